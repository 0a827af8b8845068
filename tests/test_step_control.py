"""The adaptive default step, ``CVI()`` = ``CVI(step_size="auto")`` (pyro_cvi.step_control).

* With an exact -ELBO (quadrature, closed forms) the control never accepts an increase: the
  losses ``svi.step`` returns are non-increasing, on a nearly separable logistic regression
  where the fixed step 1 diverges to -ELBO ~ 1e5.
* On the models where fixed steps diverged or raised raw torch errors (issue 10), the default
  reaches the optimum found by a long run at the small fixed step 0.1.
* A fixed ``step_size=b`` is today's exact behaviour (tests/test_conjugate_exact.py and the
  others run at ``step_size=1``), and a numerical failure under it is a clear error.
"""

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
    fixed, _ = _run(model, args, CVI(step_size=1.0), 8)
    assert max(fixed) > 1e3 * min(fixed)  # the undamped fixed-point iteration diverges
    pyro.clear_param_store()
    losses, guide = _run(model, args, CVI(), 30)
    assert guide.num_backtracks >= 2
    for a, b in zip(losses, losses[1:]):
        assert b <= a + 1e-9 * abs(a)
    pyro.clear_param_store()
    ref, _ = _run(model, args, CVI(step_size=0.25), 150)
    assert losses[-1] == pytest.approx(ref[-1], abs=1e-3)


def test_backtracks_are_reported_with_the_sites_and_what_to_do():
    model, args = _separable()
    guide = AutoCVI(model, init_sites="prior")
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    with pytest.warns(RuntimeWarning, match=r"sites \['w'\] led to a worse ELBO; it was undone"):
        for _ in range(6):
            svi.step(*args)


def test_control_rules():
    c = StepControl()
    c.start(stochastic=False)
    assert c.beta == 1.0
    c.accepted(Snapshot({}, -10.0, None), comparable=True)
    assert c.accepts(-10.0, None, True) and not c.accepts(-10.001, None, True)
    assert not c.accepts(float("nan"), None, True) and not c.accepts(-1e9, None, True)
    assert c.accepts(-1e9, None, comparable=False)  # another minibatch: not comparable
    assert c.rejected() == 0.5 and c.num_backtracks == 1
    # Monte Carlo: a drop within two standard errors of the difference is noise
    m = StepControl()
    m.start(stochastic=True)
    assert m.beta == 0.5
    m.accepted(Snapshot({}, -10.0, 0.25), comparable=True)  # se 0.5
    assert m.accepts(-10.0 - 2 * math.sqrt(0.5) + 1e-6, 0.25, True)
    assert not m.accepts(-10.0 - 2 * math.sqrt(0.5) - 1e-3, 0.25, True)
    # a step that blows q up makes its own estimate noisy: that noise does not excuse its drop
    # (the tolerance is the same as with the accepted point's variance)
    assert not m.accepts(-1e8, 1e16, True)
    assert not m.accepts(-10.0 - 2 * math.sqrt(0.5) - 1e-3, 1e4, True)
    # a quieter new point is judged with its own (smaller) variance
    assert m.accepts(-10.0 - 2 * math.sqrt(0.25 + 0.01) + 1e-6, 0.01, True)
    assert not m.accepts(-10.0 - 2 * math.sqrt(0.25 + 0.01) - 1e-3, 0.01, True)
    # when the accepted values stop moving beyond the noise, the ceiling decays
    for _ in range(3):
        m.accepted(Snapshot({}, -10.0, 0.25), comparable=True)
    assert m.ceiling == pytest.approx(0.8)
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
CASES = [
    ("eight_schools_centred", 80, 33.0, 1.0),
    ("eight_schools_noncentred", 80, 31.2, 1.0),
    ("halfnormal_regression", 60, 59.0, 0.5),
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
