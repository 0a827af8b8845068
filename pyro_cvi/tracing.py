"""Running a Pyro model at chosen latent values, and reading distribution parameters off sites."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.poutine.subsample_messenger import _Subsample
from pyro.poutine.trace_struct import Trace

__all__ = [
    "trace_model",
    "is_random",
    "unwrap",
    "LINEAR_PARAMS",
    "linear_param",
    "with_param",
]


def trace_model(model: Callable, values: Dict[str, torch.Tensor], args, kwargs) -> Trace:
    """Trace ``model(*args, **kwargs)`` with the latent sites in ``values`` fixed (conditioned)."""
    conditioned = poutine.condition(model, data=values) if values else model
    return poutine.trace(conditioned).get_trace(*args, **kwargs)


def is_random(site) -> bool:
    """A real sample site: not a plate's subsample site, not a ``pyro.deterministic``."""
    return (
        site["type"] == "sample"
        and not isinstance(site["fn"], _Subsample)
        and not site["infer"].get("_deterministic", False)
    )


def _is_latent(site) -> bool:
    return is_random(site) and not site["is_observed"]


def unwrap(fn) -> Tuple[torch.distributions.Distribution, Optional[torch.Tensor], int]:
    """Strip ``MaskedDistribution``, ``Independent`` and ``ExpandedDistribution`` wrappers.

    Returns ``(base, mask, reinterpreted_ndims)``; the base's parameters broadcast against the
    site's batch shape, and ``log_prob`` of the base must be multiplied by ``mask`` and summed
    over ``reinterpreted_ndims`` rightmost dims to reproduce the site's ``log_prob``.
    """
    mask = None
    ndims = 0
    while True:
        if isinstance(fn, dist.MaskedDistribution):
            m = fn._mask
            mask = m if mask is None else mask & m
            fn = fn.base_dist
        elif isinstance(fn, torch.distributions.Independent):
            ndims += fn.reinterpreted_batch_ndims
            fn = fn.base_dist
        elif isinstance(fn, dist.ExpandedDistribution):
            fn = fn.base_dist
        else:
            return fn, mask, ndims


def _identity(x):
    return x


# (distribution class, parameter name, link, inverse link). A factor is a linear-predictor
# factor when link(parameter) is affine in a Gaussian latent and no other parameter depends on it.
LINEAR_PARAMS = {
    torch.distributions.Normal: ("loc", _identity, _identity),
    torch.distributions.Bernoulli: ("logits", _identity, _identity),
    torch.distributions.Binomial: ("logits", _identity, _identity),
    torch.distributions.Geometric: ("logits", _identity, _identity),
    torch.distributions.NegativeBinomial: ("logits", _identity, _identity),
    torch.distributions.Poisson: ("rate", torch.log, torch.exp),
    torch.distributions.StudentT: ("loc", _identity, _identity),
    torch.distributions.Laplace: ("loc", _identity, _identity),
    torch.distributions.Cauchy: ("loc", _identity, _identity),
}

# constructor arguments of each class, other than the linear parameter
_OTHER_ARGS = {
    torch.distributions.Normal: ("scale",),
    torch.distributions.Bernoulli: (),
    torch.distributions.Binomial: ("total_count",),
    torch.distributions.Geometric: (),
    torch.distributions.NegativeBinomial: ("total_count",),
    torch.distributions.Poisson: (),
    torch.distributions.StudentT: ("df", "scale"),
    torch.distributions.Laplace: ("scale",),
    torch.distributions.Cauchy: ("scale",),
}


def _registered(base):
    for cls in type(base).__mro__:
        if cls in LINEAR_PARAMS:
            return cls
    return None


def linear_param(base) -> Optional[Tuple[str, torch.Tensor, Dict[str, torch.Tensor]]]:
    """``(name, link(value), other_params)`` for a registered likelihood, else ``None``."""
    cls = _registered(base)
    if cls is None:
        return None
    name, link, _ = LINEAR_PARAMS[cls]
    value = link(getattr(base, name))
    others = {k: getattr(base, k) for k in _OTHER_ARGS[cls]}
    return name, value, others


def with_param(base, linked_value: torch.Tensor):
    """A copy of ``base`` whose linear parameter is ``inverse_link(linked_value)``."""
    cls = _registered(base)
    name, _, inv = LINEAR_PARAMS[cls]
    kwargs = {k: getattr(base, k) for k in _OTHER_ARGS[cls]}
    kwargs[name] = inv(linked_value)
    return type(base)(**kwargs, validate_args=False)
