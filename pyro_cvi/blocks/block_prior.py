"""The joint Normal/MVN prior of a Gaussian block, read off a trace of the model (eq. 2's
``eta``): independent sites in diagonal, precision or covariance form, a linear-Gaussian tree
in information form (:mod:`~pyro_cvi.model.gaussian_tree`)."""

from __future__ import annotations

import math
from typing import List, Optional

import torch

from ..linear_gaussian import GaussianPrior
from ..messages.prior_expected import expected_prior
from ..model.analysis import BlockSpec
from ..model.gaussian_tree import tree_prior
from ..model.records import CONJUGATE_PRIOR
from ..model.tracing import latent_weight, unwrap

__all__ = ["block_prior", "expected_in", "temper"]


def block_prior(spec: BlockSpec, trace, ctx=None) -> GaussianPrior:
    """The joint Normal/MVN prior of a block's sites, read off a trace of the model; with a
    step context ``ctx``, a tree member whose prior reads the remainder (``CONJUGATE_PRIOR``)
    at its expected natural parameters under the remainder's ``q``
    (:mod:`~pyro_cvi.messages.prior_expected`)."""
    if spec.prior_rows:  # a linear-Gaussian tree: the joint prior in information form
        expected = None
        if ctx is not None and ctx.block_for is not None:
            expected = {f.site: expected_prior(ctx, f) for f in spec.factors if expected_in(f)}
        return tree_prior(spec, trace, _gaussian_prior, expected)
    parts = [
        _gaussian_prior(trace.nodes[n]["fn"], k, latent_weight(trace.nodes[n]))
        for n, k in zip(spec.names, spec.sizes)
    ]
    return parts[0] if len(parts) == 1 else _block_diag(parts)


def expected_in(spec_or_factor) -> bool:
    """Whether a block (its spec) or a factor has a prior read at expected natural parameters
    (it moves with the remainder's ``q``: no refresh is skipped)."""
    factors = getattr(spec_or_factor, "factors", None)
    if factors is None:
        return spec_or_factor.kind == CONJUGATE_PRIOR
    return any(f.kind == CONJUGATE_PRIOR for f in factors)


def _gaussian_prior(fn, D: int, weight: Optional[torch.Tensor] = None) -> GaussianPrior:
    """The prior of one site; with ``weight`` (:func:`~pyro_cvi.model.tracing.latent_weight`)
    the tempered ``prod_e N(z_e | m_e, S_e)^(c_e)`` (:func:`temper`)."""
    base, _, _ = unwrap(fn)
    if isinstance(base, torch.distributions.MultivariateNormal):
        loc = base.loc.expand(base.batch_shape + base.event_shape).reshape(-1)
        if weight is not None:
            return temper(base, weight, loc)
        if "precision_matrix" in vars(base):  # the model gave a precision: keep it
            return GaussianPrior(loc, precision=base.precision_matrix)
        return GaussianPrior(loc, cov=base.covariance_matrix)
    loc = base.loc.expand(fn.shape()).reshape(-1)
    var = (base.scale**2).expand(fn.shape()).reshape(-1)
    if loc.numel() != D:
        raise ValueError(f"prior has {loc.numel()} elements, expected {D}")
    if weight is not None:
        c = weight.to(var).reshape(-1)
        log_norm = (-0.5 * c * torch.log(2 * math.pi * var)).sum()
        if bool((c > 0).all()):
            return GaussianPrior(loc, var=var / c, log_norm=log_norm)
        return GaussianPrior(loc, precision=torch.diag_embed(c / var), log_norm=log_norm)
    return GaussianPrior(loc, var=var)


def temper(base: torch.distributions.MultivariateNormal, weight, loc) -> GaussianPrior:
    """``prod_b N(z_b | m_b, S_b)^(c_b)`` over the batch elements ``b`` of an MVN prior: the
    precision ``c_b S_b^-1`` (block-diagonal) and ``log_norm = -sum_b c_b log|2 pi S_b| / 2``."""
    k = base.event_shape[0]
    shape = base.batch_shape
    c = weight.to(loc).expand(shape).reshape(-1)
    P = base.precision_matrix.expand(shape + (k, k)).reshape(-1, k, k)
    log_norm = (c * base.log_prob(base.loc.expand(shape + (k,))).reshape(-1)).sum()
    return GaussianPrior(
        loc, precision=torch.block_diag(*(c[:, None, None] * P)), log_norm=log_norm
    )


def _block_diag(parts: List[GaussianPrior]) -> GaussianPrior:
    """The joint prior of independent sites: diagonal, precision or covariance form (a
    tempered part makes the joint unnormalised: the parts' ``log_norm`` add up)."""
    loc = torch.cat([p.loc for p in parts])
    log_norm = None
    if any(p.log_norm is not None for p in parts):
        log_norm = sum(p.normaliser() for p in parts)
    if all(p.is_diagonal for p in parts):
        return GaussianPrior(loc, var=torch.cat([p.var for p in parts]), log_norm=log_norm)
    if any(p.precision is not None for p in parts):
        return GaussianPrior(
            loc,
            precision=torch.block_diag(*[p.precision_matrix() for p in parts]),
            log_norm=log_norm,
        )
    covs = [torch.diag_embed(p.var) if p.is_diagonal else p.cov for p in parts]
    return GaussianPrior(loc, cov=torch.block_diag(*covs), log_norm=log_norm)
