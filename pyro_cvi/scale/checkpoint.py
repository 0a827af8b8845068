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
shapes, the same guide parameters); only then is anything live replaced. A file that fails a
check raises ``ValueError`` naming the file and what is wrong, and leaves the run untouched.
If the guide has not seen the model yet, the check against the model and the restore happen at
its set-up (the first ``svi.step``), which is then rolled back if the check fails. Writing is
atomic: a temporary file in the same folder, renamed over ``path`` (``os.replace``).

In a data-parallel run (``AutoCVI(..., process_group=...)``) every rank writes and reads its
own file, ``run.rank{r}-of-{R}.pt`` (its shard's sites; ``q`` and the hyperparameters are the
same on all ranks): call both functions on every rank with the same ``path`` and ``guide``.
"""

from __future__ import annotations

import os
import pickle
import random
import tempfile
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import pyro
import pyro.distributions.constraints as pyro_constraints
import torch
import torch.distributions.constraints as torch_constraints

from ..autoguide import AutoCVI
from ..guide_state import rng_preserved
from ..optim import CVI
from .distributed import rank_path

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint", "FORMAT", "VERSION"]

#: the ``"format"`` entry of every checkpoint file
FORMAT = "pyro-cvi checkpoint"
#: version 1 (pyro-cvi <= 0.x) pickled numpy and Python objects and needed an unsafe load
VERSION = 2

_PLAIN = (str, int, float, bool, type(None))


# ------------------------------------------------------------------------------------ saving
def save_checkpoint(
    path: Union[str, os.PathLike[str]], optim: CVI, guide: Optional[AutoCVI] = None
) -> None:
    """Write the param store, the optimizer, the guide's state and the RNG states to ``path``
    (atomically: a reader never sees a half-written file)."""
    live = pyro.get_param_store().get_state()
    state = {
        "format": FORMAT,
        "version": VERSION,
        "param_store": {
            "params": {n: p.detach() for n, p in live["params"].items()},
            "constraints": {n: _encode_constraint(c) for n, c in live["constraints"].items()},
        },
        "optim": optim.get_state(),
        "rng": _rng_state(),
    }
    if guide is not None:
        state["guide"] = _guide_state(guide)
    _check_plain(state, "checkpoint")
    path = rank_path(path, guide.reducer if guide is not None else None)
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


def _rng_state() -> Dict[str, Any]:
    _, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    version, internal, py_gauss = random.getstate()
    out: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": {
            "version": int(version),
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss": py_gauss,
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def _encode_constraint(c: Any) -> Dict[str, Any]:
    """A constraint as plain values: a module-level one by name, others by class and fields."""
    for module in (pyro_constraints, torch_constraints):
        for name, obj in vars(module).items():
            if obj is c and not name.startswith("__"):
                return {"name": name}
    fields: Dict[str, Any] = {}
    for k, v in vars(c).items():
        if isinstance(v, torch_constraints.Constraint):
            fields[k] = {"constraint": _encode_constraint(v)}
        elif torch.is_tensor(v) or isinstance(v, _PLAIN):
            fields[k] = v
        else:
            raise TypeError(
                f"save_checkpoint: the constraint {c!r} has a field {k!r} of type "
                f"{type(v).__name__}, which a safe checkpoint cannot store"
            )
    return {"class": type(c).__name__, "fields": fields}


def _check_plain(obj: Any, where: str) -> None:
    """Every entry must be a tensor or a plain value (what ``weights_only=True`` reads)."""
    if torch.is_tensor(obj) or isinstance(obj, _PLAIN + (torch.Size, torch.dtype)):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"save_checkpoint: {where} has a key {k!r} that is not plain")
            _check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(
        f"save_checkpoint: {where} is a {type(obj).__name__}; a safe checkpoint holds only "
        "tensors and plain Python values (use a torch optimizer whose state_dict is plain)"
    )


# ------------------------------------------------------------------------------------ loading
def read_checkpoint(path: Union[str, os.PathLike[str]]) -> Dict[str, Any]:
    """Read and check a checkpoint file without touching anything live; returns its contents
    with the RNG states and constraints decoded. Raises ``ValueError`` naming the file and
    the problem (missing, truncated, not a checkpoint, an old or unknown version, malformed)."""
    path = os.fspath(path)
    state: Any
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path!r} does not exist (or is not a file)")
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[-1][:200] if str(e).strip() else ""
        raise ValueError(
            f"checkpoint {path!r} was refused by the safe loader: it holds Python objects "
            f"other than tensors and plain values ({first}). It is not a checkpoint written "
            f"by this pyro-cvi (format {VERSION}); a file from an unknown source may run code "
            "when unpickled, so it is never loaded unsafely."
        ) from None
    except Exception as e:  # noqa: BLE001 (zip, EOF, OS errors of a damaged file)
        raise ValueError(
            f"checkpoint {path!r} cannot be read: it is truncated or not a torch file "
            f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
        ) from None
    bad = _why_malformed(state)
    if bad is not None:
        raise ValueError(f"checkpoint {path!r} is not a pyro-cvi checkpoint: {bad}")
    try:
        state["rng"] = _decode_rng(state["rng"])
        cons = state["param_store"]["constraints"]
        state["param_store"]["constraints"] = {n: _decode_constraint(c) for n, c in cons.items()}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"checkpoint {path!r} is malformed: {e}") from None
    checked: Dict[str, Any] = state
    return checked


def _why_malformed(state: Any) -> Optional[str]:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        if isinstance(state, dict) and state.get("version") == 1 and "param_store" in state:
            return (
                "it is a format-1 checkpoint of an older pyro-cvi, which stored numpy and "
                "Python objects and needed an unsafe load; re-create it with this version"
            )
        return f"it holds a {type(state).__name__} without the entry format={FORMAT!r}"
    if state.get("version") != VERSION:
        return f"format version {state.get('version')!r}; this pyro-cvi reads version {VERSION}"
    for key, kind in (("param_store", dict), ("optim", dict), ("rng", dict)):
        if not isinstance(state.get(key), kind):
            return f"its entry {key!r} is missing or not a {kind.__name__}"
    ps = state["param_store"]
    params, cons = ps.get("params"), ps.get("constraints")
    if not isinstance(params, dict) or not isinstance(cons, dict) or params.keys() != cons.keys():
        return "its param store is malformed (params and constraints do not match)"
    for n, v in params.items():
        if not torch.is_tensor(v):
            return f"param {n!r} is a {type(v).__name__}, not a tensor"
    if "guide" in state and not isinstance(state["guide"], dict):
        return "its entry 'guide' is not a dict"
    return None


def _decode_rng(rng: Dict[str, Any]) -> Dict[str, Any]:
    t = rng["torch"]
    like = torch.get_rng_state()
    if not (torch.is_tensor(t) and t.dtype == like.dtype and t.shape == like.shape):
        raise ValueError("the torch RNG state is not a uint8 tensor of the right size")
    npy, py = rng["numpy"], rng["python"]
    keys = npy["keys"]
    if not (torch.is_tensor(keys) and keys.shape == (624,)):
        raise ValueError("the numpy RNG state is not 624 keys")
    state = py["state"]
    if not (torch.is_tensor(state) and state.shape == (625,)):
        raise ValueError("the Python RNG state is not 625 words")
    return {
        "torch": t,
        "numpy": (
            "MT19937",
            keys.numpy().astype(np.uint32),
            int(npy["pos"]),
            int(npy["has_gauss"]),
            float(npy["gauss"]),
        ),
        "python": (int(py["version"]), tuple(int(v) for v in state.tolist()), py["gauss"]),
        "cuda": rng.get("cuda"),
    }


def _constraint_class(name: str) -> Any:
    for module in (pyro_constraints, torch_constraints):
        obj = vars(module).get(name)
        if isinstance(obj, type) and issubclass(obj, torch_constraints.Constraint):
            return obj
    raise ValueError(f"unknown constraint class {name!r}")


def _decode_constraint(d: Any) -> Any:
    if not isinstance(d, dict):
        raise TypeError(f"a constraint entry is a {type(d).__name__}, not a dict")
    if "name" in d:
        for module in (pyro_constraints, torch_constraints):
            obj = vars(module).get(d["name"])
            if isinstance(obj, torch_constraints.Constraint):
                return obj
        raise ValueError(f"unknown constraint {d['name']!r}")
    cls = _constraint_class(d["class"])
    c = cls.__new__(cls)  # fields only: no code of the file runs
    for k, v in d["fields"].items():
        vars(c)[k] = _decode_constraint(v["constraint"]) if isinstance(v, dict) else v
    return c


def load_checkpoint(
    path: Union[str, os.PathLike[str]], optim: CVI, guide: Optional[torch.nn.Module] = None
) -> None:
    """Restore a checkpoint written by :func:`save_checkpoint` (before the next ``svi.step``).

    The file is checked completely before anything live is replaced; with a guide that has
    seen the model, also against the model (sites, shapes, guide parameters). A guide that
    has not seen it yet restores the checkpoint at its set-up, after the same check. Pass
    Pyro's own guides (``AutoNormal``, ...) too: one that has not run yet sets itself up at
    its first call without drawing from the restored generators, so the resumed run draws
    what the uninterrupted one draws.
    """
    path = rank_path(path, getattr(guide, "reducer", None))
    state = read_checkpoint(path)
    if not isinstance(guide, AutoCVI):
        _apply(state, optim, None)
        if guide is not None:
            _keep_rng_through_late_setup(guide)
        return
    saved = state.get("guide", {})
    if saved.get("name", guide.param_prefix) != guide.param_prefix:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} holds guide {saved['name']!r} but got "
            f"{guide.param_prefix!r}; build the guide the same way as in the saved run"
        )
    if guide.prototype_trace is not None and guide.engine is not None:
        _check_model(path, saved, guide)
        _apply(state, optim, guide)
        return

    def restore(g: AutoCVI) -> None:  # at the guide's set-up (see AutoCVI.pending_restore)
        try:
            _check_model(path, saved, g)
        except ValueError as e:
            raise ValueError(
                f"{e} The checkpoint stays pending until a step with the saved run's model "
                "and data; set guide.pending_restore = None to go on without it."
            ) from e
        _apply(state, optim, g)

    guide.pending_restore = restore


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
    """Raise ``ValueError`` if the checkpoint was written for other sites, shapes or data."""
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
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} was written for another model or other data: "
            + "; ".join(problems[:5])
            + ". Build the model, the guide and the data as in the saved run."
        )


def _apply(state: Dict[str, Any], optim: CVI, guide: Optional[AutoCVI]) -> None:
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
            optim.resume_control(engine)
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
