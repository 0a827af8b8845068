"""An :class:`~pyro_cvi.AutoCVI` as one part of Pyro's ``AutoGuideList``.

Pyro's recipe builds each part on a blocked model::

    guide = AutoGuideList(model)
    guide.append(AutoCVI(poutine.block(model, hide=["s"])))
    guide.append(AutoDelta(poutine.block(model, expose=["s"])))

A blocked site is still *run* by the blocked model, from its prior, unseen: a CVI part that
analysed it would see a model with hidden noise. So an AutoCVI that finds itself in a guide list
(``guide.master``) works on the full model *given the other parts' values* instead
(:class:`OthersGiven`): for ``q = q_cvi(z) q_other(s)`` the bound is

    ELBO = E_{q_other}[ E_{q_cvi}[log p(x, z, s) - log q_cvi(z)] - log q_other(s) ],

whose inner expectation is the CVI part's own ELBO of the model conditioned on ``s``. Under
:class:`~pyro_cvi.CVI_ELBO` (:class:`PartsLoss`) each loss draws ``s`` once from the other
parts (with its graph to their parameters: a reparameterised one-draw estimate for them, exact
for point-mass parts such as ``AutoDelta``), hands it to the CVI part (which computes its
messages and natural gradients at that ``s``) and subtracts ``log q_other(s)``.

Under a Pyro ELBO (``Trace_ELBO``, ...) inside ``SVI.step`` (:func:`step_inside_pyro_elbo`)
Pyro differentiates a Monte Carlo estimate, which cannot reach the CVI part's natural
parameters. So the part steps itself when the guide list calls it, once per ``SVI.step``: it
draws ``s`` from the other parts (detached), computes its natural gradients at that ``s``
(CVI_ELBO's loss of the part given ``s``) and applies CVI's update (eq. 12: the adaptive step,
or the fixed schedule of a ``CVI(step_size=...)`` optimizer), then draws ``z`` from the
updated ``q_cvi``, detached. Pyro's loss is then its -ELBO estimate of the joint guide
``q_cvi(z) q_other(s)``, and its gradient, at fixed ``q_cvi``, trains the other parts with the
user's optimizer. A step that fails leaves the part as it was; a Pyro ELBO outside ``SVI.step``
(``Trace_ELBO().loss``, ``Predictive``) only draws.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer import ELBO, SVI
from pyro.poutine.runtime import _PYRO_STACK
from pyro.poutine.trace_messenger import TraceMessenger

from ..context import GIVEN
from ..guide_state import unbind_parameters
from ..transaction import abort, commit

__all__ = [
    "GIVEN",
    "OthersGiven",
    "PartsLoss",
    "adopt_guide_list",
    "parts_loss",
    "step_inside_pyro_elbo",
]


class OthersGiven:
    """The full model conditioned on the values of the other parts of ``part``'s guide list:
    given as ``GIVEN=values`` (one draw per loss, :class:`PartsLoss`), else drawn here from
    those parts (a run of the guide outside the loss, e.g. ``Predictive``)."""

    def __init__(self, model: Callable[..., Any], part: Any):
        self.model = model
        self.part = part
        self.__name__ = getattr(model, "__name__", "model")
        self.__wrapped__ = model

    def others(self) -> List[Any]:
        master = self.part.master() if self.part.master is not None else None
        if master is None:
            raise ValueError("this AutoCVI is no longer part of an AutoGuideList")
        return [p for p in master if p is not self.part]

    def draw(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Dict, torch.Tensor]:
        """One draw of the other parts: their values and ``log q_other`` (scaled, masked)."""
        with poutine.trace() as tr:
            for part in self.others():
                part(*args, **kwargs)
        trace = tr.trace
        trace.compute_log_prob()
        values, log_q = {}, torch.zeros(())
        for name, site in trace.nodes.items():
            if site["type"] == "sample" and not site["is_observed"]:
                values[name] = site["value"]
                log_q = log_q + site["log_prob_sum"]
        return values, log_q

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        values = kwargs.pop(GIVEN, None)
        if values is None:
            with poutine.block():
                values, _ = self.draw(args, kwargs)
        return poutine.condition(self.model, data=values)(*args, **kwargs)


def adopt_guide_list(part: Any) -> None:
    """Make ``part``'s model :class:`OthersGiven` (module docstring). A part already set up on
    its own (blocked) model is set up again, unless it was trained so (then a ``ValueError``:
    its ``q`` belongs to that model)."""
    if isinstance(part.model, OthersGiven):
        return
    master = part.master() if part.master is not None else None
    if master is None:
        raise ValueError("this AutoCVI is not a part of an AutoGuideList")
    if part.prototype_trace is not None:
        engine = part.engine
        store = pyro.get_param_store()
        steps = engine.steps_name if engine is not None else None
        if trained_alone(part):
            raise ValueError(
                "CVI_ELBO with an AutoGuideList whose AutoCVI part was trained alone on its "
                "blocked model: its q belongs to that model. Build the guide list anew and "
                "train it with SVI(model, guide_list, CVI(), CVI_ELBO())"
            )
        names = (engine.param_names() + [steps]) if engine is not None else []
        unbind_parameters(part)
        for name in names:
            if name in store:
                del store[name]
        part.prototype_trace = None
        part.engine = None
    part.model = OthersGiven(master.model, part)


def trained_alone(part: Any) -> bool:
    """Whether ``part`` was set up and stepped on its own (blocked) model, outside the list."""
    if isinstance(part.model, OthersGiven) or part.prototype_trace is None:
        return False
    engine = part.engine
    steps = engine.steps_name if engine is not None else None
    store = pyro.get_param_store()
    return steps is not None and steps in store and float(store[steps].detach()) > 0


class PartsLoss:
    """What :class:`~pyro_cvi.CVI_ELBO` steps for an ``AutoGuideList`` with one AutoCVI part:
    the part's ELBO at one draw of the others, minus their ``log q`` (module docstring)."""

    def __init__(self, guide_list: Any, cvi: Any):
        self.guide_list = guide_list
        self.cvi = cvi

    @property
    def engine(self) -> Any:
        return self.cvi.engine

    @property
    def reducer(self) -> Any:
        return self.cvi.reducer

    def elbo(
        self,
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
        grads: bool = False,
        graph: bool = False,
    ) -> torch.Tensor:
        gl = self.guide_list
        if gl.prototype_trace is None:
            gl._setup_prototype(*args, **kwargs)
        gl._create_plates(*args, **kwargs)
        adopt_guide_list(self.cvi)
        model = self.cvi.model
        values, log_q = model.draw(args, kwargs)
        # the engine keeps the ELBO's graph to the given values (the other parts' parameters)
        # although the model has no pyro.param of its own (pyro_cvi.context.GIVEN)
        elbo = self.cvi.elbo(args, {**kwargs, GIVEN: values}, grads, graph)
        return elbo - log_q.to(elbo)


