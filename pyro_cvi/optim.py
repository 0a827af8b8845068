"""``CVI``: the mirror-descent optimizer, as a :class:`pyro.optim.PyroOptim`.

Each parameter SVI hands it is stepped by its own rule:

* the CVI parameters of an :class:`~pyro_cvi.AutoCVI` guide (loss ``CVI_ELBO``): Algorithm 1's
  step (eq. 12 followed by the conjugate computation of step 4)::

      lambda_tilde <- lambda_tilde + beta_t * grad = (1 - beta_t) lambda_tilde + beta_t * target

  shrinking ``beta_t`` where the result would be an invalid natural parameter;
* the parameters of every exponential-family sample site of the guide (Normal,
  MultivariateNormal, LowRankMultivariateNormal, Gamma, Beta, Dirichlet, LogNormal and other
  ``TransformedDistribution`` s of those, under ``.to_event``, plates and particles), whatever
  their names, whenever each distribution parameter is an element-wise map (a constraint,
  ``exp``, ``softplus``) of one raw parameter, with any Pyro ELBO: the same mirror-descent step
  in the site's own family, from the gradients the ELBO wrote, mapped through that map's
  Jacobian (:mod:`pyro_cvi.natgrad`; the sites are seen while the loss runs by
  :mod:`pyro_cvi.natgrad.observe`, found by :mod:`pyro_cvi.natgrad.sites`); Pyro's Gaussian
  autoguides by their parameters' roles (:mod:`pyro_cvi.natgrad.roles`);
* every other parameter (hyperparameters, ``AutoDelta`` values, amortisation networks, flows,
  parameters of other families): a torch optimizer of the user's choice (Adam by default), so
  hybrid learning is one ``svi.step``. Nothing is refused; :meth:`CVI.explain` says which rule
  each parameter got. Under the defaults (Adam, no ``optim_args``) the hyperparameters of a
  ``pyro.contrib.gp`` variational GP, recognised by its class while its guide runs, get the
  rate :data:`pyro_cvi.natgrad.gp_models.HYPER_LR` (0.03) instead of 0.01: with ``q(u)`` at its
  optimum after each natural-gradient step their gradients are those of the collapsed bound.

It works the same under ``SVI.step`` and a hand-written loop (``loss.loss_and_grads(...)`` then
``optim(params)``); see docs/pairings.md.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    Iterable,
    List,
    Optional,
    Tuple,
    Type,
    Union,
    cast,
)

import pyro
import torch
from pyro.optim import PyroOptim

from .divergence import DivergenceError, watch
from .natgrad import GaussianStepper
from .natgrad.gp_models import HYPER_LR, GPHyperparameters
from .natgrad.guard import SUSPECTS, LossGuard
from .natgrad.observe import current, forget, observer
from .scale.distributed import tell_ranks
from .step_sizes import Schedule, as_schedule
from .transaction import abort, commit
from .update import NaturalGradientOwner, owner_of

__all__ = ["CVI"]


class CVI(PyroOptim):
    """Conjugate-computation variational inference optimizer.

    :param step_size: ``"auto"`` (default): the adaptive step of :mod:`pyro_cvi.step_control`
        (backtracking on the ELBO, shrinking on numerical failure, damping under Monte Carlo
        noise; ``beta`` starts at 1 for exact losses, 0.5 with Monte Carlo terms). Or a fixed
        ``beta_t`` in (0, 1]: a float, or a callable ``t -> beta_t`` (see
        :mod:`pyro_cvi.step_sizes`), applied as given (only shrunk to keep ``q`` valid).
        For the guide's exponential-family sites ``"auto"`` is the signal-to-noise control of
        :mod:`pyro_cvi.natgrad.control` (the loss value only feeds the divergence guard).
    :param max_step_size: the ceiling of the adaptive step (``step_size="auto"`` only).
    :param optim: torch optimizer class for every other parameter (default ``torch.optim.Adam``).
    :param optim_args: its arguments (default ``{"lr": 0.01}``; with the default ``optim``, the
        hyperparameters of a ``pyro.contrib.gp`` variational GP get ``{"lr": 0.03}``, see
        :mod:`pyro_cvi.natgrad.gp_models`; given ``optim_args`` apply to every parameter).
    :param gaussian_step: the step of Pyro's Gaussian guides: ``"retraction"`` (default; Lin,
        Schmidt & Khan 2020: no step size makes a covariance invalid) or ``"natural"`` (the
        plain natural-gradient step, halved until valid; exact in one step at
        ``step_size=1`` on a conjugate Gaussian model with exact gradients).
    :param gaussians: Gaussians declared by param-store names, ``{label: (loc name, scale
        name)}`` or ``{label: (loc name, scale_tril name)}``: taken as given, before what the
        guide's trace shows (rarely needed: the trace finds a guide's sites by itself).

    Example::

        guide = AutoMultivariateNormal(model)
        svi = SVI(model, guide, CVI(), loss=Trace_ELBO())  # natural-gradient steps
    """

    def __init__(
        self,
        step_size: Union[float, str, Schedule] = "auto",
        optim: Type[torch.optim.Optimizer] = torch.optim.Adam,
        optim_args: Optional[Union[Dict[str, Any], Callable[..., Dict[str, Any]]]] = None,
        max_step_size: float = 1.0,
        gaussian_step: str = "retraction",
        gaussians: Optional[Dict[str, Tuple[str, str]]] = None,
    ) -> None:
        self.auto = isinstance(step_size, str)
        if self.auto and step_size != "auto":
            raise ValueError(f"step_size must be 'auto', a number or a callable, got {step_size!r}")
        self.max_step_size = float(as_schedule(max_step_size)(1))
        fixed = cast(Union[float, Schedule], step_size)  # not a str here
        self.schedule = as_schedule(self.max_step_size if self.auto else fixed)
        if not callable(step_size):
            self.schedule(1)  # validates the constant
        self.t = 0
        self.engines: Dict[int, weakref.ref[NaturalGradientOwner]] = {}
        # from set_state, until the engines appear
        self.saved_controls: Dict[str, Dict[str, Any]] = {}
        self.gaussians = GaussianStepper(gaussian_step, gaussians)
        #: divergence of the Gaussians of Pyro's guides, from the loss svi.step got
        self.guard = LossGuard()
        #: steps in a row skipped for non-finite gradients (:meth:`_infinite_gradients`)
        self.infinite_steps = 0
        observer(self)  # sees the guide's sites while the loss runs (natgrad.observe)
        #: what the last step did with each parameter (:meth:`explain`)
        self.last_rules: List[Tuple[str, str, str]] = []
        #: hyperparameters of the pyro.contrib.gp models seen (their rate: _get_optim_args)
        self.gp_hyperparameters = GPHyperparameters()
        self._gp_rate = optim is torch.optim.Adam and optim_args is None
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

    def _live(self) -> List[Any]:
        return [e for e in (r() for r in self.engines.values()) if e is not None]

    def __call__(self, params: Iterable[torch.Tensor], *args: Any, **kwargs: Any) -> None:
        # the update completes the transaction its loss opened: a failure or an interrupt
        # anywhere in it rolls the guides back (:mod:`pyro_cvi.transaction`)
        params = list(params)
        t, saved, grad_mode = self.t, dict(self.saved_controls), torch.is_grad_enabled()
        try:
            obs = current()
            sites = obs.take(params) if obs is not None else {}
            self.gaussians.observe(sites)
            self.gp_hyperparameters.add(
                m for m in (s.gp_model() for s in sites.values() if s.gp_model) if m is not None
            )
            loss = (lambda: obs.take_loss(params)) if obs is not None else None  # (if needed)
            engines = self._update(params, args, kwargs, loss)
        except BaseException as error:
            self.t, self.saved_controls = t, saved
            torch.set_grad_enabled(grad_mode)
            owners = {e for e in map(owner_of, params) if e is not None}
            for reducer in {id(r): r for r in (e.reducer for e in owners) if r}.values():
                tell_ranks(reducer, error)  # data-parallel: the other ranks undo theirs too
            abort(owners)
            for p in params:  # this step's gradients must not leak into the next one
                p.grad = None
            raise
        commit(engines)

    def _update(
        self,
        params: List[torch.Tensor],
        args: Any,
        kwargs: Any,
        loss: Optional[Callable[[], Optional[float]]] = None,
    ) -> List[Any]:
        engines: Dict[int, NaturalGradientOwner] = {}
        others: List[torch.Tensor] = []
        owned: List[torch.Tensor] = []
        for p in params:
            engine = owner_of(p)  # the CVI engine that owns p (metadata on the parameter)
            if engine is None:
                others.append(p)
            else:
                engines[id(engine)] = engine
                owned.append(p)
        groups, others = self.gaussians.split(others)
        gp = self.gp_hyperparameters if self._gp_rate else None
        self.last_rules = _rules(engines.values(), groups, others, gp)
        if any(not e.has_pending_step() for e in engines.values()):
            raise ValueError(
                "AutoCVI + CVI(): the AutoCVI parameters got no natural gradients, so the loss "
                "is not CVI_ELBO (Trace_ELBO, TraceEnum_ELBO and the other Pyro ELBOs cannot "
                "differentiate AutoCVI's q; the guide would never change). Use "
                "SVI(model, AutoCVI(model), CVI(), loss=CVI_ELBO()); or, to keep a Pyro ELBO, "
                "a Gaussian guide (AutoNormal, AutoMultivariateNormal, ...), which CVI() steps "
                "by natural gradients"
            )
        self.t += 1
        self.gaussians.before = []  # (a skipped step below undoes nothing)
        value = loss() if loss is not None and groups else None
        if loss is not None and not groups:
            forget(params)
        take, why = True, None
        if groups and value is not None:
            try:
                take = self.guard.check(value, groups)
            except DivergenceError:
                for g in groups:  # the step control of each Gaussian starts afresh
                    self.gaussians.controls.pop(g.label, None)
                raise
            if not take and not math.isfinite(value):
                why = f"its loss is {value}"
        if take and groups:
            why = self._infinite_gradients(groups, others)
            take = why is None
        if not take:  # a suspect loss (natgrad.guard) or gradients: the whole step is skipped
            if why is not None:
                warnings.warn(
                    f"CVI(): this step was skipped ({why}; a draw of q where the model's "
                    "log density overflows, or on the edge of a support in float32?): the "
                    f"guide keeps its q; {SUSPECTS} such steps in a row raise DivergenceError. "
                    "Fixes: the adaptive CVI() instead of a fixed step_size (or a smaller "
                    "one), more particles in the ELBO, or float64.",
                    RuntimeWarning,
                    stacklevel=4,  # (the caller of svi.step)
                )
            self.t -= 1
            for p in params:
                p.grad = None
            abort(engines.values())  # AutoCVI guides back to where their loss began
            self.last_rules = [(n, "skipped (suspect loss)", w) for n, _, w in self.last_rules]
            return []
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
                pending = engine.pending_loss()  # (comparable losses only)
                if pending is not None:
                    watch(engine, beta, pending[0], pending[1], _Labels(engine))
                engine.step(beta)
            self.gaussians.step(groups, lambda control: (beta, None))
        for p in owned:  # consumed by the steps (SVI then has no gradient of theirs to zero)
            p.grad = None
        reducers = {id(r): r for r in (e.reducer for e in engines.values()) if r}
        for reducer in reducers.values():  # data-parallel: the full-data gradients
            reducer.status()  # every rank's step ends here: a failure anywhere is seen by all
            reducer.reduce_grads(others)
        others = [p for p in others if p.grad is not None]
        if others:
            super().__call__(others, *args, **kwargs)
        for p in others:  # consumed: an interrupt before SVI zeroes them must not leak them
            p.grad = None
        return list(engines.values())

    def _infinite_gradients(self, groups: List[Any], others: List[torch.Tensor]) -> Optional[str]:
        """``None`` where every gradient of the Gaussians' and the other parameters is finite;
        else what is not (the step is skipped; the ``SUSPECTS``-th such step in a row raises
        :class:`~pyro_cvi.DivergenceError`, the guide as it was)."""
        store = pyro.get_param_store()
        raw = store.get_state()["params"]  # (name -> unconstrained tensor)
        named = [(n, raw[n]) for g in groups for _, n in g.names if n in raw]
        named += [(store.param_name(p) or "a parameter", p) for p in others]
        grads = [(n, p.grad) for n, p in named if p.grad is not None]
        if not grads or _all_finite([g for _, g in grads]):
            self.infinite_steps = 0
            return None
        bad = sorted({n for n, g in grads if not bool(torch.isfinite(g).all())})
        self.infinite_steps += 1
        if self.infinite_steps >= SUSPECTS:
            self.infinite_steps = 0
            raise DivergenceError(
                f"CVI(): the gradients of {bad} were not finite {SUSPECTS} steps in a row (a q "
                "whose draws overflow the model's log density, or reach the edge of a support "
                "in float32: a Dirichlet's or a Gamma's coordinate drawn past the dtype's "
                "range); those steps were skipped and the guide keeps its q. Fixes: the "
                "adaptive CVI() instead of a fixed step_size (or a smaller one), more particles "
                "in the ELBO, or float64."
            )
        return f"the gradients of {bad} are not finite"

    def owns(self, leaves: FrozenSet[int]) -> bool:
        """Whether a parameter the last step of this optimizer moved is among ``leaves`` (the
        ids of raw parameters; :mod:`pyro_cvi.natgrad.observe`)."""
        return any(id(raw) in leaves for raw, _ in self.gaussians.before)

    def can_undo(self) -> bool:
        """Whether the last step moved Pyro's Gaussians (:meth:`refuse_draw` can undo it)."""
        return bool(self.gaussians.before)

    def refuse_draw(self) -> Optional[str]:
        """The loss drew a latent value outside the model's support
        (:mod:`pyro_cvi.natgrad.observe`): where the last step of this optimizer moved Pyro's
        Gaussians, that step is undone and their step controls start afresh; returns the
        sentence the error adds, or ``None`` where it moved none (AutoCVI alone: its own step
        control handles its losses; the first loss: the initial q) and the loss goes on."""
        if not self.gaussians.before:
            return None
        labels = self.gaussians.undo()
        return (
            f"The last natural-gradient step of the Gaussians {labels} was undone (the guide "
            "holds the q the previous loss evaluated), and their step controls start afresh."
        )

    def _get_optim_args(self, param: Any) -> Dict[str, Any]:
        # (PyroOptim asks once per parameter, when it builds the parameter's torch optimizer)
        if self._gp_rate and param in self.gp_hyperparameters:
            return {"lr": HYPER_LR}
        return cast(Dict[str, Any], super()._get_optim_args(param))

    def explain(self, print_table: bool = True) -> List[Dict[str, str]]:
        """Which parameters the last step moved by natural gradients (and as which family,
        found at which guide site) and which by the inner optimizer; the guide sites left to
        the inner optimizer and why. Returns the rows; prints them as a table unless
        ``print_table=False``."""
        rows = [{"param": n, "rule": r, "where": w} for n, r, w in self.last_rules]
        for site, why in self.gaussians.site_skipped.items():
            rows.append({"param": "", "rule": "inner (site)", "where": f"site {site!r}: {why}"})
        if print_table:
            width = max([len(r["param"]) for r in rows] + [5])
            rule_w = max([len(r["rule"]) for r in rows] + [4])
            print(f"{'param':<{width}}  {'rule':<{rule_w}}  where")
            for r in rows:
                print(f"{r['param']:<{width}}  {r['rule']:<{rule_w}}  {r['where']}")
        return rows

    def _load_gaussian_controls(self) -> None:
        saved = self.saved_controls.pop("__gaussians__", None)
        if saved is not None:
            self.gaussians.load(saved)

    def resume_control(self, engine: Any) -> None:
        """A checkpoint was restored into ``engine``: its adaptive step control is rebuilt
        now, so the first loss after the restore is checked as in the uninterrupted run."""
        saved = self.saved_controls.pop(engine.prefix, None)
        if self.auto and saved is not None:
            self.engines[id(engine)] = weakref.ref(engine)
            engine.enable_control(self.max_step_size, saved)

    def get_state(self) -> Dict[str, Any]:
        store = pyro.get_param_store()
        for p in [p for p in self.optim_objs if store.param_name(p) is None]:
            self.optim_objs.pop(p)  # replaced in the store (a checkpoint restored over it)
        state = super().get_state()
        state["__cvi__"] = {"t": self.t}
        controls = {e.prefix: e.control.state() for e in self._live() if e.control is not None}
        if self.gaussians.controls:
            controls["__gaussians__"] = self.gaussians.state()
        if controls:
            state["__cvi__"]["control"] = controls
        return state

    def set_state(self, state_dict: Dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        cvi = state_dict.pop("__cvi__", None)
        if cvi is not None:
            self.t = int(cvi["t"])
            self.saved_controls = dict(cvi.get("control", {}))
        self.optim_objs.clear()  # the restored parameters get their optimizers afresh,
        self.grad_clip.clear()  # from the state set here
        super().set_state(state_dict)


class _Labels:
    """An engine's step labels as text, formatted only where a warning prints them."""

    __slots__ = ("engine",)

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __str__(self) -> str:
        return str(self.engine.step_labels())

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def _all_finite(tensors: List[torch.Tensor]) -> bool:
    """Whether every entry of ``tensors`` is finite (one pass where they concatenate)."""
    try:
        return bool(torch.isfinite(torch.cat([t.reshape(-1) for t in tensors])).all())
    except RuntimeError:  # (devices that do not concatenate)
        return all(bool(torch.isfinite(t).all()) for t in tensors)


def _ceiling(max_beta: float) -> Callable[[Any], Tuple[float, float]]:
    def beta_of(control: Any) -> Tuple[float, float]:
        control.ceiling = max_beta
        b_prec, b_mean = control.step_sizes()
        return float(b_prec), float(b_mean)

    return beta_of


def _rules(
    engines: Iterable[Any],
    groups: List[Any],
    others: List[torch.Tensor],
    gp: Optional[GPHyperparameters] = None,
) -> List[Tuple[str, str, str]]:
    store = pyro.get_param_store()
    rows = []
    for engine in engines:
        rows.append((str(getattr(engine, "prefix", "AutoCVI")), "AutoCVI", "CVI_ELBO"))
    for g in groups:
        where = f"site {g.site!r}" if g.site else "by name"
        for role, name in g.names:
            rows.append((name, f"natural gradient ({g.family} {role})", where))
    for p in others:
        name = store.param_name(p)
        label = name if name is not None else f"<tensor {tuple(p.shape)}>"
        if gp is not None and p in gp:
            rows.append((label, f"inner (lr {HYPER_LR:g})", "pyro.contrib.gp hyperparameter"))
        else:
            rows.append((label, "inner", ""))
    return rows
