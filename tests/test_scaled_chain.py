"""A ``pyro.markov`` chain whose step and observation scales are remainder latents.

``x_t ~ Normal(x_{t-1}, sigma_level)``, ``y_t ~ Normal(x_t, sigma_obs)`` with both scales
latent: beyond ``JOINT_MAX_DIM`` coordinates the chain keeps its Kalman block at the expected
precisions ``E[1/s^2]`` and the remainder holds the scales (``blocks/scaled_markov.py``).
Checked: the expected precisions against a brute-force average over ``q(u)``; ``q(x)`` against
the dense exact posterior of the chain at those precisions; the reported loss against
``Trace_ELBO``; the rule's pick at both sides of the boundary, the overrides and
``explain()``'s lines.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from test_scaled_walk import data as walk_data
from test_scaled_walk import exact_walk, walk

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks.scaled_markov import ScaledMarkovBlock
from pyro_cvi.messages.chain_expected import ChainRows, expected_precisions
from pyro_cvi.model.prior_factor import JOINT_MAX_DIM

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def level(y):
    sl = pyro.sample("sigma_level", dist.HalfNormal(y.new_tensor(1.0)))
    so = pyro.sample("sigma_obs", dist.HalfNormal(y.new_tensor(1.0)))
    x = pyro.sample("x_0", dist.Normal(y.new_tensor(0.0), 1.0))
    pyro.sample("y_0", dist.Normal(2.0 * x, so), obs=y[0])
    for t in pyro.markov(range(1, len(y))):
        x = pyro.sample(f"x_{t}", dist.Normal(0.9 * x + 0.1, sl))
        pyro.sample(f"y_{t}", dist.Normal(2.0 * x, so), obs=y[t])


def data(T, dtype):
    g = torch.Generator().manual_seed(3)
    x = (0.3 * torch.randn(T, generator=g, dtype=torch.float64)).cumsum(0)
    return (2 * x + 0.5 * torch.randn(T, generator=g, dtype=torch.float64)).to(dtype)


def fit(T, dtype, steps, families=None):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    y = data(T, dtype)
    guide = AutoCVI(level, families=families)
    svi = SVI(level, guide, CVI(), CVI_ELBO())
    for _ in range(steps):
        svi.step(y)
    return guide, svi, y


def _chain(guide):
    found = [b for b in guide.engine.blocks if isinstance(b, ScaledMarkovBlock)]
    return found[0] if found else None


def _remainder(guide):
    (rem,) = [b for b in guide.engine.blocks if hasattr(b, "loc_name")]
    return rem


@DTYPES
def test_expected_precisions_against_a_brute_force_average(dtype):
    """``E[1/s^2]`` with ``log s = L0 + H (u - u0)`` under ``q(u) = N(m, S)``: the closed form
    against the average of ``exp(-2 log s)`` over 200,000 draws of ``u`` (within 4 SE)."""
    g = torch.Generator().manual_seed(0)
    H = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, -0.3]], dtype=torch.float64)
    rows = ChainRows(
        ("a", "b"), torch.tensor([0.1, -0.2]).double(), torch.tensor([0.3, -0.1, 0.2]).double(),
        H, (1,), (), torch.zeros(0, dtype=torch.long), torch.zeros(0, 1), torch.zeros(0),
    )  # fmt: skip
    m = torch.tensor([-0.4, 0.2], dtype=torch.float64)
    L = torch.tensor([[0.3, 0.0], [-0.1, 0.2]], dtype=torch.float64)
    S = L @ L.T
    closed = expected_precisions(rows, m.to(dtype), S.to(dtype))
    assert closed.dtype == dtype
    u = m + torch.randn(200_000, 2, generator=g, dtype=torch.float64) @ L.T
    log_s = rows.L0 + (u - rows.u0) @ H.T
    draws = torch.exp(-2 * log_s)
    mean, se = draws.mean(0), draws.std(0) / math.sqrt(draws.shape[0])
    assert torch.all((closed.double() - mean).abs() < 4 * se + 1e-5), (closed, mean, se)


@DTYPES
def test_the_chain_is_the_exact_posterior_at_the_expected_precisions(dtype):
    """After the steps, ``q(x)`` (the smoother) equals the dense Gaussian posterior of the
    chain whose transition and observation precisions are ``E_q[1/s^2]`` of the remainder's
    current ``q`` (closed form for the log-normal ``q`` of a HalfNormal's exp transform)."""
    T = 70
    guide, svi, y = fit(T, dtype, 3)
    with torch.no_grad():
        svi.evaluate_loss(y)  # (the blocks refreshed at the current q, no step)
    block = _chain(guide)
    assert block is not None and guide.engine.analysis.remainder == ["sigma_level", "sigma_obs"]
    rem = _remainder(guide)
    loc, cov = pyro.param(rem.loc_name).detach().double(), rem.covariance().detach().double()
    start = {s.name: s.start for s in rem.sites}
    w = {z: math.exp(-2 * loc[start[z]] + 2 * cov[start[z], start[z]]) for z in start}
    P = torch.zeros(T, T, dtype=torch.float64)
    h = torch.zeros(T, dtype=torch.float64)
    P[0, 0] += 1.0
    for t in range(1, T):  # x_t - 0.9 x_(t-1) - 0.1 ~ N(0, 1 / w_level)
        r = torch.zeros(T, dtype=torch.float64)
        r[t], r[t - 1] = 1.0, -0.9
        P += w["sigma_level"] * torch.outer(r, r)
        h += w["sigma_level"] * r * 0.1
    P += torch.eye(T, dtype=torch.float64) * 4.0 * w["sigma_obs"]  # y_t ~ N(2 x_t, .)
    h += 2.0 * w["sigma_obs"] * y.double()
    V = torch.linalg.inv(P)
    mean = V @ h
    tol = 1e-4 if dtype == torch.float32 else 1e-9
    post = block.post
    assert torch.allclose(post.mean[:, 0].double(), mean, rtol=tol, atol=tol)
    assert torch.allclose(post.cov[:, 0, 0].double(), V.diagonal(), rtol=tol, atol=tol)
    lag = torch.stack([V[t, t - 1] for t in range(1, T)])
    assert torch.allclose(post.cross[:, 0, 0].double(), lag, rtol=tol, atol=tol)


@pytest.mark.slow
@DTYPES
def test_the_reported_loss_against_trace_elbo(dtype):
    """The chain's ELBO (entropy and its own prior) and the remainder's Rao-Blackwellised
    terms add up to the bound: the reported loss against ``Trace_ELBO`` within 3 SE."""
    guide, svi, y = fit(70, dtype, 20)
    assert _chain(guide) is not None
    with torch.no_grad():
        reported = torch.tensor([svi.evaluate_loss(y) for _ in range(40)]).double()
        trace = torch.tensor(
            [Trace_ELBO(num_particles=50).loss(level, guide, y) for _ in range(8)],
            dtype=torch.float64,
        )
    se = math.hypot(reported.std() / math.sqrt(40), trace.std() / math.sqrt(8))
    tol = 3 * se + (2e-2 if dtype == torch.float32 else 1e-3)
    assert abs(float(reported.mean() - trace.mean())) < tol, (reported.mean(), trace.mean(), se)


@pytest.mark.slow
@DTYPES
def test_the_rule_at_the_boundary_and_the_overrides(dtype):
    """``T + 2`` coordinates: the joint at ``JOINT_MAX_DIM``, the Kalman block one beyond;
    ``families`` on a chain site forces either side; ``explain()`` names the rule and the
    expected messages."""
    T = JOINT_MAX_DIM - 2
    at, _, _ = fit(T, dtype, 0)
    at(data(T, dtype))
    assert _chain(at) is None and "x_0" in at.engine.analysis.remainder
    beyond, _, _ = fit(T + 1, dtype, 0)
    beyond(data(T + 1, dtype))
    assert _chain(beyond) is not None
    text = beyond.explain()
    assert f"the joint would hold {T + 3} coordinates, more than {JOINT_MAX_DIM}" in text
    assert "N(a x_(t-1) + b, 1 / E[1/s^2]) in the Kalman prior" in text
    assert "the expected row (h, E[1/s^2], E[1/s^2] (y - c))" in text
    named, _, _ = fit(20, dtype, 0, families={"x_3": "gaussian"})
    named(data(20, dtype))
    assert _chain(named) is not None and named.engine.analysis.remainder == [
        "sigma_level",
        "sigma_obs",
    ]
    assert "named families={...: 'gaussian'} on a chain site" in named.explain()
    joint, _, _ = fit(T + 10, dtype, 0, families={"x_5": "joint"})
    joint(data(T + 10, dtype))
    assert _chain(joint) is None


def exact_level(y: torch.Tensor, n: int = 120) -> float:
    """``-log p(y)`` of :func:`level` on a grid of ``(log sigma_level, log sigma_obs)``, each
    point's ``log p(y | scales)`` by a Kalman filter."""
    y = y.double()
    a = torch.linspace(-5.0, 1.5, n, dtype=torch.float64)
    la, lb = (v.reshape(-1) for v in torch.meshgrid(a, a, indexing="ij"))
    q, r = torch.exp(2 * la), torch.exp(2 * lb)
    m, P, ll = torch.zeros_like(q), torch.ones_like(q), torch.zeros_like(q)
    for t in range(len(y)):
        if t > 0:
            m, P = 0.9 * m + 0.1, 0.81 * P + q
        S = 4.0 * P + r
        ll = ll - 0.5 * (torch.log(2 * math.pi * S) + (y[t] - 2.0 * m) ** 2 / S)
        K = 2.0 * P / S
        m, P = m + K * (y[t] - 2.0 * m), (1 - 2.0 * K) * P
    half = dist.HalfNormal(torch.tensor(1.0, dtype=torch.float64))
    logp = ll + half.log_prob(la.exp()) + la + half.log_prob(lb.exp()) + lb
    h = float(a[1] - a[0])
    return float(-(torch.logsumexp(logp, 0) + 2 * math.log(h)))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32], ids=["f32"])
