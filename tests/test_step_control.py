"""The adaptive default step, ``CVI()`` = ``CVI(step_size="auto")`` (pyro_cvi.step_control).

* With an exact -ELBO (quadrature, closed forms) the control never accepts an increase: the
  losses ``svi.step`` returns are non-increasing, on a nearly separable logistic regression
  where the fixed step 1 diverges to -ELBO ~ 1e5.
* On the models where fixed steps diverged or raised raw torch errors, the default
  reaches the optimum found by a long run at the small fixed step 0.1.
* A fixed ``step_size=b`` is today's exact behaviour (tests/test_conjugate_exact.py and the
  others run at ``step_size=1``), and a numerical failure under it is a clear error.
"""

import logging
import math
import statistics
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from step_models import MODELS

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.divergence import DivergenceError
from pyro_cvi.step_control import Snapshot, StepControl, is_numerical_error

F64 = torch.float64


def _separable():
    g = torch.Generator().manual_seed(0)
    N, D = 60, 4
    X = torch.randn(N, D, generator=g, dtype=F64)
    y = (X @ torch.tensor([3.0, -2.0, 1.0, 0.5], dtype=F64) > 0).to(F64)
    flip = torch.rand(N, generator=g, dtype=F64) < 0.03
    y = torch.where(flip, 1 - y, y)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(D), 10.0).to_event(1))
        with pyro.plate("d", N):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model, (X, y)


