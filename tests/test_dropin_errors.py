"""``CVI()`` on Pyro's Gaussian guides: a draw of ``q`` that the model cannot evaluate (a
latent value that is not finite or is outside its prior's support) is refused with
``DivergenceError`` naming the site, before torch raises its own constraint error, and the last
natural-gradient step is undone bit for bit; a skipped non-finite loss warns."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer import autoguide as ag
from zoo import ZOO

from pyro_cvi import CVI, DivergenceError

DTYPES = [torch.float32, torch.float64]


def _raw(guide_name: str) -> dict:
    """The raw (unconstrained) values of the guide's parameters, cloned."""
    store = pyro.get_param_store()
    return {
        n: store[n].unconstrained().detach().clone()
        for n in store.keys()
        if n.startswith(guide_name)
    }


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_lkj_lowrank_fixed_step_names_the_site_and_undoes_the_step(dtype):
    """The zoo's LKJ model under AutoLowRankMultivariateNormal and a fixed step 0.5: the first
    step moves the mean of the HalfCauchy scales' log by thousands (exp overflows), and torch
    used to raise ``Expected parameter scale_tril ... to satisfy the constraint`` at the next
    loss. Now: DivergenceError names ``theta``, the guide holds the q before that step bit for
    bit, and it is usable (a finite loss from it)."""
    entry = ZOO["lkj_mvn"]
    model, _ = entry.build(dtype)
    data = entry.data(dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    ag.AutoLowRankMultivariateNormal(model)(*data.args)
    snapshots = [_raw("AutoLowRank")]  # the initial q (the same draws set it up below)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = ag.AutoLowRankMultivariateNormal(model)
    svi = SVI(model, guide, CVI(step_size=0.5), Trace_ELBO())
    svi.step(*data.args)
    assert _same(snapshots[0], _raw("AutoLowRank")) is False  # the first step moved q
    with pytest.raises(DivergenceError, match="latent site 'theta' that is not finite"):
        svi.step(*data.args)
    assert _same(_raw("AutoLowRank"), snapshots[0])  # the step was undone, bit for bit
    with torch.no_grad():
        assert math.isfinite(svi.evaluate_loss(*data.args))


def _positive_model(y):
    w = pyro.sample("w", dist.Gamma(y.new_tensor(2.0), y.new_tensor(1.0)))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Exponential(w), obs=y)


