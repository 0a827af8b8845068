"""``guide.check_bound()``: the reported loss against ``Trace_ELBO`` over the same guide.

The check must agree where the guide is right (conjugate models, against the closed-form
``-log p(y)`` too; every zoo model), must fail by name where the reported loss or the sampled
``q`` is wrong (guides that misreport on purpose), and must leave ``q`` and the random stream
as they were.
"""

import math
import sys
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, AutoStructuredCVI
from pyro_cvi.methods.bound_check import BoundCheck, BoundMismatchWarning

DTYPES = [torch.float64, torch.float32]


def normal_model(y):
    mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 2.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(mu, 0.5), obs=y)


def log_evidence(y):
    """``log p(y)``: ``y ~ N(0, 0.25 I + 4 1 1^T)``."""
    n = len(y)
    cov = 0.25 * torch.eye(n, dtype=torch.float64) + 4.0 * torch.ones(n, n, dtype=torch.float64)
    return float(dist.MultivariateNormal(torch.zeros(n, dtype=torch.float64), cov).log_prob(y))


def logistic_model(x, y):
    w = pyro.sample("w", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def _data(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 2, generator=g, dtype=dtype)
    y = (x[:, 0] - x[:, 1] + 0.5 * torch.randn(40, generator=g, dtype=dtype) > 0).to(dtype)
    return x, y


def _fit(model, guide, args, steps=5):
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    for _ in range(steps):
        svi.step(*args)
    return svi


class Misreporting(AutoCVI):
    """An AutoCVI whose reported ELBO is off by ``offset`` nats (a silent wrong loss)."""

    offset = 0.5

    def elbo(self, args, kwargs, grads=False, graph=False):
        return super().elbo(args, kwargs, grads, graph) + self.offset


@pytest.mark.parametrize("dtype", DTYPES)
def test_agrees_on_a_conjugate_model_whose_loss_is_exact(dtype):
    y = torch.tensor([0.3, -0.2, 1.1, 0.7, 0.4], dtype=dtype)
    guide = AutoCVI(normal_model)
    _fit(normal_model, guide, (y,), steps=2)
    result = guide.check_bound(y, num_particles=600)
    assert isinstance(result, BoundCheck)
    assert result.reported_se == 0.0  # exact: two evaluations are equal
    # q is the exact posterior: the loss is -log p(y), an independent closed form
    tol = 1e-9 if dtype == torch.float64 else 1e-4
    assert result.reported == pytest.approx(-log_evidence(y.double()), abs=tol)
    assert result.agrees, result
    assert abs(result.z) <= 3.0 or result.se < 1e-6  # (an exact bound: Trace_ELBO is flat too)
    assert result.num_particles == 600


@pytest.mark.parametrize("dtype", DTYPES)
def test_agrees_on_a_logistic_regression(dtype):
    args = _data(dtype)
    guide = AutoCVI(logistic_model)
    _fit(logistic_model, guide, args)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BoundMismatchWarning)
        result = guide.check_bound(*args, num_particles=600)
    assert result.agrees, result
    assert 0 < result.se < 0.1  # 600 draws of a 40-point bound
    assert abs(result.reported - result.estimate) <= 3 * result.se


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_misreported_loss_is_found_and_named(dtype):
    args = _data(dtype)
    guide = Misreporting(logistic_model)
    _fit(logistic_model, guide, args)
    with pytest.warns(BoundMismatchWarning, match="Misreporting.*not the -ELBO"):
        result = guide.check_bound(*args, num_particles=400)
    assert not result.agrees
    # the reported -ELBO is 0.5 below the bound; the check sees the offset
    assert result.reported - result.estimate == pytest.approx(-0.5, abs=5 * result.se)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = guide.check_bound(*args, num_particles=200, warn=False)
    assert not quiet.agrees


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_guide_that_samples_another_q_is_found(dtype):
    """The loss is right for the engine's q, but the guide draws ``mu`` shifted by one sd."""

    class Shifted(AutoCVI):
        def forward(self, *args, **kwargs):
            from pyro import poutine

            q = self._ready(args, kwargs).block_for("mu").marginal("mu")
            shift = q.stddev.detach()
            with poutine.block():
                super().forward(*args, **kwargs)
            return {"mu": pyro.sample("mu", dist.Normal(q.mean.detach() + shift, shift))}

    y = torch.tensor([0.3, -0.2, 1.1, 0.7, 0.4], dtype=dtype)
    guide = Shifted(normal_model)
    _fit(normal_model, guide, (y,), steps=2)
    with pytest.warns(BoundMismatchWarning):
        result = guide.check_bound(y, num_particles=400)
    # E_q'[-log p + log q'] - E_q[...] = KL(q' || q) = 1/2 for a one-sd shift
    assert result.estimate - result.reported == pytest.approx(0.5, abs=5 * result.se + 1e-3)


def test_q_and_the_random_stream_are_unchanged():
    args = _data(torch.float64)
    guide = AutoCVI(logistic_model)
    _fit(logistic_model, guide, args)
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    state = torch.get_rng_state()
    guide.check_bound(*args, num_particles=200)
    after = torch.randn(3)
    torch.set_rng_state(state)
    assert torch.equal(after, torch.randn(3))
    for k, v in pyro.get_param_store().items():
        assert torch.equal(v.detach(), before[k]), k
    # and the next step is the one it would have been
    assert set(pyro.get_param_store().keys()) == set(before)


