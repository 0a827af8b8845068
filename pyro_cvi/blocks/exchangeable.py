"""Label-symmetric components start apart.

A mixture's or an HMM's component parameters (``rates ~ Gamma(2, 1).expand([K]).to_event(1)``,
``with plate("components", K): locs ~ Normal(0, 5)``) have an exchangeable prior, and where the
likelihood is unchanged by relabelling the components (the weights or the transition matrix
at their symmetric start) every relabelling of a fit is a fit: the posterior has ``K!``
symmetric modes. Pyro's generic starts (``init_to_median``, ``init_to_mean``,
``init_to_feasible``) put every component at (nearly) the same point, the prior's centre or
medians of a few prior draws, so ``q`` starts at the saddle between the modes and the first
Monte Carlo draws decide which mode, and which of the non-symmetric local modes, it falls
into; Adam's guides leave it through their own noise.

:class:`ExchangeableStart` starts such components apart, opt-in through :func:`init_apart`
(``AutoCVI(model, init_loc_fn=init_apart(init_to_median))``). A site qualifies along one of its
dimensions (the last event dimension, or a plate's) when

* its start comes from a generic strategy (``value._pyro_custom_init is False``; a user's
  ``init_to_value`` is kept),
* its prior is univariate with equal parameters along that dimension (i.i.d. components),
* the dimension's size ``K`` is a number of states the model sums over (an enumerable
  latent's support, a ``DiscreteHMM``'s states, a ``MixtureSameFamily``'s components): the
  components are what the states index,
* the model's log joint at the start is unchanged by a cyclic relabelling of that dimension:
  ``log p(x) == log p(roll(x))`` for a start ``x`` with distinct components, the other
  sites at their starts and the discrete latents summed out
  (``TraceEnum_ELBO``), up to ``tol = sqrt(eps) (1 + |log p|)``. A regression's coefficients
  with an i.i.d. prior fail this test (the data tell them apart) and keep their start;
* and the data see the site at the start: moving it from tied components to ``x`` changes
  the log joint by more than its own prior term (by over ``10 tol``). A network's hidden
  units at an all-zero start are symmetric only because nothing downstream reads them yet
  (a neural network's, a factor model's weights), and keep their start.

Its components then start at the prior's ``K``-point quantization, component ``k`` at the
marginal's quantile ``(k - 1/2) / K`` (``icdf`` where it exists, else from 4,096 prior draws on
a fixed stream): no component favoured, the labels ordered, each component's start where a
``K``-th of the prior's mass lies. The test runs the model on a side trace with torch's random
stream restored afterwards, so every other start is drawn exactly as without it.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.autoguide.initialization import InitMessenger

__all__ = ["ExchangeableStart", "SPREAD_DRAWS", "init_apart", "quantized_start"]

#: prior draws for the quantiles of a marginal without ``icdf``
SPREAD_DRAWS = 4096


def _iid_base(fn, dim: int):
    """The univariate base of ``fn`` when its parameters are equal along batch dimension
    ``dim`` (negative, of the base's batch shape), else ``None``."""
    base = fn
    while isinstance(base, torch.distributions.Independent):
        base = base.base_dist
    if base.event_shape != () or base.support.is_discrete or -dim > len(base.batch_shape):
        return None
    names = list(getattr(base, "arg_constraints", {}))
    if not names:
        return None
    for name in names:
        try:
            par = getattr(base, name)
        except (AttributeError, NotImplementedError):
            return None
        if not torch.is_tensor(par):
            return None
        par = torch.broadcast_to(par, base.batch_shape)
        if not bool((par == par.narrow(dim, 0, 1)).all()):
            return None
    return base


def quantized_start(base, dim: int, like: torch.Tensor) -> Optional[torch.Tensor]:
    """The prior's ``K``-point quantization along ``dim`` (module docstring), shaped as
    ``like``; ``None`` where it is not finite or not in the support."""
    K = like.shape[dim]
    probs = (torch.arange(K, dtype=torch.float64, device=like.device) + 0.5) / K
    shape = [1] * len(base.batch_shape)
    shape[dim] = K
    with torch.no_grad():
        try:
            p = probs.to(base.mean.dtype).reshape(shape).expand(base.batch_shape)
            out = base.icdf(p)
        except (NotImplementedError, AttributeError, ValueError, RuntimeError):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                draws = base.sample((SPREAD_DRAWS,)).to(torch.float64)
            q = torch.quantile(draws, probs, dim=0)  # (K, *batch): every quantile everywhere
            idx = (
                torch.arange(K, device=q.device)
                .reshape(shape)
                .expand(base.batch_shape)
                .unsqueeze(0)
            )
            out = q.gather(0, idx).squeeze(0)  # component k at quantile k
        out = torch.broadcast_to(out.to(like), like.shape).clone()
    if not bool(torch.isfinite(out).all()) or not bool(base.support.check(out).all()):
        return None
    return out


def _candidates(trace) -> List[Tuple[str, int, Any, torch.Tensor]]:
    """``(name, dim of the value, univariate prior, start)`` of every site and dimension whose
    start is generic and whose prior is i.i.d. along it."""
    out = []
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or site["is_observed"] or not hasattr(site["fn"], "support"):
            continue
        value, fn = site["value"], site["fn"]
        if getattr(value, "_pyro_custom_init", True) is not False:
            continue
        if not torch.is_tensor(value) or not value.is_floating_point():
            continue
        edim = len(fn.event_shape)
        dims = []
        if edim and fn.event_shape[-1] > 1:
            dims.append(-1)
        for frame in site["cond_indep_stack"]:
            if frame.dim is not None and frame.size > 1 and frame.vectorized:
                dims.append(frame.dim - edim)
        for d in dims:  # (a univariate base's batch shape is the value's shape)
            if -d > value.dim() or value.shape[d] < 2:
                continue
            base = _iid_base(fn, d)
            if base is not None:
                out.append((name, d, base, value))
    return out


def _state_counts(trace) -> set:
    """The numbers of states the model sums or enumerates over: the support sizes of its
    enumerable latents, a ``DiscreteHMM``'s states, a ``MixtureSameFamily``'s components."""
    out = set()
    for site in trace.nodes.values():
        if site["type"] != "sample" or not hasattr(site["fn"], "support"):
            continue
        fn = site["fn"]
        while isinstance(
            fn, (torch.distributions.Independent, pyro.distributions.MaskedDistribution)
        ):
            fn = fn.base_dist
        if isinstance(fn, dist.DiscreteHMM):
            out.add(int(fn.initial_logits.shape[-1]))
        elif isinstance(fn, torch.distributions.MixtureSameFamily):
            out.add(int(fn.mixture_distribution.logits.shape[-1]))
        elif not site["is_observed"] and getattr(fn, "has_enumerate_support", False):
            try:
                out.add(int(fn.enumerate_support(expand=False).shape[0]))
            except (NotImplementedError, RuntimeError, ValueError):
                pass
    return out


def _log_joint(model, values: Dict[str, torch.Tensor], args, kwargs, nesting: int) -> float:
    """``log p(values, y)``, the discrete latents summed out."""
    conditioned = pyro.poutine.condition(model, data=values)
    enum = pyro.infer.config_enumerate(conditioned, default="parallel")
    elbo = pyro.infer.TraceEnum_ELBO(max_plate_nesting=nesting)
    with torch.no_grad(), pyro.poutine.block(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no site to enumerate: a plain log joint)
        return -float(elbo.loss(enum, lambda *a, **k: None, *args, **kwargs))


def _own_prior(model, values: Dict[str, torch.Tensor], name: str, args, kwargs) -> float:
    """The site ``name``'s own prior term ``log p(x_name | parents)`` at ``values``."""
    with torch.no_grad(), pyro.poutine.block():
        tr = pyro.poutine.trace(pyro.poutine.condition(model, data=values)).get_trace(
            *args, **kwargs
        )
    site = tr.nodes[name]
    return float(site["fn"].log_prob(site["value"]).sum())


#: model -> {(site, dim, shape, argument ids): label-symmetric?}: the test once per model and data
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weakref_able(model) -> bool:
    try:
        weakref.ref(model)
    except TypeError:
        return False
    return True


def symmetric_starts(model, init_fn: Callable, args, kwargs) -> Dict[str, torch.Tensor]:
    """The quantized starts of the label-symmetric sites (module docstring), by name."""
    try:
        with torch.random.fork_rng(devices=[]), pyro.poutine.block():
            trace = pyro.poutine.trace(InitMessenger(init_fn)(model)).get_trace(*args, **kwargs)
    except Exception:  # (the start itself fails: the caller's own run reports it)
        return {}
    cands = _candidates(trace)
    if cands:  # (components are labels only where states index them)
        states = _state_counts(trace)
        cands = [(n, d, b, v) for n, d, b, v in cands if v.shape[d] in states]
    cands = [(n, d, quantized_start(b, d, v)) for n, d, b, v in cands]
    cands = [(n, d, x) for n, d, x in cands if x is not None]
    if not cands:
        return {}
    values = {
        n: s["value"].detach()
        for n, s in trace.nodes.items()
        if s["type"] == "sample"
        and not s["is_observed"]
        and not getattr(getattr(s["fn"], "support", None), "is_discrete", True)
    }
    nesting = max(
        [-f.dim for s in trace.nodes.values() if s["type"] == "sample"
         for f in s["cond_indep_stack"] if f.dim is not None] + [0]
    )  # fmt: skip
    out: Dict[str, torch.Tensor] = {}
    known = _VERDICTS.setdefault(model, {}) if _weakref_able(model) else {}
    for name, d, start in cands:
        if name in out:
            continue
        key = (name, d, tuple(start.shape), start.dtype, tuple(id(a) for a in args))
        if key in known:  # (the same model and data: the engine's several start traces)
            if known[key]:
                start._pyro_custom_init = False
                out[name] = start
            continue
        known[key] = False
        test = dict(values)
        test[name] = start.narrow(d, start.shape[d] // 2, 1).expand_as(start)  # (tied)
        try:
            with torch.random.fork_rng(devices=[]):
                tied = test[name]
                test[name] = start
                lp = _log_joint(model, test, args, kwargs, nesting)
                prior = _own_prior(model, test, name, args, kwargs)
                test[name] = start.roll(1, d)
                lp_rolled = _log_joint(model, test, args, kwargs, nesting)
                tol = math.sqrt(torch.finfo(start.dtype).eps) * (1 + abs(lp))
                if not (math.isfinite(lp) and abs(lp - lp_rolled) <= tol):
                    continue
                test[name] = tied
                lp_held = _log_joint(model, test, args, kwargs, nesting)
                prior_held = _own_prior(model, test, name, args, kwargs)
        except Exception:  # a model the test cannot sum: no symmetry claimed
            continue
        seen = abs((lp - lp_held) - (prior - prior_held)) > 10 * tol
        if seen:
            known[key] = True
            start._pyro_custom_init = False
            out[name] = start
    return out


def init_apart(init_loc_fn: Callable) -> Callable:
    """``init_loc_fn`` (a Pyro init strategy, e.g. ``init_to_median``) with label-symmetric
    components started apart (module docstring), for ``AutoCVI(model, init_loc_fn=...)``:
    ``AutoCVI(model, init_loc_fn=init_apart(init_to_median))``. Opt-in: on an HMM whose
    states overlap it moved single fits both ways (a few nats), and the zoo's mixtures and
    HMMs fit the same either way."""

    @functools.wraps(init_loc_fn)
    def init_fn(site=None):
        return init_loc_fn(site)

    init_fn.spread_exchangeable = True  # type: ignore[attr-defined]
    return init_fn


class ExchangeableStart:
    """``ExchangeableStart(init_fn)(model)``: the model under Pyro's ``InitMessenger(init_fn)``
    with the label-symmetric sites' starts replaced by their quantized starts (module
    docstring)."""

    def __init__(self, init_fn: Callable) -> None:
        self.init_fn = init_fn

    def __call__(self, model: Callable) -> Callable:
        @functools.wraps(model)
        def run(*args, **kwargs):
            spread = symmetric_starts(model, self.init_fn, args, kwargs)

            def init_fn(site):
                if site["name"] in spread:
                    return spread[site["name"]]
                return self.init_fn(site)

            return InitMessenger(init_fn)(model)(*args, **kwargs)

        return run
