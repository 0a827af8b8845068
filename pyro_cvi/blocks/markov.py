"""The Markov Gaussian block: site-form CVI whose prior is a linear-Gaussian chain (App. E.2).

``q(x) = p(x) prod_r t_r(h_r' x_{t_r}) / Z`` with one linear-predictor site
``t_r(f) = exp(b_r f - w_r f^2 / 2)`` per observation element (eq. 13; in ``eta = f + c``
coordinates ``(lam1, lam2)``, as in :mod:`~pyro_cvi.blocks.gaussian`). The conjugate
computation (step 4 of Algorithm 1) is a Kalman smoother
(:func:`~pyro_cvi.statespace.kalman.smooth`), O(T d^3), and

    ELBO = log Z - sum_r E_q[log t_r] + sum_r E_q[log p(y_r | eta_r)],

whose first two terms are ``-KL(q || p)``. When the loss's graph is wanted and the prior
(transitions), the offsets ``c`` or the coefficients ``h_r`` depend on the model's parameters,
the smoother runs with graph (``log Z`` and the marginals, by a differentiable backward pass),
so the hyperparameter gradient is the derivative of the ELBO at fixed sites; coefficients
``h_r(theta)`` are recomputed every step.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import pyro
import pyro.distributions as dist
import torch

from ..context import Options, StepContext
from ..gaussian.sites import site_to_row
from ..messages.gaussian import (
    RowBlock,
    linear_predictor_message,
    linear_predictor_value,
    warm_start_target,
)
from ..model.analysis import LINEAR, BlockSpec
from ..model.structures import ChainRules, register_chain_finder
from ..model.tracing import linear_param, trace_model, unwrap
from ..statespace import detect
from ..statespace.increments import NestedIncrements
from ..statespace.kalman import LinearGaussianChain, Marginals, NotPositiveDefinite, smooth
from ..statespace.posterior import IncrementPosterior, MarkovPosterior, SiteRows, chain_neg_kl
from ..statespace.random_walk import find_random_walks
from ..update import MAX_HALVINGS_SOLVE, StepCounts, damped_step, targets_from_grads
from .base import stored
from .init_start import ChainInitStart
from .markov_fast import FastPath, expected_log_sites, on_first, site_rows
from .registry import register_block_kind
from .site_form import SiteFormBlock

__all__ = ["ExpectedPriorMarkovBlock", "MarkovBlock"]


class MarkovBlock(ChainInitStart, SiteFormBlock):
    """Kalman-smoother CVI for the chain of one :class:`~pyro_cvi.model.analysis.BlockSpec`."""

    def __init__(self, spec: BlockSpec, prefix: str, owned: Sequence[str], options: Options):
        self.spec, self.names, self.options = spec, spec.names, options
        self.chain = spec.chain
        self.owned = set(owned)
        self.linear = [f for f in spec.factors if f.kind == LINEAR]
        self.site_names = {f.site: f"{prefix}.sites.{f.site}" for f in self.linear}
        self.z_at: Optional[torch.Tensor] = None
        self.prior: Optional[LinearGaussianChain] = None
        self.rows: List[RowBlock] = []
        self.post: Optional[Marginals] = None
        self._solved_for = None
        #: ``(rows, q)`` with their graph to the model's parameters (``ctx.graph`` and the
        #: prior or the offsets depend on them), for the differentiable ELBO; else ``None``
        self._graph: Optional[tuple] = None
        #: per factor: ``(key, the objects keyed, c)`` of the last offsets built (:meth:`_offset`)
        self._offsets: Dict[str, tuple] = {}
        self.offset_builds = 0  # (how many were built: a static model builds each once)
        #: ``(rows, SiteRows)`` of the last rows gathered without a start offset (a list of
        #: rows is never changed in place: a new one is built for new sites)
        self._kept_rows: Optional[tuple] = None
        self._steps_kept: Optional[tuple] = None  # (:meth:`_steps_and_coefficients`)
        self._fast = FastPath()  # (the short path of a GP observed through x_{t,0})
        self._refreshed: Optional[tuple] = None  # (refresh's context and sites, for elbo)
        self._static_from = None  # (the trace of the last refresh that nothing can move)
        self.init_start_fields(f"{prefix}.init_h.{'+'.join(self.names)}")  # (init_loc_fn)

    def param_names(self) -> List[str]:
        return list(self.site_names.values()) + ([self.init_name] if self.init_name else [])

    def setup_values(self, values: Dict[str, torch.Tensor]) -> None:
        """Register the site parameters at zero (``q = prior``)."""
        self.z_at = self.spec.join(values).detach()
        for f in self.linear:
            R = f.jacobian.shape[0]
            pyro.param(self.site_names[f.site], lambda R=R: self.z_at.new_zeros(R, 2))

    def _sites(self) -> Dict[str, torch.Tensor]:
        return {s: stored(n) for s, n in self.site_names.items()}

    def _versions(self, sites) -> tuple:
        h0 = self._init_h()
        return tuple(sites[f.site]._version for f in self.linear) + (
            (h0._version,) if h0 is not None else ()
        )

    # ------------------------------------------------------------------ sites on the steps
    def _rows(self, site, f, sites: torch.Tensor, H=None) -> RowBlock:
        """As :func:`~pyro_cvi.messages.gaussian.linear_predictor_rows`, with ``f_r = h_r'
        x_{t_r}``: ``c = eta_at - f_at`` and ``(w, b)`` by
        :func:`~pyro_cvi.gaussian.sites.site_to_row`. With ``H`` given (the coefficients, with
        their graph where they depend on parameters) ``c`` keeps its graph to the model's
        parameters too."""
        c = self._offset(site, f, H)
        H = f.jacobian if H is None else H
        return RowBlock(H, *site_to_row(sites[..., 0], sites[..., 1], c), c, f.param, f.link)

    def _offset(self, site, f, H=None) -> torch.Tensor:
        """``c = eta_at - h' x_at`` of factor ``f`` (with ``H``: its graph kept), reused while
        what it is computed from is unchanged: the site's distribution and its tensors,
        ``z_at``, ``h`` (by identity and version counter; the cache holds them, so no identity
        is reused). One with a graph to the model's parameters is built afresh each time."""
        fn = site["fn"]
        held = (fn, self.z_at, f.jacobian, f.time_index)
        held += tuple(v for v in vars(unwrap(fn)[0]).values() if torch.is_tensor(v))
        key = tuple((id(o), getattr(o, "_version", None)) for o in held)
        hit = self._offsets.get(f.site)
        if (H is None or H is f.jacobian) and hit is not None and hit[0] == key:
            return hit[2]  # (no graph: the plain offsets are the graph ones)
        eta_at = linear_param(unwrap(fn)[0], f.param, f.link)[1].reshape(-1)
        x = self.chain.states(self.z_at)
        c = eta_at.detach() - (f.jacobian.to(x) * x[f.time_index]).sum(-1)
        if not eta_at.requires_grad:
            self._offsets[f.site] = (key, held, c)
            self.offset_builds += 1
        if H is None or (H is f.jacobian and not eta_at.requires_grad):
            return c
        return eta_at - (H.to(x) * x[f.time_index]).sum(-1)

    def _same_rows(self, obs) -> bool:
        """Whether :attr:`rows` are those of ``obs`` at the sites they were solved for: the
        same coefficients and kept offsets (so the same ``(w, b)``, bitwise)."""
        return len(self.rows) == len(obs) and all(
            r.A is f.jacobian and r.c is self._offset(site, f)
            for (site, f, _), r in zip(obs, self.rows)
        )

    def _kept(self, f, row: RowBlock) -> bool:
        """Whether ``row``'s offsets are the kept ones of ``f`` (so they carry no graph)."""
        hit = self._offsets.get(f.site)
        return hit is not None and hit[2] is row.c

    def _site_rows(self, rows: Sequence[RowBlock], h0: Any = ...) -> SiteRows:
        """All factors' rows as one :class:`SiteRows` (steps, ``h``, ``w``, ``b``), then the
        start offset's (``h0``: the current one by default; ``None``: without)."""
        h0 = self._init_h() if h0 is ... else h0
        kept = self._kept_rows
        if h0 is None and kept is not None and kept[0] is rows:  # (the list is held there)
            return kept[1]
        extra = self.init_rows(h0.detach() if h0 is not None else None)
        if extra is None:
            t, H, flag, first = self._steps_and_coefficients(rows)
            if len(rows) == 1:  # (one factor: its rows as they are, not a copy)
                w, b = rows[0].w, rows[0].b
            else:
                w, b = (torch.cat([getattr(r, k) for r in rows]) for k in "wb")
            sr = SiteRows(t, H, w, b, self.chain.length)
            sr.__dict__["_one_per_step"] = flag
            sr.__dict__["_on_first"] = first
            self._kept_rows = (rows, sr)
            return sr
        parts = [(f.time_index, r.A.to(self.z_at), r.w, r.b) for f, r in zip(self.linear, rows)]
        parts.append(extra)
        t, H, w, b = (torch.cat([p[k] for p in parts]) for k in range(4))
        return SiteRows(t, H.to(self.z_at), w, b, self.chain.length)

    def _steps_and_coefficients(self, rows: Sequence[RowBlock]) -> tuple:
        """The steps ``t`` and coefficients ``H`` of all factors' rows, whether there is one
        row per step in order (:meth:`SiteRows.one_per_step`) and whether each is on the
        first coordinate (:func:`~.markov_fast.on_first`); kept while the factors' step
        indices and the rows' coefficients are the same tensors, unedited."""
        held = tuple(f.time_index for f in self.linear) + tuple(r.A for r in rows)
        key = tuple((id(o), o._version) for o in held) + (self.z_at.dtype,)
        hit = self._steps_kept
        if hit is not None and hit[0] == key:
            return hit[2]
        t = torch.cat([f.time_index for f in self.linear])
        H = torch.cat([r.A.to(self.z_at) for r in rows]).to(self.z_at)
        flag = SiteRows(t, H, H[:, 0], H[:, 0], self.chain.length).one_per_step()
        first = flag and on_first(t, H, self.chain.length)
        self._steps_kept = (key, held, (t, H, flag, first))
        return t, H, flag, first

    def _solve(
        self, rows: Sequence[RowBlock], keep_graph: bool = False, h0: Any = ...
    ) -> Marginals:
        sr = self._site_rows(rows, h0)
        inc = self.chain.increments
        if not keep_graph and inc is None and sr.__dict__.get("_on_first"):
            post = self._fast.solve(self.prior, sr)
            if post is not None:
                return post
        eta, J = sr.information()
        prior = self.prior if keep_graph else self.prior.detach()
        post = smooth(prior, eta, J, keep_graph=keep_graph, lag_one=inc is not None)
        if inc is not None:  # the block's z are the increments eps = diff(x)
            post.to_z = inc.increments
        return post

    def init_sites_at_prior_mean(self, trace, num_quad_points: int) -> None:
        """As :meth:`GaussianBlock.init_sites_at_prior_mean`: a Newton step from the prior mean."""
        self.prior = self._chain_prior(trace, None)
        d, T = self.chain.state_dim, self.chain.length
        zero = self.z_at.new_zeros(T, d)
        p0 = smooth(self.prior.detach(), zero, zero.new_zeros(T, d, d))
        m0 = p0.mean
        sites = self._sites()
        for f in self.linear:
            H = f.jacobian.to(m0)
            v = (H.unsqueeze(-2) @ p0.cov[f.time_index] @ H.unsqueeze(-1)).flatten()
            p = sites[f.site]
            rows = self._rows(trace.nodes[f.site], f, p.detach())
            f_mean = (f.jacobian * m0[f.time_index]).sum(-1)
            target = warm_start_target(trace.nodes[f.site], rows, f_mean, num_quad_points, v)
            if target is not None:
                p.data.copy_(target)

    # ------------------------------------------------------------------ conjugate computation
    def _leaf_trace(self, ctx: StepContext):
        """The model traced with the chain's states as fresh autograd leaves (at ``z_at``)."""
        leaves = {
            n: v.detach().clone().requires_grad_(True)
            for n, v in self.spec.split(self.z_at).items()
        }
        values = {**ctx.sample_q(exclude=set(self.names), at_means=True), **leaves}
        with torch.enable_grad():
            return trace_model(ctx.model, values, ctx.args, ctx.kwargs), leaves

    def _chain_prior(self, trace, ctx: Optional[StepContext], leafy=None) -> LinearGaussianChain:
        A = None
        if not self.chain.ssm and self.chain.dynamic and ctx is not None:
            trace, leaves = leafy or self._leaf_trace(ctx)
            with torch.enable_grad():
                A = detect.loop_transitions(self.names, trace, leaves, create_graph=True)
        return detect.chain_prior(self.chain, trace, A)

    def _coefficients(self, ctx: StepContext, leafy) -> Dict[str, torch.Tensor]:
        """``H(theta)`` of the observations whose coefficients depend on learnable parameters,
        recomputed on the leaf trace (with graph when ``ctx.graph``)."""
        out = {}
        for f in self.linear:
            if f.dynamic:
                trace, leaves = leafy
                with torch.enable_grad():
                    value = linear_param(unwrap(trace.nodes[f.site]["fn"])[0], f.param, f.link)[1]
                    _, H = detect.observation_rows(self.chain, value, leaves, ctx.graph)
                f.jacobian = H.detach()
                out[f.site] = H
        return out

    def refresh(self, ctx: StepContext) -> LinearGaussianChain:
        """The prior and the site rows from the step's trace; the smoother at the current
        sites (kept when neither changed and the prior has no hyperparameters). With
        ``ctx.graph``, where the prior or the offsets depend on the model's parameters, the
        smoother runs with graph (``log Z`` and the marginals): the ELBO's gradient is then its
        derivative at fixed sites; the targets use the same marginals without graph. Again on
        that trace (a static model's, kept by the engine) with the sites it was solved for, and
        nothing in it with a graph, there is nothing to redo: the same prior, rows and ``q``."""
        tr = ctx.trace
        if tr is self._static_from and self._solved_for is not None:
            sites = self._sites()
            if self._solved_for[0] is tr and self._solved_for[1] == self._versions(sites):
                self._refreshed, self._graph = (ctx, sites), None
                return self.prior
        dynamic = any(f.dynamic for f in self.linear) or (self.chain.dynamic and not self.chain.ssm)
        leafy = self._leaf_trace(ctx) if dynamic else None
        self.prior = self._chain_prior(tr, ctx, leafy)
        H = self._coefficients(ctx, leafy) if dynamic else {}
        sites = self._sites()
        self._refreshed = (ctx, sites)  # (the same loss's elbo reads them next)
        obs = [(tr.nodes[f.site], f, sites[f.site].detach()) for f in self.linear]
        moving = self.prior.requires_grad() or bool(H)
        solved_for = (tr, self._versions(sites))  # (nothing below changes the sites)
        if moving or solved_for != self._solved_for or not self._same_rows(obs):
            self.rows = [self._rows(*o) for o in obs]
        graph_rows = (  # (a plain row with offsets kept without graph is its own graph row)
            [
                r
                if o[1].site not in H and self._kept(o[1], r)
                else self._rows(*o, H.get(o[1].site, o[1].jacobian))
                for o, r in zip(obs, self.rows)
            ]
            if ctx.graph
            else []
        )
        self._graph = None
        if ctx.graph and (moving or any(r.c.requires_grad for r in graph_rows)):  # (H: in c)
            g = self._solve(graph_rows, keep_graph=True)
            self._graph = (graph_rows, g)
            self.post = Marginals(g.mean.detach(), g.cov.detach(), g.log_z.detach())
        elif moving or self.post is None or solved_for != self._solved_for:
            self.post = self._solve(self.rows)
        self._solved_for = solved_for if not moving else None
        # (kept offsets: built without graph, see _offset)
        kept = all(self._kept(f, r) for f, r in zip(self.linear, self.rows))
        still = not (dynamic or moving) and kept and self._graph is None
        self._static_from = tr if still else None
        return self.prior

    # ------------------------------------------------------------------ ELBO and targets
    def elbo(self, ctx: StepContext, prior: LinearGaussianChain) -> torch.Tensor:
        """``log Z - E_q[log sites]`` (= ``-KL``; below float64 where it rounds badly, from the
        conditionals: :func:`~pyro_cvi.statespace.posterior.chain_neg_kl`) plus the
        observations' expected log-densities; with ``ctx.grads``, ``target - lambda_tilde``
        goes into ``.grad``."""
        post, tr = self.post, ctx.trace
        sr = plain = self._site_rows(self.rows)
        on_first = sr.__dict__.get("_on_first")
        if on_first:  # f_t = x_{t,0}
            f_mean, f_var = post.mean[:, 0], post.cov[:, 0, 0]
        else:
            f_mean, f_var = sr.moments(post.mean, post.cov)
        graph_rows, valued, g_mean, g_var = self.rows, post, f_mean, f_var
        if self._graph is not None:  # the same numbers, with their graph
            graph_rows, valued = self._graph
            sr = self._site_rows(graph_rows)
            g_mean, g_var = sr.moments(valued.mean, valued.cov)
        if on_first and self._graph is None:
            terms = expected_log_sites(sr, g_mean, g_var)
        else:
            terms = sr.expected_log_sites(g_mean, g_var)
        elbo = chain_neg_kl(valued.log_z, terms, prior, post, plain)  # (-KL: float64 as was)
        if self.chain.weighted:  # a tempered prior: the constant of N^c = N(S / c) (detect)
            shift = detect.tempered_constant(self.chain, tr)
            elbo = elbo + (shift if ctx.graph else shift.detach())
        hit, self._refreshed, i = self._refreshed, None, 0
        sites = hit[1] if hit is not None and hit[0] is ctx else self._sites()
        one = len(self.rows) == 1 and self.rows[0].c.shape[0] == f_mean.shape[0]  # (no h0 rows)
        for f, r, rg in zip(self.linear, self.rows, graph_rows):
            R = r.c.shape[0]
            sl = slice(i, i + R)
            i += R
            message = self._fast.message if self._graph is None else linear_predictor_message
            value, target = message(
                tr.nodes[f.site],
                r,
                f_mean if one else f_mean[sl],
                f_var if one else f_var[sl],
                self.options.num_quad_points,
                self.options.num_samples,
            )
            if self._graph is not None:
                value = linear_predictor_value(
                    tr.nodes[f.site], rg, g_mean[sl], g_var[sl], self.options.num_quad_points
                )
            if f.site in self.owned:
                elbo = elbo + value
            if ctx.grads:
                p = sites[f.site]
                p.grad = target - p.detach()
        h0 = self._init_h()
        if h0 is not None and ctx.grads:  # no factor's message: the target is zero
            h0.grad = -h0.detach()
        return elbo

    # ------------------------------------------------------------------ the step
    def step_sites(self, beta: float) -> StepCounts:
        """``lambda_tilde <- lambda_tilde + beta * grad`` (eq. 12), shrunk until q is valid."""
        sites, h0 = self._sites(), self._init_h()
        params = list(sites.values()) + ([h0] if h0 is not None else [])
        if len(params) == 1 and params[0].grad is not None:  # (targets_from_grads, inlined)
            o = params[0].detach()
            pair = (o,), (o + params[0].grad,)
        else:
            pair = targets_from_grads(params) if params else None
        if pair is None:
            return StepCounts()
        old, target = pair
        solved = {}
        n = len(sites)  # (then the start offset)

        def rows_for(new):
            return [
                RowBlock(r.A, *site_rows(s, r.c), r.c, *r.link_of) for r, s in zip(self.rows, new)
            ]

        def solves(new) -> bool:
            try:
                solved["rows"] = rows_for(new[:n])
                solved["post"] = self._solve(solved["rows"], h0=new[n] if h0 is not None else None)
                return True
            except NotPositiveDefinite:
                return False

        def valid(new) -> torch.Tensor:
            return torch.tensor(solves(new), device=old[0].device)

        first = None
        if len(old) == 1:  # (damped_step's first candidate, taken where q is valid)
            delta = target[0] - old[0]
            first = (old[0] + (delta if beta == 1.0 else beta * delta),)  # (1 * x is x)
        if first is not None and solves(first):
            new, counts = first, StepCounts(0, 0)
        else:
            new, counts = damped_step(old, target, beta, valid, max_halvings=MAX_HALVINGS_SOLVE)
        if counts.rejected:
            return counts
        for p, v in zip(params, new):
            p.detach().copy_(v)  # (in place, as under no_grad)
        self.rows = solved["rows"]  # (the rows of the new sites, as the last check built them)
        self.post = solved["post"]
        if self._solved_for is not None:  # q is solved for the new sites already
            self._solved_for = (self._solved_for[0], self._versions(sites))
        return counts

    def information(self):
        """The sites gathered per step: ``eta (T, d)``, ``J (T, d, d)`` (``q = p x sites``)."""
        return self._site_rows(self.rows).information()

    def forget(self) -> None:
        """The parameters were set from outside (a step undone): rebuild ``q`` from them."""
        self._solved_for = None
        if self.post is not None:
            sites = self._sites()
            self.rows = [
                RowBlock(r.A, *site_to_row(s[:, 0], s[:, 1], r.c), r.c, *r.link_of)
                for r, s in zip(self.rows, (sites[f.site].detach() for f in self.linear))
            ]
            self.post = self._solve(self.rows)

    # ------------------------------------------------------------------ q
    def marginals(self) -> Marginals:
        """The smoothed marginals of every step: means ``(T, d)``, covariances ``(T, d, d)``."""
        return self.post

    def joint(self, names: Optional[Sequence[str]] = None) -> MarkovPosterior:
        """``q`` over the concatenated flattened states of the whole chain."""
        if names is not None and tuple(names) != self.names:
            raise ValueError(f"a Markov block gives the joint q of all of {self.label}")
        return self._q(torch.Size([self.spec.dim]))

    def _q(self, shape: torch.Size):
        """``q`` of the block's z with event shape ``shape`` (a random walk: of its increments)."""
        sr = self._site_rows(self.rows)
        inc = self.chain.increments
        if inc is None:
            return MarkovPosterior(self.prior.detach(), sr, self.post, shape)
        states = torch.Size([self.chain.length, self.chain.state_dim])
        q_x = MarkovPosterior(self.prior.detach(), sr, self.post, states)
        return IncrementPosterior(q_x, inc, shape)

    @property
    def label(self) -> str:
        return self.spec.label

    def marginal(self, name: str) -> torch.distributions.Distribution:
        if isinstance(self.chain.increments, NestedIncrements):  # (a site's elements' Normals;
            q = self._q(torch.Size([self.spec.dim]))  # the joint over the sites: joint())
            mean, var = self.spec.split(q.mean)[name], self.spec.split(q.variance)[name]
            return torch.distributions.Normal(mean, var.sqrt())
        if self.chain.ssm or self.chain.increments is not None:
            return self._q(self.spec.shapes[0])
        t = self.names.index(name)
        shape = self.spec.shapes[t]
        m, S = self.post.mean[t], self.post.cov[t]
        if len(shape) == 0:
            return dist.Normal(m[0], S[0, 0].sqrt())
        return dist.MultivariateNormal(m, covariance_matrix=S)

    def mean_values(self) -> Dict[str, torch.Tensor]:
        return self.spec.split(self.post.loc)


