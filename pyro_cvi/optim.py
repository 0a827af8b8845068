"""``CVI``: the mirror-descent optimizer, as a :class:`pyro.optim.PyroOptim`.

Each parameter SVI hands it is stepped by its own rule:

* the CVI parameters of an :class:`~pyro_cvi.AutoCVI` guide (loss ``CVI_ELBO``): Algorithm 1's
  step (eq. 12 followed by the conjugate computation of step 4)::

      lambda_tilde <- lambda_tilde + beta_t * grad = (1 - beta_t) lambda_tilde + beta_t * target

  shrinking ``beta_t`` where the result would be an invalid natural parameter;
* the ``loc`` and ``scale`` / ``scale_tril`` / ``cov_factor`` of Pyro's Gaussian guides
  (``AutoNormal``, ``AutoDiagonalNormal``, ``AutoMultivariateNormal``,
  ``AutoLowRankMultivariateNormal``, hand-written Normal / MultivariateNormal guides), with any
  Pyro ELBO: the same mirror-descent step for a Gaussian, from the gradients the ELBO wrote
  (:mod:`pyro_cvi.natgrad`);
* every other parameter (hyperparameters, ``AutoDelta`` values, amortisation networks, flows):
  a torch optimizer of the user's choice, so hybrid learning is one ``svi.step``.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Iterable, Optional, Tuple, Type, Union

import pyro
import torch
from pyro.optim import PyroOptim

from .engine import owner_of
from .natgrad import GaussianStepper
from .step_sizes import Schedule, as_schedule

__all__ = ["CVI"]

_AUTOGUIDE_PREFIXES = (
    "AutoNormal.",
    "AutoMultivariateNormal.",
    "AutoDiagonalNormal.",
    "AutoLowRankMultivariateNormal.",
    "AutoDelta.",
    "AutoLaplaceApproximation.",
)


class CVI(PyroOptim):
    """Conjugate-computation variational inference optimizer.

    :param step_size: ``"auto"`` (default): the adaptive step of :mod:`pyro_cvi.step_control`
        (backtracking on the ELBO, shrinking on numerical failure, damping under Monte Carlo
        noise; ``beta`` starts at 1 for exact losses, 0.5 with Monte Carlo terms). Or a fixed
        ``beta_t`` in (0, 1]: a float, or a callable ``t -> beta_t`` (see
        :mod:`pyro_cvi.step_sizes`), applied as given (only shrunk to keep ``q`` valid).
    :param max_step_size: the ceiling of the adaptive step (``step_size="auto"`` only).
        For Pyro's Gaussian guides ``"auto"`` is the signal-to-noise control of
        :mod:`pyro_cvi.natgrad.control` (the optimizer never sees the loss value).
    :param max_step_size: the ceiling of the adaptive step (``step_size="auto"`` only).
    :param optim: torch optimizer class for every other parameter (default ``torch.optim.Adam``).
    :param optim_args: its arguments (default ``{"lr": 0.01}``).
    :param gaussian_step: the step of Pyro's Gaussian guides: ``"retraction"`` (default; Lin,
        Schmidt & Khan 2020: no step size makes a covariance invalid) or ``"natural"`` (the
        plain natural-gradient step, halved until valid; exact in one step at
        ``step_size=1`` on a conjugate Gaussian model with exact gradients).
    :param gaussians: Gaussians of a hand-written guide whose param names do not follow the
        conventions of :mod:`pyro_cvi.natgrad.roles`: ``{label: (loc name, scale name)}`` or
        ``{label: (loc name, scale_tril name)}``.

    Example::

        guide = AutoMultivariateNormal(model)
        svi = SVI(model, guide, CVI(), loss=Trace_ELBO())  # natural-gradient steps
    """

    def __init__(
        self,
        step_size: Union[float, str, Schedule] = "auto",
        optim: Type[torch.optim.Optimizer] = torch.optim.Adam,
        optim_args: Optional[Union[Dict, Callable]] = None,
        max_step_size: float = 1.0,
        gaussian_step: str = "retraction",
        gaussians: Optional[Dict[str, Tuple[str, str]]] = None,
    ):
        self.auto = isinstance(step_size, str)
        if self.auto and step_size != "auto":
            raise ValueError(f"step_size must be 'auto', a number or a callable, got {step_size!r}")
        self.max_step_size = float(as_schedule(max_step_size)(1))
        self.schedule = as_schedule(self.max_step_size if self.auto else step_size)
        if not callable(step_size):
            self.schedule(1)  # validates the constant
        self.t = 0
        self.engines: Dict[int, object] = {}
        self.saved_controls: Dict[str, Dict] = {}  # from set_state, until the engines appear
        self.gaussians = GaussianStepper(gaussian_step, gaussians)
        super().__init__(optim, optim_args if optim_args is not None else {"lr": 0.01})

    @property
    def step_size(self) -> float:
        """The step size the next step will use (``"auto"``: the current adaptive ``beta`` of
        the last engine stepped, before its minibatch decay)."""
        if self.auto:
            betas = [e.control.beta for e in self._live() if e.control is not None]
            if not betas and self.gaussians.controls:
                return float(list(self.gaussians.controls.values())[-1].step_size())
            return float(betas[-1]) if betas else self.max_step_size
        return float(self.schedule(self.t + 1))

    def _live(self):
        return [e for e in (r() for r in self.engines.values()) if e is not None]

    def __call__(self, params: Iterable[torch.Tensor], *args, **kwargs) -> None:
        params = list(params)
        engines, others = {}, []
        for p in params:
            engine = owner_of(p)  # the CVI engine that owns p (metadata on the parameter)
            if engine is None:
                others.append(p)
            else:
                engines[id(engine)] = engine
        groups, others = self.gaussians.split(others)
        if not engines and not groups:
            _refuse(others)
        if any(e.pending is None for e in engines.values()):
            raise ValueError(
                "AutoCVI + CVI(): the AutoCVI parameters got no natural gradients, so the loss "
                "is not CVI_ELBO (Trace_ELBO, TraceEnum_ELBO and the other Pyro ELBOs cannot "
                "differentiate AutoCVI's q; the guide would never change). Use "
                "SVI(model, AutoCVI(model), CVI(), loss=CVI_ELBO()); or, to keep a Pyro ELBO, "
                "a Gaussian guide (AutoNormal, AutoMultivariateNormal, ...), which CVI() steps "
                "by natural gradients"
            )
        self.t += 1
        if self.auto:
            for key, engine in engines.items():
                self.engines[key] = weakref.ref(engine)
                engine.enable_control(
                    self.max_step_size, self.saved_controls.pop(engine.prefix, None)
                )
                engine.step(None)
            if groups:
                self._load_gaussian_controls()
                self.gaussians.step(groups, _ceiling(self.max_step_size), adaptive=True)
        else:
            beta = float(self.schedule(self.t))
            if not 0.0 < beta <= 1.0:
                raise ValueError(
                    f"step-size schedule gave beta_{self.t} = {beta}; it must be in (0, 1]"
                )
            for engine in engines.values():
                engine.step(beta)
            self.gaussians.step(groups, lambda control: (beta, None))
        reducers = {id(r): r for r in (e.options.reducer for e in engines.values()) if r}
        for reducer in reducers.values():  # data-parallel: the full-data gradients
            reducer.reduce_grads(others)
        others = [p for p in others if p.grad is not None]
        if others:
            super().__call__(others, *args, **kwargs)

    def _load_gaussian_controls(self) -> None:
        saved = self.saved_controls.pop("__gaussians__", None)
        if saved is not None:
            self.gaussians.load(saved)

    def get_state(self) -> Dict:
        state = super().get_state()
        state["__cvi__"] = {"t": self.t}
        controls = {e.prefix: e.control.state() for e in self._live() if e.control is not None}
        if self.gaussians.controls:
            controls["__gaussians__"] = self.gaussians.state()
        if controls:
            state["__cvi__"]["control"] = controls
        return state

    def set_state(self, state_dict: Dict) -> None:
        state_dict = dict(state_dict)
        cvi = state_dict.pop("__cvi__", None)
        if cvi is not None:
            self.t = int(cvi["t"])
            self.saved_controls = dict(cvi.get("control", {}))
        super().set_state(state_dict)


def _ceiling(max_beta: float):
    def beta_of(control) -> Tuple[float, float]:
        control.ceiling = max_beta
        return control.step_sizes()

    return beta_of


def _refuse(params) -> None:
    store = pyro.get_param_store()
    names = [n for n in (store.param_name(p) for p in params) if n is not None]
    auto = [n for n in names if n.startswith(_AUTOGUIDE_PREFIXES)]
    what = f" (got parameters of {auto[0].split('.')[0]})" if auto else ""
    if not params:
        what = " (SVI handed it no parameters at all)"
    elif not auto and names:
        what = f" (got {names[:4]})"
    raise ValueError(
        "CVI found nothing to step by natural gradients" + what + ". CVI() steps AutoCVI "
        "guides (loss CVI_ELBO) and Gaussian guides (AutoNormal, AutoDiagonalNormal, "
        "AutoMultivariateNormal, AutoLowRankMultivariateNormal, hand-written Normal / "
        "MultivariateNormal of pyro.param loc and scale or scale_tril, see CVI(gaussians=...)) "
        "with any Pyro ELBO. For a guide without a Gaussian (AutoDelta, flows) use a torch "
        "optimizer such as pyro.optim.Adam."
    )
