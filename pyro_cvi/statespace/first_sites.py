"""The scalar pass of :mod:`.sequential` for a Gaussian process observed through its first
state coordinate, fed by its rows directly.

A Markov GP's sites sit on ``f_t = x_{t,0}``: ``eta_t = (e_t, 0)``, ``J_t = diag(j_t, 0)`` with
one row ``exp(e_t f_t - j_t f_t^2 / 2)`` per step. Given those rows (``e``, ``j``: ``(T,)``) and
the prior's transition rows (:func:`transitions`, kept by the caller while the prior is
unchanged), :func:`marginals` returns what :meth:`.sequential.SequentialSmoother.marginals`
returns for ``(eta, J)`` without lag-one covariances, bit for bit (the same floating-point
operations in the same order), without gathering ``eta`` and ``J``, testing that they lie on the
first coordinate, or comparing the prior with the last one seen. The filter reads one repeated
transition ``[A | b | Q]`` from locals, and the smoother writes six numbers per step (no lag-one
slots). Where it does not finish (a non-positive determinant, ``log Z`` or a covariance not
finite, a variance not positive, no sites at all) it returns ``None`` and the caller's general
path decides, as before.
"""

from __future__ import annotations

import array
import math
import struct
from typing import List, Optional, Tuple

import torch

from .elements import LinearGaussianChain
from .sequential import (
    OnFirst,
    Transitions,
    _Fail,
    _forward_2_first,
    _log_z,
    _pass_1,
    _Repeated,
    _transition_rows,
    doubles,
)

__all__ = ["applies", "transitions", "marginals"]

_SIX = struct.Struct("6d")  # (one smoothed step: mean, covariance row-major)


def applies(chain: LinearGaussianChain) -> bool:
    """One chain (no batch dims) of ``d <= 2`` on the CPU, without a graph."""
    return (
        chain.A.dim() == 3
        and chain.m0.dim() == 1
        and chain.m0.shape[-1] <= 2
        and chain.A.device.type == "cpu"
        and not chain.requires_grad()
    )


def transitions(chain: LinearGaussianChain) -> Tuple[List[float], List[float], Transitions]:
    """The prior's start ``m0``, ``P0`` and its transition rows, as :mod:`.sequential` reads
    them (float64 lists; one row when every step's is the same)."""
    f64 = torch.float64
    d = chain.m0.shape[-1]
    trans = _transition_rows(chain, chain.length - 1, d)
    return chain.m0.to(f64).tolist(), chain.P0.to(f64).reshape(-1).tolist(), trans


def marginals(
    rows: Tuple[List[float], List[float], Transitions], e: torch.Tensor, j: torch.Tensor
) -> Optional[tuple]:
    """``(mean (T, d), cov (T, d, d), log Z, None)`` of the chain with sites ``exp(e_t x_{t,0} -
    j_t x_{t,0}^2 / 2)`` (``e``, ``j``: ``(T,)``, in the dtype of the result), as
    ``smooth(chain, eta, J)`` gives them; ``None`` where that is for the general path to decide
    (module docstring)."""
    m0, P0, trans = rows
    T, d = e.shape[0], len(m0)
    like = dict(dtype=e.dtype, device=e.device)
    es, js = _f64(e).tolist(), _f64(j).tolist()
    if not any(es) and not any(js):
        return None  # (the stationary prior's shortcut is the general path's)
    try:
        if d == 1:
            log_z, ms, Ps, _ = _pass_1(m0, P0, trans, list(zip(es, js)), False)
            mean = doubles(ms).to(**like).reshape(T, 1)
            cov = doubles(Ps).to(**like).reshape(T, 1, 1)
            var = cov.view(T, 1)
        else:
            if isinstance(trans, _Repeated):
                log_z, flat = _smooth_repeated(m0, P0, trans.row, es, js)
            else:
                log_z, flat = _backward(*_forward_2_first(m0, P0, trans, OnFirst(es, js)))
            v = torch.frombuffer(flat, dtype=torch.float64).view(T, 6)
            if like["dtype"] == torch.float64:
                c4 = v.narrow(1, 2, 4)  # (p00, p01, p01, p11 per step)
                if not math.isfinite(log_z) or not _valid(c4):
                    return None
                return v.narrow(1, 0, 2), c4.view(T, 2, 2), _log_z(log_z, like), None
            v = v.to(**like)
            mean, cov, var = v[:, :2], v[:, 2:6].reshape(T, 2, 2), v[:, 2:6:3]
    except _Fail:
        return None
    if not math.isfinite(log_z):
        return None
    lz = _log_z(log_z, like)
    if not bool(torch.isfinite(cov).all()) or bool((var <= 0).any()):
        return None
    return mean, cov, lz, None


def _valid(c4: torch.Tensor) -> bool:
    """Whether the covariances ``(T, 4)`` are finite (their sum is: an overflowing sum only
    sends the rare case to the general path; :func:`_backward` checked the variances)."""
    return math.isfinite(float(c4.sum()))


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.to(torch.float64)


