"""The CVI parameters as the engine last left them: a change made from outside is seen.

Every block solves its ``q`` from the CVI parameters ``lambda_tilde`` (eq. 12) and keeps it
while they stand (keyed on their version counters, or on the step's trace for a static
model). A parameter set in place from outside the engine (``store[k].data.copy_(v)``: ``.data``
has a version counter of its own; ``with torch.no_grad(): p.copy_(v)``;
``store.set_state(...)``, ``store[k] = v``: another tensor) would leave the old ``q``. So the
engine records each parameter whenever it has written them (the store's unconstrained tensor
itself, its version and a copy of its values) and compares them at the next loss: another
tensor, another version or other values (``torch.equal``, the ``.data`` case) mean the
parameters were set from outside, and every block's ``q`` is rebuilt from them.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence, Tuple

import pyro
import torch

__all__ = ["SeenParams", "recorded", "watched"]


def _tensors(names: Sequence[str]) -> Tuple[Optional[torch.Tensor], ...]:
    """The store's unconstrained tensors of ``names`` (``None`` where one is missing)."""
    store = pyro.get_param_store()
    params = getattr(store.keys(), "mapping", None)  # (the store's own dict, read-only)
    if params is None:
        return tuple(store[n].unconstrained() if n in store else None for n in names)
    return tuple(params.get(n) for n in names)


class SeenParams:
    """One record of the parameters ``names`` (module docstring); never changed in place (a
    transaction's rollback rebinds the engine's record with the parameters)."""

    __slots__ = ("names", "held", "versions", "values")

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.held = _tensors(self.names)
        self.versions = tuple(-1 if t is None else t._version for t in self.held)
        self.values = tuple(None if t is None else t.detach().clone() for t in self.held)

    def moved(self, names: Sequence[str]) -> bool:
        """Whether a parameter of ``names`` was set from outside since the record (other names
        than the record's, e.g. after a new analysis, are not compared: ``False``)."""
        if tuple(names) != self.names:
            return False
        now_held = zip(_tensors(self.names), self.held, self.versions, self.values)
        for now, held, version, value in now_held:
            if now is not held:
                return True
            if now is None:
                continue
            if now._version != version or not torch.equal(now.detach(), value):
                return True
        return False

    def stale(self, names: Sequence[str]) -> bool:
        """Whether the engine's own writes since the record may have changed ``names``: other
        names, another tensor or another version (no values read: cheap)."""
        if tuple(names) != self.names:
            return True
        now = _tensors(self.names)
        return any(a is not b or (a is not None and a._version != v)
                   for a, b, v in zip(now, self.held, self.versions))  # fmt: skip


def _record(engine, out):
    """``out``, the engine's parameters recorded first where its own writes may have changed
    them (:meth:`SeenParams.stale`)."""
    names, seen = engine.param_names(), getattr(engine, "seen", None)
    if seen is None or seen.stale(names):
        engine.seen = SeenParams(names)
    return out


def watched(loss: Callable) -> Callable:
    """``Engine.loss`` that first sees parameters set from outside since the engine's record
    (then every block's ``q`` is rebuilt from them, and the step control starts afresh:
    ``engine.invalidate()``) and records them after."""

    @functools.wraps(loss)
    def run(engine, *args, **kwargs):
        seen = getattr(engine, "seen", None)
        if seen is not None and seen.moved(engine.param_names()):
            engine.invalidate()
        return _record(engine, loss(engine, *args, **kwargs))

    return run


def recorded(method: Callable) -> Callable:
    """An engine method that writes the parameters (the step), recording them after."""

    @functools.wraps(method)
    def run(engine, *args, **kwargs):
        return _record(engine, method(engine, *args, **kwargs))

    return run