def _run(model, args, optim, steps, **guide_kwargs):
    guide = AutoCVI(model, init_sites="prior", **guide_kwargs)
    svi = SVI(model, guide, optim, CVI_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return [svi.step(*args) for _ in range(steps)], guide


def test_exact_neg_elbo_is_never_accepted_higher():
    model, args = _separable()
    with pytest.raises(DivergenceError, match="grew by orders of magnitude"):
        _run(model, args, CVI(step_size=1.0), 8)  # the undamped fixed-point iteration diverges
    pyro.clear_param_store()
    losses, guide = _run(model, args, CVI(), 30)
    assert guide.num_backtracks >= 2
    for a, b in zip(losses, losses[1:]):
        assert b <= a + 1e-9 * abs(a)
    pyro.clear_param_store()
    ref, _ = _run(model, args, CVI(step_size=0.25), 150)
    assert losses[-1] == pytest.approx(ref[-1], abs=1e-3)


def test_backtracks_are_logged_once_with_the_sites_and_what_to_do(caplog):
    """Undone steps are routine: counted, logged once (INFO, logger ``pyro_cvi``), no warning
    (suites that turn warnings into errors, as Pyro's does, run)."""
    model, args = _separable()
    guide = AutoCVI(model, init_sites="prior")
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    with caplog.at_level(logging.INFO, logger="pyro_cvi"), warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(6):
            svi.step(*args)
    undone = [r for r in caplog.records if "led to a worse ELBO; it was undone" in r.message]
    assert guide.num_backtracks >= 2 and len(undone) == 1
    assert "sites ['w']" in undone[0].message


def test_control_rules():
    c = StepControl()
    c.start(stochastic=False)
    assert c.beta == 1.0
    c.accepted(Snapshot({}, -10.0, None), comparable=True)
    assert c.accepts(-10.0, None, True) and not c.accepts(-10.001, None, True)
    assert not c.accepts(float("nan"), None, True) and not c.accepts(-1e9, None, True)
    assert c.accepts(-900.0, None, comparable=False)  # another minibatch: not comparable,
    assert not c.accepts(-1e9, None, comparable=False)  # but orders of magnitude: divergent
    assert not c.accepts(-1e9, 1e30, True)  # whatever the Monte Carlo variance estimate
    assert c.rejected() == 0.5 and c.num_backtracks == 1
    # Monte Carlo: a drop within two standard errors of the difference is noise
    m = StepControl()
    m.start(stochastic=True)
    assert m.beta == 0.5
    m.accepted(Snapshot({}, -10.0, 0.25), comparable=True)  # se 0.5
    assert m.accepts(-10.0 - 2 * math.sqrt(0.5) + 1e-6, 0.25, True)
    assert not m.accepts(-10.0 - 2 * math.sqrt(0.5) - 1e-3, 0.25, True)
    # a step into a region where the estimator explodes buys no wider tolerance (the
    # Bayesian regression's -ELBO went from 476 to 2.8e9 with a standard error of 1.5e9)
    assert not m.accepts(-2.8e9, 2.2e18, True)
    assert not m.accepts(-10.0 - 2 * math.sqrt(0.5) - 1e-3, 100.0, True)
    # when the accepted values stop moving beyond the noise, the ceiling decays
    for _ in range(m.patience):
        m.accepted(Snapshot({}, -10.0, 0.25), comparable=True)
    assert m.ceiling == pytest.approx(0.8)
    # after an undo, a fresh evaluation at the restored point replaces the selected one
    m.reevaluated(-11.0, 0.3)
    assert (m.snapshot.elbo, m.snapshot.var) == (-11.0, 0.3)
    # one worse Monte Carlo estimate may be noise: beta halves no lower than the floor 0.1;
    # a second in a row, or a numerical failure, goes below
    m.beta = 0.15
    assert m.rejected() == pytest.approx(0.1) and m.rejected() == pytest.approx(0.05)
    m.accepted(Snapshot({}, -11.0, 0.3), comparable=True)
    m.beta = 0.15
    assert m.rejected(numerical=True) == pytest.approx(0.075)
    assert is_numerical_error(torch.linalg.LinAlgError("linalg.solve: singular"))
    assert is_numerical_error(ValueError("Expected parameter rate ... to satisfy the constraint"))
    assert not is_numerical_error(ValueError("observed site 'y' has a non-finite value"))


def test_fixed_step_sizes_are_applied_as_given():
    model, args = _separable()
    a, _ = _run(model, args, CVI(step_size=0.5), 4)
    pyro.clear_param_store()
    b, _ = _run(model, args, CVI(step_size=lambda t: 0.5), 4)
    assert a == b
    opt = CVI(step_size=0.5)
    assert opt.step_size == 0.5 and not opt.auto
    with pytest.raises(ValueError, match="step_size must be 'auto'"):
        CVI(step_size="adaptive")


# (model, steps, reference -ELBO, tolerance). The references are the median of the last 20 of
# 300 steps at the fixed step 0.1 (the setting the issue found to work everywhere):
#   PYTHONPATH=. python - <<< see tests/step_models.py; CVI(step_size=0.1), 300 steps.
# The tolerances cover the noise of a median of 10 Monte Carlo losses at the step floor 0.1
# (HalfNormal regression: medians between 59.1 and 59.8 over 60-150 steps, two seeds); a
# diverging or stalled run is off by far more.
CASES = [
    ("eight_schools_centred", 80, 33.0, 1.0),
    ("eight_schools_noncentred", 80, 31.2, 1.0),
    ("halfnormal_regression", 60, 59.0, 1.0),
    ("baseball_pooled", 80, 56.0, 1.5),
    ("baseball_logit", 80, 53.0, 1.5),
    ("gaussian_mixture", 60, 18.3, 0.5),
    ("gamma_poisson_glm", 60, 189.7, 0.5),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, steps, ref, tol", CASES, ids=[c[0] for c in CASES])
def test_default_cvi_converges_where_fixed_steps_failed(name, steps, ref, tol):
    model, args, guide_kwargs = MODELS[name]()
    guide = AutoCVI(model, **guide_kwargs)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        losses = [svi.step(*args) for _ in range(steps)]
    assert all(math.isfinite(v) for v in losses)
    assert statistics.median(losses[-10:]) <= ref + tol


def _matrix_regression():
    g = torch.Generator().manual_seed(3)
    N, D, H = 40, 3, 2
    X = torch.randn(N, D, generator=g, dtype=F64)
    Y = X @ torch.randn(D, H, generator=g, dtype=F64)
    Y = Y + 0.5 * torch.randn(N, H, generator=g, dtype=F64)

    def model(X, Y):
        prec = pyro.sample("prec", dist.Gamma(X.new_tensor(2.0), 1.0))
        W = pyro.sample("W", dist.Normal(X.new_zeros(D, H), 1.0).to_event(2))
        with pyro.plate("n", N):
            pyro.sample("y", dist.Normal(X @ W, prec**-0.5).to_event(1), obs=Y)

    return model, X, Y


def test_matrix_weight_next_to_a_gamma_site_is_the_cavi_fixed_point():
    """A ``.to_event(2)`` weight matrix with a Gamma noise precision (a bare
    NotImplementedError from Distribution.mean): the default CVI() reaches the mean-field fixed
    point computed here by coordinate ascent (CAVI), column by column in closed form."""
    model, X, Y = _matrix_regression()
    (N, D), H = X.shape, Y.shape[1]
    a, b = 2.0 + N * H / 2, 1.0
    for _ in range(200):  # CAVI: q(W) columns N(M, S), q(prec) Gamma(a, b)
        S = torch.linalg.inv(torch.eye(D, dtype=F64) + (a / b) * X.T @ X)
        M = (a / b) * S @ X.T @ Y
        b = 1.0 + 0.5 * (((Y - X @ M) ** 2).sum() + H * torch.trace(X.T @ X @ S))
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    losses = [svi.step(X, Y) for _ in range(15)]
    assert all(math.isfinite(v) for v in losses)
    assert torch.allclose(guide.median()["W"], M, atol=1e-6)
    assert guide.num_backtracks == 0  # every factor is conjugate: no step is undone


@pytest.mark.slow
def test_bnn_with_matrix_weights_and_a_gamma_precision_runs():
    """numpyro's bnn.py in Pyro (tanh layers, ``.to_event(2)`` weights, Gamma precision): Monte
    Carlo gradients of one joint Gaussian (the remainder), no error, finite losses, and a fit
    better than the first step's."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(30, 2, generator=g, dtype=F64)
    y = torch.sin(X.sum(-1)) + 0.1 * torch.randn(30, generator=g, dtype=F64)

    def model(X, y):
        w1 = pyro.sample("w1", dist.Normal(X.new_zeros(2, 4), 1.0).to_event(2))
        w2 = pyro.sample("w2", dist.Normal(X.new_zeros(4, 1), 1.0).to_event(2))
        prec = pyro.sample("prec", dist.Gamma(X.new_tensor(3.0), 1.0))
        with pyro.plate("n", X.shape[0]):
            pyro.sample("y", dist.Normal((torch.tanh(X @ w1) @ w2)[..., 0], prec**-0.5), obs=y)

    pyro.set_rng_seed(0)
    losses, guide = _run(model, (X, y), CVI(), 15)
    assert all(math.isfinite(v) for v in losses)
    assert statistics.median(losses[-5:]) < losses[0] - 5.0
    assert "natural-gradient step of the joint Gaussian" in guide.explain()


def test_explain_names_the_fallback_sites_and_why():
    def model(y):
        s = pyro.sample("sigma", dist.Uniform(y.new_tensor(0.0), 10.0))
        t = pyro.sample("tau", dist.Gamma(y.new_tensor(2.0), 1.0))
        r = pyro.sample("rho", dist.Gamma(y.new_tensor(2.0), 1.0))
        m = pyro.sample("m", dist.Normal(y.new_tensor(0.0), t * r))
        with pyro.plate("d", len(y)):
            pyro.sample("y", dist.Normal(m, s), obs=y)

    guide = AutoCVI(model, remainder="off", families={"tau": "gaussian"})
    SVI(model, guide, CVI(), CVI_ELBO()).step(torch.randn(10, dtype=F64))
    text = guide.explain()
    fallback = "# sigma: q = gaussian (unconstrained) (natural form; no native family for Interval"
    assert fallback in text
    override = "# tau: q = gaussian (unconstrained) (natural form; user override (families=...))"
    assert override in text
    assert "# rho: q = gamma (natural form)" in text  # the native default where one exists


def test_hyperparameter_moves_do_not_undo_cvi_steps():
    """Hybrid models: the inner optimiser moves the hyperparameters between two losses, so the
    ELBO may drop for reasons that are not the CVI step. The control then checks the old q at
    the new hyperparameters and keeps the step when the old q is no better: the default
    ``CVI()`` follows the fixed ``beta = 1`` path exactly (this model's factors are exact, so
    ``beta = 1`` is the best step), where it used to undo ~half of the steps."""
    g = torch.Generator().manual_seed(0)
    N, D = 200, 5
    X = torch.randn(N, D, generator=g, dtype=F64)
    w_true = torch.tensor([2.0, -1.0, 0.5, 0.0, 1.0], dtype=F64)
    y = torch.bernoulli(torch.sigmoid(X @ w_true), generator=g)

    def model(X, y):
        s = pyro.param("prior_scale", torch.tensor(0.3, dtype=F64), dist.constraints.positive)
        w = pyro.sample("w", dist.Normal(0.0, s).expand([D]).to_event(1))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    runs = {}
    for step in ("auto", 1.0):
        pyro.clear_param_store()
        guide = AutoCVI(model)
        svi = SVI(model, guide, CVI(step, optim_args={"lr": 0.05}), CVI_ELBO())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            losses = [svi.step(X, y) for _ in range(60)]
        runs[step] = (losses, float(pyro.param("prior_scale")), guide.num_backtracks)
    (auto, s_auto, backtracks), (fixed, s_fixed, _) = runs["auto"], runs[1.0]
    assert backtracks == 0
    assert auto == pytest.approx(fixed, rel=1e-10)
    assert s_auto == pytest.approx(s_fixed, rel=1e-10) and s_auto > 0.6  # it did learn
