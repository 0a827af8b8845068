"""Iterate averaging in the one-draw Horizon step (``Horizon(average=beta)``,
:mod:`pyro_cvi.natgrad.horizon`): the step draws from and moves its iterate, the guide holds
the bias-corrected exponential average ``q-bar`` of the iterates' parameters:

* ``q-bar`` is that average, recomputed here from the iterates, and ``median()`` is its mean;
* the reported loss is ``q-bar``'s bound: against an independent ``Trace_ELBO`` of the guide;
* ``average=0`` is the step without averaging: its parameters are the averaging run's iterates,
  bit for bit;
* a checkpoint round trip restores ``q-bar`` and the iterate: the resumed run is the
  uninterrupted one, bit for bit;
* a long run (slow): 20,000 steps reach the closed-form Gaussian posterior.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, Horizon, Remainder
from pyro_cvi.checkpoints.checkpoint import load_checkpoint, save_checkpoint

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
FORMS = pytest.mark.parametrize("form", ["full", "diag"])


def tanh_regression(X, y):
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    s = pyro.sample("s", dist.LogNormal(X.new_tensor(-0.5), 0.5))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(2.0 * torch.tanh(X @ w), s), obs=y)


def _tanh_data(dtype):
    g = torch.Generator().manual_seed(2)
    X = torch.randn(40, 3, generator=g, dtype=torch.float64)
    y = 2.0 * torch.tanh(X @ torch.tensor([1.0, -0.5, 0.3], dtype=torch.float64))
    y = y + 0.5 * torch.randn(40, generator=g, dtype=torch.float64)
    return X.to(dtype), y.to(dtype)


def _setup(dtype, form="full", seed=0, **rule):
    rule.setdefault("average", 0.99)
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    args = _tanh_data(dtype)
    guide = AutoCVI(tanh_regression, remainder=Remainder(covariance=form, step=Horizon(**rule)))
    optim = CVI()
    return guide, optim, SVI(tanh_regression, guide, optim, CVI_ELBO()), args


def _block(guide):
    (block,) = guide.engine.kinds["remainder"]
    return block


@DTYPES
@FORMS
def test_the_guide_holds_the_average_of_the_iterates(dtype, form):
    guide, _, svi, args = _setup(dtype, form)
    beta, sums, iterates = 0.99, None, []
    for _ in range(40):
        svi.step(*args)
        block = _block(guide)
        it = block.control.iterate
        iterates.append({k: v.double() for k, v in it.items()})
        new = iterates[-1]
        sums = {k: (1 - beta) * v for k, v in new.items()} if sums is None else {
            k: beta * sums[k] + (1 - beta) * v for k, v in new.items()
        }  # fmt: skip
    assert block.onedraw and block.control.averaging and block.vectorise
    held = block._values()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for k, v in held.items():
        expect = sums[k] / (1 - beta**40)
        assert torch.allclose(v.double(), expect, rtol=tol, atol=tol), k
    # the iterate moved away from the average, and the guide's median is the average's mean
    loc = block.loc_name
    assert float((iterates[-1][loc] - held[loc].double()).abs().max()) > 1e-3
    med = guide.median(*args)
    w = held[loc][:3] if block.names[0] == "w" else held[loc][1:]
    assert torch.allclose(med["w"], w.to(med["w"]))


@pytest.mark.slow
@DTYPES
def test_the_reported_loss_is_the_bound_of_the_averaged_guide(dtype):
    """At step 300 the reported loss (a tracked report of ``q-bar``'s bound before the step)
    against 2,000 Trace_ELBO draws of the guide, taken before that step."""
    guide, _, svi, args = _setup(dtype)
    for _ in range(299):
        svi.step(*args)
    state = torch.get_rng_state()
    with torch.no_grad():
        v = torch.tensor([Trace_ELBO().loss(tanh_regression, guide, *args) for _ in range(2000)])
    torch.set_rng_state(state)
    reported = svi.step(*args)
    est, se = float(v.mean()), float(v.double().std()) / math.sqrt(v.numel())
    # the report's own spread: about sqrt(b / 2) of one pair's, b >= B_MIN
    assert abs(reported - est) < 0.05 + 4 * se, (reported, est, se)
    assert float(v.std()) > 0.3  # (not a trivially sharp bound)


@DTYPES
@FORMS
def test_no_averaging_is_the_plain_step(dtype, form):
    """``average=0``: the guide's parameters are the step's, and they are the averaging run's
    iterates (the average changes what the guide holds and reports, never the step's draws;
    to rounding: the report's pairs are rows of the draw's batched model run)."""
    guide, _, svi, args = _setup(dtype, form, average=0.0)
    plain = []
    for _ in range(30):
        svi.step(*args)
        plain.append({k: v.clone() for k, v in _block(guide)._values().items()})
    assert _block(guide).control.iterate is None
    guide, _, svi, args = _setup(dtype, form)
    for t in range(30):
        svi.step(*args)
        it = _block(guide).control.iterate
        tol = 1e-4 if dtype == torch.float32 else 1e-10
        assert all(torch.allclose(it[k], plain[t][k], rtol=tol, atol=tol) for k in it), t


@DTYPES
def test_a_checkpoint_round_trip_restores_the_average_and_the_iterate(dtype, tmp_path):
    guide, optim, svi, args = _setup(dtype)
    for _ in range(20):
        svi.step(*args)
    save_checkpoint(tmp_path / "run.pt", optim, guide)
    uninterrupted = [svi.step(*args) for _ in range(10)]
    held = {k: v.clone() for k, v in _block(guide)._values().items()}
    it = {k: v.clone() for k, v in _block(guide).control.iterate.items()}
    guide, optim, svi, args = _setup(dtype, seed=123)
    load_checkpoint(tmp_path / "run.pt", optim, guide)
    svi = SVI(tanh_regression, guide, optim, CVI_ELBO())
    resumed = [svi.step(*args) for _ in range(10)]
    assert resumed == uninterrupted
    block = _block(guide)
    # to rounding: the resumed guide's first step checks its batched run against one run per
    # draw and steps from the latter's values
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for now, then in ((block.control.iterate, it), (block._values(), held)):
        assert all(torch.allclose(v, then[k], rtol=tol, atol=tol * 0.01) for k, v in now.items())


@DTYPES
def test_a_store_set_from_outside_restarts_the_average(dtype):
    guide, _, svi, args = _setup(dtype)
    for _ in range(10):
        svi.step(*args)
    block = _block(guide)
    with torch.no_grad():
        pyro.param(block.loc_name).zero_()
    svi.step(*args)  # the step starts from the store's values: the average restarts
    assert block.control.n_avg == 1
    it = block.control.iterate
    assert all(torch.allclose(v, it[k], rtol=1e-5, atol=0) for k, v in block._values().items())
    assert float(it[block.loc_name].abs().max()) < 1.0  # (from zero, not from the old mean)


def test_validation_and_the_default():
    with pytest.raises(ValueError, match="average"):
        Horizon(average=1.0)
    # by default the diagonal form averages, the full one does not (measured: the module's
    # docstring)
    assert Horizon().beta("diag") == 0.99 and Horizon().beta("full") == 0.0
    assert Horizon(average=0.0).beta("diag") == 0.0 and Horizon(average=0.9).beta("full") == 0.9
    for form, on in (("diag", True), ("full", False)):
        guide, _, svi, args = _setup(torch.float64, form, average=None)
        svi.step(*args)
        assert _block(guide).control.averaging is on
    # none by default where the model learns parameters beside the Gaussian (their gradient is
    # read at the iterate's draw; tests/test_hyper_gradients.py); a number is kept
    assert Horizon().beta("diag", learns=True) == 0.0
    assert Horizon(average=0.9).beta("diag", learns=True) == 0.9


def lognormal_regression(X, y):
    """``log y ~ N(X z + log s, 0.5^2)``, ``z ~ N(0, 4 I)``, ``log s ~ N(0, 1)``: a Gaussian
    posterior over ``(z, log s)``."""
    z = pyro.sample("z", dist.Normal(X.new_zeros(X.shape[1]), 2.0).to_event(1))
    s = pyro.sample("s", dist.LogNormal(X.new_tensor(0.0), 1.0))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.LogNormal(X @ z + s.log(), 0.5), obs=y)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32], ids=["f32"])
def test_twenty_thousand_averaged_steps_reach_the_exact_posterior(dtype):
    """The default diagonal form (averaging on) over 20,000 steps of a model whose posterior
    is Gaussian in ``(z, log s)``, in float32, where rounding accumulates first (~65 s in the
    suite; float64 takes the same path in the fast tests): ``q-bar``'s means are the exact
    ones, its variances the diagonal form's optimum (the conditional variances ``1 / P_ii``),
    and the last reported loss is its bound (within 0.3 nat of 2,000 Trace_ELBO draws)."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(30, 2, generator=g, dtype=torch.float64)
    y = torch.exp(
        X @ torch.tensor([0.8, -0.5], dtype=torch.float64)
        + 0.5 * torch.randn(30, generator=g, dtype=torch.float64)
    )
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    args = (X.to(dtype), y.to(dtype))
    guide = AutoCVI(lognormal_regression, remainder=Remainder(covariance="diag"))
    svi = SVI(lognormal_regression, guide, CVI(), CVI_ELBO())
    for _ in range(20_000):
        loss = svi.step(*args)
    block = _block(guide)
    assert block.onedraw and block.control.averaging and block.control.n_avg > 19_000
    # the exact posterior over (z_1, z_2, log s)
    ly = y.log()
    A = torch.cat([X, torch.ones(30, 1, dtype=torch.float64)], 1)
    P = torch.diag(torch.tensor([0.25, 0.25, 1.0], dtype=torch.float64)) + A.T @ A / 0.25
    S = torch.linalg.inv(P)
    mean = S @ (A.T @ ly / 0.25)
    perm = [0, 1, 2] if block.names[0] == "z" else [1, 2, 0]
    mean, P = mean[perm], P[perm][:, perm]
    m = block._values()[block.loc_name].double()
    sd = block._values()[block.role_names[0]].double()
    assert torch.all((m - mean).abs() < 0.05 * S.diagonal()[perm].sqrt()), (m, mean)
    assert torch.allclose(sd.pow(2), 1.0 / P.diagonal(), rtol=0.1), (sd.pow(2), 1 / P.diagonal())
    with torch.no_grad():
        est = (
            sum(
                Trace_ELBO(num_particles=100).loss(lognormal_regression, guide, *args)
                for _ in range(20)
            )
            / 20
        )
    assert abs(loss - est) < 0.3, (loss, est)
