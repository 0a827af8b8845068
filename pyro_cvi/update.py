"""The CVI update and the one step policy (Algorithm 1 eq. 12, Algorithm 2 step 5).

Every block takes the same step in its own parameters::

    lambda <- lambda + b * (target - lambda) = (1 - b) lambda + b target       (eq. 12)

with ``b = beta`` unless that leaves the natural domain. The policy, for every batch element
independently (a Gaussian block is one element): halve ``b`` until the new point is valid; an
element still invalid after ``max_halvings`` halvings keeps its old value (rejected). Where the
family's domain is a box (Gamma, Beta, Dirichlet: ``family.natural_bounds``) the halving count
is computed in closed form, and when the target itself lies outside the domain (a noisy Monte
Carlo target) the shrunk step also stops at most half way to the boundary, so shapes and rates
do not collapse to ~0 (the paper's "shrink until within the constraints", Section 7).
Shrunk and rejected elements are counted and reported by the caller.

**Natural-gradient parameters.** A CVI parameter's ``.grad`` holds ``target - lambda`` (written
by the loss); its *owner* (an object with ``step(beta)``: an AutoCVI engine) applies the update
above to it. :func:`register_owner` records the owner next to the parameter (weakly, nothing is
kept alive) and :func:`owner_of` reads it, so the optimizer (:class:`~pyro_cvi.CVI`) needs
nothing but this module to find what to step.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch

from .gaussian.halving import MAX_HALVINGS, MAX_HALVINGS_SOLVE, halve_until_valid

__all__ = [
    "CountedSteps",
    "NaturalGradientOwner",
    "MAX_HALVINGS",
    "MAX_HALVINGS_SOLVE",
    "StepCounts",
    "cvi_update",
    "damped_step",
    "halve_until_valid",
    "owner_of",
    "register_owner",
    "targets_from_grads",
]

Params = Tuple[torch.Tensor, ...]

#: a shrunk step covers at most this fraction of the distance to a box boundary
TO_BOUNDARY = 0.5


@dataclass
class StepCounts:
    """How many batch elements had their step shrunk, or rejected, in one step."""

    shrunk: int = 0
    rejected: int = 0

    def __iadd__(self, other: StepCounts) -> StepCounts:
        self.shrunk += other.shrunk
        self.rejected += other.rejected
        return self


class CountedSteps:
    """Mixin for a guide whose ``counts`` (:class:`StepCounts`) total all its steps so far."""

    counts: StepCounts

    @property
    def num_shrunk(self) -> int:
        """Batch elements whose step was shrunk to keep q valid (all steps so far)."""
        return self.counts.shrunk

    @num_shrunk.setter
    def num_shrunk(self, value: int) -> None:
        self.counts.shrunk = int(value)

    @property
    def num_rejected(self) -> int:
        """Batch elements whose step was rejected (no step size kept q valid)."""
        return self.counts.rejected

    @num_rejected.setter
    def num_rejected(self, value: int) -> None:
        self.counts.rejected = int(value)


def _expand(b: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return b.reshape(b.shape + (1,) * (like.dim() - b.dim()))


def cvi_update(old: Sequence[torch.Tensor], target: Sequence[torch.Tensor], b) -> Params:
    """``old + b (target - old)``; ``b`` a float or a tensor of the batch shape (eq. 12)."""
    if not torch.is_tensor(b):
        return tuple(o + b * (t - o) for o, t in zip(old, target))
    return tuple(o + _expand(b, o) * (t - o) for o, t in zip(old, target))


def targets_from_grads(params: Sequence[torch.Tensor]) -> Optional[Tuple[Params, Params]]:
    """``(lambda, target)`` from parameters whose ``.grad`` holds ``target - lambda`` (written
    by the loss); ``None`` when no parameter has a gradient."""
    if all(p.grad is None for p in params):
        return None
    old = tuple(p.detach() for p in params)
    grads = (p.grad if p.grad is not None else torch.zeros_like(o) for o, p in zip(old, params))
    return old, tuple(o + g for o, g in zip(old, grads))


def damped_step(
    old: Sequence[torch.Tensor],
    target: Sequence[torch.Tensor],
    beta: float,
    valid: Callable[[Params], torch.Tensor],
    bounds: Optional[Sequence[Tuple[Optional[float], Optional[float]]]] = None,
    param_shapes: Optional[Sequence[torch.Size]] = None,
    max_halvings: int = MAX_HALVINGS,
) -> Tuple[Params, StepCounts]:
    """The CVI update with the step policy of the module docstring.

    :param valid: ``params -> bool`` tensor of the batch shape (a 0-dim tensor for one element).
    :param bounds: box bounds ``(lo, hi)`` per natural parameter, if the domain is a box, with
        ``param_shapes`` the trailing (event) shape of each parameter.
    """
    old = tuple(o.detach() for o in old)
    target = tuple(t.detach() for t in target)
    if bounds is not None:
        return _box_step(old, target, beta, bounds, param_shapes, max_halvings)
    new, _, ok, shrunk = halve_until_valid(
        lambda b: cvi_update(old, target, b), valid, beta, max_halvings, like=old[0]
    )
    if bool(ok.all()):
        return new, StepCounts(shrunk, 0)
    new = tuple(torch.where(_expand(ok, o), n, o) for o, n in zip(old, new))
    return new, StepCounts(shrunk, int((~ok).sum()))


def _box_step(old, target, beta, bounds, param_shapes, max_halvings):
    """:func:`damped_step` on a box domain, in closed form.

    Where the target is inside the domain (always, for exact conjugate messages) the step is
    the plain convex combination. Where it is not, ``b = beta / 2^k`` with the smallest ``k``
    such that no parameter moves more than :data:`TO_BOUNDARY` of the way to its bound.
    """
    grads = tuple(t - o for t, o in zip(target, old))
    limit, finite = None, None  # largest allowed step per element (inf where unconstrained)
    for o, g, (lo, hi), shape in zip(old, grads, bounds, param_shapes):
        lim = torch.full_like(o, float("inf"))
        if lo is not None:
            lim = torch.where(g < 0, (lo - o) / g, lim)
        if hi is not None:
            lim = torch.where(g > 0, (hi - o) / g, lim)
        lim = lim.reshape(lim.shape[: lim.dim() - len(shape)] + (-1,)).amin(-1)
        ok = torch.isfinite(g).reshape(lim.shape + (-1,)).all(-1)
        limit = lim if limit is None else torch.minimum(limit, lim)
        finite = ok if finite is None else finite & ok
    limit = torch.where(finite, limit, torch.zeros_like(limit))
    allowed = torch.where(limit > 1.0, limit, TO_BOUNDARY * limit)
    b = torch.full_like(limit, float(beta))
    k = torch.ceil(torch.log2(b / allowed.clamp_min(1e-300))).clamp(min=0)
    k = torch.where(b <= allowed, torch.zeros_like(k), torch.maximum(k, torch.ones_like(k)))
    b = b * torch.exp2(-k)
    b = torch.where((b <= allowed) | (b < limit), b, b / 2)
    rejected = (k > max_halvings) | ~finite
    b = torch.where(rejected, torch.zeros_like(b), b)
    target = tuple(o + torch.nan_to_num(g) for o, g in zip(old, grads))
    return cvi_update(old, target, b), StepCounts(
        int(((k > 0) & ~rejected).sum()), int(rejected.sum())
    )


#: ``id(unconstrained param) -> (weak param, weak owner)``
_OWNERS: Dict[int, tuple] = {}


@runtime_checkable
class NaturalGradientOwner(Protocol):
    """What :class:`~pyro_cvi.CVI` asks of whatever owns natural parameters (an AutoCVI guide's
    engine, ``AutoStructuredCVI``): the loss leaves a pending step, the optimizer applies it.
    A typed protocol (checked by mypy where the optimizer uses it), not a registry of ids."""

    @property
    def prefix(self) -> str:
        """The owner's param-store prefix (checkpointed step-control state is keyed by it)."""

    @property
    def control(self) -> Optional[Any]:
        """The adaptive step control, once enabled (``None``: none)."""

    @property
    def reducer(self) -> Optional[Any]:
        """The data-parallel reducer (``None``: one process)."""

    def has_pending_step(self) -> bool:
        """Whether the last loss left natural gradients for a step."""

    def pending_loss(self) -> Optional[Tuple[float, Optional[float]]]:
        """``(ELBO, its Monte Carlo variance or None)`` of the pending step's loss where
        successive losses are comparable (no minibatch), for the fixed step's monitor."""

    def step_labels(self) -> List[str]:
        """The labels a warning about the steps names (the sites stepped)."""

    def enable_control(self, max_beta: float, state: Optional[Dict[str, Any]] = None) -> Any:
        """Switch on the adaptive step (or restore its state from a checkpoint)."""

    def step(self, beta: Optional[float]) -> None:
        """Apply the pending step with step size ``beta`` (``None``: the adaptive one)."""


def owner_of(param: torch.Tensor) -> Optional[NaturalGradientOwner]:
    """The owner that steps ``param`` by eq. 12 (see the module docstring), or ``None``."""
    entry = _OWNERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def register_owner(param: torch.Tensor, owner: Any) -> None:
    """Record ``owner`` as the one that steps ``param`` (weak references both ways)."""
    key = id(param)
    entry = _OWNERS.get(key)
    if entry is not None and entry[0]() is param and entry[1]() is owner:
        return
    _OWNERS[key] = (
        weakref.ref(param, lambda _, key=key: _OWNERS.pop(key, None)),
        weakref.ref(owner),
    )
