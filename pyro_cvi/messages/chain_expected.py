"""Expected messages between a Kalman chain and the remainder that holds its scales (eq. 20).

For the chain's factors ``v ~ Normal(m(x), s(u))`` (transitions and observations) with
``log s = L0 + H (u - u0)`` in the remainder's unconstrained coordinates and ``q(u) = N(m, S)``:

* the chain's message is the factor at its expected precision (:func:`expected_precisions`)

      E[1/s^2] = exp(-2 (L0 + H (m - u0))) E[exp(-2 H (u - m))]
               = exp(-2 (L0 + H (m - u0)) + 2 diag(H S H'));

* the remainder's side reads each factor Rao-Blackwellised over the chain's ``q(x)``
  (:func:`chain_moments`): with ``r = v - m(x)`` affine in one step or two adjacent ones,

      E_q(x)[log N(v; m(x), s)] = log N(E[r]; 0, s) - Var_q(r) / (2 s^2),

  ``Var_q(x_t - A x_{t-1}) = S_t - A X_t' - X_t A' + A S_{t-1} A'`` from the smoother's
  marginals ``S_t`` and lag-one covariances ``X_t = Cov(x_t, x_{t-1})``; the run's loc holds the
  states at a draw, so the value passed is ``E[r] + loc``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import pyro
import torch

from ..gaussian import centred_exp_mean
from ..linalg import cholesky
from ..model.tracing import trace_model, unwrap

__all__ = [
    "ChainRows",
    "batched_log_scales",
    "chain_log_factors",
    "chain_moments",
    "expected_precisions",
    "monte_carlo_precisions",
]

#: the draws of ``u`` per step of a Monte Carlo expected precision
MC_DRAWS = 256


@dataclass
class ChainRows:
    """The set-up of a chain's factors that read the remainder (see the module docstring)."""

    #: the remainder latents the scales read (model order) and their unconstrained values
    given: Tuple[str, ...]
    u0: torch.Tensor
    #: log scales at ``u0`` of every shared element (transitions' ``d`` per step, then the
    #: observations' elements) and their coefficients ``(R, U)``
    L0: torch.Tensor
    H: torch.Tensor
    #: the steps whose transition (or, step 0, prior) reads the scales
    steps: Tuple[int, ...]
    #: the observations, their rows' steps, coefficients ``h (R_obs, d)`` and offsets ``c``
    obs: Tuple[str, ...]
    obs_t: torch.Tensor
    obs_h: torch.Tensor
    obs_c: torch.Tensor
    #: elements per shared site (the steps', then the observations')
    sizes: Tuple[int, ...] = ()
    #: a walk's sites whose scales read the remainder (their elements head the rows, each
    #: flattened in its own shape; ``()`` for a loop)
    walk_sites: Tuple[str, ...] = ()
    #: where ``log s`` is not affine in ``u``: ``(K, U) -> (K, R)``, the log scales of every
    #: shared element at a batch of unconstrained values (one batched model run); ``L0`` and
    #: ``H`` are then unused and ``E[1/s^2]`` is a Monte Carlo average
    #: (:func:`monte_carlo_precisions`)
    read: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


