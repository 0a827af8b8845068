"""Natural-gradient directions of a Gaussian from the gradient at its draws: no Hessian.

For ``q = N(m, S)``, ``P = S^-1``, over a log joint ``log N(u; a, P0^-1) + f(u)`` whose
Gaussian part (a known prior, ``P0`` diagonal, zero where unknown) is handled exactly, and the
gradients ``g_k = grad f(u_k)`` at draws ``u_k = m + L eps_k``: the residual
``r_k = g_k + (P - P0)(u_k - m)`` (control variate of mean zero; exact where ``f`` is
quadratic with Hessian ``-(P - P0)``) gives the loss gradient in ``m`` (Bonnet, Khan & Lin
2017, eq. 30) and the precision's natural-gradient direction ``G = P0 - E[hess f] - P`` by
Stein's lemma ``E[hess f] = E[S^-1 (u - m) grad f^T]`` (eq. 31; Lin, Schmidt & Khan 2020,
eq. 7)::

    dl/dm = -mean_k r_k + P0 (m - a),    G = -sym(mean_k L^-T eps_k r_k^T)

Diagonal ``S = diag(s^2)``: ``G = -mean_k r_k eps_k / s`` (IVON's ``g (z - m) / s^2``).

``center`` (an estimate of ``E[r]`` independent of the draws: the moving average of past
steps' ``-dl/dm``) is subtracted from ``r`` in ``G`` only: ``E[c eps^T] = 0`` for any ``c``
independent of ``eps``, and far from the optimum ``r``'s mean, not its fluctuation, is what
makes the one-draw ``G`` noisy (``|E r| / s`` where ``E r`` is large and ``s`` small).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .retraction import retract, retract_diagonal
from .steps import MEAN_MAX_MOVE

__all__ = [
    "known_prior_expectation",
    "onedraw_diag",
    "onedraw_diag_step",
    "onedraw_tril",
    "onedraw_tril_step",
]


def onedraw_diag(
    s: Tensor, eps: Tensor, g: Tensor, p0: Tensor, center: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor]:
    """``(-mean r, G)`` for ``N(m, diag(s^2))``: draws ``m + s eps`` (rows ``[K, D]``),
    gradients ``g [K, D]`` of ``f``, prior precisions ``p0 [D]`` (the prior's mean gradient
    ``P0 (m - a)`` is the caller's)."""
    r = g + (s.pow(-2) - p0) * (s * eps)
    rc = r if center is None else r - center
    return -r.mean(0), -(rc * eps).mean(0) / s


def onedraw_tril(
    L: Tensor, eps: Tensor, g: Tensor, p0: Tensor, center: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor]:
    """``(-mean r, G)`` for ``N(m, L L^T)`` (``G`` symmetric ``[D, D]``), in ``L``'s dtype."""
    P = torch.cholesky_inverse(L)
    dz = eps @ L.mT
    r = g + dz @ P - dz * p0
    rc = r if center is None else r - center
    U = torch.linalg.solve_triangular(L.mT, eps.mT, upper=True)  # columns L^-T eps_k
    G = -(U @ rc) / eps.shape[0]
    return -r.mean(0), 0.5 * (G + G.mT)


def known_prior_expectation(m: Tensor, var: Tensor, a: Tensor, p0: Tensor) -> Tensor:
    """``E_q[-P0 (u - a)^2 / 2]`` summed (the known prior's log density up to its constant),
    from ``q``'s means ``m`` and marginal variances ``var``: differentiable in both."""
    return -0.5 * (p0 * ((m - a).pow(2) + var)).sum()


#: the largest relative change of the likelihood's precision in one step (``b |G| <= MAX_REL h``,
#: whitened for full covariance): a one-draw ``G`` can exceed ``h / rho`` many times over (a
#: funnel's scale far from its optimum), and an uncapped retraction would then multiply ``h`` by
#: large random factors
MAX_REL = 0.2

#: the same cap on an increase of a diagonal ``h`` (``G > 0``): at most ``h + h + h / 2`` in one
#: step. Curvature that appears suddenly (a network's hidden unit coming alive) must be followed
#: at once: the mean's Newton step ``alpha gm / p`` on a stale, too small ``p`` overshoots by the
#: ratio, and the cap of ``MEAN_MAX_MOVE`` sd per coordinate does not stop a thousand
#: coordinates moving together. A decrease (``G < 0``) keeps ``MAX_REL``: too large a ``p``
#: only slows the mean.
MAX_REL_UP = 1.0


def _spectral_norm(A: Tensor, iters: int = 8) -> Tensor:
    """``||A||_2`` of a symmetric ``A`` by power iteration (a lower estimate, ``O(D^2)`` a
    step), from a fixed start."""
    v = torch.ones(A.shape[-1], dtype=A.dtype, device=A.device)
    for _ in range(iters):
        w = A @ v
        n = w.norm()
        if not bool(n > 0):
            return n
        v = w / n
    return (A @ v).norm()


def onedraw_diag_step(
    m: Tensor, s: Tensor, gm: Tensor, G: Tensor, p0: Tensor, rho: float, alpha: float
) -> Tuple[Tensor, Tensor, Tuple[Tensor, Tensor]]:
    """One step of ``N(m, diag(s^2))`` with the known prior precisions ``p0``: the
    likelihood's part ``h = p - p0`` moves by the positive retraction ``h + b G + (b G)^2 /
    (2 h)`` (``b = rho``, at most ``MAX_REL h / |G|`` per element where ``G < 0`` and
    ``MAX_REL_UP h / |G|`` where ``G > 0``), so that ``p = p0 + h > p0`` at every step; then
    ``m' = m - alpha gm / p'``, at most ``MEAN_MAX_MOVE`` sd of ``q'``. Returns ``(m', s', d)``
    with the whitened directions ``d``."""
    p = s.pow(-2)
    tiny = torch.finfo(p.dtype).eps
    h = (p - p0).clamp_min(1e-3 * p)
    cap = torch.where(G > 0, torch.full_like(h, MAX_REL_UP), torch.full_like(h, MAX_REL))
    b = torch.minimum(torch.full_like(h, rho), cap * h / G.abs().clamp_min(tiny * h))
    p_new = p0 + retract_diagonal(h, G, b)
    step = alpha * gm / p_new
    z = step.abs() * p_new.sqrt()
    step = step * (MEAN_MAX_MOVE / z.clamp_min(MEAN_MAX_MOVE))
    return m - step, p_new.rsqrt(), (s * gm, G / p)


def onedraw_tril_step(
    m: Tensor, L: Tensor, gm: Tensor, G: Tensor, p0: Tensor, rho: float, alpha: float
) -> Tuple[Tensor, Tensor, Tuple[Tensor, Tensor]]:
    """One step of ``N(m, L L^T)`` with the known prior precisions ``p0`` (diagonal), in
    float64 inside: the likelihood's part ``H = P - diag(p0)`` moves by the retraction of
    Lin, Schmidt & Khan (2020) ``H / 2 + (H + b G) H^-1 (H + b G) / 2`` (positive definite
    for every ``G``; ``b = rho``, at most ``MAX_REL / ||H^-1/2 G H^-1/2||_2``), ``P' = H' +
    diag(p0)``, then ``m' = m - alpha S' gm``, at most ``MEAN_MAX_MOVE`` sd of ``q'``.
    Returns ``(m', L', d)``; a step that cannot be factorised returns a non-finite ``m'``
    (the caller keeps ``q``)."""
    dtype = m.dtype
    m, L, gm, G, p0 = (t.double() for t in (m, L, gm, G, p0))
    P = torch.cholesky_inverse(L)
    H = P - torch.diag_embed(p0)
    LH, info = torch.linalg.cholesky_ex(H)
    if int(info) != 0:  # the prior tighter than q (at the start): the part above 1e-3 P
        evals, evecs = torch.linalg.eigh(H)
        floor = 1e-3 * float(P.diagonal().min())
        H = (evecs * evals.clamp_min(floor)) @ evecs.mT
        LH = torch.linalg.cholesky(0.5 * (H + H.mT))
    W = torch.linalg.solve_triangular(LH, G, upper=False)
    W = torch.linalg.solve_triangular(LH, W.mT, upper=False)  # LH^-1 G LH^-T
    norm = float(_spectral_norm(0.5 * (W + W.mT)))
    b = min(float(rho), MAX_REL / norm) if norm > 0 else float(rho)
    H_new = retract(
        H, G, torch.cholesky_inverse(LH), torch.tensor(b, dtype=H.dtype, device=H.device)
    )
    P_new = H_new + torch.diag_embed(p0)
    LP, info = torch.linalg.cholesky_ex(0.5 * (P_new + P_new.mT))
    if int(info) != 0:
        nan = torch.full_like(m, float("nan"))
        return nan.to(dtype), L.to(dtype), (nan, G.reshape(-1))
    S_new = torch.cholesky_inverse(LP)
    L_new = torch.linalg.cholesky(0.5 * (S_new + S_new.mT))
    step = alpha * (S_new @ gm)
    z = float((step.abs() / S_new.diagonal().sqrt()).max())
    step = step * (MEAN_MAX_MOVE / max(z, MEAN_MAX_MOVE))
    d = (L.mT @ gm, (L.mT @ G @ L).reshape(-1))
    return (m - step).to(dtype), L_new.to(dtype), d
