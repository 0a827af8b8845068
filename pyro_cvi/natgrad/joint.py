"""The one-draw step's messages for a joint Gaussian over packed unconstrained coordinates
(the remainder's ``q(u) = N(m, S)``; :mod:`pyro_cvi.natgrad.horizon` for the step and its
control, :mod:`pyro_cvi.gaussian.onedraw` for the maths).

The block handed in provides ``_values()``, ``_log_joint(ctx, u, others)``, ``loc_name``,
``role_names``, ``form``, ``dim``, ``prior_loc``, ``prior_prec`` and ``control``.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Sequence

import pyro
import torch

from ..gaussian.onedraw import (
    known_prior_expectation,
    onedraw_diag,
    onedraw_diag_step,
    onedraw_tril,
    onedraw_tril_step,
)
from ..gaussian.price import bonnet_mean_gradient, expected_hessian, price_precision_gradient
from ..model.signature import closure_key, data_key
from .control import NoiseControl, SignalToNoise
from .prior import known_normal_prior

#: ``Remainder(curvature="auto")`` uses dense Hessians (Price's theorem) up to this many
#: coordinates where the log joint is vectorised (re-exported by :mod:`pyro_cvi.strategies`;
#: the size already taken beside a kept precision). Their ``D`` rows are one batched backward
#: pass; ``remainder_rules.PRICE_MAX_WORK`` bounds that pass's work
HESSIAN_MAX_DIM = 64

__all__ = [
    "price_by_default",
    "hierarchical",
    "known_priors",
    "may_use_price",
    "use_price",
    "marginal_var",
    "metric",
    "onedraw_direction",
    "onedraw_messages",
    "onedraw_step",
    "price_messages",
    "add_report",
    "antithetic_draws",
    "paired_report",
    "prior_split",
    "report_generator",
    "report_key",
    "report_pairs",
    "tracked_report",
]


def marginal_var(form: str, params: Dict[str, torch.Tensor], roles: Sequence[str]) -> torch.Tensor:
    """The marginal variances ``diag(S)`` (differentiable in ``params``)."""
    sc = params[roles[0]]
    if form == "full":
        return sc.tril().pow(2).sum(-1)
    if form == "diag":
        return sc * sc
    W = params[roles[1]]
    return sc * sc * (1.0 + (W * W).sum(-1))


def metric(
    form: str, p: Dict[str, torch.Tensor], roles: Sequence[str]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> S x`` of the current ``q``."""
    sc = p[roles[0]]
    if form == "full":
        return lambda x: sc @ (sc.mT @ x)
    if form == "diag":
        return lambda x: sc * sc * x
    W = p[roles[1]]
    return lambda x: sc * ((sc * x) + W @ (W.mT @ (sc * x)))


def prior_split(block, params: Dict[str, torch.Tensor], draws: torch.Tensor) -> torch.Tensor:
    """``E_q[log prior] - log prior(u_k)`` of the known Gaussian priors (zero mean over ``q``;
    differentiable in ``params`` and the draws), up to constants that cancel."""
    p0 = block.prior_prec
    if not bool((p0 > 0).any()):
        return draws.new_zeros(draws.shape[0])
    m = params[block.loc_name]
    at_draws = -0.5 * (p0 * (draws - block.prior_loc).pow(2)).sum(-1)
    var = marginal_var(block.form, params, block.role_names)
    return known_prior_expectation(m, var, block.prior_loc, p0) - at_draws