def parts_loss(guide_list: Any, cvi_types: Tuple[type, ...]) -> Optional[PartsLoss]:
    """The :class:`PartsLoss` of a guide list with exactly one part of ``cvi_types`` (kept on
    the guide list); ``None`` when it has none. More than one: a ``TypeError`` naming them."""
    cvis = [p for p in guide_list if isinstance(p, cvi_types)]
    if not cvis:
        return None
    if len(cvis) > 1:
        raise TypeError(
            f"CVI_ELBO with an AutoGuideList of {len(cvis)} AutoCVI parts: give one AutoCVI "
            "every site that CVI should fit (AutoCVI groups them into blocks itself)"
        )
    loss = getattr(guide_list, "_cvi_parts_loss", None)
    if loss is None or loss.cvi is not cvis[0]:
        loss = PartsLoss(guide_list, cvis[0])
        guide_list._cvi_parts_loss = loss
    return loss


#: part -> (a weak reference to) the ``SVI.step`` param capture it last stepped in
_STEPPED: weakref.WeakKeyDictionary[Any, weakref.ref] = weakref.WeakKeyDictionary()


def _svi_capture() -> Optional[TraceMessenger]:
    """The param-only trace ``SVI.step`` runs its loss under (``None`` outside ``SVI.step``)."""
    for m in _PYRO_STACK:
        if isinstance(m, TraceMessenger) and m.param_only:
            return m
    return None


