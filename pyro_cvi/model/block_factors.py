"""Factors of a Gaussian block in two settings the plain classification does not cover.

* :func:`cross_factor`: a factor the block shares with the remainder gets a Bonnet/Price
  message under the remainder's ``q`` (Algorithm 2 between blocks; the remainder owns its
  ELBO term), or, a Normal conjugate to the block given its scale, rows with the expected
  precision (:mod:`~pyro_cvi.model.scale_factor`).
* :func:`plate_factor`: a linear predictor in a vectorised subsampled plate keeps one site per
  data point of the whole plate (the incremental form, :mod:`pyro_cvi.blocks.plate_sites`).
* :func:`chain_factor`: a factor of a Markov block (the chain prior, or an observation affine in
  one step's state).
* :func:`enumerated_factor`: a Normal factor with discrete (mean-field) parents, loc affine in
  the block given them: exact rows per enumerated value weighted by ``q`` (eq. 20,
  :mod:`pyro_cvi.messages.enumerated`).
"""

from __future__ import annotations

import math
from typing import Optional, Set

import pyro.poutine
import torch

from . import probes
from .prior_factor import prior_factor
from .records import (
    CONJUGATE_ENUM,
    CONJUGATE_MC,
    GENERAL,
    LINEAR,
    PRIOR,
    SITE,
    SOFTMAX,
    Factor,
    centred_logits,
)
from .regime_chain import RULE, regime_chain_factor, regime_sites_factor
from .scale_factor import scale_factor
from .structures import chain_rules
from .tracing import (
    describe_link,
    has_learnable_params,
    linear_candidates,
    linear_param,
    linked_reader,
    rebuilds,
    subsample_values,
    unwrap,
)

__all__ = [
    "chain_factor",
    "cross_factor",
    "enumerated_factor",
    "plate_factor",
    "softmax_factor",
]


def cross_factor(an, site: str, inside: Set[str]) -> None:
    """A remainder factor that also holds latents of Gaussian site blocks: each such block
    gets a Bonnet/Price message under the remainder's ``q`` (Algorithm 2 between blocks;
    the remainder owns the factor's ELBO term); a Gamma noise precision kept beside it
    (``an.precisions``) gets the expected natural parameter, averaged over the remainder's
    draws."""
    lat = an.latents_of(site) - inside - an.collapsed
    blocks = {an.latents[n].block for n in lat if an.latents[n].form == SITE}
    given = ", ".join(sorted(an.latents_of(site) & inside))
    for b in sorted(blocks):
        block = an.blocks[b]
        expected = prior_factor(an, site, block)  # a block latent's prior given its scale
        if expected is None:
            expected = scale_factor(an, site, block)  # conjugate given the scale (eq. 20)
        if expected is not None:
            block.factors.append(expected)
            continue
        why = f"shared with the remainder; given {given} drawn from its q: Bonnet/Price"
        plate = an.minibatch_plate(site)
        block.factors.append(Factor(site, block.label, GENERAL, why, plate=plate))
    for z in sorted(lat, key=list(an.latents).index):
        if site in an.precisions.get(z, ()):
            why = (
                f"Normal precision of {z} given {given}: expected Gamma natural parameter, "
                "E_q[(y - loc)^2] by Monte Carlo over the remainder's q (eq. 20)"
            )
            an.latents[z].factors.append(Factor(site, z, CONJUGATE_MC, why))


def plate_factor(an, site: str, block, base, plate: str) -> Optional[Factor]:
    """A factor in a vectorised subsampled plate whose linked parameter is affine in the
    block, with rows and offsets free of the model's parameters: linear-predictor sites for
    every data point of the plate (eq. 13), those of each minibatch updated in place, the
    rest kept in a running sum (the incremental form of Algorithm 1 on minibatches). A
    Normal loc takes the same sites (its quadrature is exact). ``None``: not such a factor."""
    tr, leaves = an.leaf_trace()
    node = tr.nodes[site]
    frame = next(f for f in node["cond_indep_stack"] if f.name == plate)
    if not frame.vectorized or centred_logits(base) is not None or fixed_subsample(an, plate):
        return None
    if torch.is_tensor(node["value"]) and node["value"].requires_grad:
        return None
    zs = [leaves[n] for n in block.names]
    params = [s["value"] for s in tr.nodes.values() if s["type"] == "param"]
    with torch.enable_grad():
        candidates = linear_candidates(base, zs)
    for name, link in candidates:
        value = linear_param(base, name, link)[1]
        if has_learnable_params(base, name, link) or _has_graph_to(value, params):
            return None
        probed = an.probed_rows(site, block, value, linked_reader(name, link))
        if probed is None or probed[1] or not rebuilds(node, base, value, name, link):
            continue
        A = probed[0]
        axis = value.dim() - len(base.event_shape) + frame.dim
        full = list(value.shape)
        if axis < 0 or full[axis] != len(an.subsample[plate]):
            return None
        full[axis] = frame.full_size if frame.full_size is not None else frame.size
        how = describe_link(base, name, link, "A z + c")
        n = math.prod(full)
        why = (
            f"{type(base).__name__} {how} in subsampled plate {plate!r} (probed per "
            f"minibatch); {n} sites, the minibatch's updated in place"
        )
        f = Factor(site, block.label, LINEAR, why, name, A, True, link=link, plate=plate)
        f.minibatch = (axis, tuple(full))
        return f
    return None


def _has_graph_to(value: torch.Tensor, params) -> bool:
    """Whether ``value`` depends on any of the model's parameters ``params``."""
    if not params or not value.requires_grad:
        return False
    with torch.enable_grad():
        grads = torch.autograd.grad(value.sum(), params, allow_unused=True, retain_graph=True)
    return any(g is not None for g in grads)


