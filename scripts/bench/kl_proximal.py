"""KL-proximal variational inference (Khan, Baque, Fleuret & Fua, 2015) for Gaussian GLMs and GPs.

Baselines for CVI, in plain torch, for ``p(y, z) = prod_n p(y_n | x_n^T z) N(z | 0, Sigma)``
and a Gaussian ``q(z) = N(m, V)``, with ``r = 1 / (1 + beta)`` (``beta`` the proximal step):

* **KL proximal point** (eq. 2, Section 3): ``lam_{k+1} = argmax L(lam) - KL(q || q_k) / beta``.
  The subproblem is solved numerically (L-BFGS over ``m`` and a Cholesky factor of ``V``, with
  the exact Gauss-Hermite ELBO). For conjugate models it is the natural-gradient step of length
  ``beta / (1 + beta)`` (Theorem 1).
* **KL proximal gradient, linearised** (eq. 7): the non-conjugate part ``f = sum_n E_q[log p(y_n
  | eta_n)]`` is replaced by its linearisation at ``q_k``; the prior term ``h`` stays exact.
  The subproblem has a closed form. Khan et al. linearise ``f`` in the moments ``(m, V)``
  (eqs. 11-17, ``linearize="moments"``)::

      V_{k+1}^-1 = r V_k^-1 + (1 - r) (Sigma^-1 + X^T diag(gamma_k) X)                  (16)
      m_{k+1} = [(1-r) Sigma^-1 + r V_k^-1]^-1
                [(1-r)(Sigma^-1 mu - X^T alpha_k) + r V_k^-1 m_k]                             (17)

  with ``alpha_n = -df_n/dm~_n`` and ``gamma_n = -2 df_n/dv~_n`` (eq. 12). Linearising in the
  *mean parameters* ``(m, V + m m^T)`` instead (``linearize="mean"``) gives Khan & Lin (2017,
  eq. 10 and Section 6): ``lam_{k+1} = r lam_k + (1 - r)(eta + grad_mu f)``, i.e. CVI with the
  constant step ``beta_CVI = beta / (1 + beta)``. The two share the precision update (16) and
  differ in the mean: (17) omits ``X^T Gamma X`` from the mean's preconditioner.

GPs (Algorithm 1 of Khan et al., the weight-space view with ``X = I``, ``Sigma = K``) use the
dual form (eqs. 18-19): ``V_k = (K^-1 + diag(g~_k))^-1`` with ``g~_{k+1} = r g~_k + (1-r) gamma_k``,
computed with :func:`pyro_cvi.linalg.dual_solve` (Rasmussen & Williams Alg. 3.2, no ``K^-1``).
"""

from __future__ import annotations

import math
import time
from typing import Callable, List, Optional

import torch

from pyro_cvi.linalg import dual_solve
from pyro_cvi.messages.quadrature import mean_param_gradients

from .baselines import (
    HistoryPoint,
    LogRegFit,
    bernoulli_log_loss_bits,
    bernoulli_logit_log_prob,
    logreg_neg_elbo,
)

__all__ = [
    "GPFit",
    "gp_neg_elbo",
    "kl_prox_gradient_gp",
    "kl_prox_gradient_glm",
    "kl_prox_gradient_step",
    "kl_proximal_point_glm",
]

LINEARIZATIONS = ("moments", "mean")


def _check_linearize(linearize: str) -> None:
    if linearize not in LINEARIZATIONS:
        raise ValueError(f"linearize must be one of {LINEARIZATIONS}, got {linearize!r}")


def _alpha_gamma(X, y, m, V, num_points):
    """``alpha_n = -df_n/dm~_n`` and ``gamma_n = -2 df_n/dv~_n`` at ``q = N(m, V)`` (eq. 12)."""
    mean, var = X @ m, ((X @ V) * X).sum(-1).clamp_min(0.0)
    return _site_grads(mean, var, y, num_points)


def _site_grads(mean, var, y, num_points):
    with torch.enable_grad():
        _, gm, gv = mean_param_gradients(
            lambda eta: bernoulli_logit_log_prob(eta, y), mean, var, num_points=num_points
        )
    return -gm, -2.0 * gv


