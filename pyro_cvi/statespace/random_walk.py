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

Anything else (a reversed or partial cumsum, an element seeing two steps, another latent in
a factor) leaves the site to the dense Gaussian block. Switch the detection off with
``RECOGNISE_RANDOM_WALKS = False``.
"""

from __future__ import annotations

from typing import List, Optional, Set

import torch

from ..model.tracing import linear_candidates, linear_param, unwrap
from .detect import MIN_LOOP_LENGTH, ChainSpec, observation_factor, observation_rows
from .increments import Increments

__all__ = ["RECOGNISE_RANDOM_WALKS", "find_random_walks"]

RECOGNISE_RANDOM_WALKS = True


def find_random_walks(an, used: Set[str]) -> List[ChainSpec]:
    """Every random-walk chain of the model (``an``: the Analysis) outside ``used``."""
    if not RECOGNISE_RANDOM_WALKS:
        return []
    out = []
    for name in an.values:
        if name in an.continuous and name not in used:
            spec = _random_walk(an, name)
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


def _observations(an, name: str) -> Optional[List[str]]:
    """The factors of ``name``: each depends on it alone and is a registered likelihood."""
    out = []
    for site, deps in an.deps.items():
        if name not in deps or site in an.leaves:
            continue
        if deps != {name} or site in an.values or an.minibatch_plate(site) is not None:
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
        # one probe run, moved by a random direction of the states (O(1) per step)
        x0 = inc.states(an.ref[name].reshape(-1))
        g = torch.Generator(device="cpu").manual_seed(11)
        scale = float(x0.abs().mean().clamp_min(1.0))
        dx = (scale * torch.randn(x0.shape, generator=g, dtype=torch.float64, device=g.device)).to(
            x0
        )
        with torch.no_grad():
            moved = an.run(**{name: an.ref[name] + inc.increments(dx).reshape(shape)})
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
