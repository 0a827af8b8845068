"""Model changes are seen: a structural signature of the model's trace, checked whenever what
the model reads changes, and the tensors a model reads from its closure or module globals,
part of the data's identity.

The analysis of a model (its blocks, affine coefficients, messages) holds as long as the model
has the same sample sites, with the same distributions, shapes and plates, and reads the same
data. A model without learnable parameters is traced once per data (its trace at the blocks'
fixed point does not change); so that a model that changes is still seen, it is run again and
compared whenever :func:`model_state` (what its run reads) changes:

* :func:`signature`: per sample site, the base distribution's type, its batch and event shapes
  (batch dims of subsampled plates left out: a minibatch's size may vary) and its plates. A
  difference raises a ``ValueError`` naming the site and the change (the guide's parameters
  were built for the old structure: a new guide is needed). Sites added or removed, or a
  model that starts raising, are caught by the same model run.
* :func:`closure_key`: identities, versions and shapes of the tensors the model function reads
  from its closure cells and its module globals, also inside containers there (lists, tuples,
  dicts) and as attributes of captured objects or modules (``data.X``, ``self.X``) that the
  model's code names; at bounded cost (:data:`MAX_DEPTH` levels, :data:`MAX_ITEMS` values).
  Data read that way is then treated as data passed as arguments: replaced or changed in
  place, it is re-analysed at the next step (a tensor read inside another function the model
  calls is not re-analysed: pass data as arguments).
* :func:`model_state`: the key of the structure check, a superset of the data's: the
  arguments and the closure as above, plus plain values (numbers, strings, ``None``) by value,
  arrays by identity and shape, and what the model's own helper functions read.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Callable, Dict, Optional, Tuple

import torch
from pyro.poutine.trace_struct import Trace
from pyro.poutine.util import site_is_subsample

from .tracing import unwrap

__all__ = [
    "signature",
    "check_signature",
    "closure_key",
    "data_key",
    "model_state",
    "MAX_DEPTH",
    "MAX_ITEMS",
]

#: how deep :func:`closure_key` looks into captured containers and objects
MAX_DEPTH = 3
#: how many captured values :func:`closure_key` looks at in all (a model that captures a
#: larger collection should take its data as arguments)
MAX_ITEMS = 512

Sig = Dict[str, Tuple]


def _subsampled(frame) -> bool:
    return frame.full_size is not None and frame.full_size != frame.size


def signature(trace: Trace) -> Sig:
    """``{site: (distribution, batch shape, event shape, plates)}`` of the sample sites."""
    out: Sig = {}
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or site_is_subsample(site):
            continue
        frames = site["cond_indep_stack"]
        if any(not f.vectorized and _subsampled(f) for f in frames):
            continue  # a sequential minibatch's sites: named by their data index
        fn = site["fn"]
        base = unwrap(fn)[0]
        batch: Optional[tuple] = tuple(fn.batch_shape)
        if any(_subsampled(f) for f in frames):
            batch = None
        plates = tuple(sorted((f.name, f.dim, f.full_size or f.size) for f in frames))
        out[name] = (type(base).__name__, batch, tuple(fn.event_shape), plates)
    return out


def _describe(entry: Tuple) -> str:
    kind, batch, event, plates = entry
    where = ", ".join(f"{p[0]} ({p[2]})" for p in plates) or "no plate"
    shape = "?" if batch is None else str(batch)
    return f"{kind} with batch shape {shape}, event shape {event}, in {where}"


def check_signature(trace: Trace, expected: Sig) -> None:
    """``ValueError`` if a site of ``trace`` differs from ``expected`` (sites added or removed
    are reported by :func:`~pyro_cvi.model.validation.check_structure`)."""
    now = signature(trace)
    for name in expected.keys() & now.keys():
        old, new = expected[name], now[name]
        if old[1] is None or new[1] is None:
            old, new = (old[0], None) + old[2:], (new[0], None) + new[2:]
        if old != new:
            raise ValueError(
                f"site {name!r} changed since the guide was analysed: it was a "
                f"{_describe(expected[name])}, it is now a {_describe(now[name])}. AutoCVI's "
                "parameters and messages were built for the old model: build a new AutoCVI "
                "(and SVI) for the new one."
            )


def closure_key(model: Callable) -> Tuple:
    """``(name, id, version, shape)`` of every tensor ``model`` reads from its closure or its
    module's globals (a ``functools.partial``, a bound method or a callable object: its
    function), in a fixed order."""
    found: list = []
    budget = [MAX_ITEMS]
    items, attrs = _closure_items(model)
    for name, value in items:
        _collect(name, value, attrs, MAX_DEPTH, found, budget, set())
    return tuple(found)


def _closure_items(model: Callable) -> Tuple[list, tuple]:
    """``([(name, value)], attribute names)``: what ``model``'s code reads from its closure
    cells, its module's globals and (a bound method) its object."""
    where = _where(model)
    if where is None:
        return [], ()
    fn, code, owner = where
    items = _function_items(fn, code)
    if owner is not None:  # the object a method reads its data from (self.X)
        items.append(("self", owner))
    return items, _code_names(code)[2]


