"""A Kalman chain whose step and observation scales are latents of the remainder (eq. 20).

A ``pyro.markov`` loop ``x_t ~ Normal(a_t x_{t-1} + b_t, s_t(u))`` observed as
``y_r ~ Normal(h_r x_{t_r} + c_r, s_r(u))``, with the scales reading latents ``u`` outside the
chain (``sigma_level``, ``sigma_obs``) and nothing else reading the states, is, for every value
of ``u``, a linear-Gaussian chain; under ``q(x) q(u)`` its expected log-density is the same
chain with every precision ``1/s^2`` replaced by ``E_q[1/s^2]`` (and a constant of ``x``):

    E_q(u)[log N(v; m(x), s(u))] = -E_q[1/s^2] (v - m(x))^2 / 2 + const.

So the chain keeps its Kalman block (:class:`ScaledMarkovBlock`): the transitions
``N(a_t x_{t-1} + b_t, 1 / E[1/s_t^2])`` go into the smoother's prior and each observation's
expected row ``(h_r, w_r = E[1/s_r^2], w_r (y_r - c_r))`` into its information, so one
smoother pass is the exact VMP update of ``q(x)`` given ``q(u)``. With ``log s = L0 + H (u -
u0)`` affine in the remainder's unconstrained coordinates (found by finite differences at
set-up and confirmed at a random move) and ``q(u) = N(m, S)``,

    E[1/s^2] = exp(-2 (L0 + H (m - u0)) + 2 diag(H S H'))

(:func:`~pyro_cvi.messages.chain_expected.expected_precisions`); where ``log s`` is not affine,
its Monte Carlo average over draws of ``q(u)``, the scales read at all draws by one batched
model run (:func:`~pyro_cvi.messages.chain_expected.monte_carlo_precisions`). The remainder
owns these factors and reads them Rao-Blackwellised over ``q(x)``:
``E[(x_t - a_t x_{t-1} - b_t)^2]`` from the smoother's marginals and lag-one covariances
(:func:`~pyro_cvi.messages.chain_expected.chain_moments`).

Taken (:func:`find_scaled_chains`) where the remainder's joint Gaussian would otherwise hold
more than :data:`~pyro_cvi.model.prior_factor.JOINT_MAX_DIM` coordinates (the chain's and its
scales'), or where a chain site is named ``AutoCVI(families={site: "gaussian"})``; a chain site
named ``"joint"`` keeps the whole chain in the joint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributions import biject_to

from ..context import Options, StepContext
from ..messages.chain_expected import (
    MC_DRAWS,
    ChainRows,
    chain_moments,
    expected_precisions,
    monte_carlo_precisions,
)
from ..messages.prior_expected import remainder_moments
from ..model.analysis import BlockSpec
from ..model.prior_factor import JOINT_MAX_DIM
from ..model.structures import register_chain_finder
from ..model.tracing import DeferredTrace, unwrap
from ..model.weights import unit_scale, unweighted_normal_observation
from ..statespace import detect
from ..statespace.increments import NestedIncrements
from ..statespace.kalman import LinearGaussianChain
from ..statespace.posterior import conditional_entropy
from .markov import ExpectedPriorMarkovBlock
from .registry import register_block_kind
from .scaled_rows import probes_params, reads, setup_rows

__all__ = ["ScaledChainSpec", "ScaledMarkovBlock", "find_scaled_chains"]


@dataclass
class ScaledChainSpec(detect.ChainSpec):
    """A loop whose factors' scales read latents outside it (:func:`find_scaled_chains`)."""

    #: the latents the scales read (model order) and the set-up rows (``None``: not yet)
    scales: Tuple[str, ...] = ()
    rows: Optional[ChainRows] = None
    #: the rule that took the chain, as explain() states it
    rule: str = ""
    shared: Dict[str, int] = field(default_factory=dict)


def _plain_normal(node) -> bool:
    base, mask, _ = unwrap(node["fn"])
    return (
        isinstance(base, torch.distributions.Normal)
        and mask is None
        and node["mask"] is None
        and unit_scale(node["scale"])
        and not len(node["fn"].batch_shape)
        and len(node["fn"].event_shape) <= 1
    )


