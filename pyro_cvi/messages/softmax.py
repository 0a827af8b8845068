"""Expectations of log-sum-exp under a K-variate Gaussian, and their mean-parameter gradients.

A softmax (Categorical / OneHotCategorical / Multinomial-logit) factor with counts ``y`` (total
``n``) on logits ``eta ~ N(m, S)`` (K-variate) has ``log p = y^T eta - n lse(eta) + const``, so
CVI needs, per data point (Appendix B.1 of Khan & Lin 2017 in K dimensions, eqs. 29-31)::

    F = E[log p] = y^T m - n E[lse(eta)],
    dF/dm = y - n E[softmax(eta)]          (Bonnet),
    dF/dS = -n E[H(eta)] / 2,  H = diag(p) - p p^T     (Price),

and the site natural parameters ``lam2 = dF/dS`` (K x K), ``lam1 = dF/dm - 2 lam2 m``
(:func:`site_targets`). ``H`` is positive semi-definite, so every estimator below that averages
it with positive weights gives ``lam2 <= 0``: the sites stay valid. :func:`lse_expectations`
returns ``(E lse, E softmax, E H)`` three ways:

* ``"cubature"`` (default): the unscented rule in the ``d = K - 1`` logit contrasts (softmax
  ignores a common shift; :func:`contrasts`), ``2d + 1`` points ``c``, ``c +- sqrt(d + kappa) L
  e_i`` (``L L^T`` the contrasts' covariance), weights ``kappa / (d + kappa)`` and
  ``1 / (2 (d + kappa))``, exact for polynomials of degree 3; ``kappa = max(3 - d, 0)``, so for
  ``K >= 4`` it is the third-order spherical-radial rule (``2 (K - 1)`` points). Cost linear in
  K (vs. ``P^K`` for a product rule). At ``K = 2`` the expectation is one-dimensional in the
  logit difference and Gauss-Hermite on it is used: the binary logistic path exactly;
* ``"mc"``: Monte Carlo (in the contrasts) with antithetic pairs ``m +- L eps`` (the
  first-order Taylor control variate ``softmax(m) + H(m)(eta - m)`` cancels exactly) and the
  second-order Taylor control variate
  ``lse(m) + (eta-m)^T softmax(m) + (eta-m)^T H(m) (eta-m) / 2`` for the value;
* ``"bound"``: Böhning's bound ``H <= H_B = (I - 1 1^T / K) / 2`` (NCVMP supplement, eq. 29):
  ``E lse <= lse(m) + tr(H_B S) / 2``. Fixed curvature: ``lam2 = -n H_B / 2`` every step, so the
  site precisions never change and one factorisation serves every step. A lower bound on the
  ELBO (looser than the others), exact derivatives of the bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..gaussian.price import site_natural_params_multivariate
from .quadrature import expected_log_prob

__all__ = [
    "METHODS",
    "LSEMoments",
    "cov_sqrt",
    "contrasts",
    "cubature_rule",
    "lse_expectations",
    "site_targets",
]

METHODS = ("cubature", "mc", "bound")


@dataclass
class LSEMoments:
    """``E[lse(eta)] [...]``, ``E[softmax(eta)] [..., K]``, ``E[H(eta)] [..., K, K]``."""

    value: torch.Tensor
    grad: torch.Tensor
    hess: torch.Tensor


def cov_sqrt(cov: torch.Tensor) -> torch.Tensor:
    """``L`` with ``L L^T = S``: the Cholesky factor (differentiable) where ``S`` is positive
    definite, else a square root by ``eigh`` of the symmetrised, clipped ``S`` (no graph)."""
    L, info = torch.linalg.cholesky_ex(cov)
    bad = info != 0
    if bool(bad.any()):
        c = cov.detach()
        e, U = torch.linalg.eigh(0.5 * (c + c.mT))
        R = U * e.clamp_min(0).sqrt().unsqueeze(-2)
        L = torch.where(bad[..., None, None], R, L)
    return L


def cubature_rule(
    K: int, kappa: Optional[float] = None, dtype=torch.float64, device=None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Unit points ``xi [P, K]`` and weights ``[P]`` of the unscented rule (module docstring)."""
    kappa = max(3.0 - K, 0.0) if kappa is None else float(kappa)
    if kappa < 0:
        raise ValueError(f"kappa must be >= 0 (positive weights keep sites valid), got {kappa}")
    eye = torch.eye(K, dtype=dtype, device=device) * (K + kappa) ** 0.5
    xi = torch.cat([eye, -eye], 0)
    w = torch.full((2 * K,), 0.5 / (K + kappa), dtype=dtype, device=device)
    if kappa > 0:
        xi = torch.cat([xi.new_zeros(1, K), xi], 0)
        w = torch.cat([w.new_full((1,), kappa / (K + kappa)), w], 0)
    return xi, w


