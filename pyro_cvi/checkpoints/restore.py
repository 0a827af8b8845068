"""Putting a checked checkpoint into the live run (see :mod:`pyro_cvi.checkpoints.checkpoint`).

The param store is restored into the tensors it holds where names, shapes, dtypes and
constraints agree (whoever holds such a tensor, a guide's ``nn.Parameter`` attribute or a
network under ``pyro.module``, sees the restored value); the optimizer's per-parameter state
is attached afresh at the next step; an ``AutoCVI`` gets its counters, its blocks' traced
points and its step control; a guide that has not run yet sets itself up without drawing from
the restored generators. Loaded without ``guide=``, the guide's part is done at the first
call of the guide whose parameters the checkpoint holds (:class:`FinishAtFirstCall`).
"""

from __future__ import annotations

import os
import random
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pyro
import torch
from pyro.infer.autoguide import AutoGuide
from pyro.optim import PyroOptim

from ..autoguide import AutoCVI
from ..guide_state import listen_to_setups, rng_preserved
from ..optim import CVI
from .checkpoint_file import CheckpointError, encode_constraint

__all__ = [
    "FinishAtFirstCall",
    "apply_checkpoint",
    "check_model",
    "deferred_restore",
    "finish_pyro_guide",
    "key_of",
    "module_params",
    "signature",
]


def module_params(guide: torch.nn.Module) -> Dict[str, Tuple[torch.nn.Module, str]]:
    """``{param store name: (module, attribute)}`` of the guide's ``nn.Parameter`` attributes
    that are in the store (its ``PyroParam`` attributes Pyro reads back from the store)."""
    store = pyro.get_param_store()
    out: Dict[str, Tuple[torch.nn.Module, str]] = {}
    for module in guide.modules():
        for attr, p in module.named_parameters(recurse=False):
            if attr.endswith("_unconstrained"):
                continue  # a PyroParam: Pyro reads it back from the store itself
            name = store.param_name(p)
            if name is not None:
                out[name] = (module, attr)
    return out


def signature(engine: Any) -> Dict[str, List[Any]]:
    """``{site: [shape, observed]}`` of the model's sample sites as the guide saw them."""
    nodes = engine.analysis.structure.nodes  # (the prototype trace hides observations)
    return {
        n: [list(torch.as_tensor(nodes[n]["value"]).shape), bool(obs)]
        for n, obs in engine.structure.items()
        if n in nodes
    }


def engine_of(guide: AutoCVI) -> Any:
    if guide.engine is None:
        raise RuntimeError("the guide has not seen the model yet")
    return guide.engine


def key_of(block: Any) -> str:
    return "+".join(block.names)


def deferred_restore(path: Any, state: Dict[str, Any], optim: PyroOptim) -> Any:
    """The restore an ``AutoCVI`` runs at the end of its set-up (``AutoCVI.pending_restore``):
    the check against the model, then the whole checkpoint, generators included."""
    saved = state.get("guide", {})

    def restore(g: AutoCVI) -> None:
        try:
            check_model(path, saved, g)
        except CheckpointError as e:
            refused = CheckpointError(
                f"{e} The checkpoint was not applied and is dropped: the next step trains the "
                "guide from its own initialisation; call load_checkpoint again before a step "
                "with the saved run's model and data to resume it."
            )
            # the set-up's rollback puts the guide's attributes back: drop the restore after it
            refused.after_rollback = lambda: setattr(  # type: ignore[attr-defined]
                g, "pending_restore", None
            )
            raise refused from None
        apply_checkpoint(state, optim, g)

    return restore


def finish_pyro_guide(guide: torch.nn.Module) -> None:
    """A Pyro guide after the restore of the param store: one that ran holds its
    ``nn.Parameter`` attributes itself (pointed at the restored tensors where the store
    replaced them), one that has not sets itself up without moving the generators."""
    rebind(module_params(guide))
    keep_rng_through_late_setup(guide)


