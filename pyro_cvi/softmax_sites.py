"""K-dimensional softmax sites of a Gaussian block (the ``softmax-predictor`` factor kind).

A ``Categorical`` / ``OneHotCategorical`` / ``Multinomial`` factor whose logits are affine in a
Gaussian block, ``eta_n = A_n z + c_n`` (K-vector per data point), gets one site per point
(eq. 13 in K dimensions, App. E.1)::

    exp(lam1_n^T eta_n + eta_n^T lam2_n eta_n),   lam1_n: K-vector,  lam2_n: K x K (<= 0),

stored as one ``[N, K, K + 1]`` parameter (``[..., 0]`` = lam1, ``[..., 1:]`` = lam2): O(N K^2).
The logits are taken *centred* (``logits - mean(logits)``): torch normalises them, softmax is
invariant to the shift, and the centred logits are affine when the model's are.

The conjugate computation stays the Bayesian linear regression of
:mod:`~pyro_cvi.linear_gaussian` with K-variate pseudo-observations: with
``W_n = -2 lam2_n = U_n diag(s_n) U_n^T`` the site is exactly the K scalar rows
``U_n^T A_n`` with precisions ``s_n`` and coefficients ``U_n^T (lam1_n + 2 lam2_n c_n)``
(:meth:`SoftmaxRows.rows`), so primal and dual solves are reused unchanged. The targets come
from :mod:`~pyro_cvi.softmax`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .softmax import lse_expectations, site_targets
from .tracing import unwrap

__all__ = ["SOFTMAX", "SoftmaxRows", "centred_logits", "softmax_rows", "softmax_message"]

SOFTMAX = "softmax-predictor"

_CLASSES = (
    torch.distributions.Categorical,
    torch.distributions.OneHotCategorical,
    torch.distributions.Multinomial,
)


def centred_logits(base) -> Optional[torch.Tensor]:
    """``logits - mean(logits, -1)`` of a softmax likelihood, else ``None``."""
    if not isinstance(base, _CLASSES):
        return None
    logits = base.logits
    return logits - logits.mean(-1, keepdim=True)


def _counts(site, base, K: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Counts ``Y [N, K]``, totals ``n [N]``, the per-point weight (scale, masks) and the
    log-density constant (the multinomial coefficient)."""
    y = site["value"]
    logits = base.logits
    batch = logits.shape[:-1]
    weight = torch.ones(batch, dtype=logits.dtype, device=logits.device)
    mask = unwrap(site["fn"])[1]
    if mask is not None:
        weight = weight * mask.to(weight.dtype)
    if site["mask"] is False:
        weight = weight * 0
    elif site["mask"] is not None and site["mask"] is not True:
        weight = weight * site["mask"].to(weight.dtype)
    weight = weight * site["scale"]
    if isinstance(base, torch.distributions.Categorical) and not isinstance(
        base, torch.distributions.OneHotCategorical
    ):
        idx = torch.where(weight != 0, y, torch.zeros_like(y)).long().expand(batch)
        Y = torch.nn.functional.one_hot(idx, K).to(logits.dtype)
    else:
        Y = torch.where(weight.unsqueeze(-1) != 0, y.to(logits.dtype), 0.0).expand(batch + (K,))
    n = Y.sum(-1)
    const = torch.zeros_like(n)
    if isinstance(base, torch.distributions.Multinomial):
        const = torch.lgamma(n + 1) - torch.lgamma(Y + 1).sum(-1)
    return Y.reshape(-1, K), n.reshape(-1), weight.reshape(-1), const.reshape(-1)


@dataclass
class SoftmaxRows:
    """The factor's affine map ``eta = A z + c`` (rows point-major: ``A [N K, D]``), its data,
    and the current sites' rotated rows (:meth:`rows`)."""

    A: torch.Tensor
    c: torch.Tensor
    K: int
    Y: torch.Tensor
    n: torch.Tensor
    weight: torch.Tensor
    const: torch.Tensor

    @property
    def N(self) -> int:
        return self.A.shape[0] // self.K

    def rows(self, sites: torch.Tensor):
        """``(A_rot [N K, D], w [N K], b [N K], U [N, K, K])``: the sites as scalar rows
        (module docstring); ``U`` rotates them back (:meth:`moments`)."""
        N, K = self.N, self.K
        lam1, lam2 = sites[..., 0], sites[..., 1:]
        W = -(lam2 + lam2.mT)  # -2 lam2, symmetrised
        s, U = torch.linalg.eigh(W)
        b = lam1 + 2 * (lam2 @ self.c.reshape(N, K, 1)).squeeze(-1)
        A_rot = U.mT @ self.A.reshape(N, K, -1)
        b_rot = (U.mT @ b.unsqueeze(-1)).squeeze(-1)
        return A_rot.reshape(N * K, -1), s.reshape(-1), b_rot.reshape(-1), U

    def moments(self, loc: torch.Tensor, row_cov: torch.Tensor, U: torch.Tensor):
        """Mean ``[N, K]`` and covariance ``[N, K, K]`` of ``eta`` from q's mean and the
        covariance blocks of the rotated rows (``U Cov(U^T A z) U^T``)."""
        N, K = self.N, self.K
        mean = (self.A @ loc).reshape(N, K) + self.c.reshape(N, K)
        cov = U @ row_cov @ U.mT
        return mean, 0.5 * (cov + cov.mT)


def softmax_rows(site, factor, z_at: torch.Tensor) -> SoftmaxRows:
    """Rows of a softmax factor at the trace ``site`` (taken at the block value ``z_at``)."""
    base = unwrap(site["fn"])[0]
    eta = centred_logits(base)
    K = eta.shape[-1]
    A = factor.jacobian
    c = eta.detach().reshape(-1) - A @ z_at.reshape(-1)
    Y, n, weight, const = _counts(site, base, K)
    return SoftmaxRows(A, c, K, Y, n, weight, const)


def softmax_message(
    site,
    rows: SoftmaxRows,
    loc: torch.Tensor,
    row_cov: torch.Tensor,
    U: torch.Tensor,
    method: str = "cubature",
    num_points: int = 32,
    num_samples: int = 100,
):
    """ELBO term and target sites ``[N, K, K + 1]`` of a softmax factor under the current q.

    ``row_cov``: the ``[N, K, K]`` covariance blocks of the rotated rows, ``U`` their
    rotation. The value keeps its graph to hyperparameters through the offset ``c`` (as the
    scalar linear predictor does).
    """
    N, K = rows.N, rows.K
    mean, cov = rows.moments(loc.detach(), row_cov.detach(), U)
    eta_now = centred_logits(unwrap(site["fn"])[0])
    if eta_now.requires_grad:
        mean = mean + (eta_now - eta_now.detach()).reshape(N, K)
    mom = lse_expectations(mean, cov, method, num_points=num_points, num_samples=num_samples)
    F, lam1, lam2 = site_targets(rows.Y, rows.n, rows.weight, mean, mom)
    value = (F + rows.weight * rows.const).sum()
    if not value.requires_grad:
        value = value.detach()
    return value, torch.cat([lam1.unsqueeze(-1), lam2], -1).detach()
