"""What the two site-form blocks share (Algorithm 1): a joint Gaussian over a group of latent
sites, ``lambda = eta + sum_f lambda~_f`` (Theorem 1, eq. 11), with one site parameter per
data point of every linear-predictor factor (eq. 13, App. E.1).

:class:`~pyro_cvi.blocks.gaussian.GaussianBlock` solves a Bayesian linear regression;
:class:`~pyro_cvi.blocks.markov.MarkovBlock` a Kalman smoother. Both derive from
:class:`SiteFormBlock`, which maps the block protocol (:mod:`~pyro_cvi.blocks.base`) onto
their ``refresh`` / ``elbo`` / ``step``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import pyro
import torch

from ..context import StepContext
from .base import Block, BlockInit, StepReport

__all__ = ["SiteFormBlock"]


class SiteFormBlock(Block):
    """The block protocol for a Gaussian site-form block (see the module docstring).

    Subclasses provide ``spec``, ``z_at`` (the fixed point at which the trace is taken),
    ``linear`` and ``site_names`` (the linear-predictor sites), ``setup_values(values)``,
    ``refresh(ctx)``, ``elbo(ctx, prior)``, ``step_sites(beta)``, ``mean_values()`` and
    ``joint()``."""

    kind = "precision"

    @property
    def label(self) -> str:
        return self.spec.label

    def setup(self, init: BlockInit) -> None:
        self.setup_values(init.values)

    def initialise(self, ctx: StepContext, fresh: bool) -> None:
        if self.options.init_sites == "laplace" and fresh:
            self.init_sites_at_prior_mean(ctx.trace, self.options.num_quad_points)
        self.refresh(ctx)

    def continue_from(self, previous: Optional[Block], values: Dict[str, torch.Tensor]) -> None:
        """Keep the fixed point of the block it replaces; the number of data points of each
        linear-predictor site must not change (one site parameter per data point)."""
        if isinstance(previous, SiteFormBlock):
            self.z_at = previous.z_at
        if self.z_at is None:
            self.z_at = self.spec.join(values).detach()
        for f in self.linear:
            p = pyro.param(self.site_names[f.site])
            if p.shape[0] != f.jacobian.shape[0]:
                raise ValueError(
                    f"site {f.site!r} now has {f.jacobian.shape[0]} elements but the guide "
                    f"was fitted with {p.shape[0]}. AutoCVI keeps one site per data point: "
                    "pass the training data to svi.step, and use "
                    "Predictive(model, guide=guide) for new inputs."
                )

    def messages(self, ctx: StepContext) -> torch.Tensor:
        return self.elbo(ctx, self.refresh(ctx))

    def step(self, beta: float, ctx: Optional[StepContext] = None) -> List[StepReport]:
        return [StepReport(self.label, self.kind, beta, self.step_sites(beta))]

    def trace_values(self, subsample: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        # a fixed point: the block's factors are affine in it, so the point does not matter,
        # and a fixed one keeps the offsets bitwise stable (exact checkpoint/resume)
        return self.spec.split(self.z_at)

    def sample(
        self,
        subsample: Dict[str, torch.Tensor],
        exclude: Sequence[str] = (),
        at_means: bool = False,
    ) -> Dict[str, torch.Tensor]:
        if set(self.names) & set(exclude):
            return {}
        if at_means:
            return {n: v.detach() for n, v in self.mean_values().items()}
        return self.spec.split(self.joint().sample().detach())
