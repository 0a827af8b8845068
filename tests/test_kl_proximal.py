"""KL-proximal VI (Khan et al. 2015) baselines: exactness of the closed-form steps, the
equivalence with CVI (Khan & Lin 2017, Section 6), the dual GP form, and a1a convergence."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from bench.baselines import logreg_log_loss_bits, logreg_neg_elbo, plain_cvi_logreg
from bench.datasets import load_logreg
from bench.kl_proximal import (
    gp_neg_elbo,
    kl_prox_gradient_glm,
    kl_prox_gradient_gp,
    kl_prox_gradient_step,
    kl_proximal_point_glm,
)
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.messages.quadrature import mean_param_gradients


def _problem(N=40, D=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    X[:, 0] = 1.0
    y = torch.bernoulli(torch.sigmoid(X @ torch.randn(D, generator=g, dtype=X.dtype)), generator=g)
    return X, y


def _model(delta):
    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[-1]), delta**-0.5).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model


@pytest.mark.parametrize("b", [0.3, 0.8])
def test_cvi_with_constant_step_is_the_mean_linearised_kl_proximal_step(b):
    """Khan & Lin (2017): CVI with step ``b`` = the KL proximal-gradient step with ``f``
    linearised in the mean parameters and ``beta = b / (1 - b)``; AutoCVI vs closed form."""
    X, y = _problem()
    delta = 0.7
    model = _model(delta)
    guide = AutoCVI(model, init_sites="prior")
    svi = SVI(model, guide, CVI(step_size=b), loss=CVI_ELBO())
    m, P = X.new_zeros(5), delta * torch.eye(5, dtype=X.dtype)
    for _ in range(4):
        svi.step(X, y)
        m, P = kl_prox_gradient_step(X, y, delta, m, P, beta=b / (1 - b), linearize="mean")
        q = guide.posterior("w")
        assert torch.allclose(q.loc, m, rtol=0, atol=1e-8)
        assert torch.allclose(q.precision_matrix, P, rtol=0, atol=1e-8)


def _subproblem(X, y, delta, m_k, V_k, beta, linearize):
    """The objective of eq. 7 (KL-PG subproblem), with ``f`` linearised at ``q_k``."""
    mean, var = X @ m_k, ((X @ V_k) * X).sum(-1)
    _, gm, gv = mean_param_gradients(
        lambda eta: (
            -torch.nn.functional.binary_cross_entropy_with_logits(
                eta, y.expand_as(eta), reduction="none"
            )
        ),
        mean,
        var,
        num_points=32,
    )
    qk = dist.MultivariateNormal(m_k, V_k)
    prior = dist.MultivariateNormal(
        torch.zeros_like(m_k), torch.eye(len(m_k), dtype=X.dtype) / delta
    )

    def objective(m, V):
        if linearize == "moments":  # eq. 14: linear in (m, V)
            lin = gm @ (X @ m) + gv @ ((X @ V) * X).sum(-1)
        else:  # linear in the mean parameters (m, V + m m^T), i.e. in (x^T m, x^T (V + mm^T) x)
            lin = (gm - 2 * gv * mean) @ (X @ m) + gv @ ((X @ (V + torch.outer(m, m))) * X).sum(-1)
        q = dist.MultivariateNormal(m, V)
        h = -torch.distributions.kl_divergence(q, prior)
        return lin + h - torch.distributions.kl_divergence(q, qk) / beta

    return objective


@pytest.mark.parametrize("linearize", ["moments", "mean"])
def test_closed_form_step_maximises_the_subproblem(linearize):
    """Eqs. 16-17 (and the mean-parameter variant): the gradient of the subproblem (eq. 15)
    w.r.t. ``m`` and ``V`` vanishes at the closed-form step (an independent autograd check)."""
    X, y = _problem(seed=1)
    delta, beta = 0.5, 0.7
    g = torch.Generator().manual_seed(3)
    m_k = 0.3 * torch.randn(5, generator=g, dtype=X.dtype)
    A = torch.randn(5, 5, generator=g, dtype=X.dtype)
    V_k = A @ A.T / 5 + 0.2 * torch.eye(5, dtype=X.dtype)
    with torch.no_grad():
        m1, P1 = kl_prox_gradient_step(X, y, delta, m_k, torch.linalg.inv(V_k), beta, linearize)
    objective = _subproblem(X, y, delta, m_k, V_k, beta, linearize)
    m = m1.clone().requires_grad_(True)
    V = torch.linalg.inv(P1).requires_grad_(True)
    gm_, gV_ = torch.autograd.grad(objective(m, V), (m, V))
    assert gm_.abs().max() < 1e-9
    assert (gV_ + gV_.T).abs().max() < 1e-9
    # and the two linearisations really differ in the mean (not in the precision)
    other = "mean" if linearize == "moments" else "moments"
    with torch.no_grad():
        m2, P2 = kl_prox_gradient_step(X, y, delta, m_k, torch.linalg.inv(V_k), beta, other)
    assert torch.allclose(P1, P2, atol=1e-12) and (m1 - m2).abs().max() > 1e-4


def test_gp_dual_form_equals_the_primal_glm_form():
    """Eqs. 18-19 (function space, no ``K^-1``) = eqs. 16-17 with ``X = I``, ``Sigma = K``."""
    N = 12
    g = torch.Generator().manual_seed(0)
    x = torch.linspace(-2, 2, N, dtype=torch.float64).unsqueeze(-1)
    K = 2.0 * torch.exp(-torch.cdist(x, x).pow(2) / 2) + 1e-3 * torch.eye(N, dtype=x.dtype)
    y = torch.bernoulli(torch.full((N,), 0.5, dtype=x.dtype), generator=g)
    beta = 0.6
    for linearize in ("moments", "mean"):
        fit = kl_prox_gradient_gp(K, y, beta=beta, num_iters=5, linearize=linearize)
        m, P = x.new_zeros(N), torch.linalg.inv(K)
        for _ in range(5):
            m, P = kl_prox_gradient_step(
                torch.eye(N, dtype=x.dtype), y, torch.linalg.inv(K), m, P, beta, linearize
            )
        assert torch.allclose(K @ fit.a, m, atol=1e-8)
        w = torch.diagonal(P - torch.linalg.inv(K))
        assert torch.allclose(fit.w, w, atol=1e-7)
        # the dual -ELBO equals the primal one (full covariance, closed-form KL to N(0, K))
        V = torch.linalg.inv(P)
        q, p = dist.MultivariateNormal(m, V), dist.MultivariateNormal(x.new_zeros(N), K)
        eye = dist.MultivariateNormal(x.new_zeros(N), torch.eye(N, dtype=x.dtype))
        neg_expected_ll = logreg_neg_elbo(torch.eye(N, dtype=x.dtype), y, m, V, 1.0)
        neg_expected_ll = neg_expected_ll - torch.distributions.kl_divergence(q, eye)
        expected = torch.distributions.kl_divergence(q, p) + neg_expected_ll
        assert math.isclose(gp_neg_elbo(K, y, fit.a, fit.w), float(expected), rel_tol=1e-9)


@pytest.mark.slow
def test_proximal_point_ascends_and_reaches_the_cvi_optimum():
    """Eq. 2: each proximal-point step cannot lower the ELBO (KL >= 0), and the fixed point
    is the ELBO's optimum (the one CVI reaches)."""
    X, y = _problem(N=80, D=6, seed=2)
    fit = kl_proximal_point_glm(X, y, 0.5, beta=3.0, num_iters=6, inner_iters=40)
    values = [h.neg_elbo for h in fit.history]
    assert all(b <= a + 1e-9 for a, b in zip(values, values[1:]))
    cvi = plain_cvi_logreg(X, y, 0.5, 1.0, 30)
    assert abs(values[-1] - cvi.history[-1].neg_elbo) < 1e-4
    assert abs(values[1] - cvi.history[-1].neg_elbo) > 1e-2  # one proximal step is not enough


@pytest.mark.slow
def test_a1a_kl_proximal_gradient_reaches_cvi_optimum(shared_data):
    """Khan et al. (2015) Table 2, a1a row, under our protocol: the KL proximal-gradient
    method (eqs. 16-17) reaches CVI's -ELBO (591.73) within 1 nat, log-loss 0.489 bits."""
    data = load_logreg("a1a", shared_data)
    fit = kl_prox_gradient_glm(
        data.X_train, data.y_train, data.prior_precision, beta=0.5, num_iters=25
    )
    cvi = plain_cvi_logreg(data.X_train, data.y_train, data.prior_precision, 1.0, 15)
    assert abs(cvi.history[-1].neg_elbo - 591.73) < 0.01
    assert abs(fit.history[-1].neg_elbo - cvi.history[-1].neg_elbo) < 1.0
    bits = logreg_log_loss_bits(data.X_test, data.y_test, fit.loc, fit.covariance)
    assert abs(bits - 0.489) < 0.002
