"""Two ``CVI()`` optimizers in one process (two ``SVI`` objects, steps interleaved) share
the observer of :mod:`pyro_cvi.natgrad.observe`: each sees only its own guide's sites and its
own loss runs, whatever the order of the losses and the steps."""

from __future__ import annotations

import pyro
import pyro.poutine as poutine
import pytest
import torch
from conjugate_guide_cases import BY_NAME, within
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.util import zero_grads

from pyro_cvi import CVI
from pyro_cvi.natgrad.observe import current

DTYPES = [torch.float32, torch.float64]
# the same site name ("mu") in both guides, different parameters and data
A, B = BY_NAME["normal-normal-positive"], BY_NAME["normal-normal-logscale"]


def _data(dtype):
    (y,) = A.data(dtype)
    return (y,), (y - 3.0,)


def _loss_and_params(loss, pair, data):
    with poutine.trace(param_only=True) as tr:
        value = loss.loss_and_grads(pair.model, pair.guide, *data)
    return value, [s["value"].unconstrained() for s in tr.trace.nodes.values()]


@pytest.mark.parametrize("order", ["svi", "losses-first"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_two_interleaved_cvi_optimizers_reach_their_own_posteriors(dtype, order):
    """``svi_a.step, svi_b.step`` in turn, or both losses before both optimizer steps: each
    guide reaches its own closed form (Pyro's tolerance), and each optimizer found only its
    own guide's site."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    da, db = _data(dtype)
    ca, cb = CVI(), CVI()
    la, lb = Trace_ELBO(), Trace_ELBO()
    svi_a, svi_b = SVI(A.model, A.guide, ca, la), SVI(B.model, B.guide, cb, lb)
    for _ in range(150):
        if order == "svi":
            svi_a.step(*da)
            svi_b.step(*db)
        else:
            _, pa = _loss_and_params(la, A, da)
            _, pb = _loss_and_params(lb, B, db)
            ca(pa)
            cb(pb)
            zero_grads(set(pa) | set(pb))
    assert within(A, da) and within(B, db), (A.errors(da), B.errors(db))
    names_a = {n for g in ca.gaussians.site_groups.values() for _, n in g.names}
    names_b = {n for g in cb.gaussians.site_groups.values() for _, n in g.names}
    assert names_a == {"positive_loc", "positive_scale"}
    assert names_b == {"logscale_loc", "logscale_log_scale"}


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_each_optimizer_gets_its_own_loss_estimate(dtype):
    """Both losses run before either step: the observer's ``-ELBO`` estimate for each
    optimizer's parameters is that loss's own value (Trace_ELBO's, the same draw)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    da, db = _data(dtype)
    ca, cb = CVI(), CVI()
    la, lb = Trace_ELBO(), Trace_ELBO()
    SVI(A.model, A.guide, ca, la).step(*da)  # parameters exist; one step each
    SVI(B.model, B.guide, cb, lb).step(*db)
    obs = current()
    assert obs is not None
    value_a, pa = _loss_and_params(la, A, da)
    value_b, pb = _loss_and_params(lb, B, db)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    estimate_b = obs.take_loss(pb)
    estimate_a = obs.take_loss(pa)
    assert estimate_a == pytest.approx(value_a, rel=tol)
    assert estimate_b == pytest.approx(value_b, rel=tol)
    assert abs(value_a - value_b) > 1.0  # (different losses: a swap would be seen)
    assert not obs.log and obs.take_loss(pa) is None
    zero_grads(set(pa) | set(pb))
