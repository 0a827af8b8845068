"""A random walk written with a plate and ``cumsum`` whose scales are latents of the remainder.

``with pyro.plate("time", T): eps = pyro.sample("eps", Normal(mu, s_e(u)))``,
``x = eps.cumsum(a)`` (any further dims of ``eps`` are the state), observed as
``y_r ~ Normal(h_r x_{t_r} + c_r, s_r(u))``: ``x = cumsum(eps)`` is a linear change of
variables with a unit triangular Jacobian, so ``q(eps)`` and ``q(x)`` are the same Gaussian
and the increments are the chain's transitions ``x_t = x_{t-1} + eps_t`` (``A = I``,
``b_t = mu_t``, ``Q_t = diag s_t(u)^2``, ``x_0 = eps_0``). It is the
``pyro.markov`` loop of :mod:`~pyro_cvi.blocks.scaled_markov` written the vectorised way, and
takes the same block under the same rule (:func:`~pyro_cvi.blocks.scaled_markov.take_chain`):
its one site ``eps`` holds every step; the guide's site stays ``eps``, in its plate.

Several increments sites of one shape inside nested cumsums (a local linear trend: ``level =
(eta.cumsum(-1) + eps).cumsum(-1)``) are one chain too
(:class:`~pyro_cvi.statespace.increments.NestedIncrements`: ``x_t = L x_(t-1) + e_t``, the
sites the innovations, diagonal ``Q``); the guide's sites stay ``eta`` and ``eps``.

Found (:func:`find_scaled_walks`) where every factor of the sites is an unmasked Normal
observation in no subsampled plate whose loc reads the sites only (the sites: ``eps`` and
every latent those locs read beside it, at most :data:`MAX_LEVELS`, their nesting orders tried
in turn), each element affine in one step
(:func:`~pyro_cvi.statespace.detect.observation_rows`, confirmed by one probe run), whose
scale reads latents outside the walk; and each site's own prior is an unmasked Normal whose
loc reads no latent. The time dim is the first dim of the sites' value (with at least
``MIN_LOOP_LENGTH`` elements) along which the rows read one step each. A scale that reads the
states (stochastic volatility), another likelihood, a loc that reads another latent, or sites
not nested (``cumsum(eta) + cumsum(eps)``) leave the sites where they were (the joint, a dense
block at the expected prior, or the plain random walk of
:mod:`~pyro_cvi.statespace.random_walk` when no scale is latent).
"""

from __future__ import annotations

import itertools
from typing import List, Optional, Tuple

import torch
from torch.distributions import biject_to

from ..model import probes
from ..model.prior_factor import JOINT_MAX_DIM
from ..model.structures import register_chain_finder
from ..model.tracing import unwrap
from ..model.weights import unit_scale, unweighted_normal_observation
from ..statespace import detect, random_walk
from ..statespace.increments import Increments, NestedIncrements
from .scaled_markov import ScaledChainSpec, take_chain
from .scaled_rows import reads

__all__ = ["MAX_LEVELS", "find_scaled_walks"]

#: the most increments sites one walk nests (their orders are tried in turn)
MAX_LEVELS = 4


def find_scaled_walks(an, used: set) -> List[ScaledChainSpec]:
    """Every plate-and-cumsum random walk with latent scales outside ``used`` that the rule
    takes (module docstring)."""
    families, remainder = getattr(an, "placed", (None, None))
    if remainder is None or not random_walk.RECOGNISE_RANDOM_WALKS:
        return []
    leaves = an.leaf_trace()[1]
    out: List[ScaledChainSpec] = []
    for name in an.values:
        taken = {n for c in out for n in c.names}
        if name in an.continuous and name in leaves and name not in used | taken:
            spec = _scaled_walk(an, name, families or {})
            if spec is not None and not set(spec.names) & used:
                out.append(spec)
    return out


def _increments(an, name: str) -> Optional[Increments]:
    node = an.structure.nodes[name]
    base, mask, _ = unwrap(node["fn"])
    if not isinstance(base, torch.distributions.Normal) or mask is not None:
        return None
    if (
        node["mask"] is not None
        or not unit_scale(node["scale"])
        or an.deps.get(name, set()) & an.discrete
    ):
        return None
    shape = an.values[name].shape
    if node["fn"].shape() != shape or max(shape, default=0) < detect.MIN_LOOP_LENGTH:
        return None
    if any(f.name in an.minibatch_plates for f in node["cond_indep_stack"]):
        return None
    return Increments(shape, 0)


