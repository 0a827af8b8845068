"""Which latents go to the *remainder*: one joint Gaussian for everything without an exact message.

CVI is exact (conjugate, Algorithm 1's sites with Gauss-Hermite messages, Kalman smoothing,
enumeration) only where a latent's factors have a closed-form message. A latent with a
*general* factor (no closed form: a Monte Carlo message) gets no exact update whatever its
``q``; a mean-field exponential-family ``q`` for it loses the correlations that a joint
Gaussian keeps (and, with Monte Carlo messages in mean parameters, is stepped far more noisily
than by the reparameterised gradient of Pyro's Gaussian guides). So such latents go, on their
unconstrained space, into one Gaussian stepped by natural gradients
(:mod:`pyro_cvi.blocks.remainder`).

The remainder is a union of connected components of the factor graph *through the latents
without an exact block*: a *seed* (a latent with a general factor: a mean-field latent with a
Monte Carlo message, a member of a Gaussian block with a general factor whose dense Price
messages would be too costly, a continuous latent of the collapsed group) pulls in every
natural-form latent that shares a factor with it, repeatedly. A Gaussian site block that is
no seed (its factors have exact rows, linear-predictor sites, or dense Price messages) stays
out and keeps its exact messages (Algorithm 2 between blocks): a factor it shares with the
remainder is owned by the remainder, which estimates its expectation with the block's latents
drawn from their ``q``, and sends the block a Bonnet/Price message with the remainder's
latents drawn from the remainder's ``q`` (eqs. 30-31 under ``q(remainder)``). Finite discrete
latents inside a remainder component are summed out in its log joint (Pyro's TraceEnum
contraction), as ``TraceEnum_ELBO`` does for AutoNormal; a component with discrete latents
takes in its Gaussian blocks too (their exact rows would need expectations over the summed-out
labels). A component stays as it was (mean field) where the remainder cannot hold it: a
latent inside a subsampled plate (its sites change per minibatch), a latent whose ``q`` family
the user chose (``AutoCVI(families=...)``, other than ``"gaussian"``), or a data-parallel run.
"""

from __future__ import annotations

from typing import Dict, List, Set, Tuple

from .records import COLLAPSED, GENERAL, NATGRAD, NATURAL, REMAINDER, SITE, Factor
from .tracing import is_random

__all__ = ["remainder_sets", "apply_remainder", "remainder_sites", "remainder_factor"]


def _components(an, nodes: Set[str]) -> Dict[str, str]:
    """Union-find over ``nodes``: two of them are joined when one factor holds both."""
    parent = {n: n for n in nodes}

    def find(n):
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for site, node in an.structure.nodes.items():
        if node["type"] != "sample" or site in an.leaves:
            continue
        members = sorted(an.latents_of(site) & nodes)
        for m in members[1:]:
            parent[find(m)] = find(members[0])
    return {n: find(n) for n in nodes}


def _seeds(an, moves) -> Set[str]:
    """Latents with a general (Monte Carlo) factor; ``moves(D)``: whether a Gaussian block of
    ``D`` coordinates with a general factor moves (small blocks keep their exact rows and
    Price's dense Hessian messages)."""
    seeds = set()
    for name, info in an.latents.items():
        if info.form == NATURAL and any(f.kind in (GENERAL, COLLAPSED) for f in info.factors):
            seeds.add(name)
    for block in an.blocks:
        if (
            block.chain is None
            and moves(block.dim)
            and any(f.kind == GENERAL and f.plate is None for f in block.factors)
        ):
            seeds.update(block.names)
    return seeds


def _blocked(an, name: str, chosen: Set[str]) -> bool:
    """Whether latent ``name`` cannot live in the remainder (see the module docstring)."""
    if name in chosen:
        return True
    info = an.latents.get(name)
    frames = info.frames if info is not None else an.structure.nodes[name]["cond_indep_stack"]
    return any(f.name in an.minibatch_plates for f in frames)


def remainder_sets(an, chosen: Set[str], moves) -> Tuple[List[str], Set[str]]:
    """``(continuous latents of the remainder in model order, discrete latents it sums out)``.

    ``chosen``: latents whose family the user fixed (they and their components stay out);
    ``moves(D)``: whether a Gaussian block of ``D`` coordinates with a general factor joins."""
    seeds = _seeds(an, moves)
    if not seeds:
        return [], set()
    nodes = {n for n in an.values if n not in an.leaves}
    comp = _components(an, nodes - _kept_blocks(an, seeds))
    roots = {comp[s] for s in seeds}
    if any(comp.get(n) in roots for n in an.discrete):  # such a component takes its Gaussian
        comp = _components(an, nodes)  # blocks in (the module docstring)
        roots = {comp[s] for s in seeds}
    for n in comp:
        if comp[n] in roots and _blocked(an, n, chosen):
            roots.discard(comp[n])
    for n, info in an.latents.items():  # a Markov chain keeps its Kalman block (and component)
        if info.form == SITE and an.blocks[info.block].chain is not None and n in comp:
            roots.discard(comp[n])
    members = {n for n in comp if comp[n] in roots}
    continuous = [n for n in an.values if n in members and n not in an.discrete]
    discrete = {n for n in members if n in an.discrete}
    return continuous, discrete


def _kept_blocks(an, seeds: Set[str]) -> Set[str]:
    """Members of Gaussian site blocks that are no seed and whose priors are free of latents
    outside the block: they keep their exact block beside the remainder (Algorithm 2:
    messages under the other block's ``q``)."""
    kept = set()
    for block in an.blocks:
        names = set(block.names)
        free = all(not (an.latents_of(n) - names) for n in block.names)
        if block.chain is None and not names & seeds and free:
            kept.update(block.names)
    return kept


def apply_remainder(an, names: List[str], discrete: Set[str]) -> None:
    """Move ``names`` into the remainder (summing out ``discrete``) and classify again."""
    if not names:
        return
    an.remainder, an.remainder_discrete = names, set(discrete)
    for n in names:
        info = an.latents[n]
        info.form, info.block, info.factors = REMAINDER, None, []
    for n in discrete:
        an.latents.pop(n, None)
    an.collapsed |= an.remainder_discrete  # (summed out: no q)
    an.collapsed_sites = [s for s in an.collapsed_sites if s not in remainder_sites(an)]
    for info in an.latents.values():  # the rest is regrouped and classified afresh
        if info.form != REMAINDER:
            info.factors = []
    an.regroup()


def remainder_sites(an) -> Set[str]:
    """The factors (sample sites) that hold a remainder latent."""
    inside = set(an.remainder) | an.remainder_discrete
    return {
        s
        for s, node in an.structure.nodes.items()
        if is_random(node) and s not in an.leaves and (s in inside or an.latents_of(s) & inside)
    }


def remainder_factor(site: str) -> Factor:
    """The record of a factor the remainder owns."""
    why = "reparameterised gradient -> natural-gradient step of the joint Gaussian"
    return Factor(site, "remainder", NATGRAD, why)