class ExpectedPriorMarkovBlock(MarkovBlock):
    """A Markov block whose prior and extra unary rows are expected messages of other blocks
    (Algorithm 2, eq. 20): a subclass's ``refresh`` sets ``self.prior`` (the expected chain)
    and ``self._extra = (t, H, w, b)`` (rows of factors read in expectation); the smoother
    reads the sites' rows beside them, with lag-one covariances."""

    _extra: Optional[tuple] = None

    def _site_rows(self, rows, h0: Any = ...) -> SiteRows:
        h0 = self._init_h() if h0 is ... else h0
        z = self.z_at
        parts = [(f.time_index, r.A.to(z), r.w, r.b) for f, r in zip(self.linear, rows)]
        start = self.init_rows(h0.detach() if h0 is not None else None)
        if start is not None:
            parts.append(start)
        if self._extra is not None:
            parts.append(self._extra)
        t, H, w, b = (torch.cat([p[k] for p in parts]) for k in range(4))
        return SiteRows(t, H.to(z), w, b, self.chain.length)

    def _solve(self, rows, keep_graph: bool = False, h0: Any = ...) -> Marginals:
        eta, J = self._site_rows(rows, h0).information()
        return smooth(self.prior.detach(), eta, J, keep_graph=False, lag_one=True)


register_block_kind(lambda spec: spec.chain is not None, MarkovBlock, fallback=True)
# the chains this kind fits, found by the analysis: pyro.markov loops and state-space sites,
# then vectorised random walks over the latents left
register_chain_finder(
    lambda an, used: detect.find_chains(an),
    ChainRules(detect.observation_factor, detect.prepare_loop),
)
register_chain_finder(find_random_walks)
