"""The checkpoint file: its format, how its entries are encoded as tensors and plain values,
and the reader that checks a file completely before anything in it is trusted.

A checkpoint is a ``torch.save`` zip archive of one dict (format 2, :data:`VERSION`) that
holds only tensors and plain Python values, so that ``torch.load(weights_only=True)`` reads it
and a crafted file cannot run code. :func:`read_checkpoint` checks, in order: the path exists
and is a file, it is not empty, it starts as a torch zip archive does and ends with the
archive's end record (a truncated copy does not), the safe loader reads it, and every entry has
the form :func:`~pyro_cvi.checkpoints.checkpoint.save_checkpoint` writes. Any failure raises
:class:`CheckpointError` naming the file and the problem.
"""

from __future__ import annotations

import os
import pickle
import random
from typing import Any, Dict, Optional, Union

import numpy as np
import pyro.distributions.constraints as pyro_constraints
import torch
import torch.distributions.constraints as torch_constraints

__all__ = [
    "CheckpointError",
    "FORMAT",
    "VERSION",
    "read_checkpoint",
    "rng_state",
    "encode_constraint",
    "check_plain",
]

#: the ``"format"`` entry of every checkpoint file
FORMAT = "pyro-cvi checkpoint"
#: version 1 (pyro-cvi <= 0.x) pickled numpy and Python objects and needed an unsafe load
VERSION = 2

_PLAIN = (str, int, float, bool, type(None))

#: the first bytes of a file written by ``torch.save`` (a zip archive) and of the record that
#: ends a complete zip archive (its central directory), which a truncated file lacks
_ZIP_HEADER = b"PK\x03\x04"
_ZIP_END = b"PK\x05\x06"
_ZIP_END_SEARCH = 65_557  # the end record (22 bytes) plus the longest zip comment


class CheckpointError(ValueError):
    """A checkpoint file that cannot be restored: missing, not a file, empty, truncated, not a
    pyro-cvi checkpoint, malformed, or written for another model, data or optimizer. The
    message names the file and the problem; nothing live was changed."""


def rng_state() -> Dict[str, Any]:
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


def encode_constraint(c: Any) -> Dict[str, Any]:
    """A constraint as plain values: a module-level one by name, others by class and fields."""
    for module in (pyro_constraints, torch_constraints):
        for name, obj in vars(module).items():
            if obj is c and not name.startswith("__"):
                return {"name": name}
    fields: Dict[str, Any] = {}
    for k, v in vars(c).items():
        if isinstance(v, torch_constraints.Constraint):
            fields[k] = {"constraint": encode_constraint(v)}
        elif torch.is_tensor(v) or isinstance(v, _PLAIN):
            fields[k] = v
        else:
            raise TypeError(
                f"save_checkpoint: the constraint {c!r} has a field {k!r} of type "
                f"{type(v).__name__}, which a safe checkpoint cannot store"
            )
    return {"class": type(c).__name__, "fields": fields}


def check_plain(obj: Any, where: str) -> None:
    """Every entry must be a tensor or a plain value (what ``weights_only=True`` reads)."""
    if torch.is_tensor(obj) or isinstance(obj, _PLAIN + (torch.Size, torch.dtype)):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"save_checkpoint: {where} has a key {k!r} that is not plain")
            check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(
        f"save_checkpoint: {where} is a {type(obj).__name__}; a safe checkpoint holds only "
        "tensors and plain Python values (use a torch optimizer whose state_dict is plain)"
    )


