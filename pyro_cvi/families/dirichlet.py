"""Dirichlet family over the last event dimension ``K = event_shape[-1]``.

* sufficient statistics  ``phi(z) = log z``  ``[..., K]``; base measure ``h(z) = 1``
  (w.r.t. Lebesgue measure on the simplex, as in ``torch.distributions.Dirichlet``)
* natural parameters     ``eta = alpha - 1``; domain ``eta > -1``
* mean parameters        ``mu_k = digamma(alpha_k) - digamma(alpha_0)``, ``alpha_0 = sum_k alpha_k``
* log-partition          ``A = sum_k lgamma(alpha_k) - lgamma(alpha_0)``

Any leading event dims (``event_shape = (..., K)``) are independent Dirichlets, i.e. the
distribution is ``Dirichlet(alpha).to_event(len(event_shape) - 1)``. ``natural_to_mean``
evaluates ``digamma(alpha_k) - digamma(alpha_k + sum_{j != k} alpha_j)`` without cancellation
(:func:`~pyro_cvi.families.base.digamma_diff`). ``mean_to_natural`` uses Minka's fixed point
followed by safeguarded Newton in ``log alpha``
(:func:`~pyro_cvi.families.base.dirichlet_from_mean_log`).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import pyro.distributions as dist
import torch
from torch import Tensor
from torch.distributions import Dirichlet as _TorchDirichlet
from torch.distributions import Distribution, Independent

from .base import (
    Bounds,
    ExponentialFamily,
    Params,
    _float_value,
    digamma_diff,
    dirichlet_entropy,
    dirichlet_from_mean_log,
    exclusive_sum,
    max_concentration,
    sum_rightmost,
)

__all__ = ["Dirichlet"]


def mean_log_dirichlet(alpha: Tensor) -> Tensor:
    """``E[log z_k] = digamma(alpha_k) - digamma(sum alpha)`` along the last dim, stably."""
    return digamma_diff(alpha, exclusive_sum(alpha))


class Dirichlet(ExponentialFamily):
    """Dirichlet(alpha) with ``eta = alpha - 1`` (see module docstring)."""

    name = "dirichlet"
    domain = "eta > -1 (concentration alpha = eta + 1 > 0)"
    natural_bounds: Optional[Bounds] = ((-1.0, None),)
    vector_valued = True

    def __init__(self, event_shape: Sequence[int]) -> None:
        super().__init__(event_shape)
        if self.event_dim < 1 or self.event_shape[-1] < 2:
            raise ValueError(
                f"Dirichlet family needs event_shape (..., K) with K >= 2, got {tuple(event_shape)}"
            )

    @property
    def param_shapes(self) -> Tuple[torch.Size, ...]:
        return (self.event_shape,)

    def natural_to_mean(self, nat: Params) -> Params:
        return (mean_log_dirichlet(nat[0] + 1),)

    def mean_to_natural(self, mean: Params) -> Params:
        return (dirichlet_from_mean_log(mean[0]) - 1,)

    def natural_to_dist(self, nat: Params) -> Distribution:
        return dist.Dirichlet(nat[0] + 1).to_event(self.event_dim - 1)

    def dist_to_natural(self, d: Distribution) -> Params:
        while isinstance(d, Independent):
            d = d.base_dist
        if not isinstance(d, _TorchDirichlet):
            raise TypeError(f"{self!r}: cannot convert {type(d).__name__} to natural parameters")
        return (d.concentration - 1,)

    def log_partition(self, nat: Params) -> Tensor:
        alpha = nat[0] + 1
        a = torch.lgamma(alpha).sum(-1) - torch.lgamma(alpha.sum(-1))
        return sum_rightmost(a, self.event_dim - 1)

    def sufficient_stats(self, x: Tensor) -> Params:
        return (torch.log(x),)

    def entropy(self, nat: Params) -> Tensor:
        """:func:`~pyro_cvi.families.special.dirichlet_entropy` (float32-safe)."""
        return sum_rightmost(dirichlet_entropy(nat[0] + 1), self.event_dim - 1)

    def kl(self, nat_q: Params, nat_p: Params) -> Tensor:
        """``-H[q] - E_q log p`` (stable entropy, ``E log z`` by ``digamma_diff``)."""
        (e_log,) = self.natural_to_mean(nat_q)
        log_p = sum_rightmost(nat_p[0] * e_log, self.event_dim) - self.log_partition(nat_p)
        return -self.entropy(nat_q) - log_p

    def limit_natural(self, nat: Params) -> Params:
        """``alpha_0`` at most :func:`max_concentration` (the mean ``alpha / alpha_0`` kept)."""
        alpha = nat[0] + 1
        f = (max_concentration(alpha.dtype) / alpha.sum(-1, keepdim=True)).clamp(max=1.0)
        return (torch.where(f < 1, alpha * f - 1, nat[0]),)

    def _in_domain(self, nat: Params) -> Tensor:
        ok = nat[0] > -1
        return ok.reshape(ok.shape[: ok.dim() - self.event_dim] + (-1,)).all(-1)

    # CVI helpers --------------------------------------------------------------------------------
    def mean_grad(self, nat: Params, grad_nat: Params) -> Params:
        """``F^{-1} g`` in closed form (eq. 72): ``F = diag(t) - c 1 1^T`` with
        ``t_k = psi'(alpha_k)``, ``c = psi'(alpha_0)``, so by Sherman-Morrison
        ``F^{-1} g = g / t + (c s_g / (1 - c s_1)) / t``, ``s_g = sum_k g_k / t_k``,
        ``s_1 = sum_k 1 / t_k`` (``1 - c s_1 > 0``: ``F`` is positive definite)."""
        alpha = nat[0].detach() + 1
        inv_t = 1.0 / torch.polygamma(1, alpha)
        c = torch.polygamma(1, alpha.sum(-1, keepdim=True))
        g = grad_nat[0].detach() * inv_t
        s_g, s_1 = g.sum(-1, keepdim=True), inv_t.sum(-1, keepdim=True)
        return (g + inv_t * (c * s_g / (1 - c * s_1)),)

    def natural_at(self, value: Tensor, prior_nat: Optional[Params] = None) -> Params:
        """Mean ``alpha / alpha_0 = value`` (entries clamped below at ``1e-6``) with the prior's
        total concentration ``alpha_0`` (at least ``K``; else ``K``): ``(alpha_0 v - 1,)``."""
        v = _float_value(value)
        K = v.shape[-1]
        k = (
            (prior_nat[0] + 1).sum(-1, keepdim=True).clamp(min=float(K))
            if prior_nat is not None
            else float(K)
        )
        return (k * v.clamp(min=1e-6) - 1,)

    def natural_with_spread(self, value: Tensor, scale: float) -> Params:
        """Mean ``value``, total concentration ``max_k 1 / (scale^2 v_k (1 - v_k))`` (so
        every ``sd(logit z_k) <~ scale``)."""
        v = _float_value(value).clamp(1e-6, 1 - 1e-6)
        k = (1.0 / (scale**2 * v * (1 - v))).amax(-1, keepdim=True)
        return self.natural_at(value, ((k / v.shape[-1] - 1).expand(v.shape),))

    def mean_value(self, nat: Params, mean: Params) -> Optional[Tensor]:
        """``E z = alpha / sum alpha`` (from ``nat``; not differentiable w.r.t. ``mean``)."""
        a = nat[0] + 1
        return a / a.sum(-1, keepdim=True)
