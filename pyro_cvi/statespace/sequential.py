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

import array
import itertools
import math
import struct
from functools import lru_cache
from typing import Callable, Iterator, List, NamedTuple, Optional, Tuple, Union

import torch

from .elements import LinearGaussianChain, check_log_z

__all__ = ["SequentialSmoother", "applies"]

Result = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


class _Fail(Exception):
    """A non-positive determinant: hand the problem to the tensor strategy."""


def applies(chain: LinearGaussianChain, eta: torch.Tensor, J: torch.Tensor) -> bool:
    """Whether the scalar pass can take the problem: one chain (no batch dims) of ``d <= 2``
    on the CPU, without autograd."""
    return _shaped(chain, eta, J) and not torch.is_grad_enabled()


def _shaped(chain: LinearGaussianChain, eta: torch.Tensor, J: torch.Tensor) -> bool:
    """One chain (no batch dims) of ``d <= 2`` on the CPU."""
    return (
        eta.shape[-1] <= 2
        and eta.dim() == 2
        and J.dim() == 3
        and chain.A.dim() == 3
        and chain.m0.dim() == 1
        and eta.device.type == "cpu"
    )


def _rows(chain: LinearGaussianChain, eta: torch.Tensor, J: torch.Tensor, d: int):
    """Python lists: the prior's start, the transitions ``[A | b | Q]`` and the sites ``[eta |
    J]``, one flat row per step (float64)."""
    T = eta.shape[0]
    trans = _TRANSITIONS.rows(chain, T - 1, d)
    sites: Sites
    if d == 2 and _first_coordinate(eta, J):
        sites = OnFirst(_f64(eta[:, 0]).tolist(), _f64(J[:, 0, 0]).tolist())
    else:
        sites = torch.cat([_f64(eta), _f64(J).reshape(T, d * d)], 1).tolist()
    return _f64(chain.m0).tolist(), _f64(chain.P0).reshape(-1).tolist(), trans, sites


