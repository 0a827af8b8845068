"""The laws the bilinear block's guide hands out: ``q(W)`` from its independent columns
(``Columns``, through a transpose) and ``q(v)`` of a noise scale or variance ``v = tau^p``
with ``q(tau) = Gamma(a, b)`` (``PowerOfGamma``, with its closed-form moments)."""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from torch.distributions import constraints
from torch.distributions.transforms import PowerTransform, Transform

from ..families.shapes import sympy_free

__all__ = ["Columns", "PowerOfGamma"]


class _Transpose(Transform):
    """``[D, K] -> [K, D]`` (volume-preserving): ``q(W)`` from its independent columns."""

    domain = constraints.independent(constraints.real, 2)
    codomain = constraints.independent(constraints.real, 2)
    bijective = True

    def __eq__(self, other):
        return isinstance(other, _Transpose)

    def _call(self, x):
        return x.transpose(-1, -2)

    def _inverse(self, y):
        return y.transpose(-1, -2)

    def log_abs_det_jacobian(self, x, y):
        return x.new_zeros(x.shape[:-2])

    def forward_shape(self, shape):
        return torch.Size(shape[:-2]) + torch.Size((shape[-1], shape[-2]))

    def inverse_shape(self, shape):
        return self.forward_shape(shape)


class Columns(dist.TransformedDistribution):
    """``q(W)`` from its independent Gaussian columns, transposed to ``W``'s shape."""

    def __init__(self, columns: dist.MultivariateNormal, validate_args=None):
        super().__init__(columns.to_event(1), [_Transpose()], validate_args=validate_args)
        self.columns = columns

    @property
    def mean(self):
        return self.columns.mean.transpose(-1, -2)

    @property
    def variance(self):
        return self.columns.variance.transpose(-1, -2)


class PowerOfGamma(dist.TransformedDistribution):
    """``q(v)`` of ``v = tau^p``, ``tau ~ Gamma(a, b)``, with its moments
    ``E[v^j] = Gamma(a + j p) / Gamma(a) b^(-j p)`` (infinite where ``a + j p <= 0``)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, p: float, validate_args=None):
        super().__init__(
            dist.Gamma(a, b),
            [sympy_free(PowerTransform(a.new_tensor(p)))],
            validate_args=validate_args,
        )
        self.a, self.b, self.p = a, b, p

    def _moment(self, j: float) -> torch.Tensor:
        s = self.a + j * self.p
        out = torch.lgamma(s.clamp_min(1e-6)) - torch.lgamma(self.a) - j * self.p * self.b.log()
        return torch.where(s > 0, out.exp(), torch.full_like(out, math.inf))

    @property
    def mean(self) -> torch.Tensor:
        return self._moment(1.0)

    @property
    def variance(self) -> torch.Tensor:
        return self._moment(2.0) - self._moment(1.0) ** 2
