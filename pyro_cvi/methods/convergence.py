"""Whether a stochastic fit has stopped improving beyond its noise, from its reported losses.

Each loss ``l_t`` that ``svi.step`` returns is a noisy estimate of the bound of the current
``q``. Over the most recent ``K`` losses (the later half of the history, at most ``window``),
the least-squares slope ``b`` and its standard error ``se(b) = sigma / sqrt(sum_t (t -
tbar)^2)`` (``sigma``: the residual standard deviation) give the decrease still to come over
the next ``K`` steps, were the trend to go on, and an upper confidence bound on it::

    D = -b K,        D_up = max(D, 0) + z se(b) K

The fit has converged when ``D_up <= tol``, ``tol = max(atol, rtol |mean l|)``: with
confidence about ``Phi(z)`` (a one-sided normal test), ``K`` more steps would gain less than
``tol``. Noise alone never reads as convergence: a short or noisy history has a large
``se(b)`` and says ``False`` until it holds enough losses to resolve ``tol``
(``z sigma sqrt(12 / K) <= tol``), and a rising trend (``D < 0``, often the noise's own
slope) earns no credit against it. The linear fit over a decaying curve's later
half overstates the current slope, so the test errs towards ``False``.

Use it with any optimiser (``CVI()``, Adam)::

    losses = []
    for step in range(max_steps):
        losses.append(svi.step(*args))
        if step % 50 == 0 and converged(losses):
            break
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["ConvergenceReport", "converged", "convergence_report"]


@dataclass(frozen=True)
class ConvergenceReport:
    """The test's numbers: ``decrease`` (``D``, nats over the next ``steps`` steps),
    ``upper`` (``D_up``), ``tol``, ``noise`` (``sigma``, one loss's standard deviation about
    the trend), ``steps`` (``K``) and the verdict ``converged``."""

    converged: bool
    decrease: float
    upper: float
    tol: float
    noise: float
    steps: int


def _check(name: str, value: float, low: float) -> float:
    v = float(value)
    if not (math.isfinite(v) and v >= low):
        raise ValueError(f"converged({name}={value!r}): a finite number >= {low:g}")
    return v


def convergence_report(
    losses: Sequence[float],
    atol: float = 1.0,
    rtol: float = 1e-3,
    z: float = 2.0,
    window: int = 2000,
    min_steps: int = 50,
) -> ConvergenceReport:
    """The slope test of the module docstring over the later half of ``losses`` (at most
    ``window`` of them, at least ``min_steps``; fewer: not converged).

    :param losses: the reported losses, oldest first (floats or 0-d tensors).
    :param atol: the gain (nats) over the next ``K`` steps that is worth the steps.
    :param rtol: the same relative to the losses' magnitude (``tol`` is the larger).
    :param z: the confidence of the upper bound in standard errors.
    :param window: the most losses the test reads.
    :param min_steps: the fewest losses the test reads.
    """
    atol, rtol, z = _check("atol", atol, 0.0), _check("rtol", rtol, 0.0), _check("z", z, 0.0)
    if atol == 0.0 and rtol == 0.0:
        raise ValueError("converged(atol=0, rtol=0): one tolerance must be positive")
    if not (isinstance(window, int) and isinstance(min_steps, int) and 3 <= min_steps <= window):
        raise ValueError(
            f"converged(window={window!r}, min_steps={min_steps!r}): integers with "
            "3 <= min_steps <= window"
        )
    values = [float(v) for v in losses]
    K = min(window, len(values) // 2)
    nan = float("nan")
    if K < min_steps:
        return ConvergenceReport(False, nan, nan, nan, nan, K)
    y = values[-K:]
    if not all(math.isfinite(v) for v in y):
        raise ValueError("converged(losses): the recent losses hold a NaN or an infinity")
    tbar = 0.5 * (K - 1)
    ybar = sum(y) / K
    sxx = sum((t - tbar) ** 2 for t in range(K))
    b = sum((t - tbar) * (v - ybar) for t, v in enumerate(y)) / sxx
    rss = sum((v - ybar - b * (t - tbar)) ** 2 for t, v in enumerate(y))
    sigma = math.sqrt(rss / (K - 2))
    se = sigma / math.sqrt(sxx)
    decrease = -b * K
    upper = max(decrease, 0.0) + z * se * K
    tol = max(atol, rtol * abs(ybar))
    return ConvergenceReport(upper <= tol, decrease, upper, tol, sigma, K)


def converged(
    losses: Sequence[float],
    atol: float = 1.0,
    rtol: float = 1e-3,
    z: float = 2.0,
    window: int = 2000,
    min_steps: int = 50,
) -> bool:
    """Whether the bound has stopped improving beyond its noise: with confidence ``z``
    standard errors, as many more steps as the test read would gain less than ``max(atol,
    rtol |loss|)`` (:func:`convergence_report` for the numbers and the arguments)."""
    return convergence_report(losses, atol, rtol, z, window, min_steps).converged