def kl_prox_gradient_step(
    X: torch.Tensor,
    y: torch.Tensor,
    prior_precision,
    m: torch.Tensor,
    P: torch.Tensor,
    beta: float,
    linearize: str = "moments",
    num_points: int = 32,
):
    """One linearised KL proximal-gradient step for Bayesian logistic regression (primal form).

    ``q_k = N(m, P^-1)``, prior ``N(0, I / delta)`` (or ``N(0, Sigma)`` if ``prior_precision``
    is the matrix ``Sigma^-1``); returns ``(m_{k+1}, P_{k+1})``. See the
    module docstring for the two linearisations; ``"mean"`` is exactly one CVI step of size
    ``beta / (1 + beta)``.
    """
    _check_linearize(linearize)
    r = 1.0 / (1.0 + beta)
    V = torch.cholesky_inverse(torch.linalg.cholesky(P))
    alpha, gamma = _alpha_gamma(X, y, m, V, num_points)
    if torch.is_tensor(prior_precision) and prior_precision.dim() == 2:
        prior = prior_precision  # a full prior precision Sigma^-1 (e.g. K^-1 for a GP)
    else:
        prior = float(prior_precision) * torch.eye(P.shape[-1], dtype=P.dtype, device=P.device)
    XtGX = X.T @ (gamma.unsqueeze(-1) * X)
    P_new = r * P + (1 - r) * (prior + XtGX)  # eq. 16 (both linearisations)
    if linearize == "moments":  # eq. 17
        A = (1 - r) * prior + r * P
        m_new = torch.linalg.solve(A, (1 - r) * (-X.T @ alpha) + r * (P @ m))
    else:  # natural parameters: r lam_k + (1 - r)(eta + grad_mu f)
        m_new = torch.linalg.solve(P_new, r * (P @ m) + (1 - r) * (XtGX @ m - X.T @ alpha))
    return m_new, P_new


def kl_prox_gradient_glm(
    X: torch.Tensor,
    y: torch.Tensor,
    prior_precision: float,
    beta: float = 1.0,
    num_iters: int = 100,
    linearize: str = "moments",
    tol: Optional[float] = None,
    num_points: int = 32,
    callback: Optional[Callable[[int, HistoryPoint], Optional[bool]]] = None,
) -> LogRegFit:
    """Iterate :func:`kl_prox_gradient_step` from the prior; history ``(t, seconds, -ELBO)``.

    The -ELBO is the exact (Gauss-Hermite) one of :func:`bench.baselines.logreg_neg_elbo`;
    with ``tol`` the loop stops once it changes by less than ``tol``.
    """
    D = X.shape[-1]
    y = y.to(X)
    m = X.new_zeros(D)
    P = float(prior_precision) * torch.eye(D, dtype=X.dtype, device=X.device)
    history: List[HistoryPoint] = []
    start = time.perf_counter()
    with torch.no_grad():
        for t in range(num_iters + 1):
            if t > 0:
                m, P = kl_prox_gradient_step(
                    X, y, prior_precision, m, P, beta, linearize, num_points
                )
            V = torch.cholesky_inverse(torch.linalg.cholesky(P))
            nelbo = float(logreg_neg_elbo(X, y, m, V, prior_precision, num_points))
            point = HistoryPoint(t, time.perf_counter() - start, nelbo)
            history.append(point)
            if callback is not None and callback(t, point):
                break
            if tol is not None and t > 0 and abs(history[-2].neg_elbo - nelbo) < tol:
                break
    return LogRegFit(m, V, history, extra={"linearize": linearize, "beta": beta})


def kl_proximal_point_glm(
    X: torch.Tensor,
    y: torch.Tensor,
    prior_precision: float,
    beta: float = 1.0,
    num_iters: int = 20,
    inner_iters: int = 50,
    tol: Optional[float] = None,
    num_points: int = 32,
) -> LogRegFit:
    """The KL proximal-point algorithm (eq. 2) for Bayesian logistic regression.

    Each outer step maximises ``L(m, V) - KL(N(m, V) || N(m_k, V_k)) / beta`` with L-BFGS over
    ``m`` and ``L`` (``V = L L^T``, log-diagonal), started at ``q_k``; the ELBO uses exact
    quadrature. The outer history records the exact -ELBO after each proximal step.
    """
    D = X.shape[-1]
    y = y.to(X)
    delta = float(prior_precision)
    m = X.new_zeros(D)
    L = torch.eye(D, dtype=X.dtype, device=X.device) / math.sqrt(delta)
    tril = torch.tril_indices(D, D, -1, device=X.device)
    history: List[HistoryPoint] = []
    start = time.perf_counter()

    def nelbo_of(m_, L_):
        return logreg_neg_elbo(X, y, m_, None, delta, num_points, scale_tril=L_)

    def build(log_diag, off):
        L_ = torch.diag_embed(log_diag.exp())
        return L_.index_put((tril[0], tril[1]), off)

    with torch.no_grad():
        history.append(HistoryPoint(0, 0.0, float(nelbo_of(m, L))))
    for t in range(1, num_iters + 1):
        qk = torch.distributions.MultivariateNormal(m.detach(), scale_tril=L.detach())
        m_v = m.detach().clone().requires_grad_(True)
        d_v = L.diagonal().log().detach().clone().requires_grad_(True)
        o_v = L[tril[0], tril[1]].detach().clone().requires_grad_(True)
        opt = torch.optim.LBFGS(
            [m_v, d_v, o_v], max_iter=inner_iters, line_search_fn="strong_wolfe"
        )

        def closure(opt=opt, m_v=m_v, d_v=d_v, o_v=o_v, qk=qk):
            opt.zero_grad()
            L_ = build(d_v, o_v)
            q = torch.distributions.MultivariateNormal(m_v, scale_tril=L_)
            loss = nelbo_of(m_v, L_) + torch.distributions.kl_divergence(q, qk) / beta
            loss.backward()
            return loss

        opt.step(closure)
        with torch.no_grad():
            m, L = m_v.detach(), build(d_v, o_v).detach()
            point = HistoryPoint(t, time.perf_counter() - start, float(nelbo_of(m, L)))
        history.append(point)
        if tol is not None and abs(history[-2].neg_elbo - point.neg_elbo) < tol:
            break
    return LogRegFit(m, L @ L.T, history, extra={"beta": beta, "inner_iters": inner_iters})


