"""Monte Carlo messages of general (non-conjugate) factors for the mean-field latents.

For a factor ``a`` whose ``log p_a`` is not multilinear in the sufficient statistics of its
latents, the message ``grad_mu E_q[log p_a]`` is estimated from ``S`` joint draws of ``q``
(Algorithm 2 with stochastic gradients, eq. 29 / Appendix F).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import pyro
import torch

from ..context import Options, StepContext
from ..families.base import sum_rightmost
from ..model.tracing import run_model, unwrap
from .collapsed import collapsed_log_prob
from .expectations import QState, discrete_weight, reduce_like, site_weight

__all__ = ["monte_carlo"]


def _vectorized(ctx, general, q, an, blocks, S, lat, cont, dists, group, own):
    """All ``S`` samples in one model run, in a particle plate left of the model's plates (and
    enumeration left of that), like ``Trace_ELBO(vectorize_particles=True)``."""
    P = an.plate_dims
    vals = {k: v.detach() for k, v in q.values("mean").items()}

    def lead(z, batch_dims):
        return z.reshape((S,) + (1,) * (P - batch_dims) + z.shape[1:])

    for n in cont:
        d = dists[n]
        z = d.rsample((S,)) if d.has_rsample else d.sample((S,))
        vals[n] = lead(z, len(d.batch_shape))
    for block in blocks:
        if lat & set(block.names):
            for n, z in block.spec.split(block.joint().sample((S,))).items():
                vals[n] = lead(z, 0)

    def particles(*a, **k):
        with pyro.plate("_cvi_particles", S, dim=-1 - P):
            return ctx.model(*a, **k)

    try:
        tr = run_model(
            particles, vals, ctx.args, ctx.kwargs, P + 1 if an.enum_dims is not None else None
        )
    except (RuntimeError, ValueError) as e:
        raise ValueError(
            "AutoCVI(vectorize_particles=True) runs the model once with a leading particle "
            f"dimension of size {S} left of its plates, and the model failed to broadcast over "
            f"it ({e}). Write the model with broadcasting operations (e.g. (Z.unsqueeze(-1) * "
            "W).sum(-2) rather than Z @ W), or use vectorize_particles=False."
        ) from e
    total, per = 0.0, 0.0
    room = P + 1 + (len(tr.nodes[next(iter(an.discrete))]["value"].shape) - P if an.discrete else 0)
    for spec in general:
        site = tr.nodes[spec.site]
        shape = site["fn"].batch_shape
        if len(shape) > room or len(shape) < P + 1 or shape[-1 - P] != S:
            raise ValueError(
                f"AutoCVI(vectorize_particles=True): site {spec.site!r} has batch shape "
                f"{tuple(shape)} with {S} particles left of {P} plate dims: the model does not "
                "broadcast over a leading particle dimension (e.g. Z @ W mixes batch and matrix "
                "dims; write (Z.unsqueeze(-1) * W).sum(-2)), or use vectorize_particles=False."
            )
        lp = _log_prob(site, spec, own, q)
        w = discrete_weight(spec, tr, q)
        if w is not None:
            lp = lp * w
        lp = site_weight(site, lp)
        d = lp.dim() - 1 - P  # the particle dim
        per = per + lp.detach().transpose(0, d).reshape(lp.shape[d], -1).sum(-1)
        total = total + lp.sum() / S
    if group:  # the particle plate is one more plate of the contraction: log sum_z p each
        lp = collapsed_log_prob(tr, group, "_cvi_particles")
        per = per + lp.detach()
        total = total + lp.sum() / S
    ctx.add_mc_samples(per)
    return total


def _log_prob(site, spec, own, q: QState) -> torch.Tensor:
    """The factor's log-density at the draw; for a factor in ``own`` (``site -> (mask, mean
    parameters)``: a factor in the family of ``q`` of the latent ``z`` it draws,
    :mod:`~pyro_cvi.messages.expected_natural`), Rao-Blackwellised over ``z``:
    ``log p(z | theta) = <eta(theta), phi(z)> - A(eta(theta))`` (``h = 1``) is replaced by its
    expectation over ``q(z)``, ``<eta(theta), E_q phi(z)> - A(eta(theta))``, exact given the
    drawn parents. The estimate stays unbiased and loses the noise of ``z``; its gradient in
    ``z``'s mean parameters is the drawn ``eta(theta)`` (a Monte Carlo expected natural
    parameter from the draws already made), none where the mask holds (the latent takes the
    separately averaged or exact message there); the parents' gradients see ``E_q phi(z)``."""
    fn, value = site["fn"], site["value"]
    if spec.site not in own:
        return fn.log_prob(value)
    mu = own[spec.site][1]
    fam = q.fam[spec.site]
    base = unwrap(fn)[0]
    v = value.detach()
    eta = fam.dist_to_natural(base)
    phi = fam.sufficient_stats(v)
    inner = 0.0
    for e, p, m in zip(eta, phi, mu):
        term = e * (m.reshape(p.shape[p.dim() - m.dim() :]) - p)
        inner = inner + sum_rightmost(term, len(base.event_shape))
    return fn.log_prob(v) + reduce_like(fn, inner)


