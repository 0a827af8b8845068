"""A model that does not broadcast over a particle plate (a ``PyroModule`` network: its layers
take one weight matrix) has its draws mapped by ``torch.func.vmap``: the remainder's log joint
and the Monte Carlo expected messages of a Gamma precision beside it equal one model run per
draw, and a fit takes the mapped path."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.nn import PyroModule, PyroSample

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks import remainder_joint as rj
from pyro_cvi.blocks import remainder_rules as rb
from pyro_cvi.context import StepContext
from pyro_cvi.messages import precision as pm


class Net(PyroModule):
    def __init__(self, dtype):
        super().__init__()
        zero = torch.zeros((), dtype=dtype)
        self.l1 = PyroModule[torch.nn.Linear](1, 5)
        self.l1.weight = PyroSample(dist.Normal(zero, 1.0).expand([5, 1]).to_event(2))
        self.l1.bias = PyroSample(dist.Normal(zero, 1.0).expand([5]).to_event(1))
        self.l2 = PyroModule[torch.nn.Linear](5, 5, bias=False)
        self.l2.weight = PyroSample(dist.Normal(zero, 1.0).expand([5, 5]).to_event(2))
        self.l3 = PyroModule[torch.nn.Linear](5, 1, bias=False)
        self.l3.weight = PyroSample(dist.Normal(zero, 1.0).expand([1, 5]).to_event(2))

    def forward(self, x, y=None):
        mean = self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x))))).squeeze(-1)
        prec = pyro.sample("prec", dist.Gamma(x.new_tensor(3.0), x.new_tensor(1.0)))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, prec**-0.5), obs=y)


def _data(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.linspace(-1, 1, 30, dtype=dtype)[:, None]
    y = torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(30, generator=g, dtype=dtype)
    return x, y


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mapped_draws_equal_one_run_per_draw(dtype):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, (x, y) = Net(dtype), _data(dtype)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    for _ in range(3):
        svi.step(x, y)
    an = guide.engine.analysis
    assert set(an.precisions) == {"prec"}
    (block,) = [b for b in guide.engine.blocks if b.kind == "remainder"]
    # a network's log joint is vectorised (a short span): Price's Hessians stay the default
    assert rb.log_joint_span(an, block.owned) <= rb.VECTORISED_MAX_SPAN and block.hessian
    # the fit took the mapped path for both (the particle plate fails on nn.Linear)
    assert block.vectorise is rj._vmapped
    assert pm._VECTORISE[an] is pm._vmapped
    ctx = guide.engine.context((x, y), {}, {}, grads=False)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-9)
    u = torch.randn(5, block.dim, dtype=dtype)
    others = {"prec": torch.tensor(2.5, dtype=dtype)}
    mapped = rj._vmapped(block, ctx, u, others)
    looped = rj._looped(block, ctx, u, others)
    assert mapped.shape == (5,)
    torch.testing.assert_close(mapped, looped, **tol)
    # and its gradient in the draws (the Price / one-draw messages differentiate it)
    v = u.clone().requires_grad_(True)
    (g1,) = torch.autograd.grad(rj._vmapped(block, ctx, v, others).sum(), v)
    (g2,) = torch.autograd.grad(rj._looped(block, ctx, v, others).sum(), v)
    torch.testing.assert_close(g1, g2, **tol)
    # the precision's expected natural parameters over the same draws
    draws = [ctx.sample_q() for _ in range(6)]
    a1, b1 = pm._vmapped(ctx, an, "prec", ["obs"], draws)
    a2, b2 = pm._looped(ctx, an, "prec", ["obs"], draws)
    torch.testing.assert_close(a1, a2, **tol)
    torch.testing.assert_close(b1, b2, **tol)
    # independently: sum 1/2 over the 30 points, and -E[(y - loc)^2] / 2 by hand
    assert float(a1) == pytest.approx(15.0, rel=1e-5)
    sq = []
    for d in draws:
        h = torch.tanh(torch.tanh(x @ d["l1.weight"].T + d["l1.bias"]) @ d["l2.weight"].T)
        sq.append(((y - (h @ d["l3.weight"].T).squeeze(-1)) ** 2).sum())
    assert float(b1) == pytest.approx(float(-0.5 * torch.stack(sq).mean()), rel=1e-4)


def test_a_model_drawing_its_own_noise_runs_one_draw_at_a_time():
    """A model with randomness of its own is refused by the map (``randomness="error"``)."""

    def model(y):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=y.dtype), 1.0).to_event(1))
        jitter = 0.0 * torch.randn(())
        loc = torch.nn.functional.linear(w[None, :], torch.ones(1, 2, dtype=y.dtype))[0, 0]
        s = pyro.sample("s", dist.LogNormal(y.new_tensor(0.0), 1.0))
        with pyro.plate("data", y.shape[0]):
            pyro.sample("obs", dist.StudentT(4.0, loc + jitter, s), obs=y)

    y = torch.randn(10, dtype=torch.float64)
    pyro.clear_param_store()
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    svi.step(y)
    (block,) = [b for b in guide.engine.blocks if b.kind == "remainder"]
    ctx = StepContext(model, (y,), {}, {}, grads=False)
    with pytest.raises(RuntimeError):
        rj._vmapped(block, ctx, torch.randn(3, block.dim, dtype=torch.float64), {})
    assert block.vectorise is not rj._vmapped
