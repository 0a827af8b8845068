"""Storage shared by the binary and multi-class CVI strategies: writing site parameters into
their buffers, and comparing the state keys that decide when a cached ``q`` is still valid."""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
from torch import Tensor

__all__ = ["write_sites", "keys_equal"]


def write_sites(
    buffers: tuple,
    lam1: Tensor,
    lam2: Tensor,
    indices: Optional[Tensor] = None,
    check: Optional[Callable[[Tensor], None]] = None,
) -> None:
    """Overwrite the site buffers ``(lam1, lam2)`` (all, or the rows ``indices``) after checking
    that the new values are finite and pass ``check(lam2)`` (the strategy's validity rule)."""
    if not (torch.isfinite(lam1).all() and torch.isfinite(lam2).all()):
        raise FloatingPointError("refusing to store non-finite CVI site parameters.")
    if check is not None:
        check(lam2)
    with torch.no_grad():
        for buf, new in zip(buffers, (lam1, lam2)):
            if indices is None:
                buf.copy_(new)
            else:
                buf[indices] = new.to(buf)


def keys_equal(a: List, b: List) -> bool:
    """Two state keys ``[site version, tensors...]`` are equal: same version, and tensors of the
    same shape, dtype and device with equal values."""
    if len(a) != len(b) or a[0] != b[0]:
        return False
    return all(
        x.shape == y.shape and x.dtype == y.dtype and x.device == y.device and torch.equal(x, y)
        for x, y in zip(a[1:], b[1:])
    )
