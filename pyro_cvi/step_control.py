"""Adaptive step control for ``CVI(step_size="auto")`` (the default).

A fixed ``beta`` in eq. 12 is a gamble: ``beta = 1`` is exact in one step for conjugate models
but oscillates or diverges with non-conjugate factors and Monte Carlo messages. The control
makes the step safe, in the spirit of a trust region on the ELBO ``L``:

* **Backtracking.** At every loss evaluation with gradients the new ``L_t`` is compared with
  the last accepted ``L_{t-1}``. The step that led here is *undone* (the CVI parameters are
  restored) and retried with ``beta / 2`` when

  - ``L_t`` is not finite, or the loss raised a numerical error (a singular solve, a
    distribution parameter outside its constraint);
  - ``L_t < L_{t-1} - tol``: with an exact loss (closed forms, quadrature) ``tol`` is
    round-off, so an exact -ELBO never increases over accepted steps; with Monte Carlo terms
    ``tol = z * sqrt(2 v)`` (``z = 2``) with ``v`` the pooled variance of the accepted points'
    estimates (an exponential average over about ``1 / pool`` of them, bias-corrected), so noise
    alone rarely triggers it, while a step into a region where the estimator's variance
    explodes gets no wider tolerance than the accepted points had. One evaluation's own
    variance estimate is too noisy to set it: from ``K`` draws it is ``v chi2_{K-1} / (K - 1)``
    (``K = 4``: below a quarter of ``v`` one time in seven), and a tolerance read from it
    rejected about one step in eight on noise alone (a rate ``z = 2`` puts at 2%), each
    rejection cutting ``beta`` and, through it, the ceiling of blocks with a noise control of
    their own (the remainder's step froze near ``1e-3`` on regressions with a half-normal
    noise scale).

* **Hyperparameters** (hybrid models: the inner optimiser moves the model's ``pyro.param``
  values between two losses): before a drop is blamed on the CVI step, the old ``q`` is
  evaluated at the new hyperparameters; if it is no better than the new ``q``, the drop came
  from the hyperparameter step and the CVI step is kept.

* **Growth.** After an accepted step ``beta`` grows back by ``grow`` (fast for exact losses,
  slowly for Monte Carlo ones) up to the ceiling ``max_beta``.

* **Decay under noise.** With Monte Carlo messages a constant ``beta`` leaves ``q`` jittering
  around the optimum with an amplitude that scales with ``beta``. When the accepted losses
  stop improving beyond their noise (``|L_t - L_{t-1}| < z se`` for ``patience`` steps in a
  row) the ceiling decays as ``max_beta <- max_beta * decay`` (a Robbins-Monro-style decay,
  switched on only once the iterates oscillate), down to ``min_ceiling``.

* **Minibatches** (subsampled plates): losses of different minibatches are not comparable;
  only non-finite losses and errors backtrack, and the ceiling follows the Robbins-Monro
  schedule ``beta0 (1 + t / 10) ** -0.6`` (Hoffman et al. 2013).

**Reporting.** Shrunk, undone and rejected steps are the step policy doing its job: they are
counted on the guide (``guide.num_shrunk``, ``guide.num_rejected``, ``guide.num_backtracks``,
``guide.warning_counts``) and logged once per site and kind (:class:`WarningLog`) to the
``"pyro_cvi"`` logger at INFO, not warned, so that suites which turn warnings into errors
(Pyro's own) run quietly. A site whose step keeps being *rejected* (no step size keeps ``q``
valid, in ``PERSISTENT`` steps of a run: its ``q`` cannot follow the model there) is a
``RuntimeWarning``, once per site.

:func:`controlled_evaluation` is the one backtracking loop (the engine and every other caller
hand it the evaluation, a copy of the parameters and a restore function); :class:`StepControl`
holds the decisions' state.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch

__all__ = [
    "StepControl",
    "Snapshot",
    "controlled_evaluation",
    "is_numerical_error",
    "initial_failure",
    "initial_failures",
    "backtrack_message",
    "ROUTINE",
    "warn_step_counts",
    "WarningLog",
]


@dataclass
class Snapshot:
    """The last accepted point: CVI parameter values, the ELBO there, its MC variance."""

    values: Dict[str, torch.Tensor]
    elbo: float
    var: Optional[float]


@dataclass
class StepControl:
    """The state of the adaptive step size of one engine (see the module docstring)."""

    max_beta: float = 1.0
    start_exact: float = 1.0
    start_mc: float = 0.5
    shrink: float = 0.5
    grow_exact: float = 1.5
    grow_mc: float = 1.1
    z: float = 2.0
    patience: int = 5
    decay: float = 0.8
    min_ceiling: float = 0.1
    min_beta: float = 1e-4
    #: the averaging rate of the pooled variance of the accepted Monte Carlo estimates
    pool: float = 0.2
    #: relative tolerance of an exact loss (default: 100 float64 epsilons, at least 1e-9)
    rel_tol: Optional[float] = None
    beta: Optional[float] = None
    ceiling: Optional[float] = None
    snapshot: Optional[Snapshot] = None
    num_backtracks: int = 0
    t: int = 0
    _flat: int = field(default=0, repr=False)
    _in_row: int = field(default=0, repr=False)
    #: the pooled variance's unnormalised average and its normaliser (bias correction)
    _var_sum: float = field(default=0.0, repr=False)
    _var_w: float = field(default=0.0, repr=False)

    def start(self, stochastic: bool) -> None:
        if self.beta is None:
            self.ceiling = self.max_beta
            self.beta = min(self.max_beta, self.start_mc if stochastic else self.start_exact)

    def step_size(self, minibatch: bool) -> float:
        """The ``beta`` for the next step."""
        self.t += 1
        beta = float(self.beta)
        if minibatch:
            beta = min(beta, self.max_beta * (1.0 + self.t / 10.0) ** -0.6)
        return beta

    def tolerance(self, elbo: float, var: Optional[float]) -> float:
        """How far below the last accepted ELBO a new one may fall and still be accepted."""
        prev = self.snapshot
        rel = self.rel_tol
        if rel is None:
            rel = max(1e-9, 100.0 * torch.finfo(torch.float64).eps)
        tol = rel * max(1.0, abs(prev.elbo))
        if var is not None or prev.var is not None:
            pooled = self.pooled_var()
            if pooled is not None:
                # the new point's variance counts as the accepted points': a step into a
                # region where the estimator explodes must not buy itself a wider tolerance
                return tol + self.z * math.sqrt(2.0 * pooled)
            v_prev = prev.var or 0.0
            v_new = v_prev if var is None else min(var, v_prev if prev.var is not None else var)
            tol += self.z * math.sqrt(v_new + v_prev)
        return tol

    def pooled_var(self) -> Optional[float]:
        """The pooled variance of the accepted points' Monte Carlo estimates, or ``None``."""
        return self._var_sum / self._var_w if self._var_w > 0 else None

    def _pool(self, var: Optional[float]) -> None:
        if var is not None and math.isfinite(var) and var >= 0:
            self._var_sum = (1.0 - self.pool) * self._var_sum + self.pool * var
            self._var_w = (1.0 - self.pool) * self._var_w + self.pool

    def accepts(self, elbo: float, var: Optional[float], comparable: bool) -> bool:
        """Whether the point just evaluated is kept (``False``: undo the last step)."""
        if not math.isfinite(elbo):
            return False
        if self.snapshot is None:
            return True
        if exploded(elbo, self.snapshot.elbo):  # whatever the noise estimate or minibatch says
            return False
        if not comparable:
            return True
        return elbo >= self.snapshot.elbo - self.tolerance(elbo, var)

    def accepted(self, snapshot: Snapshot, comparable: bool) -> None:
        """Record an accepted point and grow ``beta`` (and decay the ceiling under noise)."""
        prev, stochastic = self.snapshot, snapshot.var is not None
        if comparable:
            self._pool(snapshot.var)
        if prev is not None and comparable and stochastic:
            noise = self.z * math.sqrt(snapshot.var + (prev.var or 0.0))
            self._flat = self._flat + 1 if abs(snapshot.elbo - prev.elbo) < noise else 0
            if self._flat >= self.patience:
                self.ceiling = max(self.min_ceiling, self.ceiling * self.decay)
                self._flat = 0
        self.snapshot, self._in_row = snapshot, 0
        grow = self.grow_mc if stochastic else self.grow_exact
        self.beta = min(self.ceiling, self.beta * grow)

    def rejected(self, numerical: bool = False) -> float:
        """Shrink ``beta`` after an undone step; returns the new value. Under Monte Carlo noise
        the first worse estimate after an accepted step halves ``beta`` no lower than the
        floor ``min_ceiling`` (it may be noise); a second one in a row, or a numerical
        failure, halves it below."""
        self.num_backtracks += 1
        self._in_row += 1
        noisy = self.snapshot is not None and self.snapshot.var is not None
        beta = self.beta * self.shrink
        if noisy and not numerical and self._in_row == 1:
            beta = max(beta, min(self.beta, self.min_ceiling))
        self.beta = max(self.min_beta, beta)
        if noisy:
            self.ceiling = max(self.min_ceiling, min(self.ceiling, 2.0 * self.beta))
        return self.beta

    def reevaluated(self, elbo: float, var: Optional[float]) -> None:
        """A fresh evaluation at the restored point replaces the stored Monte Carlo one: the
        stored value was *selected* (accepted because it was high), and comparing against it
        would reject ever more good steps (the winner's curse)."""
        snap = self.snapshot
        if snap is not None and snap.var is not None and var is not None and math.isfinite(elbo):
            self.snapshot = Snapshot(snap.values, elbo, var)

    def state(self) -> Dict:
        """Everything an exact resume needs (for :mod:`pyro_cvi.checkpoints.checkpoint`)."""
        keys = ("beta", "ceiling", "t", "num_backtracks", "_flat", "_in_row", "_var_sum", "_var_w")
        out = {k: getattr(self, k) for k in keys}
        snap = self.snapshot
        out["snapshot"] = None if snap is None else (dict(snap.values), snap.elbo, snap.var)
        return out

    def load(self, state: Dict) -> None:
        for k, v in state.items():
            if k != "snapshot":
                setattr(self, k, v)
        snap = state.get("snapshot")
        self.snapshot = None if snap is None else Snapshot(*snap)


