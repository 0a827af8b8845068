"""Running a Pyro model at chosen latent values, and reading distribution parameters off sites."""

from __future__ import annotations

import inspect
import operator
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.distributions.util import broadcast_shape
from pyro.infer.enum import config_enumerate
from pyro.poutine.subsample_messenger import _Subsample
from pyro.poutine.trace_struct import Trace

from . import probes

__all__ = [
    "LOG_PROB_KEY",
    "trace_model",
    "DeferredTrace",
    "run_model",
    "max_plate_nesting",
    "subsample_values",
    "is_random",
    "unwrap",
    "latent_weight",
    "LINEAR_PARAMS",
    "LINKS",
    "linear_param",
    "link_candidates",
    "linear_candidates",
    "parallel_enumeration",
    "with_param",
    "has_learnable_params",
    "describe_link",
    "rebuilds",
    "linked_reader",
    "no_link_reason",
]


#: a site's ``fn.log_prob(value)`` (detached) where the analysis took it on its structure trace
#: (:func:`~pyro_cvi.model.dependencies.continuous_dependencies`), read once by the density
#: checks of :mod:`~pyro_cvi.model.validation` instead of evaluating it again
LOG_PROB_KEY = "_cvi_log_prob"


def trace_model(model: Callable, values: Dict[str, torch.Tensor], args, kwargs) -> Trace:
    """Trace ``model(*args, **kwargs)`` with the latent sites in ``values`` fixed (conditioned)."""
    conditioned = poutine.condition(model, data=values) if values else model
    return poutine.trace(conditioned).get_trace(*args, **kwargs)


class DeferredTrace:
    """A trace taken when it is first read (``make()``), then kept: a step whose blocks read no
    trace runs no model for it. Reads as the trace (``.nodes``, ...)."""

    __slots__ = ("_make", "_trace")

    def __init__(self, make: Callable[[], Trace]):
        self._make: Optional[Callable[[], Trace]] = make
        self._trace: Optional[Trace] = None

    def get(self) -> Trace:
        if self._trace is None:
            make, self._make = self._make, None
            assert make is not None
            self._trace = make()
        return self._trace

    def __getattr__(self, name: str):
        return getattr(self.get(), name)


def run_model(model, values: Dict[str, torch.Tensor], args, kwargs, enum_dims: Optional[int]):
    """Trace ``model`` with ``values`` conditioned; discrete latents left free are enumerated in
    parallel left of ``enum_dims`` plate dims (``None``: no enumeration). A site the model marks
    ``"sequential"`` is enumerated in parallel too (the same sum, one run)."""
    if enum_dims is None:
        return trace_model(model, values, args, kwargs)
    fn = poutine.condition(model, data=values) if values else model
    fn = poutine.infer_config(config_enumerate(fn, default="parallel"), parallel_enumeration)
    fn = poutine.enum(fn, first_available_dim=-1 - enum_dims)
    return poutine.trace(fn).get_trace(*args, **kwargs)


def parallel_enumeration(msg) -> Dict[str, str]:
    """An ``infer_config`` that enumerates a site marked ``"sequential"`` in parallel."""
    return {"enumerate": "parallel"} if msg["infer"].get("enumerate") == "sequential" else {}


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
    if type(fn) in _UNWRAPPED:
        return fn, None, 0  # (a type that is none of the wrappers: the common case, first)
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
            if fn.__class__ is type(fn) and not issubclass(type(fn), _WRAPPERS):
                _UNWRAPPED.add(type(fn))
            return fn, mask, ndims


_WRAPPERS = (dist.MaskedDistribution, torch.distributions.Independent, dist.ExpandedDistribution)
_UNWRAPPED: set = set()  # distribution types that are none of the wrappers (unwrap)


def subsample_scale(site) -> float:
    """The product of ``full_size / size`` over the subsampled plates around ``site``: the
    scale Pyro's plates give both the model's and the guide's log-densities there."""
    ratio = 1.0
    for frame in site["cond_indep_stack"]:
        if frame.full_size is not None and frame.size and frame.full_size != frame.size:
            ratio *= frame.full_size / frame.size
    return ratio