class FinishAtFirstCall:
    """The guide's part of a checkpoint loaded without ``guide=``, done at the first call of
    the guide whose parameters the checkpoint holds (a forward pre-hook on every module, the
    guide found by its name in the param store), while the restored parameters are still the
    store's: an ``AutoCVI`` gets what :func:`load_checkpoint` with ``guide=`` gives it, a Pyro
    autoguide that has not run sets itself up without moving the generators. The hook is
    removed at that call, when the param store no longer holds the restored tensors, or at the
    next :func:`load_checkpoint`."""

    live: Optional[FinishAtFirstCall] = None

    def __init__(self, path: Any, state: Dict[str, Any], optim: PyroOptim) -> None:
        self.path, self.state, self.optim = path, state, optim
        store = dict(pyro.get_param_store().named_parameters())
        self.restored = {n: store[n] for n in state["param_store"]["params"] if n in store}
        if not self.restored:
            return
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self)
        self.stop = listen_to_setups(self.at_setup)
        FinishAtFirstCall.live = self

    @classmethod
    def cancel(cls) -> None:
        if cls.live is not None:
            cls.live.handle.remove()
            cls.live.stop()
            cls.live = None

    def _ours(self, guide: torch.nn.Module) -> bool:
        """Whether ``guide`` is the checkpoint's (its names hold the restored tensors); the
        hook ends if the store no longer holds them."""
        store = dict(pyro.get_param_store().named_parameters())
        if any(store.get(n) is not t for n, t in self.restored.items()):
            # the store moved on: the checkpoint is no longer what it holds
            FinishAtFirstCall.cancel()
            return False
        name = guide.param_prefix if isinstance(guide, AutoCVI) else type(guide).__name__
        prefix = name + "."  # (Pyro's autoguides keep their parameters under their class name)
        return any(n.startswith(prefix) for n in self.restored)

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        """Before a module's forward: a Pyro autoguide of the checkpoint."""
        if isinstance(module, AutoGuide) and not isinstance(module, AutoCVI) and self._ours(module):
            FinishAtFirstCall.cancel()
            finish_pyro_guide(module)
        return None

    def at_setup(self, guide: Any) -> None:
        """At an ``AutoCVI``'s set-up: the restore runs at its end, as with ``guide=``."""
        if isinstance(guide, AutoCVI) and self._ours(guide):
            FinishAtFirstCall.cancel()
            guide.pending_restore = deferred_restore(self.path, self.state, self.optim)


def rebind(bound: Dict[str, Tuple[torch.nn.Module, str]]) -> None:
    """A guide that ran holds its ``nn.Parameter`` attributes itself (Pyro reads only
    ``PyroParam`` attributes back from the store): point them at the restored tensors."""
    store = pyro.get_param_store()
    for name, (module, attr) in bound.items():
        if name not in store:
            continue
        value = store[name].unconstrained()  # type: ignore[attr-defined]
        if not isinstance(value, torch.nn.Parameter):
            # (an nn.Parameter attribute has the real constraint: the store keeps it as is)
            store[name] = torch.nn.Parameter(value.detach())
            value = store[name].unconstrained()  # type: ignore[attr-defined]
        if isinstance(value, torch.nn.Parameter):
            module._parameters[attr] = value


def keep_rng_through_late_setup(guide: torch.nn.Module) -> None:
    """An autoguide that has not run yet draws random numbers at its set-up (its first call),
    which the uninterrupted run drew before the checkpoint: at its set-up, the whole first
    call runs once, hidden and with the generators put back, before the real one goes on."""
    if getattr(guide, "prototype_trace", True) is not None:
        return

    def once(*args: Any, **kwargs: Any) -> None:
        del guide._setup_prototype  # the class's own again
        with rng_preserved(), pyro.poutine.block():
            guide(*args, **kwargs)

    setattr(guide, "_setup_prototype", once)  # noqa: B010 (an instance's own, for one call)


