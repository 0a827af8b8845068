"""A Kalman chain whose scales are not log-affine in the remainder's coordinates.

``x_t ~ Normal(x_{t-1}, sigma_level + 0.1)``, ``y_t ~ Normal(x_t, sigma_obs + 0.1)``: ``log s``
is not affine in ``u = log sigma``, so the set-up's affinity test sends the chain to the Monte
Carlo expected precision (an average of ``exp(-2 log s(u_k))`` over draws of ``q(u)``, one
batched model run a step) instead of the closed form. Checked: the estimator against
Gauss-Hermite quadrature; the set-up's decision and ``explain()``; the fit against the exact
grid posterior.
"""

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks.scaled_markov import ScaledMarkovBlock
from pyro_cvi.messages.chain_expected import ChainRows, monte_carlo_precisions

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def shifted(y):
    sl = pyro.sample("sigma_level", dist.HalfNormal(y.new_tensor(1.0)))
    so = pyro.sample("sigma_obs", dist.HalfNormal(y.new_tensor(1.0)))
    x = pyro.sample("x_0", dist.Normal(y.new_tensor(0.0), 1.0))
    pyro.sample("y_0", dist.Normal(x, so + 0.1), obs=y[0])
    for t in pyro.markov(range(1, len(y))):
        x = pyro.sample(f"x_{t}", dist.Normal(x, sl + 0.1))
        pyro.sample(f"y_{t}", dist.Normal(x, so + 0.1), obs=y[t])


def data(T, dtype):
    g = torch.Generator().manual_seed(3)
    x = (0.3 * torch.randn(T, generator=g, dtype=torch.float64)).cumsum(0)
    return (x + 0.5 * torch.randn(T, generator=g, dtype=torch.float64)).to(dtype)


def fit(T, dtype, steps, model=shifted):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    y = data(T, dtype)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    guide(y)
    for _ in range(steps):
        svi.step(y)
    return guide, y


def _chain(guide):
    found = [b for b in guide.engine.blocks if isinstance(b, ScaledMarkovBlock)]
    return found[0] if found else None


@DTYPES
def test_monte_carlo_precisions_against_quadrature(dtype):
    """``E[1/s^2]`` for ``s = exp(u_0) + 0.1``, ``softplus(u_1)`` and ``u_0^2 + 0.5`` under a
    correlated ``q(u) = N(m, S)``: the mean of 40 Monte Carlo estimates against 80-point
    Gauss-Hermite quadrature of each element's marginal (within 4 SE and 1e-5)."""

    def read(u):
        a, b = u[:, 0], u[:, 1]
        s = torch.stack([a.exp() + 0.1, torch.nn.functional.softplus(b), a * a + 0.5], -1)
        return s.log()

    rows = ChainRows(
        ("a", "b"), torch.zeros(2), torch.zeros(3), torch.zeros(3, 2), (1,), (),
        torch.zeros(0, dtype=torch.long), torch.zeros(0, 1), torch.zeros(0), read=read,
    )  # fmt: skip
    m = torch.tensor([-0.3, 0.4], dtype=dtype)
    L = torch.tensor([[0.4, 0.0], [0.2, 0.3]], dtype=dtype)
    S = L @ L.T
    g = torch.Generator().manual_seed(0)
    est = torch.stack([monte_carlo_precisions(rows, m, S, g) for _ in range(40)]).double()
    assert est.dtype == torch.float64 and bool(torch.isfinite(est).all())
    mean, se = est.mean(0), est.std(0) / math.sqrt(est.shape[0])
    x, w = np.polynomial.hermite_e.hermegauss(80)
    x, w = torch.tensor(x), torch.tensor(w) / math.sqrt(2 * math.pi)
    sd = S.double().diagonal().sqrt()
    a, b = m[0].double() + sd[0] * x, m[1].double() + sd[1] * x
    quad = torch.stack(
        [
            (w / (a.exp() + 0.1) ** 2).sum(),
            (w / torch.nn.functional.softplus(b) ** 2).sum(),
            (w / (a * a + 0.5) ** 2).sum(),
        ]
    )
    assert torch.all((mean - quad).abs() < 4 * se + 1e-5), (mean, quad, se)


