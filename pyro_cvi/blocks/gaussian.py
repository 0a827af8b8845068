"""The Gaussian site block (Algorithm 1): one joint Gaussian over a group of latent sites.

The natural parameters are ``lambda = eta + sum_f lambda_tilde_f`` (Theorem 1, eq. 11):

* ``eta``: the exact messages of the conjugate factors (the Normal/MVN priors of the sites,
  and Normal likelihoods whose loc is affine in the joint ``z`` and whose scale is free of it,
  possibly at the expectation of other latents, eq. 20), recomputed from the model every step,
  so a conjugate model is solved exactly and hyperparameters may move;
* ``lambda_tilde_f``: one ``(lam1_n, lam2_n)`` site per element of every linear-predictor
  factor ``eta_f = A_f z + c_f`` (eq. 13, Appendix E.1), O(N) parameters;
* one ``(lam1_n, lam2_n)`` site, a K-vector and a K x K matrix, per data point of every
  softmax factor (:mod:`~pyro_cvi.messages.softmax_sites`), O(N K^2) parameters;
* one ``(h, P)`` pair for all general factors (Bonnet/Price Monte Carlo, from gradients only
  by default, :mod:`~pyro_cvi.messages.gaussian`);
* with ``init_loc_fn``, a start offset ``h0`` (:mod:`~pyro_cvi.blocks.init_start`).

The conjugate computation (step 4 of Algorithm 1) is a Bayesian linear regression in primal or dual
form (:func:`~pyro_cvi.linear_gaussian.solve`). Parameters live in Pyro's param store; ``.grad``
holds ``target - lambda_tilde`` after the loss, and :meth:`step` applies eq. 12 with the step policy
of :mod:`~pyro_cvi.update`. Hyperparameters: where the prior or the rows depend on the model's
parameters (``A(theta)``, ``c(theta)``, a Normal scale) the loss's ``q`` is solved with graph
(:mod:`~pyro_cvi.blocks.rows`), so its gradient is that of the ELBO at fixed sites.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import pyro
import pyro.distributions as dist
import torch

from ..context import Options, StepContext
from ..gaussian import mvn_draw
from ..gaussian.retraction import retraction_target
from ..gaussian.sites import site_to_row
from ..linear_gaussian import GaussianPosterior, GaussianPrior, NotPositiveDefinite, solve
from ..messages.gaussian import (
    RowBlock,
    general_message,
    linear_predictor_message,
    linear_predictor_rows,
    warm_start_target,
)
from ..messages.scale_expected import expected_scale_rows
from ..messages.softmax_sites import (
    SOFTMAX,
    SoftmaxRows,
    centred_logits,
    softmax_message,
)
from ..messages.warm_start import prior_row_var, softmax_starts
from ..model.analysis import CONJUGATE, GENERAL, LINEAR, BlockSpec
from ..model.gaussian_tree import plugin_expected_log_prob
from ..model.probes import jacobian
from ..model.records import CONJUGATE_SCALE, CONJUGATE_SCALE_MC, PRIOR
from ..model.tracing import linked_reader, subsample_values, trace_model, unwrap
from ..update import MAX_HALVINGS_SOLVE, StepCounts, cvi_update, damped_step, targets_from_grads
from .base import stored
from .block_prior import block_prior, expected_in
from .enumerated_sites import ENUMERATED, EnumeratedSites
from .hidden_draws import draw_weight, undamped_targets
from .init_start import InitLocStart
from .laplace import LaplaceStart
from .plate_sites import PlateSites
from .registry import register_block_kind
from .rows import factor_rows, has_graph, same_rows, site_value
from .site_form import SiteFormBlock

__all__ = ["GaussianBlock", "block_prior"]

EXPECTED_SCALE = (CONJUGATE_SCALE, CONJUGATE_SCALE_MC)  #: rows at E_q[1/s^2] (eq. 20)


class GaussianBlock(InitLocStart, LaplaceStart, PlateSites, EnumeratedSites, SiteFormBlock):
    """Site-form CVI for the latent sites of one :class:`~pyro_cvi.model.analysis.BlockSpec`.

    :param spec: the block (its sites and classified factors).
    :param prefix: the param-store prefix of the guide.
    :param owned: the factor sites whose ELBO term this block computes.
    """

    def __init__(self, spec: BlockSpec, prefix: str, owned: Sequence[str], options: Options):
        self.spec, self.names, self.options = spec, spec.names, options
        self.owned = set(owned)
        self.linear = [f for f in spec.factors if f.kind == LINEAR and f.minibatch is None]
        self.minibatch = [f for f in spec.factors if f.kind == LINEAR and f.minibatch is not None]
        self.conjugate = [f for f in spec.factors if f.kind == CONJUGATE]
        self.general = [f for f in spec.factors if f.kind == GENERAL]
        self.softmax = [f for f in spec.factors if f.kind == SOFTMAX]
        key = "+".join(self.names)
        self.site_names = {
            f.site: f"{prefix}.sites.{f.site}" for f in self.linear + self.minibatch + self.softmax
        }
        self.init_plate_sites(prefix)
        self.init_enumerated_sites(prefix)
        self.general_names = (
            (f"{prefix}.general_h.{key}", f"{prefix}.general_P.{key}") if self.general else ()
        )
        self.init_start_fields(f"{prefix}.init_h.{key}")
        self.z_at: Optional[torch.Tensor] = None
        self.prior: Optional[GaussianPrior] = None
        self.rows: List[Tuple[Optional[str], RowBlock]] = []
        self.elbo_rows: List[Tuple[int, object]] = []
        self.post: Optional[GaussianPosterior] = None
        self._refreshed_from = None
        #: whether the general factors' particles run as one batched (vmap) model run; set to
        #: ``False`` the first time the model cannot be vectorised
        self._vectorise = True
        #: the step's prior and rows with their graph to the model's parameters (``ctx.graph``
        #: and something depends on them), for the differentiable ELBO; ``None`` otherwise
        self._graph: Optional[Tuple[GaussianPrior, list, dict]] = None

    def param_names(self) -> List[str]:
        return (
            list(self.site_names.values())
            + list(self.sum_names.values())
            + ([self.init_name] if self.init_name else [])
            + list(self.general_names)
        )

    def setup_values(self, values: Dict[str, torch.Tensor]) -> None:
        """Register the site parameters (zero: ``q = prior``, Algorithm 1's start)."""
        self.z_at = self.spec.join(values).detach()
        like, D = self.z_at, self.spec.dim
        if self.general and self.options.reducer is not None:
            raise NotImplementedError(
                f"block {self.spec.label!r}: data-parallel CVI (process_group) covers "
                f"conjugate and linear-predictor factors; {[f.site for f in self.general]} are "
                "general (Monte Carlo) factors. Run it in one process (process_group=None)."
            )
        for f in self.linear:
            R = f.jacobian.shape[0]
            pyro.param(self.site_names[f.site], lambda R=R: like.new_zeros(R, 2))
        self.setup_plate_sites(like)
        self.setup_enumerated_sites(like)
        for f in self.softmax:
            N, K = f.jacobian.shape[0] // f.num_classes, f.num_classes
            pyro.param(self.site_names[f.site], lambda N=N, K=K: like.new_zeros(N, K, K + 1))
        if self.general:
            pyro.param(self.general_names[0], lambda: like.new_zeros(D))
            pyro.param(self.general_names[1], lambda: like.new_zeros(D, D))

    def _sites(self) -> Dict[str, torch.Tensor]:
        return {s: stored(n) for s, n in self.site_names.items()}

    def _general(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        if not self.general:
            return None
        return stored(self.general_names[0]), stored(self.general_names[1])

    def init_sites_at_prior_mean(self, trace, num_quad_points: int) -> None:
        """Start each linear-predictor site at the factor's curvature at the prior mean.

        The site target of eq. 13 for a point mass at ``eta = A m0 + c`` is
        ``(f'(eta) - f''(eta) eta, f''(eta) / 2)``: a Newton/Laplace step from the prior mean.
        It starts q near the posterior instead of at the prior, which matters for flat priors
        (australian, ``delta = 1e-5``). Positive curvature is clipped to zero. Where the
        prior's own moments give a row less curvature, its target there instead; softmax rows
        by the same rule (:mod:`~pyro_cvi.messages.warm_start`), except in a block whose only
        likelihood factors are softmax factors with ``K > 2``: there every site starts at its
        second-order expansion at the mode (``q`` = the Laplace approximation), and that start
        is the first step (:attr:`start_is_step`).
        """
        prior = self._prior(trace)
        m0 = prior.loc.detach()
        sites = self._sites()
        for f in self.linear:
            p = sites[f.site]
            rows = linear_predictor_rows(trace.nodes[f.site], f, self.z_at, p.detach())
            f_mean = f.jacobian @ m0
            v = prior_row_var(prior, f.jacobian)
            target = warm_start_target(trace.nodes[f.site], rows, f_mean, num_quad_points, v)
            if target is not None:
                p.data.copy_(target)
        alone = self.options.reducer is None and all(
            f.kind in (PRIOR, SOFTMAX) for f in self.spec.factors
        )
        starts, self.start_is_step = softmax_starts(trace, self.softmax, prior, self.z_at, alone)
        for name, target in starts:
            sites[name].data.copy_(target)

    def _prior(self, trace, ctx: Optional[StepContext] = None) -> GaussianPrior:
        return block_prior(self.spec, trace, ctx)  # (expected priors at ctx's q)

    def refresh(self, ctx: StepContext) -> GaussianPrior:
        """Rebuild ``eta`` (prior and conjugate rows) and the site rows from the step's trace,
        and solve for the current q (skipped when nothing changed since the last solve)."""
        tr = ctx.trace
        if tr is self._refreshed_from:  # the same trace (a static model): nothing changed
            return self.prior
        prior = self._prior(tr, ctx)
        sites = self._sites()
        rows, elbo_rows, graph_rows, graph_fns = [], [], [], {}
        for f in self.spec.factors:
            if f.kind in ENUMERATED or f.kind in EXPECTED_SCALE:  # no graph: the q's weigh
                rows.append(  # rows per enumerated value / rows at E_q[1/s^2]
                    self.enumerated_rows(ctx, f)
                    if f.kind in ENUMERATED
                    else (None, expected_scale_rows(ctx, f, self.spec, self.z_at))
                )
                graph_rows += rows[-1:] if ctx.graph else []
                continue
            if f.kind not in (CONJUGATE, LINEAR, SOFTMAX):
                continue
            A = f.jacobian if ctx.graph else None  # (given: rows with graph, see messages)
            if f.dynamic:
                A = self._jacobian(f, ctx, create_graph=ctx.graph)
                f.jacobian = A.detach()
            site = tr.nodes[f.site]
            view = self.plate_view(f, sites, tr)  # (a plate's: this minibatch's sites)
            name, r, fn = factor_rows(f, site, self.z_at, view)
            self.keep_batch(f, r)
            rows.append((name, r))
            if fn is not None and f.site in self.owned:
                elbo_rows.append((len(rows) - 1, fn))
            if A is not None:
                name, r, graph_fns[len(rows) - 1] = factor_rows(f, site, self.z_at, view, A)
                graph_rows.append((name, r))
        self._graph = None
        if ctx.graph and has_graph(prior, graph_rows):
            self._graph = (prior, graph_rows, graph_fns)
        same = (
            self.post is not None
            and not self.general
            and not self.softmax
            and not self.minibatch
            and same_rows(self.prior, self.rows, prior, rows)
        )
        if self.options.reducer is not None:  # every rank must take the same branch
            same = self.options.reducer.all_agree(same, prior.loc)
        self.prior, self.rows, self.elbo_rows = prior.detach(), rows, elbo_rows
        if self._graph is not None:  # one solve, with graph; the targets read it detached
            self._graph += (self._solve(graph=True),)
            self.post = self._graph[3].detached()
        elif not same:
            self.post = self._solve()
        self._refreshed_from = None if prior.loc.requires_grad or expected_in(self.spec) else tr
        return prior

    def _jacobian(self, f, ctx: StepContext, create_graph: bool = False) -> torch.Tensor:
        """Recompute an affine coefficient that depends on learnable parameters (with its graph
        to them when ``create_graph``)."""
        leaves = {
            n: v.detach().clone().requires_grad_(True)
            for n, v in self.spec.split(self.z_at).items()
        }
        values = {**ctx.sample_q(exclude=set(self.names), at_means=True), **leaves}
        values.update(subsample_values(ctx.trace))  # the step's minibatch
        with torch.enable_grad():
            t = trace_model(ctx.model, values, ctx.args, ctx.kwargs)
            base = unwrap(t.nodes[f.site]["fn"])[0]
            value = centred_logits(base) if f.kind == SOFTMAX else linked_reader(*f.link_of)(base)
            A = [jacobian(value, leaves[n], create_graph=create_graph) for n in self.names]
            A = torch.cat(A, 1)
            return A if create_graph else A.detach()

    def _solve(
        self, site_values=None, general_values=None, graph=False, init_value=None
    ) -> GaussianPosterior:
        """``q`` from the prior and the rows (eq. 2); with ``graph``, from the step's prior and
        rows with their graph (:attr:`_graph`), so ``q`` is differentiable in the model's
        parameters at fixed sites."""
        prior, rows = (self._graph[0], self._graph[1]) if graph else (self.prior, self.rows)
        blocks, rotations, extra = [], {}, []
        for site_name, r in rows:
            if isinstance(r, SoftmaxRows):
                s = (site_values or self._sites())[site_name].detach()
                *block, rotations[site_name], nat = r.rows(s)
                blocks.append(tuple(block))
                extra += [nat] if nat is not None else []
            elif site_name is not None and site_values is not None:
                s = self.batch_of(site_name, site_values[site_name])
                blocks.append((r.A, *site_to_row(s[:, 0], s[:, 1], r.c)))
            else:
                blocks.append((r.A, r.w, r.b))
        like, D = prior.loc, self.spec.dim
        if len(blocks) == 1:
            A, w, b = blocks[0]
        elif blocks:
            A = torch.cat([b[0] for b in blocks], 0)
            w = torch.cat([b[1] for b in blocks], 0)
            b = torch.cat([b[2] for b in blocks], 0)
        else:
            A, w, b = like.new_zeros(0, D), like.new_zeros(0), like.new_zeros(0)
        h = P = None
        general = general_values if general_values is not None else self._general()
        if general is not None:
            extra.append(tuple(t.detach() for t in general))
        extra += self.plate_extras()
        h0 = init_value if init_value is not None else self._init_h()
        if h0 is not None:  # the start offset (init_loc_fn): a mean shift only
            extra.append((h0.detach(), h0.new_zeros(D, D)))
        if extra:  # natural parameters added outside the rows (general, Kronecker softmax)
            h, P = sum(e[0] for e in extra), sum(e[1] for e in extra)
        post = solve(prior, A, w, b, h, P, reduce=self.options.reducer, keep_graph=graph)
        post.rotations = rotations
        post.blocks, i = [], 0
        for (site_name, _), blk in zip(rows, blocks):
            post.blocks.append((site_name, slice(i, i + blk[0].shape[0])))
            i += blk[0].shape[0]
        return post

    def elbo(self, ctx: StepContext, prior: GaussianPrior) -> torch.Tensor:
        """``-KL(q || prior)`` plus the owned factors' expected log-densities; with
        ``ctx.grads``, writes the natural gradients ``target - lambda_tilde`` into ``.grad``.

        The targets come from the current ``q`` (no graph). Where the prior or the rows depend
        on the model's parameters and the graph is wanted (``ctx.graph``), the value is that of
        ``q`` re-solved with graph from the same sites (the same number): its gradient is the
        derivative of the ELBO at fixed site parameters."""
        post, tr = self.post, ctx.trace
        gpost = self._graph[3] if self._graph is not None else None
        valued = post if gpost is None else gpost
        graph_rows = self._graph[1] if gpost is not None else self.rows
        shared = -valued.kl_to(prior)
        shared = shared - plugin_expected_log_prob(prior, valued)  # (the mean field's)
        elbo = torch.zeros_like(shared)  # the factors' terms: this rank's data points
        for idx, fn in self.elbo_rows:
            sl = post.blocks[idx][1]
            fn = fn if gpost is None else self._graph[2][idx]
            elbo = elbo + fn(valued.f_mean[sl], valued.f_var[sl])
        sites = self._sites()
        for (site_name, sl), (_, r), (_, rg) in zip(post.blocks, self.rows, graph_rows):
            if site_name is None or self.enumerated_grad(ctx, site_name, post, sl, r):
                continue  # (a discrete parent's: the mean field owns its term)
            if isinstance(r, SoftmaxRows):
                value, target = softmax_message(
                    tr.nodes[site_name],
                    r,
                    post.loc,
                    r.cov_blocks(post, sl, post.rotations[site_name]),
                    self.options.softmax,
                    self.options.num_quad_points,
                    self.options.num_samples or 100,
                )
            else:
                value, target = linear_predictor_message(
                    tr.nodes[site_name],
                    r,
                    post.f_mean[sl],
                    post.f_var[sl],
                    self.options.num_quad_points,
                    self.options.num_samples,
                )
            if gpost is not None:  # the same number, with its graph
                value = site_value(tr.nodes[site_name], rg, gpost, sl, self.options)
            elbo = elbo + value
            if ctx.grads:
                self.write_site_grad(sites[site_name], target, tr.nodes[site_name])
        general = self._general()
        if general is not None:
            value, h, P, self._vectorise = general_message(
                self.options, self._log_joint(ctx), post, -general[1], ctx, self._vectorise
            )
            elbo = elbo + value
            if ctx.grads:  # (1/(t+1) for a hidden draw's message: averaged over the steps)
                w = draw_weight(self, ctx)
                general[0].grad = w * (h - general[0].detach())
                general[1].grad = w * (P - general[1].detach())
        h0 = self._init_h()
        if h0 is not None and ctx.grads:  # no factor's message: the target is zero
            h0.grad = -h0.detach()
        if self.options.reducer is not None:
            return self.options.reducer.combine(shared, elbo)
        return shared + elbo

    def _log_joint(self, ctx: StepContext):
        """``z -> (sum of the general factors' log p, the owned ones)``, the other latents drawn
        once from q (one draw per message)."""
        others = ctx.sample_q(exclude=set(self.names))
        fixed = [f.site for f in self.general if f.plate is None]
        plates = {f.plate for f in self.general if f.plate is not None}
        # a sequential subsampled plate names its sites by data index: take this minibatch's
        mine_too = {f.plate for f in self.general if f.plate is not None and f.site in self.owned}

        def f(z):
            t = trace_model(ctx.model, {**others, **self.spec.split(z)}, ctx.args, ctx.kwargs)
            batch = [n for n, s in t.nodes.items() if _observed_in(s, plates) and n not in fixed]
            sites = fixed + batch
            owned = [s for s in fixed if s in self.owned]
            owned += [n for n in batch if _observed_in(t.nodes[n], mine_too)]
            t.compute_log_prob(site_filter=lambda s, site: s in sites)
            total = sum(t.nodes[s]["log_prob_sum"] for s in sites)
            mine = sum((t.nodes[s]["log_prob_sum"] for s in owned), torch.zeros_like(total))
            return total, mine

        return f

    def step_sites(self, beta: float) -> StepCounts:
        """``lambda_tilde <- lambda_tilde + beta * grad`` (eq. 12), shrunk until q is valid."""
        sites, general, h0 = self._sites(), self._general(), self._init_h()
        params = list(sites.values()) + ([h0] if h0 is not None else [])
        params += list(general) if general is not None else []
        pair = targets_from_grads(params) if params else None
        if pair is None:
            return StepCounts()
        old, target = pair
        target = undamped_targets(self, old, target, beta)  # (a hidden draw's average)
        keys, solved = list(sites), {}
        k0 = len(keys) + (h0 is not None)

        def valid(new) -> torch.Tensor:
            s = dict(zip(keys, new[: len(keys)]))
            g = tuple(new[k0:]) or None
            i = new[len(keys)] if h0 is not None else None
            try:
                post = self._solve(s, g, init_value=i)
                ok = bool(torch.isfinite(post.loc).all())
            except NotPositiveDefinite:
                ok = False
            if ok:
                solved["post"] = post
            return torch.tensor(ok, device=old[0].device)

        new = cvi_update(old, target, beta)
        if general is not None and bool(valid(new)):
            counts = StepCounts()
        else:
            if general is not None:  # the plain step leaves the domain: Lin, Schmidt & Khan's
                # (2020) update instead (positive definite for any b <= beta). Not at once:
                # where G is huge its (b^2/2) G S G term overshoots the precision
                post = self.post
                pair = retraction_target(old[-2:], target[-2:], post.loc, post.covariance(), beta)
                target = (*target[:-2], *pair)
            new, counts = damped_step(old, target, beta, valid, max_halvings=MAX_HALVINGS_SOLVE)
        if counts.rejected:
            return counts
        with torch.no_grad():
            self.update_plate_sums(dict(zip(keys, new[: len(keys)])))
            for p, v in zip(params, new):
                p.copy_(v)
        self.post = solved["post"]
        self._sync_rows()
        return counts

    def _sync_rows(self) -> None:
        """Keep the rows consistent with the current site values (softmax rows are rebuilt from
        the sites at every solve)."""
        sites = self._sites()
        for site_name, r in self.rows:
            if site_name is not None and not isinstance(r, SoftmaxRows):
                s = self.batch_of(site_name, sites[site_name].detach())
                r.w, r.b = site_to_row(s[:, 0], s[:, 1], r.c)

    def forget(self) -> None:
        """The parameters were set from outside (a step undone): rebuild ``q`` from them."""
        self._refreshed_from, self._others = None, {}  # (a plate's sums: maybe set too)
        if self.post is not None:
            self._sync_rows()
            self.post = self._solve()

    def joint(self, names: Optional[Sequence[str]] = None) -> dist.MultivariateNormal:
        """``q`` of the concatenated flattened values of ``names`` (default: the whole block)."""
        post = self.post
        if names is None or tuple(names) == self.names:
            return dist.MultivariateNormal(post.loc, scale_tril=post.scale_tril())
        idx = torch.cat([self.index_of(n) for n in names])
        cov = post.covariance()[idx][:, idx]
        return dist.MultivariateNormal(post.loc[idx], covariance_matrix=cov)

    def joint_sample(self) -> torch.Tensor:
        """``joint().sample()`` bit for bit, without building the distribution (sympy, once)."""
        return mvn_draw(self.post.loc, self.post.scale_tril())

    def index_of(self, name: str) -> torch.Tensor:
        i = self.names.index(name)
        start = sum(self.spec.sizes[:i])
        return torch.arange(start, start + self.spec.sizes[i], device=self.post.loc.device)

    def marginal(self, name: str) -> torch.distributions.Distribution:
        shape = self.spec.shapes[self.names.index(name)]
        if len(self.names) == 1:
            post = self.post
            if len(shape) == 0:
                return dist.Normal(post.loc[0], post.covariance()[0, 0].sqrt())
            mvn = dist.MultivariateNormal(post.loc, scale_tril=post.scale_tril())
        else:
            mvn = self.joint([name])
            if len(shape) == 0:
                return dist.Normal(mvn.loc[0], mvn.covariance_matrix[0, 0].sqrt())
        if len(shape) == 1:
            return mvn
        return dist.TransformedDistribution(
            mvn, torch.distributions.transforms.ReshapeTransform(mvn.event_shape, shape)
        )

    def mean_values(self) -> Dict[str, torch.Tensor]:  # (before the first solve: z_at)
        return self.spec.split((self.z_at if self.post is None else self.post.loc).detach())


def _observed_in(site, plates) -> bool:
    return (
        site["type"] == "sample"
        and site["is_observed"]
        and any(f.name in plates for f in site["cond_indep_stack"])
    )


register_block_kind(lambda spec: spec.chain is None, GaussianBlock, fallback=True)
