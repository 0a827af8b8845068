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

from typing import Optional, Tuple

import pyro.distributions as dist
import torch
from torch import Tensor
from torch.distributions import Beta as _TorchBeta
from torch.distributions import Distribution, Independent

from .base import (
    Bounds,
    ExponentialFamily,
    Params,
    _float_value,
    digamma_diff,
    dirichlet_entropy,
    dirichlet_from_mean_log,
    max_concentration,
    sum_rightmost,
)

__all__ = ["Beta"]


class Beta(ExponentialFamily):
    """Beta(alpha, beta) with ``eta = (alpha - 1, beta - 1)`` (see module docstring)."""

    name = "beta"
    domain = "eta1 > -1 and eta2 > -1 (alpha = eta1 + 1 > 0, beta = eta2 + 1 > 0)"
    natural_bounds: Optional[Bounds] = ((-1.0, None), (-1.0, None))

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

    def entropy(self, nat: Params) -> Tensor:
        """The ``K = 2`` case of :func:`~pyro_cvi.families.special.dirichlet_entropy` (no
        term grows with ``a + b``: float32-safe)."""
        a, b = torch.broadcast_tensors(nat[0] + 1, nat[1] + 1)
        return sum_rightmost(dirichlet_entropy(torch.stack([a, b], -1)), self.event_dim)

    def kl(self, nat_q: Params, nat_p: Params) -> Tensor:
        """``-H[q] - E_q log p`` (stable entropy, ``E log z`` by ``digamma_diff``)."""
        e1, e2 = self.natural_to_mean(nat_q)
        log_p = nat_p[0] * e1 + nat_p[1] * e2
        return (
            -self.entropy(nat_q) - sum_rightmost(log_p, self.event_dim) + self.log_partition(nat_p)
        )

    def limit_natural(self, nat: Params) -> Params:
        """``a + b`` at most :func:`max_concentration` (the mean ``a / (a + b)`` kept)."""
        a, b = nat[0] + 1, nat[1] + 1
        f = (max_concentration(a.dtype) / (a + b)).clamp(max=1.0)
        capped = f < 1
        return torch.where(capped, a * f - 1, nat[0]), torch.where(capped, b * f - 1, nat[1])

    # CVI helpers --------------------------------------------------------------------------------
    def mean_grad(self, nat: Params, grad_nat: Params) -> Params:
        """Closed-form 2x2 solve with ``F = [[psi'(a) - psi'(a+b), -psi'(a+b)],
        [-psi'(a+b), psi'(b) - psi'(a+b)]]``."""
        a, b = nat[0] + 1, nat[1] + 1
        ta, tb, tab = torch.polygamma(1, a), torch.polygamma(1, b), torch.polygamma(1, a + b)
        f11, f22, f12 = ta - tab, tb - tab, -tab
        det = f11 * f22 - f12 * f12
        g1, g2 = grad_nat
        return (f22 * g1 - f12 * g2) / det, (-f12 * g1 + f11 * g2) / det

    def natural_at(self, value: Tensor, prior_nat: Optional[Params] = None) -> Params:
        """Mean ``a / (a + b) = value`` (clamped to ``[1e-6, 1 - 1e-6]``) with the prior's
        concentration ``k = a + b`` (at least 2; else 2): ``(k v - 1, k (1 - v) - 1)``."""
        v = _float_value(value)
        k = (prior_nat[0] + prior_nat[1] + 2).clamp(min=2.0) if prior_nat is not None else 2.0
        v = v.clamp(1e-6, 1 - 1e-6)
        return k * v - 1, k * (1 - v) - 1

    def natural_with_spread(self, value: Tensor, scale: float) -> Params:
        """Mean ``value``, concentration ``k = 1 / (scale^2 v (1 - v))`` (so
        ``sd(logit z) ~ scale``)."""
        v = _float_value(value).clamp(1e-6, 1 - 1e-6)
        k = 1.0 / (scale**2 * v * (1 - v))
        return self.natural_at(value, (k - 2, torch.zeros_like(k)))

    def mean_value(self, nat: Params, mean: Params) -> Optional[Tensor]:
        """``E z = a / (a + b)`` (from ``nat``; not differentiable w.r.t. ``mean``)."""
        a, b = nat[0] + 1, nat[1] + 1
        return a / (a + b)