def _log_affine(y):
    sl = pyro.sample("sigma_level", dist.HalfNormal(y.new_tensor(1.0)))
    so = pyro.sample("sigma_obs", dist.HalfNormal(y.new_tensor(1.0)))
    x = pyro.sample("x_0", dist.Normal(y.new_tensor(0.0), 1.0))
    pyro.sample("y_0", dist.Normal(x, so), obs=y[0])
    for t in pyro.markov(range(1, len(y))):
        x = pyro.sample(f"x_{t}", dist.Normal(x, 0.5 * sl))
        pyro.sample(f"y_{t}", dist.Normal(x, so), obs=y[t])


@DTYPES
def test_the_set_up_decides_closed_form_or_monte_carlo(dtype):
    """``s = 0.5 sigma`` (log-affine in ``log sigma``): the closed form; ``s = sigma + 0.1``:
    the Monte Carlo precision, said by ``explain()`` for the transitions and observations."""
    T = 70
    affine, _ = fit(T, dtype, 0, _log_affine)
    chain = _chain(affine)
    assert chain is not None and chain.scaled.read is None
    assert "by Monte Carlo" not in affine.explain()
    mc, _ = fit(T, dtype, 0)
    chain = _chain(mc)
    assert chain is not None and chain.scaled.read is not None
    assert mc.engine.analysis.remainder == ["sigma_level", "sigma_obs"]
    text = mc.explain()
    assert "E[1/s^2] by Monte Carlo over the remainder's q" in text
    assert "log s is not affine in the scales' unconstrained values" in text
    assert "Monte Carlo expected from y_0" in text


def exact_shifted(y: torch.Tensor, n: int = 100) -> float:
    """``-log p(y)`` of :func:`shifted` on a grid of ``(log sigma_level, log sigma_obs)``."""
    y = y.double()
    a = torch.linspace(-6.0, 1.5, n, dtype=torch.float64)
    la, lb = (v.reshape(-1) for v in torch.meshgrid(a, a, indexing="ij"))
    q, r = (la.exp() + 0.1) ** 2, (lb.exp() + 0.1) ** 2
    m, P, ll = torch.zeros_like(q), torch.ones_like(q), torch.zeros_like(q)
    for t in range(len(y)):
        if t > 0:
            P = P + q
        S = P + r
        ll = ll - 0.5 * (torch.log(2 * math.pi * S) + (y[t] - m) ** 2 / S)
        K = P / S
        m, P = m + K * (y[t] - m), (1 - K) * P
    half = dist.HalfNormal(torch.tensor(1.0, dtype=torch.float64))
    logp = ll + half.log_prob(la.exp()) + la + half.log_prob(lb.exp()) + lb
    h = float(a[1] - a[0])
    return float(-(torch.logsumexp(logp, 0) + 2 * math.log(h)))


@pytest.mark.slow
@DTYPES
def test_the_monte_carlo_chain_against_the_exact_answer(dtype):
    """T = 70 after 150 steps: the bound (``Trace_ELBO``) above ``-log p(y)`` less 3 SE and
    within 3 nats of it (mean field between the chain and its scales)."""
    guide, y = fit(70, dtype, 150)
    assert _chain(guide) is not None
    with torch.no_grad():
        v = torch.tensor(
            [Trace_ELBO(num_particles=100).loss(shifted, guide, y) for _ in range(10)],
            dtype=torch.float64,
        )
    bound, se = float(v.mean()), float(v.std() / math.sqrt(len(v)))
    exact = exact_shifted(y)
    assert exact - 3 * se - 0.05 < bound < exact + 3.0, (bound, se, exact)