def latent_weight(site) -> Optional[torch.Tensor]:
    """The weight ``Trace_ELBO`` gives a latent's prior log-density beyond its plates'
    subsampling: ``scale * mask`` of the site (``poutine.scale`` / ``poutine.mask`` around it,
    ``MaskedDistribution`` at any depth), per element of its unwrapped base distribution's batch
    shape (:func:`unwrap`; the event dims of ``Independent`` included), or ``None`` when it is
    one everywhere. The guide's ``log q`` carries no such weight, so a weight ``c`` tempers the
    prior: ``E_q[c log p(z)] - E_q[log q(z)]``."""
    fn = site["fn"]
    scale = site["scale"]
    ratio = subsample_scale(site)
    weight = None
    if torch.is_tensor(scale):
        weight = scale.detach() / ratio
    elif scale / ratio != 1.0:
        weight = torch.tensor(scale / ratio)
    m = site["mask"]
    if m is False:
        weight = torch.tensor(0.0) if weight is None else weight * 0
    elif m is not None and m is not True:
        weight = m.double() if weight is None else weight * m
    if weight is not None:  # (pyro's broadcast: torch.broadcast_shapes imports sympy)
        weight = weight.expand(broadcast_shape(weight.shape, fn.batch_shape))
        extra = weight.dim() - len(fn.batch_shape)
        if extra > 0:  # a weight with more dims than the site's batch: Trace_ELBO sums them
            weight = weight.sum(tuple(range(extra)))
    # down the wrappers: Independent moves event dims into the batch, a mask multiplies
    while True:
        if isinstance(fn, dist.MaskedDistribution):
            k = fn._mask
            if k is not None and k is not True:
                k = torch.as_tensor(k).to(torch.float64)
                weight = k if weight is None else weight * k
                weight = weight.expand(broadcast_shape(weight.shape, fn.batch_shape))
            fn = fn.base_dist
        elif isinstance(fn, torch.distributions.Independent):
            if weight is not None:
                weight = weight.reshape(weight.shape + (1,) * fn.reinterpreted_batch_ndims)
                weight = weight.expand(fn.base_dist.batch_shape)
            fn = fn.base_dist
        elif isinstance(fn, dist.ExpandedDistribution):
            fn = fn.base_dist
        else:
            break
    if weight is None or bool((weight == 1).all()):
        return None
    return weight.expand(broadcast_shape(weight.shape, fn.batch_shape))


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


def _inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    """``log(exp(x) - 1)``, stable for large ``x``: ``x + log(1 - exp(-x))``."""
    return x + torch.log(-torch.expm1(-x))


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    return x.clamp_min(0).sqrt()


#: Fixed monotone links ``theta = g(eta)`` of a distribution parameter ``theta`` and one affine
#: function ``eta`` of Gaussian latents: ``name -> (g, g^-1)``. A factor is a linear-predictor
#: factor through ``g`` when ``g^-1(theta)`` is affine in the block (probed); its message
#: evaluates ``log p(y | theta = g(eta))`` at the quadrature nodes of ``eta``. ``sqrt`` is
#: ``g(eta) = sqrt(max(eta, 0))``: its messages assume ``q`` keeps ``eta`` positive.
LINKS: Dict[str, Tuple[Callable, Callable]] = {
    "identity": (_identity, _identity),
    "exp": (torch.exp, torch.log),
    "softplus": (torch.nn.functional.softplus, _inverse_softplus),
    "sigmoid": (torch.sigmoid, torch.logit),
    "sqrt": (_sqrt, torch.square),
}


def _links_for(constraint) -> Tuple[str, ...]:
    """The links whose range is a parameter's support: real -> identity; positive -> exp,
    softplus, sqrt; the unit interval -> sigmoid; any other support -> none."""
    C = torch.distributions.constraints
    c = constraint
    while isinstance(c, C.independent):
        c = c.base_constraint
    if isinstance(c, C._Real):
        return ("identity",)
    if isinstance(c, (C.greater_than, C.greater_than_eq)) and c.lower_bound == 0:
        return ("exp", "softplus", "sqrt")
    if isinstance(c, (C.interval, C.half_open_interval)) and (c.lower_bound, c.upper_bound) == (
        0,
        1,
    ):
        return ("sigmoid",)
    return ()