def _f64(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float64 (itself when it is: no operation)."""
    return x if x.dtype == torch.float64 else x.to(torch.float64)


@lru_cache(maxsize=64)
def _packer(n: int) -> Callable:
    return struct.Struct(f"{n}d").pack


def packed(values: List[float]) -> array.array:
    """``array.array("d", values)`` bit for bit, a third of its time: ``struct`` packs the
    floats in one C pass (``array`` parses each one as a call argument), copied in once."""
    return array.array("d", _packer(len(values))(*values))


def doubles(values: List[float]) -> torch.Tensor:
    """The Python floats ``values`` as a 1-D float64 tensor, bit for bit as
    ``torch.tensor(values, dtype=torch.float64)`` (which converts element by element), over
    :func:`packed`'s buffer."""
    if not values:
        return torch.zeros(0, dtype=torch.float64)
    return torch.frombuffer(packed(values), dtype=torch.float64)


class _LastTransitions:
    """The transition rows of the last chain seen, reused while its ``A``, ``b``, ``Q`` are
    equal (``torch.equal`` against copies: a fit solves the same prior at every step). The
    copies and the rows are one tuple, replaced at once (a thread sees one pair or the other)."""

    def __init__(self) -> None:
        self.last: Optional[Tuple[Tuple[torch.Tensor, ...], Transitions]] = None

    def rows(self, chain: LinearGaussianChain, n: int, d: int) -> Transitions:
        now = (chain.A, chain.b, chain.Q)
        last = self.last
        if last is not None and all(
            a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
            for a, b in zip(now, last[0])
        ):
            return last[1]
        value = _transition_rows(chain, n, d)
        self.last = (tuple(t.detach().clone() for t in now), value)
        return value


def _transition_rows(chain: LinearGaussianChain, n: int, d: int) -> Transitions:
    """``[A | b | Q]`` per step; one row when every step's is the same."""
    f64 = torch.float64
    A = chain.A.to(f64).expand(n, d, d).reshape(n, d * d)
    b = chain.b.to(f64).expand(n, d)
    Q = chain.Q.to(f64).expand(n, d, d).reshape(n, d * d)
    rows = torch.cat([A, b, Q], 1)
    bits = rows.view(torch.int64)  # (bit for bit: -0.0 and NaN rows count as different)
    if n > 1 and bool((bits == bits[:1]).all()):  # one transition for every step: one row
        return _Repeated(rows[0].tolist(), n)
    return rows.tolist() if n > 0 else []


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


class OnFirst(NamedTuple):
    """Sites on the first coordinate only: ``eta_t = (e_t, 0)``, ``J_t = diag(j_t, 0)``."""

    e: List[float]
    j: List[float]


Sites = Union[List[List[float]], OnFirst]
_TRANSITIONS = _LastTransitions()


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


def _pass_2(m0, P0, trans, sites, lag_one: bool = True) -> Tuple[float, array.array]:
    """``d = 2``, every product written out: ``log Z`` and one flat row of ten floats per step,
    last step first: the smoothed ``(m0, m1, p00, p01, p01, p11)`` of ``x_t`` (the covariance as
    its four entries, row-major) and, with ``lag_one``,
    ``Cov(x_{t+1}, x_t)`` as ``(x00, x01, x10, x11)`` (zero at the last step, and without)."""
    forward = _forward_2_first if isinstance(sites, OnFirst) else _forward_2
    return _backward_2(*forward(m0, P0, trans, sites), lag_one)


# The filter hands the backward pass one tuple per step ``t < T - 1`` (one list append, not
# fourteen): the filtered ``m^f_t, P^f_t``, ``C = A_{t+1} P^f_t`` and the predicted
# ``m_{t+1}, P_{t+1} = C A_{t+1}' + Q_{t+1}``, each symmetric matrix as ``(p00, p01, p11)``:
#
#     (f0, f1, f00, f01, f11, c00, c01, c10, c11, n0, n1, n00, n01, n11)
#
# and the last filtered moments (the last smoothed ones).


def _forward_2(m0, P0, trans, sites):
    """The filter of :func:`_pass_2` for sites anywhere on the state: ``log Z``, the steps'
    tuples and the last filtered moments."""
    m0_, m1_ = m0
    p00, p01, _, p11 = P0
    p01 = 0.5 * (p01 + P0[2])
    log_z = 0.0
    steps: List[Tuple[float, ...]] = []
    push = steps.append
    log = math.log
    rows = itertools.chain(trans, (None,))
    for (e0, e1, j00, j01, j10, j11), row in zip(sites, rows):
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
            - 0.5 * log(det)
        )
        m0_, m1_, p00, p01, p11 = m0_ + u0, m1_ + u1, n00, n01, n11
        if row is None:
            break
        a00, a01, a10, a11, b0, b1, q00, q01, _, q11 = row
        c00, c01 = a00 * p00 + a01 * p01, a00 * p01 + a01 * p11  # C = A P^f
        c10, c11 = a10 * p00 + a11 * p01, a10 * p01 + a11 * p11
        n0, n1 = a00 * m0_ + a01 * m1_ + b0, a10 * m0_ + a11 * m1_ + b1
        n00 = c00 * a00 + c01 * a01 + q00  # P_{t+1} = C A' + Q
        n01 = c00 * a10 + c01 * a11 + q01
        n11 = c10 * a10 + c11 * a11 + q11
        push((m0_, m1_, p00, p01, p11, c00, c01, c10, c11, n0, n1, n00, n01, n11))
        m0_, m1_, p00, p01, p11 = n0, n1, n00, n01, n11
    return log_z, steps, (m0_, m1_, p00, p01, p11)


def _forward_2_first(m0, P0, trans, sites: OnFirst):
    """:func:`_forward_2` for sites on the first coordinate only (``eta = (e, 0)``, ``J =
    diag(j, 0)``: a Gaussian process observed through ``f = x_0``). Then ``det S = s = 1 + p00
    j``, ``P^f = P - k k' s j`` and ``P^f r = k r_0`` with the gain ``k = (p00, p01) / s``:
    the scalar update, a third of the operations."""
    m0_, m1_ = m0
    p00, p01, _, p11 = P0
    p01 = 0.5 * (p01 + P0[2])
    log_z = 0.0
    steps: List[Tuple[float, ...]] = []
    push = steps.append
    log = math.log
    rows = itertools.chain(trans, (None,))
    for e, j, row in zip(sites.e, sites.j, rows):
        s = 1.0 + p00 * j
        if not s > 0.0:
            raise _Fail
        jm = j * m0_
        r = e - jm
        k0, k1 = p00 / s, p01 / s
        log_z += m0_ * (e - 0.5 * jm) + 0.5 * r * r * k0 - 0.5 * log(s)
        m0_, m1_ = m0_ + k0 * r, m1_ + k1 * r
        p00, p01, p11 = k0, k1, p11 - p01 * k1 * j
        if row is None:
            break
        a00, a01, a10, a11, b0, b1, q00, q01, _, q11 = row
        c00, c01 = a00 * p00 + a01 * p01, a00 * p01 + a01 * p11  # C = A P^f
        c10, c11 = a10 * p00 + a11 * p01, a10 * p01 + a11 * p11
        n0, n1 = a00 * m0_ + a01 * m1_ + b0, a10 * m0_ + a11 * m1_ + b1
        n00 = c00 * a00 + c01 * a01 + q00  # P_{t+1} = C A' + Q
        n01 = c00 * a10 + c01 * a11 + q01
        n11 = c10 * a10 + c11 * a11 + q11
        push((m0_, m1_, p00, p01, p11, c00, c01, c10, c11, n0, n1, n00, n01, n11))
        m0_, m1_, p00, p01, p11 = n0, n1, n00, n01, n11
    return log_z, steps, (m0_, m1_, p00, p01, p11)


