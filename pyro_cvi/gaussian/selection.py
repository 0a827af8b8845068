"""A matrix with at most one non-zero per row, kept as an index and coefficients.

The loc of an observation that reads one coordinate of a latent (``theta[group] * c``, a
plate's broadcast of ``theta``) has the Jacobian ``A[r, j] = c_r [j = idx_r]`` in ``theta``:
``(R, D)`` entries of which ``R`` can be non-zero. :class:`SelectionJacobian` stores ``idx``
and ``c`` (``O(R)``) and gives what the mean field asks of ``A`` without forming it:

* ``A v = c * v[idx]`` and ``A^T u = sum_r c_r u_r e_{idx_r}`` (a scatter-add);
* ``A^2 = (idx, c^2)`` (elementwise square), so the variance of a linear predictor under a
  diagonal Gaussian, ``diag(A V A^T) = A^2 diag V``, is ``c^2 * diag(V)[idx]``;
* :meth:`SelectionJacobian.to_dense` where a dense matrix is really needed.

A row with no non-zero has ``c_r = 0`` (its index is then any column). ``A v`` is bit for bit
the dense product: each row of the dense product adds one product to exact zeros.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import Tensor

__all__ = ["SelectionJacobian", "dense", "square_matvec"]


class SelectionJacobian:
    """``A[r, j] = coef[r]`` where ``j = index[r]``, else 0: an ``(R, columns)`` matrix.

    :param index: ``(R,)`` integer column of each row's non-zero;
    :param coef: ``(R,)`` its value (0 for a zero row);
    :param columns: ``D``, the number of columns.
    """

    __slots__ = ("index", "coef", "columns")

    def __init__(self, index: Tensor, coef: Tensor, columns: int):
        if index.shape != coef.shape or index.dim() != 1:
            raise ValueError(
                f"SelectionJacobian: index {tuple(index.shape)} and coef {tuple(coef.shape)} "
                "must be vectors of the same length (one entry per row)"
            )
        self.index = index.long()
        self.coef = coef
        self.columns = int(columns)

    # -- what a tensor would say about itself
    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.coef.shape[0], self.columns))

    @property
    def dtype(self) -> torch.dtype:
        return self.coef.dtype

    @property
    def device(self) -> torch.device:
        return self.coef.device

    @property
    def requires_grad(self) -> bool:
        return self.coef.requires_grad

    def __repr__(self) -> str:
        R, D = self.shape
        return f"SelectionJacobian({R} x {D}, {self.dtype})"

    def detach(self) -> SelectionJacobian:
        return SelectionJacobian(self.index, self.coef.detach(), self.columns)

    def to(self, *args: Any, **kwargs: Any) -> SelectionJacobian:
        """The coefficients cast like ``Tensor.to`` (the index follows their device)."""
        coef = self.coef.to(*args, **kwargs)
        return SelectionJacobian(self.index.to(coef.device), coef, self.columns)

    # -- products
    def square(self) -> SelectionJacobian:
        """The elementwise square ``A * A``: the same pattern, ``coef^2``."""
        return SelectionJacobian(self.index, self.coef.square(), self.columns)

    def matvec(self, v: Tensor) -> Tensor:
        """``A v`` for ``v`` of shape ``(D,)`` or ``(D, k)``: ``c * v[idx]``."""
        picked = v[self.index]
        c = self.coef if v.dim() == 1 else self.coef.reshape((-1,) + (1,) * (v.dim() - 1))
        return c * picked

    def rmatvec(self, u: Tensor) -> Tensor:
        """``A^T u`` for ``u`` of shape ``(R,)`` or ``(R, k)`` (a scatter-add of ``c u``)."""
        c = self.coef if u.dim() == 1 else self.coef.reshape((-1,) + (1,) * (u.dim() - 1))
        out = u.new_zeros((self.columns,) + tuple(u.shape[1:]))
        return out.index_add(0, self.index, c * u)

    def __matmul__(self, v: Tensor) -> Tensor:
        return self.matvec(v)

    def to_dense(self) -> Tensor:
        """The ``(R, D)`` matrix (zeros but one entry per row)."""
        R, D = self.shape
        out = self.coef.new_zeros(R, D)
        rows = torch.arange(R, device=self.coef.device)
        return out.index_put((rows, self.index), self.coef)


def dense(A: Union[Tensor, SelectionJacobian]) -> Tensor:
    """``A`` as a dense matrix (a tensor: itself)."""
    return A.to_dense() if isinstance(A, SelectionJacobian) else A


def square_matvec(A: Union[Tensor, SelectionJacobian], v: Tensor) -> Tensor:
    """``(A * A) v``: ``diag(A diag(v) A^T)``, without forming ``A * A`` for a selection."""
    if isinstance(A, SelectionJacobian):
        return A.square().matvec(v)
    return A.square() @ v
