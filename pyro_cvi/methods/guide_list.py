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

Under a Pyro ELBO (``Trace_ELBO``, ...) the guide list is refused by name before any step
(:func:`pyro_cvi.guide_state.pyro_elbo_refusal`): Pyro differentiates a Monte Carlo estimate,
and the CVI part's natural parameters get no gradient from it, so its ``q`` would stay at the
start.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import pyro
import pyro.poutine as poutine
import torch

from ..context import GIVEN
from ..guide_state import unbind_parameters

__all__ = [
    "GIVEN",
    "OthersGiven",
    "PartsLoss",
    "adopt_guide_list",
    "parts_loss",
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
        if steps is not None and steps in store and float(store[steps].detach()) > 0:
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
