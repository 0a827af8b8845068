"""The state of an :class:`~pyro_cvi.AutoCVI` guide as a ``PyroModule``.

The engine reads and writes its parameters through Pyro's param store (``pyro.param``, under
``"<guide name>.<kind>.<site>"``). The guide also holds the *same* tensor objects as
``nn.Parameter`` attributes at the matching module paths (``<kind>.<site>``), so that
``named_parameters()``, ``state_dict()``, ``requires_grad_``, ``pickle``, ``torch.save`` and
``copy.deepcopy`` see them, as for Pyro's own autoguides. The two views are kept identical
with Pyro's ``PyroModule`` rule (:func:`sync_parameters`): the store's tensor wins where the
store has the name (e.g. after ``load_checkpoint`` or ``ParamStoreDict.set_state``), the
module's is put into the store where it has not (a guide unpickled, copied or loaded into a
fresh process). One difference, kept from earlier releases: ``pyro.clear_param_store()``
under a *live* guide (one that has run since it was built or restored) restarts it, as a
fresh guide (Pyro's ``AutoNormal`` would put its old values back).

Everything else a guide holds that cannot be pickled (the engine: traces, closures, caches) is
dropped and rebuilt from the prototype trace's recorded inputs on first use, with the random
state preserved so that a restored guide draws exactly what the original draws.

**Names per guide** (:func:`claim_prefix`). A guide keeps its parameters in the param store
under ``"<prefix>.<kind>.<site>"``, the prefix being its ``PyroModule`` name (``"AutoCVI"`` by
default, as Pyro's autoguides use their class name). Two guides with one prefix would read and
write each other's parameters (two logistic regressions stepped in turn got each other's
sites). So each guide claims its prefix at its set-up; the claim fails with a ``ValueError``
naming the prefix and the fix (``AutoCVI(model, prefix="...")``) while another live guide is
bound to the very tensors the store holds under that prefix. A dropped guide, or one whose
parameters left the store (``pyro.clear_param_store()``, a checkpoint loaded over them),
holds no claim.
"""

from __future__ import annotations

import copy
import gc
import pickle
import random
import sys
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

import pyro
import torch
from pyro.infer.autoguide.utils import deep_setattr
from pyro.poutine.messenger import Messenger
from pyro.util import set_rng_state
from torch import nn

__all__ = [
    "leaf_stages",
    "check_prefix",
    "claim_prefix",
    "GuideState",
    "refuse_inside_svi_step",
    "option_property",
    "unbind_parameters",
    "bind_parameters",
    "sync_parameters",
    "bound_parameters",
    "detach_distribution",
    "rng_preserved",
    "picklable",
    "Unsampled",
    "StoredShapes",
]

_BOUND = "_cvi_bound"  # the module attribute listing the bound store names


def bound_parameters(module: nn.Module) -> Dict[str, nn.Parameter]:
    """``{store name: module parameter}`` of every bound parameter."""
    prefix = module.param_prefix
    out = {}
    for name in getattr(module, _BOUND, ()):
        owner_path, _, leaf = name[len(prefix) + 1 :].rpartition(".")
        try:
            owner = deep_getattr(module, owner_path) if owner_path else module
        except AttributeError:
            continue
        if leaf in owner._parameters:  # read directly: no pyro.param side effect
            out[name] = owner._parameters[leaf]
    return out


def bind_parameters(module: nn.Module, names: Iterable[str]) -> None:
    """Make the store's tensors ``names`` parameters of ``module`` (one object in both views)."""
    store = pyro.get_param_store()
    prefix = module.param_prefix
    bound = list(getattr(module, _BOUND, ()))
    for name in names:
        if not name.startswith(prefix + "."):
            raise ValueError(f"parameter {name!r} is not under the guide's prefix {prefix!r}")
        value = store.get_param(name).unconstrained()
        param = value if isinstance(value, nn.Parameter) else _as_parameter(name, value)
        _set(module, name[len(prefix) + 1 :], param)
        if name not in bound:
            bound.append(name)
    object.__setattr__(module, _BOUND, tuple(bound))