def _hess(p: torch.Tensor) -> torch.Tensor:
    return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)


def _at_points(eta: torch.Tensor, w: torch.Tensor) -> LSEMoments:
    """Weighted sums over the point dim (``-2`` of ``eta [..., P, K]``)."""
    p = eta.softmax(-1)
    value = (w * eta.logsumexp(-1)).sum(-1)
    wp = w.unsqueeze(-1) * p
    grad = wp.sum(-2)
    # sum_j w_j (diag p_j - p_j p_j^T) = diag(grad) - (w p)^T p: no [..., P, K, K] temporaries
    hess = torch.diag_embed(grad) - wp.mT @ p
    return LSEMoments(value, grad, hess)


def contrasts(K: int, dtype=torch.float64, device=None) -> torch.Tensor:
    """An orthonormal basis ``Q [K, K - 1]`` of the logit contrasts (``Q^T 1 = 0``)."""
    C = torch.eye(K, dtype=torch.float64, device=device) - 1.0 / K
    Q, _ = torch.linalg.qr(C[:, : K - 1])
    return Q.to(dtype=dtype, device=device)


def _contrast_sqrt(mean, cov):
    """``eta = mean(m) 1 + Q (Q^T m + L xi)``: the basis ``Q`` and ``L L^T = Q^T S Q``. The softmax
    ignores the direction ``1``, so rules run in the K - 1 contrasts (shift-invariant)."""
    Q = contrasts(mean.shape[-1], mean.dtype, mean.device)
    return Q, cov_sqrt(Q.mT @ cov @ Q)


def _cubature(mean, cov, kappa):
    K = mean.shape[-1]
    Q, L = _contrast_sqrt(mean, cov)
    xi, w = cubature_rule(K - 1, kappa, mean.dtype, mean.device)
    eta = mean.unsqueeze(-2) + (xi @ L.mT) @ Q.mT
    out = _at_points(eta.detach(), w)
    if eta.requires_grad:  # the value keeps its graph to mean and cov
        out.value = (w * eta.logsumexp(-1)).sum(-1)
    return out


def _pairwise(mean, cov, num_points):
    """K = 2: ``lse(eta) = eta_0 + softplus(eta_1 - eta_0)``, Gauss-Hermite in the difference."""
    softplus = torch.nn.functional.softplus
    d = mean[..., 1] - mean[..., 0]
    vd = cov[..., 0, 0] + cov[..., 1, 1] - cov[..., 0, 1] - cov[..., 1, 0]
    md0, vd0 = d.detach().requires_grad_(True), vd.detach().requires_grad_(True)
    with torch.enable_grad():
        f = expected_log_prob(softplus, md0, vd0, num_points)
        gm, gv = torch.autograd.grad(f.sum(), (md0, vd0))
    if d.requires_grad or vd.requires_grad:  # keep the graph to mean and cov
        value = mean[..., 0] + expected_log_prob(softplus, d, vd, num_points)
    else:
        value = mean[..., 0] + f.detach()
    grad = torch.stack([1 - gm, gm], -1)
    u = torch.tensor([-1.0, 1.0], dtype=mean.dtype, device=mean.device)
    hess = 2 * gv[..., None, None] * (u[:, None] * u[None, :])
    return LSEMoments(value, grad, hess)


