"""The elements of the Kalman smoothers (:mod:`.kalman`'s tree, :mod:`.scan`'s scans).

A leaf is the transition ``N(x_t; A x_{t-1} + b, C)`` followed by the site
``exp(eta' x_t - x_t' J x_t / 2)``, stored as the kernel
``exp(g + e'x - x'Jx/2) N(x_t; A' x + b', C')`` of ``x = x_{t-1}`` (the filtering element of
Sarkka & Garcia-Fernandez 2021, with its log-normaliser ``g``), a stack over time in either
storage form of :mod:`.soa`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
from pyro.distributions.util import broadcast_shape

from ..linalg import NotPositiveDefinite
from . import soa
from .soa import add, dot, inv_det, mm, mv, sub, tr

__all__ = ["LinearGaussianChain", "Element", "leaf", "time_major", "check_log_z"]


@dataclass
class LinearGaussianChain:
    """The prior: ``m0 (*B, d), P0 (*B, d, d), A (*B, T-1, d, d), b (*B, T-1, d),
    Q (*B, T-1, d, d)`` (``*B``: optional batch dims of independent chains)."""

    m0: torch.Tensor
    P0: torch.Tensor
    A: torch.Tensor
    b: torch.Tensor
    Q: torch.Tensor

    @property
    def length(self) -> int:
        return self.A.shape[-3] + 1

    @property
    def dim(self) -> int:
        return self.m0.shape[-1]

    def detach(self) -> LinearGaussianChain:
        return LinearGaussianChain(*(t.detach() for t in self.tensors()))

    def tensors(self):
        return (self.m0, self.P0, self.A, self.b, self.Q)

    def requires_grad(self) -> bool:
        return any(t.requires_grad for t in self.tensors())

    def zero_mean(self) -> LinearGaussianChain:
        return LinearGaussianChain(
            torch.zeros_like(self.m0), self.P0, self.A, torch.zeros_like(self.b), self.Q
        )

    def all_steps(self):
        """``(A, b, C)`` for t = 0..T-1, the first a kernel from a dummy ``x_{-1}``."""
        m0, P0 = self.m0.unsqueeze(-2), self.P0.unsqueeze(-3)
        A = torch.cat([torch.zeros_like(P0).expand(self.A.shape[:-3] + P0.shape[-3:]), self.A], -3)
        b = torch.cat([m0.expand(self.b.shape[:-2] + m0.shape[-2:]), self.b], -2)
        C = torch.cat([P0.expand(self.Q.shape[:-3] + P0.shape[-3:]), self.Q], -3)
        return A, b, C


Element = Tuple  # (A, b, C, e, J, g)


def _plus_eye(M):
    if soa.is_packed(M):
        return M + torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
    out = [list(row) for row in M]
    for k in range(len(out)):
        out[k][k] = out[k][k] + 1.0
    return out


def _log_det_g(det, g):
    """``g - log(det) / 2``: NaN or +inf where ``det <= 0`` (``q`` not positive definite),
    which reaches ``log Z`` and is caught there."""
    return g - 0.5 * det.log()


def leaf(A, b, C, eta, J) -> Element:
    """Transition ``N(x_t; A x_{t-1} + b, C)`` followed by the site ``(eta_t, J_t)``:
    ``M = (I + C J)^-1``, ``x_t | x_{t-1}, site ~ N(M (A x + b + C eta), M C)`` and the site's
    likelihood of ``x_{t-1}``."""
    Minv, det = inv_det(_plus_eye(mm(C, J)))
    P1 = mm(Minv, C)
    W = mm(Minv, A)
    Jb = mv(J, b)
    r = sub(eta, Jb)
    Wt = tr(W)
    quad = dot(b, sub(eta, _half(Jb))) + 0.5 * dot(r, mv(P1, r))
    e = mv(Wt, r)
    g = _log_det_g(det, quad)
    return W, mv(Minv, add(b, mv(C, eta))), P1, e, mm(Wt, mm(J, A)), g


def leaf_first(A, b, C, e, j) -> Element:
    """:func:`leaf` (arrays, ``d = 2``) for a site on the first coordinate only (``eta = (e,
    0)``, ``J = diag(j, 0)``): ``det(I + C J) = s = 1 + c00 j``, ``M = [[1/s, 0], [-c10 j/s,
    1]]``, ``r = (e - j b0, 0)`` and ``W' J A = j w w'``-like outer products of the first rows
    (``w = W_0.``, ``a = A_0.``): ``e_out = r0 w``, ``J_out = j w a'``; a third of the
    operations."""
    (a00, a01), (a10, a11) = A
    b0, b1 = b
    (c00, c01), (c10, c11) = C
    s = torch.addcmul(torch.ones_like(j), c00, j)
    rs = s.reciprocal()
    k1 = c10 * rs
    u = j * k1  # c10 j / s
    P1 = [[c00 * rs, c01 * rs], [k1, torch.addcmul(c11, u, c01, value=-1.0)]]
    w0, w1 = a00 * rs, a01 * rs
    W = [[w0, w1], [torch.addcmul(a10, u, a00, value=-1.0), torch.addcmul(a11, u, a01, value=-1.0)]]
    z0 = torch.addcmul(b0, c00, e)
    mean = [z0 * rs, torch.addcmul(torch.addcmul(b1, c10, e), u, z0, value=-1.0)]
    r0 = torch.addcmul(e, j, b0, value=-1.0)
    quad = b0 * torch.addcmul(e, j, b0, value=-0.5)
    quad = torch.addcmul(quad, r0 * r0, P1[0][0], value=0.5)
    jw0, jw1 = j * w0, j * w1
    J = [[jw0 * a00, jw0 * a01], [jw1 * a00, jw1 * a01]]
    return W, mean, P1, [r0 * w0, r0 * w1], J, _log_det_g(s, quad)


def _half(v):
    return soa.tree_map(lambda t: 0.5 * t, v)


def time_major(
    chain: LinearGaussianChain, eta: torch.Tensor, J: torch.Tensor, packed: bool, first=False
):
    """The leaves (transition then site, per step), time first: ``(T, *B, ...)``; ``first``
    (arrays, ``d = 2``): every site on the first coordinate (:func:`leaf_first`)."""
    A, b, C = chain.all_steps()
    # (pyro's pure-Python broadcast: torch.broadcast_shapes imports sympy, 0.6 s, on first use)
    batch = torch.Size(broadcast_shape(A.shape[:-3], eta.shape[:-2], J.shape[:-3]))
    T, d = eta.shape[-2], eta.shape[-1]

    def mat(M):
        return M.expand(batch + (T, d, d)).movedim(-3, 0)

    def vec(v):
        return v.expand(batch + (T, d)).movedim(-2, 0).unsqueeze(-1)

    if packed:
        return leaf(mat(A), vec(b), mat(C), vec(eta), mat(J))
    m, v = soa.to_arrays_mat, soa.to_arrays_vec
    if first:
        return leaf_first(
            m(mat(A)), v(vec(b)), m(mat(C)), eta[..., 0].movedim(-1, 0), J[..., 0, 0].movedim(-1, 0)
        )
    return leaf(m(mat(A)), v(vec(b)), m(mat(C)), v(vec(eta)), m(mat(J)))


def check_log_z(log_z: torch.Tensor) -> None:
    if not bool(torch.isfinite(log_z).all()):
        raise NotPositiveDefinite("q is not positive definite: log Z is not finite")
