"""No silent divergence: a fixed CVI step size that oscillates or diverges is detected.

With a fixed ``beta`` (``CVI(step_size=b)``) nothing undoes a step that makes ``q`` worse: a
step that is too long for a non-conjugate factor makes the iterates cycle (logistic regression
with ``D = 2000``, ``N = 30`` at ``beta = 1`` alternates between -ELBOs of 50.7 and 543.6) or
drift away, while every single step looks valid. The :class:`Monitor` watches the ELBO of the
step's starting point (the loss's value) and counts the steps that fall below the best ELBO
seen so far by more than a tolerance: ``rtol |L_best|``, ``frac (L_best - L_1)`` (a share of
the progress made since the first step) and ``z`` standard errors of Monte Carlo terms, the
largest of the three. A converging run never does that (an exact ELBO under a good step only
rises); a run at a noisy fixed point (Monte Carlo gradients) jitters by far less than the
progress it made, while a cycling one falls back by a large part of it. When ``min_drops``
of the last ``window`` steps are such drops, or the ELBO is not finite, one
``RuntimeWarning`` per guide says so and advises the adaptive ``CVI()``, which undoes and
shrinks such steps. Minibatch losses are not comparable between steps and are not watched.

**Divergence under any step** (:func:`check_loss`, every training loss of an
:class:`~pyro_cvi.AutoCVI` guide, whatever the step size). The loss is the -ELBO ``F_t`` of the
current ``q_t``; the lowest so far, ``F_best``, is kept with a clone of its ``q``'s CVI
parameters. A loss is divergent when::

    F_t is not finite,   or   F_t > F_best + growth * max(|F_best|, floor)

(``growth = 1000``: three orders of magnitude above the best bound's scale, far beyond Monte
Carlo noise or the transient overshoot of a long fixed step, which recovers). Then
:class:`DivergenceError` names the sites, both values and what to do; the step's transaction
is rolled back and the guide put back to its best ``q`` (cached solves and the adaptive step
control start afresh), so the next ``svi.step`` continues from there. A first loss that is not
finite has no best ``q``: the step is undone and the error says the initial ``q`` is invalid.

**No progress** (:class:`Progress`, the same losses; not under minibatches, whose losses are
not comparable). A fit whose ``q`` starts far from the posterior can also stall without
diverging: every step lands on a loss no better than the start's, beyond a noise that the far-off
``q`` makes enormous, so the step control shrinks the steps it reads as failures and ``q``
stays where it started. Every ``tail`` steps from
``2 tail``, with ``l_0`` the median of the ``tail`` losses before the last ``tail``, ``l_r`` and
``s_r`` the median and the scaled median absolute deviation (``1.4826 MAD``) of the last
``tail``, a check finds the fit stalled when::

    l_0 - l_r < s_r    and    s_r > max(noise_floor, noise_rtol |l_r|)

(it gained less than one loss's spread over the last ``tail`` steps, and that spread is far
beyond a fit near its optimum, where ``log p - log q`` varies by a few nats). The fit has
stalled when ``runs`` checks in a row find it so: a one-draw fit on a large data set (a network
on thousands of points) has stretches of 50 steps whose losses spread by 10-40% of the loss and
gain nothing while the bound still falls over hundreds of steps; a ``q`` stuck far off stays so
(a cumsum chain in the remainder: a spread of 30-80% of the loss at every check). One
``RuntimeWarning`` per guide names the sites and what to do.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Dict, Optional

import pyro
import torch

__all__ = ["DivergenceError", "Monitor", "Progress", "check_loss", "watch"]

_MONITORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Monitor:
    """The drop counter of one engine under a fixed step (see the module docstring)."""

    def __init__(self, window: int = 20, min_drops: int = 5, rtol=1e-3, frac=0.05, z: float = 3.0):
        self.window, self.min_drops, self.rtol, self.frac, self.z = window, min_drops, rtol, frac, z
        self.first: Optional[float] = None
        self.best: Optional[float] = None
        self.best_var = 0.0
        self.drops: deque = deque(maxlen=window)
        self.warned = False
        self.low: Optional[float] = None
        self.high: Optional[float] = None

    def record(self, elbo: float, var: Optional[float]) -> Optional[str]:
        """Record the ELBO of a step's starting point; returns the warning's reason, once."""
        if self.warned:
            return None
        if not math.isfinite(elbo):
            return self._warn(f"the ELBO became {elbo}")
        var = var or 0.0
        self.first = elbo if self.first is None else self.first
        if self.best is None or elbo > self.best:
            self.best, self.best_var = elbo, var
            self.drops.append(False)
        else:
            tol = max(
                self.rtol * max(1.0, abs(self.best)),
                self.frac * (self.best - self.first),
                self.z * math.sqrt(var + self.best_var),
            )
            self.drops.append(elbo < self.best - tol)
        recent = self.low is None
        self.low = elbo if recent else min(self.low, elbo)
        self.high = elbo if recent else max(self.high, elbo)
        if sum(self.drops) >= self.min_drops:
            return self._warn(
                f"{sum(self.drops)} of the last {len(self.drops)} steps ended below the best "
                f"ELBO so far (the -ELBO ranged over [{-self.high:.6g}, {-self.low:.6g}])"
            )
        return None

    def _warn(self, reason: str) -> str:
        self.warned = True
        return reason


def watch(engine, beta: float, elbo: Optional[float], var: Optional[float], label: object) -> None:
    """Feed the step's ELBO to the engine's monitor; warn once if it oscillates or diverges."""
    if elbo is None:
        return
    monitor = _MONITORS.get(engine)
    if monitor is None:
        monitor = _MONITORS[engine] = Monitor()
    reason = monitor.record(float(elbo), var)
    if reason is not None:
        warnings.warn(
            f"AutoCVI: the fixed step size {beta:g} does not converge on sites {label}: "
            f"{reason}. The steps are too long for the model's non-conjugate factors. Use the "
            "adaptive CVI() (step_size='auto'), which undoes and shrinks such steps, or a "
            "smaller step_size.",
            RuntimeWarning,
            stacklevel=4,
        )


# ------------------------------------------------------------------ divergence under any step
GROWTH = 1000.0
FLOOR = 10.0


class DivergenceError(ValueError):
    """The fit diverged: a non-finite loss, or one orders of magnitude above the best so far.
    The guide holds its best ``q`` when this is raised."""


@dataclass
class Progress:
    """The no-progress test of the module docstring over one guide's training losses."""

    tail: int = 50
    noise_floor: float = 100.0
    noise_rtol: float = 0.15
    runs: int = 3
    recent: deque = field(default_factory=deque)
    seen: int = 0
    stalled: int = 0
    warned: bool = False

    def record(self, loss: float) -> Optional[str]:
        """Record a finite loss; the warning's reason, once, when the fit has stalled."""
        if self.warned or not math.isfinite(loss):
            return None
        self.seen += 1
        self.recent.append(loss)
        if len(self.recent) > 2 * self.tail:
            self.recent.popleft()
        if self.seen < 2 * self.tail or self.seen % self.tail:
            return None
        values = list(self.recent)
        before, tail = values[: self.tail], values[self.tail :]
        start, now = median(before), median(tail)
        spread = 1.4826 * median([abs(v - now) for v in tail])
        if not (
            start - now < spread and spread > max(self.noise_floor, self.noise_rtol * abs(now))
        ):
            self.stalled = 0
            return None
        self.stalled += 1
        if self.stalled >= self.runs:
            self.warned = True
            return (
                f"the -ELBO's median over the last {len(tail)} steps is {now:.6g}, against "
                f"{start:.6g} over the {len(before)} before, and it spreads by {spread:.3g} "
                "from one step to the next (a fit near its optimum varies by a few nats); "
                f"no gain beyond that spread at {self.runs} checks in a row, {self.tail} steps "
                "apart"
            )
        return None


