"""The gradient-only curvature of general factors on Gaussian blocks.

``gradient_gaussian_message`` (Stein's lemma, ``E[H] = E[S^-1 (z - m) grad^T]``, with a control
variate) must target the same natural parameters as the dense Bonnet/Price estimate
(``general_gaussian_message``): both are checked in expectation against the exact target of
a logistic log-likelihood, computed by Gauss-Hermite quadrature along each row. A BNN fitted
with ``general_curvature="gradient"`` must still report its bound (Trace_ELBO).
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from test_loss_is_bound import assert_loss_is_bound

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.messages.gaussian import (
    general_gaussian_message,
    gradient_gaussian_message,
    pd_preserving_target,
)
from pyro_cvi.messages.quadrature import gauss_hermite

DTYPES = [torch.float32, torch.float64]


def _problem(dtype):
    g = torch.Generator().manual_seed(0)
    D, N = 4, 30
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.full((N,), 0.5, dtype=torch.float64), generator=g) * 2 - 1
    loc = 0.3 * torch.randn(D, generator=g, dtype=torch.float64)
    A = torch.randn(D, D, generator=g, dtype=torch.float64) * 0.3
    L = torch.linalg.cholesky(A @ A.T + 0.2 * torch.eye(D, dtype=torch.float64))
    return [t.to(dtype) for t in (X, y, loc, L)]


def _log_joint(X, y):
    def f(z):  # sum_n log sigmoid(y_n x_n^T z): pure torch, so vmap works
        v = torch.nn.functional.logsigmoid(y * (X @ z)).sum()
        return v, v

    return f


def _exact_target(X, y, loc, L):
    """``(h, P)`` with ``g = E[grad f]``, ``H = E[hess f]`` by 1-D quadrature per row."""
    X, y, loc, L = (t.double() for t in (X, y, loc, L))
    t, w = gauss_hermite(60, torch.float64)
    S = L @ L.T
    mean, sd = y * (X @ loc), ((X @ S) * X).sum(-1).sqrt()
    eta = mean[:, None] + sd[:, None] * t  # y x^T z at the nodes
    s = torch.sigmoid(eta)
    d1 = ((1 - s) * w).sum(-1)  # E[d/d eta log sigmoid]
    d2 = (-(s * (1 - s)) * w).sum(-1)  # E[d2/d eta2]
    g = X.T @ (y * d1)
    H = (X * d2[:, None]).T @ X
    P = -H
    return g + P @ loc, P


def _replicates(fn, R):
    hs, Ps = zip(*[fn()[1:3] for _ in range(R)])
    return torch.stack(hs).double(), torch.stack(Ps).double()


def _assert_unbiased(hs, Ps, h, P, what):
    for est, exact, name in ((hs, h, "h"), (Ps, P, "P")):
        mean = est.mean(0)
        se = est.std(0) / math.sqrt(est.shape[0])
        tol = 4.5 * se + 1e-4 * (1 + exact.abs())
        bad = (mean - exact).abs() > tol
        assert not bad.any(), (
            f"{what}: {name} mean {mean[bad]} vs exact {exact[bad]} (se {se[bad]})"
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_target_agrees_with_dense_and_exact_in_expectation(dtype):
    pyro.set_rng_seed(0)
    X, y, loc, L = _problem(dtype)
    h, P = _exact_target(X, y, loc, L)
    f = _log_joint(X, y)
    dense = _replicates(lambda: general_gaussian_message(f, loc, L, 16), 60)
    _assert_unbiased(*dense, h, P, "dense Bonnet/Price")
    grad = _replicates(lambda: gradient_gaussian_message(f, loc, L, 64), 200)
    _assert_unbiased(*grad, h, P, "gradient-only (Stein)")
    # the control variate keeps it unbiased for any symmetric H0, and shrinks its spread
    # when H0 is near E[hess f]
    H0 = -P.to(dtype) * 0.9
    cv = _replicates(lambda: gradient_gaussian_message(f, loc, L, 64, curvature=H0), 200)
    _assert_unbiased(*cv, h, P, "gradient-only with control variate")
    assert cv[1].std(0).mean() < 0.5 * grad[1].std(0).mean()


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_target_exact_for_quadratic_with_its_curvature(dtype):
    """For a quadratic ``f`` and ``H0 = hess f`` the estimate is exact with one pair."""
    D = 5
    g = torch.Generator().manual_seed(1)
    B = torch.randn(D, D, generator=g, dtype=torch.float64)
    H = -(B @ B.T + torch.eye(D, dtype=torch.float64))
    b = torch.randn(D, generator=g, dtype=torch.float64)
    loc = torch.randn(D, generator=g, dtype=torch.float64)
    L = torch.linalg.cholesky(B.T @ B / D + torch.eye(D, dtype=torch.float64))
    H, b, loc, L = (t.to(dtype) for t in (H, b, loc, L))

    def f(z):
        v = 0.5 * z @ H @ z + b @ z
        return v, v

    _, h_est, P_est, vectorised = gradient_gaussian_message(f, loc, L, 2, curvature=H)
    assert vectorised
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(P_est, -H, **tol)
    torch.testing.assert_close(h_est, b, **tol)  # h = g + P m = b + H m - H m


def test_particles_fall_back_to_a_loop_when_vmap_fails():
    X, y, loc, L = _problem(torch.float64)
    pure = _log_joint(X, y)

    def branchy(z):  # data-dependent control flow: not vmap-able
        if float(z[0]) > 1e9:
            raise AssertionError
        return pure(z)

    torch.manual_seed(5)
    a = gradient_gaussian_message(pure, loc, L, 8)
    torch.manual_seed(5)
    b = gradient_gaussian_message(branchy, loc, L, 8)
    assert a[3] and not b[3]
    torch.testing.assert_close(a[1], b[1])
    torch.testing.assert_close(a[2], b[2])
    torch.testing.assert_close(a[0], b[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_pd_preserving_target_keeps_precision_positive_definite(dtype):
    g = torch.Generator().manual_seed(2)
    D = 6
    A = torch.randn(D, D, generator=g, dtype=torch.float64)
    Lam = (A @ A.T + 0.1 * torch.eye(D, dtype=torch.float64)).to(dtype)
    P_old = 0.5 * Lam
    B = torch.randn(D, D, generator=g, dtype=torch.float64).to(dtype)
    P_t = -5 * (B @ B.T)  # a target far outside the domain
    h_old, h_t = torch.zeros(D, dtype=dtype), torch.ones(D, dtype=dtype)
    cov = torch.linalg.inv(Lam)
    loc = cov @ h_old
    beta = 0.9
    plain = Lam + beta * (P_t - P_old)
    assert torch.linalg.eigvalsh(plain).min() < 0
    h2, P2 = pd_preserving_target((h_old, P_old), (h_t, P_t), loc, cov, beta)
    for b in (beta, beta / 2, beta / 8):
        new = Lam + b * (P2 - P_old)
        assert torch.linalg.eigvalsh(0.5 * (new + new.T)).min() > 0
    # the mean moves by b Lambda_new^-1 grad_m (Lin, Schmidt & Khan 2020, eq. 8)
    new = Lam + beta * (P2 - P_old)
    m_new = torch.linalg.solve(new, h_old + beta * (h2 - h_old))
    grad_m = (h_t - h_old) - (P_t - P_old) @ loc
    expect = loc + beta * torch.linalg.solve(new, grad_m)
    tol = 1e-3 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(m_new, expect, rtol=tol, atol=tol)


def _bnn(X, y=None):
    H = 6
    zero = X.new_zeros(())
    W1 = pyro.sample("W1", dist.Normal(zero, 1.0).expand([X.shape[1], H]).to_event(2))
    W2 = pyro.sample("W2", dist.Normal(zero, 1.0).expand([H]).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("obs", dist.Normal(torch.tanh(X @ W1) @ W2, 0.3), obs=y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_curvature_bnn_reports_its_bound(dtype):
    pyro.clear_param_store()
    pyro.set_rng_seed(3)
    g = torch.Generator().manual_seed(3)
    X = torch.randn(40, 2, generator=g, dtype=torch.float64)
    y = torch.sin(X[:, 0]) + 0.3 * torch.randn(40, generator=g, dtype=torch.float64)
    X, y = X.to(dtype), y.to(dtype)
    guide = AutoCVI(_bnn, general_curvature="gradient", remainder="off")
    svi = SVI(_bnn, guide, CVI(), CVI_ELBO())
    losses = [svi.step(X, y) for _ in range(40)]
    assert all(math.isfinite(v) for v in losses)
    assert "general" in guide.explain()
    assert_loss_is_bound(_bnn, guide, svi, (X, y), M=100, P=10, cvi_repeats=20)


def test_general_curvature_option_is_checked_and_chooses_the_estimator():
    with pytest.raises(ValueError, match="general_curvature"):
        AutoCVI(_bnn, general_curvature="diagonal")
    from pyro_cvi.context import Options
    from pyro_cvi.messages.gaussian import DENSE_HESSIAN_MAX_DIM, gradient_only

    small, large = DENSE_HESSIAN_MAX_DIM, DENSE_HESSIAN_MAX_DIM + 1
    assert not gradient_only(Options(general_curvature="auto"), small)
    assert gradient_only(Options(general_curvature="auto"), large)
    assert gradient_only(Options(general_curvature="gradient"), 1)
    assert not gradient_only(Options(general_curvature="hessian"), 10_000)
    assert AutoCVI(_bnn, general_curvature="hessian").general_curvature == "hessian"