def find_scaled_chains(an, used: set) -> List[ScaledChainSpec]:
    """``pyro.markov`` loops of Normal sites whose locs read their predecessor only and whose
    scales (and their observations') read latents outside the chain (module docstring), where
    the rule takes them; the others are left to the remainder's joint."""
    families, remainder = getattr(an, "placed", (None, None))
    if remainder is None:
        return []
    tr, leaves = an.leaf_trace()
    nodes = an.structure.nodes
    cont = [n for n in an.values if n in an.continuous and n in leaves and n not in used]
    cand = {n for n in cont if _plain_normal(nodes[n]) and not an.deps.get(n, set()) & an.discrete}
    loc_of, scale_of = {}, {}
    for n in cand:
        base = unwrap(tr.nodes[n]["fn"])[0]
        loc_of[n], scale_of[n] = reads(base.loc, leaves), reads(base.scale, leaves)
    parent = {n: next(iter(loc_of[n])) for n in cand if len(loc_of[n]) == 1 and loc_of[n] <= cand}
    children: Dict[str, List[str]] = {n: [] for n in cand}
    for n, p in parent.items():
        children[p].append(n)
    out = []
    for root in [n for n in an.values if n in cand and not loc_of[n]]:
        names = [root]
        while len(children[names[-1]]) == 1:
            names.append(children[names[-1]][0])
        if len(names) < detect.MIN_LOOP_LENGTH or children[names[-1]]:
            continue
        spec = _scaled_chain(an, tuple(names), scale_of, families or {})
        if spec is not None:
            out.append(spec)
    return out


def _scaled_chain(an, names, scale_of, families) -> Optional[ScaledChainSpec]:
    tr, leaves = an.leaf_trace()
    chain = set(names)
    scales = set().union(*(scale_of[n] for n in names))
    if scales & chain or len({tuple(an.structure.nodes[n]["fn"].event_shape) for n in names}) > 1:
        return None
    obs = {}
    for site, deps in an.deps.items():
        touch = deps & chain
        if site in chain or not touch:
            continue
        base = unweighted_normal_observation(an, site, tr.nodes[site])
        if base is None or len(touch) != 1:
            return None
        if reads(base.loc, leaves) != touch or reads(base.scale, leaves) & chain:
            return None
        read = deps - chain
        if read & (an.discrete | an.collapsed) or not read <= set(leaves):
            return None
        scales |= read
        obs[site] = names.index(next(iter(touch)))
    return take_chain(an, names, obs, scales, families, scale_of)


def take_chain(an, names, obs, scales, families, scale_of, walk=None):
    """The :class:`ScaledChainSpec` of a chain whose factors' scales read ``scales`` (and
    observations ``obs``: ``{site: step}``), where the rule takes it, else ``None``. ``walk``:
    ``(Increments, {site: (t, h, c)})`` for the plate-and-cumsum spelling (one site ``eps``
    of increments, :mod:`~pyro_cvi.blocks.scaled_walk`), its observations' rows read there."""
    tr, leaves = an.leaf_trace()
    if not scales or scales & (an.discrete | an.collapsed | set(an.leaves)):
        return None
    params = [s["value"] for s in tr.nodes.values() if s["type"] == "param"]
    zs = [leaves[n] for n in names]
    for site in list(names) + list(obs):
        base = unwrap(tr.nodes[site]["fn"])[0]
        if any(probes_params(v, zs, params) for v in (base.loc, base.scale)):
            return None  # (coefficients that move with parameters: the joint takes them)
    order = tuple(n for n in an.values if n in scales)
    inc = walk[0] if walk is not None else None
    d = int(torch.Size(an.structure.nodes[names[0]]["fn"].event_shape).numel())
    d, T = (inc.state_dim, inc.length) if inc is not None else (d, len(names))
    size = T * d + sum(
        int(biject_to(an.structure.nodes[z]["fn"].support).inv(an.values[z]).numel()) for z in order
    )
    placed = {families.get(n) for n in names}
    if "joint" in placed:
        return None
    if "gaussian" in placed:
        rule = "named families={...: 'gaussian'} on a chain site"
    elif size > JOINT_MAX_DIM:
        rule = (
            f"the default: the joint would hold {size} coordinates, more than {JOINT_MAX_DIM}; "
            "families={site: 'joint'} on a chain site keeps the joint"
        )
    else:
        return None
    rows = setup_rows(an, names, obs, order, d, walk)
    if rows is None:
        return None
    if rows.read is not None:
        rule += (
            f"; E[1/s^2] by Monte Carlo over q(u) ({MC_DRAWS} draws a step): log s is not "
            "affine in the scales' unconstrained values"
        )
    spec = ScaledChainSpec(names, d, T, False, increments=inc, scales=order, rows=rows, rule=rule)
    if inc is None and 0 in rows.steps and not detect.probe_loop(an, spec):
        return None  # (x_0's prior is shared: no chain factor reads the transitions)
    # (``shared``: the step of each shared site, as explain() words it; the increments of a
    # walk are its transitions, step 1 in the wording)
    steps = {n: (1 if inc is not None else t) for t, n in enumerate(names) if scale_of[n]}
    spec.shared = {**steps, **obs}
    return spec


