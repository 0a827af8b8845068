"""Several starts scored by the bound (``pyro_cvi.methods.restarts``): on a posterior with two
modes of known masses the fit in the heavier mode is kept, and the two fits' bounds differ by
the log of the modes' mass ratio (brute force on a grid)."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.infer.autoguide.initialization import init_to_value
from pyro.optim import Adam

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.methods.restarts import best_of_starts

DTYPES = [torch.float32, torch.float64]
N, NOISE, W, W_SCALE, PRIOR = 40, 0.5, 1.0, 3.0, 2.0


def _data(dtype):
    g = torch.Generator().manual_seed(0)
    y = 4.0 + NOISE * torch.randn(N, generator=g, dtype=torch.float64)
    return y.to(dtype), torch.tensor(W, dtype=dtype)


def model(y, w):
    """``y_n ~ N(z^2, 0.5)``: modes near ``z = +-2``; ``w ~ N(z, 3)`` at 1 makes ``+2`` heavier."""
    z = pyro.sample("z", dist.Normal(y.new_tensor(0.0), PRIOR))
    with pyro.plate("n", y.shape[0]):
        pyro.sample("y", dist.Normal(z * z, NOISE), obs=y)
    pyro.sample("w", dist.Normal(z, W_SCALE), obs=w)


def _log_mass_ratio(y, w) -> float:
    """``log P(z > 0 | y, w) - log P(z < 0 | y, w)`` by a fine grid (float64)."""
    z = torch.linspace(-4.0, 4.0, 400_001, dtype=torch.float64)
    y, w = y.double(), w.double()
    lp = dist.Normal(0.0, PRIOR).log_prob(z) + dist.Normal(z, W_SCALE).log_prob(w)
    lp = lp + dist.Normal(z.unsqueeze(-1) ** 2, NOISE).log_prob(y).sum(-1)
    pos, neg = lp[z > 0], lp[z < 0]
    return float(torch.logsumexp(pos, 0) - torch.logsumexp(neg, 0))


def _two_starts():
    return [
        init_to_value(values={"z": torch.tensor(-2.0)}),
        init_to_value(values={"z": torch.tensor(2.0)}),
    ]


def _autocvi(init):
    return SVI(model, AutoCVI(model, init_loc_fn=init, init_scale=0.1), CVI(), CVI_ELBO())


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_heavier_mode_is_kept_and_the_bounds_differ_by_the_log_mass_ratio(dtype):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    y, w = _data(dtype)
    ratio = _log_mass_ratio(y, w)
    assert 0.3 < ratio < 0.6  # (the data make +2 heavier by about 8/18 nats)
    out = best_of_starts(
        _autocvi, (y, w), starts=_two_starts(), warmup_steps=60, num_particles=2000
    )
    assert out.chosen == 1
    (neg, se_neg), (pos, se_pos) = out.bounds
    # each fit is a Gaussian in one nearly Gaussian mode: ELBO_k = log p(y) + log P(mode k) - KL
    tol = 0.01 + 4 * math.hypot(se_neg, se_pos)
    assert abs((neg - pos) - ratio) < tol, (neg - pos, ratio, tol)
    # the chosen fit's parameters are the ones in the store: it continues in its mode
    assert float(out.guide.median(y, w)["z"]) == pytest.approx(2.0, abs=0.1)
    loss = out.svi.step(y, w)
    est = Trace_ELBO(num_particles=2000, vectorize_particles=True).loss(model, out.guide, y, w)
    assert abs(loss - est) < 0.5 and math.isfinite(loss)
    assert len(out.losses) == 2 and all(len(t) == 60 for t in out.losses)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pyros_own_guides_too(dtype):
    """Any guide: AutoNormal + Adam from the same two starts keeps the heavier mode too."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    y, w = _data(dtype)

    def adam(init):
        return SVI(model, AutoNormal(model, init_loc_fn=init), Adam({"lr": 0.05}), Trace_ELBO())

    out = best_of_starts(adam, (y, w), starts=_two_starts(), warmup_steps=200, num_particles=400)
    assert out.chosen == 1
    assert float(out.guide.median(y, w)["z"]) == pytest.approx(2.0, abs=0.1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_starts_are_the_given_one_then_uniform_draws(dtype):
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    y, w = _data(dtype)
    seen = []

    def make(init):
        seen.append(init)
        return _autocvi(init)

    out = best_of_starts(make, (y, w), num_starts=3, warmup_steps=5, num_particles=20)
    assert seen[0] is None and len(seen) == 3
    assert all(getattr(s, "func", None).__name__ == "init_to_uniform" for s in seen[1:])
    assert len(out.bounds) == 3 and out.bounds[out.chosen][0] == min(b[0] for b in out.bounds)


def test_refusals_name_the_argument():
    y, w = _data(torch.float64)
    pyro.clear_param_store()
    with pytest.raises(ValueError, match="num_starts"):
        best_of_starts(_autocvi, (y, w), num_starts=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        best_of_starts(_autocvi, (y, w), warmup_steps=0)
    pyro.param("left_over", torch.zeros(1))
    with pytest.raises(ValueError, match="clear_param_store"):
        best_of_starts(_autocvi, (y, w))
    pyro.clear_param_store()
