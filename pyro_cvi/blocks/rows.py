"""A Gaussian block's factors as rows of its Bayesian linear regression, with or without graph.

Every conjugate, linear-predictor and softmax factor enters ``q`` as rows ``f = A z`` with
pseudo-observations (eq. 2 and 13): exact ones for a Normal likelihood, the site parameters for
the others. Rows *without* graph give the ``q`` that CVI steps from (its targets). Rows *with*
graph (``A`` given, e.g. ``A(theta)`` recomputed with ``create_graph``; offsets ``c(theta)``,
Normal scales) give the same ``q`` re-solved differentiably, so that the ELBO's gradient in the
model's parameters is the derivative of the reported loss at fixed site parameters.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ..context import Options
from ..linear_gaussian import GaussianPosterior, GaussianPrior
from ..messages.gaussian import RowBlock, linear_predictor_rows, linear_predictor_value, normal_rows
from ..messages.softmax_sites import SOFTMAX, SoftmaxRows, softmax_message, softmax_rows
from ..model.analysis import CONJUGATE

__all__ = ["factor_rows", "has_graph", "same_rows", "site_value"]


def factor_rows(
    f, site, z_at: torch.Tensor, sites, A: Optional[torch.Tensor] = None
) -> Tuple[Optional[str], object, Optional[Callable]]:
    """``(site name or None, rows, elbo_fn or None)`` of one factor at the trace ``site``:
    conjugate rows carry their ELBO function (:func:`~pyro_cvi.messages.gaussian.normal_rows`), site
    rows are named by their factor. With ``A`` the rows keep their graph."""
    if f.kind == CONJUGATE:
        r, fn = normal_rows(site, f, z_at, A)
        return None, r, fn
    if f.kind == SOFTMAX:
        return f.site, softmax_rows(site, f, z_at, A), None
    return f.site, linear_predictor_rows(site, f, z_at, sites[f.site].detach(), A), None


def has_graph(prior: GaussianPrior, rows) -> bool:
    """Whether the prior or any row tensor depends on the model's parameters."""
    tensors = [t for t in prior.tensors() if t is not None]
    for _, r in rows:
        tensors += [r.A, r.c] + ([r.w, r.b] if isinstance(r, RowBlock) else [])
    return any(t.requires_grad for t in tensors)


def site_value(site, rows, post: GaussianPosterior, sl: slice, options: Options) -> torch.Tensor:
    """``E_q[log p]`` of a site factor under a ``q`` solved with graph, with its graph to the
    rows and ``q`` (the value of its message,
    :func:`~pyro_cvi.messages.gaussian.linear_predictor_value`
    or :func:`~pyro_cvi.messages.softmax_sites.softmax_message`)."""
    if isinstance(rows, SoftmaxRows):
        cov = rows.cov_blocks(post, sl, post.rotations[site["name"]])
        samples = options.num_samples or 100
        return softmax_message(
            site, rows, post.loc, cov, options.softmax, options.num_quad_points, samples, True
        )[0]
    return linear_predictor_value(
        site, rows, post.f_mean[sl], post.f_var[sl], options.num_quad_points
    )


def same_rows(old_prior, old_rows, prior, rows) -> bool:
    """Whether a block's prior and rows are those it last solved from (the solve is skipped)."""
    if old_prior is None or len(old_rows) != len(rows) or not old_prior.equal(prior.detach()):
        return False
    for (_, r1), (_, r2) in zip(old_rows, rows):
        if r1.A is not r2.A and not torch.equal(r1.A, r2.A):
            return False
        if not (torch.equal(r1.w, r2.w) and torch.equal(r1.b, r2.b)):
            return False
    return True