@dataclass
class _Best:
    loss: float = math.inf
    step: int = 0
    values: Dict[str, torch.Tensor] = field(default_factory=dict)
    seen: int = 0
    progress: Progress = field(default_factory=Progress)


_BEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _values(engine) -> Dict[str, torch.Tensor]:
    store = pyro.get_param_store()  # (read directly: no effect handler, as a snapshot)
    return {n: store[n].unconstrained().detach().clone() for n in engine.param_names()}


def _back_to(engine, values: Dict[str, torch.Tensor]):
    """The action run after the step's rollback: the best ``q``, caches and control afresh."""

    def restore() -> None:
        with torch.no_grad():
            for n, v in values.items():
                pyro.param(n).unconstrained().copy_(v)
        engine.invalidate()

    return restore


def _stalled(engine, steps: int, reason: Optional[str]) -> None:
    if reason is None:
        return
    labels = [label for b in engine.blocks for label in b.labels]
    warnings.warn(
        f"AutoCVI: the fit has made no progress by step {steps} on sites {labels}: "
        f"{reason}. q is stuck far from the posterior: its steps land on losses no better "
        "beyond that noise, and the step control shrinks them. Fixes: where "
        "Normal latents reach the data linearly (through cumulative sums), name them "
        "AutoCVI(families={site: 'gaussian'}) (one exact dense block, O(D^3) a step) or write "
        "the chain with pyro.markov or one cumsum (the exact Kalman block); else the full "
        "covariance with exact curvature from a small initial scale "
        "(AutoCVI(remainder=Remainder(covariance='full', curvature='hessian', "
        "init_scale=1e-3))). guide.explain() shows each site's block.",
        RuntimeWarning,
        stacklevel=6,
    )


