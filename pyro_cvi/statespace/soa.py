"""Small-matrix algebra over long stacks, in two storage forms, for the Kalman smoother.

A stack of ``n`` (times any batch) ``d x d`` matrices is either

* **packed**: one tensor ``(n, *batch, d, d)``, vectors as columns ``(n, *batch, d, 1)``,
  scalars ``(n, *batch)``: few, larger ops (short stacks, where per-op overhead dominates);
* **arrays** (structure of arrays): a matrix is a list of ``d`` rows of ``d`` tensors
  ``(n, *batch)``, a vector a list of ``d`` tensors: for ``d <= 4`` elementwise ops on
  contiguous arrays are several times faster on a CPU than batched GEMMs of tiny matrices.

The stack index ``n`` is always the leading dimension, so slicing and joining along time is
the same in both forms. Every helper takes either form (both operands in the same form).
"""

from __future__ import annotations

import torch

__all__ = [
    "to_arrays_mat",
    "to_arrays_vec",
    "pack",
    "dot",
    "mv",
    "tr",
    "mm",
    "add",
    "sub",
    "tree_map",
    "leaves",
    "unflatten",
    "inv",
    "inv_det",
    "is_packed",
    "col",
    "hcat",
    "vcat",
    "cols",
]


def is_packed(X) -> bool:
    return torch.is_tensor(X)


def col(v):
    """A vector as a ``d x 1`` matrix."""
    return v if torch.is_tensor(v) else [[x] for x in v]


def hcat(*Ms):
    """``[M_1 M_2 ...]`` side by side."""
    if torch.is_tensor(Ms[0]):
        return torch.cat(Ms, -1)
    return [[x for row in rows for x in row] for rows in zip(*Ms)]


def vcat(*Ms):
    """``[M_1; M_2; ...]`` stacked."""
    if torch.is_tensor(Ms[0]):
        return torch.cat(Ms, -2)
    return [row for M in Ms for row in M]


def cols(M, start: int, stop: int):
    """Columns ``start:stop``."""
    if torch.is_tensor(M):
        return M[..., start:stop]
    return [row[start:stop] for row in M]


def to_arrays_mat(M: torch.Tensor):
    """``(n, *batch, d, d)`` -> ``d`` rows of ``d`` contiguous ``(n, *batch)`` tensors."""
    Mt = M.movedim((-2, -1), (0, 1)).contiguous()
    return [[Mt[i, j] for j in range(M.shape[-1])] for i in range(M.shape[-2])]


def to_arrays_vec(v: torch.Tensor):
    """A column stack ``(n, *batch, d, 1)`` -> ``d`` contiguous ``(n, *batch)`` tensors."""
    vt = v.squeeze(-1).movedim(-1, 0).contiguous()
    return [vt[i] for i in range(vt.shape[0])]


def pack(X):
    """Arrays -> packed (matrices ``(n, *batch, d, d)``, vectors as columns)."""
    if isinstance(X, tuple):
        return tuple(pack(x) for x in X)
    if isinstance(X, list) and isinstance(X[0], list):
        return torch.stack([torch.stack(row, -1) for row in X], -2)
    if isinstance(X, list):
        return torch.stack(X, -1).unsqueeze(-1)
    return X


def dot(xs, ys):
    """``x' y`` per stack entry."""
    if torch.is_tensor(xs):
        return (xs * ys).sum((-2, -1))
    out = xs[0] * ys[0]
    for x, y in zip(xs[1:], ys[1:]):
        out = torch.addcmul(out, x, y)
    return out


def mv(M, v):
    if torch.is_tensor(M):
        return M @ v
    return [dot(row, v) for row in M]


def tr(M):
    """The transpose."""
    if torch.is_tensor(M):
        return M.transpose(-1, -2)
    return [list(col) for col in zip(*M)]


