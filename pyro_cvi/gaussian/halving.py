"""The one step-halving policy of the package.

A CVI step ``x + b (target - x)`` (Khan & Lin 2017, eq. 12) or a natural-gradient step of a
Gaussian (:mod:`pyro_cvi.gaussian.steps`) that leaves the natural domain (a precision that is
not positive definite, a variance below zero, a rate below zero) is shrunk: ``b`` is halved,
per batch element, until the new point is valid, at most :data:`MAX_HALVINGS` times; an
element still invalid then keeps its old value (the caller rejects it). ``2^-30`` of a step is
below what any step-size rule would take.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch

__all__ = ["MAX_HALVINGS", "MAX_HALVINGS_SOLVE", "halve_until_valid"]

#: halvings before an element's step is rejected (each costs one validity check)
MAX_HALVINGS = 30
#: the same for blocks whose validity check is a solve (a Cholesky of the block's precision):
#: ``2^-12`` of a step is already below what the adaptive step control would take
MAX_HALVINGS_SOLVE = 12


def halve_until_valid(
    candidate: Callable[[Any], Any],
    valid: Callable[[Any], torch.Tensor],
    beta: Any,
    max_halvings: int = MAX_HALVINGS,
    like: Optional[torch.Tensor] = None,
) -> Tuple[Any, torch.Tensor, torch.Tensor, int]:
    """The one halving policy: ``b`` is halved, per batch element, where ``candidate(b)`` is
    not ``valid`` (a bool tensor of the batch shape), at most ``max_halvings`` times.

    ``beta`` is a float (``b`` then takes the batch shape of the first ``valid``, and the dtype
    of ``like``) or a tensor that broadcasts like ``valid``'s result. Returns
    ``(candidate(b), b, ok, shrunk)``: ``ok`` marks the valid elements (the others are the
    caller's to reject), ``shrunk`` counts the invalid elements over the halvings."""
    new = candidate(beta)
    ok = valid(new)
    b = beta
    if not torch.is_tensor(b):
        dtype = like.dtype if like is not None else torch.get_default_dtype()
        b = torch.full(ok.shape, float(beta), dtype=dtype, device=ok.device)
    shrunk = 0
    for _ in range(max_halvings):
        if bool(ok.all()):
            break
        shrunk += int((~ok).sum())
        b = torch.where(ok, b, b / 2)
        new = candidate(b)
        ok = valid(new)
    return new, b, ok, shrunk
