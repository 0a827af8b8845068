"""Checkpoint and resume CVI training, safely and exactly.

Everything a CVI step reads is saved in one file: the Pyro param store (the guide's site and
natural parameters, the step counter, the model's hyperparameters), the ``CVI`` optimizer's
state (its step counter ``t``, the adaptive step control with its last accepted point, the
inner torch optimizer's state per parameter), the guide's counters and the fixed points its
Gaussian blocks are traced at, and the random number generators (torch, numpy, Python, CUDA).
Restoring it in a fresh process continues on exactly the trajectory of an uninterrupted run,
bit for bit, whether or not the guide was called before loading, and whether or not the guide
is passed::

    save_checkpoint("run.pt", optim, guide)
    ...                                    # new process: build model, guide, optim, svi as before
    load_checkpoint("run.pt", optim, guide)
    svi.step(X, y)                         # identical to the uninterrupted run's next step

Parameters are restored into the tensors the param store already holds where their names,
shapes and dtypes agree (so a module that holds its parameters itself, a guide's ``loc`` or a
network under ``pyro.module``, sees the restored values), and the optimizer's per-parameter
state is attached afresh at the next step. Loaded without ``guide=``, the restore of the
guide's own state finishes at the first call of the guide whose parameters the checkpoint
holds (found by its name in the param store): a guide that has not run yet sets itself up
without drawing from the restored generators, an ``AutoCVI`` gets its counters, traced points
and step control as with ``guide=``. Saved without ``guide=``, an ``AutoCVI``'s state is found
through its parameters.

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
import tempfile
from typing import Any, Dict, List, Optional, Union

import pyro
import torch
from pyro.optim import PyroOptim

from ..autoguide import AutoCVI
from ..engine import Engine
from ..guide_state import claimed
from ..optim import CVI
from ..scale.distributed import rank_path
from ..update import owner_of
from .checkpoint_file import (
    FORMAT,
    VERSION,
    CheckpointError,
    check_plain,
    encode_constraint,
    read_checkpoint,
    rng_state,
)
from .restore import (
    FinishAtFirstCall,
    apply_checkpoint,
    check_model,
    deferred_restore,
    finish_pyro_guide,
    key_of,
    signature,
)

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
    into another guide is refused. Without it (or with a guide written as a function), an
    ``AutoCVI`` whose parameters the store holds is found through them."""
    if not isinstance(guide, torch.nn.Module):
        guide = None
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
        state["guide"] = _guide_state(guide.param_prefix, guide.counts, guide.engine)
    elif guide is not None:
        state["guide"] = _pyro_guide_state(guide)
    else:
        engine = _sole_engine()
        if engine is not None:  # an AutoCVI's state, found through its parameters
            state["guide"] = _guide_state(engine.prefix, engine.counts, engine)
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


def _sole_engine() -> Optional[Engine]:
    """The engine of the one ``AutoCVI`` whose parameters are in the param store (``None`` if
    there is none); several: a :class:`ValueError` asking for ``guide=``."""
    store = pyro.get_param_store()
    owners = {id(o): o for o in map(owner_of, dict(store.named_parameters()).values())}
    engines = [o for o in owners.values() if isinstance(o, Engine)]
    if len(engines) > 1:
        names = sorted(e.prefix for e in engines)
        raise ValueError(
            f"save_checkpoint(path, optim): the param store holds {len(engines)} AutoCVI guides "
            f"{names}; pass the one to save as guide= (one checkpoint file per guide)"
        )
    return engines[0] if engines else None


def _guide_state(name: str, counts: Any, engine: Optional[Engine]) -> Dict[str, Any]:
    out: Dict[str, Any] = {
        "name": name,
        "num_shrunk": int(counts.shrunk),
        "num_rejected": int(counts.rejected),
    }
    if engine is not None:
        out["sites"] = signature(engine)
        store = pyro.get_param_store()
        names = engine.param_names() + [engine.steps_name]
        out["params"] = {n: list(store[n].shape) for n in names if n in store}
        out["blocks"] = {key_of(b): b.extra_state() for b in engine.blocks if b.extra_state()}
    return out


def _optim_kind(optim: Any) -> str:
    """``"CVI"`` or the class name of the torch optimizer a ``pyro.optim`` optimizer wraps."""
    if isinstance(optim, CVI):
        return "CVI"
    inner = getattr(optim, "pt_optim_constructor", None)
    return getattr(inner, "__name__", type(optim).__name__)


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
    restored parameters, so the resumed run draws what the uninterrupted one draws. Without
    ``guide=``, the param store, the optimizer and the generators are restored now and the
    guide's part at the first call of the guide whose parameters the checkpoint holds (the
    same result, bit for bit; the check against the model then happens at that call).
    Raises :class:`CheckpointError` naming the file and the problem.
    """
    if not isinstance(guide, torch.nn.Module):
        guide = None  # a guide written as a function keeps all its state in the param store
    path = rank_path(path, getattr(guide, "reducer", None))
    state = read_checkpoint(path)
    _check_optim(path, state, optim)
    saved = state.get("guide", {})
    FinishAtFirstCall.cancel()  # a later load replaces an earlier one's unfinished part
    if guide is None:
        live = claimed(saved["name"]) if "name" in saved else []
        if len(live) == 1:  # the AutoCVI it was saved from, set up: as with guide=
            guide = live[0]
        else:
            apply_checkpoint(state, optim, None)
            FinishAtFirstCall(path, state, optim)
            return
    if not isinstance(guide, AutoCVI):
        _check_pyro_guide(path, saved, guide)
        apply_checkpoint(state, optim, None)
        finish_pyro_guide(guide)
        return
    if "class" in saved or saved.get("name", guide.param_prefix) != guide.param_prefix:
        held = saved.get("name") or saved.get("class")
        raise CheckpointError(
            f"checkpoint {os.fspath(path)!r} holds guide {held!r} but got AutoCVI "
            f"{guide.param_prefix!r}; build the guide the same way as in the saved run"
        )
    if guide.prototype_trace is not None and guide.engine is not None:
        check_model(path, saved, guide)
        apply_checkpoint(state, optim, guide)
        return
    guide.pending_restore = deferred_restore(path, state, optim)


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
