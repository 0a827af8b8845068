"""The guide's own bound check: is the loss it reports the -ELBO of the ``q`` it samples?

A CVI guide reports ``L = -ELBO(q)`` computed from its messages (closed forms, quadrature, its
own Monte Carlo). A wrong classification of a factor, a term left out or counted twice, or a
``q`` that samples something else than it scores all show up the same way: ``L`` differs from

    L_hat = -(1/N) sum_i [log p(x, z_i) - log q(z_i)],   z_i ~ q as Pyro samples the guide,

the plain Monte Carlo estimate of the same bound (``pyro.infer.Trace_ELBO`` over the guide
itself, eq. 3 of Khan & Lin 2017 with the expectation sampled). :func:`check_bound` computes
both, with the standard error of each (``L``'s from repeated evaluations where it is itself an
estimate, ``L_hat``'s from ``M`` independent batches of ``P`` draws), and warns with
:class:`BoundMismatchWarning` when ``|L - L_hat| > tolerance * sqrt(se_L^2 + se_hat^2)``.

The check runs the guide and the model with the random state saved and restored, inside
``poutine.block`` (an outer trace sees nothing) and with ``torch.no_grad``: it changes neither
``q`` nor what the user's program draws next.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import pyro.poutine as poutine
import torch
from pyro.infer import Trace_ELBO, TraceEnum_ELBO, config_enumerate

_Fn = Callable[..., Any]  # a Pyro model or guide

__all__ = [
    "BoundCheck",
    "BoundChecked",
    "BoundMismatchWarning",
    "check_bound",
    "DEFAULT_PARTICLES",
]

#: Trace_ELBO draws of ``check_bound`` by default
DEFAULT_PARTICLES = 2000
#: draws per batch (the standard error comes from the spread of the batch means)
BATCH = 50
#: repeated evaluations of the reported loss when it is itself a Monte Carlo estimate
REPEATS = 8


class BoundMismatchWarning(UserWarning):
    """The loss a CVI guide reports is not the -ELBO of the ``q`` it samples (within the
    tolerance in standard errors): a silent wrong answer somewhere in its messages."""


@dataclass(frozen=True)
class BoundCheck:
    """The result of :func:`check_bound`.

    :param reported: the guide's loss (the mean of its repeats, where it is an estimate).
    :param estimate: Trace_ELBO's estimate of the same ``q``'s -ELBO.
    :param se: the combined standard error of ``reported - estimate``.
    :param agrees: ``|reported - estimate| <= tolerance * se`` (``se`` floored at a float's
        resolution of the values).
    :param reported_se: the reported loss's own standard error (0: it is exact).
    :param num_particles: Trace_ELBO draws used.
    """

    reported: float
    estimate: float
    se: float
    agrees: bool
    reported_se: float = 0.0
    num_particles: int = 0
    tolerance: float = 3.0

    @property
    def z(self) -> float:
        """``(reported - estimate) / se`` (``inf`` when they differ and ``se`` is 0)."""
        d = self.reported - self.estimate
        if self.se > 0:
            return d / self.se
        return 0.0 if d == 0 else math.copysign(math.inf, d)

    def __str__(self) -> str:
        verdict = "agrees" if self.agrees else "DISAGREES"
        return (
            f"reported -ELBO {self.reported:.6g} (se {self.reported_se:.3g}) vs Trace_ELBO "
            f"{self.estimate:.6g} ({self.num_particles} draws), se {self.se:.3g}, "
            f"z = {self.z:.2f}: {verdict}"
        )


def _rng_state() -> Tuple[Any, ...]:
    import random

    import numpy as np

    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _set_rng_state(state: Tuple[Any, ...]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state[0])
    random.setstate(state[1])
    np.random.set_state(state[2])


def _mean_se(values: torch.Tensor) -> Tuple[float, float]:
    n = values.numel()
    mean = float(values.mean())
    se = float(values.std() / math.sqrt(n)) if n > 1 else 0.0
    return mean, se


def _batch(num_particles: int) -> int:
    """Draws per batch: at most :data:`BATCH`, and at least 20 batches (a standard error from
    fewer is itself too noisy to test against)."""
    return max(1, min(BATCH, num_particles // 20))


def _trace_elbo_batches(
    model: _Fn,
    guide: _Fn,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    num_particles: int,
    enum_plates: Optional[int] = None,
    vectorize: bool = False,
) -> torch.Tensor:
    """Trace_ELBO's -ELBO estimates, one per batch of ``_batch`` draws (one draw at a
    time, or with ``vectorize`` under a particle plate, falling back to one at a time where the
    model cannot run so). With ``enum_plates`` (the model's plate nesting), ``TraceEnum_ELBO``
    with every discrete site the guide does not sample summed out in parallel."""
    batch = _batch(num_particles)
    num_batches = max(2, math.ceil(num_particles / batch))

    def make(vectorise: bool) -> Any:
        if enum_plates is None:
            return Trace_ELBO(num_particles=batch, vectorize_particles=vectorise)
        return TraceEnum_ELBO(
            num_particles=batch,
            vectorize_particles=vectorise,
            max_plate_nesting=enum_plates,
            strict_enumeration_warning=False,
        )

    if enum_plates is not None:
        model = config_enumerate(model, default="parallel")
    out = []
    # one instance each: the plate nesting Pyro guesses on the first call is kept
    elbo = make(vectorize)
    for _ in range(num_batches):
        if elbo.vectorize_particles:
            try:
                out.append(elbo.loss(model, guide, *args, **kwargs))
                continue
            except Exception:  # a model that cannot run under a particle plate
                elbo = make(False)
        out.append(elbo.loss(model, guide, *args, **kwargs))
    return torch.tensor(out, dtype=torch.float64)


def _reported(
    loss: Callable[[], float],
    monte_carlo: Optional[Callable[[], bool]] = None,
    num_particles: int = DEFAULT_PARTICLES,
) -> Tuple[float, float]:
    """The reported loss and its standard error. Where the guide says its loss is a Monte
    Carlo estimate (``monte_carlo()``, asked after the first evaluation), one evaluation per
    :data:`BATCH` of the referee's draws (at least :data:`REPEATS`): a few draws per loss can
    all miss a rare, costly region of ``q`` (a step of ``round(z)`` in its tail), and two equal
    values then say nothing. Otherwise two evaluations under different random states; equal,
    it is exact (se 0), else :data:`REPEATS` of them."""
    first = loss()
    if monte_carlo is not None and monte_carlo():
        n = max(REPEATS, math.ceil(num_particles / BATCH))
        return _mean_se(torch.tensor([first] + [loss() for _ in range(n - 1)], dtype=torch.float64))
    second = loss()
    if first == second:
        return first, 0.0
    values = torch.tensor(
        [first, second] + [loss() for _ in range(REPEATS - 2)], dtype=torch.float64
    )
    return _mean_se(values)


def check_bound(
    model: _Fn,
    guide: Any,
    reported_loss: Callable[[], float],
    args: Tuple[Any, ...] = (),
    kwargs: Optional[Dict[str, Any]] = None,
    num_particles: int = DEFAULT_PARTICLES,
    tolerance: float = 3.0,
    warn: bool = True,
    label: Optional[str] = None,
    enum_plates: Optional[Callable[[], Optional[int]]] = None,
    vectorize: bool = False,
    monte_carlo: Optional[Callable[[], bool]] = None,
) -> BoundCheck:
    """Compare ``reported_loss()`` with Trace_ELBO's estimate of the guide's -ELBO (module
    docstring). Warns :class:`BoundMismatchWarning` (when ``warn``) on disagreement.

    :param reported_loss: the guide's loss at ``args``, ``kwargs`` (a float).
    :param num_particles: Trace_ELBO draws (at least 2).
    :param tolerance: in combined standard errors.
    :param vectorize: draw each batch under a particle plate (``vectorize_particles``): faster,
        but only for models written for an extra batch dim on the left (a model that stacks
        values along ``-1`` in a Python loop gets a wrong, not a failing, estimate so; by
        default the draws are taken one at a time).
    :param enum_plates: asked after the first reported loss (the guide is set up then): the
        model's plate nesting where the guide sums discrete latents out (then
        ``TraceEnum_ELBO`` sums them out too), else ``None``.
    :param monte_carlo: asked after the first reported loss: whether that loss was a Monte
        Carlo estimate (then it is repeated to about as many draws as the referee's batches).
    """
    kwargs = kwargs or {}
    if num_particles < 2:
        raise ValueError(f"check_bound: num_particles must be at least 2, got {num_particles}")
    if not tolerance > 0:
        raise ValueError(f"check_bound: tolerance must be positive, got {tolerance}")
    state = _rng_state()
    running = getattr(guide, "bound_check_running", False)
    try:
        guide.bound_check_running = True  # (a guide may refuse Pyro's ELBOs inside SVI.step)
        with torch.no_grad(), poutine.block():
            reported, reported_se = _reported(reported_loss, monte_carlo, num_particles)
            plates = enum_plates() if enum_plates is not None else None
            batches = _trace_elbo_batches(
                model, guide, args, kwargs, num_particles, plates, vectorize
            )
    finally:
        guide.bound_check_running = running
        _set_rng_state(state)
    estimate, est_se = _mean_se(batches)
    # batches of unequal size are averaged as equals: the last one is full-sized by design
    n_draws = batches.numel() * _batch(num_particles)
    se = math.hypot(reported_se, est_se)
    floor = 64 * torch.finfo(torch.float32).eps * max(1.0, abs(estimate))
    agrees = bool(abs(reported - estimate) <= tolerance * max(se, floor))
    result = BoundCheck(reported, estimate, se, agrees, reported_se, n_draws, tolerance)
    if warn and not agrees:
        who = label or type(guide).__name__
        warnings.warn(
            f"{who}: the reported loss is not the -ELBO of the q it samples: {result}. "
            "A factor may be misclassified (guide.explain() lists how each is treated); "
            "please report the model.",
            BoundMismatchWarning,
            stacklevel=3,
        )
    return result


class BoundChecked:
    """Mixin of the CVI guides (with ``model`` and ``elbo(args, kwargs)``): their
    ``check_bound`` method."""

    model: _Fn
    elbo: Callable[..., torch.Tensor]

    def check_bound(
        self,
        *args: Any,
        num_particles: int = DEFAULT_PARTICLES,
        tolerance: float = 3.0,
        warn: bool = True,
        vectorize: bool = False,
        **kwargs: Any,
    ) -> BoundCheck:
        """Compare the loss this guide reports at the model's ``args``/``kwargs`` with
        ``num_particles`` draws of ``pyro.infer.Trace_ELBO`` over the guide itself; warns
        :class:`~pyro_cvi.bound_check.BoundMismatchWarning` when they differ by more than
        ``tolerance`` standard errors (``vectorize``: Trace_ELBO's particles under a plate, for
        models written for it). Neither ``q`` nor the random state changes.
        Returns a :class:`~pyro_cvi.bound_check.BoundCheck` (``reported``, ``estimate``,
        ``se``, ``agrees``)."""

        def reported() -> float:
            return float(self.elbo(args, kwargs).detach().neg())

        return check_bound(
            self.model,
            self,
            reported,
            args,
            kwargs,
            num_particles=num_particles,
            tolerance=tolerance,
            warn=warn,
            label=f"{type(self).__name__}({getattr(self.model, '__name__', 'model')})",
            enum_plates=lambda: collapsed_plates(self),
            vectorize=vectorize,
            monte_carlo=lambda: (
                getattr(getattr(self, "engine", None), "last_mc_var", None) is not None
            ),
        )


def collapsed_plates(guide: Any) -> Optional[int]:
    """The model's plate nesting where the guide sums discrete latents out
    (``discrete="collapse"``: it has no site for them, so the referee is ``TraceEnum_ELBO``),
    else ``None``."""
    analysis = getattr(getattr(guide, "engine", None), "analysis", None)
    if not getattr(analysis, "collapsed", None):
        return None
    return int(getattr(analysis, "plate_dims", 0) or 0)


def check_setup_draws(n: Any) -> None:
    """A guide's ``check_at_setup``: ``0`` (no check) or a number of draws (at least 2)."""
    if isinstance(n, bool) or not (n == 0 or (isinstance(n, int) and n >= 2)):
        raise ValueError(
            "check_at_setup is the number of Trace_ELBO draws of the bound check at set-up "
            f"(0: none, else at least 2), got {n!r}"
        )
