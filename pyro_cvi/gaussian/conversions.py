"""Natural, mean and moment parameters of a Gaussian, through Cholesky factors.

For ``q = N(m, S)`` over ``R^D``, ``P = S^-1`` (Khan & Lin 2017, Section 3 and eq. 13):

* moments             ``(m, S)``
* natural parameters  ``eta1 = P m``, ``eta2 = -P / 2``  (sufficient statistics ``(z, z z^T)``)
* mean parameters     ``mu1 = m``, ``mu2 = S + m m^T``
* log-partition       ``A(eta) = m^T P m / 2 - log|P| / 2 = |L^-1 eta1|^2 / 2 - sum log diag L``
  with ``P = L L^T``; its gradient in ``eta`` is ``mu`` (checked against autograd in the tests).

Every map takes the Cholesky factor its solve needs (computed by the caller, with the
caller's jitter policy from :func:`pyro_cvi.linalg.cholesky`), so that each is one triangular
solve or ``cholesky_inverse`` and nothing is factorised twice. Batched over leading dims.
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch
from torch import Tensor

__all__ = [
    "diagonal_moments_from_natural",
    "diagonal_natural_from_moments",
    "loc_from_natural",
    "log_partition",
    "mean_params",
    "moments_from_mean_params",
    "moments_from_natural",
    "natural_from_moments",
    "precision_from_scale_tril",
    "scale_tril_from_precision",
    "symmetrise",
    "tril_log_prob",
    "centred_exp_mean",
]

_LOG_2PI = 1.8378770664093453  # log(2 pi), as math.log(2 * math.pi)


def symmetrise(M: Tensor) -> Tensor:
    """``(M + M^T) / 2``."""
    return 0.5 * (M + M.mT)


def _eye_like(M: Tensor) -> Tensor:
    return torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)


def precision_from_scale_tril(L: Tensor) -> Tensor:
    """``P = S^-1 = L^-T L^-1`` for ``S = L L^T`` (one triangular solve)."""
    Linv: Tensor = torch.linalg.solve_triangular(L, _eye_like(L).expand_as(L), upper=False)
    return Linv.mT @ Linv


def loc_from_natural(eta1: Tensor, chol_P: Tensor) -> Tensor:
    """``m = P^-1 eta1`` from ``eta1`` and the Cholesky factor of ``P``."""
    return torch.cholesky_solve(eta1.unsqueeze(-1), chol_P).squeeze(-1)


def moments_from_natural(eta1: Tensor, chol_P: Tensor) -> Tuple[Tensor, Tensor]:
    """``(m, S) = (P^-1 eta1, P^-1)`` from ``eta1`` and the Cholesky factor of ``P``."""
    return loc_from_natural(eta1, chol_P), torch.cholesky_inverse(chol_P)


def natural_from_moments(m: Tensor, chol_S: Tensor) -> Tuple[Tensor, Tensor]:
    """``(eta1, P) = (S^-1 m, S^-1)`` from ``m`` and the Cholesky factor of ``S``
    (``eta2 = -P / 2``)."""
    eta1 = torch.cholesky_solve(m.unsqueeze(-1), chol_S).squeeze(-1)
    return eta1, torch.cholesky_inverse(chol_S)


def mean_params(m: Tensor, S: Tensor) -> Tuple[Tensor, Tensor]:
    """``(mu1, mu2) = (m, S + m m^T)``."""
    return m, S + m.unsqueeze(-1) * m.unsqueeze(-2)


def moments_from_mean_params(mu1: Tensor, mu2: Tensor) -> Tuple[Tensor, Tensor]:
    """``(m, S) = (mu1, sym(mu2 - mu1 mu1^T))`` (``S`` is positive definite exactly when
    ``mu`` lies in the mean domain)."""
    return mu1, symmetrise(mu2 - mu1.unsqueeze(-1) * mu1.unsqueeze(-2))


def diagonal_moments_from_natural(eta1: Tensor, eta2: Tensor) -> Tuple[Tensor, Tensor]:
    """Element-wise ``(m, v) = (eta1 v, -1 / (2 eta2))`` (independent Normals)."""
    var = -0.5 / eta2
    return eta1 * var, var


def diagonal_natural_from_moments(m: Tensor, var: Tensor) -> Tuple[Tensor, Tensor]:
    """Element-wise ``(eta1, eta2) = (m / v, -1 / (2 v))`` (independent Normals)."""
    return m / var, -0.5 / var


def scale_tril_from_precision(
    P: Tensor, cholesky: Callable[[Tensor], Tensor] = torch.linalg.cholesky
) -> Tensor:
    """The lower Cholesky factor of ``S = P^-1`` without forming ``S``: with ``J`` the index
    reversal, ``chol(J P J) = Lf`` gives ``P = U U^T`` for the upper-triangular ``U = J Lf J``,
    so ``S = U^-T U^-1`` and ``scale_tril = U^-T`` (one Cholesky, one triangular solve).
    ``cholesky`` factorises (the caller's jitter policy)."""
    upper = cholesky(P.flip(-2, -1)).flip(-2, -1)
    lower_inv: Tensor = torch.linalg.solve_triangular(upper, _eye_like(P), upper=True)
    return lower_inv.mT


def log_partition(eta1: Tensor, chol_P: Tensor) -> Tensor:
    """``A = |L^-1 eta1|^2 / 2 - sum log diag L`` for ``P = L L^T`` (without the base
    measure ``-D/2 log 2 pi``)."""
    w: Tensor = torch.linalg.solve_triangular(chol_P, eta1.unsqueeze(-1), upper=False)
    w = w.squeeze(-1)
    return 0.5 * w.square().sum(-1) - chol_P.diagonal(dim1=-2, dim2=-1).log().sum(-1)


def tril_log_prob(m: Tensor, L: Tensor, u: Tensor) -> Tensor:
    """``log N(u_k; m, L L^T) = -|L^-1 (u_k - m)|^2 / 2 - sum log diag L - D log(2 pi) / 2`` at
    the rows ``u_k`` of ``u`` (``K x D``; ``m``, ``L`` unbatched): the operations of
    ``MultivariateNormal(m, scale_tril=L).log_prob(u)``, so the same values bit for bit,
    without constructing the distribution (its shape checks cost more than the solve)."""
    w: Tensor = torch.linalg.solve_triangular(L, (u - m).mT, upper=False)
    half_log_det = L.diagonal().log().sum(-1)
    return -0.5 * (m.shape[-1] * _LOG_2PI + w.pow(2).sum(-2)) - half_log_det


def centred_exp_mean(a: Tensor, var: Tensor) -> Tensor:
    """``E[exp(a (u - m))] = exp(a^2 var / 2)`` for ``u ~ N(m, var)`` (the moment generating
    function at ``a``): e.g. ``E[s^-2] = s(m)^-2 exp(2 beta^2 var)`` for ``log s`` affine in
    ``u`` with slope ``beta``."""
    return torch.exp(0.5 * a.square() * var)


def mvn_draw(loc: torch.Tensor, scale_tril: torch.Tensor) -> torch.Tensor:
    """One draw ``loc + L e``, ``e ~ N(0, I)``: ``MultivariateNormal(loc, scale_tril=L).sample()``
    bit for bit (the same draws from torch's stream), without building the distribution (whose
    shape check imports sympy the first time in a process)."""
    with torch.no_grad():
        e = torch.empty(loc.shape, dtype=loc.dtype, device=loc.device).normal_()
        return loc + torch.matmul(scale_tril, e.unsqueeze(-1)).squeeze(-1)
