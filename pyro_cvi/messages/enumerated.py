"""The exact message of a Normal factor with discrete parents to a Gaussian block (eq. 20).

For ``y ~ Normal(A(s) z + B(s) x + c(s), sigma(s))`` with ``z`` the block, ``x`` other
continuous latents and ``s`` discrete latents with a mean-field ``q(s)``, the factor is
quadratic in ``z`` for every value of ``s``, so its expected log-density under the other
factors of ``q`` is

    E_{q(s) q(x)}[log p] = sum_k q(s = k) [-(y - A_k z - B_k E[x] - c_k)^2 / (2 sigma_k^2)] + const

and the VMP message (the expected natural parameter, Algorithm 2, eq. 20) is exact: one row
``(A_k, w = q(s = k) / sigma_k^2, y - B_k E[x] - c_k)`` per enumerated value ``k`` and element.
The rows are read off one model run with ``s`` enumerated in parallel, the other latents at
their means and the block at its fixed point ``z_at``; ``A`` by autograd there.
"""

from __future__ import annotations

import torch
from pyro.distributions.util import broadcast_shape

from ..context import StepContext
from ..model.probes import jacobian
from ..model.tracing import run_model, unwrap
from .gaussian import RowBlock, _weight

__all__ = ["enumerated_normal_rows"]


def enumerated_normal_rows(ctx: StepContext, factor, spec, z_at: torch.Tensor) -> RowBlock:
    """The rows of ``factor`` (kind ``CONJUGATE_ENUM``) on the Gaussian block ``spec``
    (:class:`~pyro_cvi.model.records.BlockSpec`) at its fixed point ``z_at`` (joint), weighted
    by the current ``q`` of the factor's discrete parents (``ctx.marginal``)."""
    names, at = spec.names, spec.split(z_at)
    values = ctx.sample_q(exclude=set(names) | set(factor.enumerated), at_means=True)
    for c in factor.enumerated:
        values.pop(c, None)
    leaves = {n: at[n].detach().clone().requires_grad_(True) for n in names}
    values.update(leaves)
    with torch.enable_grad():
        tr = run_model(ctx.model, values, ctx.args, ctx.kwargs, factor.enum_dims)
        site = tr.nodes[factor.site]
        base = unwrap(site["fn"])[0]
        y = site["value"]
        # (pyro's pure-Python broadcast: torch.broadcast_shapes imports sympy on first use)
        shape = torch.Size(broadcast_shape(base.loc.shape, base.scale.shape, y.shape))
        loc = base.loc.expand(shape)
        A = torch.cat([jacobian(loc, leaves[n]) for n in names], 1)
    loc = loc.detach()
    z_at = torch.cat([leaves[n].detach().reshape(-1) for n in names])
    prob = torch.ones((), dtype=loc.dtype, device=loc.device)
    for c in factor.enumerated:  # q of the enumerated value of each entry (batch-aligned)
        prob = prob * ctx.marginal(c).log_prob(tr.nodes[c]["value"]).exp().detach()
    prob = prob.reshape(prob.shape + (1,) * site["fn"].event_dim)  # (a to_event factor)
    weight = _weight(site, loc) * prob.expand(shape)
    y = torch.where(weight != 0, y.expand(shape), torch.zeros_like(loc))
    prec = (weight / base.scale.detach().expand(shape) ** 2).reshape(-1)
    c = loc.reshape(-1) - A @ z_at
    return RowBlock(A, prec, prec * (y.reshape(-1) - c), c)
