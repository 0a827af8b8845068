"""Beta family (``alpha``, ``beta``), elementwise over ``event_shape``.

* sufficient statistics  ``phi(z) = (log z, log(1 - z))``; base measure ``h(z) = 1``
* natural parameters     ``eta = (alpha - 1, beta - 1)``; domain ``eta1 > -1, eta2 > -1``
* mean parameters        ``mu = (digamma(a) - digamma(a + b), digamma(b) - digamma(a + b))``
* log-partition          ``A = lgamma(a) + lgamma(b) - lgamma(a + b)``

This is the ``K = 2`` Dirichlet on ``(z, 1 - z)``, and the maps share its numerics:
``natural_to_mean`` uses the cancellation-free ``digamma(a) - digamma(a + b)`` and
``mean_to_natural`` runs Newton on the 2x2 system (Fisher matrix
``diag(trigamma(a), trigamma(b)) - trigamma(a + b) 1 1^T``) in ``(log a, log b)`` so the
iterates stay positive (:func:`~pyro_cvi.families.base.dirichlet_from_mean_log`).
"""

from __future__ import annotations

from typing import Tuple

import pyro.distributions as dist
import torch
from torch import Tensor
from torch.distributions import Beta as _TorchBeta
from torch.distributions import Distribution, Independent

from .base import ExponentialFamily, Params, digamma_diff, dirichlet_from_mean_log, sum_rightmost

__all__ = ["Beta"]


class Beta(ExponentialFamily):
    """Beta(alpha, beta) with ``eta = (alpha - 1, beta - 1)`` (see module docstring)."""

    name = "beta"
    domain = "eta1 > -1 and eta2 > -1 (alpha = eta1 + 1 > 0, beta = eta2 + 1 > 0)"

    @property
    def param_shapes(self) -> Tuple[torch.Size, ...]:
        return (self.event_shape, self.event_shape)

    def natural_to_mean(self, nat: Params) -> Params:
        a, b = nat[0] + 1, nat[1] + 1
        return digamma_diff(a, b), digamma_diff(b, a)

    def mean_to_natural(self, mean: Params) -> Params:
        mu = torch.stack(torch.broadcast_tensors(*mean), dim=-1)
        ab = dirichlet_from_mean_log(mu)
        return ab[..., 0] - 1, ab[..., 1] - 1

    def natural_to_dist(self, nat: Params) -> Distribution:
        a, b = torch.broadcast_tensors(nat[0] + 1, nat[1] + 1)
        return dist.Beta(a, b).to_event(self.event_dim)

    def dist_to_natural(self, d: Distribution) -> Params:
        while isinstance(d, Independent):
            d = d.base_dist
        if not isinstance(d, _TorchBeta):
            raise TypeError(f"{self!r}: cannot convert {type(d).__name__} to natural parameters")
        return d.concentration1 - 1, d.concentration0 - 1

    def log_partition(self, nat: Params) -> Tensor:
        a, b = nat[0] + 1, nat[1] + 1
        return sum_rightmost(
            torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b), self.event_dim
        )

    def sufficient_stats(self, x: Tensor) -> Params:
        return torch.log(x), torch.log1p(-x)

    def _in_domain(self, nat: Params) -> Tensor:
        e1, e2 = torch.broadcast_tensors(*nat)
        ok = (e1 > -1) & (e2 > -1)
        return ok.reshape(ok.shape[: ok.dim() - self.event_dim] + (-1,)).all(-1)
