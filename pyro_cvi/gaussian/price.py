"""Bonnet's and Price's theorems: gradients of ``E_q[f]`` in ``q = N(m, S)``'s parameters.

For ``F(m, S) = E_q[f(z)]`` (Opper & Archambeau 2009; Khan & Lin 2017, eq. 29)::

    dF/dm = E_q[grad f(z)]               (Bonnet)
    dF/dS = E_q[hess f(z)] / 2           (Price)

and by the chain rule through the mean parameters ``mu1 = m``, ``mu2 = S + m m^T``
(eqs. 30-31)::

    dF/dmu1 = dF/dm - 2 dF/dS m,         dF/dmu2 = dF/dS.

The gradient in ``mu`` is the natural parameter ``(lam1, lam2)`` of the Gaussian site
``exp(lam1^T z + z^T lam2 z)`` that CVI puts in place of ``f`` (eqs. 12-13); in precision
form ``(h, P) = (lam1, -2 lam2) = (g - H m, -H)`` with ``g = E[grad f]``, ``H = E[hess f]``.
``E[hess f]`` from gradients only is Stein's lemma, ``E[(z - m) grad f^T] = S E[hess f]``
(the reparameterisation form of Lin, Schmidt & Khan 2020, eq. 7).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from .quadrature import expected_log_prob

__all__ = [
    "bonnet_mean_gradient",
    "expected_hessian",
    "mean_param_gradients",
    "price_precision_gradient",
    "price_target",
    "site_natural_params",
    "site_natural_params_multivariate",
    "stein_hessian",
]


def site_natural_params(mean: Tensor, grad_mean: Tensor, grad_var: Tensor) -> Tuple[Tensor, Tensor]:
    """Map ``(dF/dm, dF/dv)`` at ``N(mean, var)`` to ``(dF/dmu1, dF/dmu2)`` (eqs. 30-31),
    element-wise.

    The result is the natural parameter ``(lam1, lam2)`` of the Gaussian site
    ``exp(lam1 * eta + lam2 * eta^2)``; ``lam2 < 0`` for log-concave likelihoods.
    """
    return grad_mean - 2.0 * grad_var * mean, grad_var


def site_natural_params_multivariate(
    mean: Tensor, grad_mean: Tensor, grad_cov: Tensor
) -> Tuple[Tensor, Tensor]:
    """Eqs. 30-31 in K dimensions: ``(dF/dm - 2 dF/dS m, dF/dS)`` for ``mean [..., K]``,
    ``grad_cov = dF/dS [..., K, K]`` (symmetric)."""
    return grad_mean - 2 * (grad_cov @ mean.unsqueeze(-1)).squeeze(-1), grad_cov


def price_target(g: Tensor, H: Tensor, m: Tensor) -> Tuple[Tensor, Tensor]:
    """The CVI target of ``f`` in precision form, ``(h, P) = (g - H m, -H)`` from
    ``g = E[grad f]`` and the symmetric ``H = E[hess f]`` at ``q``'s mean ``m``."""
    P = -H
    return g + P @ m, P


def price_precision_gradient(H: Tensor, P: Tensor) -> Tensor:
    """``G = -2 dL/dS = -sym(E[hess f]) - S^-1`` for ``L = E_q[f] + H[q]`` (Price, and
    ``dH[q]/dS = S^-1 / 2``): the precision's natural-gradient step direction, ``G = P_target -
    P`` with ``P_target = -E[hess f]``; ``P = S^-1``."""
    return -0.5 * (H + H.mT) - P


def bonnet_mean_gradient(g: Tensor, u: Tensor, m: Tensor, P: Tensor) -> Tensor:
    """``dL/dm = E[grad f]`` from the gradients ``g [K, D]`` at draws ``u [K, D]`` of
    ``N(m, P^-1)``, with the control variate ``P (u - m)`` (zero in expectation, and the exact
    negative of ``g``'s fluctuation where ``f`` is the log of a Gaussian with precision ``P``)."""
    return (g + (u - m) @ P).mean(0)


