"""Checkpoint and resume CVI training, safely and exactly.

Everything a CVI step reads is saved in one file: the Pyro param store (the guide's site and
natural parameters, the step counter, the model's hyperparameters), the ``CVI`` optimizer's
state (its step counter ``t``, the adaptive step control with its last accepted point, the
inner torch optimizer's state per parameter), the guide's counters and the fixed points its
Gaussian blocks are traced at, and the random number generators (torch, numpy, Python, CUDA).
Restoring it in a fresh process continues on exactly the trajectory of an uninterrupted run,
bit for bit, whether or not the guide was called before loading::

    save_checkpoint("run.pt", optim, guide)
    ...                                    # new process: build model, guide, optim, svi as before
    load_checkpoint("run.pt", optim, guide)
    svi.step(X, y)                         # identical to the uninterrupted run's next step

Safety. The file holds only tensors and plain Python values (RNG states are tensors,
constraints are stored by name) and is read with ``torch.load(weights_only=True)``: a crafted
file cannot run code. Loading checks the whole file first (format, version, every entry's type,
and, with a guide, that it was written for the same model: the same sample sites with the same
shapes, the same guide parameters, the same kind of optimizer); only then is anything live
replaced. A file that fails a check raises :class:`CheckpointError` (a ``ValueError``) naming
the file and what is wrong, and leaves the run untouched. If the guide has not seen the model
yet, the check against the model and the restore happen at its set-up (the first
``svi.step``); a refused restore is rolled back and dropped, so the next step trains the guide
from its own initialisation. Writing is atomic: a temporary file in the same folder, renamed
over ``path`` (``os.replace``).

In a data-parallel run (``AutoCVI(..., process_group=...)``) every rank writes and reads its
own file, ``run.rank{r}-of-{R}.pt`` (its shard's sites; ``q`` and the hyperparameters are the
same on all ranks): call both functions on every rank with the same ``path`` and ``guide``.
"""

from __future__ import annotations

import os
import random
import tempfile
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import pyro
import torch
from pyro.optim import PyroOptim

from ..autoguide import AutoCVI
from ..guide_state import rng_preserved
from ..optim import CVI
from .checkpoint_file import (
    FORMAT,
    VERSION,
    CheckpointError,
    check_plain,
    encode_constraint,
    read_checkpoint,
    rng_state,
)
from .distributed import rank_path

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "FORMAT",
    "VERSION",
]


# ------------------------------------------------------------------------------------ saving
def save_checkpoint(
    path: Union[str, os.PathLike[str]],
    optim: PyroOptim,
    guide: Optional[torch.nn.Module] = None,
) -> None:
    """Write the param store, the optimizer, the guide's state and the RNG states to ``path``
    (atomically: a reader never sees a half-written file). ``guide`` is an ``AutoCVI`` or any
    Pyro guide (``AutoNormal``, ...): its kind and parameter shapes are kept, so that a load
    into another guide is refused."""
    if not isinstance(optim, PyroOptim):
        raise TypeError(
            f"save_checkpoint: optim is a {type(optim).__name__}; pass the Pyro optimizer "
            "given to SVI (CVI(...) or a pyro.optim optimizer)"
        )
    live = pyro.get_param_store().get_state()
    state: Dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "optim_kind": _optim_kind(optim),
        "param_store": {
            "params": {n: p.detach() for n, p in live["params"].items()},
            "constraints": {n: encode_constraint(c) for n, c in live["constraints"].items()},
        },
        "optim": optim.get_state(),
        "rng": rng_state(),
    }
    if isinstance(guide, AutoCVI):
        state["guide"] = _guide_state(guide)
    elif guide is not None:
        state["guide"] = _pyro_guide_state(guide)
    check_plain(state, "checkpoint")
    path = rank_path(path, getattr(guide, "reducer", None))
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=folder)
    except OSError as e:
        raise ValueError(
            f"cannot write checkpoint {os.fspath(path)!r}: its folder {folder!r} does not exist "
            f"or is not writable ({e.strerror}). Create the folder, or save to another path."
        ) from e
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _guide_state(guide: AutoCVI) -> Dict[str, Any]:
    out: Dict[str, Any] = {
        "name": guide.param_prefix,
        "num_shrunk": guide.num_shrunk,
        "num_rejected": guide.num_rejected,
    }
    engine = guide.engine
    if guide.prototype_trace is not None and engine is not None:
        out["sites"] = _signature(guide)
        store = pyro.get_param_store()
        names = engine.param_names() + [engine.steps_name]
        out["params"] = {n: list(store[n].shape) for n in names if n in store}
        out["blocks"] = {_key(b): b.extra_state() for b in engine.blocks if b.extra_state()}
    return out


