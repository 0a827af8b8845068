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

When the classes share ``phi_n`` (one kernel, or equal ones, and shared inducing inputs),
``P = I + sum_n W_n (x) phi_n phi_n^T`` (class-major): every block ``sum_n W_nkl phi_n
phi_n^T`` is symmetric, and both the Gram and the marginals ``phi_n^T S_v[k, l] phi_n`` are
one matrix product with the table of the ``M (M + 1) / 2`` distinct products
``phi_ni phi_nj`` (``O(N K^2 M^2 / 4)`` each, half the general count).

Softmax sites ignore a common shift of the classes: ``E[H] 1 = 0`` and ``1^T (y - E p) = 0``,
so ``W_n 1 = 0`` and ``1^T r_n = 0`` (and so for every convex combination of targets). In the
orthonormal basis ``(1 / sqrt(K), B)`` of the classes (``B``: :func:`contrast_basis`), with
``phi`` shared, ``P`` is then block diagonal: the common part keeps its prior ``N(0, I)`` and
only the contrasts are solved, ``P_r = I + sum_n (B^T W_n B) (x) phi_n phi_n^T`` of size
``(K - 1) M`` (at ``K = 10``: 0.73 of the factorisations, 0.82 of the Gram and the marginals),
``m_v = B m_r``, ``S_v = (B (x) I) P_r^-1 (B (x) I)^T + (1 1^T / K) (x) I``,
``Cov f(x_n) = B (phi_n^T P_r^-1 phi_n) B^T + |phi_n|^2 1 1^T / K + diag(k_nn - |phi_n|^2)``
and the KL is that of the contrasts. The test is exact up to round-off (64 K eps relative);
other sites take the full solve.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from .posterior import safe_cholesky

__all__ = ["MultiClassSitePosterior"]


def _coupled_gram(Phi: Tensor, W: Tensor) -> Tensor:
    """``sum_n Phi_n^T W_n Phi_n`` as ``[K, M, K, M]``: block column ``k`` below the diagonal,
    ``[(l, i), j] = sum_n W_nlk phi_nli phi_nkj`` for ``l >= k``, is one matrix product
    ``[(K - k) M, N] @ [N, M]``; the blocks above the diagonal are their transposes (the Gram
    is symmetric), so K products cover the ``K (K + 1) / 2`` class pairs. Any ``phi`` per
    class, differentiable; :func:`_shared_precision` is the same sum when ``phi`` is shared."""
    K, M, N = Phi.shape
    out = Phi.new_empty(K, M, K, M)
    for k in range(K):
        A = (Phi[k:] * W[:, k:, k].mT.unsqueeze(1)).reshape((K - k) * M, N)
        blk = (A @ Phi[k].mT).reshape(K - k, M, M)  # blocks (l, k), l >= k
        out[k:, :, k, :] = blk
        out[k, :, k + 1 :, :] = blk[1:].transpose(-1, -2).permute(1, 0, 2)
    return out


#: elements of the per-chunk temporaries of :meth:`MultiClassSitePosterior.predict` (a
#: megabyte in float64): small buffers are reused by the allocator, where ``[K, M, n]``
#: temporaries would be fresh pages every call
CHUNK_ELEMENTS = 1 << 17
#: the largest products table ``Psi`` (:func:`shared_products`, elements) that is built
PACK_ELEMENTS = 1 << 23