def unbind_parameters(module: nn.Module) -> None:
    """Forget the bound parameters (the guide starts afresh: a cleared param store under a
    live guide)."""
    prefix = module.param_prefix
    for name in getattr(module, _BOUND, ()):
        owner_path, _, leaf = name[len(prefix) + 1 :].rpartition(".")
        try:
            owner = deep_getattr(module, owner_path) if owner_path else module
        except AttributeError:
            continue
        owner._parameters.pop(leaf, None)
    object.__setattr__(module, _BOUND, ())


def sync_parameters(module: nn.Module) -> None:
    """Pyro's ``PyroModule`` rule for every bound parameter: the store wins where it has the
    name; the module's tensor is put into the store where it has not. (Where the store and the
    module hold the tensors of the last sync, there is nothing to do: :func:`_in_sync`.)"""
    store = pyro.get_param_store()
    params = getattr(store.keys(), "mapping", None)  # (the store's own dict, read-only)
    synced = module.__dict__.get(_SYNCED)
    if params is not None and synced is not None and synced[0] is module.__dict__.get(_BOUND):
        if _in_sync(params, module, synced[1]):
            return
    for name, param in bound_parameters(module).items():
        if name in store:
            value = store.get_param(name).unconstrained()
            if value is not param:
                if not isinstance(value, nn.Parameter):
                    value = _as_parameter(name, value)
                _set(module, name[len(module.param_prefix) + 1 :], value)
        else:
            with torch.no_grad():
                store[name] = param  # constraint real: the store keeps this very object
            if store.get_param(name).unconstrained() is not param:  # pragma: no cover
                raise RuntimeError(f"the param store copied {name!r} instead of keeping it")
    if params is not None:  # (the bound names, then per name the tensor and its path)
        entries = [_entry(module, name) for name in module.__dict__.get(_BOUND, ())]
        ok = None not in entries and _in_sync(params, module, entries)
        module.__dict__[_SYNCED] = (module.__dict__.get(_BOUND), entries) if ok else None


_SYNCED = "_cvi_synced"  # the module attribute: the last sync's tensors (:func:`_in_sync`)


def _entry(module: nn.Module, name: str) -> Optional[tuple]:
    """``(name, parameter, path, its submodules but module: no cycle)`` (``None``: none)."""
    path = name[len(module.param_prefix) + 1 :].split(".")
    try:
        chain = tuple(deep_getattr(module, ".".join(path[: i + 1])) for i in range(len(path) - 1))
    except AttributeError:
        return None
    param = (chain[-1] if chain else module)._parameters.get(path[-1])
    return None if param is None else (name, param, tuple(path), chain)


def _in_sync(params, module: nn.Module, entries) -> bool:
    """Whether the store's ``params`` and ``module`` still hold the tensors of ``entries``."""
    for name, param, path, chain in entries:
        owner = module
        for part, child in zip(path, chain):
            if owner._modules.get(part) is not child:
                return False
            owner = child
        if params.get(name) is not param or owner._parameters.get(path[-1]) is not param:
            return False
    return True


def deep_getattr(obj, path: str):
    """``obj.a.b.c`` for ``path = "a.b.c"`` (``AttributeError`` if a part is missing; used
    for the submodules only)."""
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _as_parameter(name: str, value: torch.Tensor) -> nn.Parameter:
    """Replace the store's plain tensor by an ``nn.Parameter`` sharing its storage."""
    store = pyro.get_param_store()
    param = nn.Parameter(value.detach(), requires_grad=value.requires_grad)
    del store[name]  # (CVI parameters are unconstrained: the store keeps this very object)
    with torch.no_grad():
        store[name] = param
    return param


def _set(module: nn.Module, path: str, param: nn.Parameter) -> None:
    owner_path, _, leaf = path.rpartition(".")
    try:
        owner = deep_getattr(module, owner_path) if owner_path else module
    except AttributeError:
        deep_setattr(module, path, param)
        return
    if leaf in owner._parameters:
        owner._parameters[leaf] = param
    else:
        owner.register_parameter(leaf, param)