def onedraw_messages(block, ctx, p, log_joint, K: int, shown=None):
    """The one-draw step's directions: the gradient of the log joint at ``K`` draws, the
    known Gaussian priors exact; the loss is ``mean_k [f(u_k) - log q(u_k)] + E_q[log
    prior]``, unbiased for the bound. ``p``: the block's parameter values (the step's
    iterate); ``shown``: the ``q`` the guide holds where it is not ``p`` (the iterates'
    average): the report is of its bound (the step control's decision the draw's), from the
    rule's ``report_pairs``, else the block's ``average_pairs`` (by the log joint's work,
    :mod:`pyro_cvi.blocks.remainder_joint`), or where there are none, one draw ``e`` a step
    at ``shown`` and at the previous ``shown`` (two rows of the batched run,
    :func:`alternating_draw`; ``TrackedReport`` with common random numbers: the average moves
    little a step, so the difference is sharp and the report averages over many steps'
    draws). ``log_joint(u)``: the log joint at draws. Returns ``(elbo, {loc: -mean r, "G": G}
    or None)``."""
    m, sc = p[block.loc_name], p[block.role_names[0]]
    q = p if shown is None else shown
    full = block.form == "full"
    eps = torch.randn(K, block.dim, dtype=m.dtype, device=m.device)
    dz = eps @ sc.mT if full else sc * eps
    u = (m + dz).requires_grad_(True)
    # the report's pairs run in the draw's own batched model run, as rows the gradient does
    # not read (none where the model runs once per draw; at the first step the batched run is
    # checked on the step's draw alone, and the pairs run after it): the run's fixed cost is
    # paid once
    f = None
    if block.vectorise is None:
        f = log_joint(u)
    batched = block.vectorise is not None and block.vectorise is not False
    n = getattr(block.rule, "report_pairs", 0) if batched else 0
    if batched and shown is not None and n == 0:  # the averaged guide's report: by its work
        n = getattr(block, "average_pairs", 0)
    single = batched and shown is not None and n == 0  # one draw, no antithetic twin
    n = 1 if single else n
    tracked = tracked_report(block, ctx) if n >= 2 or single else None
    key = prev = None
    if tracked is not None:
        key = report_key(block, ctx)
        prev = tracked.previous(key)
    if n > 0:
        qm, qs = q[block.loc_name], q[block.role_names[0]]
        if single:
            e2, u2 = alternating_draw(block, ctx, qm, qs, full)
        else:
            e2, u2 = antithetic_draws(block, ctx, qm, qs, n, full)
        parts = [u2.detach()]
        if prev is not None:  # the same pairs at the previous q (common random numbers)
            u_prev, logdet_prev = _at_previous(block, prev, e2, full)
            parts.append(u_prev.detach())
        if f is None:
            f_all = log_joint(torch.cat([u] + parts))
            f, rest = f_all[:K], f_all[K:].detach()
        else:
            with torch.no_grad():
                rest = log_joint(torch.cat(parts))
    elif f is None:
        f = log_joint(u)
    prior = prior_split(block, p, u)
    # log q(u_k) from eps_k: -|eps_k|^2 / 2 - log |L| - D log(2 pi) / 2
    logdet = (sc.diagonal() if full else sc).abs().log().sum()
    log_q = -0.5 * eps.pow(2).sum(-1) - logdet - 0.5 * block.dim * math.log(2 * math.pi)
    per_t = f + prior - log_q
    elbo = per_t.mean()
    ctx.add_mc_samples(per_t)
    if n > 0:
        with torch.no_grad():
            sq = q[block.role_names[0]]
            logdet_q = (sq.diagonal() if full else sq).abs().log().sum()
            const = logdet_q + 0.5 * block.dim * math.log(2 * math.pi)
            r = e2.shape[0]
            pairs = paired_report(block, q, parts[0], rest[:r], e2, const)
            value = float(pairs.mean())
            if tracked is not None:
                before = None
                if prev is not None:
                    c0 = logdet_prev + 0.5 * block.dim * math.log(2 * math.pi)
                    before = paired_report(block, prev, parts[1], rest[r:], e2, c0)
                value = tracked.update(key, q, pairs, before)
        # the reported value is the pairs' (or their tracked) mean, the step control's
        # decision the draw's
        ctx.report_shift += value - float(per_t.detach().mean())
    if ctx.grads:
        record = getattr(block.control, "record", None)
        if record is not None:  # the step schedule's plateau test (natgrad/horizon.py)
            record(-float(per_t.detach().mean()))
        # (the loss keeps this graph where it is differentiated for the model's parameters)
        (g,) = torch.autograd.grad(
            (f + prior).sum(), u, allow_unused=True, retain_graph=bool(ctx.graph)
        )
        g = torch.zeros_like(u) if g is None else g.detach()
        p0, c = block.prior_prec, block.control.center()
        if c is not None and c.shape != m.shape:
            c = None
        if full:
            c = None if c is None else c.double()
            gm, G = onedraw_tril(sc.double(), eps.double(), g.double(), p0.double(), c)
            gm, G = gm.to(m), G.to(m)
        else:
            gm, G = onedraw_diag(sc, eps, g, p0, c)
        return elbo, {block.loc_name: gm, "G": G}
    return elbo, None


