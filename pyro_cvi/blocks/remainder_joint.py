"""The remainder's log joint at a batch of draws ``u_k`` of its unconstrained Gaussian: ``log p(x,
T(u_k)) + log |T'(u_k)|`` over the factors it owns, the discrete latents it holds summed out
(Pyro's TraceEnum contraction), the other blocks' latents at ``others`` (their draws from ``q``,
for factors shared with exact blocks). One model run with a particle plate left of the model's
plates when the model broadcasts over it (checked once against one run per draw, on two rows at
least), else one run per draw. The prior of a block latent read at expected natural parameters
(kind ``conjugate (E prior)``) enters Rao-Blackwellised over the block's ``q``
(:func:`rao_blackwellised`), not at the block's draw; the factors a chain at its expected
precisions shares with the remainder enter in one closed-form expression of the draws
(:func:`~pyro_cvi.messages.chain_expected.chain_log_factors`), not evaluated in the run."""

from __future__ import annotations

from typing import Any, Sequence

import pyro
import torch
from pyro.distributions.util import scale_and_mask
from pyro.poutine.trace_struct import Trace

from ..context import StepContext
from ..messages.chain_expected import chain_log_factors
from ..messages.collapsed import collapsed_log_prob
from ..messages.prior_expected import block_moments, expected_log_prior
from ..model.index_guard import checked_indexing
from ..model.tracing import run_model
from .remainder_rules import log_joint_graph

__all__ = ["rao_blackwellised", "remainder_log_joint"]


_REFUSED = (RuntimeError, ValueError, IndexError, TypeError, NotImplementedError, AssertionError)


def remainder_log_joint(block, ctx: StepContext, draws: torch.Tensor, others) -> torch.Tensor:
    """``log p(x, T(u_k)) + log |T'(u_k)|`` of each draw (the owned factors, the discrete
    latents summed out): one batched model run (a particle plate, else ``vmap``; the first
    that agrees with one run per draw at the first step is kept), else one run per draw."""
    skip, closed = chain_log_factors(block.analysis, ctx, block.owned, draws, block.sites)
    mo = _Moments(block_moments(block.analysis, ctx, set(block.owned) - skip, others))
    mo.skip = skip
    out = _sums(block, ctx, draws, others, mo)
    return out + closed if skip else out


def _sums(block, ctx: StepContext, draws: torch.Tensor, others, mo) -> torch.Tensor:
    if block.vectorise is not None:
        if block.vectorise is not False:
            try:
                out = block.vectorise(block, ctx, draws, others, mo)
            except _REFUSED:
                out = None
            if out is not None:
                return out
            block.vectorise = False  # (a model whose path changed with the values)
        return _looped(block, ctx, draws, others, mo)
    looped = _looped(block, ctx, draws, others, mo)
    tol = 1e-3 if looped.dtype in (torch.float32, torch.float16) else 1e-7
    block.vectorise = False
    rows, ref = draws, looped.detach()
    if draws.shape[0] == 1:  # one row cannot show rows mixed up: q's mean beside the draw
        mean = pyro.param(block.loc_name).detach().to(draws)[None]
        with torch.no_grad():
            ref = torch.cat([ref, _looped(block, ctx, mean, others, mo)])
        rows = torch.cat([draws.detach(), mean])
    for way in (_vectorised, _vmapped):
        try:
            with checked_indexing(draws.device, trial=way is _vectorised):
                found = way(block, ctx, rows, others, mo)
        except _REFUSED:
            found = None
        if found is not None and bool(torch.allclose(found.detach(), ref, rtol=tol, atol=tol)):
            block.vectorise = way
            block.average_pairs = average_pairs(block)
            break
    return looped


#: the most work (report rows times the log joint's graph size, :func:`log_joint_graph`) that
#: the averaged guide's report adds to a step, and its most pairs. Measured (float32, one
#: thread): the 13-8-3 wine network (graph 6,237) takes 4 tracked pairs (16 rows; within 1
#: nat of the bound at 300 steps on 5 seeds, 2 pairs on 2 of 3), where its step's fixed cost
#: dominates; the digits network (187,624) takes none: its rows cost about 0.8 ms each on a
#: 5 ms step, and the report is one alternating draw (2 rows)
REPORT_MAX_WORK = 2**17
AVERAGE_MAX_PAIRS = 4


