"""Reading a guide parameter's constrained value and loss gradient, and writing it back.

Pyro keeps every ``pyro.param`` as an unconstrained tensor ``u`` with ``c = T(u)``,
``T = transform_to(constraint)``; SVI's backward leaves ``dloss/du`` in ``u.grad``. Every
constraint of a Gaussian role (real, positive, softplus_positive, lower_cholesky,
unit_lower_cholesky) has an element-wise ``T``, so the chain rule inverts element by element:
``dloss/dc = (dloss/du) / T'(u)`` (zero where ``T' = 0``: the fixed unit diagonal).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

import pyro
import torch
from torch.distributions import transform_to

__all__ = ["read", "write"]


def read(
    name: str, cons: Mapping[str, object], transform: Optional[Any] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(c, dloss/dc)`` of the param ``name`` (zeros where it has no gradient); ``c =
    transform(u)``, by default the param's own constraint transform (any element-wise
    bijection: :mod:`pyro_cvi.natgrad.sites`)."""
    store = pyro.get_param_store()
    u = store[name].unconstrained()
    if transform is None:
        transform = transform_to(cons[name])
    with torch.enable_grad():
        leaf = u.detach().requires_grad_(True)
        c = transform(leaf)
        (deriv,) = torch.autograd.grad(c.sum(), leaf, allow_unused=True)
    c = c.detach()
    if u.grad is None:
        return c, torch.zeros_like(c)
    if deriv is None:
        deriv = torch.zeros_like(c)
    safe = torch.where(deriv != 0, deriv, torch.ones_like(deriv))
    return c, torch.where(deriv != 0, u.grad / safe, torch.zeros_like(c))


def write(
    name: str, value: torch.Tensor, cons: Mapping[str, object], transform: Optional[Any] = None
) -> None:
    """Set the param ``name`` to ``value = transform(u)`` in place (its tensor, and so any
    optimizer state keyed on it, is kept)."""
    u = pyro.get_param_store()[name].unconstrained()
    if transform is None:
        transform = transform_to(cons[name])
    with torch.no_grad():
        u.copy_(transform.inv(value.to(u)))
