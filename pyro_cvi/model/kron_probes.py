"""A Kronecker-structured Jacobian read from a few backward passes (softmax regression's
centred logits: ``d out / d z = X (x) G``), confirmed entry by entry on what is read and by
random two-sided products (:func:`pyro_cvi.model.probes.jacobian` uses it)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = [
    "kron_jacobian",
    "kron_product",
    "kron_factors_of",
    "matvec",
    "transposed",
    "KRON_FEATURE_TRIES",
]

#: the dense products made by :func:`kron_product` (weakly held, by identity): their version
#: and factors
_PRODUCTS = WeakTensorKeyDictionary()


def kron_product(X: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``X (x) G``, remembered with its factors (:func:`kron_factors_of`). One broadcast
    product (``torch.kron``'s entries, bit for bit, in about half its time)."""
    (N, D), (K, L) = X.shape, G.shape
    A = (X[:, None, :, None] * G[None, :, None, :]).reshape(N * K, D * L)
    _PRODUCTS[A] = (A._version, X, G)
    return A


def kron_factors_of(A: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(X, G)`` where ``A`` is, unedited, a product ``X (x) G`` made by :func:`kron_product`
    (exact: no confirmation needed), else ``None``."""
    hit = _PRODUCTS.get(A)
    return hit[1:] if hit is not None and hit[0] == A._version else None


def matvec(A: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``A v``; for a product of :func:`kron_product`, ``vec(X V G^T)`` (``O(N D' K)``)."""
    kron = kron_factors_of(A)
    if kron is None:
        return A @ v
    X, G = kron
    return (X @ (v.reshape(X.shape[1], G.shape[1]) @ G.mT)).reshape(-1)


#: features tried for a nonzero column block before :func:`kron_jacobian` gives up
KRON_FEATURE_TRIES = 3


def kron_jacobian(
    out: torch.Tensor, z: torch.Tensor, tol: float, seed: int = 11
) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(X [N, D'], G [K, K'])`` with ``d out / d z = X (x) G`` (``out [..., K]`` with ``N``
    rows of ``K``, ``z [D', K']``; Jacobian rows point-major, columns ``d K' + l``), or ``None``.

    A softmax regression's centred logits ``(X W) (I - 1 1^T / K)`` have this Jacobian. From
    ``D' + K'`` columns (one backward pass each of ``v -> A^T v``) instead of ``D' K'``: the
    columns ``(d0, l)`` give ``X[:, d0] G`` (``G`` at the pivot point ``n0``), the columns
    ``(d, l0)`` give ``X[:, d] G[:, l0]``. The structure is then confirmed, not assumed: every
    column read agrees with ``X (x) G`` in every entry, and so do ``A u`` and ``w^T A`` at random
    ``u``, ``w`` (one pass each; ``X U G^T`` and ``X^T W G`` for ``X (x) G``), within
    ``tol`` (relative) of the scale ``|X| |U| |G|^T`` (resp. ``|X|^T |W| |G|``)."""
    if z.dim() != 2 or out.dim() < 2 or not out.requires_grad:
        return None
    K, (Dx, Kz) = out.shape[-1], z.shape
    R = out.numel()
    N = R // max(K, 1)
    if K < 2 or Kz < 2 or N < 2 or Dx < 2:
        return None
    v, atv = transposed(out, z)
    if atv is None or not atv.requires_grad:
        return None

    def column(d: int, l: int) -> torch.Tensor:
        (g,) = torch.autograd.grad(atv[d, l], v, retain_graph=True, allow_unused=True)
        return (torch.zeros_like(v) if g is None else g).reshape(N, K)

    d0, first = None, None
    for d in range(min(Dx, KRON_FEATURE_TRIES)):  # the first feature with a nonzero column
        cols = torch.stack([column(d, l) for l in range(Kz)], -1)  # [N, K, K']
        if bool(cols.abs().amax() > 0):
            d0, first = d, cols
            break
    if first is None or not bool(torch.isfinite(first).all()):
        return None
    n0 = int(first.abs().flatten(1).amax(1).argmax())
    G = first[n0]  # X[n0, d0] = 1
    flat_g = int(G.abs().argmax())
    k0, l0 = flat_g // Kz, flat_g % Kz

    def agrees(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> bool:
        # (``scale`` is a fresh temporary; a NaN or an infinity in ``a`` or ``b`` makes the
        # difference NaN or infinite, above any finite bound, and the bound's sum is finite
        # only where ``scale`` is, which bounds ``|b|``)
        diff = (a - b).abs_()
        bound = scale.add_(1.0).mul_(tol)
        return bool((diff <= bound).all()) and bool(torch.isfinite(bound.sum()))

    x0, Ga = first[:, k0, l0] / G[k0, l0], G.abs()  # (a first check before D' more passes)
    if not agrees(first, x0[:, None, None] * G, x0.abs()[:, None, None] * Ga):
        return None
    cols = [first[..., l0] if d == d0 else column(d, l0) for d in range(Dx)]
    C = torch.stack(cols, 1)  # [N, D', K]: X[:, d] G[:, l0]
    X = C[:, :, k0] / G[k0, l0]
    Xa = X.abs()
    if not agrees(C, X[:, :, None] * G[:, l0], Xa[:, :, None] * Ga[:, l0]):
        return None
    g = torch.Generator(device="cpu").manual_seed(seed)
    for _ in range(2):  # A u against X U G^T
        U = torch.randn(Dx, Kz, generator=g, dtype=torch.float64, device=g.device).to(X)
        (Au,) = torch.autograd.grad((atv * U).sum(), v, retain_graph=True, allow_unused=True)
        if Au is None or not agrees(Au.reshape(N, K), X @ U @ G.mT, Xa @ U.abs() @ Ga.mT):
            return None
    Wt = torch.randn(N, K, generator=g, dtype=torch.float64, device=g.device).to(X)
    # (a scalar output, not grad_outputs: torch imports sympy for explicit grad_outputs)
    (wA,) = torch.autograd.grad(
        (out.reshape(-1) * Wt.reshape(-1)).sum(), z, retain_graph=True, allow_unused=True
    )
    if wA is None or not agrees(wA, X.mT @ Wt @ G, Xa.mT @ Wt.abs() @ Ga):
        return None
    return X.detach(), G.detach()


def transposed(out: torch.Tensor, z: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(v, A^T v)`` for ``A = d out / d z`` at a zero vector ``v`` that requires grad: ``A^T v``
    keeps its graph to ``v``, so a backward pass of ``(A^T v)_j`` in ``v`` reads column ``j``
    of ``A`` and one of ``(A^T v) . u`` reads ``A u`` (reverse of reverse). ``A^T v`` is
    ``None`` where ``out`` does not reach ``z``."""
    v = torch.zeros(out.numel(), dtype=out.dtype, device=out.device, requires_grad=True)
    with torch.enable_grad():
        # (a scalar output, not grad_outputs=v: torch imports sympy for explicit grad_outputs)
        (atv,) = torch.autograd.grad(
            (out.reshape(-1) * v).sum(), z, retain_graph=True, create_graph=True, allow_unused=True
        )
    return v, atv
