"""Messages to the natural-form latents (Algorithm 2 of Khan & Lin, 2017).

For a mean-field ``q(z) = prod_i q_i(z_i | lambda_i)`` one step of Algorithm 2 is

    lambda~_i = sum_{a in N_i} [ eta~_{a,i} + grad_{mu_i} E_q[log p~_nc^{a,i}] ]     (step 4)
    lambda_i <- (1 - beta) lambda_i + beta lambda~_i                               (step 5)

Both kinds of message are ``grad_{mu_i} E_q[log p_a]`` (eq. 89): exact factors through the
closed form of :mod:`~pyro_cvi.messages.expectations` (so with ``beta = 1`` a sequential sweep is
CAVI),
general factors by Monte Carlo (:mod:`~pyro_cvi.messages.montecarlo`); a Gamma precision beside
the remainder gets the expected natural parameter of the factors the remainder owns, averaged
over joint draws (:mod:`~pyro_cvi.messages.precision`). :func:`compute` also returns
the
mean-field part of the ELBO: every factor touching a natural-form latent, and their entropies.
Inside ``pyro.plate(..., subsample_size=B)`` a local latent's terms all carry the scale ``N/B``;
its target is the unscaled message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Set, Tuple

import torch

from ..context import Options, StepContext
from ..model import conjugate_pairs as cp
from ..model.analysis import MEANFIELD
from ..model.factor_roles import minibatch_renames, minibatch_spec
from ..model.replication import replicated_sites
from ..model.tracing import run_model
from .augmented import augmented_plan
from .expectations import QState, expected_log_prob
from .expected_natural import expected_natural, expected_natural_rule
from .montecarlo import monte_carlo
from .precision import jensen_gap, precision_messages, precision_sites
from .prior_expected import beside_messages

#: joint draws of ``q`` per Monte Carlo expected message (at least; ``num_general_samples``)
EXPECTED_MESSAGE_SAMPLES = 16

__all__ = ["MeanFieldResult", "compute"]


@dataclass
class MeanFieldResult:
    elbo: torch.Tensor
    targets: Dict[str, Tuple[torch.Tensor, ...]]


def compute(
    ctx: StepContext,
    analysis,
    natural: Dict,
    gaussian,
    options: Options,
    cache: Dict,
    fixed: Dict[str, torch.Tensor],
    want: Optional[Set[str]] = None,
    value: bool = True,
) -> MeanFieldResult:
    """``E_q[log p]`` over the factors touching natural-form latents, their entropies, and
    (for the latents in ``want``, default all) the targets ``grad_mu E_q[log p]``.

    With ``value=False`` only the factors touching ``want`` are evaluated.
    """
    want = set(natural) if want is None else set(want) & set(natural)
    sub = ctx.subsample
    q = QState(natural, gaussian, sub, want, fixed)
    specs = []
    # a sequential subsampled plate names its sites by data index: this minibatch's sites
    nodes = ctx.trace.nodes if ctx.trace is not None else None
    renames = minibatch_renames(analysis, ctx.trace) if nodes is not None else {}
    for site, owner in analysis.owner.items():
        if owner != MEANFIELD or (nodes is not None and site not in nodes):
            continue  # (not in this minibatch)
        spec = analysis.spec(site)
        if value or spec.latents & want:
            specs.append(spec)
    for site, template in renames.items():
        if site not in analysis.owner and template is not None:
            if analysis.owner[template] == MEANFIELD:
                spec = minibatch_spec(analysis, site, template)
                if value or spec.latents & want:
                    specs.append(spec)
    if any(s.collapsed for s in specs):  # the collapsed group is one factor: all or nothing
        group = [analysis.spec(s) for s in analysis.collapsed_sites]
        specs += [s for s in group if s not in specs]
    exact = [s for s in specs if s.exact]
    # factors made conjugate by auxiliary latents (allocations): exact messages of their own
    augmented = {s.site: augmented_plan(analysis, s) for s in specs if not s.exact}
    augmented = {k: v for k, v in augmented.items() if v is not None}
    general = [s for s in specs if not s.exact and s.site not in augmented]
    like = next(iter(q.mu.values()))[0] if q.mu else None
    zero = torch.zeros(
        (), dtype=None if like is None else like.dtype, device=None if like is None else like.device
    )
    # data-parallel (options.reducer): factors every rank holds in full count 1/R per rank
    reducer = options.reducer
    shared = replicated_sites(analysis) if reducer is not None else set()
    share = 1.0 / reducer.world_size if reducer is not None else 1.0
    key = (ctx.data_key, tuple((k, tuple(v.tolist())) for k, v in sorted(sub.items())))
    grad_total, elbo = zero, zero
    memo: Dict[str, object] = {}

    def at_means():
        """The model run once at the mean values (shared by every closed-form read)."""
        if "mean" not in memo:
            memo["mean"] = run_model(
                ctx.model, q.values("mean"), ctx.args, ctx.kwargs, analysis.enum_dims
            )
        return memo["mean"]

    with torch.enable_grad():
        mc_grads: Dict[str, Tuple[torch.Tensor, ...]] = {}
        first = None
        # non-conjugate factors of a natural-form latent in the factor's own family send it
        # their expected natural parameter (eq. 20) where it is reliable; their Monte Carlo
        # terms are Rao-Blackwellised over that latent (montecarlo._log_prob)
        S = max(EXPECTED_MESSAGE_SAMPLES, int(options.num_general_samples))
        own_msgs, own = {}, {}
        for s in general:
            rule = expected_natural_rule(analysis, s, q.fam.get(s.site))
            if rule is None:
                continue
            lam = q.lam[s.site]
            batch = lam[0].shape[: lam[0].dim() - len(q.fam[s.site].param_shapes[0])]
            ok = torch.ones(batch, dtype=torch.bool, device=lam[0].device)
            if s.site in want:
                shapes = [t.shape for t in lam]
                found = expected_natural(
                    ctx, analysis, s.site, q.fam[s.site], rule, shapes, at_means, S
                )
                ok = ok & False if found is None else found[1]
                if bool(ok.any()):
                    own_msgs[s.site] = tuple(
                        torch.where(ok.reshape(ok.shape + (1,) * (t.dim() - ok.dim())), t, 0.0)
                        for t in found[0]
                    )
            k = len(natural[s.site].value_shape(lam)) - ok.dim()
            own[s.site] = ok.reshape(ok.shape + (1,) * k)
        if general:
            total, mc_grads, first = monte_carlo(
                ctx, general, q, want, analysis, gaussian, options, own
            )
            elbo = elbo + total
        if exact:
            # factors whose parameters are all free of continuous latents (e.g. priors with
            # fixed hyperparameters) can be read off any trace: reuse a Monte Carlo one
            plain = first is not None and all(
                not s.discrete and all(r.kind == cp.CONST for r in s.roles.values()) for s in exact
            )
            mean_trace = first if plain else at_means()
            traces = {"mean": mean_trace}
            if q.geo and any(r.kind == cp.MONOMIAL for s in exact for r in s.roles.values()):
                traces["geo"] = run_model(
                    ctx.model, q.values("geo"), ctx.args, ctx.kwargs, analysis.enum_dims
                )
            for spec in exact:
                e = expected_log_prob(spec, traces, q, cache, key)
                e = e * share if spec.site in shared else e
                grad_total = grad_total + e
        elbo = elbo + grad_total
        aug_msgs: Dict[str, Tuple[torch.Tensor, ...]] = {}
        for site, (kind, plan) in augmented.items():
            e, msgs = kind.messages(plan, at_means(), q, want)
            elbo = elbo + (e * share if site in shared else e)
            for n, m in msgs.items():
                old = aug_msgs.get(n)
                aug_msgs[n] = m if old is None else tuple(a + b for a, b in zip(old, m))
        targets: Dict[str, Tuple[torch.Tensor, ...]] = {}
        names = sorted(want, key=list(natural).index)
        leaves = [t for n in names for t in q.mu[n]]
        if leaves and grad_total.requires_grad:
            gs = torch.autograd.grad(grad_total, leaves, allow_unused=True, retain_graph=value)
        else:
            gs = [None] * len(leaves)
        expected = {}
        for n in names:  # factors the remainder owns: expected natural parameters by MC
            sites = precision_sites(analysis, n)
            if sites:
                S = max(EXPECTED_MESSAGE_SAMPLES, int(options.num_general_samples))
                expected[n] = precision_messages(ctx, analysis, n, sites, S)
                if value:  # the remainder read its factors at E[tau]: the Jensen gap
                    gap = jensen_gap(expected[n][0], q.values("mean")[n], q.geo[n])
                    elbo = elbo + gap * share
        for n in names:  # the remainder's factors, exact given its q (prior_expected)
            msg = beside_messages(ctx, analysis.latents[n].factors, n, q.mu[n][0].shape)
            if msg is not None:
                old = expected.get(n)
                expected[n] = msg if old is None else tuple(a + b for a, b in zip(old, msg))
        for site, msg in list(own_msgs.items()) + list(aug_msgs.items()):
            if site in expected:
                msg = tuple(a.reshape(b.shape) + b for a, b in zip(expected[site], msg))
            expected[site] = msg
        k = 0
        for n in names:
            parts = []
            for t in q.mu[n]:
                g = gs[k]
                parts.append(torch.zeros_like(t) if g is None else g.detach())
                k += 1
            if n in mc_grads:
                parts = [a + b for a, b in zip(parts, mc_grads[n])]
            if n in expected:
                parts = [a + b.reshape(a.shape) for a, b in zip(parts, expected[n])]
            s = natural[n].local_scale(sub)
            if s != 1.0:
                parts = [t / s for t in parts]
            targets[n] = tuple(q.fam[n].symmetrize(tuple(parts)))
    if reducer is not None:  # the global latents' targets: the sums over every rank's data
        reducer.reduce_targets(targets, [n for n in names if n in shared])
    if value:
        for n, nb in natural.items():  # (a fixed order: a reproducible float sum)
            h = q.fam[n].entropy(q.lam[n]).sum() * nb.local_scale(sub)
            elbo = elbo + (h * share if n in shared else h)
        if reducer is not None:
            elbo = reducer.combine(torch.zeros_like(elbo), elbo)
    return MeanFieldResult(elbo, targets)
