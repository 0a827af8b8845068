"""Running a Pyro model at chosen latent values, and reading distribution parameters off sites."""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional, Set, Tuple

import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer.enum import config_enumerate
from pyro.poutine.subsample_messenger import _Subsample
from pyro.poutine.trace_struct import Trace

__all__ = [
    "trace_model",
    "run_model",
    "max_plate_nesting",
    "subsample_values",
    "discrete_dependencies",
    "continuous_dependencies",
    "is_random",
    "unwrap",
    "LINEAR_PARAMS",
    "linear_param",
    "with_param",
    "has_learnable_params",
]


def trace_model(model: Callable, values: Dict[str, torch.Tensor], args, kwargs) -> Trace:
    """Trace ``model(*args, **kwargs)`` with the latent sites in ``values`` fixed (conditioned)."""
    conditioned = poutine.condition(model, data=values) if values else model
    return poutine.trace(conditioned).get_trace(*args, **kwargs)


def run_model(model, values: Dict[str, torch.Tensor], args, kwargs, enum_dims: Optional[int]):
    """Trace ``model`` with ``values`` conditioned; discrete latents left free are enumerated in
    parallel left of ``enum_dims`` plate dims (``None``: no enumeration)."""
    if enum_dims is None:
        return trace_model(model, values, args, kwargs)
    fn = poutine.condition(model, data=values) if values else model
    fn = poutine.enum(config_enumerate(fn, default="parallel"), first_available_dim=-1 - enum_dims)
    return poutine.trace(fn).get_trace(*args, **kwargs)


def max_plate_nesting(trace: Trace) -> int:
    """The number of batch dims used by vectorised plates (enumeration goes left of them)."""
    dims = [
        -f.dim
        for s in trace.nodes.values()
        if s["type"] == "sample"
        for f in s["cond_indep_stack"]
        if f.vectorized and f.dim is not None
    ]
    return max(dims, default=0)


def subsample_values(trace: Trace) -> Dict[str, torch.Tensor]:
    """The subsample indices of every plate in a trace (to replay the same minibatch)."""
    return {
        n: s["value"]
        for n, s in trace.nodes.items()
        if s["type"] == "sample" and isinstance(s["fn"], _Subsample)
    }


def discrete_dependencies(trace: Trace, discrete: Iterable[str]) -> Dict[str, Set[str]]:
    """For each sample site of an *enumerated* trace, the discrete latents it depends on.

    Read off Pyro's enumeration bookkeeping: every enumerated site has an id, and every site
    records the ids of the live enumeration dims (``infer["_dim_to_id"]``); a site depends on
    those its distribution's batch shape broadcasts over. Ids, not dims alone:
    ``pyro.markov`` recycles enumeration dims, so ``x_t`` and ``x_{t-2}`` share a dim but never
    an id.
    """
    ids = {}
    for c in discrete:
        infer = trace.nodes[c]["infer"]
        d = infer.get("_enumerate_dim")
        if d is not None:
            ids[c] = infer["_dim_to_id"][d]
    out: Dict[str, Set[str]] = {}
    for name, site in trace.nodes.items():
        if not is_random(site):
            continue
        infer = site["infer"]
        shape = site["fn"].batch_shape
        own = infer.get("_dim_to_id", {}).get(infer.get("_enumerate_dim"))
        # the live enumeration dims the distribution actually broadcasts over
        seen = {
            i for d, i in infer.get("_dim_to_id", {}).items() if len(shape) >= -d and shape[d] > 1
        } - {own}
        out[name] = {c for c, i in ids.items() if c != name and i in seen}
    return out


def continuous_dependencies(trace: Trace, leaves: Dict[str, torch.Tensor]) -> Dict[str, Set[str]]:
    """For each sample site of ``trace``, the continuous latent sites its distribution depends on,
    through its parameters or its observed value (``pyro.sample("z", d, obs=f(x))``).

    ``trace`` was taken with the latent values ``leaves`` as autograd leaves; a latent is a
    dependency of a site when the gradient of the site's parameters with respect to it is not
    identically absent. This is structural (exact), not numeric. (Discrete latents: see
    :func:`discrete_dependencies`.)
    """
    names = list(leaves)
    deps: Dict[str, Set[str]] = {}
    with torch.enable_grad():
        for name, site in trace.nodes.items():
            if not is_random(site):
                continue
            params = [p for p in float_params(site["fn"]) if p.requires_grad]
            value = site["value"]
            if name not in leaves and torch.is_tensor(value) and value.requires_grad:
                params.append(value)  # an observed value computed from latents: obs=f(x)
            # and through the density itself: parameters held inside the distribution object
            # (MixtureSameFamily's components, a DiscreteHMM's observation law, ...)
            lp = _log_prob(site)
            if lp is not None:
                params.append(lp)
            deps[name] = set()
            if not params or not names:
                continue
            total = sum((p * torch.randn_like(p)).sum() for p in params)
            grads = torch.autograd.grad(
                total, [leaves[n] for n in names], allow_unused=True, retain_graph=True
            )
            deps[name] = {n for n, g in zip(names, grads) if g is not None and n != name}
    return deps


def _log_prob(site) -> Optional[torch.Tensor]:
    """The site's log density at its value, where it has a graph (else ``None``)."""
    try:
        lp = site["fn"].log_prob(site["value"])
    except Exception:  # (a density that cannot be evaluated here: its parameters decide)
        return None
    return lp if torch.is_tensor(lp) and lp.requires_grad else None


def float_params(fn) -> list:
    """The floating-point parameter tensors of a site's (unwrapped) distribution."""
    base = unwrap(fn)[0]
    out = []
    for name in getattr(base, "arg_constraints", {}):
        try:
            v = getattr(base, name)
        except Exception:  # lazy parameters that cannot be computed
            continue
        if torch.is_tensor(v) and v.is_floating_point():
            out.append(v)
    return out


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


def has_learnable_params(base) -> bool:
    """Whether a parameter of ``base`` other than its linear one carries a graph (a learned
    scale, degrees of freedom, total count): the expected log-density must then keep it."""
    return any(
        torch.is_tensor(v) and v.requires_grad
        for v in (getattr(base, k) for k in _OTHER_ARGS[_registered(base)])
    )


def with_param(base, linked_value: torch.Tensor):
    """A copy of ``base`` whose linear parameter is ``inverse_link(linked_value)``."""
    cls = _registered(base)
    name, _, inv = LINEAR_PARAMS[cls]
    kwargs = {k: getattr(base, k) for k in _OTHER_ARGS[cls]}
    kwargs[name] = inv(linked_value)
    return type(base)(**kwargs, validate_args=False)