def _group(an, name: str, tr, leaves) -> Optional[Tuple[List[str], List[str]]]:
    """The walk's sites (``name`` and every latent the observations' locs read beside it,
    model order) and its observations (Normal, unweighted), or ``None``."""
    group, sites = {name}, []
    while True:
        found = set()
        for site, deps in an.deps.items():
            if site in group or site in sites or not deps & group:
                continue
            fn = unweighted_normal_observation(an, site, tr.nodes[site])
            if fn is None:
                return None
            found |= reads(fn.loc, leaves)
            sites.append(site)
        if found <= group:
            break
        group |= found
        if len(group) > MAX_LEVELS:
            return None
    return [n for n in an.values if n in group], sites


def _scaled_walk(an, name: str, families) -> Optional[ScaledChainSpec]:
    if _increments(an, name) is None:
        return None
    tr, leaves = an.leaf_trace()
    grouped = _group(an, name, tr, leaves)
    if grouped is None:
        return None
    names, sites = grouped
    incs = [_increments(an, n) for n in names]
    if any(i is None or i.shape != incs[0].shape for i in incs) or not set(names) <= set(leaves):
        return None
    scales, scale_of = set(), {}
    for n in names:
        base = unwrap(tr.nodes[n]["fn"])[0]
        scale_of[n] = reads(base.scale, leaves)
        if reads(base.loc, leaves) or scale_of[n] & set(names):
            return None
        scales |= scale_of[n]
    for site in sites:
        fn = unweighted_normal_observation(an, site, tr.nodes[site])
        if not reads(fn.loc, leaves) or reads(fn.scale, leaves) & set(names):
            return None
        read = an.deps[site] - set(names)
        if read & (an.discrete | an.collapsed) or not read <= set(leaves):
            return None
        scales |= read
    placed = {families.get(n) for n in names}
    if not sites or not scales or "joint" in placed:
        return None
    size = len(names) * incs[0].shape.numel() + sum(
        int(biject_to(an.structure.nodes[z]["fn"].support).inv(an.values[z]).numel())
        for z in scales
        if z in an.values
    )
    if size <= JOINT_MAX_DIM and "gaussian" not in placed:
        return None  # (the joint keeps it: no rows read)
    shape = incs[0].shape
    for dim in (a for a in range(len(shape)) if shape[a] >= detect.MIN_LOOP_LENGTH):
        for order in itertools.permutations(names) if len(names) > 1 else [tuple(names)]:
            one = len(names) == 1
            inc = Increments(shape, dim) if one else NestedIncrements(shape, dim, sites=order)
            rows = _observation_rows(an, order, inc, sites)
            if rows is not None:
                obs = dict.fromkeys(sites, 0)
                return take_chain(an, order, obs, scales, families, scale_of, (inc, rows))
    return None


def _observation_rows(an, names, inc: Increments, sites) -> Optional[dict]:
    """``{site: (t, h, c)}``: each element of the observation's loc (broadcast to its value)
    is ``h' x_t + c`` (JVPs on the leaf trace, confirmed at one probe run), else ``None``."""
    tr, leaves = an.leaf_trace()
    spec = detect.ChainSpec(tuple(names), inc.state_dim, inc.length, False, increments=inc)
    found = {}
    for site in sites:
        node = tr.nodes[site]
        fn = unwrap(node["fn"])[0]
        shape = torch.broadcast_shapes(fn.loc.shape, fn.scale.shape, node["value"].shape)
        loc = fn.loc.expand(shape)
        with torch.enable_grad():
            try:
                t, h = detect.observation_rows(spec, loc, leaves)
            except (ValueError, RuntimeError):
                return None
        found[site] = (shape, loc.detach().reshape(-1), t, h.detach())
    x0, dx, moved = random_walk.probe_run(an, names, inc)  # (one probe run, for the rows)
    out = {}
    for site, (shape, loc, t, h) in found.items():
        c = loc - (h * x0[t]).sum(-1)
        moved_loc = unwrap(moved.nodes[site]["fn"])[0].loc.expand(shape).reshape(-1)
        pred = loc + (h * dx[t]).sum(-1)
        if not probes.close(moved_loc, pred, probes.rtol(x0.dtype)):
            return None  # (a loc not affine in the states)
        out[site] = (t, h, c)
    return out


register_chain_finder(find_scaled_walks)
