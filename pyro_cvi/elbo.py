"""``CVI_ELBO``: the ELBO with gradients with respect to mean parameters.

For every CVI parameter ``lambda_tilde`` of an :class:`~pyro_cvi.AutoCVI` guide this loss writes
the natural gradient ``grad_mu E_q[log p_f] - lambda_tilde`` into ``.grad`` (exact for conjugate
factors, Gauss-Hermite or Monte Carlo for linear-predictor factors, Bonnet/Price or implicit
reparameterisation for general ones), and it back-propagates the ELBO into every other
parameter, so hyperparameters can be learned by a torch optimizer in the same step. That
gradient is the derivative of the reported loss at fixed CVI parameters: a Gaussian block's
``q`` is re-solved, with graph, from the prior and the sites (its affine coefficients ``A`` and
offsets ``c`` too, where they depend on the parameters), so it equals the loss's finite
differences. The value it returns is the -ELBO of the current ``q``: exact where closed forms allow
(conjugate terms, the KL, quadrature), an unbiased estimate otherwise.
"""

from __future__ import annotations

import inspect
from types import FrameType
from typing import Any, Callable, List, NoReturn, Optional, Union

import torch
from pyro.infer import ELBO
from pyro.infer.autoguide import AutoGuideList
from pyro.poutine.runtime import _PYRO_STACK
from pyro.poutine.trace_messenger import TraceMessenger

from .autoguide import AutoCVI
from .methods.guide_list import PartsLoss, parts_loss
from .methods.structured_guide import AutoStructuredCVI
from .optim import CVI
from .scale.distributed import tell_ranks
from .transaction import abort, pending

__all__ = ["CVI_ELBO"]

_Fn = Callable[..., Any]  # a Pyro model or guide


class CVI_ELBO(ELBO):
    """The evidence lower bound for CVI; use it with :class:`~pyro_cvi.AutoCVI` and
    :class:`~pyro_cvi.CVI`::

        svi = SVI(model, AutoCVI(model), CVI(step_size=0.5), loss=CVI_ELBO())
    """

    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("num_particles", 1) != 1:
            raise ValueError(
                "CVI_ELBO computes its expectations itself; set AutoCVI(num_samples=...) for "
                "Monte Carlo gradients instead of num_particles"
            )
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]  # (pyro: untyped)

    def loss(self, model: _Fn, guide: _Fn, *args: Any, **kwargs: Any) -> float:
        # (not under no_grad: quadrature and mean-field expectations use autograd inside)
        return float(_checked(model, guide).elbo(args, kwargs, grads=False).detach().neg())

    def differentiable_loss(
        self, model: _Fn, guide: _Fn, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        return _checked(model, guide).elbo(args, kwargs, grads=False, graph=True).neg()

    def loss_and_grads(self, model: _Fn, guide: _Fn, *args: Any, **kwargs: Any) -> float:
        cvi_guide = _checked(model, guide)
        if cvi_guide.engine is not None and cvi_guide.engine.pending is not None:
            engine = cvi_guide.engine
            abort([engine])  # the unapplied step is dropped: a CVI() step can follow
            engine.pending = None
            frame = inspect.currentframe()
            stepper = _optimizer_of_caller(frame.f_back if frame is not None else None)
            del frame
            # with CVI() the last step was interrupted before its update (now undone)
            if not isinstance(stepper, CVI):
                raise ValueError(
                    "AutoCVI + CVI_ELBO with an optimizer that is not CVI (e.g. "
                    "pyro.optim.Adam): the natural gradients of the last step were never "
                    "applied, so q cannot change. Use SVI(model, AutoCVI(model), CVI(), "
                    "loss=CVI_ELBO()); CVI(optim=...) hands the model's other parameters to a "
                    "torch optimizer of your choice"
                )
        try:
            elbo = cvi_guide.elbo(args, kwargs, grads=True)
        except BaseException as e:  # data-parallel: the other ranks raise too, not wait
            abort([g for g in [getattr(cvi_guide, "engine", None)] if g is not None])  # (kept)
            tell_ranks(getattr(cvi_guide, "reducer", None), e)
            raise
        try:
            if not elbo.requires_grad:
                return -float(elbo)  # (-x is exact: the same number as float(-x))
            loss = -elbo
            txn = pending(cvi_guide.engine)
            if txn is not None:  # (a rollback, now or at the next loss, drops their gradients)
                txn.grads_of = _captured_params()
            loss.backward()
            return float(loss.detach())
        except BaseException:  # the step's transaction is rolled back (an interrupt, too)
            abort([cvi_guide.engine])
            raise

    def _get_trace(self, model: _Fn, guide: _Fn, args: Any, kwargs: Any) -> NoReturn:
        raise NotImplementedError("CVI_ELBO does not sample traces; it computes expectations")


def _captured_params() -> List[torch.Tensor]:
    """The parameters ``SVI.step``'s param capture holds (the model's hyperparameters): their
    gradients from a step that is rolled back must not add to the next step's (SVI drops them
    only after a step)."""
    for m in _PYRO_STACK:
        if isinstance(m, TraceMessenger) and m.param_only and m.trace is not None:
            values = [s["value"] for s in m.trace.nodes.values() if s["type"] == "param"]
            return [v.unconstrained() for v in values if v is not None]
    return []


def _checked(model: _Fn, guide: _Fn) -> Union[AutoCVI, AutoStructuredCVI, PartsLoss]:
    if isinstance(guide, AutoGuideList):
        loss = parts_loss(guide, (AutoCVI,))
        if loss is not None:
            _same_model(model, guide)
            return loss
    if not isinstance(guide, (AutoCVI, AutoStructuredCVI)):
        name = type(guide).__name__
        parts = ""
        if isinstance(guide, AutoGuideList):
            parts = " (an AutoGuideList without an AutoCVI part)"
        raise TypeError(
            f"CVI_ELBO needs an AutoCVI guide, got {name}{parts}. CVI_ELBO computes "
            "AutoCVI's conjugate messages: use guide = AutoCVI(model). "
            f"To keep {name}, use pyro.infer.Trace_ELBO (or another Pyro ELBO) with CVI(), "
            "which steps Gaussian guides by natural gradients, or with pyro.optim.Adam."
        )
    _same_model(model, guide)
    return guide


def _same_model(model: _Fn, guide: Any) -> None:
    if guide.model is not model and getattr(guide.model, "__wrapped__", None) is not model:
        raise ValueError(
            f"CVI_ELBO: this {type(guide).__name__} guide was built for a different model "
            f"({getattr(guide.model, '__name__', guide.model)!r}); build the guide with "
            f"{type(guide).__name__}(model) for the model you pass to SVI"
        )


def _optimizer_of_caller(frame: Optional[FrameType]) -> Any:
    """The optimizer of the ``pyro.infer.SVI.step`` call that ``frame`` is, if it is one."""
    if frame is None or frame.f_code.co_name != "step":
        return None
    svi = frame.f_locals.get("self")
    return getattr(svi, "optim", None)
