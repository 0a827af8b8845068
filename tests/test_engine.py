"""``pyro_cvi.engine``: one pipeline over blocks of any kind.

The engine's ELBO is the constant factors plus every block's messages; the sequential schedule
with ``beta = 1`` is CAVI (its fixed point is the closed-form CAVI fixed point of a
Normal model with unknown mean and precision); the parallel schedule reaches the same point.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks import GaussianBlock, MeanFieldBlock, NaturalBlock

Y = torch.tensor([1.3, 0.2, 2.1, 1.7, 0.9, 1.1, 2.5, 0.4])
M0, V0, A0, B0 = 0.5, 4.0, 2.0, 1.5


def normal_gamma(y):
    mu = pyro.sample("mu", dist.Normal(torch.tensor(M0, dtype=y.dtype), V0**0.5))
    tau = pyro.sample("tau", dist.Gamma(torch.tensor(A0, dtype=y.dtype), B0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(mu, tau**-0.5), obs=y)


def cavi(y, iters=500):
    """The textbook CAVI updates (Bishop 10.1.3) to convergence, and the ELBO there."""
    y = y.double()
    N, Et = len(y), A0 / B0
    for _ in range(iters):
        lam = 1 / V0 + N * Et
        m = (M0 / V0 + Et * y.sum().item()) / lam
        a = A0 + N / 2
        b = B0 + 0.5 * float(((y - m) ** 2).sum() + N / lam)
        Et = a / b
    v = 1 / lam
    Elog = torch.digamma(torch.tensor(a, dtype=torch.float64)).item() - math.log(b)
    elbo = (
        -0.5 * N * math.log(2 * math.pi)
        + 0.5 * N * Elog
        - 0.5 * Et * float(((y - m) ** 2).sum() + N * v)
        + dist.Normal(M0, V0**0.5).log_prob(torch.tensor(m, dtype=torch.float64)).item()
        - 0.5 * v / V0
        + A0 * math.log(B0)
        - math.lgamma(A0)
        + (A0 - 1) * Elog
        - B0 * Et
        + 0.5 * math.log(2 * math.pi * math.e * v)
        + dist.Gamma(torch.tensor(a, dtype=torch.float64), b).entropy().item()
    )
    return m, v, a, b, elbo


@pytest.mark.parametrize("schedule", ["sequential", "parallel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_schedules_reach_the_cavi_fixed_point_and_report_its_elbo(schedule, dtype):
    y = Y.to(dtype)
    guide = AutoCVI(normal_gamma, schedule=schedule)
    svi = SVI(normal_gamma, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    for _ in range(60):
        svi.step(y)
    loss = CVI_ELBO().loss(normal_gamma, guide, y)  # the bound at the final q
    engine = guide.engine
    # mu: a site-form block (y's Normal is conjugate given E[tau]); tau: the mean field
    assert [type(b) for b in engine.blocks] == [GaussianBlock, MeanFieldBlock]
    assert isinstance(engine.stepper["mu"], GaussianBlock)
    assert isinstance(engine.stepper["tau"], NaturalBlock)
    m, v, a, b, elbo = cavi(y)
    tol = 1e-4 if dtype == torch.float32 else 1e-9
    q_mu, q_tau = guide.posterior("mu"), guide.posterior("tau")
    assert abs(q_mu.mean.item() - m) < tol and abs(q_mu.variance.item() - v) < tol
    assert abs(q_tau.concentration.item() - a) < tol * a and abs(q_tau.rate.item() - b) < tol * b
    assert abs(-loss - elbo) < (1e-3 if dtype == torch.float32 else 1e-8)


def logistic_and_normal_gamma(X, y, z):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
    pyro.sample("label", dist.Bernoulli(logits=X @ w).to_event(1), obs=y)
    normal_gamma(z)


def test_the_elbo_is_the_constant_factors_plus_every_blocks_messages():
    g = torch.Generator().manual_seed(3)
    X = torch.randn(30, 3, generator=g, dtype=torch.float64)
    y = (torch.rand(30, generator=g, dtype=torch.float64) < 0.5).double()
    z = Y.double()
    guide = AutoCVI(logistic_and_normal_gamma)
    svi = SVI(logistic_and_normal_gamma, guide, CVI(step_size=0.5), loss=CVI_ELBO())
    for _ in range(3):
        svi.step(X, y, z)
    engine = guide.engine
    # w and mu: site-form blocks; tau: the mean field
    assert [type(b) for b in engine.blocks] == [GaussianBlock, GaussianBlock, MeanFieldBlock]
    assert engine.param_names() == [n for b in engine.blocks for n in b.param_names()]
    total = float(engine.loss((X, y, z), {}, {}, grads=False))
    ctx = engine.context((X, y, z), {}, {}, grads=False)
    parts = [float(b.messages(ctx)) for b in engine.blocks]
    # no factor depends on no latent here: the constant part is zero
    assert abs(total - sum(parts)) < 1e-10, (total, parts)
    # the loss svi reports is minus that sum
    loss = CVI_ELBO().loss(logistic_and_normal_gamma, guide, X, y, z)
    assert loss == pytest.approx(-total, abs=1e-10)
