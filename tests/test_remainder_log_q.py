"""The remainder's per-step shortcuts give the numbers of what they replace, bit for bit:
``log q`` of the full form without a ``MultivariateNormal`` (and its gradient in the draws),
and the log joint of a trace with nothing summed out as a direct sum of its sites."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI
from torch.distributions import MultivariateNormal

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, Remainder
from pyro_cvi.blocks.remainder_joint import _site_sum
from pyro_cvi.gaussian import tril_log_prob
from pyro_cvi.messages.collapsed import collapsed_log_prob
from pyro_cvi.model.tracing import run_model

DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 3, 42, 151])
@pytest.mark.parametrize("K", [1, 4])
def test_tril_log_prob_is_the_distribution_s(dtype, D, K):
    g = torch.Generator().manual_seed(D + 100 * K)
    A = torch.randn(D, D, generator=g, dtype=dtype)
    L = torch.linalg.cholesky(A @ A.mT / D + torch.eye(D, dtype=dtype))
    m = torch.randn(D, generator=g, dtype=dtype)
    u0 = m + torch.randn(K, D, generator=g, dtype=dtype) @ L.mT
    u1, u2 = u0.clone().requires_grad_(True), u0.clone().requires_grad_(True)
    ours = tril_log_prob(m, L, u1)
    ref = MultivariateNormal(m, scale_tril=L).log_prob(u2)
    assert ours.shape == (K,)
    assert torch.equal(ours, ref)
    (g1,) = torch.autograd.grad(ours.sum(), u1)
    (g2,) = torch.autograd.grad(ref.sum(), u2)
    assert torch.equal(g1, g2)
    # and the closed form: d/du log q = -S^-1 (u - m)
    S = L @ L.mT
    tol = 1e-3 if dtype == torch.float32 else 1e-9
    assert torch.allclose(g1, -torch.linalg.solve(S, (u0 - m).mT).mT, rtol=tol, atol=tol)


def _plated_model(y, mask):
    def model():
        loc = pyro.sample("loc", dist.Normal(y.new_tensor(0.0), 1.0))
        cols = pyro.plate("cols", 4, dim=-1)
        with cols:
            col = pyro.sample("col", dist.Normal(loc, 2.0))
        scale = pyro.sample("scale", dist.LogNormal(y.new_tensor(0.0), 1.0))
        with pyro.plate("rows", 3, dim=-2):
            row = pyro.sample("row", dist.Normal(loc, 1.0))
            with cols, poutine.scale(scale=2.5):
                pyro.sample("y", dist.Normal(row + col, scale).mask(mask), obs=y)
        with cols:  # the first plate's group again, later
            pyro.sample("z", dist.Normal(col, 1.0), obs=y[0])

    return model


@pytest.mark.parametrize("dtype", DTYPES)
def test_site_sum_is_the_contraction_without_discrete_sites(dtype):
    g = torch.Generator().manual_seed(1)
    y = torch.randn(3, 4, generator=g, dtype=dtype)
    mask = torch.rand(3, 4, generator=g) > 0.3
    model = _plated_model(y, mask)
    values = {
        "loc": torch.randn((), generator=g, dtype=dtype),
        "col": torch.randn(4, generator=g, dtype=dtype),
        "scale": torch.rand((), generator=g, dtype=dtype) + 0.5,
        "row": torch.randn(3, 1, generator=g, dtype=dtype),
    }
    tr = run_model(model, values, (), {}, None)
    for sites in (["loc", "col", "scale", "row", "y", "z"], ["y", "z", "col"], ["z"]):
        direct = _site_sum(tr, sites)
        assert torch.equal(direct, collapsed_log_prob(tr, sites))
        tr.compute_log_prob()
        by_hand = sum(tr.nodes[s]["log_prob_sum"] for s in sites)
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        assert torch.allclose(direct, by_hand, rtol=tol, atol=tol)


def _horseshoe(X, y):
    D = X.shape[1]
    tau = pyro.sample("tau", dist.HalfCauchy(X.new_tensor(1.0)))
    with pyro.plate("features", D):
        lam = pyro.sample("lambda", dist.HalfCauchy(X.new_tensor(1.0)))
        beta = pyro.sample("beta", dist.Normal(X.new_tensor(0.0), tau * lam))
    b = pyro.sample("b", dist.Normal(X.new_tensor(0.0), 5.0))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("obs", dist.Bernoulli(logits=b + X @ beta), obs=y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_block_s_log_q_is_its_joint_s(dtype):
    """After a few steps (``L`` no longer diagonal), the full form's ``log q`` at fresh draws
    equals ``q``'s own ``log_prob``, and the losses equal a run that builds the distribution."""
    g = torch.Generator().manual_seed(2)
    X = torch.randn(40, 5, generator=g, dtype=dtype)
    y = torch.bernoulli(torch.sigmoid(X[:, 0] - X[:, 1]), generator=g)

    def run(patch):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoCVI(_horseshoe, remainder=Remainder(covariance="full"))
        svi = SVI(_horseshoe, guide, CVI(), CVI_ELBO())
        losses = [svi.step(X, y)]
        rem = guide.engine.kinds["remainder"][0]
        assert rem.form == "full"
        if patch:
            rem._log_q = lambda u: rem.joint_unconstrained().log_prob(u)
        losses += [svi.step(X, y) for _ in range(7)]
        return rem, losses

    rem, losses = run(False)
    _, ref_losses = run(True)
    assert losses == ref_losses
    u = rem.joint_unconstrained().sample((6,))
    assert torch.equal(rem._log_q(u), rem.joint_unconstrained().log_prob(u))
