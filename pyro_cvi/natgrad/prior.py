"""Known Gaussian priors of a joint Gaussian's coordinates, to be added exactly.

A latent site whose prior is ``Normal(a, b)`` (possibly ``.expand``-ed or ``.to_event``-ed)
with ``a`` and ``b`` constants (no latent, no ``pyro.param`` behind them: no autograd graph in
the analysis trace, where every latent and parameter is a leaf), real support, no mask, and a
constant ``poutine.scale`` ``c``, contributes ``-c (u - a)^2 / (2 b^2)`` to the log joint at
each of its unconstrained coordinates ``u``: a Gaussian factor with precision ``p0 = c / b^2``,
whose expectation under ``q`` is closed form. The remainder takes it out of the sampled log
joint and adds it exactly (:mod:`pyro_cvi.gaussian.onedraw`).
"""

from __future__ import annotations

from typing import Sequence, Tuple

import pyro.distributions as dist
import torch
from torch.distributions import constraints

__all__ = ["known_normal_prior"]


def _normal_base(fn):
    while isinstance(fn, (dist.Independent, torch.distributions.Independent)):
        fn = fn.base_dist
    if isinstance(fn, (dist.Normal, torch.distributions.Normal)) and type(fn).__name__ == "Normal":
        return fn
    return None


def known_normal_prior(
    nodes, sites: Sequence[Tuple[str, int, int]], dim: int, like: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(a, p0)`` over the ``dim`` packed coordinates (``p0 = 0`` where the prior is not a
    known Normal). ``nodes``: the analysis trace's nodes; ``sites``: ``(name, start, size)``."""
    a = torch.zeros(dim, dtype=like.dtype, device=like.device)
    p0 = torch.zeros(dim, dtype=like.dtype, device=like.device)
    for name, start, size in sites:
        node = nodes[name]
        base = _normal_base(node["fn"])
        if base is None or node.get("mask") is not None:
            continue
        if base.support is not constraints.real:
            continue
        loc, scale = base.loc, base.scale
        if loc.requires_grad or scale.requires_grad:
            continue
        c = node.get("scale", 1.0)
        if torch.is_tensor(c):
            if c.numel() != 1 or c.requires_grad:
                continue
            c = float(c)
        value = node["value"]
        try:
            loc = torch.broadcast_to(loc.detach(), value.shape).reshape(-1)
            scale = torch.broadcast_to(scale.detach(), value.shape).reshape(-1)
        except RuntimeError:
            continue
        if loc.numel() != size:
            continue
        a[start : start + size] = loc.to(a)
        p0[start : start + size] = (float(c) / scale.pow(2)).to(p0)
    return a, p0
