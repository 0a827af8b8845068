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
import pyro.distributions as dist
import torch

from ..context import StepContext
from .base import Block, BlockInit, GuideDraw, StepReport

__all__ = ["SiteFormBlock"]


class SiteFormBlock(Block):
    """The block protocol for a Gaussian site-form block (see the module docstring).

    Subclasses provide ``spec``, ``z_at`` (the fixed point at which the trace is taken),
    ``linear`` and ``site_names`` (the linear-predictor sites), ``setup_values(values)``,
    ``refresh(ctx)``, ``elbo(ctx, prior)``, ``step_sites(beta)``, ``mean_values()`` and
    ``joint()``."""

    kind = "precision"
    gaussian_joint = True

    @property
    def label(self) -> str:
        return self.spec.label

    def setup(self, init: BlockInit) -> None:
        self.setup_values(init.values)

    def initialise(self, ctx: StepContext, fresh: bool) -> None:
        if self.options.init_sites == "laplace" and fresh:
            self.init_sites_at_prior_mean(ctx.trace, self.options.num_quad_points)
            self.refresh(ctx)
            if not self.damped_start(ctx):  # one Newton step was enough
                return
            self._refreshed_from = None
        self.refresh(ctx)

    def damped_start(self, ctx: StepContext) -> bool:
        """Where one Newton step from the prior mean overshoots, move the sites to the mode's
        (:mod:`~pyro_cvi.blocks.laplace`); whether they moved. None by default."""
        return False

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
        return self.spec.split(self.joint_sample().detach())

    # ------------------------------------------------------------------ the guide's methods
    def guide_sample(self, name: str, draw: GuideDraw) -> Dict[str, torch.Tensor]:
        """One scalar-or-vector site alone: its marginal; otherwise one auxiliary joint draw,
        and each site a ``Delta`` in its plates."""
        if len(self.names) == 1 and len(self.spec.shapes[0]) == draw.event_dim(name):
            return {name: pyro.sample(name, draw.frozen(self.marginal(name)))}
        z = pyro.sample(
            f"_{draw.prefix}_latent_{self.spec.index}",
            draw.frozen(self.joint()),
            infer={"is_auxiliary": True},
        )
        out, batch = {}, z.shape[:-1]  # plates outside the model's (vectorised particles)
        for n, v in self.spec.split(z).items():
            # broadcast against the site's own plate dims, as AutoContinuous unpacks
            shape = v.shape[len(batch) :]
            v = v.reshape(torch.broadcast_shapes(shape, batch + (1,) * draw.event_dim(n)))
            with draw.plates(n):
                out[n] = pyro.sample(n, dist.Delta(v, event_dim=draw.event_dim(n)))
        return out

    def median_values(self) -> Dict[str, torch.Tensor]:
        return {n: v.detach() for n, v in self.mean_values().items()}

    def variance_along(self, parts: Dict[str, torch.Tensor]) -> torch.Tensor:
        """With the block's joint covariance (cross-site terms included)."""
        cov = getattr(self.post, "covariance", None)
        if cov is None:
            return super().variance_along(parts)
        like = next(iter(parts.values()))
        R = like.shape[0]
        cols = [
            parts.get(n, torch.zeros(R, k, dtype=like.dtype, device=like.device))
            for n, k in zip(self.names, self.spec.sizes)
        ]
        A = torch.cat(cols, 1)
        return ((A @ cov()) * A).sum(-1)

    def packed_factors(self):
        return [(self.names, self.spec.shapes, self.joint(), True)]

    def extra_state(self) -> Dict:
        # the fixed point sets the bits of the offsets c: an exact resume restores it
        return {"z_at": self.z_at.detach()} if torch.is_tensor(self.z_at) else {}

    def load_extra_state(self, state: Dict) -> None:
        if "z_at" in state and torch.is_tensor(self.z_at):
            self.z_at = state["z_at"].to(self.z_at)
