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
from :mod:`~pyro_cvi.messages.softmax`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ..gaussian.sites import site_to_row_multivariate
from ..model import probes
from ..model.kron_probes import kron_factors_of, matvec
from ..model.records import SOFTMAX, centred_logits
from ..model.tracing import unwrap
from .softmax import lse_expectations, site_targets

__all__ = ["SOFTMAX", "SoftmaxRows", "centred_logits", "softmax_rows", "softmax_message"]


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
    kron: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    @property
    def N(self) -> int:
        return self.A.shape[0] // self.K

    def rows(self, sites: torch.Tensor):
        """The sites as a Bayesian-linear-regression contribution: ``(A_rot [N K, D], w [N K],
        b [N K], U [N, K, K], None)`` (rotated scalar rows, module docstring), or, when
        ``A = X (x) G`` (:attr:`kron`), no rows and the natural parameters ``(h, P)`` summed in
        ``O(N D^2 K^2)``: ``P = sum_n x_n x_n^T (x) G^T W_n G`` (its blocks ``i <= j`` only: the
        ``(j, i)`` block equals the ``(i, j)`` one), ``h = sum_n x_n (x) G^T b_n``."""
        N, K = self.N, self.K
        W, b = site_to_row_multivariate(sites[..., 0], sites[..., 1:], self.c.reshape(N, K))
        if self.kron is not None:
            X, G = self.kron
            Dx = X.shape[1]
            GWG = (G.mT @ W @ G).reshape(N, K * K)
            P = _from_pairs(_outer(X).mT @ GWG, Dx).reshape(Dx, Dx, K, K).permute(0, 2, 1, 3)
            h = X.mT @ (b @ G)
            none = self.A.new_zeros(0)
            return self.A[:0], none, none, None, (h.reshape(-1), P.reshape(Dx * K, Dx * K))
        s, U = torch.linalg.eigh(W)
        A_rot = U.mT @ self.A.reshape(N, K, -1)
        b_rot = (U.mT @ b.unsqueeze(-1)).squeeze(-1)
        return A_rot.reshape(N * K, -1), s.reshape(-1), b_rot.reshape(-1), U, None

    def cov_blocks(self, post, sl: slice, U: Optional[torch.Tensor]) -> torch.Tensor:
        """``Cov(eta_n) [N, K, K]`` under the solved ``post``: from the rotated rows' covariance
        blocks (``U Cov(U^T A_n z) U^T``), or ``G (x_n^T (x) I) V (x_n (x) I) G^T`` as
        ``G (sum_{i <= j} x_ni x_nj (V_ij + [i < j] V_ji)) G^T`` (``V_ij``: ``K x K`` blocks)."""
        N, K = self.N, self.K
        if self.kron is None:
            cov = U @ post.row_cov_blocks(sl, K) @ U.mT
        else:
            X, G = self.kron
            Dx = X.shape[1]
            V = post.covariance().reshape(Dx, K, Dx, K).permute(0, 2, 1, 3)
            i, j = _pairs(Dx, V.device)
            Vp = V[i, j] + torch.where((i < j)[:, None, None], V[j, i], 0.0)  # [pairs, K, K]
            cov = G @ (_outer(X) @ Vp.reshape(-1, K * K)).reshape(N, K, K) @ G.mT
        return 0.5 * (cov + cov.mT)

    def mean(self, loc: torch.Tensor) -> torch.Tensor:
        """``E eta_n = A_n m + c_n``, ``[N, K]`` (``X M G^T + C`` for ``A = X (x) G``)."""
        if self.kron is not None:
            X, G = self.kron
            return X @ (loc.reshape(X.shape[1], -1) @ G.mT) + self.c.reshape(self.N, self.K)
        return (self.A @ loc).reshape(self.N, self.K) + self.c.reshape(self.N, self.K)


