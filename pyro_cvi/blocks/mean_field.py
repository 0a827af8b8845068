"""The mean-field block (Algorithm 2): every natural-form latent, and the factors that touch
them, as one block of the protocol (:mod:`~pyro_cvi.blocks.base`).

Each natural-form latent is a :class:`~pyro_cvi.blocks.natural.NaturalBlock` (its natural
parameters); the mean-field block computes their messages together, because one set of model
runs serves all of them (:func:`~pyro_cvi.messages.mean_field.compute`: closed-form
expectations of exact factors, eqs. 20 and 89; Monte Carlo messages of general factors,
App. F; collapsed discrete latents), and owns the mean-field part of the ELBO (those factors'
expectations and the entropies). Inside a subsampled plate the local latents first take a full
(``beta = 1``) update for the minibatch (doubly stochastic CVI, Hoffman et al. 2013).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import pyro
import torch

from ..context import Options, StepContext
from ..messages.mean_field import compute
from ..model.records import NATURAL
from .base import Block, BlockInit, GuideDraw, Incoming, StepReport
from .marginals import marginal_median
from .natural import NaturalBlock
from .registry import Found, register_kind

__all__ = ["MeanFieldBlock"]


class MeanFieldBlock(Block):
    """Algorithm 2 over the natural-form latents (see the module docstring).

    :param natural: the natural blocks by latent name (model order).
    :param analysis: the model's :class:`~pyro_cvi.model.analysis.Analysis`.
    :param site_blocks: the Gaussian site-form blocks (their moments enter the messages).
    :param options: the guide's options.
    :param fixed: values of the leaf latents (sites nothing depends on).
    :param order: ``() -> [latent names]``, the sequential schedule's order.
    """

    kind = "mean field"
    draws_first = True

    def __init__(
        self,
        natural: OrderedDict[str, NaturalBlock],
        analysis,
        site_blocks: Sequence[Block],
        options: Options,
        fixed: Dict[str, torch.Tensor],
        order: Callable[[], List[str]],
    ):
        self.natural, self.analysis, self.site_blocks = natural, analysis, list(site_blocks)
        self.options, self.fixed, self.order = options, fixed, order
        self.names = tuple(natural)
        #: expectations that depend only on the data (e.g. ``lgamma(y + 1)``), by data key
        self.cache: Dict = {}
        for nb in natural.values():
            nb.group = self

    @property
    def label(self) -> str:
        return "mean field(" + ", ".join(self.names) + ")"

    @property
    def labels(self) -> List[str]:
        return list(self.names)

    @property
    def moves_trace(self) -> bool:  # type: ignore[override]
        return bool(self.natural)

    @property
    def sweeps(self) -> bool:  # type: ignore[override]
        return bool(self.natural)

    @property
    def setup_traces(self) -> Tuple[str, ...]:  # type: ignore[override]
        if not self.natural:
            return ()
        mean = any(nb.family.starts_at_mean for nb in self.natural.values())
        return ("init", "mean") if mean else ("init",)

    def steppers(self) -> Dict[str, Block]:
        return dict(self.natural)

    def natural_targets(self, ctx: StepContext) -> Dict:
        return self.targets(ctx)

    def state_objects(self) -> List:
        return list(self.natural.values())

    @property
    def sequential(self) -> bool:
        return self.options.schedule != "parallel"

    def param_names(self) -> List[str]:
        return [n for nb in self.natural.values() for n in nb.param_names()]

    def setup(self, init: BlockInit) -> None:
        for nb in self.natural.values():
            nb.setup(init)

    # ------------------------------------------------------------------ messages
    def compute(self, ctx: StepContext, want: Optional[Set[str]] = None, value: bool = True):
        """:func:`~pyro_cvi.messages.mean_field.compute` for this block's latents."""
        return compute(
            ctx,
            self.analysis,
            self.natural,
            self.site_blocks,
            self.options,
            self.cache,
            self.fixed,
            want=want,
            value=value,
        )

    def targets(self, ctx: StepContext, want: Optional[Set[str]] = None) -> Dict:
        """The Algorithm 2 targets of ``want`` (default: every latent) at the current q."""
        return self.compute(ctx, want=want, value=False).targets

    def messages(self, ctx: StepContext) -> torch.Tensor:
        grads = ctx.grads and not self.sequential
        if grads and ctx.subsample:
            self.update_locals(ctx)
        res = self.compute(ctx, want=None if grads else set(), value=True)
        if grads:
            for name, target in res.targets.items():
                nb = self.natural[name]
                if nb.is_local(ctx.subsample):
                    continue  # already updated (beta = 1) by update_locals
                nb.write_target(target)
        return res.elbo

    def update_locals(self, ctx: StepContext) -> None:
        """Doubly stochastic CVI: a full (``beta = 1``) update of every local natural block
        (in a subsampled plate), for the current minibatch, in the sequential order."""
        for name in self.order():
            nb = self.natural.get(name)
            if nb is None or not nb.is_local(ctx.subsample):
                continue
            target = self.targets(ctx, {name})[name]
            ctx.report(
                StepReport(name, nb.family.name, 1.0, nb.step_to(target, 1.0, ctx.subsample))
            )

    # ------------------------------------------------------------------ steps
    def step(self, beta: float, ctx: Optional[StepContext] = None) -> List[StepReport]:
        sub = ctx.subsample if ctx is not None else {}
        out = []
        for nb in self.natural.values():
            if not nb.is_local(sub):
                out += nb.step(beta, ctx)
        return out

    def sweep(self, name: str, ctx: StepContext, beta: float, done: set) -> List[StepReport]:
        return self.natural[name].sweep(name, ctx, beta, done)

    def incoming(self, analysis) -> List[Incoming]:
        """Its natural blocks' messages, latent by latent."""
        return [i for nb in self.natural.values() for i in nb.incoming(analysis)]

    def valid(self) -> bool:
        return all(nb.valid() for nb in self.natural.values())

    # ------------------------------------------------------------------ the current q
    def trace_values(self, subsample: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {n: nb.mean_value(subsample) for n, nb in self.natural.items()}

    def sample(
        self,
        subsample: Dict[str, torch.Tensor],
        exclude: Sequence[str] = (),
        at_means: bool = False,
    ) -> Dict[str, torch.Tensor]:
        out = {}
        for nb in self.natural.values():
            out.update(nb.sample(subsample, exclude, at_means))
        return out

    def marginal(self, name: str) -> torch.distributions.Distribution:
        return self.natural[name].marginal(name)

    # ------------------------------------------------------------------ the guide's methods
    def guide_sample(self, name: str, draw: GuideDraw) -> Dict[str, torch.Tensor]:
        with draw.plates(name):
            q = self.natural[name].dist(draw.subsample)
            return {name: pyro.sample(name, draw.frozen(q))}

    def median_values(self) -> Dict[str, torch.Tensor]:
        return {
            n: marginal_median(nb.dist({})).reshape(nb.mean_value({}).shape)
            for n, nb in self.natural.items()
        }

    def packed_factors(self):
        out = []
        for n, nb in self.natural.items():
            q = nb.dist({})
            if not q.support.is_discrete:
                out.append(((n,), (q.batch_shape + q.event_shape,), q, False))
        return out


def build_mean_field(found: Found) -> List[Block]:
    """The mean-field block of the natural-form latents (one natural block each) and the
    collapsed sums, reading the moments of the blocks built before it."""
    an = found.analysis
    natural = OrderedDict(
        (n, NaturalBlock(i, found.prefix)) for n, i in an.latents.items() if i.form == NATURAL
    )
    if not natural and not an.collapsed_sites:
        return []
    leaves = {n: an.values[n] for n in an.leaves}
    return [MeanFieldBlock(natural, an, found.built, found.options, leaves, found.order)]


register_kind("mean field", 20, build_mean_field)
