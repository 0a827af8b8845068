"""Several starts scored by the bound: an answer for multimodal posteriors.

A posterior with several modes (the labels of an HMM's or a mixture's states, a sign flip in a
factor model) gives a variational fit several fixed points; which one a fit ends in depends on
where ``q`` starts. Every fixed point ``q_k`` has ``ELBO(q_k) = log p(y) - KL(q_k || p(z | y))``,
so of two fits the one with the higher ELBO is the one nearer the posterior in that
divergence: comparing the bounds is the justified choice between modes (it is how Stan's and
Pyro's users compare chains started apart, and how mixtures are fitted by EM with restarts).

:func:`best_of_starts` builds one fit per start with the user's ``make_svi(init_loc_fn)``, takes
``warmup_steps`` steps of each, scores each by a plain Monte Carlo estimate of its bound
(``pyro.infer.Trace_ELBO`` over the guide, ``num_particles`` draws: the same estimate for every
kind of guide, AutoCVI or Pyro's own), keeps the fit with the lowest ``-ELBO`` and leaves its
parameters in Pyro's param store. The starts are the user's ``init_loc_fn`` (``None``: the
guide's own default start) and then Stan's default for chains, a point drawn uniformly in
``(-radius, radius)`` on every site's unconstrained space (``init_to_uniform``), or an explicit
list ``starts``. Each fit runs alone in the param store (its parameters are taken out when it
is done), so the guides may all use one name prefix; the SVI objects keep their own optimizer
state, so the chosen one continues exactly where it stopped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pyro
import torch
from pyro.infer.autoguide.initialization import init_to_uniform

from .bound_check import _trace_elbo_batches

__all__ = ["Starts", "best_of_starts"]

#: what ``make_svi`` gets: a Pyro init strategy, or ``None`` for the guide's default start
InitFn = Optional[Callable[..., Any]]


@dataclass
class Starts:
    """The outcome of :func:`best_of_starts`: ``svi`` (with ``svi.guide``) is the chosen fit,
    its parameters in Pyro's param store; ``bounds`` holds every start's ``-ELBO`` estimate and
    its standard error, ``losses`` the warm-up losses each ``svi.step`` returned."""

    svi: Any
    chosen: int
    bounds: List[Tuple[float, float]] = field(default_factory=list)
    losses: List[List[float]] = field(default_factory=list)

    @property
    def guide(self) -> Any:
        return self.svi.guide


def _check(num_starts: int, warmup_steps: int, num_particles: int, radius: float) -> None:
    if int(num_starts) != num_starts or num_starts < 1:
        raise ValueError(f"best_of_starts: num_starts={num_starts!r} must be an integer >= 1")
    if int(warmup_steps) != warmup_steps or warmup_steps < 1:
        raise ValueError(
            f"best_of_starts: warmup_steps={warmup_steps!r} must be an integer >= 1 (the fits "
            "are compared after that many steps each)"
        )
    if int(num_particles) != num_particles or num_particles < 2:
        raise ValueError(
            f"best_of_starts: num_particles={num_particles!r} must be an integer >= 2 (the "
            "bound's estimate needs a standard error)"
        )
    if not radius > 0:
        raise ValueError(f"best_of_starts: radius={radius!r} must be positive")


def best_of_starts(
    make_svi: Callable[[InitFn], Any],
    args: Tuple[Any, ...] = (),
    kwargs: Optional[Dict[str, Any]] = None,
    *,
    num_starts: int = 4,
    warmup_steps: int = 100,
    init_loc_fn: InitFn = None,
    starts: Optional[Sequence[InitFn]] = None,
    radius: float = 2.0,
    num_particles: int = 200,
) -> Starts:
    """Fit from several starts, keep the one with the best bound (module docstring).

    :param make_svi: ``init_loc_fn -> pyro.infer.SVI``, a fresh guide and optimizer each call,
        e.g. ``lambda init: SVI(model, AutoCVI(model, init_loc_fn=init), CVI(), CVI_ELBO())``
        (``init`` is ``None`` for the guide's default start).
    :param args: the model's arguments (``kwargs`` its keyword arguments).
    :param num_starts: how many fits (``len(starts)`` when ``starts`` is given).
    :param warmup_steps: steps of each fit before they are compared.
    :param init_loc_fn: the first start (``None``: the guide's default); the others are
        ``init_to_uniform(radius=radius)`` draws.
    :param starts: an explicit list of starts instead.
    :param num_particles: draws of the ``-ELBO`` estimate that scores each fit.
    :returns: :class:`Starts`; step ``result.svi`` on to continue the chosen fit.
    """
    kwargs = {} if kwargs is None else kwargs
    if starts is None:
        _check(num_starts, warmup_steps, num_particles, radius)
        starts = [init_loc_fn] + [init_to_uniform(radius=radius)] * (num_starts - 1)
    else:
        starts = list(starts)
        _check(len(starts), warmup_steps, num_particles, radius)
    store = pyro.get_param_store()
    if len(store):
        names = ", ".join(sorted(store.keys())[:3])
        raise ValueError(
            f"best_of_starts: Pyro's param store is not empty ({names}, ...): each start must "
            "begin from an empty store; call pyro.clear_param_store() first"
        )
    fits, states, bounds, losses = [], [], [], []
    for start in starts:
        svi = make_svi(start)
        trail = [float(svi.step(*args, **kwargs)) for _ in range(warmup_steps)]
        with torch.no_grad():
            vals = _trace_elbo_batches(
                svi.model, svi.guide, args, kwargs, num_particles, vectorize=True
            )
        mean = float(vals.mean())
        se = float(vals.std() / math.sqrt(vals.numel()))
        if not math.isfinite(mean):  # a start that failed to fit loses
            mean = math.inf
        fits.append(svi)
        states.append(store.get_state())
        bounds.append((mean, se))
        losses.append(trail)
        pyro.clear_param_store()  # (the next fit starts alone)
    chosen = min(range(len(fits)), key=lambda k: bounds[k][0])
    if not math.isfinite(bounds[chosen][0]):
        raise ValueError(
            "best_of_starts: no start gave a finite bound after "
            f"{warmup_steps} steps; try another init_loc_fn, a smaller radius, or float64"
        )
    store.set_state(states[chosen])
    return Starts(svi=fits[chosen], chosen=chosen, bounds=bounds, losses=losses)