def controlled_evaluation(
    control: StepControl,
    evaluate: Callable[[], Tuple[torch.Tensor, Optional[float]]],
    values: Callable[[], Dict[str, torch.Tensor]],
    restore: Callable[[Dict[str, torch.Tensor]], None],
    comparable: bool,
    hybrid: bool,
    warn: Callable[[float, Optional[BaseException]], None],
    decision: Optional[Callable[[torch.Tensor], float]] = None,
) -> torch.Tensor:
    """The loss with backtracking (the module docstring): a point worse than the last accepted
    one (beyond its noise), non-finite, or numerically invalid is undone: the parameters are
    restored, re-evaluated, and ``beta`` is halved.

    :param evaluate: ``() -> (ELBO tensor, its Monte Carlo variance or None)`` at the current
        parameters (it also leaves the step's natural gradients in ``.grad``).
    :param values: ``() -> {name: tensor}``, a copy of the CVI parameters.
    :param restore: puts such a copy back.
    :param comparable: losses of successive steps are comparable (no minibatches).
    :param hybrid: the model has hyperparameters that another optimiser moves.
    :param warn: ``(new beta, error or None) -> None``, told about an undone step.
    :param decision: ``elbo -> float``, the value the decisions read (default: ``elbo``'s):
        where the reported loss holds an estimate independent of the step's draws, the
        decision reads the step's own estimate, so that accepting high estimates never
        selects (biases) the reported one.
    """
    value_of = decision if decision is not None else (lambda e: float(e.detach()))
    try:
        elbo, var = evaluate()
        value = value_of(elbo)
        ok, error = control.accepts(value, var, comparable), None
    except (ValueError, RuntimeError, FloatingPointError) as e:
        if not is_numerical_error(e):
            raise
        ok, error, value, var = False, e, float("nan"), None
    if ok:
        control.accepted(Snapshot(values(), value, var), comparable)
        return elbo
    if control.snapshot is None:
        raise initial_failure(error)
    new = values()
    restore(control.snapshot.values)
    elbo, old_var = evaluate()
    if error is None and hybrid and comparable:
        # hybrid: the hyperparameters moved too (the inner optimiser's step). If the old q is
        # no better than the new one at the new hyperparameters, the drop is theirs: keep the
        # CVI step (the loss reported is then the new point's, recomputed)
        if value >= value_of(elbo) - control.tolerance(value, var):
            restore(new)
            elbo, new_var = evaluate()
            control.accepted(Snapshot(new, value_of(elbo), new_var), comparable)
            return elbo
    warn(control.rejected(numerical=error is not None), error)
    control.reevaluated(value_of(elbo), old_var)
    return elbo