def _optim_kind(optim: Any) -> str:
    """``"CVI"`` or the class name of the torch optimizer a ``pyro.optim`` optimizer wraps."""
    if isinstance(optim, CVI):
        return "CVI"
    inner = getattr(optim, "pt_optim_constructor", None)
    return getattr(inner, "__name__", type(optim).__name__)


def _module_params(guide: torch.nn.Module) -> Dict[str, Tuple[torch.nn.Module, str]]:
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


def _guide_param_names(guide: torch.nn.Module) -> List[str]:
    """The param store names of all of a Pyro guide's parameters (once it has run)."""
    store = pyro.get_param_store()
    names = (store.param_name(p) for p in guide.parameters())
    return sorted(n for n in names if n is not None)


def _pyro_guide_state(guide: torch.nn.Module) -> Dict[str, Any]:
    """A Pyro guide's kind and, once it has run, its parameters' shapes."""
    store = pyro.get_param_store()
    names = _guide_param_names(guide)
    return {
        "class": type(guide).__name__,
        "params": {n: list(store[n].shape) for n in names if n in store},
    }


def _signature(guide: AutoCVI) -> Dict[str, List[Any]]:
    """``{site: [shape, observed]}`` of the model's sample sites as the guide saw them."""
    engine = _engine(guide)
    nodes = engine.analysis.structure.nodes  # (the prototype trace hides observations)
    return {
        n: [list(torch.as_tensor(nodes[n]["value"]).shape), bool(obs)]
        for n, obs in engine.structure.items()
        if n in nodes
    }


def _engine(guide: AutoCVI) -> Any:
    if guide.engine is None:
        raise RuntimeError("the guide has not seen the model yet")
    return guide.engine


def _key(block: Any) -> str:
    return "+".join(block.names)


# ------------------------------------------------------------------------------------ loading
def load_checkpoint(
    path: Union[str, os.PathLike[str]],
    optim: PyroOptim,
    guide: Optional[torch.nn.Module] = None,
) -> None:
    """Restore a checkpoint written by :func:`save_checkpoint` (before the next ``svi.step``).

    The file is checked completely before anything live is replaced: its form, that ``optim``
    is the kind of optimizer that wrote it, and, with a guide, that the guide is of the kind
    that was saved and (once it has seen the model) that it was written for the same model:
    sites, shapes, guide parameters. An ``AutoCVI`` that has not seen the model yet restores
    the checkpoint at its set-up, after the same check; a refused one is dropped. Pass Pyro's
    own guides (``AutoNormal``, ...) too, whether or not they ran: one that has not sets itself
    up at its first call without drawing from the restored generators, one that has gets the
    restored parameters, so the resumed run draws what the uninterrupted one draws.
    Raises :class:`CheckpointError` naming the file and the problem.
    """
    path = rank_path(path, getattr(guide, "reducer", None))
    state = read_checkpoint(path)
    _check_optim(path, state, optim)
    saved = state.get("guide", {})
    if not isinstance(guide, AutoCVI):
        if guide is not None:
            _check_pyro_guide(path, saved, guide)
        bound = _module_params(guide) if guide is not None else {}
        _apply(state, optim, None)
        if guide is not None:
            _rebind(bound)
            _keep_rng_through_late_setup(guide)
        return
    if "class" in saved or saved.get("name", guide.param_prefix) != guide.param_prefix:
        held = saved.get("name") or saved.get("class")
        raise CheckpointError(
            f"checkpoint {os.fspath(path)!r} holds guide {held!r} but got AutoCVI "
            f"{guide.param_prefix!r}; build the guide the same way as in the saved run"
        )
    if guide.prototype_trace is not None and guide.engine is not None:
        _check_model(path, saved, guide)
        _apply(state, optim, guide)
        return

    def restore(g: AutoCVI) -> None:  # at the guide's set-up (see AutoCVI.pending_restore)
        try:
            _check_model(path, saved, g)
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
        _apply(state, optim, g)

    guide.pending_restore = restore


