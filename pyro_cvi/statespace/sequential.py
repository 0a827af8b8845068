"""The Kalman filter and RTS smoother as one sequential pass of scalar arithmetic (``d <= 2``).

The same problem as :mod:`.kalman` and :mod:`.scan` (prior chain x sites: ``log Z``, smoothed
marginals, lag-one covariances) for short chains of small states, where a torch operation's
fixed cost (microseconds) is worth hundreds of floating-point operations: every ``d x d`` product
is written out on Python floats (float64), so a step costs no dispatch at all. Forward, from
``N(m, P)`` predicted at step ``t`` (``m_0, P_0``; then ``m = A_t m + b_t``,
``P = A_t P A_t' + Q_t``), the site ``exp(eta' x - x' J x / 2)`` gives

    S = I + P J,   P^f = S^-1 P = (P^-1 + J)^-1,   r = eta - J m,   m^f = m + P^f r,
    log Z += m' (eta - J m / 2) + r' P^f r / 2 - log det S / 2,

(the Gaussian integral of the site under ``N(m, P)``); backward (Rauch-Tung-Striebel), with
``G_t = P^f_t A_{t+1}' P_{t+1}^-1`` (``P_{t+1}`` predicted),

    m^s_t = m^f_t + G_t (m^s_{t+1} - m_{t+1}),   P^s_t = P^f_t + G_t (P^s_{t+1} - P_{t+1}) G_t',
    Cov(x_{t+1}, x_t) = P^s_{t+1} G_t'.

No graph (the caller's ``keep_graph`` takes a tensor strategy), no batch dims, CPU tensors only;
anything else, and a step whose ``det S`` or ``det P_{t+1}`` is not positive (``q`` not
positive definite, or a singular prediction), goes to the tensor strategy it stands in for,
which decides (and raises) as before.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Iterator, List, Optional, Tuple, Union

import torch

from .elements import LinearGaussianChain, check_log_z

__all__ = ["SequentialSmoother", "applies"]

Result = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


class _Fail(Exception):
    """A non-positive determinant: hand the problem to the tensor strategy."""


def applies(chain: LinearGaussianChain, eta: torch.Tensor, J: torch.Tensor) -> bool:
    """Whether the scalar pass can take the problem: one chain (no batch dims) of ``d <= 2``
    on the CPU, without autograd."""
    d = eta.shape[-1]
    return (
        d <= 2
        and eta.dim() == 2
        and J.dim() == 3
        and chain.A.dim() == 3
        and chain.m0.dim() == 1
        and eta.device.type == "cpu"
        and not torch.is_grad_enabled()
    )


def _rows(chain: LinearGaussianChain, eta: torch.Tensor, J: torch.Tensor, d: int):
    """Python lists: the prior's start, the transitions ``[A | b | Q]`` and the sites ``[eta |
    J]``, one flat row per step (float64)."""
    f64 = torch.float64
    T = eta.shape[0]
    n = T - 1
    A = chain.A.to(f64).expand(n, d, d).reshape(n, d * d)
    b = chain.b.to(f64).expand(n, d)
    Q = chain.Q.to(f64).expand(n, d, d).reshape(n, d * d)
    rows = torch.cat([A, b, Q], 1)
    bits = rows.view(torch.int64)  # (bit for bit: -0.0 and NaN rows count as different)
    if n > 1 and bool((bits == bits[:1]).all()):  # one transition for every step: one row
        trans: Transitions = _Repeated(rows[0].tolist(), n)
    else:
        trans = rows.tolist() if n > 0 else []
    if d == 2 and _first_coordinate(eta, J):
        sites = torch.stack([eta[:, 0], J[:, 0, 0]], 1).to(f64).tolist()
    else:
        sites = torch.cat([eta.to(f64), J.to(f64).reshape(T, d * d)], 1).tolist()
    return chain.m0.to(f64).tolist(), chain.P0.to(f64).reshape(-1).tolist(), trans, sites


def _first_coordinate(eta: torch.Tensor, J: torch.Tensor) -> bool:
    """Whether every site lies on the first coordinate (``eta_t = (e, 0)``, ``J_t = diag(j,
    0)``; exact zeros, so a NaN elsewhere keeps the general pass)."""
    rest = torch.cat([eta[:, 1:], J.reshape(J.shape[0], -1)[:, 1:]], 1)
    return not bool(rest.any())


class _Repeated:
    """``n`` copies of one transition row, indexed as the list of them."""

    __slots__ = ("row", "n")

    def __init__(self, row: List[float], n: int):
        self.row, self.n = row, n

    def __getitem__(self, t: int) -> List[float]:
        return self.row

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[List[float]]:
        return itertools.repeat(self.row, self.n)


Transitions = Union[List[List[float]], _Repeated]


def _pass_1(m0, P0, trans, sites, lag_one: bool):
    """``d = 1``: ``(log Z, means, variances, Cov(x_t, x_{t-1}))`` as lists."""
    m, P = m0[0], P0[0]
    log_z = 0.0
    mf: List[float] = []
    Pf: List[float] = []
    mp: List[float] = [m]
    Pp: List[float] = [P]
    for t, (e, j) in enumerate(sites):
        if t:
            a, bb, q = trans[t - 1]
            m, P = a * m + bb, a * P * a + q
            mp.append(m)
            Pp.append(P)
        s = 1.0 + P * j
        if not s > 0.0:
            raise _Fail
        Pn = P / s
        jm = j * m
        r = e - jm
        log_z += m * (e - 0.5 * jm) + 0.5 * r * Pn * r - 0.5 * math.log(s)
        m, P = m + Pn * r, Pn
        mf.append(m)
        Pf.append(P)
    T = len(sites)
    ms, Ps, X = [0.0] * T, [0.0] * T, [0.0] * T
    ms[-1], Ps[-1] = mf[-1], Pf[-1]
    for t in range(T - 2, -1, -1):
        a = trans[t][0]
        pp = Pp[t + 1]
        if not pp > 0.0:
            raise _Fail
        g = Pf[t] * a / pp
        ms[t] = mf[t] + g * (ms[t + 1] - mp[t + 1])
        Ps[t] = Pf[t] + g * (Ps[t + 1] - pp) * g
        X[t + 1] = Ps[t + 1] * g
    return log_z, ms, Ps, X


def _pass_2(m0, P0, trans, sites, lag_one: bool):
    """``d = 2``, every product written out: as :func:`_pass_1`, covariances as ``(p00, p01,
    p11)`` and lag-one covariances as ``(x00, x01, x10, x11)``."""
    forward = _forward_2_first if sites and len(sites[0]) == 2 else _forward_2
    return _backward_2(*forward(m0, P0, trans, sites), lag_one)


def _forward_2(m0, P0, trans, sites):
    """The filter of :func:`_pass_2`: ``log Z``, the filtered moments ``(m0, m1, p00, p01,
    p11)`` and the predicted ones with ``A_t`` (``..., a00, a01, a10, a11``), flat lists of
    floats (no tuple per step for the garbage collector to count)."""
    m0_, m1_ = m0
    p00, p01, _, p11 = P0
    p01 = 0.5 * (p01 + P0[2])
    log_z = 0.0
    filt: List[float] = []
    pred: List[float] = [m0_, m1_, p00, p01, p11, 0.0, 0.0, 0.0, 0.0]
    for t, (e0, e1, j00, j01, j10, j11) in enumerate(sites):
        if t:
            a00, a01, a10, a11, b0, b1, q00, q01, _, q11 = trans[t - 1]
            m0_, m1_ = a00 * m0_ + a01 * m1_ + b0, a10 * m0_ + a11 * m1_ + b1
            c00, c01 = a00 * p00 + a01 * p01, a00 * p01 + a01 * p11  # (A P) row 0
            c10, c11 = a10 * p00 + a11 * p01, a10 * p01 + a11 * p11  # (A P) row 1
            p00 = c00 * a00 + c01 * a01 + q00
            p01 = c00 * a10 + c01 * a11 + q01
            p11 = c10 * a10 + c11 * a11 + q11
            pred += (m0_, m1_, p00, p01, p11, a00, a01, a10, a11)
        s00, s01 = 1.0 + p00 * j00 + p01 * j10, p00 * j01 + p01 * j11  # S = I + P J
        s10, s11 = p01 * j00 + p11 * j10, 1.0 + p01 * j01 + p11 * j11
        det = s00 * s11 - s01 * s10
        if not det > 0.0:
            raise _Fail
        n00 = (s11 * p00 - s01 * p01) / det  # S^-1 P
        n01 = 0.5 * ((s11 * p01 - s01 * p11) + (s00 * p01 - s10 * p00)) / det
        n11 = (s00 * p11 - s10 * p01) / det
        jm0, jm1 = j00 * m0_ + j01 * m1_, j10 * m0_ + j11 * m1_
        r0, r1 = e0 - jm0, e1 - jm1
        u0, u1 = n00 * r0 + n01 * r1, n01 * r0 + n11 * r1
        log_z += (
            m0_ * (e0 - 0.5 * jm0)
            + m1_ * (e1 - 0.5 * jm1)
            + 0.5 * (r0 * u0 + r1 * u1)
            - 0.5 * math.log(det)
        )
        m0_, m1_, p00, p01, p11 = m0_ + u0, m1_ + u1, n00, n01, n11
        filt += (m0_, m1_, p00, p01, p11)
    return log_z, filt, pred


def _forward_2_first(m0, P0, trans, sites):
    """:func:`_forward_2` for sites on the first coordinate only (``eta = (e, 0)``, ``J =
    diag(j, 0)``: a Gaussian process observed through ``f = x_0``). Then ``det S = s = 1 + p00
    j``, ``P^f = P - (p00, p01)' (p00, p01) j / s`` and ``P^f r = (p00, p01)' r_0 / s``: the
    scalar update, a third of the operations."""
    m0_, m1_ = m0
    p00, p01, _, p11 = P0
    p01 = 0.5 * (p01 + P0[2])
    log_z = 0.0
    filt: List[float] = []
    pred: List[float] = [m0_, m1_, p00, p01, p11, 0.0, 0.0, 0.0, 0.0]
    log = math.log
    for (e, j), row in zip(sites, itertools.chain((None,), trans)):
        if row is not None:  # the prediction by A_t, b_t, Q_t
            a00, a01, a10, a11, b0, b1, q00, q01, _, q11 = row
            m0_, m1_ = a00 * m0_ + a01 * m1_ + b0, a10 * m0_ + a11 * m1_ + b1
            c00, c01 = a00 * p00 + a01 * p01, a00 * p01 + a01 * p11  # (A P) row 0
            c10, c11 = a10 * p00 + a11 * p01, a10 * p01 + a11 * p11  # (A P) row 1
            p00 = c00 * a00 + c01 * a01 + q00
            p01 = c00 * a10 + c01 * a11 + q01
            p11 = c10 * a10 + c11 * a11 + q11
            pred += (m0_, m1_, p00, p01, p11, a00, a01, a10, a11)
        s = 1.0 + p00 * j
        if not s > 0.0:
            raise _Fail
        jm = j * m0_
        r = e - jm
        k0, k1 = p00 / s, p01 / s  # the gain P h / s
        log_z += m0_ * (e - 0.5 * jm) + 0.5 * r * r * k0 - 0.5 * log(s)
        m0_, m1_ = m0_ + k0 * r, m1_ + k1 * r
        p00, p01, p11 = k0, k1, p11 - p01 * k1 * j
        filt += (m0_, m1_, p00, p01, p11)
    return log_z, filt, pred


def _backward_2(log_z, filt, pred, lag_one: bool):
    """The RTS pass of :func:`_pass_2` over the filter's output: ``log Z``, the smoothed
    ``(m0, m1, p00, p01, p11)`` and (``lag_one``) ``(x00, x01, x10, x11)``, flat."""
    T = len(filt) // 5
    ms = [0.0] * (5 * T)
    X = [0.0] * (4 * T)
    ms[-5:] = filt[-5:]
    s0, s1, s00, s01, s11 = filt[-5:]
    for t in range(T - 2, -1, -1):
        f0, f1, f00, f01, f11 = filt[5 * t : 5 * t + 5]
        q0, q1, q00, q01, q11, a00, a01, a10, a11 = pred[9 * t + 9 : 9 * t + 18]  # A_{t+1}
        det = q00 * q11 - q01 * q01
        if not det > 0.0:
            raise _Fail
        i00, i01, i11 = q11 / det, -q01 / det, q00 / det  # P_{t+1}^-1
        c00, c01 = f00 * a00 + f01 * a01, f00 * a10 + f01 * a11  # P^f A'
        c10, c11 = f01 * a00 + f11 * a01, f01 * a10 + f11 * a11
        g00, g01 = c00 * i00 + c01 * i01, c00 * i01 + c01 * i11  # G = P^f A' P^-1
        g10, g11 = c10 * i00 + c11 * i01, c10 * i01 + c11 * i11
        d0, d1 = s0 - q0, s1 - q1
        D00, D01, D11 = s00 - q00, s01 - q01, s11 - q11
        h00, h01 = g00 * D00 + g01 * D01, g00 * D01 + g01 * D11  # G D
        h10, h11 = g10 * D00 + g11 * D01, g10 * D01 + g11 * D11
        if lag_one:  # P^s_{t+1} G'
            X[4 * t + 4 : 4 * t + 8] = (
                s00 * g00 + s01 * g01,
                s00 * g10 + s01 * g11,
                s01 * g00 + s11 * g01,
                s01 * g10 + s11 * g11,
            )
        s0, s1 = f0 + g00 * d0 + g01 * d1, f1 + g10 * d0 + g11 * d1
        s00 = f00 + h00 * g00 + h01 * g01
        s01 = f01 + h00 * g10 + h01 * g11
        s11 = f11 + h10 * g10 + h11 * g11
        ms[5 * t : 5 * t + 5] = (s0, s1, s00, s01, s11)
    return log_z, ms, None, X


class SequentialSmoother:
    """The scalar sequential filter and smoother (module docstring); problems it does not take
    go to ``fallback(T, d)``, the tensor strategy the rule would otherwise pick."""

    name = "sequential"

    def __init__(self, fallback: Callable[[int, int], Callable]):
        self.fallback = fallback

    def __call__(self, chain: LinearGaussianChain, eta, J, lag_one: bool) -> Result:
        T, d = eta.shape[-2], eta.shape[-1]
        if applies(chain, eta, J):
            try:
                return self._solve(chain, eta, J, lag_one)
            except _Fail:
                pass
        return self.fallback(T, d)(chain, eta, J, lag_one)

    @staticmethod
    def _solve(chain: LinearGaussianChain, eta, J, lag_one: bool) -> Result:
        T, d = eta.shape[-2], eta.shape[-1]
        rows = _rows(chain, eta, J, d)
        like = dict(dtype=eta.dtype, device=eta.device)
        if d == 1:
            log_z, ms, Ps, X = _pass_1(*rows, lag_one)
            m = torch.tensor(ms, **like).reshape(T, 1, 1)
            S = torch.tensor(Ps, **like).reshape(T, 1, 1)
            cross = torch.tensor(X, **like).reshape(T, 1, 1) if lag_one else None
        else:
            log_z, out, _, X = _pass_2(*rows, lag_one)
            v = torch.tensor(out, **like).reshape(T, 5)  # m0, m1, p00, p01, p11
            m = v[:, :2].unsqueeze(-1)
            S = v[:, [2, 3, 3, 4]].reshape(T, 2, 2)
            cross = torch.tensor(X, **like).reshape(T, 2, 2) if lag_one else None
        lz = torch.tensor(log_z, **like)
        check_log_z(lz)
        return lz, m, S, cross