def _backward_2(log_z: float, steps: List[Tuple[float, ...]], last: Tuple[float, ...], lag_one):
    """The RTS pass of :func:`_pass_2` over the filter's steps (``last``: the filtered moments
    of ``x_{T-1}``, its smoothed ones): ``G = P^f A' P_{t+1}^-1 = C' P_{t+1}^-1``."""
    s0, s1, s00, s01, s11 = last
    z = 0.0
    out: List[float] = [s0, s1, s00, s01, s01, s11, z, z, z, z]
    push = out.extend  # (one flat list: a tuple's floats are copied in C)
    for f0, f1, f00, f01, f11, c00, c01, c10, c11, n0, n1, n00, n01, n11 in reversed(steps):
        det = n00 * n11 - n01 * n01
        if not det > 0.0:
            raise _Fail
        i00, i01, i11 = n11 / det, -n01 / det, n00 / det  # P_{t+1}^-1
        g00, g01 = c00 * i00 + c10 * i01, c00 * i01 + c10 * i11  # G = C' P_{t+1}^-1
        g10, g11 = c01 * i00 + c11 * i01, c01 * i01 + c11 * i11
        d0, d1 = s0 - n0, s1 - n1
        D00, D01, D11 = s00 - n00, s01 - n01, s11 - n11
        h00, h01 = g00 * D00 + g01 * D01, g00 * D01 + g01 * D11  # G D
        h10, h11 = g10 * D00 + g11 * D01, g10 * D01 + g11 * D11
        if lag_one:  # P^s_{t+1} G'
            x00, x01 = s00 * g00 + s01 * g01, s00 * g10 + s01 * g11
            x10, x11 = s01 * g00 + s11 * g01, s01 * g10 + s11 * g11
        else:
            x00 = x01 = x10 = x11 = z
        s0, s1 = f0 + g00 * d0 + g01 * d1, f1 + g10 * d0 + g11 * d1
        s00 = f00 + h00 * g00 + h01 * g01
        s01 = f01 + h00 * g10 + h01 * g11
        s11 = f11 + h10 * g10 + h11 * g11
        push((s0, s1, s00, s01, s01, s11, x00, x01, x10, x11))
    return log_z, packed(out)


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
            m = doubles(ms).to(**like).reshape(T, 1, 1)
            S = doubles(Ps).to(**like).reshape(T, 1, 1)
            cross = doubles(X).to(**like).reshape(T, 1, 1) if lag_one else None
        else:
            log_z, flat = _pass_2(*rows, lag_one)
            v = torch.frombuffer(flat, dtype=torch.float64).view(T, 10).flip(0).to(**like)
            m = v[:, :2].unsqueeze(-1)
            S = v[:, 2:6].reshape(T, 2, 2)
            # row t holds Cov(x_{t+1}, x_t); the smoother's t holds Cov(x_t, x_{t-1})
            cross = v[:, 6:].roll(1, 0).reshape(T, 2, 2) if lag_one else None
        return _log_z(log_z, like), m, S, cross

    def marginals(self, chain: LinearGaussianChain, eta, J, lag_one: bool) -> Optional[tuple]:
        """``smooth``'s no-graph result in its layout, ``(mean (T, d), cov (T, d, d), log Z,
        Cov(x_t, x_{t-1}) (T - 1, d, d) or None)``, its covariances checked (``None`` in the
        first slot: one is not finite or a variance is not positive), without the tensor
        operations that reshape, symmetrise and detach a tensor strategy's output (the pass's
        covariances are symmetric by construction, its outputs new tensors without graph).
        ``None`` where ``smooth``'s general path decides: a problem the pass does not take, a
        failed pass (the tensor strategy), sites that are all zero (the stationary prior)."""
        if not _shaped(chain, eta, J):
            return None
        T, d = eta.shape[-2], eta.shape[-1]
        rows = _rows(chain, eta, J, d)
        if _no_sites(rows[3]):
            return None
        like = dict(dtype=eta.dtype, device=eta.device)
        try:
            if d == 1:
                log_z, ms, Ps, X = _pass_1(*rows, lag_one)
                mean = doubles(ms).to(**like).reshape(T, 1)
                cov = doubles(Ps).to(**like).reshape(T, 1, 1)
                var = cov.view(T, 1)
                cross = doubles(X[1:]).to(**like).reshape(T - 1, 1, 1) if lag_one else None
            else:
                log_z, flat = _pass_2(*rows, lag_one)
                v = torch.frombuffer(flat, dtype=torch.float64).view(T, 10).flip(0)
                v = v if like["dtype"] == torch.float64 else v.to(**like)
                mean, cov, var = v[:, :2], v[:, 2:6].reshape(T, 2, 2), v[:, 2:6:3]
                # row t holds Cov(x_{t+1}, x_t): the smoother's Cov(x_t, x_{t-1}), t >= 1
                cross = v[:-1, 6:].reshape(T - 1, 2, 2) if lag_one else None
        except _Fail:
            return None
        lz = _log_z(log_z, like)  # (checked first, as after a strategy)
        if not bool(torch.isfinite(cov).all()) or bool((var <= 0).any()):
            return None, None, None, None
        return mean, cov, lz, cross