def average_pairs(block) -> int:
    """The tracked pairs of the averaged guide's report (``Horizon(report_pairs=0)``): as
    many as :data:`REPORT_MAX_WORK` allows, at most :data:`AVERAGE_MAX_PAIRS` (0: one
    alternating draw a step)."""
    try:
        _, size = log_joint_graph(block.analysis, block.owned)
    except (RuntimeError, ValueError, TypeError, KeyError, NotImplementedError):
        return 0
    return min(AVERAGE_MAX_PAIRS, REPORT_MAX_WORK // (4 * max(int(size), 1)))


def rao_blackwellised(block, ctx: StepContext, others) -> dict:
    """``{site: (mean, variance)}`` of the block latents whose prior the remainder owns as an
    expected-prior factor: their log-density is read as ``E_q(theta)[log N(theta; loc(u),
    s(u))]`` in closed form (:func:`~pyro_cvi.messages.prior_expected.expected_log_prior`),
    the block's moments held fixed, instead of at a draw of ``theta`` (``others``: the draws
    of the other blocks' latents the run reads)."""
    return block_moments(block.analysis, ctx, block.owned, others)


class _Moments(dict):
    """``{site: (mean, variance)}`` of :func:`rao_blackwellised`, and ``skip``: the sites a
    closed form took (:func:`chain_log_factors`), left out of the run's sums."""

    skip: frozenset = frozenset()


def _owned(block, tr: Trace, mo) -> list:
    skip = getattr(mo, "skip", ())
    return [s for s in block.owned if s in tr.nodes and s not in skip]


def _log_prob(node, name: str, moments) -> torch.Tensor:
    fn: Any = node["fn"]
    if name in moments:
        return expected_log_prior(fn, *moments[name])
    return fn.log_prob(node["value"], *node["args"], **node["kwargs"])


def _looped(block, ctx: StepContext, draws: torch.Tensor, others, mo=None) -> torch.Tensor:
    per = []
    enum = block.analysis.enum_dims if block.analysis.remainder_discrete else None
    for k in range(draws.shape[0]):
        values, logdet = block.unpack(draws[k])
        tr = run_model(ctx.model, {**others, **values, **ctx.subsample}, ctx.args, ctx.kwargs, enum)
        sites = _owned(block, tr, mo)
        lp = collapsed_log_prob(tr, sites) if enum is not None else _site_sum(tr, sites, mo)
        per.append(lp + logdet)
    return torch.stack(per)


def _vmapped(block, ctx: StepContext, draws: torch.Tensor, others, mo=None):
    """One draw's log joint mapped over the draws by ``torch.func.vmap`` (Pyro's argument
    checks, data-dependent branches, are off inside; a model that draws random numbers of its
    own is refused)."""
    if block.analysis.remainder_discrete:
        return None
    fixed = {**others, **ctx.subsample}

    def one(u):
        values, logdet = block.unpack(u)
        with pyro.validation_enabled(False):
            tr = run_model(ctx.model, {**fixed, **values}, ctx.args, ctx.kwargs, None)
            sites = _owned(block, tr, mo)
            return _site_sum(tr, sites, mo) + logdet

    return torch.func.vmap(one, randomness="error")(draws)


def _vectorised(block, ctx: StepContext, draws: torch.Tensor, others, mo=None):
    K, P = draws.shape[0], block.analysis.plate_dims
    values, logdet = {}, draws.new_zeros(K)
    for s in block.sites:
        x = draws[:, s.start : s.start + s.size].reshape((K,) + s.ushape)
        z = s.transform(x)
        ld = s.transform.log_abs_det_jacobian(x, z).reshape(K, -1).sum(-1)
        logdet = logdet + ld
        batch = len(s.shape) - s.event_dim
        values[s.name] = z.reshape((K,) + (1,) * (P - batch) + s.shape)

    def particles(*a, **k):
        with pyro.plate("_cvi_particles", K, dim=-1 - P):
            return ctx.model(*a, **k)

    enum = P + 1 if block.analysis.remainder_discrete else None
    tr = run_model(particles, {**others, **values, **ctx.subsample}, ctx.args, ctx.kwargs, enum)
    sites = _owned(block, tr, mo)
    for name in sites:
        shape = tr.nodes[name]["fn"].batch_shape
        if len(shape) < P + 1 or shape[len(shape) - 1 - P] != K:
            return None
    if block.analysis.remainder_discrete:
        return collapsed_log_prob(tr, sites, "_cvi_particles") + logdet
    return _particle_sums(tr, sites, K, P, mo) + logdet


def _site_sum(tr: Trace, sites: Sequence[str], moments=None) -> torch.Tensor:
    """``sum_a scale_a * mask_a * log p_a`` over ``sites`` of a trace with nothing summed out:
    what :func:`collapsed_log_prob` contracts to there (the same terms, added in the same
    order: grouped by their plates, each group in site order), without its packing."""
    groups: dict = {}
    for name in sites:
        node = tr.nodes[name]
        lp = _log_prob(node, name, moments or {})
        lp = scale_and_mask(lp, node["scale"], node["mask"])
        key = frozenset(f.name for f in node["cond_indep_stack"] if f.vectorized)
        groups.setdefault(key, []).append(lp)
    total = None
    for terms in groups.values():
        for t in terms:
            total = t.sum() if total is None else total + t.sum()
    return total if total is not None else torch.zeros(())


def _particle_sums(tr: Trace, sites: Sequence[str], K: int, P: int, moments=None):
    """``sum_a scale_a * mask_a * log p_a`` per particle, without enumeration: the sum that
    :func:`collapsed_log_prob` contracts to when nothing is summed out, taken directly."""
    total = None
    for name in sites:  # (each has the particle dim: checked by the caller)
        node = tr.nodes[name]
        lp = scale_and_mask(_log_prob(node, name, moments or {}), node["scale"], node["mask"])
        lp = lp.movedim(lp.dim() - 1 - P, 0)
        lp = lp.expand((K,) + lp.shape[1:]).reshape(K, -1).sum(-1)
        total = lp if total is None else total + lp
    return total if total is not None else 0.0  # (nothing owned: the log-determinants alone)
