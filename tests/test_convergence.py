"""The convergence check (:mod:`pyro_cvi.methods.convergence`): its slope test against closed forms,
and its verdicts on real fits, checked against the exact gap to the optimum of a conjugate
model."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.methods.convergence import converged, convergence_report

DTYPES = [torch.float32, torch.float64]


# --------------------------------------------------------------------------- the test itself
def test_linear_trend_is_read_exactly():
    """A noiseless line: the slope, the decrease over the next K steps and a zero noise."""
    losses = [100.0 - 0.01 * t for t in range(400)]
    r = convergence_report(losses, atol=1.0, rtol=0.0)
    assert r.steps == 200
    assert r.decrease == pytest.approx(0.01 * 200, rel=1e-9)
    assert r.noise == pytest.approx(0.0, abs=1e-9)
    assert r.upper == pytest.approx(r.decrease, rel=1e-6)
    assert not r.converged  # 2 nats to gain over the next 200 steps > 1
    assert converged(losses, atol=2.5, rtol=0.0)


def test_slope_and_noise_match_least_squares():
    """The slope and residual sd against numpy-free least squares by the normal equations."""
    g = torch.Generator().manual_seed(3)
    y = (50.0 - 0.002 * torch.arange(600.0) + 0.7 * torch.randn(600, generator=g)).tolist()
    r = convergence_report(y, atol=1.0, rtol=0.0, window=300)
    t = torch.arange(300, dtype=torch.float64)
    Y = torch.tensor(y[-300:], dtype=torch.float64)
    A = torch.stack([torch.ones_like(t), t], -1)
    coef = torch.linalg.lstsq(A, Y[:, None]).solution[:, 0]
    res = Y - A @ coef
    assert r.decrease == pytest.approx(-float(coef[1]) * 300, rel=1e-9)
    assert r.noise == pytest.approx(math.sqrt(float(res.pow(2).sum()) / 298), rel=1e-9)
    se = r.noise / math.sqrt(float((t - t.mean()).pow(2).sum()))
    assert r.upper == pytest.approx(r.decrease + 2.0 * se * 300, rel=1e-9)


def test_noise_alone_is_not_convergence():
    """Flat but noisy losses: too few of them to resolve the tolerance says False; enough,
    True; a trend hidden in the noise (0.5 nat per 100 steps) stays False at any length."""
    g = torch.Generator().manual_seed(0)
    noise = (10.0 * torch.randn(20000, generator=g, dtype=torch.float64)).tolist()
    flat = [1000.0 + e for e in noise]
    assert not converged(flat[:200], atol=1.0, rtol=0.0)  # sqrt(12 / 100) 20 > 1
    assert converged(flat, atol=1.0, rtol=0.0, window=10000)
    trend = [1000.0 - 0.005 * t + e for t, e in enumerate(noise)]
    r = convergence_report(trend, atol=1.0, rtol=0.0, window=10000)
    assert r.decrease == pytest.approx(50.0, abs=5.0)
    assert not r.converged


def test_a_rising_trend_is_no_credit_against_the_noise():
    """Losses that rise by 0.02 a step under noise of sd 14 (a one-draw network's reported
    losses): ``D = -b K`` is about -7 nats over K = 350, and ``z se(b) K`` about 5.3 > 1. A
    negative ``D`` must not pull the bound under the tolerance: still False."""
    g = torch.Generator().manual_seed(2)
    noise = (14.0 * torch.randn(700, generator=g, dtype=torch.float64)).tolist()
    rising = [75.0 + 0.02 * t + e for t, e in enumerate(noise)]
    r = convergence_report(rising, atol=1.0, rtol=0.0)
    assert r.decrease < -3.0
    se_band = 2.0 * r.noise * math.sqrt(12.0 / r.steps)  # z se(b) K, with sum (t - tbar)^2
    assert r.upper == pytest.approx(se_band * math.sqrt(r.steps**2 / (r.steps**2 - 1)), rel=1e-9)
    assert r.upper > 1.0 and not r.converged


def test_short_history_is_not_converged():
    r = convergence_report([1.0] * 99)
    assert not r.converged and r.steps == 49
    assert converged([1.0] * 100)  # constant: nothing left to gain


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"atol": -1.0}, "atol"),
        ({"rtol": float("nan")}, "rtol"),
        ({"atol": 0.0, "rtol": 0.0}, "one tolerance"),
        ({"window": 10, "min_steps": 20}, "min_steps"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        converged([0.0] * 200, **kwargs)


def test_non_finite_losses_are_named():
    with pytest.raises(ValueError, match="NaN or an infinity"):
        converged([0.0] * 199 + [float("nan")])


def test_tensors_are_accepted():
    assert converged([torch.tensor(3.0)] * 200)


# --------------------------------------------------------------------------- a conjugate model
def _groups(dtype):
    g = torch.Generator().manual_seed(1)
    D, n = 4, 8
    mu = 4.0 * torch.randn(D, 1, generator=g, dtype=torch.float64)
    x = mu + torch.randn(D, n, generator=g, dtype=torch.float64)
    return x.to(dtype)


S0, S = 5.0, 1.0  # prior sd of each mean, observation sd


def normal_means(x):
    with pyro.plate("groups", x.shape[0]):
        mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), S0))
        with pyro.plate("obs", x.shape[1]):
            pyro.sample("x", dist.Normal(mu, S), obs=x.mT)


def _kl_to_posterior(x, m, v):
    """``KL(q || p(mu | x))`` summed over the groups (``q = N(m, v)``): the exact gap between
    the guide's -ELBO and ``-log p(x)`` (AutoNormal holds the posterior exactly)."""
    x = x.double()
    prec = 1.0 / S0**2 + x.shape[1] / S**2
    mp, vp = x.sum(1) / S**2 / prec, 1.0 / prec
    m, v = m.double(), v.double()
    return float((0.5 * (v / vp + (m - mp) ** 2 / vp - 1.0 - (v / vp).log())).sum())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_adam_on_a_conjugate_model(dtype):
    """AutoNormal + Adam on independent Normal means: False while the exact gap to the
    posterior is large, True once the gap is small (the gap from the closed form)."""
    x = _groups(dtype)
    guide = AutoNormal(normal_means)
    svi = SVI(normal_means, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    losses, first, early = [], None, None
    for step in range(6000):
        losses.append(svi.step(x))
        if step + 1 == 100:
            early = _kl_to_posterior(x, guide.locs.mu.detach(), guide.scales.mu.detach() ** 2)
            assert not converged(losses)
        if (step + 1) % 50 == 0 and converged(losses):
            first = step + 1
            break
    assert early is not None and early > 5.0  # False was right: far from the posterior
    assert first is not None
    gap = _kl_to_posterior(x, guide.locs.mu.detach(), guide.scales.mu.detach() ** 2)
    assert gap < 1.0  # True was right: within the tolerance of the optimum


@pytest.mark.parametrize("dtype", DTYPES)
def test_autocvi_on_a_conjugate_model(dtype):
    """AutoCVI's exact messages reach the posterior at once: the check says True as soon as it
    reads enough losses, and the guide's bound is -log p(x) there."""
    x = _groups(dtype)
    guide = AutoCVI(normal_means)
    svi = SVI(normal_means, guide, CVI(), CVI_ELBO())
    losses = [svi.step(x) for _ in range(99)]
    assert not converged(losses)  # too few losses to test
    losses.append(svi.step(x))
    assert converged(losses)
    xd = x.double()
    n = xd.shape[1]
    cov = S**2 * torch.eye(n, dtype=torch.float64) + S0**2
    log_z = float(
        dist.MultivariateNormal(torch.zeros(n, dtype=torch.float64), cov).log_prob(xd).sum()
    )
    with torch.no_grad():
        est = Trace_ELBO(num_particles=200).loss(normal_means, guide, x)
    assert est == pytest.approx(-log_z, abs=0.2)
