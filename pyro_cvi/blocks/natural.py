"""The natural-parameter block (Algorithm 2): a mean-field factor ``q(z) = family(lambda)``.

One block per natural-form latent site. Its natural parameters ``lambda`` (batched over the
site's plates, at full plate sizes) live in Pyro's param store; a step moves them towards the
target ``lambda~ = sum_a [eta~_a + grad_mu E_q[log p~_nc^a]]`` (Algorithm 2, steps 4-5)::

    lambda <- (1 - beta) lambda + beta lambda~

with the step policy of :mod:`~pyro_cvi.update`. Inside ``pyro.plate(..., subsample_size=B)``
the block is *local*: a step touches only the minibatch's rows.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import pyro
import torch
from pyro.infer.autoguide.initialization import InitMessenger
from pyro.ops.tensor_utils import periodic_repeat

from ..context import StepContext
from ..messages.augmented import augmented_plan
from ..messages.expected_natural import (
    EXACT,
    MONTE_CARLO,
    expected_natural_rule,
    monte_carlo_messages_used,
)
from ..model.analysis import MEANFIELD, LatentInfo
from ..model.explain import SITES
from ..model.tracing import unwrap
from ..update import StepCounts, damped_step, targets_from_grads
from .base import Block, BlockInit, Incoming, StepReport, stored
from .exchangeable import ExchangeableStart
from .marginals import discrete_mode

__all__ = ["NaturalBlock", "initial_natural", "init_messenger"]

Params = Tuple[torch.Tensor, ...]


class NaturalBlock(Block):
    """Mean-field CVI for one latent site (see the module docstring).

    Its messages come from its group, the :class:`~pyro_cvi.blocks.mean_field.MeanFieldBlock`
    (one set of model runs serves every natural-form latent); on its own it is stepped by the
    sequential schedule (:meth:`sweep`) or from the target in ``.grad`` (:meth:`step`)."""

    def __init__(self, info: LatentInfo, prefix: str):
        self.name = info.name
        self.family = info.family
        self.frames = info.frames
        self.event_shape = info.event_shape
        self.names = (info.name,)
        n = len(self.family.param_shapes)
        self.store_names = tuple(f"{prefix}.natural{i}.{info.name}" for i in range(n))
        #: the mean-field block that computes this latent's messages (set by it)
        self.group = None

    @property
    def kind(self) -> str:
        return self.family.name

    def param_names(self) -> List[str]:
        return list(self.store_names)

    def setup(self, init: BlockInit) -> None:
        """Register the natural parameters at :func:`initial_natural` of the site (kept as
        they are when already in the param store)."""
        site = (init.init_trace or init.prototype_trace).nodes[self.name]
        at_mean = None if init.mean_trace is None else init.mean_trace.nodes[self.name]
        nat = initial_natural(self.family, site, init.init_loc_fn, init.init_scale, at_mean)
        for n, t in zip(self.store_names, nat):
            t = t.detach().clone()
            pyro.param(n, lambda t=t: t)

    def params(self) -> Tuple[torch.Tensor, ...]:
        return tuple(stored(n) for n in self.store_names)

    # ------------------------------------------------------------------ minibatch views
    def _slices(self, subsample: Dict[str, torch.Tensor]):
        return [(f.dim, subsample[f.name]) for f in self.frames if f.name in subsample]

    def is_local(self, subsample: Dict[str, torch.Tensor]) -> bool:
        return any(f.name in subsample for f in self.frames)

    def local_scale(self, subsample: Dict[str, torch.Tensor]) -> float:
        """``N / B`` of the subsampled plates of this site (1 if none)."""
        s = 1.0
        for f in self.frames:
            if f.name in subsample:
                s *= (f.full_size or f.size) / len(subsample[f.name])
        return s

    def natural(self, subsample: Dict[str, torch.Tensor]) -> Params:
        """The natural parameters restricted to the minibatch (detached)."""
        params = tuple(p.detach() for p in self.params())
        sl = self._slices(subsample)
        if not sl:
            return params
        out = []
        for p, shape in zip(params, self.family.param_shapes):
            for dim, idx in sl:
                p = p.index_select(p.dim() + dim - len(shape), idx)
            out.append(p)
        return tuple(out)

    def value_shape(self, nat: Params) -> torch.Size:
        lam = nat[0]
        return lam.shape[: lam.dim() - len(self.family.param_shapes[0])] + self.event_shape

    def dist(self, subsample: Dict[str, torch.Tensor]) -> torch.distributions.Distribution:
        return self.family.natural_to_dist(self.natural(subsample))

    def mean_value(self, subsample: Dict[str, torch.Tensor]) -> torch.Tensor:
        """A representative value of q: its mean (discrete: its mode, a valid value)."""
        nat = self.natural(subsample)
        fam = self.family
        if fam.is_discrete:
            return discrete_mode(fam.natural_to_dist(nat))
        value = fam.mean_value(nat, fam.natural_to_mean(nat))
        return value.reshape(self.value_shape(nat)).detach()

    # ------------------------------------------------------------------ the step
    def step_to(self, target: Sequence[torch.Tensor], beta: float, subsample) -> StepCounts:
        """Move the (minibatch rows of the) natural parameters towards ``target`` (eq. 12)."""
        fam = self.family
        old = self.natural(subsample)
        new, counts = damped_step(
            old, target, beta, fam.is_valid, fam.natural_bounds, fam.param_shapes
        )
        # float32: concentrations beyond the dtype's meaning are capped (mean kept)
        self._write(fam.limit_natural(new), subsample)
        return counts

    def write_target(self, target: Sequence[torch.Tensor]) -> None:
        """Deliver the target as the natural gradient ``.grad = target - lambda``."""
        for p, t in zip(self.params(), target):
            p.grad = (t - p.detach()).detach()

    def step(self, beta: float, ctx: Optional[StepContext] = None) -> List[StepReport]:
        """The step of a global block with the target held in ``.grad`` (``target - lambda``,
        written by the loss over the full parameters)."""
        pair = targets_from_grads(self.params())
        counts = StepCounts() if pair is None else self.step_to(pair[1], beta, {})
        return [StepReport(self.name, self.kind, beta, counts)]

    # ------------------------------------------------------------------ the block protocol
    def messages(self, ctx: StepContext) -> torch.Tensor:
        """This latent's target alone (its group owns the mean-field ELBO): written into
        ``.grad`` with ``ctx.grads``; the ELBO terms returned are none."""
        if ctx.grads:
            self.write_target(self.group.targets(ctx, {self.name})[self.name])
        return torch.zeros(())

    def sweep(self, name: str, ctx: StepContext, beta: float, done: set) -> List[StepReport]:
        """The sequential schedule: the target from the current q of the others, then the
        step (minibatch locals: ``beta = 1``)."""
        target = self.group.targets(ctx, {self.name})[self.name]
        b = 1.0 if self.is_local(ctx.subsample) else beta
        return [StepReport(self.name, self.kind, b, self.step_to(target, b, ctx.subsample))]

    def incoming(self, analysis) -> List[Incoming]:
        """The records' rules, but a non-conjugate factor that draws this latent sends its
        expected natural parameter (:mod:`~pyro_cvi.messages.expected_natural`), and one made
        conjugate by auxiliary latents its exact message (:mod:`~pyro_cvi.messages.augmented`)."""
        out = []
        for item in super().incoming(analysis):
            if item.factor == self.name and item.rule == SITES and self.name in analysis.owner:
                rule = expected_natural_rule(analysis, analysis.spec(self.name), self.family)
                if rule == EXACT or (rule == MONTE_CARLO and monte_carlo_messages_used(analysis)):
                    item = item._replace(rule=rule)
            elif item.rule == SITES and analysis.owner.get(item.factor) == MEANFIELD:
                spec = analysis.spec(item.factor)
                found = None if spec.exact else augmented_plan(analysis, spec)
                if found is not None:  # exact through auxiliary latents
                    item = item._replace(rule=EXACT, note=found[0].describe(found[1], self.name))
            out.append(item)
        return out

    def valid(self) -> bool:
        return bool(self.family.is_valid(tuple(p.detach() for p in self.params())).all())

    def trace_values(self, subsample: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {self.name: self.mean_value(subsample)}

    def sample(
        self,
        subsample: Dict[str, torch.Tensor],
        exclude: Sequence[str] = (),
        at_means: bool = False,
    ) -> Dict[str, torch.Tensor]:
        if self.name in exclude:
            return {}
        value = self.mean_value(subsample) if at_means else self.dist(subsample).sample()
        return {self.name: value}

    def marginal(self, name: str) -> torch.distributions.Distribution:
        return self.dist({})

    def _write(self, values: Sequence[torch.Tensor], subsample) -> None:
        sl = self._slices(subsample)
        with torch.no_grad():
            for p, v, shape in zip(self.params(), values, self.family.param_shapes):
                if not sl:
                    p.copy_(v)
                    continue
                if len(sl) > 1:
                    raise NotImplementedError(
                        f"site {self.name!r} lies in two subsampled plates; subsample one of them"
                    )
                dim, idx = sl[0]
                p.index_copy_(p.dim() + dim - len(shape), idx, v.to(p.dtype))


def _prior_natural(fam, fn) -> Optional[Params]:
    batch = fn.batch_shape
    try:
        nat = fam.dist_to_natural(unwrap(fn)[0])
        nat = tuple(
            torch.broadcast_to(t, batch + s).detach() for t, s in zip(nat, fam.param_shapes)
        )
    except (TypeError, ValueError, RuntimeError, NotImplementedError):
        return None
    return nat if bool(fam.is_valid(nat).all()) else None


def init_messenger(init_loc_fn):
    """A ``pyro.poutine`` InitMessenger for ``init_loc_fn`` that leaves discrete sites to
    their prior (Pyro's init strategies cannot place a discrete value); with
    :func:`~pyro_cvi.blocks.exchangeable.init_apart` (opt-in), label-symmetric components
    start apart (:class:`~pyro_cvi.blocks.exchangeable.ExchangeableStart`)."""

    def init_fn(site):
        if site["fn"].support.is_discrete:
            return site["fn"].sample().detach()
        return init_loc_fn(site)

    if getattr(init_loc_fn, "spread_exchangeable", False):
        return ExchangeableStart(init_fn)
    return InitMessenger(init_fn)


def initial_natural(
    fam,
    site,
    init_loc_fn=None,
    init_scale: Optional[float] = None,
    mean_site=None,
) -> Params:
    """Initial natural parameters of a natural-form site, at full plate sizes.

    The prior's natural parameters when the prior is of ``q``'s family and no ``init_loc_fn``
    is given (Algorithm 2's ``lambda_0``); otherwise ``family.natural_at`` the init value (or
    the prototype draw) with the prior's spread, or with spread ``init_scale`` when given
    (``family.natural_with_spread``; continuous families only). Families that
    ``starts_at_mean`` (the positive ones, whose prior draws reach ``1e-30`` at small shapes)
    start, without ``init_loc_fn`` and when the prior is of ``q``'s family, at ``natural_at``
    the prior mean of ``mean_site`` (the site in a trace where every latent sits at its prior
    mean given its parents'), so that no prior draw upstream puts the first Monte Carlo
    messages at extreme values.
    """
    if fam.starts_at_mean and mean_site is not None and init_loc_fn is None and init_scale is None:
        mean_fn = mean_site["fn"]
        mean_prior = _prior_natural(fam, mean_fn)  # (a prior of another family: as before)
        nat = None if mean_prior is None else fam.natural_at(mean_site["value"], mean_prior)
        finite = nat is not None and all(bool(torch.isfinite(t).all()) for t in nat)
        if finite and bool(fam.is_valid(nat).all()):
            return _full_size(fam, dict(site, fn=mean_fn), nat)
    fn = site["fn"]
    prior = _prior_natural(fam, fn)
    if init_scale is not None and not fam.is_discrete:
        value = init_loc_fn(site) if init_loc_fn is not None else site["value"]
        nat = fam.natural_with_spread(value, init_scale)
    elif prior is not None and (init_loc_fn is None or fam.is_discrete):
        nat = prior  # discrete sites start at their prior (symmetry is broken by the others)
    else:
        value = init_loc_fn(site) if init_loc_fn is not None else site["value"]
        nat = fam.natural_at(value, prior)
    return _full_size(fam, site, nat)


def _full_size(fam, site, nat: Params) -> Params:
    """``nat`` broadcast to the site's batch shape and repeated to its plates' full sizes."""
    batch = site["fn"].batch_shape
    out = []
    for t, s in zip(nat, fam.param_shapes):
        t = torch.broadcast_to(t, batch + s)
        for frame in site["cond_indep_stack"]:
            full = frame.full_size or frame.size
            if frame.vectorized and full != frame.size:
                dim = t.dim() + frame.dim - len(s)
                t = (
                    periodic_repeat(t, full, dim)
                    if t.shape[dim] > 1
                    else t.expand(t.shape[:dim] + (full,) + t.shape[dim + 1 :])
                )
        out.append(t.contiguous().clone())
    return tuple(out)
