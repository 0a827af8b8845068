"""The remainder's log joint at a batch of draws ``u_k`` of its unconstrained Gaussian:
``log p(x, T(u_k)) + log |T'(u_k)|`` over the factors it owns, the discrete latents it holds
summed out (Pyro's TraceEnum contraction), the other blocks' latents at ``others`` (their
draws from ``q``, for factors shared with exact blocks). One model run with a particle plate
left of the model's plates when the model broadcasts over it (checked once against one run per
draw), else one run per draw."""

from __future__ import annotations

import pyro
import torch

from ..context import StepContext
from ..messages.collapsed import collapsed_log_prob
from ..model.tracing import run_model

__all__ = ["remainder_log_joint"]


def remainder_log_joint(block, ctx: StepContext, draws: torch.Tensor, others) -> torch.Tensor:
    """``log p(x, T(u_k)) + log |T'(u_k)|`` of each draw (the owned factors, the discrete
    latents summed out): one model run with a particle plate left of the model's plates
    when the model broadcasts over it (checked once against one run per draw), else one
    run per draw."""
    if block.vectorise is not False:
        try:
            batched = _vectorised(block, ctx, draws, others)
        except (RuntimeError, ValueError, IndexError, TypeError):
            batched = None
        if batched is None:
            block.vectorise = False
        elif block.vectorise:
            return batched
    per = []
    enum = block.analysis.enum_dims if block.analysis.remainder_discrete else None
    for k in range(draws.shape[0]):
        values, logdet = block.unpack(draws[k])
        tr = run_model(ctx.model, {**others, **values, **ctx.subsample}, ctx.args, ctx.kwargs, enum)
        sites = [s for s in block.owned if s in tr.nodes]
        per.append(collapsed_log_prob(tr, sites) + logdet)
    looped = torch.stack(per)
    if block.vectorise is None:  # the first step: do both agree?
        tol = 1e-3 if looped.dtype in (torch.float32, torch.float16) else 1e-7
        same = bool(torch.allclose(batched.detach(), looped.detach(), rtol=tol, atol=tol))
        block.vectorise = same
    return looped


def _vectorised(block, ctx: StepContext, draws: torch.Tensor, others):
    K, P = draws.shape[0], block.analysis.plate_dims
    values, logdet = {}, draws.new_zeros(K)
    for s in block.sites:
        x = draws[:, s.start : s.start + s.size].reshape((K,) + s.ushape)
        z = s.transform(x)
        ld = s.transform.log_abs_det_jacobian(x, z).reshape(K, -1).sum(-1)
        logdet = logdet + ld
        batch = len(s.shape) - s.event_dim
        values[s.name] = z.reshape((K,) + (1,) * (P - batch) + s.shape)

    def particles(*a, **k):
        with pyro.plate("_cvi_particles", K, dim=-1 - P):
            return ctx.model(*a, **k)

    enum = P + 1 if block.analysis.remainder_discrete else None
    tr = run_model(particles, {**others, **values, **ctx.subsample}, ctx.args, ctx.kwargs, enum)
    sites = [s for s in block.owned if s in tr.nodes]
    for name in sites:
        shape = tr.nodes[name]["fn"].batch_shape
        if len(shape) < P + 1 or shape[len(shape) - 1 - P] != K:
            return None
    return collapsed_log_prob(tr, sites, "_cvi_particles") + logdet
