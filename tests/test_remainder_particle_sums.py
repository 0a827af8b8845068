"""The remainder's per-particle log joint without enumeration (a direct sum) agrees with the
TraceEnum contraction it replaces, with plates, masks and subsampling scales."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine

from pyro_cvi.blocks.remainder_joint import _particle_sums
from pyro_cvi.messages.collapsed import collapsed_log_prob
from pyro_cvi.model.tracing import run_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_particle_sums_match_the_contraction(dtype):
    K, P = 5, 2
    g = torch.Generator().manual_seed(0)
    y = torch.randn(3, 4, generator=g, dtype=dtype)
    mask = torch.rand(3, 4, generator=g) > 0.3

    def model():
        loc = pyro.sample("loc", dist.Normal(y.new_tensor(0.0), 1.0))
        scale = pyro.sample("scale", dist.LogNormal(y.new_tensor(0.0), 1.0))
        with pyro.plate("rows", 3, dim=-2):
            row = pyro.sample("row", dist.Normal(loc, 1.0))
            with pyro.plate("cols", 4, dim=-1), poutine.scale(scale=2.5):
                pyro.sample("y", dist.Normal(row, scale).mask(mask), obs=y)

    def particles():
        with pyro.plate("_cvi_particles", K, dim=-1 - P):
            return model()

    values = {
        "loc": torch.randn(K, 1, 1, generator=g, dtype=dtype),
        "scale": torch.rand(K, 1, 1, generator=g, dtype=dtype) + 0.5,
        "row": torch.randn(K, 3, 1, generator=g, dtype=dtype),
    }
    tr = run_model(particles, values, (), {}, None)
    sites = ["loc", "scale", "row", "y"]
    direct = _particle_sums(tr, sites, K, P)
    contracted = collapsed_log_prob(tr, sites, "_cvi_particles")
    assert direct.shape == (K,)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert torch.allclose(direct, contracted, rtol=tol, atol=tol)
    # and against each particle's own trace, by hand
    for k in range(K):
        one = {n: v[k] if n == "row" else v[k].reshape(()) for n, v in values.items()}
        t1 = run_model(model, one, (), {}, None)
        t1.compute_log_prob()
        ref = sum(t1.nodes[s]["log_prob_sum"] for s in sites)
        assert torch.allclose(direct[k], ref, rtol=tol, atol=tol)
