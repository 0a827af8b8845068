"""Messages of a GLM factor with discrete parents to a Gaussian block (eqs. 13, 20, 30-31).

For ``y ~ p(y | eta)``, ``eta = A_k z + c_k`` once the discrete parents ``s`` take the value
``k`` (:mod:`pyro_cvi.model.discrete_glm`), the expected log-density under ``q(s) q(z)`` is
``sum_k q(s = k) E_q(z)[log p(y | eta_k)]``. Its gradient in the mean parameters of ``eta_k``
is ``q(s = k)`` times the plain linear-predictor gradient, so the target of the ``k``-th
branch's site is the linear-predictor target (Gauss-Hermite, App. B.1) with the element's
weight multiplied by ``q(s = k)``: :func:`enumerated_site` returns the factor's node in one
model run with ``s`` enumerated in parallel (the other latents at their means, the block at its
fixed point), its ``scale`` times ``q(s = k)``, for
:func:`~pyro_cvi.messages.gaussian.linear_predictor_rows` and
:func:`~pyro_cvi.messages.gaussian.linear_predictor_message`.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from ..context import StepContext
from ..model.tracing import run_model

__all__ = ["enumerated_site"]


def enumerated_site(ctx: StepContext, factor, spec, z_at: torch.Tensor) -> Dict[str, Any]:
    """The trace node of ``factor`` (kind ``LINEAR_ENUM``) with its discrete parents enumerated,
    the Gaussian block ``spec`` at ``z_at`` (joint) and every other latent at its ``q``'s mean;
    its ``scale`` carries ``prod_c q(c = value)`` (batch-aligned with the enumerated values)."""
    names, at = spec.names, spec.split(z_at)
    values = ctx.sample_q(exclude=set(names) | set(factor.enumerated), at_means=True)
    for c in factor.enumerated:
        values.pop(c, None)
    values.update({n: at[n].detach() for n in names})
    tr = run_model(ctx.model, values, ctx.args, ctx.kwargs, factor.enum_dims)
    site = tr.nodes[factor.site]
    prob = torch.ones((), dtype=z_at.dtype, device=z_at.device)
    for c in factor.enumerated:
        prob = prob * ctx.marginal(c).log_prob(tr.nodes[c]["value"]).exp().detach()
    prob = prob.reshape(prob.shape + (1,) * site["fn"].event_dim)  # (a to_event factor)
    return {**site, "scale": site["scale"] * prob}
