"""The loss that ``svi.step`` returns is the current ``q``'s bound, at any step count: after 300
default steps on a recursion model (the remainder's one-draw step) it equals an independent
``Trace_ELBO`` estimate of the same guide within 1 nat or 1%."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI


def arma(y):
    """ARMA(1,1) by its innovations recursion, written as a Python loop."""
    mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 1.0))
    phi = pyro.sample("phi", dist.Uniform(y.new_tensor(-1.0), 1.0))
    theta = pyro.sample("theta", dist.Uniform(y.new_tensor(-1.0), 1.0))
    sigma = pyro.sample("sigma", dist.LogNormal(y.new_tensor(-1.0), 1.0))
    errs, prev_e, prev_y = [], 0.0 * mu, mu
    for t in range(y.shape[0]):
        e = y[t] - (mu + phi * (prev_y - mu) + theta * prev_e)
        errs.append(e)
        prev_e, prev_y = e, y[t]
    with pyro.plate("time", y.shape[0]):
        pyro.sample("e", dist.Normal(0.0, sigma), obs=torch.stack(errs, -1))


def _data(dtype):
    g = torch.Generator().manual_seed(4)
    y, e_prev, y_prev = [], 0.0, 0.5
    for _ in range(100):
        e = 0.3 * float(torch.randn((), generator=g, dtype=torch.float64))
        yt = 0.5 + 0.6 * (y_prev - 0.5) + 0.3 * e_prev + e
        y.append(yt)
        e_prev, y_prev = e, yt
    return torch.tensor(y, dtype=dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_loss_after_300_steps_is_the_bound(dtype):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    y = _data(dtype)
    guide = AutoCVI(arma)
    svi = SVI(arma, guide, CVI(), CVI_ELBO())
    losses = [svi.step(y) for _ in range(300)]
    (block,) = [b for b in guide.engine.blocks if b.kind == "remainder"]
    assert block.onedraw and not block.hessian  # the default on a recursion: one draw a step
    with torch.no_grad():
        est = sum(Trace_ELBO(num_particles=200).loss(arma, guide, y) for _ in range(5)) / 5
    assert abs(losses[-1] - est) <= max(1.0, 0.01 * abs(est)), (losses[-1], est)
    # and it is no trajectory average: the first losses are far above the bound
    assert losses[0] > est + 5.0