def is_numerical_error(e: BaseException) -> bool:
    """A failure caused by an invalid point of ``q`` (too long a step), not by bad input: a
    singular or non-positive-definite linear solve, or a distribution parameter outside its
    constraint (``validate_args``)."""
    if isinstance(e, (torch.linalg.LinAlgError, FloatingPointError)):
        return True
    text = str(e)
    return isinstance(e, (ValueError, RuntimeError)) and (
        "to satisfy the constraint" in text
        or "singular" in text
        or "positive-definite" in text
        or "not positive definite" in text
    )


def initial_failure(error: Optional[BaseException]) -> ValueError:
    """The error for a model that fails (or has a non-finite ELBO) at the initial ``q``, before
    any CVI step: no step size can fix that, the model, its data or the start of ``q`` must."""
    why = f" ({str(error).splitlines()[0][:200]})" if error is not None else ""
    return ValueError(
        f"AutoCVI: the ELBO of the initial q is not finite or cannot be evaluated{why}. Before "
        "any CVI step this is not a step-size problem: check the model's priors, parameters and "
        "data, or start q elsewhere with AutoCVI(init_loc_fn=...)."
    )


@contextlib.contextmanager
def initial_failures():
    """Numerical failures of the model at the start (a prior draw, ``init_loc_fn``'s values)
    become :func:`initial_failure`."""
    try:
        yield
    except (ValueError, RuntimeError) as e:
        if not is_numerical_error(e) or str(e).startswith("AutoCVI"):
            raise
        raise initial_failure(e) from e