def _check_optim(path: Any, state: Dict[str, Any], optim: Any) -> None:
    """Raise :class:`CheckpointError` if ``optim`` is not the kind that wrote the checkpoint."""
    if not isinstance(optim, PyroOptim):
        raise CheckpointError(
            f"load_checkpoint({os.fspath(path)!r}, optim, ...): optim is a "
            f"{type(optim).__name__}; pass the Pyro optimizer given to SVI (CVI(...) or a "
            "pyro.optim optimizer)"
        )
    saved = state.get("optim_kind", "CVI" if "__cvi__" in state["optim"] else None)
    now = _optim_kind(optim)
    if saved is None or saved == now:
        return
    if saved == "CVI":
        fix = "build the optimizer as CVI(...), as in the saved run"
    elif now == "CVI":
        fix = f"build the optimizer as pyro.optim.{saved}(...), as in the saved run"
    else:
        fix = f"use a {saved} optimizer, as in the saved run"
    raise CheckpointError(
        f"checkpoint {os.fspath(path)!r} was written with a {saved} optimizer, but got "
        f"{now}: its state cannot continue that run; {fix}"
    )


def _check_pyro_guide(path: Any, saved: Dict[str, Any], guide: torch.nn.Module) -> None:
    """Raise :class:`CheckpointError` if a Pyro guide is not the kind that was saved, or (once
    it has run) its parameters' names or shapes differ from the saved ones."""
    name = type(guide).__name__
    if "name" in saved:
        raise CheckpointError(
            f"checkpoint {os.fspath(path)!r} holds an AutoCVI guide {saved['name']!r} but got "
            f"{name}; build the guide as in the saved run"
        )
    if "class" not in saved:
        return
    if saved["class"] != name:
        raise CheckpointError(
            f"checkpoint {os.fspath(path)!r} holds a {saved['class']} guide but got {name}; "
            "build the guide as in the saved run"
        )
    store = pyro.get_param_store()
    now = {n: list(store[n].shape) for n in _guide_param_names(guide) if n in store}
    then = saved.get("params", {})
    if not now or not then:
        return  # not run yet: its set-up creates the parameters the restore has put in place
    problems = [f"the guide's parameters differ: {sorted(set(now) ^ set(then))}"]
    if set(now) == set(then):
        problems = [
            f"parameter {n!r} has shape {tuple(then[n])} in the checkpoint and {tuple(now[n])} here"
            for n in sorted(now)
            if list(then[n]) != now[n]
        ]
    if problems:
        raise CheckpointError(
            f"checkpoint {os.fspath(path)!r} was written for another model or other data: "
            + "; ".join(problems[:5])
            + ". Build the model, the guide and the data as in the saved run."
        )


def _rebind(bound: Dict[str, Tuple[torch.nn.Module, str]]) -> None:
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


def _keep_rng_through_late_setup(guide: torch.nn.Module) -> None:
    """An autoguide that has not run yet draws random numbers at its set-up (its first call),
    which the uninterrupted run drew before the checkpoint: its first call runs once more,
    hidden and with the generators put back, before the real one."""
    if getattr(guide, "prototype_trace", True) is not None:
        return

    def once(module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        handle.remove()
        with rng_preserved(), pyro.poutine.block():
            module(*args, **kwargs)

    handle = guide.register_forward_pre_hook(once, with_kwargs=True)


def _check_model(path: Any, saved: Dict[str, Any], guide: AutoCVI) -> None:
    """Raise :class:`CheckpointError` if the checkpoint was written for other sites, shapes
    or data."""
    problems = []
    if "sites" in saved:
        then, now = saved["sites"], _signature(guide)
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
        engine = _engine(guide)
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


def _apply(state: Dict[str, Any], optim: PyroOptim, guide: Optional[AutoCVI]) -> None:
    """Replace the live state with a checked checkpoint."""
    store = pyro.get_param_store()
    store.clear()
    store.set_state(state["param_store"])
    for p in state["param_store"]["params"].values():
        p.requires_grad_(p.is_floating_point() or p.is_complex())
    optim.set_state(state["optim"])
    if guide is not None:
        saved = state.get("guide", {})
        guide.num_shrunk = saved.get("num_shrunk", 0)
        guide.num_rejected = saved.get("num_rejected", 0)
        engine = guide.engine
        if engine is not None:
            extra = dict(saved.get("blocks", {}))
            for key, z in saved.get("z_at", {}).items():  # (written by an earlier version)
                extra.setdefault(key, {"z_at": z})
            for block in engine.blocks:
                if _key(block) in extra:
                    block.load_extra_state(extra[_key(block)])
            engine.invalidate()
            if isinstance(optim, CVI):
                optim.resume_control(engine)
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
