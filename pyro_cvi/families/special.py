"""Special functions shared by the Gamma, Beta and Dirichlet families.

Stable ``log x - digamma(x)``, ``x trigamma(x) - 1``, ``digamma(x) - digamma(x + d)`` and their
inverses (digamma inversion for the Gamma and Dirichlet mean -> natural maps).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

__all__ = [
    "log_minus_digamma",
    "inv_log_minus_digamma",
    "x_trigamma_minus_one",
    "digamma_diff",
    "inv_digamma",
    "dirichlet_from_mean_log",
    "exclusive_sum",
    "stirling_remainder",
    "dirichlet_entropy",
    "max_concentration",
]

# ---------------------------------------------------------------------------------------------
# Special functions
# ---------------------------------------------------------------------------------------------
# Asymptotic expansions (B_2k Bernoulli numbers), used for x >= _ASYMPTOTIC_MIN:
#   log x - psi(x) = 1/(2x) + sum_k B_2k / (2k x^2k)
#   x psi'(x) - 1  = 1/(2x) + sum_k B_2k / x^2k
_B2K = (1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66, -691 / 2730, 7 / 6)
_PSI_COEF = tuple(b / (2 * (k + 1)) for k, b in enumerate(_B2K))
_ASYMPTOTIC_MIN = 8.0
_EULER_GAMMA = 0.5772156649015329


def _poly_w(x: Tensor, coefs: Sequence[float]) -> Tensor:
    """``sum_k coefs[k] * x^{-2(k+1)}`` by Horner's rule in ``w = 1/x^2``."""
    w = x.reciprocal().square()
    acc = torch.zeros_like(x)
    for c in reversed(coefs):
        acc = (acc + c) * w
    return acc


def log_minus_digamma(x: Tensor) -> Tensor:
    """``log(x) - digamma(x) > 0`` without cancellation for large ``x``."""
    big = x >= _ASYMPTOTIC_MIN
    xb = torch.where(big, x, torch.full_like(x, _ASYMPTOTIC_MIN))
    xs = torch.where(big, torch.ones_like(x), x)
    series = 0.5 / xb + _poly_w(xb, _PSI_COEF)
    return torch.where(big, series, torch.log(xs) - torch.digamma(xs))


def stirling_remainder(x: Tensor) -> Tensor:
    """``r(x) = lgamma(x) - (x - 1/2) log x + x - log(2 pi) / 2`` (Stirling's remainder,
    ``~ 1 / (12 x)``), without the cancellation of ``lgamma(x) ~ x log x`` for large ``x``:
    the series ``sum_k B_2k / (2k (2k - 1) x^(2k-1))`` for ``x >= 8``."""
    big = x >= _ASYMPTOTIC_MIN
    xb = torch.where(big, x, torch.full_like(x, _ASYMPTOTIC_MIN))
    xs = torch.where(big, torch.ones_like(x), x)
    coefs = tuple(b / (2 * (k + 1) * (2 * k + 1)) for k, b in enumerate(_B2K))
    series = _poly_w(xb, coefs) * xb
    direct = torch.lgamma(xs) - (xs - 0.5) * torch.log(xs) + xs - 0.5 * math.log(2 * math.pi)
    return torch.where(big, series, direct)


def dirichlet_entropy(alpha: Tensor) -> Tensor:
    """Entropy of ``Dirichlet(alpha)`` over the last dim (``K`` categories; Beta is ``K = 2``),
    ``log B(alpha) + (a0 - K) psi(a0) - sum_j (a_j - 1) psi(a_j)``, written with
    :func:`stirling_remainder` ``r`` and ``l(x) = log x - psi(x)`` so that no term grows with
    the concentrations (the ``x log x`` terms cancel symbolically)::

        H = sum_j [log(a_j) / 2 + r(a_j) + (a_j - 1) l(a_j)] + (1/2 - K) log a0 - r(a0)
            - (a0 - K) l(a0) + (K - 1) log(2 pi) / 2

    Accurate in float32 where the textbook form loses every digit (``lgamma(1e6) ~ 1.3e7``)."""
    K = alpha.shape[-1]
    a0 = alpha.sum(-1)
    per = (
        0.5 * torch.log(alpha) + stirling_remainder(alpha) + (alpha - 1) * log_minus_digamma(alpha)
    )
    return (
        per.sum(-1)
        + (0.5 - K) * torch.log(a0)
        - stirling_remainder(a0)
        - (a0 - K) * log_minus_digamma(a0)
        + 0.5 * (K - 1) * math.log(2 * math.pi)
    )