def test_twenty_thousand_steps_of_the_chain_path(dtype):
    """20,000 steps of the Kalman block beside its scales (``ScaledMarkovBlock``, the step both
    spellings take; here the plate-and-cumsum one, whose model run is one vectorised call, named
    ``'gaussian'`` at T = 20), in float32, where rounding accumulates first: every reported loss
    finite, the last 2,000 steps' mean within 0.3 nats of the mean over steps 8,000-10,000 (no
    drift), and the bound (``Trace_ELBO``) between ``-log p(y)`` (the exact grid answer) less
    3 SE and ``-log p(y) + 3`` nats (mean field between the chain and its scales)."""
    T, steps = 20, 20_000
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    y = walk_data(T, dtype)
    guide = AutoCVI(walk, families={"eps": "gaussian"})
    svi = SVI(walk, guide, CVI(), CVI_ELBO())
    losses = torch.tensor([svi.step(y) for _ in range(steps)], dtype=torch.float64)
    assert _chain(guide) is not None
    assert bool(torch.isfinite(losses).all())
    late, middle = float(losses[-2000:].mean()), float(losses[8000:10000].mean())
    assert abs(late - middle) < 0.3, (late, middle)
    with torch.no_grad():
        v = torch.tensor(
            [Trace_ELBO(num_particles=100).loss(walk, guide, y) for _ in range(10)],
            dtype=torch.float64,
        )
    bound, se = float(v.mean()), float(v.std() / math.sqrt(len(v)))
    exact = exact_walk(y)
    assert exact - 3 * se - 0.05 < bound < exact + 3.0, (bound, se, exact)