def test_check_at_setup_warns_at_the_first_step_and_is_off_by_default():
    args = _data(torch.float64)
    with pytest.warns(BoundMismatchWarning):
        _fit(logistic_model, Misreporting(logistic_model, check_at_setup=400), args, steps=1)
    pyro.clear_param_store()
    with warnings.catch_warnings():
        warnings.simplefilter("error", BoundMismatchWarning)
        _fit(logistic_model, Misreporting(logistic_model), args, steps=1)  # default: no check
    pyro.clear_param_store()
    with warnings.catch_warnings():
        warnings.simplefilter("error", BoundMismatchWarning)
        _fit(logistic_model, AutoCVI(logistic_model, check_at_setup=400), args, steps=2)


@pytest.mark.parametrize("bad", [1, -3, 2.5, True, "yes"])
def test_check_at_setup_refuses_bad_values(bad):
    with pytest.raises(ValueError, match="check_at_setup"):
        AutoCVI(logistic_model, check_at_setup=bad)


def test_bad_arguments_are_named():
    args = _data(torch.float64)
    guide = AutoCVI(logistic_model)
    _fit(logistic_model, guide, args, steps=1)
    with pytest.raises(ValueError, match="num_particles"):
        guide.check_bound(*args, num_particles=1)
    with pytest.raises(ValueError, match="tolerance"):
        guide.check_bound(*args, tolerance=0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_collapsed_guide_is_checked_against_trace_enum_elbo(dtype):
    """``discrete="collapse"``: the guide has no site for ``c``; the referee sums it out."""

    def mixture(x):
        w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), 3.0))
        with pyro.plate("data", len(x)):
            c = pyro.sample("c", dist.Bernoulli(x.new_tensor(0.3)))
            pyro.sample("x", dist.Normal(w * c, 1.0), obs=x)

    x = torch.tensor([0.1, 3.9, 4.2, -0.3, 4.4, 0.2], dtype=dtype)
    guide = AutoCVI(mixture, discrete="collapse")
    _fit(mixture, guide, (x,), steps=10)
    result = guide.check_bound(x, num_particles=200)
    assert result.agrees, result
    bad = _as(guide, Misreporting)
    bad.offset = 20 * result.se + 0.5  # (the loss here is itself an estimate: a wider miss)
    with pytest.warns(BoundMismatchWarning):
        assert not bad.check_bound(x, num_particles=200).agrees


def _as(guide, cls):
    """The same guide object seen as ``cls`` (a subclass of its class)."""
    guide.__class__ = cls
    return guide


def test_the_structured_guide_has_it_too():
    def hierarchical(y):
        mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 3.0))
        with pyro.plate("groups", y.shape[0]):
            theta = pyro.sample("theta", dist.Normal(mu, 1.0))
            with pyro.plate("obs", y.shape[1]):
                pyro.sample("y", dist.Normal(theta, 1.0), obs=y.T)

    y = torch.randn(6, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    guide = AutoStructuredCVI(hierarchical)
    _fit(hierarchical, guide, (y,), steps=5)
    result = guide.check_bound(y, num_particles=400)
    assert result.agrees, result


# ------------------------------------------------------------------------------------------------
# every zoo model
# ------------------------------------------------------------------------------------------------
sys.path.insert(0, str(Path(__file__).parent))
from zoo import ZOO  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(ZOO))
def test_every_zoo_model_reports_its_bound(name, dtype):
    """Five default steps, then 400 Trace_ELBO draws against the reported loss (five combined
    standard errors: 66 cases, a real mismatch is tens of standard errors)."""
    entry = ZOO[name]
    pyro.set_rng_seed(0)
    model, kwargs = entry.build(dtype)
    data = entry.data(dtype)
    guide = AutoCVI(model, **kwargs)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    for _ in range(min(entry.steps, 5)):
        svi.step(*data.args, **data.kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BoundMismatchWarning)
        result = guide.check_bound(*data.args, num_particles=400, tolerance=5.0, **data.kwargs)
    assert math.isfinite(result.estimate), result
    assert result.agrees, result


def test_a_monte_carlo_reported_loss_keeps_float64():
    """A float64 model whose reported loss is a Monte Carlo estimate (a general site): the
    repeats are averaged in float64, so the reported value is not rounded to float32."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    y = (torch.linspace(-1.0, 1.0, 10, dtype=torch.float64) > 0.0).double()

    def model(y):
        z = pyro.sample("z", dist.Normal(y.new_tensor(0.0), 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("x", dist.Bernoulli(probs=torch.round(z).clamp(0.2, 0.8)), obs=y)

    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    losses = [svi.step(y) for _ in range(30)]
    check = guide.check_bound(y, num_particles=400, warn=False)
    # every draw of this q rounds z to the same integer: the loss and the estimate are exact
    assert check.reported_se < 1e-12
    assert abs(check.reported - check.estimate) < 1e-10
    assert abs(check.reported - losses[-1]) < 1e-10
