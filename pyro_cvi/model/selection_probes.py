"""A selection Jacobian (one non-zero per row) read from a few products, never formed densely.

``out = c * z[idx]`` (an observation reading its group's coordinate, a plate's broadcast) has
``d out / d z = A`` with ``A[r, idx_r] = c_r`` and zeros elsewhere. With ``A v`` computed by
autograd (reverse of reverse: ``A v = d/du (u^T A v)``, one pass each), two products read the
structure: ``A 1 = c`` and ``A (1, 2, ..., D) = c * (idx + 1)``, so ``idx = A(1..D) / c - 1``.
It is then confirmed, not assumed: ``A v = c * v[idx]`` and ``A^T w = sum_r c_r w_r e_{idx_r}``
at random ``v``, ``w`` (a row with a second non-zero, or one that sums to zero, fails them)
within the probes' tolerance. Cost: ``O(R + D)`` per pass instead of the ``R x D`` matrix.
A product ``X @ z`` is read off autograd's record instead (a one-hot design ``X`` selects).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..gaussian.selection import SelectionJacobian
from .kron_probes import transposed
from .probes import close, matvec_matrix, rtol

__all__ = ["SELECTION_MIN_ENTRIES", "selection_jacobian"]

#: dense Jacobians of fewer entries are kept dense (they are cheap, and the dense products'
#: gradients are the ones recorded so far, bit for bit); larger ones are read as a selection
#: where they are one
SELECTION_MIN_ENTRIES = 1 << 18

#: the most columns a float32 position probe ``1..D`` reads back to the integer index exactly
_FLOAT32_MAX_COLUMNS = 1 << 22


def selection_jacobian(
    out: torch.Tensor,
    z: torch.Tensor,
    min_entries: Optional[int] = None,
    seed: int = 13,
) -> Optional[SelectionJacobian]:
    """``d out / d z`` as a :class:`~pyro_cvi.gaussian.selection.SelectionJacobian` where it
    has at most one non-zero per row (confirmed at random products), else ``None`` (the caller
    forms the dense Jacobian). ``None`` too below ``min_entries`` dense entries, or where ``out``
    has no autograd record to ``z``. ``min_entries`` defaults to :data:`SELECTION_MIN_ENTRIES`."""
    R, D = out.numel(), z.numel()
    if min_entries is None:
        min_entries = SELECTION_MIN_ENTRIES
    if R * D < min_entries or R == 0 or D == 0 or not out.requires_grad:
        return None
    if out.dtype != torch.float64 and D >= _FLOAT32_MAX_COLUMNS:
        return None
    X = matvec_matrix(out, z)
    if X is not None:  # ``X @ z``: the matrix is on the record (a one-hot design selects)
        return _from_matrix(X)
    flat = out.reshape(-1)
    u, atu = transposed(out, z)
    if atu is None or not atu.requires_grad:
        return None
    atu = atu.reshape(-1)

    def times(v: torch.Tensor) -> torch.Tensor:
        """``A v`` (one pass through the backward graph)."""
        (g,) = torch.autograd.grad((atu * v).sum(), u, retain_graph=True, allow_unused=True)
        return torch.zeros_like(u) if g is None else g.detach()

    dt, dev = out.dtype, out.device
    coef = times(torch.ones(D, dtype=dt, device=dev))
    pos = times(torch.arange(1, D + 1, dtype=dt, device=dev))
    live = coef != 0
    ratio = torch.where(live, pos / torch.where(live, coef, torch.ones_like(coef)), 1.0)
    index = (ratio.round() - 1).clamp(0, D - 1).long()
    A = SelectionJacobian(index, coef, D)
    g = torch.Generator(device="cpu").manual_seed(seed)
    tol = rtol(out.dtype)
    v = torch.randn(D, generator=g, dtype=torch.float64).to(dtype=dt, device=dev)
    if not close(times(v), A.matvec(v), tol):
        return None
    w = torch.randn(R, generator=g, dtype=torch.float64).to(dtype=dt, device=dev)
    (atw,) = torch.autograd.grad((flat * w).sum(), z, retain_graph=True, allow_unused=True)
    if atw is None or not close(atw.reshape(-1), A.rmatvec(w), tol):
        return None
    return A


def _from_matrix(X: torch.Tensor) -> Optional[SelectionJacobian]:
    """The selection equal to ``X`` entry for entry, where ``X`` has one non-zero a row."""
    live = X != 0
    if bool((live.sum(1) > 1).any()):
        return None
    index = live.to(torch.uint8).argmax(1)
    return SelectionJacobian(index, X.detach().gather(1, index[:, None]).squeeze(1), X.shape[1])