def _smooth_repeated(m0, P0, row, es, js):
    """:func:`.sequential._forward_2_first` with one transition row for every step, read into
    locals once, then :func:`_backward` in the same frame (the same operations in the same
    order: the filter writes each step's prediction straight into the names the next step
    reads, the smoother starts from the last filtered state without a call)."""
    m0_, m1_ = m0
    p00, p01, _, p11 = P0
    p01 = 0.5 * (p01 + P0[2])
    log_z = 0.0
    steps: List[Tuple[float, ...]] = []  # (appended as steps.append: 3.11's list fast path)
    log = math.log
    a00, a01, a10, a11, b0, b1, q00, q01, _, q11 = row
    last = len(es) - 1
    for e, j in zip(es[:last], js[:last]):  # (the last step's update follows the loop)
        s = 1.0 + p00 * j
        if not s > 0.0:
            raise _Fail
        jm = j * m0_
        r = e - jm
        k0, k1 = p00 / s, p01 / s  # (the filtered covariance is (k0, k1, f11))
        log_z += m0_ * (e - 0.5 * jm) + 0.5 * r * r * k0 - 0.5 * log(s)
        f0, f1 = m0_ + k0 * r, m1_ + k1 * r
        f11 = p11 - p01 * k1 * j
        c00, c01 = a00 * k0 + a01 * k1, a00 * k1 + a01 * f11  # C = A P^f
        c10, c11 = a10 * k0 + a11 * k1, a10 * k1 + a11 * f11
        m0_, m1_ = a00 * f0 + a01 * f1 + b0, a10 * f0 + a11 * f1 + b1
        p00 = c00 * a00 + c01 * a01 + q00  # P_{t+1} = C A' + Q
        p01 = c00 * a10 + c01 * a11 + q01
        p11 = c10 * a10 + c11 * a11 + q11
        steps.append((f0, f1, k0, k1, f11, c00, c01, c10, c11, m0_, m1_, p00, p01, p11))
    e, j = es[last], js[last]  # (the loop's update, once more)
    s = 1.0 + p00 * j
    if not s > 0.0:
        raise _Fail
    jm = j * m0_
    r = e - jm
    k0, k1 = p00 / s, p01 / s
    log_z += m0_ * (e - 0.5 * jm) + 0.5 * r * r * k0 - 0.5 * log(s)
    final = (m0_ + k0 * r, m1_ + k1 * r, k0, k1, p11 - p01 * k1 * j)
    return _backward(log_z, steps, final)


def _backward(log_z: float, steps: List[Tuple[float, ...]], last: Tuple[float, ...]):
    """:func:`.sequential._backward_2` without lag-one covariances: six floats per step, first
    step first, ``(m0, m1, p00, p01, p01, p11)`` (the same operations, but for signs: with
    ``q = n01 / det``, ``c * (-q)`` is ``-(c q)`` and ``a + (-(c q))`` is ``a - c q`` bit for
    bit); :class:`_Fail` where a variance is not positive (or NaN). (The pass goes last step
    first and packs each step's six as it goes, one C call, not six floats kept; the packed
    steps are joined in order at the end.)"""
    s0, s1, s00, s01, s11 = last
    if not (s00 > 0.0 and s11 > 0.0):
        raise _Fail
    pack = _SIX.pack
    out: List[bytes] = [pack(s0, s1, s00, s01, s01, s11)]
    for f0, f1, f00, f01, f11, c00, c01, c10, c11, n0, n1, n00, n01, n11 in reversed(steps):
        det = n00 * n11 - n01 * n01
        if not det > 0.0:
            raise _Fail
        i00, q, i11 = n11 / det, n01 / det, n00 / det  # P_{t+1}^-1 = (i00, -q, -q, i11)
        g00, g01 = c00 * i00 - c10 * q, c10 * i11 - c00 * q  # G = C' P_{t+1}^-1
        g10, g11 = c01 * i00 - c11 * q, c11 * i11 - c01 * q
        d0, d1 = s0 - n0, s1 - n1
        D00, D01, D11 = s00 - n00, s01 - n01, s11 - n11
        h00, h01 = g00 * D00 + g01 * D01, g00 * D01 + g01 * D11  # G D (its h10 inline below)
        h11 = g10 * D01 + g11 * D11
        s0, s1 = f0 + g00 * d0 + g01 * d1, f1 + g10 * d0 + g11 * d1
        s00 = f00 + h00 * g00 + h01 * g01
        s01 = f01 + h00 * g10 + h01 * g11
        s11 = f11 + (g10 * D00 + g11 * D01) * g10 + h11 * g11
        if not (s00 > 0.0 and s11 > 0.0):
            raise _Fail
        out.append(pack(s0, s1, s00, s01, s01, s11))
    out.reverse()
    flat = array.array("d")
    flat.frombytes(b"".join(out))
    return log_z, flat
