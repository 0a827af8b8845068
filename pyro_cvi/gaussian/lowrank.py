"""The natural-gradient step of a low-rank-plus-diagonal Gaussian.

For ``S = diag(s) (I + W W^T) diag(s)`` (``AutoLowRankMultivariateNormal``'s form) ``dl/dS``
cannot be recovered from the ``D (r + 1)`` gradients, so the step is the natural gradient of
the family itself, the Fisher-metric projection of the full one (Khan & Lin 2017, eqs. 10-13)
on the family's tangent space: ``m' = m - b S dl/dm`` (exact: the Fisher of ``m`` is ``P``),
and for ``theta = (log s, W)`` ``theta' = theta - b F^-1 dl/dtheta`` with ``F`` the Gaussian
Fisher ``F = 1/2 J^T (S^-1 (x) S^-1) J`` (independent of ``s``), solved by conjugate gradients
with matrix-free products at ``O(D r^2)`` each (``S^-1`` by Woodbury), at most 20 of them (up
to 256 parameters, ``F`` is formed by one batched product and solved exactly).
``s = exp(log s)`` stays positive for every ``b``.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .steps import MEAN_MAX_MOVE

__all__ = ["lowrank_fisher_mv", "lowrank_step"]

_LOWRANK_MAX_MOVE = 5.0
#: low-rank Gaussians with at most this many covariance parameters get the exact Fisher solve
_DENSE_FISHER = 256


def lowrank_fisher_mv(
    W: torch.Tensor, v_rho: torch.Tensor, V: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The Fisher-vector product of ``N(0, diag(e^rho) K diag(e^rho))``, ``K = I + W W^T``,
    in ``(rho, W)`` at direction ``(v_rho, V)``; independent of ``rho``. With
    ``E = diag(v) K + K diag(v) + V W^T + W V^T`` (``dS = D E D``) and
    ``F = 1/2 tr(K^-1 E K^-1 E')``: ``F v = (diag(E K^-1), K^-1 E K^-1 W)``, in ``O(D r^2)``
    with ``K^-1 = I - W C W^T``, ``C = (I + W^T W)^-1``, ``K^-1 W = W C``."""
    r = W.shape[-1]
    eye = torch.eye(r, dtype=W.dtype, device=W.device)
    C: torch.Tensor = torch.linalg.inv(eye + W.T @ W)
    WC = W @ C
    M = W.T @ (v_rho[..., :, None] * W)  # W^T diag(v) W (batched over leading dims of v)

    def kinv(X: torch.Tensor) -> torch.Tensor:  # K^-1 X
        return X - WC @ (W.T @ X)

    # diag(E K^-1) = v + diag(K diag(v) K^-1) + diag((V W^T + W V^T) K^-1)
    ww = (W * W).sum(-1)
    d_kvk = v_rho + ww * v_rho - v_rho * (W * WC).sum(-1) - (W * (WC @ M.mT)).sum(-1)
    d_vw = (V * WC).sum(-1) + (W * kinv(V)).sum(-1)
    f_rho = v_rho + d_kvk + d_vw
    # K^-1 E K^-1 W = K^-1 (E W) C,  E W = diag(v) K W + K diag(v) W + V W^T W + W V^T W
    KW = W + W @ (W.T @ W)
    vW = v_rho[..., :, None] * W
    EW = v_rho[..., :, None] * KW + vW + W @ M + V @ (W.T @ W) + W @ (V.mT @ W)
    f_W = kinv(EW) @ C
    return f_rho, f_W


_Vec = Tuple[torch.Tensor, ...]