def shared_products(Phi: Tensor) -> Optional[Tensor]:
    """``Psi [M (M + 1) / 2, N]``, ``Psi_(ij),n = phi_ni phi_nj`` (``i <= j``, the rows of
    ``torch.triu_indices``), when every class has the same ``phi_n`` (one kernel, or equal
    kernels, and one set of inducing inputs) and no graph is needed; else ``None``. Then the
    Gram is ``sum_n W_n (x) phi_n phi_n^T`` (eq. below) and both it and the marginals are one
    product with ``Psi`` each (:func:`_shared_precision`, :func:`_shared_cov`)."""
    K, M, N = Phi.shape
    if Phi.requires_grad or (M * (M + 1) // 2) * N > PACK_ELEMENTS:
        return None
    if not all(torch.equal(Phi[0], Phi[k]) for k in range(1, K)):
        return None
    phi = Phi[0]
    out = phi.new_empty(M * (M + 1) // 2, N)
    r = 0
    for i in range(M):  # the rows (i, j >= i), written in place (no gathered temporaries)
        torch.mul(phi[i], phi[i:], out=out[r : r + M - i])
        r += M - i
    return out


@functools.lru_cache(maxsize=8)
def _pack_index(K: int, M: int, device: torch.device) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Flat positions in a ``[K, M, K, M]`` array of the packed entries ``(q, p)``: class pairs
    ``q = (l, k)``, ``l >= k`` (``torch.tril_indices``), entry pairs ``p = (i, j)``, ``i <= j``
    (``torch.triu_indices``): ``(l, i, k, j)`` and ``(l, j, k, i)`` (the two copies in a
    symmetric block), ``[pairs, M (M + 1) / 2]`` each; and the class and entry pairs."""
    low = torch.tril_indices(K, K, device=device)
    iu = torch.triu_indices(M, M, device=device)
    lq, kq = low[0].unsqueeze(1), low[1].unsqueeze(1)
    ij = ((lq * M + iu[0]) * K + kq) * M + iu[1]
    ji = ((lq * M + iu[1]) * K + kq) * M + iu[0]
    return ij, ji, low, iu


def _shared_precision(Psi: Tensor, W: Tensor, K: int, M: int) -> Tensor:
    """``P = I + sum_n W_n (x) phi_n phi_n^T`` (``phi`` shared by the classes) as ``[K M, K M]``,
    its blocks ``(l, k)``, ``l >= k``, filled and those above the diagonal zero (the Cholesky
    factorisation reads the lower triangle only). Each block is symmetric, so the
    ``K (K + 1) / 2`` blocks are one product ``W_(lk)^T Psi^T`` over the ``M (M + 1) / 2``
    distinct entries (half the multiplications of the general Gram), written to both places."""
    ij, ji, low, _ = _pack_index(K, M, W.device)
    G = (Psi @ W[:, low[0], low[1]]).mT.reshape(-1)  # [pairs * M (M + 1) / 2]
    P = G.new_zeros(K * M * K * M)
    P.index_copy_(0, ji.reshape(-1), G)
    P.index_copy_(0, ij.reshape(-1), G)
    P = P.view(K * M, K * M)
    P.diagonal().add_(1.0)
    return P


def _shared_cov(Psi: Tensor, S_v: Tensor) -> Tensor:
    """``Phi_n S_v Phi_n^T [N, K, K]`` (``phi`` shared): ``phi^T S_v[l, :, k, :] phi`` is the
    product of ``Psi`` with the packed symmetric part of ``B = S_v[l, :, k, :]`` (entries
    ``B_ij + B_ji``, ``i < j``, and ``B_ii``), one product for the ``K (K + 1) / 2`` pairs."""
    K, M = S_v.shape[:2]
    ij, ji, low, iu = _pack_index(K, M, S_v.device)
    flat = S_v.reshape(-1)
    Sp = flat.take(ij).add_(flat.take(ji))  # [pairs, M (M + 1) / 2]
    Sp[:, iu[0] == iu[1]] *= 0.5
    C = (Sp @ Psi).mT  # [N, pairs]
    cov = C.new_empty(C.shape[0], K, K)
    cov[:, low[0], low[1]] = C
    cov[:, low[1], low[0]] = C
    return cov


@functools.lru_cache(maxsize=8)
def contrast_basis(K: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``B [K, K - 1]``: orthonormal columns spanning the vectors orthogonal to ``1`` (the
    Helmert contrasts, column ``j``: ``(1, .., 1, -j, 0, ..) / sqrt(j (j + 1))``)."""
    B = torch.zeros(K, K - 1, dtype=torch.float64)
    for j in range(1, K):
        B[:j, j - 1] = 1.0
        B[j, j - 1] = -float(j)
        B[:, j - 1] /= (j * (j + 1)) ** 0.5
    return B.to(dtype=dtype, device=device)


def _ignore_common_shift(W: Tensor, r: Tensor) -> bool:
    """Whether every site ignores a common shift of the K classes up to round-off: ``W_n 1 =
    0`` and ``1^T r_n = 0`` (softmax sites: ``E[H] 1 = 0``, ``1^T (y - E p) = 0``; their convex
    combinations too). Then ``P`` is block diagonal in the basis ``(1 / sqrt(K), B)``: the
    common part keeps its prior ``N(0, I)`` and only the ``(K - 1) M`` contrasts are solved."""
    tol = 64 * W.shape[-1] * torch.finfo(W.dtype).eps
    w_scale, r_scale = float(W.abs().amax()), float(r.abs().amax())
    return bool(W.sum(-1).abs().amax() <= tol * w_scale) and bool(
        r.sum(-1).abs().amax() <= tol * r_scale
    )


def _factor(P: Tensor) -> Tensor:
    """The Cholesky factor of ``P`` (lower triangle read); a finite diagonal with LAPACK's
    success flag means every entry is finite (a NaN or infinity reaches the diagonal of its
    row), so only a failure goes through the full checks and their error message."""
    L, info = torch.linalg.cholesky_ex(P)
    if int(info) == 0 and bool(torch.isfinite(L.diagonal()).all()):
        return L
    return safe_cholesky(P, "P = I + sum_n Phi_n^T W_n Phi_n")


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
        products: Optional[Tensor] = None,
    ):
        K, M, _ = K_ZZ.shape
        self.K, self.M = K, M
        if whitened is None:
            whitened = self.whitening(K_ZZ, K_ZX)
        self.L_Z, self.Phi = whitened  # [K, M, M], [K, M, N]
        #: ``Psi`` of :func:`shared_products` (``phi`` shared by the classes), or ``None``
        self.Psi = products
        #: ``contrast_basis`` where the sites ignore a common shift of the classes, else None
        self.B: Optional[Tensor] = None
        self._S_r: Optional[Tensor] = None
        #: every site empty (the first step): q = prior, ``P = I``, no Gram and no solve
        self.is_prior = not (bool(lam1.any()) or bool(lam2.any()))
        if self.is_prior:
            eye = torch.eye(K * M, dtype=K_ZZ.dtype, device=K_ZZ.device)
            self.L_P, self.m_v = eye, K_ZZ.new_zeros(K, M)
            self._S_v: Optional[Tensor] = eye.reshape(K, M, K, M)
            return
        W = -(lam2 + lam2.mT)
        r = lam1 - (W @ prior_mean_X.mT.unsqueeze(-1)).squeeze(-1)  # [N, K]
        shared = self.Psi is not None and not (torch.is_grad_enabled() and W.requires_grad)
        if shared and _ignore_common_shift(W, r):
            B = self.B = contrast_basis(K, W.dtype, W.device)
            self.L_P = _factor(_shared_precision(self.Psi, B.mT @ W @ B, K - 1, M))
            h = (self.Phi[0] @ (r @ B)).mT.reshape((K - 1) * M, 1)
            self._m_r = torch.cholesky_solve(h, self.L_P).reshape(K - 1, M)
            self.m_v = B @ self._m_r
            self._S_v = self._S_r = None
            return
        if shared:
            P = _shared_precision(self.Psi, W, K, M)
        else:
            eye = torch.eye(K * M, dtype=K_ZZ.dtype, device=K_ZZ.device)
            P = _coupled_gram(self.Phi, W).reshape(K * M, K * M) + eye
            P = 0.5 * (P + P.mT)
        self.L_P = _factor(P)
        h = torch.einsum("kin,nk->ki", self.Phi, r).reshape(K * M, 1)
        self.m_v = torch.cholesky_solve(h, self.L_P).reshape(K, M)
        self._S_v = None

    @staticmethod
    def whitening(K_ZZ: Tensor, K_ZX: Tensor) -> Tuple[Tensor, Tensor]:
        """``L_Z`` (``L_Z L_Z^T = K_ZZ``) and ``Phi = L_Z^-1 K_ZX``: the part of q that depends on
        the kernel only (a caller may reuse it while the hyperparameters are unchanged)."""
        K = K_ZZ.shape[0]
        graph = torch.is_grad_enabled() and (K_ZZ.requires_grad or K_ZX.requires_grad)
        if (
            K > 1
            and not graph
            and all(  # one kernel: one factorisation and solve (bitwise equal)
                torch.equal(K_ZZ[0], K_ZZ[k]) and torch.equal(K_ZX[0], K_ZX[k]) for k in range(1, K)
            )
        ):
            L_Z, Phi = MultiClassSitePosterior.whitening(K_ZZ[:1], K_ZX[:1])
            return L_Z.expand_as(K_ZZ), Phi.expand_as(K_ZX)
        L_Z = safe_cholesky(K_ZZ, "K_ZZ (the inducing-point kernel matrices)")
        return L_Z, torch.linalg.solve_triangular(L_Z, K_ZX, upper=False)

    def whiten(self, K_Zx: Tensor) -> Tensor:
        """``phi_x = L_Z^-1 k(Z, x)``, ``[K, M, n]``."""
        return torch.linalg.solve_triangular(self.L_Z, K_Zx, upper=False)

    def S_v(self) -> Tensor:
        """``Cov(v) = P^-1`` as ``[K, M, K, M]`` (computed once)."""
        if self._S_v is None:
            K, M = self.K, self.M
            if self.B is None:
                self._S_v = torch.cholesky_inverse(self.L_P).reshape(K, M, K, M)
            else:  # (B (x) I) S_r (B (x) I)^T + (1 1^T / K) (x) I
                S = torch.einsum("ka,aibj,lb->kilj", self.B, self.S_r(), self.B)
                eye = torch.eye(M, dtype=S.dtype, device=S.device)
                self._S_v = S + (eye / K).expand(K, K, M, M).transpose(1, 2)
        return self._S_v

    def S_r(self) -> Tensor:
        """``P_r^-1 [K - 1, M, K - 1, M]``, the covariance of the contrasts ``B^T v`` (only where
        the sites ignore a common shift of the classes: ``B`` is set)."""
        if self._S_r is None:
            K, M = self.K - 1, self.M
            self._S_r = torch.cholesky_inverse(self.L_P).reshape(K, M, K, M)
        return self._S_r

    def predict(
        self,
        Phi_x: Tensor,
        prior_mean_x: Tensor,
        kxx_diag: Tensor,
        chunk: Optional[int] = None,
        products: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Tensor]:
        """Marginal mean ``[n, K]`` and covariance ``[n, K, K]`` of ``f(x)`` (classes coupled):
        ``Cov_kl = d_kl (k_k(x, x) - |phi_xk|^2) + phi_xk^T S_v[k, l] phi_xl``,
        ``O(n K^2 M^2)``: for each class ``l`` one product ``S_v[k <= l, :, l, :] phi_xl``
        (``[(l + 1) M, M] @ [M, c]`` over chunks of ``c`` points; by the symmetry of ``S_v`` the
        left factor is a strided view of its rows ``l``, not a copy), the entries ``k > l`` by
        symmetry. ``chunk``: points per chunk (default: temporaries of
        :data:`CHUNK_ELEMENTS`). ``products``: ``Psi`` of ``Phi_x`` (:func:`shared_products`):
        then one product (:func:`_shared_cov`). At the prior (``S_v = I``) the covariance is
        ``diag(k(x, x))``."""
        mean = prior_mean_x.mT + torch.einsum("kin,ki->nk", Phi_x, self.m_v)
        K, M, n = self.K, self.M, Phi_x.shape[-1]
        reduced = (
            self.B is not None
            and products is not None
            and not (torch.is_grad_enabled() and Phi_x.requires_grad)
        )
        S_v = self.S_r() if reduced else self.S_v()
        graph = torch.is_grad_enabled() and (Phi_x.requires_grad or S_v.requires_grad)
        # |phi_xk|^2; without a graph by a reduction (no [K, M, n] temporary)
        sq = Phi_x.pow(2).sum(-2) if graph else torch.linalg.vector_norm(Phi_x, dim=-2).square()
        prior_part = (kxx_diag - sq).clamp_min(0)  # [K, n]
        if self.is_prior:
            return mean, torch.diag_embed((prior_part + sq).mT)
        if reduced:  # B C_n B^T + |phi_n|^2 1 1^T / K, C_n = phi_n^T S_r phi_n (the contrasts)
            C = self.B @ _shared_cov(products, S_v) @ self.B.mT
            common = (sq[0] / K)[:, None, None].expand(n, K, K)
            return mean, C + common + torch.diag_embed(prior_part.mT)
        if products is not None and not graph:
            return mean, _shared_cov(products, S_v) + torch.diag_embed(prior_part.mT)
        c = max(1, min(n, CHUNK_ELEMENTS // (K * M) if chunk is None else int(chunk)))
        cov = Phi_x.new_empty(n, K, K)
        buf = None if graph else Phi_x.new_empty(K * M * c)
        for s in range(0, n, c):  # bounded temporaries ([K M, c]) at any n
            ph = Phi_x[..., s : s + c]
            e = ph.shape[-1]
            for l in range(K):
                # S_v[k <= l, :, l, :] as [(l + 1) M, M]: the transpose of the view S_v[l, :, :l+1]
                left = S_v[l, :, : l + 1, :].reshape(M, (l + 1) * M).mT
                if buf is None:
                    T = (left @ ph[l]).reshape(l + 1, M, e)
                    v = (ph[: l + 1] * T).sum(1).mT  # [e, l + 1]: the entries (k, l), k <= l
                else:
                    T = buf[: (l + 1) * M * e].view((l + 1) * M, e)
                    torch.matmul(left, ph[l], out=T)
                    v = T.view(l + 1, M, e).mul_(ph[: l + 1]).sum(1).mT
                cov[s : s + e, : l + 1, l] = v
                cov[s : s + e, l, :l] = v[:, :l]
        return mean, cov + torch.diag_embed(prior_part.mT)

    def kl(self) -> Tensor:
        """``KL[q(v) || N(0, I)] = KL[q(u) || p(u)]`` in closed form."""
        D = self.L_P.shape[-1]
        if self.B is not None:  # the common shift keeps its prior: KL of the contrasts only
            trace = self.S_r().reshape(D, D).diagonal().sum()
            m2 = self._m_r.pow(2).sum()
        else:
            trace = self.S_v().reshape(D, D).diagonal().sum()  # tr P^-1 (S_v serves predict)
            m2 = self.m_v.pow(2).sum()
        logdet = 2.0 * self.L_P.diagonal().log().sum()
        return 0.5 * (trace + m2 - D + logdet)

    def q_u(self, prior_mean_Z: Tensor) -> Tuple[Tensor, Tensor]:
        """Mean ``[K, M]`` and joint covariance ``[K M, K M]`` of ``u`` (classes coupled)."""
        mean = prior_mean_Z + (self.L_Z @ self.m_v.unsqueeze(-1)).squeeze(-1)
        D = self.K * self.M
        cov = torch.einsum("kab,kblc,lcd->kald", self.L_Z, self.S_v(), self.L_Z.mT)
        return mean, cov.reshape(D, D)