def check_model(path: Any, saved: Dict[str, Any], guide: AutoCVI) -> None:
    """Raise :class:`CheckpointError` if the checkpoint was written for other sites, shapes
    or data."""
    problems = []
    if "sites" in saved:
        then, now = saved["sites"], signature(engine_of(guide))
        only_then = sorted(set(then) - set(now))
        only_now = sorted(set(now) - set(then))
        if only_then:
            problems.append(f"sites only in the checkpoint: {only_then}")
        if only_now:
            problems.append(f"sites only in this model: {only_now}")
        for n in sorted(set(then) & set(now)):
            if list(then[n][0]) != list(now[n][0]):
                problems.append(
                    f"site {n!r} has shape {tuple(then[n][0])} in the checkpoint and "
                    f"{tuple(now[n][0])} here"
                )
            elif bool(then[n][1]) != bool(now[n][1]):
                which = ("latent", "observed")
                problems.append(
                    f"site {n!r} is {which[bool(then[n][1])]} in the checkpoint and "
                    f"{which[bool(now[n][1])]} here"
                )
    if "params" in saved and not problems:
        store = pyro.get_param_store()
        engine = engine_of(guide)
        names = engine.param_names() + [engine.steps_name]
        shapes = {n: list(store[n].shape) for n in names if n in store}
        if set(shapes) != set(saved["params"]):
            diff = sorted(set(shapes) ^ set(saved["params"]))
            problems.append(f"the guide's parameters differ: {diff}")
        else:
            problems += [
                f"parameter {n!r} has shape {tuple(saved['params'][n])} in the checkpoint and "
                f"{tuple(shapes[n])} here"
                for n in sorted(shapes)
                if list(saved["params"][n]) != shapes[n]
            ]
    if problems:
        raise CheckpointError(
            f"checkpoint {os.fspath(path)!r} was written for another model or other data: "
            + "; ".join(problems[:5])
            + ". Build the model, the guide and the data as in the saved run."
        )


def apply_checkpoint(state: Dict[str, Any], optim: PyroOptim, guide: Optional[AutoCVI]) -> None:
    """Replace the live state with a checked checkpoint."""
    restore_store(state["param_store"])
    # the optimizers of the restored parameters start afresh from the saved state (the same
    # tensors may be live: a stale per-parameter optimizer must not go on)
    optim.optim_objs.clear()
    optim.grad_clip.clear()
    optim._state_waiting_to_be_consumed.clear()
    optim.set_state(state["optim"])
    if guide is not None:
        apply_guide_state(state.get("guide", {}), optim, guide)
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def restore_store(saved: Dict[str, Any]) -> None:
    """The param store becomes the saved one: a parameter the store holds with the same name,
    shape, dtype and constraint is overwritten in place (whoever holds that tensor sees the
    restored value), any other is put in; names the checkpoint lacks are removed."""
    store = pyro.get_param_store()
    live = dict(store.named_parameters())
    constraints = store.get_state()["constraints"]
    for name in [n for n in live if n not in saved["params"]]:
        del store[name]
    put: Dict[str, Dict[str, Any]] = {"params": {}, "constraints": {}}
    for name, value in saved["params"].items():
        old, c = live.get(name), saved["constraints"][name]
        same = (
            old is not None
            and old.shape == value.shape
            and old.dtype == value.dtype
            and encode_constraint(constraints[name]) == encode_constraint(c)
        )
        if same and old is not None:
            with torch.no_grad():
                old.copy_(value)
            continue
        if old is not None:
            del store[name]
        value.requires_grad_(value.is_floating_point() or value.is_complex())
        put["params"][name], put["constraints"][name] = value, c
    store.set_state(put)  # type: ignore[arg-type]


def apply_guide_state(saved: Dict[str, Any], optim: PyroOptim, guide: AutoCVI) -> None:
    """An ``AutoCVI``'s own state: its counters, its blocks' traced points, the step control."""
    guide.num_shrunk = saved.get("num_shrunk", 0)
    guide.num_rejected = saved.get("num_rejected", 0)
    engine = guide.engine
    if engine is not None:
        extra = dict(saved.get("blocks", {}))
        for key, z in saved.get("z_at", {}).items():  # (written by an earlier version)
            extra.setdefault(key, {"z_at": z})
        for block in engine.blocks:
            if key_of(block) in extra:
                block.load_extra_state(extra[key_of(block)])
        engine.invalidate()
        if isinstance(optim, CVI):
            optim.resume_control(engine)
