"""The CVI parameters as the engine last left them: a change made from outside is seen.

Every block solves its ``q`` from the CVI parameters ``lambda_tilde`` (eq. 12) and keeps it
while they stand (keyed on their version counters, or on the step's trace for a static
model). A parameter set in place from outside the engine (``store[k].data.copy_(v)``: ``.data``
has a version counter of its own; ``with torch.no_grad(): p.copy_(v)``;
``store.set_state(...)``, ``store[k] = v``: another tensor) would leave the old ``q``. So the
engine records each parameter whenever it has written them (the store's unconstrained tensor
itself, its version and a copy of its values) and compares them at the next loss: another
tensor or other values (``torch.equal``: also the ``.data`` case) mean the parameters were set
from outside, and every block's ``q`` is rebuilt from them. (A version alone proves nothing:
a transaction's rollback copies the same values back.)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Tuple, TypeVar

import pyro
import torch

__all__ = ["SeenParams", "recorded", "watched"]

F = TypeVar("F", bound=Callable[..., Any])
#: per parameter: its name, the store's tensor, its version and a copy of its values
Item = Tuple[str, torch.Tensor, int, torch.Tensor]


def _tensors(names: Sequence[str]) -> Tuple[Optional[torch.Tensor], ...]:
    """The store's unconstrained tensors of ``names`` (``None`` where one is missing)."""
    store = pyro.get_param_store()
    params = getattr(store.keys(), "mapping", None)  # (the store's own dict, read-only)
    if params is None:
        return tuple(_unconstrained(store, n) for n in names)
    return tuple(map(params.get, names))


def _unconstrained(store: Any, name: str) -> Optional[torch.Tensor]:
    return store.get_param(name).unconstrained() if name in store else None


class SeenParams:
    """One record of the parameters ``names`` (module docstring): per parameter in the store,
    ``(name, tensor, version, values)``. Never changed in place (a transaction's rollback
    rebinds the engine's record together with the parameters)."""

    __slots__ = ("names", "items")

    def __init__(
        self, names: Sequence[str], held: Optional[Sequence[Optional[torch.Tensor]]] = None
    ) -> None:
        self.names = tuple(names)
        self.items: Tuple[Item, ...]
        held = _tensors(self.names) if held is None else held
        if len(held) == 1 and held[0] is not None:  # (the common case, without a generator)
            t = held[0]
            self.items = ((self.names[0], t, t._version, t.detach().clone()),)
            return
        kept = [(n, t) for n, t in zip(self.names, held) if t is not None]
        self.items = tuple((n, t, t._version, t.detach().clone()) for n, t in kept)

    def again(self) -> SeenParams:
        """A new record of the same tensors (the engine wrote them in place)."""
        if len(self.items) != len(self.names):  # (one was missing: look again)
            return SeenParams(self.names)
        return SeenParams(self.names, [item[1] for item in self.items])

    def moved(self) -> bool:
        """Whether a recorded parameter was set from outside since the record: another tensor
        in the store or other values (the names are the engine's while the record stands: a
        new analysis drops it)."""
        store = pyro.get_param_store()
        params = getattr(store.keys(), "mapping", None)  # (the store's own dict, read-only)
        for name, held, _, value in self.items:
            t = params.get(name) if params is not None else _tensors((name,))[0]
            if t is not held or not torch.equal(t, value):  # (a rollback's copy: versions
                return True  # move, values stay)
        return False

    def stale(self) -> bool:
        """Whether the engine's own writes since the record changed a parameter (its version:
        the engine writes in place, under its counter)."""
        for item in self.items:
            if item[1]._version != item[2]:
                return True
        return False


def _record(engine: Any, out: Any, always: bool = False) -> Any:
    """``out``, the engine's parameters recorded first (``always``, or where its own writes may
    have changed them: :meth:`SeenParams.stale`). The names are the engine's while a record
    stands (a new analysis, which may change them, drops it)."""
    seen = getattr(engine, "seen", None)
    if seen is None:
        engine.seen = SeenParams(engine.param_names())
    elif always or seen.stale():
        engine.seen = seen.again()
    return out


def watched(loss: F) -> F:
    """``Engine.loss`` that first sees parameters set from outside since the engine's record
    (then every block's ``q`` is rebuilt from them, and the step control starts afresh:
    ``engine.invalidate()``) and records them after."""

    @functools.wraps(loss)
    def run(engine: Any, *args: Any, **kwargs: Any) -> Any:
        seen = getattr(engine, "seen", None)
        if seen is not None and seen.moved():
            engine.invalidate()
        return _record(engine, loss(engine, *args, **kwargs))

    return run  # type: ignore[return-value]


def recorded(method: F) -> F:
    """An engine method that writes the parameters (the step), recording them after."""

    @functools.wraps(method)
    def run(engine: Any, *args: Any, **kwargs: Any) -> Any:
        return _record(engine, method(engine, *args, **kwargs), always=True)

    return run  # type: ignore[return-value]