def _constructor_args(base) -> List[str]:
    """The parameters that rebuild ``base``: its ``arg_constraints`` that its constructor takes,
    with ``logits`` rather than ``probs`` where both are (one of them determines the other)."""
    try:
        accepted = inspect.signature(type(base).__init__).parameters
    except (TypeError, ValueError):
        return []
    names = [n for n in getattr(base, "arg_constraints", {}) if n in accepted]
    if "probs" in names and "logits" in names:
        names.remove("probs")
    return names


def link_candidates(base) -> List[Tuple[str, str]]:
    """``(parameter, link)`` pairs to try for a univariate distribution: every floating
    parameter of its constructor with each link whose range is the parameter's support."""
    if len(getattr(base, "event_shape", (1,))):
        return []
    out = []
    for name in _constructor_args(base):
        try:
            v = getattr(base, name)
        except Exception:  # (a lazy parameter that cannot be computed)
            continue
        if torch.is_tensor(v) and v.is_floating_point():
            out += [(name, g) for g in _links_for(base.arg_constraints[name])]
    return out


def _depends(value, zs) -> bool:
    if not (torch.is_tensor(value) and value.requires_grad):
        return False
    with torch.enable_grad():
        gs = torch.autograd.grad(value.sum(), zs, allow_unused=True, retain_graph=True)
    return any(g is not None for g in gs)


class _Depends:
    """:func:`_depends` on the leaves ``zs``, one backward pass per tensor asked (a registered
    parameter read again as a constructor argument, ``logits``, is the same tensor)."""

    __slots__ = ("zs", "seen")

    def __init__(self, zs):
        self.zs, self.seen = zs, {}

    def __call__(self, value) -> bool:
        key = id(value)
        if key not in self.seen:  # (value held beside its answer: the id stays its own)
            self.seen[key] = (value, _depends(value, self.zs))
        return self.seen[key][1]


#: the last answer of :func:`linear_candidates` per distribution object, with its leaves: the
#: random-walk check and the classification ask the same of the same leaf trace
_CANDIDATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def linear_candidates(base, zs) -> List[Tuple[str, Optional[str]]]:
    """The ``(parameter, link)`` readings to probe for a factor on the autograd leaves ``zs``
    (``link`` ``None``: the registered likelihood's own). The registered one first, where its
    other parameters are free of ``zs`` and it depends on them; then, where exactly one
    constructor parameter depends on ``zs``, that parameter through every link of its
    support (:data:`LINKS`). Empty when two parameters depend on ``zs``."""
    zs = list(zs)
    try:
        known = _CANDIDATES.get(base)
    except TypeError:  # (an unhashable distribution: no memory)
        known = None
    if known is not None and len(known[0]) == len(zs) and all(map(operator.is_, known[0], zs)):
        return list(known[1])
    out = _linear_candidates(base, zs)
    try:
        _CANDIDATES[base] = (zs, tuple(out))
    except TypeError:
        pass
    return out


def _linear_candidates(base, zs) -> List[Tuple[str, Optional[str]]]:
    depends = _Depends(zs)
    out: List[Tuple[str, Optional[str]]] = []
    cls = _registered(base)
    if cls is not None:
        name, value, others = linear_param(base)
        if depends(value) and not any(depends(v) for v in others.values()):
            out.append((name, None))
    pairs = link_candidates(base)
    touched = {p for p in _constructor_args(base) if depends(getattr(base, p))}
    if len(touched) != 1:
        return out
    registered = None
    if cls is not None:
        name, g_inv, _ = LINEAR_PARAMS[cls]
        registered = (name, "identity" if g_inv is _identity else "exp")
    return out + [(p, g) for p, g in pairs if p in touched and (p, g) != registered]


