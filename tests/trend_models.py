"""A local linear trend written with two cumsums, shared by the nested-walk tests and
``scripts/benchmark_local_trend.py``.

``eta ~ Normal(0, slope)``, ``eps ~ Normal(0, level)`` in one plate of ``T``,
``level_t = (eta.cumsum(-1) + eps).cumsum(-1)``, ``y ~ Normal(level_t, obs)``: the chain of
``x_t = (slope_t, level_t - slope_t)``, ``x_t = [[1, 0], [1, 1]] x_(t-1) + (eta_t, eps_t)``. The
scales are fixed numbers (:func:`fixed_scales`) or HalfNormal latents (:func:`latent_scales`).
Beside the model: the same density as a two-state ``pyro.markov`` loop, simulated data, and the
exact ``log p(y | scales)`` by a Kalman filter on ``(slope, level)`` (``x_(-1) = 0``,
``Q = [[ss^2, ss^2], [ss^2, ss^2 + sl^2]]``), integrated on a grid of the latent scales.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence, Tuple

import pyro
import pyro.distributions as dist
import torch

#: the latent scales' HalfNormal prior scales: ``(level, slope, obs)``
PRIOR_SCALES = (1.0, 0.2, 1.0)


def latent_scales(y):
    """``(sigma_level, sigma_slope, sigma_obs)``, HalfNormal latents (:data:`PRIOR_SCALES`)."""
    sl = pyro.sample("sigma_level", dist.HalfNormal(y.new_tensor(PRIOR_SCALES[0])))
    ss = pyro.sample("sigma_slope", dist.HalfNormal(y.new_tensor(PRIOR_SCALES[1])))
    so = pyro.sample("sigma_obs", dist.HalfNormal(y.new_tensor(PRIOR_SCALES[2])))
    return sl, ss, so


def fixed_scales(level: float, slope: float, obs: float) -> Callable:
    """Scales that are numbers: ``(level, slope, obs)`` whatever ``y``."""
    return lambda y: (level, slope, obs)


def trend(scales: Callable) -> Callable:
    """The local linear trend with two cumsums, its scales ``scales(y)``."""

    def model(y):
        sl, ss, so = scales(y)
        with pyro.plate("time", y.shape[0]):
            eta = pyro.sample("eta", dist.Normal(y.new_tensor(0.0), ss))
            eps = pyro.sample("eps", dist.Normal(y.new_tensor(0.0), sl))
        level = (eta.cumsum(-1) + eps).cumsum(-1)
        with pyro.plate("obs_time", y.shape[0]):
            pyro.sample("y", dist.Normal(level, so), obs=y)

    return model


def trend_loop(scales: Callable) -> Callable:
    """The same density, a ``pyro.markov`` loop on ``x_t = (slope_t, level_t - slope_t)``."""

    def model(y):
        sl, ss, so = scales(y)
        s = torch.stack([ss, sl]) if torch.is_tensor(ss) else y.new_tensor([ss, sl])
        A = y.new_tensor([[1.0, 0.0], [1.0, 1.0]])
        x = pyro.sample("x_0", dist.Normal(y.new_zeros(2), s).to_event(1))
        pyro.sample("y_0", dist.Normal(x.sum(), so), obs=y[0])
        for t in pyro.markov(range(1, len(y))):
            x = pyro.sample(f"x_{t}", dist.Normal(A @ x, s).to_event(1))
            pyro.sample(f"y_{t}", dist.Normal(x.sum(), so), obs=y[t])

    return model


def beside(scales: Callable, how: str) -> Callable:
    """Where the nested walk does not apply: ``how = 'parallel'``, two walks side by side
    (``cumsum(eta) + cumsum(eps)``, not nested); ``'shifted'``, the observation's loc reads
    another latent ``mu`` beside the two walks."""

    def model(y):
        sl, ss, so = scales(y)
        mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 1.0)) if how == "shifted" else 0
        with pyro.plate("time", y.shape[0]):
            eta = pyro.sample("eta", dist.Normal(y.new_tensor(0.0), ss))
            eps = pyro.sample("eps", dist.Normal(y.new_tensor(0.0), sl))
            if how == "parallel":
                loc = eta.cumsum(-1) + eps.cumsum(-1)
            else:
                loc = (eta.cumsum(-1) + eps).cumsum(-1) + mu
            pyro.sample("y", dist.Normal(loc, so), obs=y)

    model.__name__ = how
    return model


def check_guide_sites(guide, block, y: torch.Tensor, mean: torch.Tensor, tol: float) -> None:
    """The guide samples ``eta`` and ``eps`` in their plate ``time`` (the data's dtype), and
    the block's marginals of them, and the guide's median of ``eps``, are the increments of
    ``q(x)``'s means ``mean (T, 2)``: ``eta = diff(slope)``, ``eps_t = rest_t - rest_(t-1) -
    slope_(t-1)`` (``x_t = (slope_t, rest_t)``)."""
    tr = pyro.poutine.trace(guide).get_trace(y)
    for site in ("eta", "eps"):
        node = tr.nodes[site]
        assert node["value"].shape == y.shape and node["value"].dtype == y.dtype
        assert [f.name for f in node["cond_indep_stack"]] == ["time"]
    slope, rest = mean[:, 0], mean[:, 1]
    eta = torch.cat([slope[:1], slope.diff()])
    eps = torch.cat([rest[:1], rest[1:] - rest[:-1] - slope[:-1]])
    assert torch.allclose(block.marginal("eta").mean, eta, rtol=tol, atol=tol)
    assert torch.allclose(block.marginal("eps").mean, eps, rtol=tol, atol=tol)
    assert torch.allclose(guide.median(y)["eps"], eps, rtol=tol, atol=tol)


def simulate(T: int, dtype=torch.float64, level=0.2, obs=0.5, offset=0.0, slope=0.02):
    """``T`` observations of a trend with slope sd ``slope``, level sd ``level`` from
    ``offset``, noise sd ``obs`` (seed 0, drawn in float64, then ``dtype``)."""
    g = torch.Generator().manual_seed(0)
    s = (slope * torch.randn(T, generator=g, dtype=torch.float64)).cumsum(0)
    x = offset + (s + level * torch.randn(T, generator=g, dtype=torch.float64)).cumsum(0)
    return (x + obs * torch.randn(T, generator=g, dtype=torch.float64)).to(dtype)


def kalman_log_lik(y: torch.Tensor, sl2, ss2, so2) -> torch.Tensor:
    """``log p(y | scales)`` of the trend by a Kalman filter on ``(slope, level)``, at the
    variances ``sl2, ss2, so2`` (float64 tensors of one shape: one value each)."""
    y = y.double()
    m1, m2, p11, p12, p22, ll = (torch.zeros_like(sl2) for _ in range(6))
    for t in range(len(y)):
        m2 = m2 + m1
        p11, p12, p22 = p11 + ss2, p11 + p12 + ss2, p22 + 2 * p12 + p11 + ss2 + sl2
        S = p22 + so2
        r = y[t] - m2
        ll = ll - 0.5 * (torch.log(2 * math.pi * S) + r * r / S)
        k1, k2 = p12 / S, p22 / S
        m1, m2 = m1 + k1 * r, m2 + k2 * r
        p11, p12, p22 = p11 - k1 * p12, p12 - k1 * p22, p22 - k2 * p22
    return ll


def neg_log_evidence(y: torch.Tensor, level: float, slope: float, obs: float) -> float:
    """``-log p(y)`` of the trend at fixed scales."""
    var = (torch.tensor(v**2, dtype=torch.float64) for v in (level, slope, obs))
    return -float(kalman_log_lik(y, *var))


Bounds = Sequence[Tuple[float, float]]


def grid_neg_log_evidence(y: torch.Tensor, n: int, bounds: Bounds) -> float:
    """``-log p(y)`` of the trend with :func:`latent_scales`: ``log p(y | scales)`` at every
    point of an ``n^3`` grid of the log scales (``bounds``: ``(lo, hi)`` of ``log level``,
    ``log slope``, ``log obs``), times the priors (with the log's Jacobian), by the rule."""
    axes = [torch.linspace(a, b, n, dtype=torch.float64) for a, b in bounds]
    logs = [v.reshape(-1) for v in torch.meshgrid(*axes, indexing="ij")]
    ll = kalman_log_lik(y, *(torch.exp(2 * v) for v in logs))
    for v, s in zip(logs, PRIOR_SCALES):
        half = dist.HalfNormal(torch.tensor(s, dtype=torch.float64))
        ll = ll + half.log_prob(v.exp()) + v
    h = sum(math.log(float(a[1] - a[0])) for a in axes)
    return float(-(torch.logsumexp(ll, 0) + h))