def _where(model: Callable) -> Optional[Tuple[Callable, types.CodeType, object]]:
    """``(function, its code, the object it is bound to)`` under wrappers, partials, bound
    methods and callable objects (``None``: no Python code)."""
    if type(model) is types.FunctionType and "__wrapped__" not in model.__dict__:
        return model, model.__code__, None  # (a plain function: the common case, first)
    fn = _bound(model)
    owner = fn.__self__ if inspect.ismethod(fn) else None  # a bound method's object
    if inspect.ismethod(fn):
        fn = fn.__func__
    code = getattr(fn, "__code__", None)
    if code is None and callable(fn):  # a callable object: its __call__
        owner, fn = fn, type(fn).__call__
        code = getattr(fn, "__code__", None)
    return None if code is None else (fn, code, owner)


def _function_items(fn, code: types.CodeType) -> list:
    freevars, names, _ = _code_names(code)
    items = []
    cells = getattr(fn, "__closure__", None) or ()
    for name, cell in zip(freevars, cells):
        try:
            items.append((name, cell.cell_contents))
        except ValueError:  # an empty cell
            continue
    env = getattr(fn, "__globals__", {})
    items += [(n, env[n]) for n in names if n in env]
    return items


#: ``{id(code): (code, its names)}`` (the code held: no other takes its identity; bounded)
_CODE_NAMES: Dict[int, Tuple[types.CodeType, Tuple[tuple, tuple, tuple]]] = {}


def _code_names(code: types.CodeType) -> Tuple[tuple, tuple, tuple]:
    """``(free variables, global names, sorted attribute names)`` a code object reads (a code
    object is immutable: computed once per code object)."""
    hit = _CODE_NAMES.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    out = (tuple(code.co_freevars), tuple(code.co_names), tuple(sorted(set(code.co_names))))
    if len(_CODE_NAMES) >= 4096:
        _CODE_NAMES.clear()
    _CODE_NAMES[id(code)] = (code, out)
    return out


def _bound(model: Callable) -> Callable:
    """The function (or bound method, or callable object) under wrappers and partials."""
    fn = inspect.unwrap(model) if callable(model) else model
    while hasattr(fn, "func") and callable(fn.func):  # functools.partial
        fn = fn.func
    return fn


def _collect(
    path: str,
    value,
    attrs: tuple,
    depth: int,
    found: list,
    budget: list,
    seen: set,
    state: Optional[_Scan] = None,
):
    """Append ``(path, id, version, shape)`` of every tensor in ``value``: the value itself,
    the items of a list, tuple or dict, and the attributes named in ``attrs`` of an object, a
    module or an ``nn.Module`` (its buffers; a parameter is learned, not data: skipped). Read
    without running code (no properties, no ``PyroModule`` side effects). A library's module
    (torch, pyro, the standard library) holds no data: skipped. With ``state``, also what
    else may change the model's structure: plain values (numbers, strings, ``None``) by value,
    an array's identity and shape, and the closures and globals of the model's own helper
    functions (:func:`model_state`)."""
    if budget[0] <= 0:
        return
    budget[0] -= 1
    if _INERT.get(id(value)) is value:
        return  # (a library's module or function, a class, a builtin: it names no data)
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and isinstance(value, torch.nn.Parameter):
            return  # (a plain tensor is tested first: the parameter test is slow)
        found.append((path, id(value), value._version, tuple(value.shape)))
        if state is not None:
            state.append(value.dtype)
            state.held.append(value)
        return
    if state is not None and isinstance(value, _PLAIN):
        state.append((path, type(value), value))  # (True == 1: the type too)
        return
    if depth == 0 or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value[:MAX_ITEMS]):
            _collect(f"{path}[{i}]", v, attrs, depth - 1, found, budget, seen, state)
    elif isinstance(value, dict):
        if state is not None:
            state.append((path, len(value)))
        for k in list(value)[:MAX_ITEMS]:
            _collect(f"{path}[{k!r}]", value[k], attrs, depth - 1, found, budget, seen, state)
    elif isinstance(value, types.ModuleType) and _library(value.__name__):
        _inert(value)
    elif isinstance(value, types.FunctionType):
        if _library(getattr(value, "__module__", None)):
            _inert(value)
        elif state is not None:
            # a helper of the model's own: what it reads may change the model too
            code = value.__code__
            for n, v in _function_items(value, code):
                _collect(
                    f"{path}.{n}", v, _code_names(code)[2], depth - 1, found, budget, seen, state
                )
    elif state is not None and hasattr(type(value), "__array__") and hasattr(value, "shape"):
        state.append((path, id(value), tuple(value.shape), str(getattr(value, "dtype", ""))))
    elif _holds_attributes(value):
        for a in attrs:
            v = _attribute(value, a)
            if v is not _MISSING:
                _collect(f"{path}.{a}", v, attrs, depth - 1, found, budget, seen, state)
    elif (inspect.isclass(value) or inspect.isroutine(value)) and not hasattr(
        type(value), "__array__"
    ):
        _inert(value)  # (its attributes are not read: nothing, in either scan)


