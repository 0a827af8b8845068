"""Collapsed discrete latents: finite discrete sites summed out exactly, as ``TraceEnum_ELBO``.

The finite discrete latents ``z`` that are summed out (the sites the model marks for
enumeration, by default; every one with ``AutoCVI(model, discrete="collapse")``; the rule:
:mod:`pyro_cvi.model.collapsed_group`) get no ``q`` factor. The bound is

    L(q) = E_{q(theta)}[ log sum_z p(x, z, theta) ] - E_q[log q(theta)],

the bound ``TraceEnum_ELBO`` estimates for a guide over the continuous latents ``theta`` only.
Every factor that is, or depends on, a collapsed latent joins one *collapsed group*; its value
``log sum_z prod_a p_a`` at a draw ``theta ~ q`` is Pyro's own tensor contraction
(``pyro.infer.traceenum_elbo._compute_model_factors`` + ``pyro.ops.contract.contract_to_tensor``
over the enumerated trace: plates, ``pyro.markov`` and ``poutine.mask`` as in TraceEnum_ELBO).

The continuous ``q`` are stepped by CVI with the Monte Carlo messages of general factors
(Appendix F: implicit reparameterisation and the family's Fisher solve): the message is
``grad_mu E_q[log sum_z p]``, and since

    grad_theta log sum_z p(x, z, theta) = E_{p(z | x, theta)}[ grad_theta log p(x, z, theta) ],

autograd of the contraction weights every factor's gradient by the exact posterior
responsibilities ``p(z | x, theta)`` at each draw.

Sampling: the guide has no site for a collapsed latent, so ``Predictive(model, guide=guide)``
leaves it to the model, which draws it from its prior given the continuous draw.
:func:`sample_posterior` (``guide.sample_discrete``) draws it from ``p(z | x, theta)`` instead,
by Pyro's ``infer_discrete``.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional

import pyro.poutine as poutine
import torch
from opt_einsum import shared_intermediates
from pyro.infer import config_enumerate, infer_discrete
from pyro.infer.traceenum_elbo import _compute_model_factors
from pyro.ops import packed
from pyro.ops.contract import contract_to_tensor
from pyro.poutine.trace_struct import Trace

from ..model.collapsed_group import (
    MODES,
    check_mode,
    collapsed_sites,
    collapsed_spec,
    infinite_support_error,
)
from ..model.tracing import parallel_enumeration

__all__ = [
    "MODES",
    "check_mode",
    "collapsed_sites",
    "collapsed_spec",
    "collapsed_log_prob",
    "infinite_support_error",
    "sample_posterior",
]


def collapsed_log_prob(
    trace: Trace, sites: Iterable[str], plate: Optional[str] = None
) -> torch.Tensor:
    """``log sum_z prod_{a in sites} p_a`` on an enumerated trace, scaled like TraceEnum_ELBO
    (masks inside the sum, the plates' common subsampling scale outside); differentiable.

    With ``plate`` (the particle plate of vectorised Monte Carlo), the contraction stops at
    that plate and the result is one value per particle (their sum is the scalar result)."""
    sub = Trace()
    for name in sites:
        node = trace.nodes[name]
        sub.add_node(name, **{k: v for k, v in node.items() if k not in ("packed", "log_prob")})
    sub.compute_log_prob()
    sub.pack_tensors()
    costs, log_factors, _, sum_dims, scale = _compute_model_factors(sub, Trace())
    target, sym, size = frozenset(), None, 1
    if plate is not None:
        size = next(
            f.size for n in sub.nodes.values() for f in n["cond_indep_stack"] if f.name == plate
        )
        sym = sub.plate_to_symbol[plate]
        target = frozenset([sym])  # TraceEnum's ordinals are sets of plate symbols

    def reduce(t):  # a packed tensor -> its sum, or one sum per particle
        if sym is None:
            return t.sum()
        if sym not in t._pyro_dims:
            return t.sum().expand(size) / size
        d = t._pyro_dims.index(sym)
        return t.transpose(0, d).reshape(size, -1).sum(-1)

    total = None
    for terms in costs.values():  # group members that broadcast over no enumerated dim
        for t in terms:
            total = reduce(t) if total is None else total + reduce(t)
    if log_factors:
        with shared_intermediates() as cache:
            lp = contract_to_tensor(log_factors, sum_dims, target_ordinal=target, cache=cache)
        lp = reduce(packed.scale_and_mask(lp, scale=scale))
        total = lp if total is None else total + lp
    if total is None:
        return torch.zeros(size) if sym is not None else torch.zeros(())
    return total


def sample_posterior(model, guide_values: Dict[str, torch.Tensor], plate_dims: int, args, kwargs):
    """One draw of the collapsed latents from ``p(z | x, theta)`` at the continuous values
    ``guide_values`` (forward filtering, backward sampling: Pyro's ``infer_discrete``)."""
    conditioned = config_enumerate(poutine.condition(model, data=guide_values), default="parallel")
    conditioned = poutine.infer_config(
        conditioned, parallel_enumeration
    )  # ("sequential": the same sum)
    sampler = infer_discrete(conditioned, first_available_dim=-1 - plate_dims, temperature=1)
    tr = poutine.trace(sampler).get_trace(*args, **kwargs)
    return tr
