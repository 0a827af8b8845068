"""The ELBO terms no block owns: factors that depend on no latent (the engine adds them).

A factor whose owner is ``CONSTANT`` (e.g. an observation with learnable parameters only) is
a constant of ``q`` but part of the bound and of the hyperparameter gradients: its log-density
at the step's trace, weighted as Pyro weighs it (scale and mask), enters the ELBO as it is.
"""

from __future__ import annotations

import torch

from ..messages.expectations import site_weight
from ..model.analysis import CONSTANT, Analysis
from ..model.factor_roles import minibatch_renames

__all__ = ["constant_terms", "elbo_terms"]


def constant_terms(analysis: Analysis, trace, reducer=None) -> torch.Tensor:
    """``sum log p`` of the constant factors of ``trace`` (a data-parallel run: all ranks')."""
    if reducer is None and CONSTANT not in analysis.owner.values():
        return torch.zeros(())  # (none, in any minibatch: a sequential site's template is one)
    total = torch.zeros(())
    owners = dict(analysis.owner)
    for site, template in minibatch_renames(analysis, trace).items():
        if template is not None:  # a sequential plate's site of this minibatch
            owners.setdefault(site, owners[template])
    for site, owner in owners.items():
        if owner == CONSTANT and site in trace.nodes:  # (sequential minibatch sites vary)
            node = trace.nodes[site]
            lp = site_weight(node, node["fn"].log_prob(node["value"])).sum()
            total = total.to(lp) + lp
    shared = torch.zeros_like(total)
    # (the rank's data in a data-parallel run)
    return shared + total if reducer is None else reducer.combine(shared, total)


def elbo_terms(analysis: Analysis, ctx, blocks, reducer=None) -> torch.Tensor:
    """:func:`constant_terms` plus each block's ELBO terms (``block.messages(ctx)``), summed in
    that order; sets ``ctx.elbo`` to its value. Without constant factors the zero is left out
    where ``0 + x`` is ``x`` (the dtype unchanged: a float32 or float64 sum); the one number
    where it is not, ``x = -0.0``, is made ``0 + x`` after all (an ELBO of zero)."""
    terms = None
    if reducer is None and blocks and CONSTANT not in analysis.owner.values():
        terms = blocks[0].messages(ctx)
        if torch.promote_types(torch.get_default_dtype(), terms.dtype) != terms.dtype:
            terms = torch.zeros(()) + terms  # (a narrower dtype: promoted, as the zero does)
        blocks = blocks[1:]
    elbo = constant_terms(analysis, ctx.trace, reducer) if terms is None else terms
    for block in blocks:
        elbo = elbo + block.messages(ctx)
    ctx.elbo = float(elbo.detach())
    if terms is not None and ctx.elbo == 0.0:
        elbo = torch.zeros(()) + elbo  # (+0.0, as the sum from zero gives it)
        ctx.elbo = float(elbo.detach())
    return elbo
