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
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections import deque
from typing import Optional

__all__ = ["Monitor", "watch"]

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


def watch(engine, beta: float, elbo: Optional[float], var: Optional[float], label: str) -> None:
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
