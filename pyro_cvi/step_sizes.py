"""Step-size schedules ``beta_t`` for CVI (``t = 1, 2, ...``).

Any callable ``t -> beta_t`` works as ``CVI(step_size=...)``. Convergence of stochastic mirror
descent needs ``sum beta_t = inf`` and ``sum beta_t^2 < inf`` when gradients are noisy
(Robbins-Monro); with exact gradients a constant ``beta`` is fine.
"""

from __future__ import annotations

from typing import Callable, Union

__all__ = ["constant", "paper", "robbins_monro", "as_schedule"]

Schedule = Callable[[int], float]


def constant(beta: float) -> Schedule:
    """``beta_t = beta``."""
    _check(beta)
    return lambda t: beta


def paper(w: float) -> Schedule:
    """The paper's convention (Table 2): ``beta = w / (1 + w)``, constant in ``t``."""
    if w <= 0:
        raise ValueError(f"w must be positive, got {w}")
    return constant(w / (1.0 + w))


def robbins_monro(beta0: float = 1.0, tau: float = 1.0, kappa: float = 0.6) -> Schedule:
    """``beta_t = beta0 * (t + tau) ** -kappa`` with ``0.5 < kappa <= 1`` (Hoffman et al.)."""
    if not 0.5 < kappa <= 1.0:
        raise ValueError(f"kappa must be in (0.5, 1], got {kappa}")
    _check(beta0)
    return lambda t: min(1.0, beta0 * (t + tau) ** (-kappa))


def as_schedule(step_size: Union[float, Schedule]) -> Schedule:
    if callable(step_size):
        return step_size
    try:
        beta = float(step_size)
    except (TypeError, ValueError):
        raise TypeError(
            f"CVI(step_size={step_size!r}): the step size must be 'auto' (the default: "
            "adaptive), a number in (0, 1] or a callable t -> beta_t"
        ) from None
    return constant(beta)


def _check(beta: float) -> None:
    if not 0.0 < beta <= 1.0:
        raise ValueError(
            f"CVI step size must be in (0, 1], got {beta}; beta = 1 jumps to the conjugate "
            "update's fixed point, smaller values average it with the previous sites"
        )