def _caller_self(names: Tuple[str, ...], cls: type) -> Optional[Tuple[Any, str]]:
    """``(self, method name)`` of the innermost call on the stack of a method in ``names`` of
    an instance of ``cls`` (``None``: none)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_name
        if name in names and isinstance(frame.f_locals.get("self"), cls):
            return frame.f_locals["self"], name
        frame = frame.f_back
    return None


def _svi_optimizer() -> Any:
    """The optimizer of the ``SVI.step`` call on the stack (``None``: not found)."""
    found = _caller_self(("step",), SVI)
    return found[0].optim if found is not None else None


#: parts already warned that a Pyro ELBO differentiated them outside ``SVI.step``
_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()
#: part -> how often a Pyro ELBO differentiated it outside ``SVI.step`` while it was unfitted
_UNSTEPPED_RUNS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
#: a loop, not one gradient (Pyro's own tests take one ``loss_and_grads`` of a guide list)
LOOP_RUNS = 3

_DIFFERENTIATING = ("differentiable_loss", "loss_and_grads")


def _pyro_elbo_differentiating() -> Optional[str]:
    """``"Trace_ELBO.loss_and_grads"`` (say) when a Pyro ELBO's differentiating method is on the
    call stack, else ``None``."""
    found = _caller_self(_DIFFERENTIATING, ELBO)
    return f"{type(found[0]).__name__}.{found[1]}" if found is not None else None


def _warn_outside_svi_step(part: Any) -> None:
    """Once per part, at the :data:`LOOP_RUNS`-th time: a Pyro ELBO differentiating the guide
    list outside ``SVI.step`` (a hand-written loop) trains the other parts, but never steps the
    CVI part (its ``q`` is computed by conjugate computations; gradients cannot reach it)."""
    if part in _WARNED or not torch.is_grad_enabled():
        return
    engine = part.engine
    store = pyro.get_param_store()
    if engine is not None and engine.steps_name in store:
        if float(store[engine.steps_name].detach()) > 0:  # fitted: drawn as it is (two stages)
            return
    caller = _pyro_elbo_differentiating()
    if caller is None:
        return
    runs = _UNSTEPPED_RUNS.get(part, 0) + 1
    _UNSTEPPED_RUNS[part] = runs
    if runs < LOOP_RUNS:
        return
    _WARNED.add(part)
    warnings.warn(
        f"the AutoCVI part of an AutoGuideList was run by {caller} outside SVI.step: its q "
        "is fitted by CVI's steps, which a hand-written loop never takes, so it stays where "
        "it is while the other parts train. Step the guide list with "
        "SVI(model, guide_list, CVI(), loss=CVI_ELBO()).step(...) (or SVI with a Pyro ELBO "
        "and any optimizer, which steps the part once per SVI.step)",
        RuntimeWarning,
        stacklevel=2,
    )


def step_inside_pyro_elbo(part: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """Whether ``part`` (an AutoCVI) runs inside ``SVI.step`` under a Pyro ELBO as a part of an
    ``AutoGuideList``; if so, its CVI step for this ``SVI.step`` is applied now (once, also
    with ``num_particles > 1``) and the caller draws from ``q`` detached (module docstring)."""
    master = part.master() if getattr(part, "master", None) is not None else None
    if master is None or getattr(part, "bound_check_running", False):
        return False
    capture = _svi_capture()
    if capture is None:
        _warn_outside_svi_step(part)
        return False
    if trained_alone(part):  # a q fitted on its blocked model: drawn as it is, not stepped
        return False
    last = _STEPPED.get(part)
    if last is not None and last() is capture:
        return True
    adopt_guide_list(part)
    with poutine.block():  # (its parameters are CVI's, not the user optimizer's)
        _step(part, args, kwargs)
    _STEPPED[part] = weakref.ref(capture)
    return True


def _step(part: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    values, _ = part.model.draw(args, kwargs)
    given = {name: value.detach() for name, value in values.items()}
    part.elbo(args, {**kwargs, GIVEN: given}, grads=True)  # the transaction stays open
    engine = part.engine
    try:
        _apply(engine, _svi_optimizer())
    except BaseException:
        abort([engine])
        raise
    finally:
        store = pyro.get_param_store()
        for name in engine.param_names():
            if name in store:
                store.get_param(name).unconstrained().grad = None
    commit([engine])


def _apply(engine: Any, optim: Any) -> None:
    """CVI's update of the pending step: a ``CVI(step_size=...)`` optimizer's fixed schedule
    at this part's step count, else the adaptive step (with ``CVI``'s ceiling and kept in its
    state, so that checkpoints carry it)."""
    from ..optim import CVI  # (the optimizer imports the guides' modules)

    if isinstance(optim, CVI) and not optim.auto:
        t = int(pyro.param(engine.steps_name).detach()) + 1
        beta = float(optim.schedule(t))
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"step-size schedule gave beta_{t} = {beta}; it must be in (0, 1]")
        engine.step(beta)
        return
    if isinstance(optim, CVI):
        optim.engines[id(engine)] = weakref.ref(engine)
        engine.enable_control(optim.max_step_size, optim.saved_controls.pop(engine.prefix, None))
    else:
        engine.enable_control(1.0)
    engine.step(None)