def read_checkpoint(path: Union[str, os.PathLike[str]]) -> Dict[str, Any]:
    """Read and check a checkpoint file without touching anything live; returns its contents
    with the RNG states and constraints decoded. Checks, in order: the path exists and is a
    file, it is not empty, it starts as a torch file does and is complete (a zip archive with
    its end record), the safe loader reads it, and every entry has the type and form a
    checkpoint's has. Raises :class:`CheckpointError` naming the file and the problem."""
    path = os.fspath(path)
    _check_file(path)
    state: Any
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        first = _first_line(e, 200)
        raise CheckpointError(
            f"checkpoint {path!r} was refused by the safe loader: it holds Python objects "
            f"other than tensors and plain values ({first}). It is not a checkpoint written "
            f"by this pyro-cvi (format {VERSION}); a file from an unknown source may run code "
            "when unpickled, so it is never loaded unsafely."
        ) from None
    except Exception as e:  # noqa: BLE001 (zip, EOF, OS errors of a damaged file)
        raise CheckpointError(
            f"checkpoint {path!r} cannot be read: it is truncated or not a torch file "
            f"({type(e).__name__}: {_first_line(e, 160)}). Save it again, or use an earlier "
            "checkpoint."
        ) from None
    bad = _why_malformed(state)
    if bad is not None:
        raise CheckpointError(f"checkpoint {path!r} is not a pyro-cvi checkpoint: {bad}")
    try:
        state["rng"] = _decode_rng(state["rng"])
        cons = state["param_store"]["constraints"]
        state["param_store"]["constraints"] = {n: _decode_constraint(c) for n, c in cons.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(
            f"checkpoint {path!r} is malformed: {e}. It was not written by save_checkpoint "
            "or was changed since; save it again."
        ) from None
    checked: Dict[str, Any] = state
    return checked


def _first_line(e: BaseException, width: int) -> str:
    """The first line of an exception's message, cut at a word boundary."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    if len(text) <= width:
        return text
    return text[:width].rsplit(" ", 1)[0] + " ..."


def _complete_zip(tail: bytes, size: int) -> bool:
    """Whether ``tail`` (the file's last bytes) ends with a whole zip end record."""
    at = tail.rfind(_ZIP_END)
    if at < 0 or len(tail) - at < 22:
        return False
    comment = int.from_bytes(tail[at + 20 : at + 22], "little")
    return at + 22 + comment == len(tail)


def _check_file(path: str) -> None:
    """Raise :class:`CheckpointError` unless ``path`` is a complete torch (zip) file."""
    if not os.path.exists(path):
        raise CheckpointError(
            f"checkpoint {path!r} does not exist (or is not a file): check the path, or save "
            "a checkpoint there first"
        )
    if os.path.isdir(path):
        raise CheckpointError(
            f"checkpoint {path!r} does not exist (or is not a file): it is a directory; pass "
            "the path of the checkpoint file (e.g. a 'run.pt' inside it)"
        )
    if not os.path.isfile(path):
        raise CheckpointError(
            f"checkpoint {path!r} does not exist (or is not a file): it is not a regular "
            "file; pass the path of a file written by save_checkpoint"
        )
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(len(_ZIP_HEADER))
            f.seek(max(0, size - _ZIP_END_SEARCH))
            tail = f.read()
    except OSError as e:
        raise CheckpointError(
            f"checkpoint {path!r} cannot be read: {e.strerror}; check its permissions"
        ) from None
    if size == 0:
        raise CheckpointError(
            f"checkpoint {path!r} cannot be read: it is truncated or not a torch file (it is "
            "empty, 0 bytes: the save was interrupted or the file was created by something "
            "else). Save it again, or use an earlier checkpoint."
        )
    if head != _ZIP_HEADER:
        raise CheckpointError(
            f"checkpoint {path!r} cannot be read: it is truncated or not a torch file (it "
            f"starts with {head!r}, not the {_ZIP_HEADER!r} of a file written by torch.save, "
            "so it is no pyro-cvi checkpoint). Pass a file written by save_checkpoint."
        )
    if not _complete_zip(tail, size):
        raise CheckpointError(
            f"checkpoint {path!r} cannot be read: it is truncated or not a torch file (its "
            f"{size} bytes end before the archive's directory: the copy or the write was "
            "cut short). Save it again, or use an earlier checkpoint."
        )


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
    if "guide" in state:
        bad = _why_guide_malformed(state["guide"])
        if bad is not None:
            return bad
    optim_kind = state.get("optim_kind", "CVI" if "__cvi__" in state["optim"] else None)
    if optim_kind is not None and not isinstance(optim_kind, str):
        return "its entry 'optim_kind' is not a string"
    cvi = state["optim"].get("__cvi__")
    if cvi is not None:
        if not isinstance(cvi, dict) or not isinstance(cvi.get("t"), int):
            return "its CVI optimizer state is malformed (no step counter 't')"
        if not isinstance(cvi.get("control", {}), dict):
            return "its CVI optimizer state is malformed (the step control is not a dict)"
    for n, v in state["optim"].items():
        if n != "__cvi__" and not isinstance(v, dict):
            return f"the optimizer state of {n!r} is a {type(v).__name__}, not a dict"
    return None


def _why_guide_malformed(saved: Any) -> Optional[str]:
    if not isinstance(saved, dict):
        return "its entry 'guide' is not a dict"
    for key in ("name", "class"):
        if key in saved and not isinstance(saved[key], str):
            return f"its guide's {key} is not a string"
    sites = saved.get("sites", {})
    if not isinstance(sites, dict) or not all(
        isinstance(v, list)
        and len(v) == 2
        and isinstance(v[0], list)
        and all(isinstance(i, int) for i in v[0])
        for v in sites.values()
    ):
        return "its guide's site signature is malformed (expected {site: [shape, observed]})"
    params = saved.get("params", {})
    if not isinstance(params, dict) or not all(
        isinstance(v, list) and all(isinstance(i, int) for i in v) for v in params.values()
    ):
        return "its guide's parameter shapes are malformed (expected {name: shape})"
    for key in ("blocks", "z_at"):
        if not isinstance(saved.get(key, {}), dict):
            return f"its guide's entry {key!r} is not a dict"
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