def linear_param(
    base, param: Optional[str] = None, link: Optional[str] = None
) -> Optional[Tuple[str, torch.Tensor, Dict[str, torch.Tensor]]]:
    """``(name, g^-1(value), other_params)``: with ``link`` the parameter ``param`` through the
    link ``LINKS[link]``; without, a registered likelihood's linear parameter (``None`` for an
    unregistered one)."""
    if link is not None:
        value = LINKS[link][1](getattr(base, param))
        others = {k: getattr(base, k) for k in _constructor_args(base) if k != param}
        return param, value, others
    cls = _registered(base)
    if cls is None:
        return None
    name, g_inv, _ = LINEAR_PARAMS[cls]
    value = g_inv(getattr(base, name))
    others = {k: getattr(base, k) for k in _OTHER_ARGS[cls]}
    return name, value, others


def has_learnable_params(base, param: Optional[str] = None, link: Optional[str] = None) -> bool:
    """Whether a parameter of ``base`` other than its linear one carries a graph (a learned
    scale, degrees of freedom, total count): the expected log-density must then keep it."""
    others = linear_param(base, param, link)[2]
    return any(torch.is_tensor(v) and v.requires_grad for v in others.values())


def with_param(
    base, linked_value: torch.Tensor, param: Optional[str] = None, link: Optional[str] = None
):
    """A copy of ``base`` whose linear parameter is ``g(linked_value)`` (the registered one, or
    ``param`` through ``LINKS[link]``)."""
    if link is not None:
        kwargs = linear_param(base, param, link)[2]
        kwargs[param] = LINKS[link][0](linked_value)
        return type(base)(**kwargs, validate_args=False)
    cls = _registered(base)
    name, _, inv = LINEAR_PARAMS[cls]
    kwargs = {k: getattr(base, k) for k in _OTHER_ARGS[cls]}
    kwargs[name] = inv(linked_value)
    return type(base)(**kwargs, validate_args=False)


def describe_link(base, param: str, link: Optional[str], rhs: str = "") -> str:
    """``"log(rate)"``, ``"logits"``, ``"scale = exp(.)"``: how the affine part enters; with
    ``rhs`` the equation (``"log(rate) = A z + c"``, ``"scale = exp(.) with . = A z + c"``)."""
    if link is None:
        how = "log(rate)" if param == "rate" else param
    else:
        how = param if link == "identity" else f"{param} = {link}(.)"
    if not rhs:
        return how
    return f"{how} = {rhs}" if link in (None, "identity") else f"{how} with . = {rhs}"


def no_link_reason(base, zs, candidates, label: str) -> str:
    """Why a factor on the leaves ``zs`` is no linear predictor, having probed ``candidates``:
    two of its parameters depend on them, or none of the readings tried is affine."""
    kind_name = type(base).__name__
    touched = [p for p in _constructor_args(base) if _depends(getattr(base, p), zs)]
    if len(touched) > 1:
        return f"{kind_name} {', '.join(touched)} depend on {label}: no one linear predictor"
    tried = ", ".join(describe_link(base, n, g) for n, g in candidates)
    if not tried:
        return f"{kind_name}: no parameter of it carries {label} through a link"
    return f"{kind_name} {tried} not affine in {label} (probed)"


def linked_reader(param: str, link: Optional[str]) -> Callable:
    """``fn -> g^-1(fn.param)``: the linked value of a distribution (for probes)."""
    return lambda fn: linear_param(fn, param, link)[1]


def rebuilds(site, base, value, name: str, link) -> bool:
    """Whether the distribution rebuilt from the linked parameter (``with_param``) has the
    site's log density at its value (a constructor that takes the parameter as read)."""
    if link is None:
        return True
    y = site["value"]
    try:
        with torch.no_grad():
            again = with_param(base, value.detach(), name, link).log_prob(y)
            lp = base.log_prob(y)
    except (ValueError, RuntimeError, TypeError):
        return False
    again, lp = torch.broadcast_tensors(again, lp)
    ok = torch.isfinite(lp)
    return probes.close(again[ok], lp[ok], probes.rtol(lp.dtype))