# ----------------------------------------------------------------------------------------------
# Gaussian-process classification (Algorithm 1 of Khan et al. 2015, dual form, eqs. 18-19)
# ----------------------------------------------------------------------------------------------


class GPFit:
    """``q(f) = N(K a, (K^-1 + diag(w))^-1)`` at the training inputs, and its history."""

    def __init__(self, K, a, w, history):
        self.K, self.a, self.w, self.history = K, a, w, history

    def predict(self, K_cross: torch.Tensor, k_diag: torch.Tensor):
        """Predictive mean and variance of ``f(x*)``; ``K_cross = k(X, x*)``,
        ``k_diag = k(x*, x*)``."""
        sol = dual_solve(self.K, self.w, torch.zeros_like(self.w))
        Vs = sol.whiten(K_cross)
        return K_cross.T @ self.a, (k_diag - Vs.square().sum(-2)).clamp_min(1e-12)

    def log_loss_bits(self, K_cross, k_diag, y_test, num_points: int = 32) -> float:
        mean, var = self.predict(K_cross, k_diag)
        return bernoulli_log_loss_bits(mean, var, y_test, num_points)


def gp_neg_elbo(K, y, a, w, num_points: int = 32, sol=None) -> float:
    """Exact -ELBO of ``q(f) = N(m = K a, V = (K^-1 + diag(w))^-1)`` under ``N(0, K)``.

    ``KL = (tr(B^-1) + m^T a - N + log|B|) / 2`` with ``B = I + W^1/2 K W^1/2``
    (``tr(K^-1 V) = tr(B^-1)``, ``log|K| - log|V| = log|B|``); the likelihood by quadrature.
    """
    sol = dual_solve(K, w, torch.zeros_like(w)) if sol is None else sol
    m = K @ a
    trace_binv = torch.cholesky_inverse(sol.L).diagonal().sum()
    kl = 0.5 * (trace_binv + m @ a - K.shape[-1] + sol.logdet_B)
    with torch.enable_grad():
        f, _, _ = mean_param_gradients(
            lambda eta: bernoulli_logit_log_prob(eta, y), m, sol.var.clamp_min(0), num_points
        )
    return float((kl - f.sum()).detach())


def kl_prox_gradient_gp(
    K: torch.Tensor,
    y: torch.Tensor,
    beta: float = 1.0,
    num_iters: int = 100,
    linearize: str = "moments",
    tol: Optional[float] = None,
    num_points: int = 32,
) -> GPFit:
    """Linearised KL proximal gradient for GP classification with a logistic likelihood.

    State: ``a = K^-1 m`` and the site precisions ``w = g~`` of eq. 18. ``"moments"``:
    eq. 17/19, ``m_{k+1} = (K^-1 + r W_k)^-1 [K^-1 r m_k + r W_k m_k - (1 - r) alpha_k]``;
    ``"mean"``: the CVI site update ``b <- r b + (1 - r)(gamma m - alpha)``,
    ``m = (K^-1 + W)^-1 b``.
    Both: ``w_{k+1} = r w_k + (1 - r) gamma_k``. Starts at the prior (``w = 0``).
    """
    _check_linearize(linearize)
    r = 1.0 / (1.0 + beta)
    y = y.to(K)
    N = K.shape[-1]
    a, w, b = K.new_zeros(N), K.new_zeros(N), K.new_zeros(N)
    sol = dual_solve(K, w, b)
    history: List[HistoryPoint] = []
    start = time.perf_counter()
    with torch.no_grad():
        history.append(HistoryPoint(0, 0.0, gp_neg_elbo(K, y, a, w, num_points, sol)))
        for t in range(1, num_iters + 1):
            m = K @ a
            alpha, gamma = _site_grads(m, sol.var.clamp_min(0), y, num_points)
            if linearize == "moments":
                step = dual_solve(K, r * w, r * w * m - (1 - r) * alpha, mu_f=r * m)
                a = r * a + step.alpha
            else:
                b = r * b + (1 - r) * (gamma * m - alpha)
                a = dual_solve(K, r * w + (1 - r) * gamma, b).alpha
            w = r * w + (1 - r) * gamma
            sol = dual_solve(K, w, torch.zeros_like(w))
            nelbo = gp_neg_elbo(K, y, a, w, num_points, sol)
            point = HistoryPoint(t, time.perf_counter() - start, nelbo)
            history.append(point)
            if tol is not None and abs(history[-2].neg_elbo - point.neg_elbo) < tol:
                break
    return GPFit(K, a, w, history)
