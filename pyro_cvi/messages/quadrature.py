"""Expectations of 1-D functions under Gaussians, and their mean-parameter gradients.

For a factor that touches a Gaussian latent only through a scalar ``eta ~ N(m, v)`` per data
point, CVI needs ``f = E_q[log p(y | eta)]`` and its gradient with respect to the mean
parameters ``mu1 = m``, ``mu2 = v + m^2`` (Appendix B.1 of Khan & Lin 2017). Using
Opper & Archambeau's identities (eq. 29) and the chain rule (eqs. 30-31)::

    df/dm = E[f'(eta)],  df/dv = E[f''(eta)] / 2
    df/dmu1 = df/dm - 2 m df/dv,   df/dmu2 = df/dv

The gradient with respect to ``mu`` *is* the natural parameter of the Gaussian "site"
``exp(lam1 * eta + lam2 * eta^2)`` that CVI puts in place of the factor (eq. 13).

Gauss-Hermite quadrature (deterministic; exact for polynomials of degree < 2K) is the default;
Monte Carlo is available for checking and for likelihoods with kinks.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Optional, Tuple

import numpy as np
import torch
from numpy.polynomial.hermite_e import hermegauss

__all__ = [
    "gauss_hermite",
    "expected_log_prob",
    "mean_param_gradients",
    "site_natural_params",
]

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


def _nodes(mean: torch.Tensor, var: torch.Tensor, num_points: int):
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
    eta, w = _nodes(mean, var, num_points)
    return (w * log_prob_fn(eta)).sum(0)


def mean_param_gradients(
    log_prob_fn: LogProbFn,
    mean: torch.Tensor,
    var: torch.Tensor,
    num_points: int = 20,
    num_samples: Optional[int] = None,
    create_graph: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(f, df/dm, df/dv)`` elementwise, for ``f = E_{N(mean, var)}[log_prob_fn(eta)]``.

    With ``num_samples=None`` the gradients are exact derivatives of the Gauss-Hermite
    estimate of ``f`` (one backward pass). With ``num_samples=S`` they are the Monte Carlo
    estimates of eq. 29, ``E[f']`` and ``E[f''] / 2`` from ``S`` draws, with the value ``f``
    still computed by quadrature. ``f`` keeps its graph to any other tensors that
    ``log_prob_fn`` closes over (hyperparameters), so the caller can back-propagate it.
    """
    m = mean.detach().requires_grad_(True)
    v = var.detach().requires_grad_(True)
    if num_samples is None:
        f = expected_log_prob(log_prob_fn, m, v, num_points)
        gm, gv = torch.autograd.grad(f.sum(), (m, v), retain_graph=True, create_graph=create_graph)
        return f, gm, gv
    f = expected_log_prob(log_prob_fn, mean.detach(), var.detach(), num_points)
    eps = torch.randn((num_samples,) + mean.shape, dtype=mean.dtype, device=mean.device)
    eta = (mean.detach() + var.detach().clamp_min(0).sqrt() * eps).requires_grad_(True)
    lp = log_prob_fn(eta)
    (d1,) = torch.autograd.grad(lp.sum(), eta, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), eta)
    return f, d1.detach().mean(0), 0.5 * d2.mean(0)


def site_natural_params(
    mean: torch.Tensor, grad_mean: torch.Tensor, grad_var: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Map ``(df/dm, df/dv)`` at ``N(mean, var)`` to ``(df/dmu1, df/dmu2)`` (eqs. 30-31).

    The result is the natural parameter ``(lam1, lam2)`` of the Gaussian site
    ``exp(lam1 * eta + lam2 * eta^2)``; ``lam2 < 0`` for log-concave likelihoods.
    """
    return grad_mean - 2.0 * grad_var * mean, grad_var