def _batched_vjp(g: Tensor, u: Tensor, cotangents: Tensor) -> Tuple[Optional[Tensor], ...]:
    """``torch.autograd.grad(g, u, cotangents, retain_graph=True, is_grads_batched=True,
    allow_unused=True)``: the same batched engine call, without the public function's check of
    the cotangents' shapes (right here by construction), whose first use in a process imports
    sympy (0.4-0.5 CPU s, most of a small model's first step). The public call where torch's
    internals differ."""
    try:
        from torch._vmap_internals import _vmap
        from torch.autograd.graph import _engine_run_backward
    except ImportError:
        return _public_batched_vjp(g, u, cotangents)
    if cotangents.shape[1:] != g.shape or cotangents.dtype != g.dtype:
        return _public_batched_vjp(g, u, cotangents)

    def vjp(cotangent: Tuple[Tensor]) -> Tuple[Optional[Tensor], ...]:
        out = _engine_run_backward((g,), cotangent, True, False, (u,), True, accumulate_grad=False)
        return tuple(out)

    try:
        rows: Tuple[Optional[Tensor], ...] = _vmap(vjp, 0, 0, allow_none_pass_through=True)(
            (cotangents,)
        )
    except TypeError:  # (another torch's private signatures; the graph is retained)
        return _public_batched_vjp(g, u, cotangents)
    return rows


def _public_batched_vjp(g: Tensor, u: Tensor, cotangents: Tensor) -> Tuple[Optional[Tensor], ...]:
    rows: Tuple[Optional[Tensor], ...] = torch.autograd.grad(
        g, u, cotangents, retain_graph=True, is_grads_batched=True, allow_unused=True
    )
    return rows


def expected_hessian(g: Tensor, u: Tensor) -> Tensor:
    """``E[hess f]`` over draws ``u [K, D]`` from ``g = grad f(u) [K, D]`` (with its graph to
    ``u``; ``f`` a sum over the draws of one term per draw): the exact Hessian that Price's
    theorem averages, ``H_ij = mean_k d g_ki / d u_kj``. All ``D`` rows come from one batched
    backward pass (the unit vectors ``e_i`` as a batch of cotangents, ``sum_k e_i^T g_k``
    differentiated in ``u``); where an operation of the graph has no batched backward it
    falls back to one backward pass per row. The same numbers either way."""
    K, D = u.shape
    if not g.requires_grad:
        return u.new_zeros(D, D)
    eye = torch.eye(D, dtype=g.dtype, device=g.device)
    try:
        (rows,) = _batched_vjp(g, u, eye[:, None, :].expand(D, K, D))
    except (RuntimeError, NotImplementedError):
        rows = None
    else:
        if rows is None:
            return u.new_zeros(D, D)
        return rows.mean(1).detach()
    out = []
    for i in range(D):
        (h,) = torch.autograd.grad(g[:, i].sum(), u, retain_graph=True, allow_unused=True)
        out.append(torch.zeros_like(u) if h is None else h)
    return torch.stack(out, 1).mean(0).detach()


def stein_hessian(eps: Tensor, dz: Tensor, L: Tensor, G: Tensor, H0: Tensor) -> Tensor:
    """``E[hess f]`` from gradients only, by Stein's lemma ``E[hess f] = E[S^-1 (z - m) grad
    f^T]`` with draws ``z - m = dz = eps L^T`` (rows; ``S = L L^T``, so ``S^-1 (z - m) = L^-T
    eps``) and gradients ``G`` (rows). ``H0`` (symmetric) is a control variate: since
    ``E[L^-T eps eps^T L^T] = I``, ``E[hess f] = H0 + E[L^-T eps (grad f - H0 L eps)^T]``, exact
    for a quadratic ``f`` once ``H0`` is (with antithetic pairs the constant part of the
    residual cancels). The estimate is symmetrised."""
    S = eps.shape[0]
    U: Tensor = torch.linalg.solve_triangular(L.T, eps.T, upper=True)
    U = U.T  # rows L^-T eps
    H = H0 + U.T @ (G - dz @ H0) / S
    return 0.5 * (H + H.T)


def mean_param_gradients(
    log_prob_fn: Callable[[Tensor], Tensor],
    mean: Tensor,
    var: Tensor,
    num_points: int = 20,
    num_samples: Optional[int] = None,
    create_graph: bool = False,
) -> Tuple[Tensor, Tensor, Tensor]:
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
