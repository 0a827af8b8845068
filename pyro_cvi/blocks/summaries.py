"""``median()`` and ``quantiles()`` of :class:`~pyro_cvi.AutoCVI` (a mixin): every latent
site's marginal, leaves included, from :mod:`pyro_cvi.blocks.marginals` (deterministic; the
median is the 0.5 quantile)."""

from __future__ import annotations

from typing import Dict, Sequence

import torch

from .marginals import marginal_median, marginal_quantiles, marginal_std

__all__ = ["Summaries"]


class Summaries:
    """Mixin (before ``AutoGuide`` in the bases) for a guide with ``_ready`` (its engine) and
    ``_leaf_priors`` (each leaf's conditional prior)."""

    @torch.no_grad()
    def median(self, *args, **kwargs) -> Dict[str, torch.Tensor]:
        """The posterior median of each latent site (its marginals' 0.5 quantiles, see
        :mod:`pyro_cvi.blocks.marginals`; the mode, for discrete factors); a leaf's at its
        parents' means. ``args``: the model's (only needed before the first step)."""
        engine = self._ready(args, kwargs)
        out = {}
        for block in engine.blocks:
            out.update(block.median_values())
        if engine.analysis.leaves:
            for name, fn in self._leaf_priors(args or None, kwargs).items():
                out[name] = marginal_median(fn).detach()
        order = list(engine.analysis.latents)
        return dict(sorted(out.items(), key=lambda kv: order.index(kv[0])))

    @torch.no_grad()
    def quantiles(self, quantiles: Sequence[float], *args, **kwargs) -> Dict[str, torch.Tensor]:
        """Marginal quantiles of each latent site, stacked on a leading dim (deterministic:
        exact for Gaussians and any law with an ``icdf``, a fine CDF grid for the others, see
        :mod:`pyro_cvi.blocks.marginals`); ``quantiles(..., 0.5, ...)`` is :meth:`median`."""
        engine = self._ready(args, kwargs)
        medians = self.median(*args, **kwargs)
        leaves = self._leaf_priors(args or None, kwargs) if engine.analysis.leaves else {}
        out = {}
        for name, med in medians.items():
            if name in leaves:
                q = leaves[name]
            else:
                q = engine.block_for(name).marginal(name)
            if _gaussian(q):
                std = marginal_std(q).reshape(med.shape)  # (a Gaussian: median + z sd)
                normal = torch.distributions.Normal(0.0, 1.0)
                qs = torch.as_tensor(list(quantiles), dtype=med.dtype, device=med.device)
                z = normal.icdf(qs).reshape((-1,) + (1,) * med.dim())
                out[name] = med + z * std
                continue
            out[name] = marginal_quantiles(q, quantiles).reshape((-1,) + med.shape).detach()
        return out


def _gaussian(q) -> bool:
    """A Gaussian marginal, possibly reshaped: its quantiles are ``median + z sd``."""
    T = torch.distributions
    while isinstance(q, T.TransformedDistribution):
        if not all(isinstance(t, T.transforms.ReshapeTransform) for t in q.transforms):
            return False
        q = q.base_dist
    return isinstance(q, (T.Normal, T.MultivariateNormal))
