"""Reading a guide parameter's constrained value and loss gradient, and writing it back.

Pyro keeps every ``pyro.param`` as an unconstrained tensor ``u`` with ``c = T(u)``,
``T = transform_to(constraint)``; SVI's backward leaves ``dloss/du`` in ``u.grad``. Every
constraint of a Gaussian role (real, positive, softplus_positive, lower_cholesky,
unit_lower_cholesky) has an element-wise ``T``, so the chain rule inverts element by element:
``dloss/dc = (dloss/du) / T'(u)`` (zero where ``T' = 0``: the fixed unit diagonal).

A distribution parameter may also be a selection ``c = T(u).flatten()[idx]`` of a parameter
that feeds several (``ab[0]``, ``ab[1]``): :class:`Selected`. Its gradient is the same
selection of ``dloss/dT(u)``, and writing it sets only the elements ``idx`` of ``u``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

import pyro
import torch
from torch.distributions import transform_to

__all__ = ["Selected", "read", "write", "write_grad"]


@dataclass(frozen=True, eq=False)
class Selected:
    """The element-wise map ``transform`` followed by a selection: ``c = T(u).flatten()[idx]``
    (``idx``: flat indices into ``u``, none twice)."""

    transform: Any
    idx: torch.Tensor


def read(
    name: str, cons: Mapping[str, object], transform: Optional[Any] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(c, dloss/dc)`` of the param ``name`` (zeros where it has no gradient); ``c =
    transform(u)``, by default the param's own constraint transform (any element-wise
    bijection: :mod:`pyro_cvi.natgrad.sites`)."""
    store = pyro.get_param_store()
    u = store[name].unconstrained()
    if isinstance(transform, Selected):
        c, grad = read(name, cons, transform.transform)
        idx = transform.idx.to(c.device)
        return c.reshape(-1)[idx], grad.reshape(-1)[idx]
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
    if isinstance(transform, Selected):
        idx = transform.idx.to(u.device).reshape(-1)
        with torch.no_grad():
            u.view(-1)[idx] = transform.transform.inv(value.to(u)).reshape(-1)
        return
    if transform is None:
        transform = transform_to(cons[name])
    with torch.no_grad():
        u.copy_(transform.inv(value.to(u)))


def write_grad(
    name: str, grad: torch.Tensor, cons: Mapping[str, object], transform: Optional[Any] = None
) -> None:
    """Replace ``dloss/dc`` of the param ``name`` by ``grad`` (the inverse of :func:`read`'s
    chain rule: ``dloss/du = grad * T'(u)``), on the elements ``c`` covers only."""
    u = pyro.get_param_store()[name].unconstrained()
    if u.grad is None:
        return
    inner = transform.transform if isinstance(transform, Selected) else transform
    if inner is None:
        inner = transform_to(cons[name])
    with torch.enable_grad():
        leaf = u.detach().requires_grad_(True)
        (deriv,) = torch.autograd.grad(inner(leaf).sum(), leaf, allow_unused=True)
    if deriv is None:
        return
    with torch.no_grad():
        if isinstance(transform, Selected):
            idx = transform.idx.to(u.device).reshape(-1)
            new = grad.to(u).reshape(-1) * deriv.reshape(-1)[idx]
            u.grad.view(-1)[idx] = new
        else:
            u.grad.copy_(grad.to(u) * deriv)
