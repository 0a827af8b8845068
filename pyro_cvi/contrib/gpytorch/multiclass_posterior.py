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

from typing import Tuple

import torch
from torch import Tensor

from .posterior import safe_cholesky

__all__ = ["MultiClassSitePosterior"]


def _pairs(K: int, device) -> Tuple[Tensor, Tensor]:
    """The class pairs ``k <= l`` (both blocks are symmetric in the pair: half the work)."""
    iu = torch.triu_indices(K, K, device=device)
    return iu[0], iu[1]


def _coupled_gram(Phi: Tensor, W: Tensor, chunk: int = 1024) -> Tensor:
    """``sum_n Phi_n^T W_n Phi_n`` as ``[K, M, K, M]``: for each class pair ``k <= l`` the
    matrix product ``Phi_k diag(W_:kl) Phi_l^T`` (block ``(l, k)`` is its transpose), batched
    over the pairs, in chunks of the data."""
    K, M, N = Phi.shape
    a, b = _pairs(K, Phi.device)
    G = Phi.new_zeros(a.shape[0], M, M)
    for s in range(0, N, chunk):
        ph, w = Phi[..., s : s + chunk], W[s : s + chunk, a, b].mT  # w: [pairs, c]
        G = G + (ph[a] * w.unsqueeze(1)) @ ph[b].mT
    out = Phi.new_zeros(K, K, M, M)
    out = out.index_put((a, b), G).index_put((b, a), G.mT)
    return out.permute(0, 2, 1, 3)


class MultiClassSitePosterior:
    """q(v) of K whitened GPs from coupled sites (module docstring).

    :param K_ZZ: ``[K, M, M]`` inducing covariances (jitter included).
    :param K_ZX: ``[K, M, N]`` cross covariances to the site inputs.
    :param prior_mean_X: ``[K, N]`` prior means at the site inputs.
    :param lam1: ``[N, K]``; :param lam2: ``[N, K, K]`` (negative semidefinite).
    """

    def __init__(
        self, K_ZZ: Tensor, K_ZX: Tensor, prior_mean_X: Tensor, lam1: Tensor, lam2: Tensor
    ):
        K, M, _ = K_ZZ.shape
        self.K, self.M = K, M
        self.L_Z = safe_cholesky(K_ZZ, "K_ZZ (the inducing-point kernel matrices)")
        self.Phi = torch.linalg.solve_triangular(self.L_Z, K_ZX, upper=False)  # [K, M, N]
        W = -(lam2 + lam2.mT)
        r = lam1 - (W @ prior_mean_X.mT.unsqueeze(-1)).squeeze(-1)  # [N, K]
        P = _coupled_gram(self.Phi, W).reshape(K * M, K * M)
        P = P + torch.eye(K * M, dtype=P.dtype, device=P.device)
        self.L_P = safe_cholesky(0.5 * (P + P.mT), "P = I + sum_n Phi_n^T W_n Phi_n")
        h = torch.einsum("kin,nk->ki", self.Phi, r).reshape(K * M, 1)
        self.m_v = torch.cholesky_solve(h, self.L_P).reshape(K, M)
        self._S_v = None

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
        self, Phi_x: Tensor, prior_mean_x: Tensor, kxx_diag: Tensor, chunk: int = 2048
    ) -> Tuple[Tensor, Tensor]:
        """Marginal mean ``[n, K]`` and covariance ``[n, K, K]`` of ``f(x)`` (classes coupled):
        ``Cov_kl = d_kl (k_k(x, x) - |phi_xk|^2) + phi_xk^T S_v[k, l] phi_xl``,
        ``O(n K^2 M^2)``, in chunks of ``n``."""
        mean = prior_mean_x.mT + torch.einsum("kin,ki->nk", Phi_x, self.m_v)
        S_v = self.S_v()
        K = self.K
        a, b = _pairs(K, Phi_x.device)
        S_ab = S_v[a, :, b, :]  # [pairs, M, M]
        E = Phi_x.new_zeros(a.shape[0], K * K)  # pair -> entries (k, l) and (l, k)
        E[torch.arange(a.shape[0]), a * K + b] = 1.0
        E[torch.arange(a.shape[0]), b * K + a] = 1.0
        covs = []
        for s in range(0, Phi_x.shape[-1], chunk):
            ph = Phi_x[..., s : s + chunk]  # [K, M, c]
            v = (ph[a] * (S_ab @ ph[b])).sum(-2).mT  # [c, pairs] (batched matmuls)
            covs.append((v @ E).reshape(-1, K, K))
        cov = torch.cat(covs, 0) if covs else mean.new_zeros(0, K, K)
        prior_part = kxx_diag - Phi_x.pow(2).sum(-2)  # [K, n]
        cov = cov + torch.diag_embed(prior_part.mT.clamp_min(0))
        return mean, cov

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
