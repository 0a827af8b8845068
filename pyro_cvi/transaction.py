"""Transactional CVI steps: a step that fails or is interrupted leaves the guide as it was.

One ``svi.step`` is two calls: the loss (:class:`~pyro_cvi.CVI_ELBO`: on the first step the
guide's set-up, the analysis of new data, the step's trace and messages, the natural gradients)
and the optimizer's update (:class:`~pyro_cvi.CVI`: eq. 12 on every block). Both only *rebind*
attributes of the guide, its engine, its blocks and its step control, and change the CVI
parameters *in place*. So a snapshot taken when the loss starts is cheap and complete: a shallow
copy of those objects' attributes, clones of the guide's parameters, and the param store's
names. If anything raises before the update has finished (a validation error, a numerical
failure, ``KeyboardInterrupt``), the snapshot is put back: the parameters added by a failed
first step leave the param store, the guide forgets a half-built set-up, autograd's global mode
is restored, and the next good step works as if the failed one never happened.

The snapshot lives from the loss until the optimizer's update (:func:`commit`), keyed weakly
by the engine (a loss evaluated without a step, e.g. ``svi.evaluate_loss``, keeps none).
"""

from __future__ import annotations

import weakref
from typing import Dict, Iterable, List, Optional, Union

import pyro
import torch

__all__ = ["Transaction", "pending", "commit", "rolled_back"]

#: the snapshot each engine's pending step would roll back to: ``engine -> Transaction``
_OPEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Memento:
    """The instance attributes of one object (a shallow copy: rebinding is undone; the
    attribute values themselves are never mutated in place by a step)."""

    __slots__ = ("obj", "saved")

    def __init__(self, obj):
        self.obj, self.saved = obj, vars(obj).copy()  # (dict.copy: a quarter of dict()'s time)

    def restore(self) -> None:
        d = vars(self.obj)
        for k in [k for k in d if k not in self.saved]:
            del d[k]
        d.update(self.saved)


class Transaction:
    """A snapshot of ``guide`` (an :class:`~pyro_cvi.AutoCVI`) and its parameters."""

    def __init__(self, guide):
        self.guide = guide
        #: autograd's mode: an interrupt that lands between a ``with torch.no_grad()`` body and
        #: its ``__exit__`` (CPython does not guard that point) would leave it switched off
        self.grad_mode = torch.is_grad_enabled()
        store = pyro.get_param_store()
        self.names = set(store.keys())
        objs: List = [guide, guide.counts]
        #: each parameter's values: a detached clone, or a CPU scalar's number (the step
        #: counter: exact in its dtype, and cheaper to keep than a tensor)
        self.params: Dict[str, Union[torch.Tensor, float, int, bool]] = {}
        engine = guide.engine
        if engine is not None:
            objs += [engine, engine.counts] + list(engine.blocks)
            objs += [o for b in engine.blocks for o in b.state_objects()]
            if engine.control is not None:
                objs.append(engine.control)
            for n in engine.param_names() + [engine.steps_name]:
                if n in store:  # (a detached clone records no graph, also with grad mode on)
                    u = _unconstrained(n)
                    self.params[n] = u.item() if u.dim() == 0 and u.is_cpu else u.detach().clone()
        self.mementos = list({id(o): _Memento(o) for o in objs}.values())
        #: other parameters whose gradients the loss wrote (dropped on a rollback)
        self.grads_of: List[torch.Tensor] = []

    def kept(self, value):
        """``value``, the snapshot kept open for the update first (when asked: the body's last
        act, so that an interrupt in the exit finds it open; the caller's abort undoes it)."""
        if getattr(self, "keep_open", False) and self.guide.engine is not None:
            keep(self.guide.engine, self)
        return value

    def rollback(self) -> None:
        """Put the guide, its engine and its parameters back as they were at the snapshot."""
        torch.set_grad_enabled(self.grad_mode)
        store = pyro.get_param_store()
        for n in [n for n in store.keys() if n not in self.names]:
            del store[n]  # added by the failed step (a first step's set-up)
        with torch.no_grad():
            for n, v in self.params.items():
                if n in store:
                    u = _unconstrained(n)
                    if not isinstance(v, torch.Tensor):
                        if u.dim() == 0:
                            u.fill_(v)
                    elif u.shape == v.shape:
                        u.copy_(v)
                    u.grad = None
        for m in self.mementos:
            m.restore()
        for p in self.grads_of:
            p.grad = None


def _unconstrained(name: str) -> torch.Tensor:
    """The store's unconstrained tensor (no effect handler, no transform: a snapshot)."""
    store = pyro.get_param_store()
    params = getattr(store.keys(), "mapping", None)  # (the store's own dict, read-only)
    return params[name] if params is not None else store[name].unconstrained()


def pending(engine) -> Optional[Transaction]:
    """The snapshot the engine's pending step would roll back to (``None``: none)."""
    return _OPEN.get(engine)


def keep(engine, txn: Transaction) -> None:
    """Keep ``txn`` until the optimizer's update of ``engine`` (:func:`commit`)."""
    _OPEN[engine] = txn


def commit(engines: Iterable) -> None:
    """The update finished: the snapshots are dropped."""
    for e in engines:
        _OPEN.pop(e, None)


class rolled_back:
    """``with rolled_back(guide, keep_open=False) as txn:`` runs a loss evaluation as a
    transaction: on any exception (``KeyboardInterrupt`` included) the guide is rolled back
    and the exception re-raised. With ``keep_open`` the snapshot stays open for the
    optimizer's update (:func:`commit` or :func:`abort`). (A class, not a generator: it is
    entered once per step.)"""

    __slots__ = ("guide", "keep_open", "txn")

    def __init__(self, guide, keep_open: bool = False):
        self.guide, self.keep_open = guide, keep_open

    def __enter__(self) -> Transaction:
        self.txn = Transaction(self.guide)
        self.txn.keep_open = self.keep_open
        return self.txn

    def __exit__(self, kind, e, tb) -> bool:
        if kind is None:
            try:
                if self.keep_open and self.guide.engine is not None:
                    keep(self.guide.engine, self.txn)
                return False
            except BaseException as error:  # (an interrupt here, too)
                self._undo(error)
                raise
        self._undo(e)
        return False  # (re-raised)

    def _undo(self, e: BaseException) -> None:
        self.txn.rollback()
        after = getattr(e, "after_rollback", None)  # e.g. back to the best q (divergence.py)
        if callable(after):
            after()


def abort(engines: Iterable) -> None:
    """The update failed: roll every engine's guide back to its snapshot."""
    for e in list(engines):
        txn = _OPEN.pop(e, None)
        if txn is not None:
            txn.rollback()
