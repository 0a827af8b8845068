"""Which latents each site of a traced model depends on: through autograd from continuous
latents made leaves (:func:`continuous_dependencies`), through the enumeration dims of
discrete latents (:func:`discrete_dependencies`), and through paths autograd does not record
(integer casts, ``detach``, ``.item()``), found by one run with every continuous latent moved
(:func:`hidden_dependencies`). A model that cannot run with enumeration dims (it asserts the
shapes of its own samples, as Pyro runs it without them) gets its discrete dependencies by
runs with each discrete latent moved instead (:func:`discrete_dependencies_of`)."""

from __future__ import annotations

from functools import partial
from typing import AbstractSet, Callable, Dict, Iterable, Optional, Set, Tuple, Union

import torch
from pyro.poutine.trace_struct import Trace

from . import probes
from .probes import MODEL_ERRORS
from .tracing import LOG_PROB_KEY, float_params, is_random, latent_weight, run_model, trace_model

__all__ = [
    "discover",
    "continuous_dependencies",
    "discrete_dependencies",
    "discrete_dependencies_of",
    "NotEnumerable",
    "unenumerated_leaves",
    "moved_discrete_dependencies",
    "hidden_dependencies",
    "RngWatch",
    "random_sites",
]


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


def discrete_dependencies_of(
    enumerated: Callable[[], Trace],
    trace: Trace,
    discrete: Iterable[str],
    rerun: Callable[[Dict[str, torch.Tensor]], Trace],
    ignore: AbstractSet[str] = frozenset(),
) -> Tuple[Dict[str, Set[str]], Union[Trace, NotEnumerable]]:
    """``(dependencies, enumerated trace)``: from the enumerated run ``enumerated()`` where the
    model runs so (:func:`discrete_dependencies`); where it refuses (a model asserting its own
    sample shapes, written for Pyro's ``Trace_ELBO``, which adds no enumeration dim), from
    unenumerated runs with each discrete latent moved (:func:`moved_discrete_dependencies`),
    and why it refused (a :class:`NotEnumerable`) in place of the trace. The moved runs also
    check an enumerated run that succeeded: a site that moves with a discrete latent but does
    not broadcast over its enumeration dim (outside ``ignore``, the sites that draw
    randomness of their own) makes the model one that does not run enumerated."""
    discrete = list(discrete)
    try:
        with torch.enable_grad():
            tr = enumerated()
    except MODEL_ERRORS as e:
        deps = moved_discrete_dependencies(trace, discrete, rerun)
        return deps, NotEnumerable(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    deps = discrete_dependencies(tr, discrete)
    # a model that runs enumerated but does not broadcast over the enumeration dims (a
    # .view/.reshape to a fixed shape, a sum or index over a fixed dim) hides a dependency
    # there: the moved runs, as Pyro runs the model, see it
    moved = moved_discrete_dependencies(trace, discrete, rerun, exact_only=True)
    for n, cs in moved.items():
        hidden = sorted(cs - deps.get(n, set()) - ignore)
        if hidden and n not in ignore:
            return moved_discrete_dependencies(trace, discrete, rerun), NotEnumerable(
                f"site {n!r} reads discrete latent {hidden[0]!r} but does not broadcast over "
                "its enumeration dim: a .view/.reshape to a fixed shape, or an index or sum "
                "over a fixed dim, where x.shape[-k:] or a negative dim is needed"
            )
    return deps, tr


class NotEnumerable:
    """Why a model cannot run with enumeration dims (the error it raised there)."""

    def __init__(self, why: str):
        self.why = why


def unenumerated_leaves(
    leaves: Set[str],
    deps: Dict[str, Set[str]],
    latents: Iterable[str],
    discrete: Iterable[str],
    nodes,
    why: NotEnumerable,
) -> Set[str]:
    """The leaves of a model that cannot run enumerated: ``leaves`` and, repeatedly, every
    unweighted latent whose dependents are all latent leaves (a prior-only subtree:
    ``q(x, y) = p(x) p(y | x)`` is its exact posterior, which no enumeration needs). A discrete
    latent left outside them would need a ``q`` whose messages enumerate it: refused, naming
    the error the model raised with enumeration dims."""
    leaves, latents = set(leaves), set(latents)
    changed = True
    while changed:
        changed = False
        for x in sorted(latents - leaves):
            users = {n for n, d in deps.items() if x in d and n != x}
            if users <= leaves and latent_weight(nodes[x]) is None:
                leaves.add(x)
                changed = True
    left = sorted(set(discrete) - leaves)
    if left:
        raise ValueError(
            f"AutoCVI: the model fails when run with enumeration dims ({why.why}), and the "
            f"discrete latent site(s) {', '.join(map(repr, left))} need them: their q's "
            "messages sum over their values in parallel, as TraceEnum_ELBO does. Make the "
            "model broadcast over extra dims on the left of its plates (check x.shape[-k:] "
            "rather than x.shape, e.g. in an assert), or collapse them with "
            "AutoCVI(discrete='collapse') once it runs so."
        )
    return leaves


def moved_discrete_dependencies(
    trace: Trace,
    discrete: Iterable[str],
    rerun: Callable[[Dict[str, torch.Tensor]], Trace],
    exact_only: bool = False,
) -> Dict[str, Set[str]]:
    """For each sample site of the unenumerated ``trace``, the discrete latents it depends on:
    one run per discrete latent ``c`` with every element of it moved to the next value of its
    support (``(c + 1) mod K``; a one-hot value rolled); a site whose parameters (or observed
    value) move depends on ``c``. A latent whose support is not ``0..K-1`` or one-hot counts as
    a dependency of every site after it (conservative; with ``exact_only``, of none)."""
    names = [n for n, s in trace.nodes.items() if is_random(s)]
    out: Dict[str, Set[str]] = {n: set() for n in names}
    for c in discrete:
        site = trace.nodes[c]
        moved = _next_value(site)
        after = names[names.index(c) + 1 :]
        if moved is None:
            for n in after if not exact_only else ():
                out[n].add(c)
            continue
        with torch.no_grad():
            other = rerun({c: moved})
        for n in after:
            if n not in other.nodes or _site_moved(trace.nodes[n], other.nodes[n], n != c):
                out[n].add(c)
    return out


def _next_value(site) -> Optional[torch.Tensor]:
    """Every element of a discrete latent's value moved to the next value of its support, or
    ``None`` for a support other than ``0..K-1`` or one-hot."""
    fn, v = site["fn"], site["value"]
    try:
        support = fn.enumerate_support(expand=False)
    except (NotImplementedError, ValueError, RuntimeError):
        return None
    K = support.shape[0]
    if fn.event_shape and v.shape[-1] == K and bool(((v == 0) | (v == 1)).all()):
        return v.roll(1, -1)  # one-hot
    if fn.event_shape or not torch.equal(
        support.reshape(-1), torch.arange(K, device=support.device).to(support)
    ):
        return None
    return (v + 1).remainder(K)


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


def hidden_dependencies(
    trace: Trace,
    deps: Dict[str, Set[str]],
    rerun: Callable[[Dict[str, torch.Tensor]], Trace],
    at: Dict[str, torch.Tensor],
) -> Dict[str, Set[str]]:
    """``deps`` with the dependencies autograd does not record: a cast to an integer,
    ``detach``, ``.item()``. One run of the model (``rerun(values)``) with every continuous
    latent ``at`` moved (on its unconstrained scale, by at least 2 in each element, so that an
    integer cast moves too); a site with no recorded latent parent whose parameters (or
    observed value) move with them is run again per latent, to find which it reads. A model
    that cannot be run at the moved values keeps ``deps``."""
    if not at:
        return deps
    g = torch.Generator(device="cpu").manual_seed(13)  # (the user's RNG stream untouched)
    moved_at = {}
    for n, v in at.items():
        support = trace.nodes[n]["fn"].support
        if not v.numel() or support.is_discrete:
            continue
        try:
            t = torch.distributions.biject_to(support)
        except NotImplementedError:  # (a support with no transform: left where it is)
            continue
        with torch.no_grad():
            u = t.inv(v)
            r = torch.randn(u.shape, generator=g, dtype=torch.float64, device=g.device).to(u)
            d = r.sign() * (2 * u.abs().mean().clamp_min(1.0) + r.abs())
            moved_at[n] = t(u + d)
    try:
        with torch.no_grad():
            moved = rerun(moved_at)
        suspects = [
            n
            for n, d in deps.items()
            if not d and n in moved.nodes and _site_moved(trace.nodes[n], moved.nodes[n], n in at)
        ]
        if not suspects:
            return deps
        out = {n: set(d) for n, d in deps.items()}
        for z in moved_at:
            with torch.no_grad():
                one = rerun({z: moved_at[z]})
            for n in suspects:
                if n != z and n in one.nodes and _site_moved(trace.nodes[n], one.nodes[n], n in at):
                    out[n].add(z)
    except MODEL_ERRORS:  # (the model refuses the moved values: nothing more to learn here)
        return deps
    return out


def _site_moved(site, other, latent: bool) -> bool:
    """Whether a site's distribution parameters (and, observed, its value) differ between two
    runs (beyond the probes' tolerance)."""
    a, b = float_params(site["fn"]), float_params(other["fn"])
    if not latent:
        a, b = a + [site["value"]], b + [other["value"]]
    if len(a) != len(b):
        return True
    for x, y in zip(a, b):
        if not (torch.is_tensor(x) and torch.is_tensor(y)) or x.shape != y.shape:
            if x is not y:
                return True
            continue
        if not x.is_floating_point():
            if not torch.equal(x, y):
                return True
            continue
        if not probes.close(x.detach(), y.detach(), probes.rtol(x.dtype)):
            return True
    return False


def _log_prob(site) -> Optional[torch.Tensor]:
    """The site's log density at its value, where it has a graph (else ``None``); kept,
    detached, under :data:`~.tracing.LOG_PROB_KEY` for the density checks."""
    try:
        lp = site["fn"].log_prob(site["value"])
    except MODEL_ERRORS:  # (a density that cannot be evaluated here: its parameters decide)
        return None
    if not torch.is_tensor(lp):
        return None
    site[LOG_PROB_KEY] = lp.detach()
    return lp if lp.requires_grad else None


class RngWatch:
    """``rerun`` that records whether any call drew from torch's random stream: a model run
    with every latent fixed draws nothing, unless the model holds randomness that no handler
    sees (a latent hidden by ``poutine.block``, a ``torch.randn`` of its own)."""

    def __init__(self, rerun: Callable[[Dict[str, torch.Tensor]], Trace]):
        self.rerun, self.drew = rerun, False

    def __call__(self, values: Dict[str, torch.Tensor]) -> Trace:
        state = torch.get_rng_state()
        try:
            return self.rerun(values)
        finally:
            self.drew = self.drew or not torch.equal(state, torch.get_rng_state())


def random_sites(trace: Trace, rerun: Callable[[Dict[str, torch.Tensor]], Trace]) -> Set[str]:
    """The sites whose distribution (or observed value) differs between ``trace`` and a run at
    the same latent values (``rerun({})``): they read a draw the guide does not see, so one
    trace's exact message is one draw of a random message. (Pyro's Trace_ELBO averages
    over that draw; so must the messages.) A model that refuses the run gives none."""
    try:
        with torch.no_grad():
            again = rerun({})
    except MODEL_ERRORS:
        return set()
    return {
        n
        for n, s in trace.nodes.items()
        if is_random(s) and n in again.nodes and _site_moved(s, again.nodes[n], False)
    }


def discover(
    model,
    args,
    kwargs,
    structure: Trace,
    values,
    leaves,
    fixed,
    discrete,
    subsample,
    plate_dims: int,
):
    """Every site's latents: autograd from the continuous ``leaves``, paths autograd misses
    (one run with them moved), hidden randomness (a run at fixed latents that draws), and,
    with discrete latents, an enumerated trace (or moved runs where the model refuses
    enumeration dims). Returns ``(deps, random_sites, leaf_trace, not_enumerable)``: the
    trace to read leaves from (the enumerated one where it ran) and the
    :class:`NotEnumerable` reason or None."""
    deps = continuous_dependencies(structure, leaves)
    at = {n: values[n] for n in leaves}
    rerun = partial(_rerun, model, args, kwargs, {**fixed, **at, **subsample})
    watch = RngWatch(rerun)
    deps = hidden_dependencies(structure, deps, watch, at)
    randoms = random_sites(structure, rerun) if watch.drew else set()
    if not discrete:
        return deps, randoms, structure, None
    cont = {n: v for n, v in values.items() if n not in discrete}
    enumerated = partial(
        run_model, model, {**cont, **leaves, **subsample}, args, kwargs, plate_dims
    )
    extra, tr = discrete_dependencies_of(enumerated, structure, discrete, rerun, randoms)
    deps = {n: d | extra.get(n, set()) for n, d in deps.items()}
    if isinstance(tr, NotEnumerable):
        return deps, randoms, structure, tr
    return deps, randoms, tr, None


def _rerun(model, args, kwargs, base, values):
    """The model traced at ``base`` with ``values`` replacing some of it."""
    return trace_model(model, {**base, **values}, args, kwargs)