def _stepped(dtype, guide_cls):
    """A Gamma-Exponential model, one ``CVI()`` step taken: ``(svi, y, q before the step,
    q after it)``."""
    y = torch.tensor([0.5, 1.5, 0.8, 2.0], dtype=dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    guide = guide_cls(_positive_model)
    guide(y)
    before = _raw(guide_cls.__name__)
    svi = SVI(_positive_model, guide, CVI(step_size=0.5), Trace_ELBO())
    svi.step(y)
    after = _raw(guide_cls.__name__)
    assert not _same(after, before)
    return svi, y, before, after


def _set_loc(guide_name: str, value: float) -> None:
    """A step gone wrong: the mean of the guide's one latent (log w) set to ``value``."""
    store = pyro.get_param_store()
    name = next(n for n in store.keys() if n.startswith(guide_name) and ".loc" in n)
    with torch.no_grad():
        store[name].unconstrained().fill_(value)


@pytest.mark.parametrize("guide_cls", [ag.AutoNormal, ag.AutoMultivariateNormal])
@pytest.mark.parametrize(
    "loc,why",
    [(1e4, "is not finite"), (-1e4, r"is outside the support of its prior \(GreaterThan")],
    ids=["overflow", "underflow"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_a_draw_outside_the_support_is_refused(dtype, guide_cls, loc, why):
    """``log w`` at +-1e4: ``w = exp(log w)`` is ``inf`` (not finite) or ``0`` (outside the
    image ``(0, inf)`` of the guide's map onto the Gamma prior's support) in both dtypes;
    without the check torch raises its own constraint error in the Exponential likelihood.
    The error names ``w``; the guide is back at the q before the last step, bit for bit; the
    next step runs from it."""
    svi, y, before, _ = _stepped(dtype, guide_cls)
    _set_loc(guide_cls.__name__, loc)
    with pytest.raises(DivergenceError, match=f"latent site 'w' that {why}") as info:
        svi.step(y)
    assert "was undone" in str(info.value) and "Fixes:" in str(info.value)
    assert _same(_raw(guide_cls.__name__), before)
    assert math.isfinite(svi.step(y))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_a_refused_draw_leaves_another_optimizers_guide_alone(dtype):
    """Two ``SVI`` objects with their own ``CVI()``: a refused draw of the first guide undoes
    only the first optimizer's step; the second guide and its next step are untouched."""
    y = torch.tensor([0.5, 1.5, 0.8, 2.0], dtype=dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(2)

    def model_b(y):
        m = pyro.sample("m", dist.Normal(y.new_tensor(0.0), 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("obs_b", dist.Normal(m, 1.0), obs=y)

    guide_a = ag.AutoNormal(_positive_model)
    guide_b = ag.AutoDiagonalNormal(model_b)
    svi_a = SVI(_positive_model, guide_a, CVI(step_size=0.5), Trace_ELBO())
    svi_b = SVI(model_b, guide_b, CVI(step_size=0.5), Trace_ELBO())
    svi_a.step(y)
    svi_b.step(y)
    b_after = _raw("AutoDiagonalNormal")
    _set_loc("AutoNormal", 1e4)
    with pytest.raises(DivergenceError, match="latent site 'w'"):
        svi_a.step(y)
    assert _same(_raw("AutoDiagonalNormal"), b_after)
    assert math.isfinite(svi_b.step(y))
    assert not _same(_raw("AutoDiagonalNormal"), b_after)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_a_skipped_non_finite_loss_warns_and_keeps_q(dtype):
    """An observation of ``inf`` after a step: the loss is not finite, the divergence guard
    skips the step (the guide bit for bit), and a RuntimeWarning says so (never a silent
    non-finite loss); the next ordinary loss steps again."""
    svi, y, _, after = _stepped(dtype, ag.AutoNormal)
    bad = y.clone()
    bad[0] = math.inf
    with pytest.warns(RuntimeWarning, match=r"this step was skipped \(its loss is (inf|nan)"):
        loss = svi.step(bad)
    assert not math.isfinite(loss)
    assert _same(_raw("AutoNormal"), after)
    assert math.isfinite(svi.step(y))
    assert not _same(_raw("AutoNormal"), after)


def _loss_and_grads(elbo, model, guide, *args):
    """One loss of a hand-written loop: ``(loss, the raw parameters it touched)``."""
    with pyro.poutine.trace(param_only=True) as tr:
        loss = elbo.loss_and_grads(model, guide, *args)
    return loss, [s["value"].unconstrained() for s in tr.trace.nodes.values()]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_non_finite_gradients_skip_the_step_and_three_in_a_row_raise(dtype):
    """A finite loss whose gradients are not finite (a draw on the edge of a support: the
    lda model in float32): the whole step is skipped with a warning (the Gaussians and the
    inner optimizer's parameter bit for bit); the third such step in a row raises
    DivergenceError naming the parameter; an ordinary step then runs."""

    def model(y):
        w = pyro.sample("w", dist.Gamma(y.new_tensor(2.0), y.new_tensor(1.0)))
        shift = pyro.param("shift", y.new_tensor(0.0))  # (the inner optimizer's)
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Exponential(w), obs=y * shift.exp())

    y = torch.tensor([0.5, 1.5, 0.8, 2.0], dtype=dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(3)
    guide = ag.AutoNormal(model)
    optim, elbo = CVI(step_size=0.5), Trace_ELBO()
    _, params = _loss_and_grads(elbo, model, guide, y)
    optim(params)
    for p in params:
        p.grad = None
    before = {n: v.unconstrained().detach().clone() for n, v in pyro.get_param_store().items()}
    for k in range(3):
        loss, params = _loss_and_grads(elbo, model, guide, y)
        assert math.isfinite(loss)
        pyro.get_param_store()["AutoNormal.locs.w"].unconstrained().grad.fill_(math.nan)
        if k < 2:
            with pytest.warns(RuntimeWarning, match=r"skipped \(the gradients of \['AutoNormal"):
                optim(params)
        else:
            with pytest.raises(DivergenceError, match="not finite 3 steps in a row"):
                optim(params)
        now = pyro.get_param_store()
        assert all(torch.equal(now[n].unconstrained(), v) for n, v in before.items())
        assert all(p.grad is None for p in params)
    _, params = _loss_and_grads(elbo, model, guide, y)
    optim(params)
    now = pyro.get_param_store()
    assert all(not torch.equal(now[n].unconstrained(), v) for n, v in before.items())
