"""The warm start of linear-predictor and softmax sites: one rule for both.

A site of a factor ``eta = A z + c`` starts at its target (eq. 13) under one of two ``q``:

* a near point mass at the prior mean (variance ``1e-4`` per logit difference): a Newton /
  Laplace step from the prior mean, which starts ``q`` near the posterior where the prior is
  flat on the likelihood's scale (australian, ``delta = 1e-5``);
* the prior itself (Algorithm 1's first full step from ``q`` = prior), per row where the prior
  is not flat (a logit-difference variance ``<= FLAT_PRIOR_VAR``) and gives the row less
  curvature than the point mass: the more conservative start. Measured: a1a (logistic, prior
  variance about 5) needs 12 steps at step 0.4 from the point mass, whose curvature
  overstates the precision, and 7 with this rule.

Scalar rows use :func:`~pyro_cvi.messages.gaussian.warm_start_target` with the rows' prior
variances from :func:`prior_row_var`; K-variate softmax rows use :func:`softmax_warm_start`,
with "flat" read off the largest prior variance of a logit difference and "curvature" as the
trace of ``-lam2`` (at ``K = 2`` both are the scalar rule's, so the two-class softmax and the
Bernoulli path stay step for step equal).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..linear_gaussian import GaussianPrior
from .gaussian import FLAT_PRIOR_VAR
from .softmax_sites import SoftmaxRows, kron_factors, softmax_message

__all__ = ["prior_row_var", "prior_row_cov_blocks", "softmax_warm_start"]

#: the largest ``rows x dim^2`` product for which a dense prior's row covariances are formed
#: (one ``A L`` product); beyond it the warm start keeps the point mass
_MAX_DENSE_WORK = 2e8


def _prior_sqrt(prior: GaussianPrior) -> Optional[torch.Tensor]:
    """``L`` with ``L L^T = S0`` for a dense prior (``None`` where its precision is not PD)."""
    if prior.cov is not None:
        return prior.cov_cholesky().detach()
    L, info = torch.linalg.cholesky_ex(prior.precision.detach())
    if int(info) != 0:
        return None
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device)
    return torch.linalg.solve_triangular(L, eye, upper=False).mT  # L^-T: (L^-T)(L^-1) = P^-1


def prior_row_var(prior: GaussianPrior, A: torch.Tensor) -> Optional[torch.Tensor]:
    """The prior variances ``diag(A S0 A^T)`` of the rows ``A z`` (``None`` where they cannot
    be computed cheaply)."""
    with torch.no_grad():
        A = A.detach().to(prior.loc)
        if prior.var is not None:
            return (A**2) @ prior.var.detach()
        if A.shape[0] * A.shape[1] ** 2 > _MAX_DENSE_WORK:
            return None
        L = _prior_sqrt(prior)
        return None if L is None else ((A @ L) ** 2).sum(-1)


def prior_row_cov_blocks(prior: GaussianPrior, A: torch.Tensor, K: int) -> Optional[torch.Tensor]:
    """``Cov(A_n z) [N, K, K]`` under the prior, rows point-major (``A [N K, D]``). A diagonal
    prior ``v`` and ``A = X (x) G`` (:func:`~pyro_cvi.messages.softmax_sites.kron_factors`)
    give ``sum_d X_nd^2 G diag(v_d) G^T``: ``O(N D K^2)`` instead of ``O(N D K^3)``."""
    kron = kron_factors(A, K) if prior.var is not None and not A.requires_grad else None
    with torch.no_grad():
        A = A.detach().to(prior.loc)
        N = A.shape[0] // K
        if kron is not None:
            X, G = (t.to(prior.loc) for t in kron)
            v = prior.var.detach().reshape(X.shape[1], K)
            M = (G * v.unsqueeze(-2)) @ G.mT  # [D', K, K]: G diag(v_d) G^T
            return ((X * X) @ M.reshape(X.shape[1], K * K)).reshape(N, K, K)
        if prior.var is not None:
            An = A.reshape(N, K, -1)
            return (An * prior.var.detach()) @ An.mT
        if A.shape[0] * A.shape[1] ** 2 > _MAX_DENSE_WORK:
            return None
        L = _prior_sqrt(prior)
        if L is None:
            return None
        B = (A @ L).reshape(N, K, -1)
        return B @ B.mT


def _max_difference_var(cov: torch.Tensor) -> torch.Tensor:
    """``max_{i, j} Var(eta_i - eta_j)`` per block of ``cov [N, K, K]``."""
    d = torch.diagonal(cov, dim1=-2, dim2=-1)
    return (d.unsqueeze(-1) + d.unsqueeze(-2) - 2 * cov).flatten(-2).amax(-1)


def softmax_warm_start(
    site, rows: SoftmaxRows, m0: torch.Tensor, prior_cov: Optional[torch.Tensor]
) -> Optional[torch.Tensor]:
    """Targets ``[N, K, K + 1]`` of a softmax factor for its warm start (module docstring), or
    ``None`` when they are not finite. ``prior_cov``: the rows' prior ``Cov(eta_n)``."""
    N, K = rows.N, rows.K
    eye = torch.eye(K, dtype=m0.dtype, device=m0.device)
    # 5e-5 I: variance 1e-4 of each logit difference, as the scalar point mass
    _, target = softmax_message(site, rows, m0, 5e-5 * eye.expand(N, K, K))
    informative = None if prior_cov is None else _max_difference_var(prior_cov) <= FLAT_PRIOR_VAR
    if informative is not None and bool(informative.any()):
        _, at_prior = softmax_message(site, rows, m0, prior_cov)
        curv = torch.diagonal(target[..., 1:], dim1=-2, dim2=-1).sum(-1).abs()
        curv_prior = torch.diagonal(at_prior[..., 1:], dim1=-2, dim2=-1).sum(-1).abs()
        pick = informative & (curv_prior < curv)
        target = torch.where(pick[:, None, None], at_prior, target)
    return target if bool(torch.isfinite(target).all()) else None