def _means(q: QState, name: str, lam, mask) -> Tuple[torch.Tensor, ...]:
    """``E_q phi(z)`` of latent ``name``: differentiable in its natural parameters ``lam``
    (autograd leaves) where ``mask`` is false, detached where it holds."""
    if lam is None:
        return tuple(m.detach() for m in q.mu[name])
    out = []
    for m in q.fam[name].natural_to_mean(lam):
        keep = mask.reshape(mask.shape + (1,) * max(0, m.dim() - mask.dim()))
        out.append(torch.where(keep, m.detach(), m))
    return tuple(out)


def monte_carlo(
    ctx: StepContext,
    general,
    q: QState,
    want,
    an,
    blocks,
    options: Options,
    own: Optional[Dict[str, torch.Tensor]] = None,
):
    """Monte Carlo ``E_q[log p_a]`` of the general factors and its mean-parameter gradients.

    Returns ``(the estimate with its graph to hyperparameters, grads by latent, the first
    sampled trace)``. Gradients with respect to ``lambda`` by implicit reparameterisation
    (``rsample``), mapped to mean parameters by the family's Fisher solve (Appendix F,
    eq. 72); discrete latents are enumerated and weighted by their q probabilities
    (differentiable in their ``mu``). The factors in ``own`` (``site -> mask``, broadcasting
    against the site's value) are Rao-Blackwellised over the latent they draw where the mask
    holds, and send it no gradient there (:func:`_log_prob`).
    """
    S = max(1, int(options.num_general_samples))
    own = {} if own is None else own
    lat = set().union(*[s.latents for s in general])
    cont = [n for n in sorted(lat) if n in q.lam and n not in an.discrete]  # fixed RNG order
    lam_leaves = {n: tuple(t.clone().requires_grad_(n in want) for t in q.lam[n]) for n in cont}
    dists = {n: q.fam[n].natural_to_dist(lam_leaves[n]) for n in cont}
    total = 0.0
    first = None
    pushed = {n for n in cont if hasattr(q.fam[n], "sample_with_log_det")}
    own = {n: (mask, _means(q, n, lam_leaves.get(n), mask)) for n, mask in (own or {}).items()}
    group = [s.site for s in general if s.collapsed]
    general = [s for s in general if not s.collapsed]
    if S > 1 and options.vectorize_particles and not pushed:
        total = _vectorized(ctx, general, q, an, blocks, S, lat, cont, dists, group, own)
    per = []
    for _ in range(0 if torch.is_tensor(total) else S):
        vals = q.values("mean")
        vals = {k: v.detach() for k, v in vals.items()}
        ladj = {}
        for n in cont:
            if n in pushed:  # z = T(u): the entropy's E log|det dT/du| joins E_q[log p]
                vals[n], ladj[n] = q.fam[n].sample_with_log_det(lam_leaves[n])
                continue
            z = dists[n].rsample() if dists[n].has_rsample else dists[n].sample()
            vals[n] = z
        for block in blocks:
            if lat & set(block.names):
                vals.update(block.spec.split(block.joint().sample()))
        tr = run_model(ctx.model, vals, ctx.args, ctx.kwargs, an.enum_dims)
        first = tr if first is None else first
        one = 0.0
        for n, t in ladj.items():
            one = one + site_weight(tr.nodes[n], t).sum()
        if group:  # log sum_z p over the collapsed group (weights p(z | x, theta) in autograd)
            one = one + collapsed_log_prob(tr, group)
        for spec in general:
            site = tr.nodes[spec.site]
            lp = _log_prob(site, spec, own, q)
            w = discrete_weight(spec, tr, q)
            if w is not None:
                lp = lp * w
            one = one + site_weight(site, lp).sum()
        total = total + one / S
        per.append(torch.as_tensor(one).detach())
    if per:
        ctx.add_mc_samples(torch.stack(per))
    grads: Dict[str, Tuple[torch.Tensor, ...]] = {}
    targets = [n for n in want if n in lam_leaves] + [
        n for n in want if n in an.discrete and n in lat
    ]
    if torch.is_tensor(total) and total.requires_grad and targets:
        inputs = []
        for n in targets:
            inputs.extend(lam_leaves[n] if n in lam_leaves else q.mu[n])
        gs = torch.autograd.grad(total, inputs, allow_unused=True, retain_graph=True)
        k = 0
        for n in targets:
            src = lam_leaves[n] if n in lam_leaves else q.mu[n]
            g = []
            for t in src:
                g.append(torch.zeros_like(t) if gs[k] is None else gs[k].detach())
                k += 1
            if n in lam_leaves:
                g = q.fam[n].mean_grad(q.lam[n], tuple(g))
                g = tuple(torch.nan_to_num(x, nan=0.0) for x in g)
            grads[n] = tuple(g)
    return total, grads, first
