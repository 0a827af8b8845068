"""Closed-form q(f) from CVI sites: GP regression with Gaussian pseudo-observations.

CVI (Khan & Lin 2017, eqs. 13-14) replaces each likelihood factor ``p(y_n | f_n)`` by a Gaussian
site ``exp(lam1_n f_n + lam2_n f_n^2)`` with ``lam2_n <= 0``. Writing ``W = -2 lam2`` (site
precisions) and ``r = lam1 - W m0`` (sites relative to the prior mean ``m0``), the posterior is::

    q(f) ∝ N(f | m0, K) prod_n exp(lam1_n f_n + lam2_n f_n^2)
         = N(f | m0 + (K^-1 + W)^-1 r, (K^-1 + W)^-1),

i.e. GP regression with pseudo-targets ``lam1 / W`` and noise variances ``1 / W``. Both forms
below are written so that ``W = 0`` (an empty site) needs no special case and ``K`` is never
inverted.

* :class:`FullSitePosterior` (sites on every training input; Rasmussen & Williams Alg. 3.2,
  computed by :func:`pyro_cvi.linalg.dual_solve`, shared with the Pyro guide)::

      B = I + W^1/2 K W^1/2 = L L^T,     alpha = r - W^1/2 B^-1 W^1/2 K r,
      m(x) = m0(x) + k(x, X) alpha,       v(x) = k(x, x) - |L^-1 W^1/2 k(X, x)|^2,
      KL[q || p] = 1/2 (-sum_n W_n v_n + alpha^T K alpha + log |B|).

  ``B`` has eigenvalues >= 1, so its Cholesky factor exists even when ``K`` is numerically
  singular (the paper's log sf = 5 setting). Cost O(N^3), memory O(N^2).

* :class:`SparseSitePosterior` (sites on the N training inputs, ``u = f(Z)`` at M inducing
  points; the dual parameterisation of Adam et al. 2021). A site acts on the conditional mean
  ``a_n^T u`` with ``a_n = K_ZZ^-1 k(Z, x_n)``. In whitened coordinates ``u = m0(Z) + L_Z v``::

      Phi = L_Z^-1 K_ZX (M x N),          B = I + Phi W Phi^T = L_B L_B^T,
      q(v) = N(B^-1 Phi r, B^-1),         (the optimal SGPR q(u) for the pseudo-data)
      KL[q(v) || N(0, I)] = 1/2 (tr B^-1 + |m_v|^2 - M + log |B|).

  Cost O(N M^2), memory O(N M). ``B`` and ``Phi r`` need the data only through the sums
  ``Phi W Phi^T = sum_n phi_n W_n phi_n^T`` and ``Phi r = sum_n phi_n r_n``: data-parallel,
  each rank sums its shard and one all-reduce gives every rank the full-data q(v).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from ...gaussian.sites import site_to_row
from ...linalg import cholesky, dual_solve

__all__ = ["FullSitePosterior", "SparseSitePosterior", "safe_cholesky"]

_ADVICE = (
    "Use float64 (model.double(), likelihood.double()), increase jitter_val, or reduce the CVI "
    "step_size."
)


def safe_cholesky(A: Tensor, what: str) -> Tensor:
    """Cholesky factor of ``A`` (no jitter), or a clear error naming the matrix and what to do.

    :raises pyro_cvi.linalg.NotPositiveDefinite: (a ``RuntimeError``) if ``A`` is not positive
        definite.
    """
    return cholesky(A, what=what, hint=_ADVICE)


def _site_precisions(lam2: Tensor) -> Tensor:
    """The row precisions ``w = -2 lam2`` of sites on ``f`` itself, negative ones at 0."""
    return site_to_row(lam2, lam2, torch.zeros_like(lam2))[0].clamp_min(0.0)


class FullSitePosterior:
    """q(f(X)) for sites on every input in ``X`` (the "full" GP), in the stable ``B`` form.

    :param K: prior covariance ``k(X, X)``, ``N x N`` (dense).
    :param prior_mean: ``m0(X)``, length ``N``.
    :param lam1: site natural parameters ``lam1``, length ``N``.
    :param lam2: site natural parameters ``lam2 <= 0``, length ``N``.
    """

    def __init__(self, K: Tensor, prior_mean: Tensor, lam1: Tensor, lam2: Tensor):
        w = _site_precisions(lam2)
        # centred sites r = lam1 - W m0: the solve is for f - m0 (see pyro_cvi.linalg.dual_solve)
        self._sol = sol = dual_solve(K, w, lam1 - w * prior_mean, hint=_ADVICE)
        self.L = sol.L
        self.alpha = sol.alpha
        self.K = K
        self.w = w
        self.sqrt_w = sol.sqrt_w
        # Posterior marginals at the site inputs.
        self.Vh = sol.V
        self.mean = prior_mean + sol.mean
        self.var = sol.var

    def predict(self, K_Xx: Tensor, prior_mean_x: Tensor) -> Tuple[Tensor, Tensor]:
        """Return the predictive mean at ``x`` and ``R`` with ``cov = k(x, x) - R^T R``."""
        mean = prior_mean_x + K_Xx.mT @ self.alpha
        return mean, self._sol.whiten(K_Xx)

    def kl(self) -> Tensor:
        """``KL[q(f(X)) || p(f(X))]`` in closed form (uses ``tr B^-1 = N - sum_n W_n v_n``)."""
        quad = self.alpha @ (self.K @ self.alpha)
        return 0.5 * (quad + self._sol.logdet_B - (self.w * self.var).sum(-1))

    def q_u(self) -> Tuple[Tensor, Tensor]:
        """Dense mean and covariance of q(f(X)) (O(N^2) memory; for inspection only)."""
        return self.mean, self.K - self.Vh.mT @ self.Vh


class SparseSitePosterior:
    """q(u) with ``u = f(Z)`` for sites on the ``N`` training inputs (dual parameterisation).

    :param K_ZZ: ``k(Z, Z) + jitter I``, ``M x M``.
    :param K_ZX: ``k(Z, X)``, ``M x N`` (X: the site inputs).
    :param prior_mean_X: ``m0(X)``, length ``N``.
    :param lam1: site natural parameters, length ``N``.
    :param lam2: site natural parameters ``<= 0``, length ``N``.
    :param reduce: data-parallel: sums a list of tensors over the ranks (a
        :class:`pyro_cvi.scale.distributed.Reducer`); the sites then are this rank's shard and the
        sums over data points ``Phi W Phi^T`` and ``Phi r`` are all-reduced (one call).
    """

    def __init__(
        self,
        K_ZZ: Tensor,
        K_ZX: Tensor,
        prior_mean_X: Tensor,
        lam1: Tensor,
        lam2: Tensor,
        reduce: Optional[Callable[[List[Tensor]], List[Tensor]]] = None,
        sums: Optional[SiteSums] = None,
    ):
        if sums is not None:  # L_Z, Phi and the sums kept across minibatch steps
            self.L_Z, self.Phi, S, s = sums.L_Z, sums.Phi, sums.S, sums.s
        else:
            self.L_Z = safe_cholesky(K_ZZ, "K_ZZ (the inducing-point kernel matrix)")
            self.Phi = torch.linalg.solve_triangular(self.L_Z, K_ZX, upper=False)
            S, s = site_sums(self.Phi, lam1, lam2, prior_mean_X)
        m = K_ZZ.shape[-1]
        eye = torch.eye(m, dtype=K_ZZ.dtype, device=K_ZZ.device)
        if reduce is not None:  # every rank's data points
            S, s = reduce([S, s])
        self.L_B = safe_cholesky(eye + S, "B = I + Phi W Phi^T")
        self.m_v = torch.cholesky_solve(s.unsqueeze(-1), self.L_B).squeeze(-1)
        self.prior_mean_X = prior_mean_X

    def predict(self, Phi_x: Tensor, prior_mean_x: Tensor) -> Tuple[Tensor, Tensor]:
        """Mean at x and ``Psi = L_B^-1 Phi_x``: ``cov = k(x,x) - Phi_x^T Phi_x + Psi^T Psi``."""
        mean = prior_mean_x + Phi_x.mT @ self.m_v
        Psi = torch.linalg.solve_triangular(self.L_B, Phi_x, upper=False)
        return mean, Psi

    def whiten(self, K_Zx: Tensor) -> Tensor:
        """``Phi_x = L_Z^-1 k(Z, x)``."""
        return torch.linalg.solve_triangular(self.L_Z, K_Zx, upper=False)

    def marginals(
        self, Phi_x: Tensor, kxx_diag: Tensor, prior_mean_x: Tensor
    ) -> Tuple[Tensor, Tensor]:
        mean, Psi = self.predict(Phi_x, prior_mean_x)
        var = kxx_diag - Phi_x.pow(2).sum(-2) + Psi.pow(2).sum(-2)
        return mean, var

    def kl(self) -> Tensor:
        """``KL[q(u) || p(u)] = KL[q(v) || N(0, I)]`` in closed form."""
        m = self.L_B.shape[-1]
        eye = torch.eye(m, dtype=self.L_B.dtype, device=self.L_B.device)
        L_inv = torch.linalg.solve_triangular(self.L_B, eye, upper=False)
        trace = L_inv.pow(2).sum((-2, -1))
        logdet_B = 2.0 * self.L_B.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        return 0.5 * (trace + self.m_v @ self.m_v - m + logdet_B)

    def q_u(self, prior_mean_Z: Tensor) -> Tuple[Tensor, Tensor]:
        """Dense mean and covariance of q(u), ``u = f(Z)``."""
        mean = prior_mean_Z + self.L_Z @ self.m_v
        m = self.L_B.shape[-1]
        eye = torch.eye(m, dtype=self.L_B.dtype, device=self.L_B.device)
        S_v = torch.cholesky_solve(eye, self.L_B)
        return mean, self.L_Z @ S_v @ self.L_Z.mT


def site_sums(Phi: Tensor, lam1: Tensor, lam2: Tensor, prior_mean: Tensor) -> Tuple[Tensor, Tensor]:
    """``sum_n phi_n W_n phi_n^T`` and ``sum_n phi_n r_n`` (``r = lam1 - W m0``) over the columns
    of ``Phi``."""
    w = _site_precisions(lam2)
    return (Phi * w.unsqueeze(-2)) @ Phi.mT, Phi @ (lam1 - w * prior_mean)


class SiteSums:
    """What q(u) of the sparse form needs from the data, kept across minibatch CVI steps at fixed
    hyperparameters: ``L_Z``, ``Phi = L_Z^-1 K_ZX`` (computed once, O(N M^2)) and the running sums
    ``S = sum_n phi_n W_n phi_n^T``, ``s = sum_n phi_n r_n``. A step on the sites of a batch B
    changes them by ``Phi_B diag(dW) Phi_B^T`` and ``Phi_B dr`` (O(B M^2)); q(u) then costs
    O(M^3) and the batch's marginals O(B M^2). The sums are recomputed in full every
    :attr:`REFRESH` updates, so round-off does not accumulate.

    :param version: the strategy's site version these sums belong to.
    """

    REFRESH = 50

    def __init__(self, K_ZZ: Tensor, K_ZX: Tensor, prior_mean_X: Tensor, lam1, lam2, version: int):
        self.L_Z = safe_cholesky(K_ZZ, "K_ZZ (the inducing-point kernel matrix)")
        self.Phi = torch.linalg.solve_triangular(self.L_Z, K_ZX, upper=False)
        self.prior_mean_X = prior_mean_X
        self.refresh(lam1, lam2, version)

    def refresh(self, lam1: Tensor, lam2: Tensor, version: int) -> None:
        self.S, self.s = site_sums(self.Phi, lam1, lam2, self.prior_mean_X)
        self.version, self.updates = version, 0

    @staticmethod
    def updatable(sums: Optional[SiteSums], version: int, indices) -> Optional[SiteSums]:
        """``sums`` if they belong to ``version`` and ``indices`` are distinct rows, else None."""
        if sums is None or indices is None or sums.version != version:
            return None
        return sums if torch.unique(indices).numel() == indices.numel() else None

    def scale(self, factor: float) -> None:
        """Every site multiplied by ``factor``: both sums are linear in the sites."""
        self.S, self.s = self.S * factor, self.s * factor

    def update(self, indices: Tensor, old: Tuple[Tensor, Tensor], new: Tuple[Tensor, Tensor]):
        """Account for the sites at ``indices`` (distinct) going from ``old`` to ``new``."""
        P, m0 = self.Phi[..., indices], self.prior_mean_X[..., indices]
        S_new, s_new = site_sums(P, new[0], new[1], m0)
        S_old, s_old = site_sums(P, old[0], old[1], m0)
        self.S = self.S + (S_new - S_old)
        self.s = self.s + (s_new - s_old)
        self.updates += 1
