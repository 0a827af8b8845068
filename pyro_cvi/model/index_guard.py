"""Bounds-checked indexing for trial runs of a user's model on an accelerator.

The engine tries some model runs that may not fit the model (a particle plate the model was
not written for, a batched read of its scales): where the model indexes a latent by a data
index, the extra batch dimension can put the index out of range. On the CPU that raises an
``IndexError`` and the engine falls back to a run that fits; on a GPU the same indexing is a
device-side assert that leaves the process's device unusable. Inside :func:`checked_indexing`
every integer tensor index of ``Tensor.__getitem__``/``__setitem__``, ``index_select``,
``gather`` and ``take`` is checked against its dimension before the operation runs, and an
out-of-range one raises :class:`TrialIndexError` (an ``IndexError``), as on the CPU.
The checks read the indices' extrema (a device synchronisation each): trial runs only.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["TrialIndexError", "checked_indexing"]


class TrialIndexError(IndexError):
    """An index out of range in a trial run (raised before the device would assert)."""


def _check(index: torch.Tensor, size: int, where: str) -> None:
    if index.numel() == 0 or index.dtype in (torch.bool, torch.uint8):
        return
    lo, hi = int(index.min()), int(index.max())
    if lo < -size or hi >= size:
        raise TrialIndexError(
            f"{where}: index {hi if hi >= size else lo} is out of range for a size {size}"
        )


def _check_subscript(x: torch.Tensor, key) -> None:
    """The integer tensors of a ``x[key]`` subscript against the dimensions they index."""
    items = key if isinstance(key, tuple) else (key,)
    used = sum(
        (k.dim() if torch.is_tensor(k) and k.dtype in (torch.bool, torch.uint8) else 1)
        for k in items
        if k is not None and k is not Ellipsis
    )
    dim = 0
    for k in items:
        if k is None:
            continue
        if k is Ellipsis:
            dim += max(x.dim() - used, 0)
            continue
        if torch.is_tensor(k):
            if k.dtype in (torch.bool, torch.uint8):
                dim += k.dim()
                continue
            if not k.is_floating_point() and dim < x.dim():
                _check(k, x.shape[dim], "indexing")
        dim += 1


class _Checked(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and torch.is_tensor(
            args[0]
        ):
            _check_subscript(args[0], args[1])
        elif func in (torch.index_select, torch.Tensor.index_select):
            x, dim, index = (list(args) + [kwargs.get("dim"), kwargs.get("index")])[:3]
            if torch.is_tensor(x) and torch.is_tensor(index) and x.dim():
                _check(index, x.shape[dim], "index_select")
        elif func in (torch.gather, torch.Tensor.gather):
            x, dim, index = (list(args) + [kwargs.get("dim"), kwargs.get("index")])[:3]
            if torch.is_tensor(x) and torch.is_tensor(index) and x.dim():
                _check(index, x.shape[dim], "gather")
        elif func in (torch.take, torch.Tensor.take):
            x, index = (list(args) + [kwargs.get("index")])[:2]
            if torch.is_tensor(x) and torch.is_tensor(index):
                _check(index, x.numel(), "take")
        return func(*args, **kwargs)


@contextlib.contextmanager
def checked_indexing(
    device: torch.device, trial: bool = True, always: bool = False
) -> Iterator[None]:
    """Check indices inside the block where it is a ``trial`` and ``device`` is not the CPU
    (or ``always``, for tests)."""
    if not always and (not trial or device.type == "cpu"):
        yield
        return
    with _Checked():
        yield
