"""``MarkovBlock``'s offsets ``c = eta_at - h' x_at`` are built once per unchanged trace.

A static model reuses them step after step (counted), and the fit is bitwise the one that
rebuilds them every step; an in-place edit of the data, of the site's tensors or of ``z_at``,
and a changed kernel hyperparameter still give the exact new answer: a Normal likelihood
with an offset is conjugate, so one step at ``step_size=1`` is the dense GP posterior."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks import MarkovBlock
from pyro_cvi.model.tracing import unwrap
from pyro_cvi.statespace import Matern32, markov_gp

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
T, NOISE = 30, 0.5


def tol(dtype):
    return 1e-10 if dtype == torch.float64 else 2e-4


def offset_model(ls):
    def model(t, y, off):
        f = markov_gp("x", t, Matern32(lengthscale=ls, variance=1.0))
        with pyro.plate("t", len(t)):
            pyro.sample("y", dist.Normal(f + off, NOISE), obs=y)

    return model


def dense(t, y, off, ls):
    """The GP posterior of ``f`` and the evidence, from the dense kernel matrix (float64)."""
    t, y, off = t.double(), y.double(), off.double()
    K = Matern32(lengthscale=float(ls), variance=1.0).covariance(t, t)
    S = K + NOISE**2 * torch.eye(len(t), dtype=torch.float64)
    mean = K @ torch.linalg.solve(S, y - off)
    var = (K - K @ torch.linalg.solve(S, K)).diagonal()
    return mean, var, dist.MultivariateNormal(off, S).log_prob(y)


@DTYPES
def test_edits_between_steps_give_the_exact_new_posterior(dtype):
    """In-place edits of the offset data and of the lengthscale between steps: every step is
    the dense posterior of the current data and kernel, and ``-ELBO = -log p(y)``."""
    pyro.clear_param_store()
    t = torch.arange(T, dtype=dtype)
    y, off = torch.sin(t / 4), torch.linspace(-1.0, 1.0, T, dtype=dtype)
    ls = torch.tensor(5.0, dtype=dtype)
    model = offset_model(ls)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    for edit in (None, lambda: off.add_(0.3), lambda: ls.fill_(8.0), lambda: y.mul_(-0.5), None):
        if edit is not None:
            edit()
        svi.step(t, y, off)
        loss = CVI_ELBO().loss(model, guide, t, y, off)
        q = guide.posterior("x")
        mean, var, evidence = dense(t, y, off, ls)
        assert torch.allclose(q.mean[:, 0].double(), mean, rtol=0, atol=tol(dtype))
        assert torch.allclose(q.variance[:, 0].double(), var, rtol=0, atol=tol(dtype))
        assert abs(loss + evidence.item()) < (1e-8 if dtype == torch.float64 else 2e-3)


def fit(dtype, learn: bool, steps: int = 6):
    t = torch.arange(40, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    y = torch.poisson(torch.exp(torch.sin(t.double() / 6.0)), generator=g).to(dtype)

    def model(t, y):
        if learn:
            pos = dist.constraints.positive
            ls = pyro.param("ls", torch.tensor(5.0, dtype=dtype), constraint=pos)
            kernel = Matern32(ls, pyro.param("s2", torch.tensor(1.0, dtype=dtype), constraint=pos))
        else:
            kernel = Matern32(lengthscale=5.0, variance=1.0)
        f = markov_gp("x", t, kernel)
        with pyro.plate("t", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    losses = torch.tensor([svi.step(t, y) for _ in range(steps)], dtype=torch.float64)
    q = guide.posterior("x")
    (block,) = guide.engine.blocks
    return (losses, q.mean, q.variance), block.offset_builds


@DTYPES
@pytest.mark.parametrize("learn", [False, True], ids=["static", "learned-kernel"])
def test_reused_offsets_fit_bitwise_as_rebuilt_ones(dtype, learn, monkeypatch):
    """Poisson counts, 6 steps: a static model builds its offsets once; with a learned
    kernel (a fresh trace each step) they are rebuilt each step; either way the -ELBOs and ``q`` are
    bitwise those of a block that rebuilds every time."""
    cached, builds = fit(dtype, learn)
    assert builds == (1 + 6 if learn else 1)  # (learned: the set-up's trace, then each step's)
    offset = MarkovBlock._offset

    def rebuilt(self, *a, **k):
        self._offsets.clear()
        return offset(self, *a, **k)

    monkeypatch.setattr(MarkovBlock, "_offset", rebuilt)
    fresh, builds_fresh = fit(dtype, learn)
    assert builds_fresh > builds
    for a, b in zip(cached, fresh):
        assert torch.equal(a, b)


@DTYPES
def test_in_place_edits_of_the_site_or_the_point_rebuild_the_offsets(dtype):
    """On one trace: the same site reuses its offsets; an in-place edit of the site's mean
    or of ``z_at`` rebuilds them, to ``c = loc - f_at``."""
    pyro.clear_param_store()
    t = torch.arange(T, dtype=dtype)
    y, off = torch.sin(t / 4), torch.linspace(-1.0, 1.0, T, dtype=dtype)
    model = offset_model(5.0)
    guide = AutoCVI(model)
    SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO()).step(t, y, off)
    (block,) = guide.engine.blocks
    (f,) = block.linear
    at = block.spec.split(block.z_at)
    node = pyro.poutine.trace(pyro.poutine.condition(model, at)).get_trace(t, y, off).nodes["y"]
    loc = unwrap(node["fn"])[0].loc

    def expected():
        return loc - block.chain.states(block.z_at)[:, 0]

    builds = block.offset_builds
    c = block._offset(node, f)
    assert block.offset_builds == builds + 1
    assert torch.allclose(c, expected(), rtol=0, atol=tol(dtype))
    assert block._offset(node, f) is c and block.offset_builds == builds + 1
    loc.add_(0.25)
    c2 = block._offset(node, f)
    assert block.offset_builds == builds + 2
    assert torch.allclose(c2, expected(), rtol=0, atol=tol(dtype))
    assert torch.allclose(c2 - c, torch.full_like(c, 0.25), rtol=0, atol=tol(dtype))
    block.z_at.add_(0.5)  # (f_at moves with z_at; loc, traced before, does not)
    c3 = block._offset(node, f)
    assert block.offset_builds == builds + 3
    assert torch.allclose(c3, expected(), rtol=0, atol=tol(dtype))
    assert torch.allclose(c2 - c3, torch.full_like(c, 0.5), rtol=0, atol=tol(dtype))