def _cg(mv: Callable[[_Vec], _Vec], b: _Vec, iters: int, tol: float) -> _Vec:
    """Conjugate gradients for ``A x = b`` (a tuple of tensors, ``A`` PSD)."""
    x = tuple(torch.zeros_like(t) for t in b)
    r = b
    p = r
    rr = sum((t * t).sum() for t in r)
    stop = tol * tol * rr
    for _ in range(iters):
        if not bool(rr > stop) or not bool(rr > 0):
            break
        Ap = mv(p)
        pAp = sum((a * q).sum() for a, q in zip(Ap, p))
        if not bool(pAp > 0):
            break
        alpha = rr / pAp
        x = tuple(xi + alpha * pi for xi, pi in zip(x, p))
        r = tuple(ri - alpha * ai for ri, ai in zip(r, Ap))
        rr_new = sum((t * t).sum() for t in r)
        p = tuple(ri + (rr_new / rr) * pi for ri, pi in zip(r, p))
        rr = rr_new
    return x


def lowrank_step(
    m: torch.Tensor,
    s: torch.Tensor,
    W: torch.Tensor,
    gm: torch.Tensor,
    gs: torch.Tensor,
    gW: torch.Tensor,
    beta: float,
    max_rel: Optional[float] = None,
    cg_iters: int = 20,
    damping: float = 1e-2,
    beta_mean: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """One natural step of ``N(m, diag(s) (I + W W^T) diag(s))`` (Pyro's low-rank form).

    ``F`` is singular along rotations ``W -> W Q`` (``W W^T`` is unchanged), while a
    reparameterised one-sample gradient is not rotation invariant: ``F + damping I``
    (Levenberg-Marquardt; ``F`` is O(1) here, ``F = 2 I`` in ``log s`` at ``W = 0``) keeps the
    solve bounded. ``max_rel`` (the adaptive step; 5 for a fixed one, where ``exp`` would
    otherwise underflow ``s`` to 0 in float32) caps ``b`` so that no ``log s`` or ``W`` entry
    moves by more than that in one step. Returns ``(m', s', W', d)``."""
    dtype = m.dtype
    m, s, W, gm, gs, gW = (t.double() for t in (m, s, W, gm, gs, gW))
    g_rho = gs * s

    def mv(v: _Vec) -> _Vec:
        f_rho, f_W = lowrank_fisher_mv(W, v[0], v[1])
        return f_rho + damping * v[0], f_W + damping * v[1]

    n = s.numel() + W.numel()
    if n <= _DENSE_FISHER:  # small: the exact solve, one batched product for all of F
        eye = torch.eye(n, dtype=W.dtype, device=W.device)
        f_rho, f_W = lowrank_fisher_mv(
            W, eye[:, : s.numel()], eye[:, s.numel() :].reshape(n, *W.shape)
        )
        F = torch.cat([f_rho, f_W.reshape(n, -1)], -1)
        F = 0.5 * (F + F.T) + damping * eye
        x = torch.cholesky_solve(
            torch.cat([g_rho, gW.reshape(-1)])[:, None], torch.linalg.cholesky(F)
        )
        x_rho, x_W = x[: s.numel(), 0], x[s.numel() :, 0].reshape(W.shape)
    else:
        x_rho, x_W = _cg(mv, (g_rho, gW), cg_iters, 1e-8)
    b = float(beta)
    cap = _LOWRANK_MAX_MOVE if max_rel is None else max_rel
    big = max(float(x_rho.abs().max()), float(x_W.abs().max()) if x_W.numel() else 0.0)
    if big * b > cap:
        b = cap / big
    s_new = s * torch.exp(-b * x_rho)
    W_new = W - b * x_W
    # S' dl/dm = s' * ((I + W' W'^T) (s' * dl/dm)), O(D r)
    u = s_new * gm
    bm = b if beta_mean is None else beta_mean
    step = bm * s_new * (u + W_new @ (W_new.T @ u))
    if max_rel is not None:
        sd = s_new * (1.0 + (W_new * W_new).sum(-1)).sqrt()
        z = float((step.abs() / sd).max())
        step = step * (MEAN_MAX_MOVE / max(z, MEAN_MAX_MOVE))
    m_new = m - step
    marg = s * (1.0 + (W * W).sum(-1)).sqrt()
    d = (marg * gm, torch.cat([x_rho, x_W.reshape(-1)]))
    return m_new.to(dtype), s_new.to(dtype), W_new.to(dtype), d
