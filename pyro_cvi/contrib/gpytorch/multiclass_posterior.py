"""Closed-form q(u) of K latent GPs from coupled K x K CVI sites (multi-class classification).

K independent GP priors ``f_k ~ GP(m_k, k_k)`` with inducing values ``u_k = f_k(Z_k)``
(``M`` points per class, shared or per class), whitened ``u_k = m_k(Z_k) + L_k v_k``,
``L_k L_k^T = K_k(Z_k, Z_k)``. Each data point ``n`` owns one site on its K-vector of
conditional means ``g_n``, ``g_nk = m_k(x_n) + phi_nk^T v_k``, ``phi_nk = L_k^-1 k_k(Z_k, x_n)``
(the dual parameterisation of Adam et al. 2021, in K dimensions)::

    exp(lam1_n^T g_n + g_n^T lam2_n g_n),   W_n = -2 lam2_n  (K x K, PSD: classes coupled).

The conjugate computation (Khan & Lin 2017, eq. 14, with K-variate pseudo-observations) is::

    P = I + sum_n Phi_n^T W_n Phi_n     (KM x KM: P_(ki),(lj) = d + sum_n W_nkl phi_nki phi_nlj)
    h = sum_n Phi_n^T r_n,              r_n = lam1_n - W_n m(x_n),
    q(v) = N(P^-1 h, P^-1),             KL = (tr P^-1 + |m_v|^2 - KM + log |P|) / 2,

with ``Phi_n`` the ``K x KM`` block-diagonal matrix of the ``phi_nk^T``. Storage: the sites are
``O(N K^2)`` and ``Phi`` is ``O(K M N)``; nothing of size ``(N K)^2`` is formed. Cost
``O(N K^2 M^2 + K^3 M^3)`` per solve. With ``Z`` = the training inputs this is the full GP
(exact up to the jitter on ``K_ZZ``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .posterior import safe_cholesky

__all__ = ["MultiClassSitePosterior"]


def _coupled_gram(Phi: Tensor, W: Tensor) -> Tensor:
    """``sum_n Phi_n^T W_n Phi_n`` as ``[K, M, K, M]``: block column ``k`` below the diagonal,
    ``[(l, i), j] = sum_n W_nlk phi_nli phi_nkj`` for ``l >= k``, is one matrix product
    ``[(K - k) M, N] @ [N, M]``; the blocks above the diagonal are their transposes (the Gram
    is symmetric), so K products cover the ``K (K + 1) / 2`` class pairs."""
    K, M, N = Phi.shape
    out = Phi.new_empty(K, M, K, M)
    for k in range(K):
        A = (Phi[k:] * W[:, k:, k].mT.unsqueeze(1)).reshape((K - k) * M, N)
        blk = (A @ Phi[k].mT).reshape(K - k, M, M)  # blocks (l, k), l >= k
        out[k:, :, k, :] = blk
        out[k, :, k + 1 :, :] = blk[1:].transpose(-1, -2).permute(1, 0, 2)
    return out


class MultiClassSitePosterior:
    """q(v) of K whitened GPs from coupled sites (module docstring).

    :param K_ZZ: ``[K, M, M]`` inducing covariances (jitter included).
    :param K_ZX: ``[K, M, N]`` cross covariances to the site inputs.
    :param prior_mean_X: ``[K, N]`` prior means at the site inputs.
    :param lam1: ``[N, K]``; :param lam2: ``[N, K, K]`` (negative semidefinite).
    """

    def __init__(
        self,
        K_ZZ: Tensor,
        K_ZX: Tensor,
        prior_mean_X: Tensor,
        lam1: Tensor,
        lam2: Tensor,
        *,
        whitened: Optional[Tuple[Tensor, Tensor]] = None,
    ):
        K, M, _ = K_ZZ.shape
        self.K, self.M = K, M
        if whitened is None:
            whitened = self.whitening(K_ZZ, K_ZX)
        self.L_Z, self.Phi = whitened  # [K, M, M], [K, M, N]
        eye = torch.eye(K * M, dtype=K_ZZ.dtype, device=K_ZZ.device)
        #: every site empty (the first step): q = prior, ``P = I``, no Gram and no solve
        self.is_prior = not (bool(lam1.any()) or bool(lam2.any()))
        if self.is_prior:
            self.L_P, self.m_v = eye, K_ZZ.new_zeros(K, M)
            self._S_v: Optional[Tensor] = eye.reshape(K, M, K, M)
            return
        W = -(lam2 + lam2.mT)
        r = lam1 - (W @ prior_mean_X.mT.unsqueeze(-1)).squeeze(-1)  # [N, K]
        P = _coupled_gram(self.Phi, W).reshape(K * M, K * M) + eye
        self.L_P = safe_cholesky(0.5 * (P + P.mT), "P = I + sum_n Phi_n^T W_n Phi_n")
        h = torch.einsum("kin,nk->ki", self.Phi, r).reshape(K * M, 1)
        self.m_v = torch.cholesky_solve(h, self.L_P).reshape(K, M)
        self._S_v = None

    @staticmethod
    def whitening(K_ZZ: Tensor, K_ZX: Tensor) -> Tuple[Tensor, Tensor]:
        """``L_Z`` (``L_Z L_Z^T = K_ZZ``) and ``Phi = L_Z^-1 K_ZX``: the part of q that depends on
        the kernel only (a caller may reuse it while the hyperparameters are unchanged)."""
        L_Z = safe_cholesky(K_ZZ, "K_ZZ (the inducing-point kernel matrices)")
        return L_Z, torch.linalg.solve_triangular(L_Z, K_ZX, upper=False)

    def whiten(self, K_Zx: Tensor) -> Tensor:
        """``phi_x = L_Z^-1 k(Z, x)``, ``[K, M, n]``."""
        return torch.linalg.solve_triangular(self.L_Z, K_Zx, upper=False)

    def S_v(self) -> Tensor:
        """``Cov(v) = P^-1`` as ``[K, M, K, M]`` (computed once)."""
        if self._S_v is None:
            K, M = self.K, self.M
            self._S_v = torch.cholesky_inverse(self.L_P).reshape(K, M, K, M)
        return self._S_v

    def predict(
        self, Phi_x: Tensor, prior_mean_x: Tensor, kxx_diag: Tensor, chunk: int = 4096
    ) -> Tuple[Tensor, Tensor]:
        """Marginal mean ``[n, K]`` and covariance ``[n, K, K]`` of ``f(x)`` (classes coupled):
        ``Cov_kl = d_kl (k_k(x, x) - |phi_xk|^2) + phi_xk^T S_v[k, l] phi_xl``,
        ``O(n K^2 M^2)``: for each class ``l`` one product ``S_v[k <= l, :, l, :] phi_xl``
        (``[(l + 1) M, M] @ [M, n]``, in chunks of ``n``), the entries ``k > l`` by symmetry.
        At the prior (``S_v = I``) the covariance is ``diag(k(x, x))``."""
        mean = prior_mean_x.mT + torch.einsum("kin,ki->nk", Phi_x, self.m_v)
        K, M, n = self.K, self.M, Phi_x.shape[-1]
        prior_part = (kxx_diag - Phi_x.pow(2).sum(-2)).clamp_min(0)  # [K, n]
        if self.is_prior:
            return mean, torch.diag_embed((prior_part + Phi_x.pow(2).sum(-2)).mT)
        S_v = self.S_v()
        cov = Phi_x.new_empty(n, K, K)
        for s in range(0, n, chunk):  # bounded temporaries ([K M, chunk]) at any n
            ph = Phi_x[..., s : s + chunk]
            c = ph.shape[-1]
            for l in range(K):
                T = (S_v[: l + 1, :, l, :].reshape((l + 1) * M, M) @ ph[l]).reshape(l + 1, M, c)
                v = (ph[: l + 1] * T).sum(1).mT  # [c, l + 1]: the entries (k, l), k <= l
                cov[s : s + c, : l + 1, l] = v
                cov[s : s + c, l, :l] = v[:, :l]
        return mean, cov + torch.diag_embed(prior_part.mT)

    def kl(self) -> Tensor:
        """``KL[q(v) || N(0, I)] = KL[q(u) || p(u)]`` in closed form."""
        D = self.L_P.shape[-1]
        trace = self.S_v().reshape(D, D).diagonal().sum()  # tr P^-1 (S_v serves predict too)
        logdet = 2.0 * self.L_P.diagonal().log().sum()
        return 0.5 * (trace + self.m_v.pow(2).sum() - D + logdet)

    def q_u(self, prior_mean_Z: Tensor) -> Tuple[Tensor, Tensor]:
        """Mean ``[K, M]`` and joint covariance ``[K M, K M]`` of ``u`` (classes coupled)."""
        mean = prior_mean_Z + (self.L_Z @ self.m_v.unsqueeze(-1)).squeeze(-1)
        D = self.L_P.shape[-1]
        cov = torch.einsum("kab,kblc,lcd->kald", self.L_Z, self.S_v(), self.L_Z.mT)
        return mean, cov.reshape(D, D)
