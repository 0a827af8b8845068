"""The associative-scan Kalman filter and RTS smoother (Sarkka & Garcia-Fernandez 2021).

The same problem as :mod:`.kalman` (prior chain x sites: ``log Z``, marginals, lag-one
covariances) as two all-prefix scans of ``ceil(log2 T)`` levels each, every level one batched
operation over the time axis (Hillis-Steele: ``O(T d^3 log T)`` work in few, large ops).

**Filtering elements** (the paper's parallel Kalman filter, with a log-normaliser carried
along): element ``k`` is ``(A_k, b_k, C_k, eta_k, J_k, g_k)``, the kernel

    (F1)  p(x_k | x_{k-1}, y_k) = N(x_k; A_k x_{k-1} + b_k, C_k),
          p(y_k | x_{k-1}) = exp(g_k + eta_k' x_{k-1} - x_{k-1}' J_k x_{k-1} / 2)

(:func:`.kalman.leaf`); neighbours combine by the paper's filtering operator (F2,
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

from . import kalman
from .soa import inv

__all__ = ["filter_scan", "smooth_scan"]


def _cat_first(head: tuple, rest: tuple) -> tuple:
    return tuple(torch.cat([h, r], 0) for h, r in zip(head, rest))


def filter_scan(el: Tuple) -> Tuple:
    """All inclusive prefixes ``e_0 o ... o e_k`` of packed, time-major filtering elements
    ``(A, b, C, eta, J, g)`` (Hillis-Steele: at level ``s`` every ``k >= s`` takes
    ``prefix_{k-s} o prefix_k``)."""
    T = el[5].shape[0]
    s = 1
    while s < T:
        later = tuple(t[s:] for t in el)
        earlier = tuple(t[: T - s] for t in el)
        combined, _ = kalman.combine(earlier, later)
        el = _cat_first(tuple(t[:s] for t in el), combined)
        s *= 2
    return el


def _smoothing_elements(chain: kalman.LinearGaussianChain, mf, Pf, batch):
    """``(E, g, L)`` of every step from the filtering means ``mf (T, *B, d, 1)`` and covariances
    ``Pf (T, *B, d, d)``; also the gains ``E`` for the lag-one covariances."""
    T, d = Pf.shape[0], Pf.shape[-1]
    if T == 1:
        return Pf.new_zeros(Pf.shape), mf, Pf

    def steps(M, tail):
        return M.expand(batch + (T - 1,) + tail).movedim(len(batch), 0)

    A = steps(chain.A, (d, d))
    b = steps(chain.b, (d,)).unsqueeze(-1)
    Q = steps(chain.Q, (d, d))
    m, P = mf[:-1], Pf[:-1]
    AP = A @ P
    S = AP @ A.transpose(-1, -2) + Q
    E = (inv(S) @ AP).transpose(-1, -2)  # P A' S^-1 (P, S symmetric)
    g = m - E @ (A @ m + b)
    L = P - E @ AP  # P - P A' S^-1 A P
    E = torch.cat([E, E.new_zeros(E[:1].shape)], 0)
    return E, torch.cat([g, mf[-1:]], 0), torch.cat([L, Pf[-1:]], 0)


def smoothing_scan(E, g, L):
    """All suffixes ``a_k o ... o a_{T-1}`` of the smoothing elements: the smoothed means and
    covariances (the suffix's ``E`` is zero)."""
    T = g.shape[0]
    s = 1
    while s < T:
        Ei, gi, Li = E[: T - s], g[: T - s], L[: T - s]
        Ej, gj, Lj = E[s:], g[s:], L[s:]
        EL = Ei @ Lj
        E = torch.cat([Ei @ Ej, E[T - s :]], 0)
        g = torch.cat([Ei @ gj + gi, g[T - s :]], 0)
        L = torch.cat([EL @ Ei.transpose(-1, -2) + Li, L[T - s :]], 0)
        s *= 2
    return g, L


def smooth_scan(
    chain: kalman.LinearGaussianChain, eta: torch.Tensor, J: torch.Tensor, lag_one: bool
):
    """``(log Z, means (T, *B, d, 1), covariances (T, *B, d, d), Cov(x_t, x_{t-1}) or None)``,
    time-major, by the two scans (module docstring). Grad mode is the caller's."""
    el = kalman._time_major(chain, eta, J, packed=True)
    batch = el[5].shape[1:]
    prefix = filter_scan(el)
    log_z = prefix[5][-1]
    kalman._check_log_z(log_z)
    mf, Pf = prefix[1], prefix[2]
    E, g, L = _smoothing_elements(chain, mf, Pf, batch)
    gains = E[:-1]
    m, S = smoothing_scan(E, g, L)
    cross = None
    if lag_one:
        cross = S[1:] @ gains.transpose(-1, -2)
        cross = torch.cat([cross.new_zeros(cross[:1].shape), cross], 0)
    return log_z, m, S, cross