def chain_factor(an, site: str, block, base) -> Factor:
    """A factor of a Markov block: the chain prior (Kalman smoother), or an observation
    affine in one step's state (linear-predictor sites); one shared probe run."""
    chain, (tr, leaves), label = block.chain, an.leaf_trace(), block.label
    if block.index not in an.probe_cache and chain.probe is not None:
        an.probe_cache[block.index] = chain.probe  # the random walk's detection probe
    if block.index not in an.probe_cache:
        (dz,) = probes.perturbations({n: an.ref[n] for n in block.names}, num_probes=1)
        with torch.no_grad():
            moved = an.run(**{n: an.ref[n] + dz[n] for n in block.names})
        dx = chain.states(torch.cat([dz[n].reshape(-1) for n in block.names]))
        an.probe_cache[block.index] = (dx, moved)
    dx, moved = an.probe_cache[block.index]
    if site not in block.names:
        found = chain.observations.get(site)
        name, rows, why, dyn, link = found or chain_rules().observation_factor(
            site, chain, base, tr, leaves, moved, dx
        )
        return Factor(site, label, LINEAR, why, name, rows[1], dyn, time_index=rows[0], link=link)
    if site != block.names[0]:
        return Factor(site, label, PRIOR, f"transition into {site}: in the chain prior")
    if not chain.ssm and chain.increments is None and not chain.regimes:
        with torch.enable_grad():
            chain_rules().prepare_loop(chain, tr, leaves, moved, label)
    why = f"Markov prior: Kalman smoother, O(T d^3) ({chain.size_text})"
    if chain.regimes:  # (its transitions are read per value of the regimes every step)
        why += f"; the expected prior over q({', '.join(chain.regimes)}) ({RULE})"
    if chain.increments is not None:
        why += "; " + chain.increments.describe(site)
    return Factor(site, label, PRIOR, why)


def fixed_subsample(an, plate: str, runs: int = 3) -> bool:
    """Whether the plate's minibatch is the same in every run (``pyro.plate(..., subsample=idx)``
    with fixed indices): Trace_ELBO's objective is then that subset's likelihood scaled by
    ``N / B``, not the whole plate's, and per-point sites of the whole plate would be the wrong
    answer. Decided by a few more model runs (cached per plate): random minibatches differ."""
    cache = an.fixed_subsamples
    if plate not in cache:
        first = an.subsample[plate]
        same = True
        with torch.no_grad():
            for _ in range(runs):
                tr = pyro.poutine.trace(an.model).get_trace(*an.args, **an.kwargs)
                other = subsample_values(tr).get(plate)
                same = same and other is not None and bool(torch.equal(other, first))
        cache[plate] = same
    return cache[plate]


def softmax_factor(an, site: str, block, base) -> Factor:
    """A Categorical / OneHotCategorical / Multinomial factor: softmax sites when its centred
    logits are affine in the block's z (Jacobian by autograd, confirmed by probing)."""
    label, kind_name = block.label, type(base).__name__
    value = centred_logits(base)
    K = value.shape[-1]
    if not value.requires_grad:
        return Factor(site, label, GENERAL, f"{kind_name} logits do not depend on {label}")
    probed = an.probed_rows(site, block, value, centred_logits, row_constant=True)
    if probed is None:
        why = f"{kind_name} logits are not affine in {label} (probed)"
        return Factor(site, label, GENERAL, why)
    A, dynamic = probed
    R, D = A.shape
    why = (
        f"{kind_name} logits = A z + c (probed, A: {R}x{D}); {R // K} coupled "
        f"K={K} sites (K x K each)"
    )
    return Factor(site, label, SOFTMAX, why, "logits", A, dynamic, num_classes=K)


def enumerated_factor(an, spec, block) -> Optional[Factor]:
    """The exact message of a factor with discrete parents to Gaussian ``block``
    (kind ``CONJUGATE_ENUM``), or ``None`` where it does not apply: an observed Normal whose
    loc is affine in the block given the discrete values (the scale free of the block), the
    discrete parents in the mean field (not summed out or in the remainder), outside a
    subsampled plate, the block not a chain. Other continuous parents enter at their means,
    exact under the mean field between blocks (the loc is affine in them too). On a chain
    whose regime latents the factor reads: :func:`~.regime_chain.regime_chain_factor`."""
    if block.chain is not None and block.chain.regimes:
        found = regime_chain_factor(an, spec, block)
        if found is not None or not spec.discrete & set(block.chain.regimes):
            return found
        base = unwrap(an.leaf_trace()[0].nodes[spec.site]["fn"])[0]
        return regime_sites_factor(an, spec, block, chain_factor(an, spec.site, block, base))
    loc = spec.roles.get("loc")
    if not (
        spec.exact
        and spec.discrete
        and spec.pattern is not None
        and spec.pattern.name == "Normal"
        and spec.value_kind == "observed"
        and loc is not None
        and loc.kind == "affine"
        and set(loc.parents) & set(block.names)
        and block.chain is None
        and not spec.collapsed
        and not spec.discrete & (an.collapsed | an.remainder_discrete)
        and an.minibatch_plate(spec.site) is None
    ):
        return None
    given = ", ".join(sorted(spec.discrete))
    others = ", ".join(sorted(spec.latents - set(block.names)))
    why = f"{spec.reason}: rows per value of {given} weighted by q, given {others} (eq. 20)"
    return Factor(
        spec.site,
        block.label,
        CONJUGATE_ENUM,
        why,
        "loc",
        dynamic=spec.dynamic,
        given_others=True,
        enumerated=tuple(sorted(spec.discrete)),
        enum_dims=an.enum_dims,
    )