def detach_distribution(d: torch.distributions.Distribution) -> torch.distributions.Distribution:
    """A shallow copy of ``d`` whose tensors (and nested distributions') are detached: a JIT
    trace records them as constants (a tensor that requires grad cannot be one)."""
    out = copy.copy(d)
    if isinstance(out, torch.distributions.Dirichlet):  # Beta too, through its _dirichlet
        out.__class__ = _traceable(type(out))
    for key, value in list(vars(out).items()):
        if torch.is_tensor(value) and value.requires_grad:
            setattr(out, key, value.detach())
        elif isinstance(value, torch.distributions.Distribution):
            setattr(out, key, detach_distribution(value))
        elif isinstance(value, (list, tuple)) and any(
            isinstance(v, torch.distributions.Distribution) for v in value
        ):
            setattr(
                out,
                key,
                type(value)(
                    detach_distribution(v) if isinstance(v, torch.distributions.Distribution) else v
                    for v in value
                ),
            )
    return out


_TRACEABLE: Dict[type, type] = {}
_NO_SHAPE = torch.Size()


def _traceable(cls: type) -> type:
    """A subclass of a Dirichlet class whose draws skip torch's Python autograd function
    (which a JIT trace cannot export): the same native sampler on the same concentrations, so
    the same draws. It survives ``expand`` (torch rebuilds the instance's own class)."""
    if getattr(cls, "_cvi_traceable", False):
        return cls
    if cls not in _TRACEABLE:

        def rsample(self, sample_shape=_NO_SHAPE) -> torch.Tensor:
            concentration = self.concentration.expand(self._extended_shape(sample_shape))
            return torch._sample_dirichlet(concentration)

        _TRACEABLE[cls] = type(
            "Traceable" + cls.__name__, (cls,), {"rsample": rsample, "_cvi_traceable": True}
        )
    return _TRACEABLE[cls]


class Unsampled(Messenger):
    """Leave the sites ``names`` undrawn in a model run that only reads their conditional
    priors (nothing depends on a leaf): each takes a placeholder value (its mean where finite,
    else zeros), so the run draws no random numbers and a JIT trace holds no sampler."""

    def __init__(self, names: Iterable[str]):
        super().__init__()
        self.names = set(names)

    def _pyro_sample(self, msg) -> None:
        if msg["name"] not in self.names or msg["value"] is not None or msg["is_observed"]:
            return
        fn = msg["fn"]
        try:
            value = fn.mean.detach()
            if not bool(torch.isfinite(value).all()):
                raise ValueError
        except (NotImplementedError, ValueError, AttributeError, RuntimeError):
            value = torch.zeros(fn.shape(), dtype=torch.get_default_dtype())
        msg["value"] = value.expand(fn.shape())


def leaf_stages(leaves: List[str], deps: Dict[str, Any]) -> List[List[str]]:
    """The leaves in the stages the guide draws them in, one model run each: a stage holds the
    leaves none of whose parents is a leaf still to draw (model order kept). One stage where no
    leaf depends on another (the usual case); a prior-only subtree (``x`` whose only dependent
    is the leaf ``y``) draws ``x`` first and reads ``p(y | x)`` at that draw."""
    left, stages = list(leaves), []
    while left:
        todo = set(left)
        stage = [n for n in left if not (set(deps.get(n, ())) & todo - {n})] or left
        stages.append(stage)
        left = [n for n in left if n not in stage]
    return stages


@contextmanager
def rng_preserved() -> Iterator[None]:
    """Run a block (e.g. rebuilding the engine, which traces the model) without moving the
    torch, numpy and Python random states. numpy's is kept only once ``numpy.random`` is
    imported (importing it costs 0.08 s; a fresh import's state is unseeded anyway)."""
    state = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if "numpy.random" in sys.modules:
        state["numpy"] = sys.modules["numpy.random"].get_state()
    try:
        yield
    finally:
        set_rng_state(state)


def picklable(obj) -> bool:
    """Whether ``obj`` pickles (functions pickle by reference: cheap; modules are kept)."""
    if isinstance(obj, nn.Module):
        return True
    try:
        pickle.dumps(obj)
    except Exception:  # noqa: BLE001 (any failure means: not picklable)
        return False
    return True


