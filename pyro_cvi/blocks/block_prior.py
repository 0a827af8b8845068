"""The joint Normal/MVN prior of a Gaussian block, read off a trace of the model (eq. 2's
``eta``): independent sites in diagonal, precision or covariance form, a linear-Gaussian tree
in information form (:mod:`~pyro_cvi.model.gaussian_tree`)."""

from __future__ import annotations

from typing import List

import torch

from ..linear_gaussian import GaussianPrior
from ..model.analysis import BlockSpec
from ..model.gaussian_tree import tree_prior
from ..model.tracing import unwrap

__all__ = ["block_prior"]


def block_prior(spec: BlockSpec, trace) -> GaussianPrior:
    """The joint Normal/MVN prior of a block's sites, read off a trace of the model."""
    if spec.prior_rows:  # a linear-Gaussian tree: the joint prior in information form
        return tree_prior(spec, trace, _gaussian_prior)
    parts = [_gaussian_prior(trace.nodes[n]["fn"], k) for n, k in zip(spec.names, spec.sizes)]
    return parts[0] if len(parts) == 1 else _block_diag(parts)


def _gaussian_prior(fn, D: int) -> GaussianPrior:
    base, _, _ = unwrap(fn)
    if isinstance(base, torch.distributions.MultivariateNormal):
        loc = base.loc.expand(base.batch_shape + base.event_shape).reshape(-1)
        if "precision_matrix" in vars(base):  # the model gave a precision: keep it
            return GaussianPrior(loc, precision=base.precision_matrix)
        return GaussianPrior(loc, cov=base.covariance_matrix)
    loc = base.loc.expand(fn.shape()).reshape(-1)
    var = (base.scale**2).expand(fn.shape()).reshape(-1)
    if loc.numel() != D:
        raise ValueError(f"prior has {loc.numel()} elements, expected {D}")
    return GaussianPrior(loc, var=var)


def _block_diag(parts: List[GaussianPrior]) -> GaussianPrior:
    """The joint prior of independent sites: diagonal, precision or covariance form."""
    loc = torch.cat([p.loc for p in parts])
    if all(p.is_diagonal for p in parts):
        return GaussianPrior(loc, var=torch.cat([p.var for p in parts]))
    if any(p.precision is not None for p in parts):
        return GaussianPrior(
            loc, precision=torch.block_diag(*[p.precision_matrix() for p in parts])
        )
    covs = [torch.diag_embed(p.var) if p.is_diagonal else p.cov for p in parts]
    return GaussianPrior(loc, cov=torch.block_diag(*covs))