def mm(X, Y):
    if torch.is_tensor(X):
        return X @ Y
    Yt = tr(Y)
    return [[dot(row, col) for col in Yt] for row in X]


def add(X, Y):
    if isinstance(X, list):
        return [add(x, y) for x, y in zip(X, Y)]
    return X + Y


def sub(X, Y):
    if isinstance(X, list):
        return [sub(x, y) for x, y in zip(X, Y)]
    return X - Y


def tree_map(fn, X):
    """``fn`` on every tensor of a (nested) tuple/list."""
    if isinstance(X, (list, tuple)):
        return type(X)(tree_map(fn, x) for x in X)
    return fn(X)


def leaves(X):
    if isinstance(X, (list, tuple)):
        return [t for x in X for t in leaves(x)]
    return [X]


def unflatten(template, flat):
    """``template``'s structure filled with the tensors of the iterator ``flat``."""
    if isinstance(template, (list, tuple)):
        return type(template)(unflatten(x, flat) for x in template)
    return next(flat)


def inv_det(M):
    """``(M^-1, det M)`` of a stack of small matrices: closed forms for d = 1, 2, 3 in both
    storage forms."""
    d = M.shape[-1] if torch.is_tensor(M) else len(M)
    if torch.is_tensor(M):
        if d == 1:
            return M.reciprocal(), M[..., 0, 0]
        if d == 2:
            return _inv_det_2(M)
        if d == 3:
            return _inv_det_3(M)
        return torch.linalg.inv(M), torch.linalg.det(M)
    if d == 1:
        return [[M[0][0].reciprocal()]], M[0][0]
    if d == 2:
        (a, b), (c, e) = M
        det = a * e - b * c
        r = det.reciprocal()
        return [[e * r, -b * r], [-c * r, a * r]], det
    if d == 3:
        return _inv_det_3_arrays(M)
    full = torch.stack([torch.stack(row, -1) for row in M], -2)
    return to_arrays_mat(torch.linalg.inv(full)), torch.linalg.det(full)


def _inv_det_2(M: torch.Tensor):
    """Packed 2 x 2: ``adj M = tr(M) I - M`` (Cayley-Hamilton) over ``det M = a e - b c``."""
    f = M.flatten(-2)
    det = f[..., 0] * f[..., 3] - f[..., 1] * f[..., 2]
    adj = -M
    adj.diagonal(dim1=-2, dim2=-1).add_((f[..., 0] + f[..., 3]).unsqueeze(-1))
    return adj / det[..., None, None], det


def _inv_det_3(M: torch.Tensor):
    """Packed 3 x 3: the columns of ``adj M`` are the cross products of the rows
    ``(r1 x r2, r2 x r0, r0 x r1)``, and ``det M = r0 . (r1 x r2)``."""
    r0, r1, r2 = M.unbind(-2)
    c0 = torch.linalg.cross(r1, r2)
    adj = torch.stack([c0, torch.linalg.cross(r2, r0), torch.linalg.cross(r0, r1)], -1)
    det = (r0 * c0).sum(-1)
    return adj / det[..., None, None], det


def _inv_det_3_arrays(M):
    """Arrays 3 x 3: the cofactors (``adj M`` is the transposed cofactor matrix) and
    ``det M = a A + b B + c C`` along the first row, all elementwise."""
    (a, b, c), (d, e, f), (g, h, i) = M
    A, B, C = e * i - f * h, f * g - d * i, d * h - e * g
    det = a * A + b * B + c * C
    r = det.reciprocal()
    return [
        [A * r, (c * h - b * i) * r, (b * f - c * e) * r],
        [B * r, (a * i - c * g) * r, (c * d - a * f) * r],
        [C * r, (b * g - a * h) * r, (a * e - b * d) * r],
    ], det


def inv(M):
    """``M^-1`` of a stack of small matrices."""
    if torch.is_tensor(M) and M.shape[-1] > 3:
        return torch.linalg.inv(M)
    return inv_det(M)[0]
