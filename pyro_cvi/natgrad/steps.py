"""Natural-gradient (CVI) steps of a Gaussian ``q = N(m, S)`` from the loss gradients.

CVI's mirror-descent step (Khan & Lin 2017, eqs. 10-13) for a Gaussian is, with the loss
``l = -L`` (Pyro's sign) and its gradients ``dl/dm``, ``dl/dS`` (symmetric)::

    P'  = P + b G,              G = 2 dl/dS = -2 dL/dS        (natural parameter -P/2, eq. 12)
    m'  = m - b S' dl/dm                                       (natural parameter P m)

since ``grad_mu L`` is ``(dL/dm - 2 dL/dS m, dL/dS)``. On a conjugate Gaussian model with exact
gradients, ``b = 1`` gives the exact posterior in one step (``G = P_post - P``, and
``-S' dl/dm = m_post - m``). ``G`` may be indefinite under Monte Carlo noise or
non-convexity; the default ``retraction`` form (Lin, Schmidt & Khan 2020, eq. 9)::

    P' = P + b G + (b^2 / 2) G S G = P / 2 + (P + b G) S (P + b G) / 2

is positive definite for every symmetric ``G`` and every ``b``: no step makes ``S'`` invalid.
The ``"natural"`` form keeps the plain step and halves ``b`` (per Gaussian, per element for a
diagonal one) until ``P'`` is positive definite. ``beta_mean`` (the adaptive step) gives the
mean its own step size: a block-diagonal scaling of the natural gradient, still an ascent
direction, and the mean's direction is far less noisy than ``G``'s under Monte Carlo.

``dl/dS`` comes from the gradients of the guide's own parameterisation by the chain rule:
diagonal ``S = diag(s^2)``: ``dl/dS = (dl/ds) / (2 s)``; Cholesky ``S = L L^T``: the reverse
mode of the Cholesky factorisation (``dl/dS = Phi(L^T dl/dL)`` pulled back by ``L^-1``),
taken from torch's own ``cholesky`` backward.

Low rank ``S = diag(s) (I + W W^T) diag(s)`` (``AutoLowRankMultivariateNormal``): ``dl/dS``
cannot be recovered from the ``D (r + 1)`` gradients, so the step is the natural gradient of
the family itself, the Fisher-metric projection of the full one on the family's tangent space:
``m' = m - b S dl/dm`` (exact: the Fisher of ``m`` is ``P``), and for ``theta = (log s, W)``
``theta' = theta - b F^-1 dl/dtheta`` with ``F`` the Gaussian Fisher
``F = 1/2 J^T (S^-1 (x) S^-1) J`` (independent of ``s``), solved by conjugate gradients with
matrix-free products at ``O(D r^2)`` each (``S^-1`` by Woodbury), at most 20 of them (up to
256 parameters, ``F`` is formed by one batched product and solved exactly).
``s = exp(log s)`` stays positive for every ``b``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..update import halve_until_valid

__all__ = [
    "chol_grad_to_cov_grad",
    "diag_step",
    "tril_step",
    "lowrank_fisher_mv",
    "lowrank_step",
]

_MAX_HALVINGS = 40
_LOWRANK_MAX_MOVE = 5.0
#: the adaptive step moves the mean by at most this many marginal standard deviations of q'
MEAN_MAX_MOVE = 3.0
#: low-rank Gaussians with at most this many covariance parameters get the exact Fisher solve
_DENSE_FISHER = 256


def diag_step(
    m: torch.Tensor,
    s: torch.Tensor,
    gm: torch.Tensor,
    gs: torch.Tensor,
    beta: float,
    retraction: bool = True,
    max_rel: Optional[float] = None,
    beta_mean: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """One step of independent Normals ``N(m_i, s_i^2)`` (any shape, element-wise): ``G =
    2 dl/dv = (dl/ds) / s``. Returns ``(m', s', d)``; ``d`` is the whitened direction
    ``(s dl/dm, G s^2)``, dimensionless, for the noise control. ``max_rel`` caps the
    relative precision change ``b |G| / P`` per element (a trust region; see
    :func:`tril_step`)."""
    p = s.pow(-2)
    g = gs / s
    b = torch.full_like(p, beta)
    if max_rel is not None:
        b = torch.minimum(b, max_rel * p / g.abs().clamp_min(torch.finfo(p.dtype).tiny))
    if retraction:
        p_new = p + b * g + 0.5 * (b * g).pow(2) / p
    else:
        p_new, b, ok, _ = halve_until_valid(
            lambda b: p + b * g, lambda new: new > 0, b, _MAX_HALVINGS
        )
        p_new = torch.where(ok, p_new, p)
    bm = b if beta_mean is None else torch.full_like(p, beta_mean)
    step = bm * gm / p_new
    if max_rel is not None:  # at most MEAN_MAX_MOVE standard deviations of q' per step
        z = step.abs() * p_new.sqrt()
        step = step * (MEAN_MAX_MOVE / z.clamp_min(MEAN_MAX_MOVE))
    m_new = m - step
    return m_new, p_new.rsqrt(), ((s * gm).reshape(-1), (g / p).reshape(-1))


def chol_grad_to_cov_grad(L: torch.Tensor, gL: torch.Tensor) -> torch.Tensor:
    """``dl/dS`` (symmetric) from ``dl/dL`` for ``L = cholesky(S)`` (lower triangles only)."""
    with torch.enable_grad():
        S = (L @ L.transpose(-1, -2)).detach().requires_grad_(True)
        Lc = torch.linalg.cholesky(S)
        (gS,) = torch.autograd.grad(Lc, S, gL.tril())
    return 0.5 * (gS + gS.transpose(-1, -2))


def _chol_inverse(L: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device).expand_as(L)
    Linv = torch.linalg.solve_triangular(L, eye, upper=False)
    return Linv.transpose(-1, -2) @ Linv


def tril_step(
    m: torch.Tensor,
    L: torch.Tensor,
    gm: torch.Tensor,
    gL: torch.Tensor,
    beta: float,
    retraction: bool = True,
    max_rel: Optional[float] = None,
    beta_mean: Optional[float] = None,
    G: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """One step of ``N(m, L L^T)`` (batched over leading dims), in float64 inside.
    Returns ``(m', L', d)`` with ``d = (L^T dl/dm, L^T G L)`` whitened. ``G = 2 dl/dS`` may be
    given instead of ``gL`` (e.g. by Price's theorem, ``G = -E_q[grad^2 log p] - S^-1``).

    ``max_rel`` (the adaptive step only) caps ``b`` so that the whitened precision change
    ``b ||L^T G L||_2`` is at most ``max_rel``: under heavy Monte Carlo noise the retraction's
    ``b^2 G S G / 2``, positive whatever the sign of ``G``, would otherwise inflate the
    precision (collapse ``S``) systematically."""
    dtype = m.dtype
    m, L, gm = (t.double() for t in (m, L, gm))
    G = 2.0 * chol_grad_to_cov_grad(L, gL.double()) if G is None else G.double()
    P = _chol_inverse(L)
    S = L @ L.transpose(-1, -2)
    b = torch.full(P.shape[:-2] + (1, 1), float(beta), dtype=P.dtype, device=P.device)
    Lt = L.transpose(-1, -2)
    white = Lt @ G @ L
    if not bool(torch.isfinite(white).all() and torch.isfinite(gm).all()):
        nan = torch.full_like(m, float("nan"))  # the caller skips a non-finite step
        return nan.to(dtype), L.to(dtype), (nan, white.reshape(-1))
    if max_rel is not None:
        norm = torch.linalg.matrix_norm(white, ord=2)[..., None, None]
        b = torch.minimum(b, max_rel / norm.clamp_min(torch.finfo(P.dtype).tiny))
    if retraction:
        A = P + b * G
        P_new = 0.5 * P + 0.5 * (A @ S @ A)
        LP, info = torch.linalg.cholesky_ex(0.5 * (P_new + P_new.transpose(-1, -2)))
    else:
        last = {}

        def factor_ok(new):  # (the last factorisation is the step's: kept, not redone)
            last["LP"], last["info"] = torch.linalg.cholesky_ex(new)
            return (last["info"] == 0)[..., None, None]

        P_new, b, _, _ = halve_until_valid(lambda b: P + b * G, factor_ok, b, _MAX_HALVINGS)
        LP, info = last["LP"], last["info"]
    if bool((info > 0).any()):  # round-off only (retraction) or no valid step: keep q
        keep = (info > 0)[..., None, None]
        P_new = torch.where(keep, P, P_new)
        b = torch.where(keep, torch.zeros_like(b), b)
        LP = torch.linalg.cholesky(0.5 * (P_new + P_new.transpose(-1, -2)))
    S_new = torch.cholesky_inverse(LP)
    L_new = torch.linalg.cholesky(0.5 * (S_new + S_new.transpose(-1, -2)))
    bm = b[..., 0] if beta_mean is None else beta_mean
    step = bm * (S_new @ gm.unsqueeze(-1)).squeeze(-1)
    if max_rel is not None:
        z = (step.abs() / S_new.diagonal(dim1=-2, dim2=-1).sqrt()).amax(-1, keepdim=True)
        step = step * (MEAN_MAX_MOVE / z.clamp_min(MEAN_MAX_MOVE))
    m_new = m - step
    d = ((Lt @ gm.unsqueeze(-1)).reshape(-1), white.reshape(-1))
    return m_new.to(dtype), L_new.to(dtype), d


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
    C = torch.linalg.inv(eye + W.T @ W)
    WC = W @ C
    M = W.T @ (v_rho[..., :, None] * W)  # W^T diag(v) W (batched over leading dims of v)

    def kinv(X):  # K^-1 X
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


def _cg(mv, b, iters: int, tol: float):
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

    def mv(v):
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
