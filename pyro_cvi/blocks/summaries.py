"""``median()`` and ``quantiles()`` of :class:`~pyro_cvi.AutoCVI` (a mixin): every latent
site's marginal, leaves included, from :mod:`pyro_cvi.blocks.marginals` (deterministic; the
median is the 0.5 quantile)."""

from __future__ import annotations

from typing import Dict, Sequence

import torch

from ..model.analysis import REMAINDER, SITE
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
        for block in engine.gaussian:
            out.update(block.mean_values())
        for name, nb in engine.natural.items():
            out[name] = marginal_median(nb.dist({})).reshape(nb.mean_value({}).shape)
        if engine.remainder is not None:
            out.update(engine.remainder.median_values())
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
            info = engine.analysis.latents[name]
            if info.form == SITE:
                q = engine.gaussian[info.block].marginal(name)
                std = marginal_std(q).reshape(med.shape)
                normal = torch.distributions.Normal(0.0, 1.0)
                qs = torch.as_tensor(list(quantiles), dtype=med.dtype, device=med.device)
                z = normal.icdf(qs).reshape((-1,) + (1,) * med.dim())
                out[name] = med + z * std
                continue
            if info.form == REMAINDER:
                q = engine.remainder.marginal(name)
            else:
                q = leaves[name] if name in leaves else engine.natural[name].dist({})
            out[name] = marginal_quantiles(q, quantiles).reshape((-1,) + med.shape).detach()
        return out
