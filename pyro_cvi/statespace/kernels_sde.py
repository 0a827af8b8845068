"""Matern kernels of 1-D inputs as linear SDEs (Hartikainen & Sarkka 2010; Sarkka & Solin 2019).

A stationary GP ``f ~ GP(0, k)`` with Matern-nu kernel, ``nu = p + 1/2``, is ``f(t) = H x(t)``
for the state ``x = (f, f', ..., f^(p))`` of the SDE ``dx = F x dt + L dW``, with stationary
covariance ``P_inf``. Between inputs ``dt`` apart the exact discretisation is

    A = expm(F dt),    Q = P_inf - A P_inf A',

so irregularly spaced inputs cost nothing extra, and ``k(tau) = H expm(F tau) P_inf H'``.
Sums of kernels stack their states (block-diagonal ``F``, ``P_inf``; ``H`` concatenated).
Lengthscale and variance are numbers or tensors (e.g. ``pyro.param``; gradients flow through
``expm``); everything is computed in the dtype and on the device of the inputs (``like``).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple, Union, cast

import torch

__all__ = ["SDEKernel", "Matern12", "Matern32", "Matern52", "SumKernel"]

Number = Union[float, torch.Tensor]


class SDEKernel:
    """A kernel with a state-space form: ``F``, ``P_inf``, ``H`` and :meth:`covariance`."""

    state_dim: int

    def feedback(self, like: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def stationary_cov(self, like: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def emission(self, like: torch.Tensor) -> torch.Tensor:
        """``H`` of shape ``(state_dim,)``: ``f = H x``."""
        raise NotImplementedError

    def covariance(self, t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
        """The closed-form kernel matrix ``k(t1_i, t2_j)`` (for checks and dense baselines)."""
        raise NotImplementedError

    def transitions(self, dt: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``A = expm(F dt)`` and ``Q = P_inf - A P_inf A'`` for every gap ``dt (T-1,)``."""
        F, P = self.feedback(dt), self.stationary_cov(dt)
        # a regular grid has few distinct gaps: exponentiate each once
        gaps, inverse = torch.unique(dt.detach(), return_inverse=True)
        if gaps.numel() < dt.numel():
            gaps = gaps + (dt - dt.detach()).sum() * 0  # keep dt's graph, if any
        A = torch.linalg.matrix_exp(F * gaps.to(F)[:, None, None])
        Q = P - A @ P @ A.transpose(-1, -2)
        Q = 0.5 * (Q + Q.transpose(-1, -2))
        return A[inverse], Q[inverse]

    def __add__(self, other: SDEKernel) -> SumKernel:
        return SumKernel([self, other])

    def key(self) -> Optional[Tuple[object, ...]]:
        """A hashable key of the kernel when its hyperparameters are plain numbers (the prior
        is then a function of the inputs alone and may be cached), else ``None``."""
        return None


class _Matern(SDEKernel):
    order = 0  # p, with nu = p + 1/2

    def __init__(self, lengthscale: Number = 1.0, variance: Number = 1.0):
        self.lengthscale, self.variance = lengthscale, variance
        self.state_dim = self.order + 1

    def key(self) -> Optional[Tuple[object, ...]]:
        ls, s2 = self.lengthscale, self.variance
        numbers = isinstance(ls, (int, float)) and isinstance(s2, (int, float))
        return (type(self).__name__, float(ls), float(s2)) if numbers else None

    def params(self, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(lengthscale, variance, lam = sqrt(2 nu) / lengthscale)`` as tensors like ``like``."""
        ls = torch.as_tensor(self.lengthscale).to(like)
        s2 = torch.as_tensor(self.variance).to(like)
        return ls, s2, math.sqrt(2 * self.order + 1) / ls

    def emission(self, like: torch.Tensor) -> torch.Tensor:
        H = like.new_zeros(self.state_dim)
        H[0] = 1.0
        return H

    def feedback(self, like: torch.Tensor) -> torch.Tensor:
        """Companion matrix of ``(s + lam)^(p+1)``."""
        p, lam = self.order, self.params(like)[2]
        coef = [math.comb(p + 1, k) * lam ** (p + 1 - k) for k in range(p + 1)]
        d = self.state_dim
        top = torch.eye(d, dtype=lam.dtype, device=lam.device)[1:]  # shifts: x_k' = x_{k+1}
        last = -torch.stack(coef)
        return torch.cat([top, last.reshape(1, d)], 0)


class Matern12(_Matern):
    """``k(r) = s2 exp(-r / l)`` (Ornstein-Uhlenbeck)."""

    order = 0

    def stationary_cov(self, like: torch.Tensor) -> torch.Tensor:
        return self.params(like)[1].reshape(1, 1)

    def covariance(self, t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
        ls, s2, _ = self.params(t1)
        r = (t1[:, None] - t2[None, :]).abs()
        return s2 * torch.exp(-r / ls)


class Matern32(_Matern):
    """``k(r) = s2 (1 + sqrt(3) r / l) exp(-sqrt(3) r / l)``."""

    order = 1

    def stationary_cov(self, like: torch.Tensor) -> torch.Tensor:
        _, s2, lam = self.params(like)
        return torch.diag(torch.stack([s2, lam**2 * s2]))

    def covariance(self, t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
        _, s2, lam = self.params(t1)
        a = lam * (t1[:, None] - t2[None, :]).abs()
        return s2 * (1 + a) * torch.exp(-a)


class Matern52(_Matern):
    """``k(r) = s2 (1 + sqrt(5) r / l + 5 r^2 / (3 l^2)) exp(-sqrt(5) r / l)``."""

    order = 2

    def stationary_cov(self, like: torch.Tensor) -> torch.Tensor:
        _, s2, lam = self.params(like)
        kappa = lam**2 * s2 / 3
        z = torch.zeros_like(s2)
        rows = [torch.stack([s2, z, -kappa]), torch.stack([z, kappa, z])]
        rows.append(torch.stack([-kappa, z, lam**4 * s2]))
        return torch.stack(rows)

    def covariance(self, t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
        _, s2, lam = self.params(t1)
        a = lam * (t1[:, None] - t2[None, :]).abs()
        return s2 * (1 + a + a**2 / 3) * torch.exp(-a)


class SumKernel(SDEKernel):
    """``k = k_1 + k_2 + ...``: independent SDEs, stacked states."""

    parts: List[SDEKernel]

    def __init__(self, parts: List[SDEKernel]):
        flat: List[SDEKernel] = []
        for p in parts:
            flat.extend(p.parts if isinstance(p, SumKernel) else [p])
        self.parts = flat
        self.state_dim = sum(p.state_dim for p in flat)

    def feedback(self, like: torch.Tensor) -> torch.Tensor:
        F: torch.Tensor = torch.block_diag(*[p.feedback(like) for p in self.parts])
        return F

    def stationary_cov(self, like: torch.Tensor) -> torch.Tensor:
        P: torch.Tensor = torch.block_diag(*[p.stationary_cov(like) for p in self.parts])
        return P

    def emission(self, like: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.emission(like) for p in self.parts])

    def key(self) -> Optional[Tuple[object, ...]]:
        keys = tuple(p.key() for p in self.parts)
        return None if any(k is None for k in keys) else ("sum",) + keys

    def covariance(self, t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, sum(p.covariance(t1, t2) for p in self.parts))