#: the ``"pyro_cvi"`` logger: routine step-policy events (shrunk and undone steps)
LOGGER = logging.getLogger("pyro_cvi")
#: the kinds of :class:`WarningLog` that are routine (logged at INFO, not warned)
ROUTINE = frozenset({"step shrunk", "step undone", "step undone (numerical)", "step rejected"})
#: steps of a run in which a site's step was rejected before that is warned about
PERSISTENT = 100


class WarningLog:
    """One warning per ``(site, kind)`` per run (a guide's lifetime), however many steps repeat
    it: the first occurrence is shown, every occurrence is counted (``counts``, shown on the
    guide as ``guide.warning_counts``). Python's own once-per-text filter cannot do this, as
    the texts carry the step size, which changes from step to step."""

    def __init__(self) -> None:
        self.counts: Dict[tuple, int] = {}

    def warn(self, site, kind: str, message: str, stacklevel: int = 2) -> None:
        key = (str(site), kind)
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.counts[key] == 1:
            text = message + " (shown once per site and kind; see guide.warning_counts)"
            if kind in ROUTINE:  # the step policy doing its job: logged, not warned
                LOGGER.info(text)
            else:
                warnings.warn(text, RuntimeWarning, stacklevel=stacklevel + 1)


def backtrack_message(labels, beta: float, error: Optional[BaseException]) -> str:
    """The report of an undone step: which sites, why, the new step, and what to do."""
    why = "a numerical failure" if error is not None else "a worse ELBO"
    return (
        f"AutoCVI: a CVI step on sites {labels} led to {why}; it was undone and is retried "
        f"with a smaller step size (now {beta:.3g}; counted in guide.num_backtracks). If "
        "this repeats, raise num_general_samples (Monte Carlo noise) or cap the step with "
        "CVI(max_step_size=...)."
    )


def warn_step_counts(
    label: str, what: str, beta: float, counts, stacklevel: int, log: Optional[WarningLog] = None
) -> None:
    """Warn about shrunk and rejected steps, once per site and kind when ``log`` is given (the
    counts of elements are ``guide.num_shrunk`` / ``guide.num_rejected``)."""
    log = log if log is not None else WarningLog()
    if counts.shrunk:
        log.warn(
            label,
            "step shrunk",
            f"AutoCVI: step on site {label!r} shrunk from {beta:g} to keep the {what} "
            "natural parameters valid (counted in guide.num_shrunk)",
            stacklevel=stacklevel,
        )
    if counts.rejected:
        why = (
            f"no step size keeps the {what} natural parameters valid (counted in "
            "guide.num_rejected), so the step's target itself is invalid and a smaller step "
            "size does not help. Causes: Monte Carlo noise (raise num_samples or "
            "num_general_samples), or a likelihood that overflows at q (a prior far wider than "
            "the data's scale: start q at the data, init_sites='laplace', or narrow the prior)."
        )
        log.warn(
            label,
            "step rejected",
            f"AutoCVI: step on site {label!r} rejected for some elements: {why}",
            stacklevel=stacklevel,
        )
        if log.counts[(str(label), "step rejected")] == PERSISTENT:
            log.warn(
                label,
                "step rejected repeatedly",
                f"AutoCVI: step on site {label!r} rejected for some elements in {PERSISTENT} "
                f"steps of this run: q cannot follow the model there; {why}",
                stacklevel=stacklevel,
            )


def exploded(elbo: float, best: float) -> bool:
    """Whether an ELBO fell by orders of magnitude below ``best`` (:mod:`pyro_cvi.divergence`): a
    divergent point, not Monte Carlo noise, whose variance estimate there is as huge."""
    from .divergence import FLOOR, GROWTH

    return elbo < best - GROWTH * max(abs(best), FLOOR)
