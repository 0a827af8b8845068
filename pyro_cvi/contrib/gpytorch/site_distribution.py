"""q(u) built from CVI sites, as a GPyTorch ``MultivariateNormal`` that carries the sites'
closed-form KL (Khan & Lin 2017, eq. 14: ``KL[q(v) || N(0, I)]`` in whitened coordinates) and the
backward step's zero-valued probe, so that every KL GPyTorch or Pyro computes from it (the closed
form, or a Monte Carlo ``log q(u) - log p(u)``) tells the step its weight in the loss."""

from __future__ import annotations

from typing import Optional

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.distributions.multivariate_normal import kl_mvn_mvn
from torch import Tensor
from torch.distributions import register_kl

__all__ = ["SiteMultivariateNormal"]


class SiteMultivariateNormal(MultivariateNormal):
    """q(u) built from CVI sites. ``torch.distributions.kl_divergence(q, prior)`` returns the
    sites' closed-form KL (which may carry the probe of the backward step), so GPyTorch's wrappers
    (``IndependentMultitaskVariationalStrategy``, ``LMCVariationalStrategy``), which compute the
    KL from ``variational_distribution`` and ``prior_distribution``, get the same value."""

    def __init__(
        self,
        mean: Tensor,
        covariance_matrix,
        kl: Optional[Tensor] = None,
        probe: Optional[Tensor] = None,
        **kwargs,
    ):
        super().__init__(mean, covariance_matrix, **kwargs)
        self.site_kl = kl
        self.site_probe = probe

    def log_prob(self, value: Tensor) -> Tensor:
        """``log q(u)``, plus the backward step's zero-valued probe
        (:class:`~pyro_cvi.contrib.gpytorch.inducing.BackwardStep`): a Monte Carlo KL (Pyro's
        ``Trace_ELBO`` scores ``log q(u) - log p(u)`` at a draw) then tells the step its weight,
        as the closed-form KL does."""
        res = super().log_prob(value)
        probe = getattr(self, "site_probe", None)
        return res if probe is None else res + probe

    def expand(self, batch_size) -> SiteMultivariateNormal:
        """GPyTorch's ``expand`` (Pyro calls it for vectorised particles and plates; it may skip
        ``__init__``), with the sites' KL and probe expanded alongside."""
        batch_size = torch.Size(batch_size)
        new = super().expand(batch_size)
        kl = getattr(self, "site_kl", None)
        new.site_kl = None if kl is None else kl.expand(batch_size)
        probe = getattr(self, "site_probe", None)
        new.site_probe = None if probe is None else probe.expand(batch_size)
        return new


@register_kl(SiteMultivariateNormal, MultivariateNormal)
def _kl_site_mvn(q: SiteMultivariateNormal, p: MultivariateNormal) -> Tensor:
    kl = getattr(q, "site_kl", None)
    if kl is None:  # built without the sites' KL: the closed form of two Gaussians
        return kl_mvn_mvn(q, p)
    return kl