def max_concentration(dtype: torch.dtype) -> float:
    """The largest concentration (Gamma shape, Beta/Dirichlet parameters) a ``q`` keeps in
    ``dtype``: ``1 / (16 eps)`` (5.2e5 in float32, 2.8e14 in float64). Beyond it ``q`` is a
    point mass to the dtype's precision (``sd(log z) ~ alpha^-1/2``), its mean parameters
    (``log mu2 - mu1 ~ 1 / (2 alpha)``) no longer determine it, and Monte Carlo messages
    summed over many steps drive it to meaningless values (float32 reached 2.6e9)."""
    return 1.0 / (16.0 * torch.finfo(dtype).eps)


def x_trigamma_minus_one(x: Tensor) -> Tensor:
    """``x * trigamma(x) - 1 > 0`` without cancellation for large ``x``."""
    big = x >= _ASYMPTOTIC_MIN
    xb = torch.where(big, x, torch.full_like(x, _ASYMPTOTIC_MIN))
    xs = torch.where(big, torch.ones_like(x), x)
    series = 0.5 / xb + _poly_w(xb, _B2K)
    return torch.where(big, series, xs * torch.polygamma(1, xs) - 1)


def _inv_trigamma_minus_x(x: Tensor) -> Tensor:
    """``1 / trigamma(x) - x`` (tends to -1/2 for large ``x``), computed stably."""
    big = x >= _ASYMPTOTIC_MIN
    xb = torch.where(big, x, torch.full_like(x, _ASYMPTOTIC_MIN))
    xs = torch.where(big, torch.ones_like(x), x)
    p = x_trigamma_minus_one(xb)
    return torch.where(big, -xb * p / (1 + p), torch.polygamma(1, xs).reciprocal() - xs)


def digamma_diff(x: Tensor, d: Tensor) -> Tensor:
    """``digamma(x) - digamma(x + d)`` for ``x > 0, d >= 0``, accurate even when ``d << x``.

    Shifts both arguments by 8 with ``psi(t) = psi(t + 1) - 1/t`` (every shifted term
    ``d / ((x+j)(x+d+j))`` is computed without cancellation) and uses the asymptotic
    expansion, written in terms of ``log1p(d/x)`` and ``expm1``, for the shifted pair.
    """
    n = int(_ASYMPTOTIC_MIN)
    y = x + d
    shift = sum(d / ((x + j) * (y + j)) for j in range(n))
    xs, ys = x + n, y + n
    lg = torch.log1p(d / xs)
    series = -lg - d / (2 * xs * ys)
    w = xs.reciprocal().square()
    wk = w
    for k, c in enumerate(_PSI_COEF, start=1):
        series = series + c * wk * torch.expm1(-2 * k * lg)
        wk = wk * w
    return series - shift


def _newton_tol(dtype: torch.dtype) -> float:
    """Step size below which one more (quadratically convergent) Newton step suffices."""
    return math.sqrt(torch.finfo(dtype).eps)


def inv_log_minus_digamma(s: Tensor, max_iter: int = 12) -> Tensor:
    """Solve ``log(a) - digamma(a) = s`` for ``a > 0`` (Gamma shape from mean parameters).

    Starts from Minka's closed form ``a0 = (3 - s + sqrt((s - 3)^2 + 24 s)) / (12 s)`` and
    runs Newton on ``log(log a - digamma(a)) = log s`` in ``u = log a``; that equation is
    nearly linear in ``u`` at both ends (slope -1), so the iteration converges in a few steps
    from anywhere. Steps are clipped to ``|du| <= 2``. Returns NaN where ``s <= 0`` or NaN.
    """
    valid = s > 0
    s_ = torch.where(valid, s, torch.ones_like(s))
    root = torch.sqrt((s_ - 3).square() + 24 * s_)
    a0 = torch.where(s_ > 3, 2 / (root + s_ - 3), (3 - s_ + root) / (12 * s_))
    u = torch.log(a0)
    log_s = torch.log(s_)
    tol, last = _newton_tol(s.dtype), False
    for _ in range(max_iter):
        a = torch.exp(u)
        fa = log_minus_digamma(a)
        step = (torch.log(fa) - log_s) * fa / x_trigamma_minus_one(a)
        step = step.clamp(-2.0, 2.0)
        u = u + step
        if last:
            break
        last = not bool((step.abs() > tol).any())
    return torch.where(valid, torch.exp(u), torch.full_like(s, float("nan")))