def tracked_report(block, ctx):
    """The block's :class:`~pyro_cvi.natgrad.report.TrackedReport` where its rule asks for one
    (``report_track``), the evaluation is a step's (``ctx.grads``: an evaluation outside a step,
    e.g. ``svi.evaluate_loss``, reports fresh pairs, independent of earlier reports, and leaves
    the tracker as it was) and the log joint is the block's alone (every latent of the model is
    one of its ``names``: no other block's ``q`` in it), else ``None``."""
    if not getattr(block.rule, "report_track", False) or not ctx.grads:
        return None
    analysis = getattr(block, "analysis", None)
    if analysis is None or not set(analysis.values) <= set(block.names):
        return None
    return getattr(block.control, "tracked", None)


def report_key(block, ctx):
    """What the log joint reads besides ``u``: the data (the arguments' identities, versions
    and shapes, and the model's closure tensors) and the model's parameters in Pyro's param
    store (outside the guide's own, by name prefix); ``None`` under a minibatch (each step
    another log joint: the tracked report restarts)."""
    if ctx.subsample:
        return None
    prefix = block.loc_name.split(".", 1)[0] + "."
    store = pyro.get_param_store()
    params = tuple(
        (name, id(v), v._version)
        for name, v in store.named_parameters()
        if not name.startswith(prefix)
    )
    # the closure's tensors: the engine's key (its re-analysis check reads their versions each
    # step and renews the key where they changed), else read here (a scan of the model's code)
    closure = getattr(ctx, "data_key", None)
    if closure is None:
        closure = closure_key(ctx.model)
    return data_key(ctx.args, ctx.kwargs) + (closure,) + params


#: the report's base seed (its draws are the block's own, see :func:`report_generator`)
REPORT_SEED = 0x5EED


