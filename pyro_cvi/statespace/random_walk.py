"""Recognising a vectorised random walk, ``x = eps.cumsum(a)``, as a Markov chain (O(T)).

A latent site ``eps`` qualifies when (all confirmed on the analysis' traces, nothing read
from the model's source):

* its prior is an independent Normal (``Normal``, expanded, in plates or ``.to_event``) free
  of other latents, unmasked, in no subsampled plate;
* every factor that depends on it depends on it alone and is an observation (in no
  subsampled plate) one of whose parameters, through a link (``g^-1(param)``, e.g. the log
  of a Normal's scale), in the coordinates
  ``x = cumsum(eps)`` along some dim ``a`` of the site, has every element on one step:
  ``eta_r = h_r' x_{t_r} + c_r``, i.e. its Jacobian in ``eps`` has cumulative rows
  ``h_r[k] 1[s <= t_r]``. The rows come from
  Jacobian-vector products in O(T) memory (:func:`~.detect.observation_rows`, directions
  ``diff(dx)``), are confirmed by a random JVP, and affinity by one probe run at
  ``eps + diff(dx)``.

Several such sites of one shape inside nested cumsums, read together by their observations
(a local linear trend with fixed scales: ``level = (eta.cumsum(-1) + eps).cumsum(-1)``), are
one chain too (:class:`~.increments.NestedIncrements`: ``x_t = L x_(t-1) + e_t``, the sites the
innovations): every factor of the group depends on its sites only (at most
:data:`MAX_NESTED`, their nesting orders tried in turn), with rows and a probe run as above.

Anything else (a reversed or partial cumsum, an element seeing two steps, another latent in
a factor, walks side by side) leaves the site to the dense Gaussian block. Switch the
detection off with ``RECOGNISE_RANDOM_WALKS = False``.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, List, Optional, Sequence, Set, Tuple

import torch

from ..model.tracing import linear_candidates, linear_param, unwrap
from .detect import MIN_LOOP_LENGTH, ChainSpec, observation_factor, observation_rows
from .increments import Increments, NestedIncrements

__all__ = ["MAX_NESTED", "RECOGNISE_RANDOM_WALKS", "find_random_walks", "probe_run"]

RECOGNISE_RANDOM_WALKS = True
#: the most increments sites one nested walk holds (their orders are tried in turn)
MAX_NESTED = 4


def find_random_walks(an, used: Set[str]) -> List[ChainSpec]:
    """Every random-walk chain of the model (``an``: the Analysis) outside ``used``."""
    if not RECOGNISE_RANDOM_WALKS:
        return []
    out: List[ChainSpec] = []
    for name in an.values:
        taken = used | {n for c in out for n in c.names}
        if name in an.continuous and name not in taken:
            spec = _random_walk(an, name) or _nested_walk(an, name, taken)
            if spec is not None:
                out.append(spec)
    return out


def _increments_prior(an, name: str) -> bool:
    site = an.structure.nodes[name]
    base, mask, _ = unwrap(site["fn"])
    if mask is not None or not isinstance(base, torch.distributions.Normal):
        return False
    if an.deps.get(name) or site["fn"].shape() != an.values[name].shape:
        return False
    return not any(f.name in an.minibatch_plates for f in site["cond_indep_stack"])


def _observations(an, name: str, group: Optional[Set[str]] = None) -> Optional[List[str]]:
    """The factors of ``name``: each depends on it alone (on latents of ``group`` only) and
    is an observation in no subsampled plate."""
    out = []
    for site, deps in an.deps.items():
        if name not in deps or site in an.leaves:
            continue
        if not deps <= (group or {name}) or site in an.values:
            return None
        if an.minibatch_plate(site) is not None:
            return None
        out.append(site)
    return out or None


def _random_walk(an, name: str) -> Optional[ChainSpec]:
    if not _increments_prior(an, name):
        return None
    sites = _observations(an, name)
    if sites is None:
        return None
    tr, leaves = an.leaf_trace()
    shape = an.values[name].shape
    for dim in range(len(shape)):
        if shape[dim] < MIN_LOOP_LENGTH:
            continue
        inc = Increments(shape, dim)
        spec = ChainSpec((name,), inc.state_dim, inc.length, False, increments=inc)
        if not all(_one_step_rows(spec, tr, leaves, site) for site in sites):
            continue  # rejected on the leaf trace: no probe run needed
        _, dx, moved = probe_run(an, (name,), inc)
        try:
            for site in sites:
                base = unwrap(tr.nodes[site]["fn"])[0]
                spec.observations[site] = observation_factor(
                    site, spec, base, tr, leaves, moved, dx
                )
        except ValueError:
            continue
        spec.probe = (dx, moved)
        return spec
    return None


def _group(an, name: str) -> Optional[Tuple[List[str], List[str]]]:
    """The latents that ``name``'s observations read beside it, closed over theirs (model
    order, at most :data:`MAX_NESTED`), and all their observations, or ``None``."""
    group = {name}
    while True:
        grown = set(group)
        for site, deps in an.deps.items():
            if deps & group and site not in an.leaves and site not in an.values:
                grown |= deps
        if grown == group:
            break
        if len(grown) > MAX_NESTED or not grown <= set(an.values):
            return None
        group = grown
    sites = [_observations(an, n, group) for n in group]
    if len(group) < 2 or any(s is None for s in sites):
        return None
    return [n for n in an.values if n in group], list(dict.fromkeys(sum(sites, [])))


def _nested_walk(an, name: str, taken: Set[str]) -> Optional[ChainSpec]:
    """Increments sites nested in cumsums that their observations read together (module
    docstring): one chain, or ``None``."""
    grouped = _group(an, name) if _increments_prior(an, name) else None
    if grouped is None:
        return None
    names, sites = grouped
    shape = an.values[name].shape
    if set(names) & taken or not all(
        _increments_prior(an, n) and an.values[n].shape == shape for n in names
    ):
        return None
    tr, leaves = an.leaf_trace()
    for dim in (a for a in range(len(shape)) if shape[a] >= MIN_LOOP_LENGTH):
        for order in itertools.permutations(names):
            inc = NestedIncrements(shape, dim, sites=order)
            spec = ChainSpec(order, inc.state_dim, inc.length, False, increments=inc)
            if all(_one_step_rows(spec, tr, leaves, site) for site in sites):
                return _probed(an, spec, sites, tr, leaves)
    return None


def _probed(an, spec: ChainSpec, sites, tr, leaves) -> Optional[ChainSpec]:
    """``spec`` with its observations confirmed by one probe run that moves the increments
    (a direction of the states would move them by differences the nested cumsums cancel
    again), or ``None``."""
    _, dx, moved = probe_run(an, spec.names, spec.increments)
    try:
        for site in sites:
            base = unwrap(tr.nodes[site]["fn"])[0]
            spec.observations[site] = observation_factor(site, spec, base, tr, leaves, moved, dx)
    except ValueError:
        return None
    spec.probe = (dx, moved)
    return spec


def probe_run(an, names: Sequence[str], inc: Increments) -> Tuple[torch.Tensor, torch.Tensor, Any]:
    """One probe run of the model (``an``: the Analysis) with the walk's sites ``names`` moved
    by a fixed random direction (seed 11, scaled by ``s = max(1, mean |x_0|)``): ``(x_0, dx,
    the moved trace)``, ``x_0`` the states at the reference values, ``dx`` the states' move.

    One site moves its states by ``dx = s r`` (``eps = diff(dx)``); nested sites move their
    increments by ``s r / sqrt(T)`` (``dx`` their states): a direction of the states would move
    them by differences that the nested cumsums cancel again (``T^1.5`` rounding in float32).
    ``r`` is drawn and scaled in float64, then rounded once to the states' dtype."""
    x0 = inc.states(torch.cat([an.ref[n].detach().reshape(-1) for n in names]))
    g = torch.Generator(device="cpu").manual_seed(11)
    r = torch.randn(x0.numel(), generator=g, dtype=torch.float64, device=g.device)
    scale = float(x0.abs().mean().clamp_min(1.0))
    if isinstance(inc, NestedIncrements):
        moves = (scale / math.sqrt(inc.length) * r).to(x0)
        dx = inc.states(moves)
    else:
        dx = (scale * r.reshape(x0.shape)).to(x0)
        moves = inc.increments(dx)
    parts = moves.split([an.ref[n].numel() for n in names])
    with torch.no_grad():
        moved = an.run(**{n: an.ref[n] + v.reshape(an.ref[n].shape) for n, v in zip(names, parts)})
    return x0, dx, moved


def _one_step_rows(spec: ChainSpec, tr, leaves, site: str) -> bool:
    """Whether every element of one of the factor's linked parameters (through a link) sees
    one step (JVPs only)."""
    base = unwrap(tr.nodes[site]["fn"])[0]
    with torch.enable_grad():
        for name, link in linear_candidates(base, [leaves[n] for n in spec.names]):
            try:
                observation_rows(spec, linear_param(base, name, link)[1], leaves)
            except (ValueError, RuntimeError):
                continue
            return True
    return False