def inv_digamma(y: Tensor, num_iter: int = 6) -> Tensor:
    """Solve ``digamma(x) = y`` (Minka's initialisation followed by Newton)."""
    x = torch.where(y >= -2.22, torch.exp(y) + 0.5, -1 / (y + _EULER_GAMMA))
    for _ in range(num_iter):
        x = x - (torch.digamma(x) - y) / torch.polygamma(1, x)
        x = x.clamp(min=torch.finfo(y.dtype).tiny)
    return x


def exclusive_sum(a: Tensor) -> Tensor:
    """``sum_{j != k} a_j`` along the last dim, without subtracting ``a_k`` from the total."""
    zero = torch.zeros_like(a[..., :1])
    before = torch.cat([zero, a[..., :-1].cumsum(-1)], dim=-1)
    rev = a.flip(-1)
    after = torch.cat([zero, rev[..., :-1].cumsum(-1)], dim=-1).flip(-1)
    return before + after


def dirichlet_from_mean_log(mu: Tensor, max_iter: int = 20) -> Tensor:
    """Solve ``digamma(a_k) - digamma(sum_j a_j) = mu_k`` for ``a > 0`` (last dim ``K``).

    Initialisation: ``a0 = (K - 1) / (2 (1 - sum exp mu)) + 1/2`` (exact as all ``a_k -> inf``)
    followed by three of Minka's fixed-point steps ``a_k = psi^{-1}(psi(a0) + mu_k)``. Then
    Newton in ``u = log a`` with the Fisher matrix ``diag(psi'(a)) - psi'(a0) 1 1^T`` inverted
    by Sherman-Morrison; its denominator ``1 - psi'(a0) sum 1/psi'(a_k)`` is evaluated as
    ``psi'(a0) * (g(a0) - sum g(a_k))`` with ``g(x) = 1/psi'(x) - x`` to avoid cancellation.
    Steps are clipped to ``|du| <= 1``; iteration stops one step after all ``|du| < sqrt(eps)``
    (or after ``max_iter``). Invalid input (some ``mu_k >= 0``, or
    ``sum exp mu >= 1``) gives NaN.
    """
    k = mu.shape[-1]
    tiny = torch.finfo(mu.dtype).tiny
    valid = (mu < 0).all(-1, keepdim=True) & (torch.logsumexp(mu, -1, keepdim=True) < 0)
    mu_ = torch.where(valid, mu, torch.full_like(mu, -1.0))
    gap = -torch.expm1(torch.logsumexp(mu_, -1, keepdim=True))
    total = (k - 1) / (2 * gap) + 0.5
    for _ in range(3):
        a = inv_digamma(torch.digamma(total) + mu_)
        total = a.sum(-1, keepdim=True)
    u = torch.log(a)
    tol, last = _newton_tol(mu.dtype), False
    for _ in range(max_iter):
        a = torch.exp(u)
        a0 = a.sum(-1, keepdim=True)
        r = digamma_diff(a, exclusive_sum(a)) - mu_
        d = torch.polygamma(1, a)
        c = torch.polygamma(1, a0)
        denom = c * (_inv_trigamma_minus_x(a0) - _inv_trigamma_minus_x(a).sum(-1, keepdim=True))
        denom = denom.clamp(min=tiny)
        rd = r / d
        corr = c * rd.sum(-1, keepdim=True) / denom
        step = -(rd + corr / d) / a
        step = step.clamp(-1.0, 1.0)
        u = u + step
        if last:
            break
        last = not bool((step.abs() > tol).any())
    return torch.where(valid, torch.exp(u), torch.full_like(mu, float("nan")))
