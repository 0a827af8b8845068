"""Pyro's weights (``poutine.scale``, ``poutine.mask``, masked distributions) on latent priors,
where they change the form a latent takes: Trace_ELBO multiplies every model log-density by its
site's weight and leaves ``log q`` alone, so a weight ``c`` tempers a prior into ``p^c``
(:func:`~pyro_cvi.model.tracing.latent_weight`)."""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributions import Normal

from .tracing import latent_weight, unwrap

__all__ = [
    "UnboundedELBOError",
    "leaf_latents",
    "unit_scale",
    "unweighted_normal_observation",
    "weighted_chain",
    "weighted_leaf",
]


class UnboundedELBOError(ValueError):
    """A construct for which Trace_ELBO's objective has no maximum (raised at set-up)."""


def unit_scale(scale) -> bool:
    """Whether a site's ``scale`` (a number, or a tensor from ``poutine.scale``) is one
    everywhere."""
    if torch.is_tensor(scale):
        return bool((scale == 1).all())
    return scale == 1.0


def unweighted_normal_observation(an, site: str, node) -> Optional[Normal]:
    """The ``Normal`` of an observed ``site`` with no mask, no weight other than one and no
    minibatch plate (what a Kalman chain's observation rows can read), else ``None``."""
    if site in an.latents or not node["is_observed"]:
        return None
    base, mask, _ = unwrap(node["fn"])
    if not isinstance(base, Normal) or mask is not None or node["mask"] is not None:
        return None
    return None if not unit_scale(node["scale"]) or an.minibatch_plate(site) else base


def weighted_leaf(name: str, site) -> bool:
    """Whether latent ``name``, which nothing depends on, has a prior weight other than a
    mask: a leaf's ``q`` is its conditional prior, masked as the prior is (so a masked element
    adds nothing to the ELBO, as under Trace_ELBO with that guide), which is the optimum only
    for weights 0 and 1. A scaled leaf gets a ``q`` of its own instead (``q ~ p^c``); scaled and
    partly masked, its masked elements would be free in a ``q`` that is not masked: an error."""
    weight = latent_weight(site)
    if weight is None or bool(((weight == 0) | (weight == 1)).all()):
        return False
    if bool((weight == 0).any()):
        raise UnboundedELBOError(
            f"latent site {name!r} is both scaled and partly masked, and no other site "
            "depends on it: a q fitted to its tempered prior would leave the masked elements' "
            "ELBO term H(q) without a maximum. Scale it without the mask, or drop the masked "
            "elements from the site."
        )
    return True


def weighted_chain(structure, chain) -> bool:
    """Whether a Markov chain has a weight its Kalman block cannot take (the chain's
    ``takes_weights(trace)``: a loop with positive weights is tempered in the block, ``N^c =
    N(S / c)`` times a constant); such a chain goes to the blocks that weigh its prior element
    by element."""
    weighted = any(latent_weight(structure.nodes[n]) is not None for n in chain.names)
    return weighted and not chain.takes_weights(structure)


def leaf_latents(values, referenced, nodes, own_leaves: bool = False) -> set:
    """The latents no site depends on (``referenced``: the dependencies), whose ``q`` is their
    conditional prior; not a tempered one (:func:`weighted_leaf`), and with ``own_leaves`` not
    one whose prior a Gaussian ``q`` holds exactly (it starts at ``init_loc_fn``'s values)."""
    return {
        n
        for n in values
        if n not in referenced
        and not weighted_leaf(n, nodes[n])
        and not (own_leaves and _gaussian_prior(nodes[n]))
    }


def _gaussian_prior(site) -> bool:
    """Whether latent ``site``'s prior is an unmasked, unscaled Normal or MultivariateNormal (a
    Gaussian q holds it exactly; a masked element has no prior to hold)."""
    base, mask, _ = unwrap(site["fn"])
    if mask is not None or latent_weight(site) is not None:
        return False
    return type(base).__name__ in ("Normal", "MultivariateNormal")