def check_loss(engine, loss: float) -> None:
    """Record the training loss (the -ELBO) of ``engine``'s current ``q``; raise
    :class:`DivergenceError` if it diverged (see the module docstring). Called inside the
    step's transaction: the error rolls the step back, then restores the best ``q``."""
    best = _BEST.get(engine)
    if best is None:
        best = _BEST[engine] = _Best()
    best.seen += 1
    if not getattr(engine, "minibatch", False):
        _stalled(engine, best.seen, best.progress.record(loss))
    if math.isfinite(loss) and loss <= best.loss:
        best.loss, best.step, best.values = loss, best.seen, _values(engine)
        return
    if math.isfinite(loss) and loss <= best.loss + GROWTH * max(abs(best.loss), FLOOR):
        return
    labels = [label for b in engine.blocks for label in b.labels]
    if not math.isfinite(best.loss):  # no finite loss yet: no q to go back to
        best.seen -= 1
        raise DivergenceError(
            f"AutoCVI: the -ELBO of the initial q is {loss} on sites {labels}: it cannot be "
            "fitted from there. Check the model at the prior's scale (a prior far wider than the "
            "data's scale makes exp(...) or a likelihood overflow), start q at the data "
            "(init_sites='laplace', the default; init_loc_fn=...), or use float64."
        )
    what = "is not finite" if not math.isfinite(loss) else "grew by orders of magnitude"
    error = DivergenceError(
        f"AutoCVI: the fit diverged on sites {labels}: the -ELBO {what} ({loss:.6g} at step "
        f"{best.seen}; the best so far was {best.loss:.6g}, at step {best.step}). The guide was "
        "rolled back to that best q, and the next svi.step continues from it. Fixes: the "
        "adaptive CVI() instead of a fixed step_size (or a smaller one), more Monte Carlo "
        "samples (AutoCVI(num_samples=..., num_general_samples=...)), a lower learning rate "
        "for the model's pyro.param hyperparameters (CVI(optim_args={'lr': ...})), or float64."
    )
    error.after_rollback = _back_to(engine, best.values)
    raise error
