"""The associative-scan Kalman filter and RTS smoother (Sarkka & Garcia-Fernandez 2021).

The same problem as :mod:`.kalman` (prior chain x sites: ``log Z``, marginals, lag-one
covariances) as two all-prefix scans of ``ceil(log2 T)`` levels each, every level one batched
operation over the time axis (Hillis-Steele: ``O(T d^3 log T)`` work in few, large ops).

**Filtering elements** (the paper's parallel Kalman filter, with a log-normaliser carried
along): element ``k`` is ``(A_k, b_k, C_k, eta_k, J_k, g_k)``, the kernel

    (F1)  p(x_k | x_{k-1}, y_k) = N(x_k; A_k x_{k-1} + b_k, C_k),
          p(y_k | x_{k-1}) = exp(g_k + eta_k' x_{k-1} - x_{k-1}' J_k x_{k-1} / 2)

(:func:`.elements.leaf`); neighbours combine by the paper's filtering operator (F2,
:func:`.kalman.combine`). Element 0 starts from a dummy ``x_{-1}`` (``A_0 = 0``), so the
inclusive prefix ``0..k`` holds the filtering law ``N(m^f_k, P^f_k)`` in its ``(b, C)`` and
``log p(y_{0..k})`` in its ``g``; the last ``g`` is ``log Z``.

**Smoothing elements**: ``x_k | x_{k+1}, y_{0..k} ~ N(E_k x_{k+1} + g_k, L_k)``, with

    (S1)  S_k = A_{k+1} P^f_k A_{k+1}' + Q_{k+1},   E_k = P^f_k A_{k+1}' S_k^-1,
          g_k = m^f_k - E_k (A_{k+1} m^f_k + b_{k+1}),   L_k = P^f_k - E_k A_{k+1} P^f_k,

and ``(0, m^f_{T-1}, P^f_{T-1})`` last. They combine (``i`` earlier) as

    (S2)  (E_i, g_i, L_i) o (E_j, g_j, L_j) = (E_i E_j, E_i g_j + g_i, E_i L_j E_i' + L_i),

and the suffix ``k..T-1`` is the smoothed ``N(m^s_k, P^s_k)``; the lag-one covariance is
``Cov(x_{k+1}, x_k) = P^s_{k+1} E_k'``.

All plain tensor ops (differentiable with ``keep_graph``); the small inverses are closed forms
for ``d <= 3`` (:func:`.soa.inv`). Leading batch dims as in :mod:`.kalman`.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .elements import LinearGaussianChain, check_log_z, time_major
from .soa import inv, inv_det

__all__ = ["filter_scan", "smooth_scan"]


def _filter_combine(Fi: torch.Tensor, gi: torch.Tensor, Fj: torch.Tensor, gj: torch.Tensor):
    """The filtering operator (F2) on elements stored as one tensor ``[A | b | C | eta | J]``
    ``(n, *B, d, 3d + 2)`` and ``g (n, *B)``; ``i`` earlier. With ``M = (I + C_i J_j)^-1``:
    ``A = A_j M A_i``, ``b = A_j M (b_i + C_i eta_j) + b_j``, ``C = A_j M C_i A_j' + C_j``,
    ``eta = A_i' M' (eta_j - J_j b_i) + eta_i``, ``J = A_i' M' J_j A_i + J_i`` and
    ``g = g_i + g_j + b_i' (eta_j - J_j b_i / 2) + r' M C_i r / 2 - log det(M^-1) / 2``
    (``r = eta_j - J_j b_i``); the products sharing a left factor share one matmul."""
    d = Fi.shape[-2]
    Ci, Aj = Fi[..., d + 1 : 2 * d + 1], Fj[..., :d]
    ej, Jj = Fj[..., 2 * d + 1 : 2 * d + 2], Fj[..., 2 * d + 2 :]
    CJ = Ci @ Jj
    CJ.diagonal(dim1=-2, dim2=-1).add_(1.0)
    Minv, det = inv_det(CJ)
    JAb = Jj @ Fi[..., : d + 1]  # [J_j A_i | J_j b_i]
    Jb = JAb[..., d:]
    r = ej - Jb
    Y = Minv @ Fi[..., : 2 * d + 1]  # [W | M b_i | P1], W = M A_i, P1 = M C_i
    P1 = Y[..., d + 1 :]
    Pe = P1 @ torch.cat([ej, r], -1)  # [P1 eta_j | P1 r]
    nu = Y[..., d : d + 1] + Pe[..., :1]
    Z = Aj @ torch.cat([Y[..., :d], nu, P1], -1)  # [A | A_j nu | A_j P1]
    W = Y[..., :d]
    eJ = W.transpose(-1, -2) @ torch.cat([r, JAb[..., :d]], -1)
    F = torch.cat([Z[..., : d + 1], Z[..., d + 1 :] @ Aj.transpose(-1, -2), eJ], -1)
    F[..., d : 2 * d + 1] += Fj[..., d : 2 * d + 1]  # + [b_j | C_j]
    F[..., 2 * d + 1 :] += Fi[..., 2 * d + 1 :]  # + [eta_i | J_i]
    quad = (Fi[..., d : d + 1] * (ej - 0.5 * Jb) + 0.5 * r * Pe[..., 1:]).sum((-2, -1))
    return F, (gi + gj + quad) - 0.5 * det.log()


def filter_scan(F: torch.Tensor, g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """All inclusive prefixes ``e_0 o ... o e_k`` of time-major filtering elements (Hillis-
    Steele: at level ``s`` every ``k >= s`` takes ``prefix_{k-s} o prefix_k``)."""
    T = g.shape[0]
    s = 1
    while s < T:
        Fn, gn = _filter_combine(F[: T - s], g[: T - s], F[s:], g[s:])
        F, g = torch.cat([F[:s], Fn], 0), torch.cat([g[:s], gn], 0)
        s *= 2
    return F, g


def _smoothing_elements(chain: LinearGaussianChain, mf, Pf, batch):
    """``[E | g | L] (T, *B, d, 2d + 1)`` of every step (S1) from the filtering means
    ``mf (T, *B, d, 1)`` and covariances ``Pf (T, *B, d, d)``."""
    T, d = Pf.shape[0], Pf.shape[-1]
    last = torch.cat([Pf.new_zeros(Pf[-1:].shape), mf[-1:], Pf[-1:]], -1)
    if T == 1:
        return last

    def steps(M, tail):
        return M.expand(batch + (T - 1,) + tail).movedim(len(batch), 0)

    A = steps(chain.A, (d, d))
    b = steps(chain.b, (d,)).unsqueeze(-1)
    Q = steps(chain.Q, (d, d))
    m, P = mf[:-1], Pf[:-1]
    APm = A @ torch.cat([P, m], -1)  # [A P | A m]
    AP = APm[..., :d]
    S = AP @ A.transpose(-1, -2) + Q
    E = (inv(S) @ AP).transpose(-1, -2)  # P A' S^-1 (P, S symmetric)
    Epm = E @ torch.cat([APm[..., d:] + b, AP], -1)  # [E (A m + b) | E A P]
    gL = torch.cat([m, P], -1) - Epm
    return torch.cat([torch.cat([E, gL], -1), last], 0)


def smoothing_scan(X: torch.Tensor) -> torch.Tensor:
    """All suffixes ``a_k o ... o a_{T-1}`` (S2) of the smoothing elements ``[E | g | L]``:
    the suffix's ``E`` is zero, its ``[g | L]`` the smoothed mean and covariance."""
    T, d = X.shape[0], X.shape[-2]
    s = 1
    while s < T:
        Xi = X[: T - s]
        Ei = Xi[..., :d]
        P = Ei @ X[s:]  # [E_i E_j | E_i g_j | E_i L_j]
        new = torch.cat([P[..., : d + 1], P[..., d + 1 :] @ Ei.transpose(-1, -2)], -1)
        new[..., d:] += Xi[..., d:]
        X = torch.cat([new, X[T - s :]], 0)
        s *= 2
    return X[..., d:]


def smooth_scan(chain: LinearGaussianChain, eta: torch.Tensor, J: torch.Tensor, lag_one: bool):
    """``(log Z, means (T, *B, d, 1), covariances (T, *B, d, d), Cov(x_t, x_{t-1}) or None)``,
    time-major, by the two scans (module docstring). Grad mode is the caller's."""
    A, b, C, e, Jl, g = time_major(chain, eta, J, packed=True)
    d = A.shape[-1]
    batch = g.shape[1:]
    F, g = filter_scan(torch.cat([A, b, C, e, Jl], -1), g)
    log_z = g[-1]
    check_log_z(log_z)
    X = _smoothing_elements(chain, F[..., d : d + 1], F[..., d + 1 : 2 * d + 1], batch)
    gains = X[:-1, ..., :d]
    gL = smoothing_scan(X)
    m, S = gL[..., :1], gL[..., 1:]
    cross = None
    if lag_one:
        cross = S[1:] @ gains.transpose(-1, -2)
        cross = torch.cat([cross.new_zeros(cross[:1].shape), cross], 0)
    return log_z, m, S, cross