class GuideState:
    """Mixin for a guide (before ``AutoGuide`` in the bases) whose unpicklable working state
    lives in its ``engine`` attribute, rebuilt on first use: pickling, ``torch.save``,
    ``copy.deepcopy`` and ``load_state_dict`` keep the parameters, the options, the prototype
    trace and the model (where it pickles), and drop the engine."""

    @property
    def model(self) -> Optional[Callable]:
        """The model (``None`` in a guide unpickled without it: set it again)."""
        return self._model[0] if self._model is not None else None

    @model.setter
    def model(self, model: Callable) -> None:
        self._model = (model,)

    def __getstate__(self) -> Dict[str, Any]:
        """The picklable state; the live guide is left untouched (Pyro's ``AutoGuide`` drops
        the model of the live guide too)."""
        for p in self.parameters():
            p.__dict__.pop("unconstrained", None)  # a weakref the param store attaches
        state = self.__dict__.copy()
        state["engine"] = None
        state["master"] = None
        model = self.model
        state["_model"] = (model if model is not None and picklable(model) else None,)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)

    def __deepcopy__(self, memo):
        """A copy with its own parameters and the same model and prototype trace (read-only;
        Pyro's guides keep a reference to their model, not a copy)."""
        model = self.model
        for shared in (model, self.prototype_trace):
            if shared is not None:
                memo[id(shared)] = shared
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        state = self.__getstate__()
        state["_model"] = (model,)
        new.__setstate__(copy.deepcopy(state, memo))
        return new

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` (into the parameters the store shares), then the
        engine is rebuilt on next use, so ``q`` follows the loaded values."""
        out = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.engine = None
        return out


def option_property(name: str) -> property:
    """A guide property that reads and writes ``guide.options.<name>``."""

    def get(self):
        return getattr(self.options, name)

    def set_(self, value):
        setattr(self.options, name, value)

    return property(get, set_, doc=f"The guide option ``{name}`` (see :class:`AutoCVI`).")


def refuse_inside_svi_step(guide) -> None:
    """``SVI.step`` runs its loss under ``poutine.trace(param_only=True)``; CVI_ELBO never runs
    the guide, so a guide run there is a Pyro ELBO's (Trace_ELBO, TraceEnum_ELBO, ...), whose
    gradients cannot reach AutoCVI's natural parameters: q would never change.
    A guide already fitted by CVI_ELBO may be sampled there, fixed, while other parts of an
    AutoGuideList train (a two-stage fit)."""
    from pyro.poutine.runtime import _PYRO_STACK
    from pyro.poutine.trace_messenger import TraceMessenger

    if getattr(guide, "bound_check_running", False):  # its own check (methods/bound_check.py)
        return
    engine = guide.engine
    store = pyro.get_param_store()
    if engine is not None and engine.steps_name in store:
        if float(store[engine.steps_name].detach()) > 0:
            return
    if any(isinstance(m, TraceMessenger) and m.param_only for m in _PYRO_STACK):
        raise ValueError(
            f"{type(guide).__name__} ran inside SVI.step under a Pyro ELBO (Trace_ELBO, "
            "TraceEnum_ELBO, ...) before any CVI_ELBO step: its q is computed by conjugate "
            "computations, not differentiated, so it would never change. Use "
            "SVI(model, AutoCVI(model), CVI(), loss=CVI_ELBO()); or, to keep a Pyro ELBO, a "
            "Gaussian guide such as AutoMultivariateNormal or AutoNormal with CVI(), which "
            "steps it by natural gradients"
        )


#: prefix -> the guides that claimed it (weakly: a dropped guide holds no claim)
_CLAIMS: Dict[str, List[weakref.ref]] = {}
#: called with each guide at the start of its set-up, once its prefix is claimed
_SETUP_LISTENERS: List[Callable[[Any], None]] = []


def listen_to_setups(listener: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``listener(guide)`` at the start of every guide's set-up (a checkpoint loaded
    without its guide finishes there); returns the function that stops it."""
    _SETUP_LISTENERS.append(listener)

    def stop() -> None:
        if listener in _SETUP_LISTENERS:
            _SETUP_LISTENERS.remove(listener)

    return stop


def claimed(prefix: str) -> List[Any]:
    """The live guides set up under ``prefix`` that are bound to the store's tensors."""
    guides = [r() for r in _CLAIMS.get(prefix, [])]
    return [g for g in guides if g is not None and _holds_store_tensors(g)]


def check_prefix(prefix: Any, owner: str = "AutoCVI") -> str:
    """A valid prefix (a non-empty string without leading or trailing dots), or a ``ValueError``."""
    if not isinstance(prefix, str) or not prefix.strip(".") or prefix != prefix.strip("."):
        raise ValueError(
            f"{owner}(prefix={prefix!r}): the prefix of the guide's parameter names must be a "
            "non-empty string that neither starts nor ends with a dot, e.g. prefix='logreg'"
        )
    return prefix


def _holds_store_tensors(guide: Any) -> bool:
    """Whether ``guide`` is set up and bound to tensors the store holds under its names."""
    if getattr(guide, "prototype_trace", None) is None:
        return False
    store = pyro.get_param_store()
    return any(
        name in store and param is store.get_param(name).unconstrained()
        for name, param in bound_parameters(guide).items()
    )


def claim_prefix(guide: Any) -> None:
    """Claim ``guide``'s prefix for its set-up; ``ValueError`` if another live guide holds it."""
    prefix = guide.param_prefix
    for attempt in range(2):
        refs = [r for r in _CLAIMS.get(prefix, []) if r() is not None and r() is not guide]
        others = [r() for r in refs]
        if not any(_holds_store_tensors(g) for g in others):
            break
        del others  # (not held while the collector looks for dropped guides)
        if attempt == 0:
            gc.collect()  # a dropped guide in a reference cycle holds no claim
            continue
        kind = type(guide).__name__
        raise ValueError(
            f"{kind}: another guide in this process already keeps its parameters under the "
            f"prefix {prefix!r} in Pyro's param store ({prefix}.*); two guides with one prefix "
            "would read and overwrite each other's parameters. Give each guide its own prefix, "
            f"e.g. {kind}(model, prefix='{prefix}_2'), or call pyro.clear_param_store() to start "
            "a new run without the old guide's parameters."
        )
    _CLAIMS[prefix] = [r for r in _CLAIMS.get(prefix, []) if r() is not None and r() is not guide]
    _CLAIMS[prefix].append(weakref.ref(guide))
    for listener in list(_SETUP_LISTENERS):
        listener(guide)


class StoredShapes(Messenger):
    """A guide's set-up that finds one of its parameters (``prefix.*``) already in Pyro's param
    store with another shape or dtype than its own start: a ``ValueError`` naming it. The store's
    value wins where it fits (Pyro's rule: a guide built again resumes from the store), but one
    of another shape was left by a guide of another model under the same prefix (two models fitted
    one after another), and would fail later in torch's words. The start is computed only for
    such a parameter, without moving the random stream."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix + "."

    def _pyro_param(self, msg) -> None:
        name, *init = msg["args"]
        store = pyro.get_param_store()
        if not init or not name.startswith(self.prefix) or name not in store:
            return
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            start = init[0]() if callable(init[0]) else init[0]
            held = store[name]
        if not (torch.is_tensor(start) and torch.is_tensor(held)):
            return
        if held.shape != start.shape or (held.is_floating_point() and held.dtype != start.dtype):
            raise ValueError(
                f"AutoCVI: parameter {name!r} is in Pyro's param store with shape "
                f"{tuple(held.shape)} ({held.dtype}), but this guide's model needs "
                f"{tuple(start.shape)} ({start.dtype}): it was left there by a guide of another "
                f"model under the same prefix {self.prefix[:-1]!r}. Call pyro.clear_param_store() "
                "before fitting another model, or give this guide its own prefix "
                f"(AutoCVI(model, prefix='{self.prefix[:-1]}_2'))."
            )
