"""``pyro_cvi.blocks.markov``: the Kalman-smoother block (App. E.2) through the block protocol.

A local-level model written as a ``pyro.markov`` loop with Normal observations is conjugate:
one step at ``step_size=1`` is the exact posterior, here checked against the dense Gaussian
posterior of the same joint (an independent computation)."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks import MarkovBlock

T, Q, R = 12, 0.3, 0.5


def local_level(y):
    x = pyro.sample("x_0", dist.Normal(torch.zeros((), dtype=y.dtype), 1.0))
    for t in pyro.markov(range(T)):
        if t > 0:
            x = pyro.sample(f"x_{t}", dist.Normal(0.9 * x, Q**0.5))
        pyro.sample(f"y_{t}", dist.Normal(x, R**0.5), obs=y[t])


def dense_posterior(y):
    """The joint prior of x is N(0, K) with K from the AR(1) recursion; observations add 1/R."""
    A = torch.zeros(T, T, dtype=torch.float64)  # x = L e, e ~ N(0, diag(1, Q, ..., Q))
    A[0, 0] = 1.0
    for t in range(1, T):
        A[t] = 0.9 * A[t - 1]
        A[t, t] = 1.0
    s = torch.full((T,), Q, dtype=torch.float64)
    s[0] = 1.0
    K = A @ torch.diag(s) @ A.T
    prec = torch.linalg.inv(K) + torch.eye(T, dtype=torch.float64) / R
    cov = torch.linalg.inv(prec)
    return cov @ (y.double() / R), cov


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_step_is_the_exact_smoothed_posterior(dtype):
    y = torch.sin(torch.arange(T, dtype=dtype) / 2) + 0.1 * torch.arange(T, dtype=dtype) / T
    guide = AutoCVI(local_level)
    svi = SVI(local_level, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    svi.step(y)
    (block,) = guide.engine.blocks
    assert isinstance(block, MarkovBlock) and len(block.names) == T
    mean, cov = dense_posterior(y)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    for t in (0, 5, T - 1):
        q = block.marginal(f"x_{t}")
        assert abs(q.mean.item() - mean[t].item()) < tol
        assert abs(q.variance.item() - cov[t, t].item()) < tol
    means = block.sample({}, at_means=True)
    assert torch.allclose(means["x_3"].double(), mean[3], atol=tol)
    # the reported loss at the exact posterior is -log p(y)
    # Cov(y) = K + R I, K the prior covariance recovered from the posterior precision
    prec_post = torch.linalg.inv(cov)
    K = torch.linalg.inv(prec_post - torch.eye(T, dtype=torch.float64) / R)
    K_y = K + R * torch.eye(T, dtype=torch.float64)
    evidence = dist.MultivariateNormal(torch.zeros(T, dtype=torch.float64), K_y).log_prob(
        y.double()
    )
    loss = CVI_ELBO().loss(local_level, guide, y)
    assert abs(loss + evidence.item()) < (1e-3 if dtype == torch.float32 else 1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_a_markov_gp_fit_is_the_same_with_either_smoother(dtype, monkeypatch):
    """A non-conjugate fit (Poisson counts on a Matern-3/2 Markov GP, 6 steps at step size 1)
    gives the same -ELBO every step and the same ``q`` with the tree and with the scan (the
    smoother is an exact computation: only rounding differs)."""
    from pyro_cvi.statespace import Matern32, kalman, markov_gp

    t = torch.arange(40, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    y = torch.poisson(torch.exp(torch.sin(t.double() / 6.0)), generator=g).to(dtype)

    def model(t, y):
        f = markov_gp("x", t, Matern32(lengthscale=5.0, variance=1.0))
        with pyro.plate("t", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

    fits = {}
    for method in (kalman.TREE, kalman.SCAN):
        monkeypatch.setattr(kalman, "choose_smoother", lambda T, d, m=method: m)
        pyro.clear_param_store()
        guide = AutoCVI(model)
        svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
        losses = torch.tensor([svi.step(t, y) for _ in range(6)], dtype=torch.float64)
        q = guide.posterior("x")
        fits[method.name] = (losses, q.mean.double(), q.variance.double())
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    for a, b in zip(fits["tree"], fits["scan"]):
        torch.testing.assert_close(a, b, **tol)
