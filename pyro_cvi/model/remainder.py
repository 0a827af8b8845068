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
labels). A Gamma latent ``tau`` whose only general factors are Normal likelihoods with precision
``c * tau`` (``scale = (c tau)^(-1/2)``, probed) and a loc free of ``tau`` (anything in the
remainder's latents) stays out too and keeps its Gamma ``q``: such a factor is conjugate to
``tau`` given the others, ``log p = 1/2 log tau - tau c (y - loc)^2 / 2 + const``, so its
message is the expected natural parameter ``(1/2, -c E_q[(y - loc)^2] / 2)`` (eq. 20), the
expectation over draws of the remainder (:mod:`pyro_cvi.messages.precision`); the remainder
reads the factor at ``tau = E_q[tau]`` (exact in ``tau`` up to a constant of its latents).
A component of latents whose own priors are all of their ``q``'s (non-Gaussian) family given
their parents (Gamma layers with latent rates, a Dirichlet with latent concentrations) keeps
one exponential-family block per latent (:func:`prior_in_family`). Members Gaussian given the
others whose prior scale is a remainder latent (a random walk's increments under a latent step
scale, :func:`scaled_gaussians`) make the remainder take Price's dense Hessians, as a kept
precision does.
Members of a linear-Gaussian tree too large for one joint block (``theta_j ~ Normal(mu, tau)``
over many groups) keep natural-form Gaussian blocks beside it, their prior's and their
observations' expected natural parameters in closed form (:mod:`~pyro_cvi.model.beside`).
A component stays as it was (mean field) where the remainder cannot hold it: a
latent inside a subsampled plate (its sites change per minibatch), a latent whose ``q`` family
the user chose (``AutoCVI(families=...)``, other than ``"gaussian"``), or a data-parallel run.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import torch
from torch.distributions import biject_to

from ..families.gamma import Gamma
from . import conjugate_pairs as cp
from . import probes
from .beside import beside_candidates, observed_beside, observed_blocks, shares_remainder
from .prior_factor import JOINT_MAX_DIM, prior_applies
from .records import COLLAPSED, GENERAL, NATGRAD, NATURAL, REMAINDER, SITE, Factor
from .tracing import is_random, unwrap

__all__ = [
    "JOINT_MAX_DIM",
    "joint_dim",
    "remainder_sets",
    "apply_remainder",
    "remainder_sites",
    "remainder_factor",
]


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


def _seeds(an, moves, own: Set[str] = frozenset()) -> Set[str]:
    """Latents with a general (Monte Carlo) factor; ``moves(D)``: whether a Gaussian block of
    ``D`` coordinates with a general factor moves (small blocks keep their exact rows and
    Price's dense Hessian messages). A block with a latent the user named ``"gaussian"``
    (``own``) whose general factors are all Gaussian-linear given the others is no seed: they
    become exact expected messages beside the remainder."""
    seeds = set()
    for name, info in an.latents.items():
        if info.form == NATURAL and any(f.kind in (GENERAL, COLLAPSED) for f in info.factors):
            seeds.add(name)
    for block in an.blocks:
        general = [f for f in block.factors if f.kind == GENERAL and f.plate is None]
        if block.chain is None and moves(block.dim) and general:
            if set(block.names) & own and all(
                conjugate_given_others(an, f.site, block.names) for f in general
            ):
                continue
            seeds.update(block.names)
    return seeds


def _blocked(an, name: str, chosen: Set[str]) -> bool:
    """Whether latent ``name`` cannot live in the remainder (see the module docstring)."""
    if name in chosen:
        return True
    info = an.latents.get(name)
    frames = info.frames if info is not None else an.structure.nodes[name]["cond_indep_stack"]
    return any(f.name in an.minibatch_plates for f in frames)


def remainder_sets(
    an, chosen: Set[str], moves, families: Optional[Dict[str, str]] = None
) -> Tuple[List[str], Set[str], Dict[str, List[str]]]:
    """``(continuous latents of the remainder in model order, discrete latents it sums out,
    {Gamma precision kept beside it: its factors with Monte Carlo expected messages})``.

    ``chosen``: latents whose family the user fixed (they and their components stay out);
    ``moves(D)``: whether a Gaussian block of ``D`` coordinates with a general factor joins;
    ``families``: the user's ``AutoCVI(families=...)``. A block latent whose Normal prior reads
    remainder latents (:mod:`~pyro_cvi.model.prior_factor`) keeps its exact block beside the
    remainder (mean field, the prior's expected message) where the user names it
    ``"gaussian"``, or, unless the user names it ``"joint"``, where the joint Gaussian would
    otherwise hold more than :data:`JOINT_MAX_DIM` coordinates; else it shares the joint.
    ``an.prior_rule`` records, per latent that took the block, ``"named"`` or the joint's size."""
    named = {n for n, f in (families or {}).items() if f == "gaussian"}
    joint = {n for n, f in (families or {}).items() if f == "joint"}
    beside = beside_candidates(an, families)
    out, own = _settle(an, chosen, moves, named | beside)
    an.prior_rule = {n: "named" for n in own - beside}
    _record_beside(an, own & beside, out[0])
    size = joint_dim(an, out[0])
    auto = _prior_candidates(an) - named - joint if size > JOINT_MAX_DIM else set()
    if not auto:
        return out
    out, own = _settle(an, chosen, moves, named | auto | beside)
    an.prior_rule = {n: "named" if n in named else size for n in own - beside}
    _record_beside(an, own & beside, out[0])
    return out


def _record_beside(an, names: Set[str], members: List[str]) -> None:
    """``an.prior_beside``: ``{latent kept beside: its dropped tree}``; ``an.observed_beside``:
    ``{observation the remainder owns: the latent it sends exact messages}``."""
    an.prior_beside = {n: an.dropped_trees[n] for n in names}
    an.observed_beside = observed_beside(an, names, set(members))


def _settle(an, chosen: Set[str], moves, own: Set[str]):
    """:func:`_remainder_sets` with the block latents ``own`` whose prior's parents all end in
    the remainder (its closed form) and, for a natural-form latent among them
    (:func:`beside_candidates`), whose other factors hold none of its latents (they stay
    the mean field's exact factors) or are observations conjugate to it
    (:func:`~pyro_cvi.model.beside.shares_remainder`); ``(its result, those latents)``."""
    while True:
        out, kept = _remainder_sets(an, chosen, moves, own)
        members = set(out[0])
        late = {n for n in kept & own if an.latents_of(n) - _block_names(an, n) - members}
        late |= {n for n in kept & own if shares_remainder(an, n, members)}
        if not late:
            return out, kept & own
        own = own - late


def _prior_candidates(an) -> Set[str]:
    """Block latents whose Normal prior reads latents outside their block in the affine way
    :func:`~pyro_cvi.model.prior_factor.prior_applies` takes."""
    return {
        n
        for block in an.blocks
        for n in block.names
        if an.latents_of(n) - set(block.names) and prior_applies(an, n, block) is not None
    }


def joint_dim(an, names: List[str]) -> int:
    """The unconstrained coordinates of latents ``names`` (the remainder's joint Gaussian)."""
    nodes = an.structure.nodes
    return sum(int(biject_to(nodes[n]["fn"].support).inv(an.values[n]).numel()) for n in names)


def _block_names(an, name: str) -> Set[str]:
    info = an.latents.get(name)
    if info is None or info.block is None:
        return {name}
    return set(an.blocks[info.block].names)


def _remainder_sets(an, chosen: Set[str], moves, own: Set[str]):
    scaled = [b.chain for b in an.blocks if getattr(b.chain, "scales", ())]
    # natural-form Gaussians beside it (beside_candidates): no seed, their prior its factor
    natural = {n for n in own if n in an.latents and an.latents[n].form == NATURAL}
    seeds = (_seeds(an, moves, own) - natural) | {z for c in scaled for z in c.scales}
    precisions = _precision_candidates(an, seeds)
    seeds -= set(precisions)
    if not seeds:
        return ([], set(), {}), set()
    nodes = {n for n in an.values if n not in an.leaves}
    # a chain whose scales the remainder holds keeps its Kalman block beside it (its
    # expected messages, blocks/scaled_markov.py)
    kept_blocks = _kept_blocks(an, seeds, moves, own) | {n for c in scaled for n in c.names}
    kept_blocks = (kept_blocks - observed_blocks(an, natural)) | natural
    comp = _components(an, nodes - kept_blocks - set(precisions))
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
    for root in list(roots):  # exponential-family blocks, each conjugate to its own prior
        inside = [n for n in comp if comp[n] == root and n not in an.discrete]
        if all(prior_in_family(an, n) for n in inside):
            roots.discard(root)
    members = {n for n in comp if comp[n] in roots}
    continuous = [n for n in an.values if n in members and n not in an.discrete]
    discrete = {n for n in members if n in an.discrete}
    kept = {
        z: sites
        for z, sites in precisions.items()
        if all(an.latents_of(s) - {z} <= members for s in sites)
    }
    return (continuous, discrete, kept), kept_blocks


def prior_in_family(an, name: str) -> bool:
    """Whether latent ``name`` has a non-Gaussian exponential-family ``q`` (natural form) and its
    own prior is of that family whatever its parents' values (a Gamma with a latent rate, a
    Dirichlet with latent concentrations): the prior is then conjugate to ``q`` given the
    others, ``log p(z | pa) = <eta(pa), T(z)> - A(eta(pa))``, and its message is the expected
    natural parameter ``E_q[eta(pa)]`` (eq. 20). A component of such latents keeps one
    exponential-family block per latent: a joint Gaussian on their logarithms fits sparse
    posteriors (a Gamma or Dirichlet shape below one) worse than the family itself."""
    info = an.latents.get(name)
    if info is None or info.form != NATURAL or info.family is None or info.family.is_gaussian:
        return False
    try:
        info.family.dist_to_natural(an.structure.nodes[name]["fn"])
    except (TypeError, NotImplementedError, ValueError):
        return False
    return True


def _precision_candidates(an, seeds: Set[str]) -> Dict[str, List[str]]:
    """Natural-form Gamma latents whose general factors are all Normal likelihoods conjugate
    to them given other seeds (:func:`precision_given_others`): ``{latent: those factors}``."""
    out: Dict[str, List[str]] = {}
    for z in sorted(seeds, key=list(an.values).index):
        info = an.latents.get(z)
        if info is None or info.form != NATURAL or not isinstance(info.family, Gamma):
            continue
        general = [f.site for f in info.factors if f.kind in (GENERAL, COLLAPSED)]
        if general and all(
            an.latents_of(s) - {z}
            and an.latents_of(s) - {z} <= seeds - {z}
            and precision_given_others(an, s, z)
            for s in general
        ):
            out[z] = general
    return out


def precision_given_others(an, site: str, z: str) -> bool:
    """Whether factor ``site`` is an observed Normal whose precision ``scale^-2`` is ``c * z``
    (``c`` free of every latent; probed) and whose loc is free of ``z``: then ``log p`` is
    linear in ``(log z, z)`` given the other latents, the Gamma's sufficient statistics."""
    if site == z or site in an.collapsed_sites or an.minibatch_plate(site) is not None:
        return False
    base, leaves = _observed_normal(an, site)
    if base is None or z not in leaves or an.deps.get(site, set()) & an.discrete:
        return False
    loc, scale = base.loc, base.scale
    if not (torch.is_tensor(scale) and scale.requires_grad):
        return False
    names = list(leaves)
    with torch.enable_grad():
        gs = torch.autograd.grad(
            scale.sum(), [leaves[n] for n in names], allow_unused=True, retain_graph=True
        )
        if torch.is_tensor(loc) and loc.requires_grad:
            gl = torch.autograd.grad(loc.sum(), [leaves[z]], allow_unused=True, retain_graph=True)
            if gl[0] is not None and bool(gl[0].ne(0).any()):
                return False
    for n, g in zip(names, gs):
        if n != z and g is not None and bool(g.ne(0).any()):
            return False

    def precision(value):
        return unwrap(an.run(**{z: value}).nodes[site]["fn"])[0].scale ** -2

    return cp.check_monomial(precision, an.ref[z], probes.rtol(an.ref[z].dtype)) is None


def _kept_blocks(an, seeds: Set[str], moves, own: Set[str] = frozenset()) -> Set[str]:
    """Members of the Gaussian site blocks that stay exact beside the remainder (Algorithm 2:
    messages under the other blocks' ``q``): no seed, no Markov chain, a prior free of outside
    latents (or, for a latent in ``own``, a Normal prior affine in them,
    :func:`~pyro_cvi.model.prior_factor.prior_applies`), few enough coordinates for Price's dense
    Hessian (exact given the outside latents), and every factor it shares with outside latents
    Gaussian-linear given them (:func:`conjugate_given_others`)."""
    kept = set()
    for block in an.blocks:
        names = set(block.names)
        if block.chain is not None or names & seeds or (moves(block.dim) and not names & own):
            continue  # (a named block's shared factors must all be Gaussian-linear, below)
        if any(
            an.latents_of(n) - names and not (n in own and prior_applies(an, n, block) is not None)
            for n in block.names
        ):
            continue
        shared = [
            site
            for site, node in an.structure.nodes.items()
            if is_random(node)
            and site not in an.leaves
            and site not in names
            and an.latents_of(site) & names
            and an.latents_of(site) - names
        ]
        if all(conjugate_given_others(an, site, block.names) for site in shared):
            kept.update(names)
    return kept


def scaled_gaussians(an, names: List[str]) -> List[str]:
    """The remainder's latents ``names`` whose factors are all Gaussian in them given the others
    while a scale among ``names`` sets their curvature: a Normal prior whose scale is another
    remainder latent (:func:`prior_given_others`; a random walk's increments under a latent step
    scale) and every other factor :func:`conjugate_given_others`. Their curvature moves with the
    scale between steps, as beside a kept Gamma precision, so the remainder takes Price's dense
    Hessians at each step (:mod:`pyro_cvi.blocks.remainder`)."""
    out = []
    for n in names:
        if not (an.deps.get(n, set()) & set(names)) or not prior_given_others(an, n):
            continue
        factors = [
            s
            for s, node in an.structure.nodes.items()
            if is_random(node) and s != n and s not in an.leaves and n in an.latents_of(s)
        ]
        if factors and all(conjugate_given_others(an, s, [n]) for s in factors):
            out.append(n)
    return out


def prior_given_others(an, name: str) -> bool:
    """Whether latent ``name``'s prior is a Normal whose loc is free of every latent and whose
    scale is free of ``name``: given the other latents its log density is Gaussian in ``name``
    with precision ``scale^-2``."""
    tr, leaves = an.leaf_trace()
    base = unwrap(tr.nodes[name]["fn"])[0]
    if not isinstance(base, torch.distributions.Normal) or name not in leaves:
        return False
    loc, scale = base.loc, base.scale
    if torch.is_tensor(loc) and loc.requires_grad:
        return False
    if not (torch.is_tensor(scale) and scale.requires_grad):
        return True
    with torch.enable_grad():
        (g,) = torch.autograd.grad(
            scale.sum(), [leaves[name]], allow_unused=True, retain_graph=True
        )
    return g is None or not bool(g.ne(0).any())


def conjugate_given_others(an, site: str, names) -> bool:
    """Whether factor ``site`` is a Normal whose loc is affine in the block's latents ``names``
    with a coefficient free of every other latent, and whose scale is free of ``names``: then
    ``E_q[log p]`` is the block's Bayesian linear regression given ``E_q[1 / scale^2]`` of the
    others (eq. 20), and Price's Hessian at a draw of the others is that regression's."""
    base, leaves = _observed_normal(an, site)
    if base is None:
        return False
    own = [leaves[n] for n in names if n in leaves]
    others = [v for n, v in leaves.items() if n not in names]
    if not own:
        return False
    with torch.enable_grad():
        loc, scale = base.loc, base.scale
        if torch.is_tensor(scale) and scale.requires_grad:
            gs = torch.autograd.grad(scale.sum(), own, allow_unused=True, retain_graph=True)
            if any(g is not None and bool(g.ne(0).any()) for g in gs):
                return False
        if not (torch.is_tensor(loc) and loc.requires_grad):
            return False
        v = torch.randn_like(loc)
        gl = torch.autograd.grad((loc * v).sum(), own, allow_unused=True, create_graph=True)
        gl = [g for g in gl if g is not None]
        if not gl:
            return False
        probe = sum((g * torch.randn_like(g)).sum() for g in gl)
        if not probe.requires_grad:  # a coefficient free of every latent: affine
            return True
        second = torch.autograd.grad(probe, own + others, allow_unused=True, retain_graph=True)
        return all(g is None or not bool(g.ne(0).any()) for g in second)


def _observed_normal(an, site: str):
    """``(the Normal of factor site, the leaf trace's latents)`` when ``site`` is an observed
    Normal whose value carries no gradient (data), else ``(None, latents)``."""
    tr, leaves = an.leaf_trace()
    node = tr.nodes[site]
    base = unwrap(node["fn"])[0]
    if not isinstance(base, torch.distributions.Normal) or not node["is_observed"]:
        return None, leaves
    if torch.is_tensor(node["value"]) and node["value"].requires_grad:
        return None, leaves
    return base, leaves


def apply_remainder(
    an, names: List[str], discrete: Set[str], precisions: Dict[str, List[str]]
) -> None:
    """Move ``names`` into the remainder (summing out ``discrete``; ``precisions`` stay out
    with Monte Carlo expected messages) and classify again."""
    if not names:
        return
    an.remainder, an.remainder_discrete = names, set(discrete)
    an.precisions = dict(precisions)
    an.scaled_gaussians = scaled_gaussians(an, names)
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