def _monte_carlo(mean, cov, num_samples, generator, draws=None):
    half = max(1, num_samples // 2)
    if draws is None:
        device = mean.device if generator is None else generator.device
        eps = torch.randn(
            (half,) + mean.shape, dtype=mean.dtype, generator=generator, device=device
        )
        eps = eps.to(mean.device)
    elif draws.shape != (half,) + mean.shape:
        raise ValueError(
            f"lse_expectations: draws must have shape {(half,) + tuple(mean.shape)} "
            f"(num_samples // 2 antithetic pairs), got {tuple(draws.shape)}"
        )
    else:
        eps = draws
    eps = eps.to(mean)
    Q, L = _contrast_sqrt(mean, cov)
    # L eps as one contraction, not [S, N] tiny matmuls (10x faster on the CPU)
    dh = torch.einsum("...ij,s...j->s...i", L, eps[..., : mean.shape[-1] - 1]) @ Q.mT
    m = mean.detach()
    p0, lse0 = m.softmax(-1), m.logsumexp(-1)
    H0 = _hess(p0)
    graph = torch.is_grad_enabled() and (mean.requires_grad or dh.requires_grad)
    if graph:
        eta = mean + torch.cat([dh, -dh], 0)  # antithetic pairs
    else:  # the same values, written in place (no concatenated and negated copies)
        eta = dh.new_empty((2 * dh.shape[0],) + dh.shape[1:])
        torch.add(m, dh, out=eta[: dh.shape[0]])
        torch.sub(m, dh, out=eta[dh.shape[0] :])
    # value: E[taylor_2] in closed form + the Monte Carlo mean of (lse - taylor_2), with
    # d^T H(m) d = sum_k p_k d_k^2 - (p^T d)^2; the linear term p^T d cancels within each pair
    # and the quadratic one is the same for both draws of a pair (computed on one half)
    dp = (dh * p0).sum(-1)
    quad = 0.5 * ((dh * dh * p0).sum(-1) - dp * dp)
    top = eta.detach().amax(-1, keepdim=True)
    # lse and the softmax from one exp
    e = (eta - top).exp() if graph else eta.sub_(top).exp_()
    total = e.sum(-1)
    lse = top.squeeze(-1) + total.log()
    resid = lse.mean(0) - lse0 - quad.mean(0)
    value = lse0 + 0.5 * (H0 * cov).sum((-2, -1)) + resid
    p = (e / total.unsqueeze(-1)).detach() if graph else e.div_(total.unsqueeze(-1))
    pbar = p.mean(0)  # E[H] = diag(E p) - E[p p^T], without an [S, ..., K, K] intermediate
    outer = torch.einsum("s...k,s...l->...kl", p, p) / p.shape[0]
    return LSEMoments(value, pbar, torch.diag_embed(pbar) - outer)


def _bound(mean, cov):
    K = mean.shape[-1]
    eye = torch.eye(K, dtype=mean.dtype, device=mean.device)
    HB = 0.5 * (eye - 1.0 / K)
    value = mean.logsumexp(-1) + 0.5 * (HB * cov).sum((-2, -1))
    grad = mean.detach().softmax(-1)
    return LSEMoments(value, grad, HB.expand(mean.shape + (K,)))


def lse_expectations(
    mean: torch.Tensor,
    cov: torch.Tensor,
    method: str = "cubature",
    *,
    num_points: int = 32,
    num_samples: int = 100,
    kappa: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
    draws: Optional[torch.Tensor] = None,
) -> LSEMoments:
    """``E[lse]``, ``E[softmax]``, ``E[H]`` under ``N(mean [..., K], cov [..., K, K])``.

    ``method``: ``"cubature"`` (default), ``"mc"`` or ``"bound"`` (module docstring).
    ``num_points``: Gauss-Hermite points of the K = 2 cubature; ``num_samples``: Monte Carlo
    draws; ``draws``: Monte Carlo only, the standard normals ``[num_samples // 2, ..., K]`` to
    use instead of drawing them from ``generator`` (a caller that re-seeds every call can keep
    them). The value keeps its graph to ``mean`` and ``cov``; the moments have none.
    """
    if method not in METHODS:
        raise ValueError(f"softmax method must be one of {METHODS}, got {method!r}")
    if method == "bound":
        return _bound(mean, cov)
    if method == "mc":
        return _monte_carlo(mean, cov, num_samples, generator, draws)
    if mean.shape[-1] == 2:
        return _pairwise(mean, cov, num_points)
    return _cubature(mean, cov, kappa)


def site_targets(
    y: torch.Tensor, n: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, mom: LSEMoments
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(F, lam1, lam2)`` per point: ``F = weight (y^T m - n E lse)`` (without the constant)
    and the target site ``lam2 = dF/dS``, ``lam1 = dF/dm - 2 lam2 m`` (eqs. 30-31 in K-D).

    ``lam2`` is symmetrised and projected onto the negative semidefinite cone (its positive
    eigenvalues, only ever round-off for the estimators here, are clipped to zero).
    """
    wn = weight * n
    F = weight * (y * mean).sum(-1) - wn * mom.value
    dm = weight.unsqueeze(-1) * y - wn.unsqueeze(-1) * mom.grad
    lam2 = -0.5 * wn[..., None, None] * mom.hess
    lam2 = 0.5 * (lam2 + lam2.mT)
    # only the matrices with an eigenvalue above round-off (a Cholesky test) are decomposed
    K = lam2.shape[-1]
    tol = K * torch.finfo(lam2.dtype).eps * lam2.abs().amax((-2, -1), keepdim=True)
    eye = torch.eye(K, dtype=lam2.dtype, device=lam2.device)
    bad = torch.linalg.cholesky_ex(tol * eye - lam2).info != 0
    if bool(bad.any()):
        e, U = torch.linalg.eigh(lam2[bad])
        lam2 = lam2.clone()
        lam2[bad] = (U * e.clamp_max(0).unsqueeze(-2)) @ U.mT
    lam1, lam2 = site_natural_params_multivariate(mean.detach(), dm, lam2)
    return F, lam1, lam2