#: ``{id: value}`` of values that name no data in either scan of :func:`_collect` whatever
#: they hold (a library's module or function, a class, a builtin), so that the next scan skips
#: them at once; held here, so that no other object takes one of their identities
_INERT: Dict[int, object] = {}


def _inert(value) -> None:
    if len(_INERT) >= 4096:  # (bounded: classes made on the fly are not kept for ever)
        _INERT.clear()
    _INERT[id(value)] = value


#: values recorded by value in :func:`model_state`
_PLAIN = (bool, int, float, complex, str, bytes, type(None))

_LIBRARIES = frozenset({"torch", "pyro", "pyro_cvi", "gpytorch", "numpy", "scipy", "funsor"})
_LIBRARY_OF: Dict[str, bool] = {}


def _library(module: Optional[str]) -> bool:
    """Whether a module (by name) is a library's: torch, Pyro and their kin, the standard
    library."""
    if module is None:
        return False
    out = _LIBRARY_OF.get(module)
    if out is None:
        root = module.partition(".")[0]
        out = _LIBRARY_OF[module] = root in _LIBRARIES or root in sys.stdlib_module_names
    return out


class _Scan(list):
    """:func:`model_state`'s plain entries, and the tensors it named (:attr:`held`)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list = []


class ModelState:
    """A :func:`model_state` key. It holds the tensors it names, so that while it lives no
    other tensor can take one of their identities."""

    __slots__ = ("key", "held")

    def __init__(self, key: Tuple, held: list):
        self.key, self.held = key, held

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelState) and self.key == other.key

    __hash__ = None  # type: ignore[assignment]


def model_state(model: Callable, args, kwargs) -> Optional[ModelState]:
    """What a model's run reads that may differ from one step to the next, as a key: the
    arguments (tensors by identity, version, shape and dtype; containers item by item; plain
    values by value), and the same of what the model's code and its own helper functions read
    from their closures and globals (:func:`closure_key`, with plain values). Equal keys: the
    model sees the same inputs, so its structure is the one already checked. ``None`` where
    the scan was cut short (:data:`MAX_ITEMS`): nothing can be concluded."""
    found: list = []
    state = _Scan()
    budget = [MAX_ITEMS]
    items, attrs = _closure_items(model)
    seen: set = set()
    for i, a in enumerate(args):
        _collect(f"args[{i}]", a, attrs, MAX_DEPTH, found, budget, seen, state)
    for k in sorted(kwargs):
        _collect(f"kwargs[{k!r}]", kwargs[k], attrs, MAX_DEPTH, found, budget, seen, state)
    for name, value in items:
        _collect(name, value, attrs, MAX_DEPTH, found, budget, seen, state)
    if budget[0] <= 0:
        return None
    return ModelState((tuple(found), tuple(state)), state.held)


_MISSING = object()


def _holds_attributes(value) -> bool:
    """An object whose attributes may hold data: a module, an ``nn.Module``, an instance with
    a ``__dict__`` (not a function, a class or a descriptor)."""
    if isinstance(value, (types.ModuleType, torch.nn.Module)):
        return True
    if inspect.isroutine(value) or inspect.isclass(value):
        return False
    return hasattr(value, "__dict__")


def _attribute(obj, name: str):
    """``obj.name`` without running code (``_MISSING`` if absent or computed). A plain module's
    attribute is its ``__dict__`` entry (what ``inspect.getattr_static`` finds for any name
    but a dunder, which ``ModuleType`` itself defines), read directly."""
    if type(obj) is types.ModuleType and not name.startswith("__"):
        v = obj.__dict__.get(name, _MISSING)
        return _MISSING if isinstance(v, (property, staticmethod, classmethod)) else v
    if isinstance(obj, torch.nn.Module):
        for get in (obj.get_buffer, obj.get_submodule):
            try:
                return get(name)
            except AttributeError:
                pass
    try:
        v = inspect.getattr_static(obj, name)
    except AttributeError:
        return _MISSING
    return _MISSING if isinstance(v, (property, staticmethod, classmethod)) else v


def data_key(args, kwargs):
    """Identifies the data: the arguments' identities, versions and shapes."""
    items = list(args) + [kwargs[k] for k in sorted(kwargs)]
    return tuple(
        (id(a), a._version, tuple(a.shape)) if torch.is_tensor(a) else id(a) for a in items
    )