def report_pairs(block, K: int) -> int:
    """The report's antithetic pairs of a block under Price's Hessians or the gradient step:
    the rule's ``report_pairs`` where the log joint is vectorised (one batched forward run),
    at most ``K D / 2`` (their ``2 n`` forward draws cost no more than the ``K D`` backward
    rows of the dense Hessians), none for the gradient step (its ``K`` draws cost about
    ``K`` model runs: the report's would cost more than the step)."""
    n = getattr(block.rule, "report_pairs", 0)
    if n <= 0 or not block.hessian or block.vectorise is None or block.vectorise is False:
        return 0
    return min(n, (K * block.dim) // 2)


def add_report(block, ctx, p, log_joint, log_q, elbo: torch.Tensor, n: int) -> None:
    """Report the mean of ``n`` antithetic pairs ``u = m +- L e`` (the block's own generator,
    one forward-only batched run of the log joint) in place of the step's estimate ``elbo``
    (:attr:`~pyro_cvi.context.StepContext.report_shift`): each pair's mean of ``f(u) +
    E_q[log prior] - log prior(u) - log q(u)`` is unbiased for the current ``q``'s bound, its
    odd Taylor terms cancelled; the pairs are independent of the step's draws and so of the
    step control's accept decision, which reads the step's estimate. Where the rule tracks
    (``report_track``), the same pairs also run at the previous ``q`` and the report is
    :class:`~pyro_cvi.natgrad.report.TrackedReport`'s."""
    m, sc = p[block.loc_name], p[block.role_names[0]]
    full = block.form == "full"
    tracked = tracked_report(block, ctx) if n >= 2 else None
    key = prev = None
    if tracked is not None:
        key = report_key(block, ctx)
        prev = tracked.previous(key)
    with torch.no_grad():
        e, u = antithetic_draws(block, ctx, m, sc.tril() if full else sc, n, full)
        rows = [u]
        if prev is not None:
            u_prev, logdet = _at_previous(block, prev, e, full, tril=True)
            rows.append(u_prev)
        f = log_joint(torch.cat(rows))
        per = f[: 2 * n] + prior_split(block, p, u) - log_q(u)
        pairs = 0.5 * (per[:n] + per[n:])
        value = float(pairs.mean())
        if tracked is not None:
            before = None
            if prev is not None:
                lq = -0.5 * e.pow(2).sum(-1) - logdet - 0.5 * block.dim * math.log(2 * math.pi)
                per = f[2 * n :] + prior_split(block, prev, rows[1]) - lq
                before = 0.5 * (per[:n] + per[n:])
            value = tracked.update(key, p, pairs, before)
    ctx.report_shift += value - float(elbo.detach())


def _at_previous(block, prev, e: torch.Tensor, full: bool, tril: bool = False):
    """The pairs ``e`` at the previous ``q`` (parameters ``prev``): ``(m' + L' e, log |L'|)``."""
    sp = prev[block.role_names[0]]
    sp = sp.tril() if full and tril else sp
    u = prev[block.loc_name] + (e @ sp.mT if full else sp * e)
    return u, (sp.diagonal() if full else sp).abs().log().sum()


def antithetic_draws(block, ctx, m: torch.Tensor, scale: torch.Tensor, n: int, full: bool):
    """``(e, u)``: ``n`` antithetic pairs ``e = [e_j; -e_j]`` from :func:`report_generator` and
    ``u = m + L e`` (``L = scale``, lower triangular where ``full``, else its diagonal)."""
    g = report_generator(block, ctx)
    e = torch.randn(n, block.dim, dtype=m.dtype, generator=g, device=g.device)
    e = torch.cat([e, -e]).to(m.device)
    return e, m + (e @ scale.mT if full else scale * e)


def alternating_draw(block, ctx, m: torch.Tensor, scale: torch.Tensor, full: bool):
    """``(e, u)``: the single report draw of a step, ``e`` from a generator seeded by the pair
    of steps ``(2 j, 2 j + 1)`` that holds the guide's step counter and negated at the odd
    one: consecutive steps' draws are antithetic, so the linear terms of a tracked report's
    fresh values and differences cancel over two steps (a pair's gain at one row a step)."""
    steps = int(getattr(ctx, "steps", 0) or 0)
    g = torch.Generator().manual_seed(REPORT_SEED + 1_000_003 * (steps - steps % 2) + 499)
    e = torch.randn(1, block.dim, dtype=m.dtype, generator=g, device=g.device).to(m.device)
    e = -e if steps % 2 else e
    return e, m + (e @ scale.mT if full else scale * e)


def report_generator(block, ctx) -> torch.Generator:
    """A generator of the block's own for the report's draws (the step's draws come from the
    user's stream, as without a report), seeded by the guide's step counter and the report's
    count within that step: a run resumed from a checkpoint (which holds the counter) draws
    the same pairs as the uninterrupted run; evaluations within one step draw fresh ones."""
    steps = int(getattr(ctx, "steps", 0) or 0)
    last, k = getattr(block, "_report_count", (None, 0))
    k = k + 1 if last == steps else 0
    block._report_count = (steps, k)
    return torch.Generator().manual_seed(REPORT_SEED + 1_000_003 * steps + k)


def paired_report(block, p, u2, f2, e2, const) -> torch.Tensor:
    """The bound's estimate of each antithetic pair ``u = m +- L e``: the mean over the pair of
    ``f(u) + E_q[log prior] - log prior(u) - log q(u)``, minus the zero-mean quadratic
    ``((u - m)^T P0 (u - m) - tr(P0 S)) / 2`` (the known prior's fluctuation, which
    ``-log q`` would cancel if the prior were left in ``f``). The linear term cancels in each
    pair; the pairs are independent of each other. An odd number of rows: single draws, each
    its own estimate."""
    dz2 = u2 - p[block.loc_name]
    var = marginal_var(block.form, p, block.role_names)
    p0 = block.prior_prec
    quad = 0.5 * ((dz2 * dz2 * p0).sum(-1) - (p0 * var).sum())
    per = f2 + prior_split(block, p, u2) + 0.5 * e2.pow(2).sum(-1) + const - quad
    n = per.shape[0] // 2
    return per if per.shape[0] % 2 else 0.5 * (per[:n] + per[n:])


def known_priors(analysis, sites, dim: int):
    """``(a, p0)`` of the packed coordinates: :func:`~pyro_cvi.natgrad.prior.known_normal_prior`
    over the real sites (``name``, ``start``, ``size``, ``real`` attributes)."""
    like = next(v for v in analysis.values.values() if v.is_floating_point())
    spans = [(s.name, s.start, s.size) for s in sites if s.real]
    return known_normal_prior(analysis.structure.nodes, spans, dim, like)


def hierarchical(analysis, names: Sequence[str]) -> bool:
    """Whether a latent's prior depends on another of ``names`` (the analysis' dependencies)."""
    deps = getattr(analysis, "deps", {})
    group = set(names)
    return any(deps.get(n, set()) & (group - {n}) for n in names)


def onedraw_direction(block, p: Dict[str, torch.Tensor], gm: torch.Tensor) -> torch.Tensor:
    """The mean's direction: momentum on the sampled part of ``dl/dm`` (restarted in ``q``'s
    metric), plus the known prior's part ``P0 (m - a)``, exact (the low-rank form's gradient
    holds it already)."""
    gm = block.control.direction(gm, metric(block.form, p, block.role_names))
    if block.form != "lowrank":
        gm = gm + block.prior_prec * (p[block.loc_name] - block.prior_loc)
    return gm


def onedraw_step(block, p: Dict[str, torch.Tensor], grads, b_prec: float, b_mean: float):
    """The diagonal or full step (:mod:`pyro_cvi.gaussian.onedraw`): ``(new params, d)``."""
    m, (name,) = p[block.loc_name], block.role_names
    gm, G, p0 = grads[block.loc_name], grads["G"], block.prior_prec
    step = onedraw_tril_step if block.form == "full" else onedraw_diag_step
    m2, sc2, d = step(m, p[name], gm, G, p0, b_prec, b_mean)
    return {block.loc_name: m2, name: sc2}, d


def price_messages(block, ctx, p, log_joint, log_q, K: int):
    """Bonnet's and Price's theorems (eqs. 30-31): ``dL/dm = E[g]``, ``dL/dS = E[H] / 2 +
    S^-1 / 2`` from the gradient ``g`` and Hessian ``H`` of ``log p(T(u)) + log|T'(u)|`` at
    the draws (the mean's with the control variate ``S^-1 (u - m)``, zero in expectation).
    The precision's target ``-E[H]`` is exact at once where the posterior is Gaussian in
    ``u``, whatever ``q``: a Newton step (variational online Newton). The reported loss is
    :func:`add_report`'s (where :func:`report_pairs` gives pairs). Returns ``(elbo, grads or
    None)`` (see :func:`onedraw_messages`)."""
    m, L = p[block.loc_name], p[block.role_names[0]]
    eps = torch.randn(K, block.dim, dtype=m.dtype, device=m.device)
    u = (m + eps @ L.mT).requires_grad_(True)
    f = log_joint(u)
    per_t = f - log_q(u)
    elbo = per_t.mean()
    ctx.add_mc_samples(per_t)
    n = report_pairs(block, K)
    if n > 0:  # the reported loss: independent antithetic pairs
        add_report(block, ctx, p, log_joint, log_q, elbo, n)
    if ctx.grads:
        (g,) = torch.autograd.grad(f.sum(), u, create_graph=True, allow_unused=True)
        g = torch.zeros_like(u) if g is None else g
        H = expected_hessian(g, u)
        P = torch.cholesky_inverse(L)
        gm = -bonnet_mean_gradient(g.detach(), u.detach(), m, P)
        G = price_precision_gradient(H, P)
        return elbo, {block.loc_name: gm, "G": G}
    return elbo, None


def price_by_default(block) -> bool:
    """Whether the default rule takes Price's dense Hessians on a small full form
    (:func:`may_use_price`), as far as its size goes: yes, always. The structural test comes
    after it (``blocks.remainder_rules.cheap_hessian``: Price where the log joint is vectorised,
    the one-draw step, one gradient a step, where a model run chains its steps: ODEs,
    recursions). The user overrides with ``Remainder(curvature="hessian")`` or
    ``Remainder(step=Horizon())``. A rule by the model's measured cost would make the fit, and
    a resumed run, depend on the machine's load."""
    return block.dim >= 0


def may_use_price(block, strategy) -> bool:
    """Whether the default rule may still take Price's Hessians (:func:`price_by_default`):
    the one-draw step by default, on a full form of at most
    ``HESSIAN_MAX_DIM`` coordinates, with ``curvature="auto"``."""
    return bool(
        block.onedraw
        and strategy.step is None
        and strategy.curvature == "auto"
        and block.form == "full"
        and block.dim <= HESSIAN_MAX_DIM
    )


def use_price(block) -> int:
    """Switch the block to Price's Hessians under the noise control; the draws per step."""
    block.rule, block.hessian, block.onedraw = SignalToNoise(), True, False
    block.control = NoiseControl(start=1.0)
    block.prior_prec = torch.zeros_like(block.prior_prec)
    return block.strategy.draws(block.rule)