def expected_precisions(rows: ChainRows, m: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """``E_q[1/s^2]`` of every shared element under ``q(u) = N(m, S)`` (module docstring)."""
    H = rows.H.to(m)
    log_s = rows.L0.to(m) + H @ (m - rows.u0.to(m))
    var = ((H @ S) * H).sum(1)
    return torch.exp(-2 * log_s) * centred_exp_mean(var.new_tensor(-2.0), var)


def monte_carlo_precisions(
    rows: ChainRows, m: torch.Tensor, S: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """``E_q[1/s^2]`` of every shared element under ``q(u) = N(m, S)`` where ``log s`` is not
    affine in ``u`` (``s = softplus(u)``, ``exp(u) + c``): the average of the natural parameter
    ``exp(-2 log s(u_k))`` over :data:`MC_DRAWS` draws ``u_k = m + L e_k`` (antithetic pairs
    ``+-e_k``; one batched evaluation of :attr:`ChainRows.read`), unbiased for the expected
    natural parameter of eq. 20."""
    half = MC_DRAWS // 2
    e = torch.randn(
        half, m.numel(), generator=generator, dtype=torch.float64, device=generator.device
    ).to(m)
    e = torch.cat([e, -e])
    L = cholesky(S, jitter="grow", what="the covariance of q(u) of the chain's scales")
    assert rows.read is not None
    log_s = rows.read(m + e @ L.mT)
    return torch.exp(-2 * log_s).mean(0)


def chain_log_factors(an, ctx, owned, draws: torch.Tensor, sites) -> Tuple[set, torch.Tensor]:
    """The shared factors of every chain at its expected precisions that the remainder owns,
    read Rao-Blackwellised over the chain's ``q(x)`` in closed form at each of the remainder's
    draws ``u_k`` (rows ``(K, U)``; ``sites``: its sites with ``name``, ``start``, ``size``):

        sum_e -log s_e(u_k) - log(2 pi) / 2 - E_q(x)[r_e^2] exp(-2 log s_e(u_k)) / 2,

    ``log s_e = L0_e + H_e (u_k - u0)``, one vectorised expression instead of a model run's
    factor per site. Returns the sites covered and the ``(K,)`` sums (``(set(), 0)``: none)."""
    covered: set = set()
    total = draws.new_zeros(draws.shape[0])
    if ctx is None or ctx.block_for is None or an.remainder_discrete:
        return covered, total
    owned = set(owned)
    index = {s.name: (s.start, s.size) for s in sites}
    for spec in an.blocks:
        chain = ctx.block_for(spec.names[0]) if spec.chain is not None else None
        if not hasattr(chain, "shared_second_moments"):
            continue
        found = chain.shared_second_moments(owned)
        rows = chain.scaled
        if found is None or rows.read is not None or not set(rows.given) <= set(index):
            continue
        names, keep, e = found
        cols = torch.cat(
            [
                torch.arange(index[z][0], index[z][0] + index[z][1], device=draws.device)
                for z in rows.given
            ]
        )
        u = draws[:, cols] - rows.u0.to(draws)
        H = rows.H.to(draws)[keep]
        log_s = rows.L0.to(draws)[keep] + u @ H.mT
        lp = -log_s - 0.5 * math.log(2 * math.pi) - 0.5 * e.to(draws) * torch.exp(-2 * log_s)
        total = total + lp.sum(-1)
        covered |= names
    return covered, total


def chain_moments(block, ctx, sites, others) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """``{site: (mean, variance)}`` of the chain's shared factors among ``sites`` read by the
    remainder at ``expected_log_prior`` (module docstring), with the states at ``others``'
    draws; a factor whose draw is missing is left out (its term stays the draw's)."""
    if block.chain.increments is not None:
        return _walk_moments(block, ctx, set(sites), others)
    rows, post, prior = block.scaled, block.post, block.prior
    names, shapes = block.names, block.spec.shapes
    m, S = post.mean.detach(), post.cov.detach()
    d = m.shape[-1]
    out: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
    sites = set(sites)
    steps = [t for t in rows.steps if names[t] in sites]
    if 0 in steps:
        out[names[0]] = (m[0].reshape(shapes[0]), torch.diagonal(S[0]).reshape(shapes[0]))
    later = [t for t in steps if t > 0 and names[t - 1] in others]
    if later:
        t = torch.tensor(later, dtype=torch.long, device=m.device)
        A = prior.A[t - 1].detach().to(m)
        X = post.cross[t - 1].detach()
        C = S[t] - A @ X.mT - X @ A.mT + A @ S[t - 1] @ A.mT
        prev = torch.stack([others[names[s - 1]].detach().reshape(d) for s in later]).to(m)
        mean = m[t] + (A @ (prev - m[t - 1]).unsqueeze(-1)).squeeze(-1)
        var = torch.diagonal(C, dim1=-2, dim2=-1)
        for i, s in enumerate(later):
            out[names[s]] = (mean[i].reshape(shapes[s]), var[i].reshape(shapes[s]))
    if ctx is None or ctx.trace is None:
        return out
    observed = block.observed(ctx)
    start = 0
    for j, site in enumerate(rows.obs):
        k = rows.sizes[len(rows.steps) + j]
        sl = slice(start, start + k)
        start += k
        if site not in sites or site not in observed:
            continue
        ts = rows.obs_t[sl]
        t = int(ts[0])
        cur = others.get(names[t])
        if cur is None or not bool((ts == t).all()):
            continue
        h = rows.obs_h[sl].to(m)
        y, shape = observed[site]
        shift = h @ (cur.detach().reshape(d).to(m) - m[t])
        var = ((h @ S[t]) * h).sum(-1)
        out[site] = (y.expand(shape) + shift.reshape(shape), var.reshape(shape))
    return out


def _walk_moments(block, ctx, sites, others) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`chain_moments` of a walk ``x = cumsum(eps)``: the increments' factor at
    ``(E_q[eps], Var_q(eps))`` (its loc is free of the states), an observation at
    ``y + h (x_k - m)`` with ``x_k = cumsum`` of ``others``' draw of ``eps``."""
    rows, post, inc, names = block.scaled, block.post, block.chain.increments, block.names
    m, S = post.mean.detach(), post.cov.detach()
    out: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
    walk = set(rows.walk_sites or (names if rows.steps else ())) & sites
    if walk:  # (a nested walk's flat values: its sites' concatenated)
        means = block.spec.split(inc.increments(m))
        var = block.spec.split(inc.variance(S, post.cross.detach()))
        for name, shape in zip(names, block.spec.shapes):
            if name in walk:
                out[name] = (means[name].reshape(shape), var[name].reshape(shape))
    if ctx is None or ctx.trace is None or not all(n in others for n in names):
        return out
    observed = block.observed(ctx)
    x = inc.states(torch.cat([others[n].detach().reshape(-1) for n in names]).to(m))
    start = 0
    for j, site in enumerate(rows.obs):
        sl = slice(start, start + rows.sizes[len(rows.sizes) - len(rows.obs) + j])
        start = sl.stop
        if site not in sites or site not in observed:
            continue
        t, h = rows.obs_t[sl], rows.obs_h[sl].to(m)
        y, shp = observed[site]
        shift = (h * (x[t] - m[t])).sum(-1)
        var = ((h.unsqueeze(-2) @ S[t]).squeeze(-2) * h).sum(-1)
        out[site] = (y.expand(shp) + shift.reshape(shp), var.reshape(shp))
    return out


def batched_log_scales(an, order, ts, u0, sites):
    """``(K, U) -> (K, R)``: the log scales of ``sites`` at a batch of the scales'
    unconstrained values, one model run in a particle plate left of the model's plates."""
    P = an.plate_dims
    sizes = [u0[z].numel() for z in order]

    def particles(*args, **kwargs):
        with pyro.plate("_cvi_particles", particles.K, dim=-1 - P):
            return an.model(*args, **kwargs)

    def batched(flat: torch.Tensor) -> torch.Tensor:
        K = particles.K = flat.shape[0]
        vals = {}
        for z, part in zip(order, flat.split(sizes, -1)):
            ref, fn = an.ref[z], an.structure.nodes[z]["fn"]
            v = ts[z](part.reshape((K,) + ts[z].inv(ref).shape))
            vals[z] = v.reshape((K,) + (1,) * (P - (ref.dim() - fn.event_dim)) + ref.shape)
        with torch.no_grad():
            tr = trace_model(
                particles, {**an.fixed, **an.subsample, **an.ref, **vals}, an.args, an.kwargs
            )
        out = []
        for site in sites:
            node = tr.nodes[site]
            base = unwrap(node["fn"])[0]
            shape = torch.broadcast_shapes(base.loc.shape, base.scale.shape, node["value"].shape)
            if not len(shape) or shape[0] != K:
                raise ValueError(f"site {site!r}: the scale does not broadcast over the draws")
            out.append(torch.as_tensor(base.scale).expand(shape).reshape(K, -1).log())
        return torch.cat(out, -1)

    particles.K = 1
    return batched