def _pairs(D: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The index pairs ``i <= j`` of a symmetric ``D x D`` matrix (row-major upper triangle)."""
    i, j = torch.triu_indices(D, D, device=device)
    return i, j


def _from_pairs(S: torch.Tensor, D: int) -> torch.Tensor:
    """``[D, D, ...]`` symmetric from its pairs ``i <= j`` (:func:`_pairs`) ``S [pairs, ...]``."""
    i, j = _pairs(D, S.device)
    out = S.new_zeros((D, D) + S.shape[1:])
    out[j, i] = S
    out[i, j] = S
    return out


def _outer(X: torch.Tensor) -> torch.Tensor:
    """``[N, D (D + 1) / 2]``: the rows' outer products ``x_n x_n^T`` at the pairs ``i <= j``
    (:func:`_pairs`: the products are symmetric, so half the work in the sums over ``n``);
    kept per ``X`` (the factor's constant design: one allocation per fit, not per step)."""
    hit = _OUTER.get(X)
    if hit is not None and hit[0] == X._version:
        return hit[1]
    out = torch.cat([X[:, i : i + 1] * X[:, i:] for i in range(X.shape[1])], 1)  # (pairs' order)
    if not X.requires_grad:
        _OUTER[X] = (X._version, out)
    return out


#: per constant tensor (weakly held): ``(its version, the derived tensor)``
#: (tensors compare elementwise: torch's weak dictionary keys them by identity)
_OUTER = WeakTensorKeyDictionary()
_KRON = WeakTensorKeyDictionary()


def kron_factors(A: torch.Tensor, K: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(X [N, D'], G [K, K])`` with ``A = X (x) G`` (rows point-major, columns ``d * K + l``)
    when the Jacobian has that structure (``logits = X @ W`` and a bias), else ``None``. Kept
    per constant ``A`` (the test reads ``O(N K D)`` temporaries: once per fit, not per step)."""
    if A.requires_grad:
        return _kron_factors(A, K)
    hit = _KRON.get(A)
    if hit is not None and hit[:2] == (A._version, K):
        return hit[2]
    out = _kron_factors(A, K)
    _KRON[A] = (A._version, K, out)
    return out


#: elements of ``A`` per chunk of :func:`_kron_factors` (the temporaries stay in cache)
KRON_CHUNK = 1 << 16


def _kron_factors(A: torch.Tensor, K: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`kron_factors` uncached. The pivot is ``|A|``'s largest entry (the first, as
    ``argmax``); ``G`` its row block, ``X`` its column scaled by it. ``A = X (x) G`` holds where
    ``|A - X (x) G| <= tol (1 + |A|)`` everywhere (:func:`~pyro_cvi.model.probes.rtol`; the
    scale is ``|A|``'s alone, so a structure this accepts also passes
    :func:`~pyro_cvi.model.probes.close`) and the difference is finite; a product made by the
    Jacobian probe (:func:`~pyro_cvi.model.kron_probes.kron_factors_of`, unedited) gives its
    own factors. Both passes run over chunks of points: no temporary of ``A``'s size (``A`` is
    ``N K x D K``)."""
    R, Dz = A.shape
    if Dz % K or R % K or not R:
        return None
    made = kron_factors_of(A)
    if made is not None and made[1].shape == (K, K):  # made as one by the Jacobian probe
        return made
    N, Dx = R // K, Dz // K
    A4 = A.detach().reshape(N, K, Dx, K)
    step = max(1, KRON_CHUNK // (K * Dz))  # points per chunk
    flat, best = 0, None
    for s in range(0, N, step):  # (a NaN in A: whatever the pivot, the check fails)
        part = A4[s : s + step].abs().reshape(-1)
        i = int(part.argmax())
        if best is None or bool(part[i] > best):
            flat, best = s * K * Dz + i, part[i]
    # (plain arithmetic: torch.unravel_index imports sympy)
    n0, k0, d0, l0 = flat // (K * Dz), flat // Dz % K, flat // K % Dx, flat % K
    A4 = A.reshape(N, K, Dx, K)  # (X and G keep A's graph, if any)
    G = A4[n0, :, d0, :]
    X = A4[:, k0, :, l0] / G[k0, l0]
    tol = probes.rtol(A.dtype)
    with torch.no_grad():
        Gd, Xd = G.detach(), X.detach()
        for s in range(0, N, step):
            a = A4[s : s + step].detach()
            diff = (a - Xd[s : s + step, None, :, None] * Gd[None, :, None, :]).abs_()
            if not bool((diff <= a.abs().mul_(tol).add_(tol)).all()):
                return None
            if not bool(torch.isfinite(diff.sum())):
                return None
    return X, G


def softmax_rows(site, factor, z_at: torch.Tensor, A: Optional[torch.Tensor] = None) -> SoftmaxRows:
    """Rows of a softmax factor at the trace ``site`` (taken at the block value ``z_at``); with
    ``A`` given (the Jacobian with its graph) ``A`` and ``c`` keep their graph to the model's
    parameters (as :func:`~pyro_cvi.messages.gaussian.linear_predictor_rows`)."""
    base = unwrap(site["fn"])[0]
    eta = centred_logits(base)
    K = eta.shape[-1]
    graph = A is not None
    A = factor.jacobian if A is None else A
    c = (eta if graph else eta.detach()).reshape(-1) - matvec(A, z_at.reshape(-1))
    Y, n, weight, const = _counts(site, base, K)
    return SoftmaxRows(A, c, K, Y, n, weight, const, kron_factors(A, K))


def softmax_message(
    site,
    rows: SoftmaxRows,
    loc: torch.Tensor,
    cov: torch.Tensor,
    method: str = "cubature",
    num_points: int = 32,
    num_samples: int = 100,
    graph: bool = False,
):
    """ELBO term and target sites ``[N, K, K + 1]`` of a softmax factor under the current q.

    ``loc``: q's mean; ``cov``: ``Cov(eta_n) [N, K, K]`` (:meth:`SoftmaxRows.cov_blocks`). The
    value keeps its graph to hyperparameters through the offset ``c`` (as the scalar linear
    predictor does); with ``graph`` (rows and a ``q`` solved with their graph) through
    ``A``, ``c``, ``loc`` and ``cov`` instead.
    """
    N, K = rows.N, rows.K
    if graph:
        mean = rows.mean(loc)
    else:
        mean, cov = rows.mean(loc.detach()), cov.detach()
        eta_now = centred_logits(unwrap(site["fn"])[0])
        if eta_now.requires_grad:  # the fixed-q gradient to the offset (A free of parameters)
            mean = mean + (eta_now - eta_now.detach()).reshape(N, K)
    mom = lse_expectations(mean, cov, method, num_points=num_points, num_samples=num_samples)
    F, lam1, lam2 = site_targets(rows.Y, rows.n, rows.weight, mean, mom)
    value = (F + rows.weight * rows.const).sum()
    if not value.requires_grad:
        value = value.detach()
    return value, torch.cat([lam1.unsqueeze(-1), lam2], -1).detach()