class ScaledMarkovBlock(ExpectedPriorMarkovBlock):
    """Kalman-smoother CVI of a chain at its expected precisions (module docstring)."""

    def __init__(self, spec: BlockSpec, prefix: str, owned: Sequence[str], options: Options):
        super().__init__(spec, prefix, owned, options)
        self.scaled = spec.chain.rows
        #: the steps whose transitions are scaled (``0``: the start), as an index
        self._steps = self.scaled.u0.new_tensor(self.scaled.steps, dtype=torch.long)
        self._extra: Optional[tuple] = None
        self._fixed_for: Optional[tuple] = None
        self._elements: Optional[tuple] = None
        self._generator: Optional[torch.Generator] = None

    def init_sites_at_prior_mean(self, trace, num_quad_points: int) -> None:
        """The sites of the other observations start at zero."""

    def _site(self, t: int) -> str:
        """The site of step ``t`` (a walk's increments hold every step)."""
        return self.names[0] if self.chain.increments is not None else self.names[t]

    def _solve(self, rows, keep_graph: bool = False, h0=...):
        post = super()._solve(rows, keep_graph, h0)
        if self.chain.increments is not None:  # (the block's z: the increments diff(x))
            post.to_z = self.chain.increments.increments
        return post

    def _fixed(self, ctx: StepContext) -> tuple:
        """The chain's prior and the observations' values read off the step's trace, kept
        while the model reads what it read (the engine then defers the trace: a step that
        reads nothing else runs no model for this block). ``A``, ``b``, ``m0`` are free of
        the latents and parameters (:func:`find_scaled_chains` checked it); ``Q`` and the
        observations' scales are the expected ones (:meth:`_expected`)."""
        tr = ctx.trace
        if self._fixed_for is not None and (
            isinstance(tr, DeferredTrace) or tr is self._fixed_for[0]
        ):
            return self._fixed_for[1]
        rows = self.scaled
        p = detect.chain_prior(self.chain, tr)
        z = self.z_at
        parts, shapes = [], []
        for site in rows.obs:
            node = tr.nodes[site]
            fn, v = unwrap(node["fn"])[0], node["value"].detach()
            parts.append(v)
            shapes.append(torch.broadcast_shapes(fn.loc.shape, fn.scale.shape, v.shape))
        flat = [v.expand(sh).reshape(-1) for v, sh in zip(parts, shapes)]
        y = torch.cat(flat or [z.new_zeros(0)]).to(z)
        fixed = (
            tuple(t.detach().to(z) for t in (p.m0, p.P0, p.A, p.b, p.Q)),
            y - rows.obs_c.to(z),
            {site: (v, sh) for site, v, sh in zip(rows.obs, parts, shapes)},
        )
        self._fixed_for = (tr, fixed)
        return fixed

    def observed(self, ctx: StepContext) -> Dict[str, Tuple[torch.Tensor, torch.Size]]:
        """``{site: (value, shape)}`` of the observations that read the chain (the value and
        the shape its loc and scale broadcast to)."""
        return self._fixed(ctx)[2]

    def _expected(self, ctx: StepContext) -> LinearGaussianChain:
        """The chain at ``E_q[1/s^2]`` of the remainder's current ``q`` and the observations'
        expected rows (:attr:`_extra`)."""
        rows = self.scaled
        m, S = remainder_moments(ctx, rows.given, f"the chain {self.label}", self.names[0])
        if rows.read is None:
            w = expected_precisions(rows, m, S)
        else:
            if self._generator is None:
                self._generator = torch.Generator().manual_seed(self.spec.index)
            w = monte_carlo_precisions(rows, m, S, self._generator)
        (m0, P0, A, b, Q), resid, _ = self._fixed(ctx)
        z = self.z_at
        d = self.chain.state_dim
        if self._nested:  # (a nested walk: the shared levels' precisions, the others fixed)
            n = sum(rows.sizes[: len(rows.walk_sites)])
            P0, Q = self._nested_variances(P0, Q, w[:n].to(z))
            wo = w[n:].to(z)
            self._extra = (rows.obs_t, rows.obs_h.to(z), wo, wo * resid)
            return LinearGaussianChain(m0, P0, A, b, Q)
        n = len(rows.steps) * d
        ws = w[:n].to(z).reshape(-1, d)
        inc = self.chain.increments
        if inc is not None and inc.dim != 0:  # (the site's elements, time-major)
            ws = inc.layout(w[:n].to(z).reshape(inc.shape))
        Q = Q.clone()
        steps = self._steps
        later = steps > 0
        if bool(later.any()):
            Q[steps[later] - 1] = torch.diag_embed(1.0 / ws[later])
        if not bool(later.all()):
            P0 = torch.diag(1.0 / ws[~later][0])
        wo = w[n:].to(z)
        self._extra = (rows.obs_t, rows.obs_h.to(z), wo, wo * resid)
        return LinearGaussianChain(m0, P0, A, b, Q)

    @property
    def _nested(self) -> bool:
        return isinstance(self.chain.increments, NestedIncrements)

    def _nested_variances(self, P0, Q, w):
        """``P0``, ``Q`` of a nested walk with the shared sites' elements at ``1 / w`` (``w``:
        their expected precisions, each site flattened in its shape, ``walk_sites`` order)."""
        inc, rows = self.chain.increments, self.scaled
        var = torch.cat([torch.diagonal(P0)[None], torch.diagonal(Q, dim1=-2, dim2=-1)], 0)
        parts = list(inc.unlayout(var).split(inc.site_size))
        given = dict(zip(rows.walk_sites, w.split(inc.site_size)))
        parts = [1.0 / given[n] if n in given else v for n, v in zip(self.names, parts)]
        var = inc.layout(torch.cat(parts))
        return torch.diag(var[0]), torch.diag_embed(var[1:])

    def _nested_terms(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``E_q[(e - mu)^2]`` and the prior's variance of every increment of a nested walk,
        ``(T, d)`` each (``e_t = x_t - L x_(t-1)``: the smoother's marginals and lag-one
        covariances)."""
        post, p = self.post, self.prior
        m, S, X = post.mean, post.cov, post.cross
        A = p.A
        C = S[1:] - A @ X.mT - X @ A.mT + A @ S[:-1] @ A.mT
        r = m[1:] - (A @ m[:-1].unsqueeze(-1)).squeeze(-1) - p.b
        r0 = m[0] - p.m0
        second = torch.cat(
            [(r0 * r0 + torch.diagonal(S[0]))[None], r * r + torch.diagonal(C, dim1=-2, dim2=-1)]
        )
        var = torch.cat([torch.diagonal(p.P0)[None], torch.diagonal(p.Q, dim1=-2, dim2=-1)])
        return second, var

    def _nested_sites(self, values: torch.Tensor, names) -> torch.Tensor:
        """``(T, d)`` values of a nested walk's increments, the sites ``names``' elements (each
        flattened in its shape), concatenated."""
        inc = self.chain.increments
        parts = dict(zip(self.names, inc.unlayout(values).split(inc.site_size)))
        return torch.cat([parts[n] for n in names]) if names else values.new_zeros(0)

    def refresh(self, ctx: StepContext) -> LinearGaussianChain:
        """The expected chain at the current ``q(u)``, the sites' rows, and the smoother."""
        self.prior = self._expected(ctx)
        sites = self._sites()
        tr = ctx.trace
        self.rows = [self._rows(tr.nodes[f.site], f, sites[f.site].detach()) for f in self.linear]
        self._graph = None
        self.post = self._solve(self.rows)
        self._solved_for = None
        return self.prior

    def elbo(self, ctx: StepContext, prior: LinearGaussianChain) -> torch.Tensor:
        """``H(q) + E_q[log p]`` of the steps this block owns: ``log Z - E_q[log sites]``
        (the expected rows included) less ``E_q[log p~_t]`` of the steps the remainder owns."""
        elbo = super().elbo(ctx, prior)
        if self._nested and not self.linear:
            # ``log Z - E_q[log sites] = H(q) + E_q[log p~]``: the entropy from the marginals and
            # lag-one covariances, and the expected prior of the elements the block owns (the
            # two sums cancel to a few digits when the level is large, in float32)
            theirs = set(self.scaled.walk_sites) - self.owned
            second, var = self._nested_terms()
            terms = -0.5 * torch.log(2 * math.pi * var) - 0.5 * second / var
            ours = [n for n in self.names if n not in theirs]
            return conditional_entropy(self.post) + self._nested_sites(terms, ours).sum()
        steps = [t for t in self.scaled.steps if self._site(t) not in self.owned]
        return elbo - self._expected_log_prior(steps)

    def _expected_log_prior(self, steps: Sequence[int]) -> torch.Tensor:
        """``sum_t E_q[log p~_t(x_t | x_{t-1})]`` over ``steps`` (diagonal ``Q~``)."""
        post, p = self.post, self.prior
        m, S = post.mean, post.cov
        total = m.new_zeros(())
        if 0 in steps:
            prec = 1.0 / torch.diagonal(p.P0)
            r = m[0] - p.m0
            second = r * r + torch.diagonal(S[0])
            total = total + (-0.5 * torch.log(2 * math.pi / prec) - 0.5 * prec * second).sum()
        t = torch.tensor([s for s in steps if s > 0], dtype=torch.long, device=m.device)
        if t.numel():
            A, b = p.A[t - 1], p.b[t - 1]
            prec = 1.0 / torch.diagonal(p.Q[t - 1], dim1=-2, dim2=-1)
            r = m[t] - (A @ m[t - 1].unsqueeze(-1)).squeeze(-1) - b
            X = post.cross[t - 1]
            C = S[t] - A @ X.mT - X @ A.mT + A @ S[t - 1] @ A.mT
            second = r * r + torch.diagonal(C, dim1=-2, dim2=-1)
            total = total + (-0.5 * torch.log(2 * math.pi / prec) - 0.5 * prec * second).sum()
        return total

    def shared_second_moments(self, owned) -> Optional[Tuple[set, torch.Tensor, torch.Tensor]]:
        """``(sites, keep, E_q(x)[r_e^2])`` of the shared elements whose sites are in
        ``owned`` (``keep``: their indices in the rows' element order; ``r = v - m(x)``, the
        factor's residual: ``E[r]^2 + Var_q(r)`` from the smoother's marginals and lag-one
        covariances), or ``None`` before the first smoother pass."""
        post, p, rows = self.post, self.prior, self.scaled
        if post is None or post.cross is None or p is None or self._fixed_for is None:
            return None
        if self._elements is None:
            sites = list(dict.fromkeys(self._site(t) for t in rows.steps)) + list(rows.obs)
            if self._nested:
                sites = list(rows.walk_sites) + list(rows.obs)
            sizes = torch.tensor(rows.sizes, device=post.mean.device)
            which = torch.arange(len(sites), device=sizes.device).repeat_interleave(sizes)
            self._elements = (sites, which)
        sites, which = self._elements
        mine = torch.tensor([n in owned for n in sites], dtype=torch.bool, device=which.device)
        if not bool(mine.any()):
            return None
        m, S = post.mean, post.cov
        d = m.shape[-1]
        parts = []
        t = self._steps
        if self._nested:
            parts.append(self._nested_sites(self._nested_terms()[0], rows.walk_sites))
        elif t.numel():
            first = t == 0
            r = m.new_zeros(t.numel(), d)
            v = m.new_zeros(t.numel(), d)
            if bool(first.any()):
                r[first] = m[0] - p.m0
                v[first] = torch.diagonal(S[0])
            later = t[~first]
            if later.numel():
                A, b = p.A[later - 1], p.b[later - 1]
                X = post.cross[later - 1]
                C = S[later] - A @ X.mT - X @ A.mT + A @ S[later - 1] @ A.mT
                r[~first] = m[later] - (A @ m[later - 1].unsqueeze(-1)).squeeze(-1) - b
                v[~first] = torch.diagonal(C, dim1=-2, dim2=-1)
            inc = self.chain.increments
            if inc is not None and inc.dim != 0:  # (in the site's element order)
                parts.append(inc.unlayout(r * r + v))
            else:
                parts.append((r * r + v).reshape(-1))
        if rows.obs:
            h = rows.obs_h.to(m)
            ot = rows.obs_t
            r = self._fixed_for[1][1] - (h * m[ot]).sum(-1)
            v = ((h.unsqueeze(-2) @ S[ot]).squeeze(-2) * h).sum(-1)
            parts.append(r * r + v)
        e = torch.cat(parts).detach()
        keep = mine[which]
        return {n for n, k in zip(sites, mine.tolist()) if k}, keep, e[keep]

    def expected_moments(self, ctx, sites, others) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        """``{site: (mean, variance)}`` of the shared factors in ``sites`` for the remainder's
        Rao-Blackwellised read (:func:`~pyro_cvi.messages.chain_expected.chain_moments`)."""
        if self.post is None or self.post.cross is None or self.prior is None:
            return {}
        return chain_moments(self, ctx, sites, others)


register_block_kind(
    lambda spec: spec.chain is not None and isinstance(spec.chain, ScaledChainSpec),
    ScaledMarkovBlock,
)
register_chain_finder(find_scaled_chains)