def _no_sites(sites: Sites) -> bool:
    """Whether every ``eta_t`` and ``J_t`` is zero (a NaN counts as a site)."""
    if isinstance(sites, OnFirst):
        return not any(sites.e) and not any(sites.j)
    return not any(map(any, sites))


def _log_z(log_z: float, like: dict) -> torch.Tensor:
    if like["dtype"] == torch.float64 and math.isfinite(log_z):
        return torch.scalar_tensor(log_z, **like)  # (exact, and cheaper than torch.tensor)
    lz = torch.tensor(log_z, **like)  # (a narrower dtype may round it to inf: checked)
    check_log_z(lz)
    return lz


def reduced(el: tuple) -> Optional[Tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The scalar pass on the chain of a reduction level's end states (:mod:`.kalman`'s tree,
    stopped early): packed elements ``(A, b, C, e, J, g)`` over ``n`` spans, element ``k`` the
    kernel ``exp(g_k + e_k' x - x' J_k x / 2) N(y; A_k x + b_k, C_k)`` from the end state
    ``x = y_{k-1}`` of span ``k - 1`` to its own ``y_k`` (span 0 starts at the dummy
    ``x_{-1}``: ``A_0 = 0``, ``e_0 = 0``, ``J_0 = 0``). That is a chain ``y_0 ~ N(b_0, C_0)``,
    ``y_k | y_{k-1} ~ N(A_k y_{k-1} + b_k, C_k)`` with the site ``(e_{k+1}, J_{k+1})`` on
    ``y_k`` (none on the last), and ``log Z = sum_k g_k + log Z(chain)``. Returns ``(log Z,
    means (n, d, 1), covariances (n, d, d), Cov(y_k, y_{k-1}) (n, d, d), zero at 0)`` in
    float64 (the descent below needs the lag-one covariances), or ``None`` where a step's
    determinant is not positive (the tree decides)."""
    A, b, C, e, J, g = el
    n, d = A.shape[0], A.shape[-1]
    f = torch.float64
    A, b, C, e, J = (_f64(t).reshape(n, -1) for t in (A, b, C, e, J))
    trans = torch.cat([A[1:], b[1:], C[1:]], 1).tolist()
    sites = torch.cat([torch.cat([e[1:], J[1:]], 1), torch.zeros(1, d + d * d, dtype=f)], 0)
    m0, P0 = b[0].tolist(), C[0].tolist()
    try:
        if d == 1:
            log_z, ms, Ps, X = _pass_1(m0, P0, trans, sites.tolist(), True)
            m, S = doubles(ms), doubles(Ps)
            cross = doubles(X).reshape(n, 1, 1)
        else:
            log_z, flat = _pass_2(m0, P0, trans, sites.tolist(), True)
            v = torch.frombuffer(flat, dtype=f).view(n, 10).flip(0)
            m, S = v[:, :2], v[:, 2:6]
            cross = v[:, 6:].roll(1, 0).reshape(n, 2, 2)  # row t: Cov(y_{t+1}, y_t)
    except _Fail:
        return None
    log_z += float(_f64(g).sum())
    return log_z, m.reshape(n, d, 1), S.reshape(n, d, d), cross
