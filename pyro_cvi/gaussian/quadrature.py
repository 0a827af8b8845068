"""Gauss-Hermite quadrature: expectations of functions of a scalar Gaussian.

``E_{x ~ N(0, 1)}[g(x)] ~= sum_k w_k g(t_k)`` with the nodes ``t_k`` of the probabilists'
Hermite polynomial ``He_K`` and weights normalised to sum to one; exact for polynomials of
degree below ``2K``. For ``eta ~ N(m, v)``: ``E[g(eta)] ~= sum_k w_k g(m + sqrt(v) t_k)``.
Used for the linear-predictor messages (Khan & Lin 2017, Appendix B.1, eq. 29) and for the
moments of transformed Gaussians.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Optional, Tuple

import numpy as np
import torch
from numpy.polynomial.hermite_e import hermegauss

__all__ = ["expected_log_prob", "gauss_hermite", "nodes"]

LogProbFn = Callable[[torch.Tensor], torch.Tensor]


@lru_cache(maxsize=32)
def _hermegauss(num_points: int) -> Tuple[np.ndarray, np.ndarray]:
    x, w = hermegauss(num_points)
    return x, w / np.sqrt(2.0 * np.pi)


def gauss_hermite(
    num_points: int, dtype: torch.dtype = torch.float64, device: Optional[torch.device] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Nodes ``t_k`` and weights ``w_k`` with ``E[g(x)] ~= sum_k w_k g(t_k)`` for ``x ~ N(0, 1)``.

    Uses :func:`numpy.polynomial.hermite_e.hermegauss` (probabilists' Hermite polynomials);
    the weights are normalised to sum to one.
    """
    if num_points < 1:
        raise ValueError(f"num_points must be >= 1, got {num_points}")
    x, w = _hermegauss(int(num_points))
    return (
        torch.as_tensor(x, dtype=dtype, device=device),
        torch.as_tensor(w, dtype=dtype, device=device),
    )


def nodes(
    mean: torch.Tensor, var: torch.Tensor, num_points: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(eta, w)``: the nodes ``mean + sqrt(var) t_k`` (shape ``(K,) + mean.shape``) and the
    weights (shape ``(K,) + (1,) * mean.dim()``) of ``N(mean, var)`` elementwise."""
    t, w = gauss_hermite(num_points, mean.dtype, mean.device)
    shape = (num_points,) + (1,) * mean.dim()
    eta = mean + var.clamp_min(0).sqrt() * t.reshape(shape)
    return eta, w.reshape(shape)


def expected_log_prob(
    log_prob_fn: LogProbFn, mean: torch.Tensor, var: torch.Tensor, num_points: int = 20
) -> torch.Tensor:
    """Elementwise ``E_{eta ~ N(mean, var)}[log_prob_fn(eta)]`` by Gauss-Hermite quadrature.

    ``log_prob_fn`` receives ``eta`` of shape ``(num_points,) + mean.shape`` and must return the
    elementwise log-density of the same shape (broadcasting against the data is its job).
    """
    eta, w = nodes(mean, var, num_points)
    return (w * log_prob_fn(eta)).sum(0)
