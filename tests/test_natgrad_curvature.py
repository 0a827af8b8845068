"""The curvature a Gaussian's draws show (:mod:`pyro_cvi.natgrad.curvature`), diagonal and
full-covariance: the secant fit is exact on linear gradients, its control variates have mean
zero under ``q`` (Gauss-Hermite quadrature, exact for their degree), and ``CVI()`` +
``AutoNormal`` reaches the closed-form mean-field optimum of a strongly correlated regression."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_cvi import CVI
from pyro_cvi.natgrad.curvature import (
    DrawCurvature,
    correlation_metric,
    diag_with_draw,
    reparameterised,
    tril_reparameterised,
    tril_with_draw,
)

DTYPES = [torch.float32, torch.float64]


def _spd(d: int, g: torch.Generator) -> torch.Tensor:
    b = torch.randn(d, d, generator=g, dtype=torch.float64)
    return b @ b.T + 0.5 * torch.eye(d, dtype=torch.float64)


def test_the_fit_is_exact_on_linear_gradients():
    g = torch.Generator().manual_seed(0)
    d = 5
    A, c = _spd(d, g), torch.randn(d, generator=g, dtype=torch.float64)
    curv = DrawCurvature(d)
    s = torch.rand(d, generator=g, dtype=torch.float64) + 0.1
    assert curv.fit(s) is None  # fewer draws than its window
    for _ in range(curv.window):
        u = torch.randn(d, generator=g, dtype=torch.float64) * 3.0 + 1.0
        curv.add(u, A @ u + c)
    a, c_fit = curv.fit(s)
    # (exact up to the solve's ridge, 1e-8 of the whitened spread)
    assert torch.allclose(a, A, atol=1e-6, rtol=1e-6)
    assert torch.allclose(c_fit, c, atol=1e-5, rtol=1e-6)


def test_the_control_variates_have_mean_zero_under_q():
    """With any fit (here a random one), the corrected ``dl/dm`` and ``dl/ds`` have the same
    expectation under ``q`` as the plain ones: checked with a 3-point Gauss-Hermite product
    rule in d = 3 (exact for the corrections, polynomials of degree 2 in eps), on a nonlinear
    gradient ``h(u) = tanh(u) + u^3 / 10``."""
    g = torch.Generator().manual_seed(1)
    d = 3
    m = torch.randn(d, generator=g, dtype=torch.float64)
    s = torch.rand(d, generator=g, dtype=torch.float64) + 0.3
    x, w = np.polynomial.hermite_e.hermegauss(3)
    x, w = torch.tensor(x), torch.tensor(w / math.sqrt(2 * math.pi))
    fit = DrawCurvature(d)
    for _ in range(fit.window):  # a fit from unrelated points: a wrong one
        u = torch.randn(d, generator=g, dtype=torch.float64)
        fit.add(u, torch.randn(d, generator=g, dtype=torch.float64))
    dm, ds = torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    for idx in itertools.product(range(3), repeat=d):
        eps = x[list(idx)]
        weight = float(torch.prod(w[list(idx)]))
        u = m + s * eps
        h = torch.tanh(u) + u**3 / 10
        gs = h * eps - 1 / s
        curv = DrawCurvature(d)
        curv.load(fit.state())
        curv.gains = lambda error, s: (True, False)  # type: ignore[method-assign]
        gm2, gs2, _ = diag_with_draw(m, s, h, gs, u, curv)
        dm += weight * (gm2 - h)
        ds += weight * (gs2 - gs)
    assert dm.abs().max() < 1e-12 and ds.abs().max() < 1e-12


def test_the_metric_is_the_identity_for_independent_coordinates():
    a = torch.diag(torch.tensor([4.0, 9.0, 0.25], dtype=torch.float64))
    v, lam = correlation_metric(a)
    assert torch.allclose(v @ torch.diag(lam) @ v.T, torch.eye(3, dtype=torch.float64))
    assert correlation_metric(-a) is None


def _regression(dtype):
    g = torch.Generator().manual_seed(0)
    n, d, noise = 200, 6, 0.5
    common = torch.randn(n, 1, generator=g, dtype=torch.float64)
    X = math.sqrt(0.95) * common + math.sqrt(0.05) * torch.randn(n, d, generator=g).double()
    y = X @ torch.randn(d, generator=g, dtype=torch.float64) + noise * torch.randn(
        n, generator=g, dtype=torch.float64
    )

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(d), 10.0).to_event(1))
        with pyro.plate("data", n):
            pyro.sample("obs", dist.Normal(X @ w, noise), obs=y)

    lam = torch.eye(d, dtype=torch.float64) / 100 + X.T @ X / noise**2
    m_star = torch.linalg.solve(lam, X.T @ y / noise**2)
    return model, X.to(dtype), y.to(dtype), m_star, lam.diagonal().rsqrt()


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_autonormal_reaches_the_mean_field_optimum_of_a_correlated_regression(dtype):
    """Six predictors of pairwise correlation 0.95 (the diagonal step alone is a Jacobi
    iteration at rate 0.05): 100 steps reach ``m*`` and ``1 / sqrt(Lambda_ii)``."""
    model, X, y, m_star, s_star = _regression(dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(model)
    cvi = CVI()
    svi = SVI(model, guide, cvi, Trace_ELBO())
    for _ in range(100):
        svi.step(X, y)
    m = pyro.param("AutoNormal.locs.w").detach().double()
    s = pyro.param("AutoNormal.scales.w").detach().double()
    tol = 1e-3 if dtype == torch.float64 else 2e-2
    assert ((m - m_star) / s_star).abs().max() < tol
    assert ((s - s_star) / s_star).abs().max() < tol
    assert "AutoNormal.locs.w" in cvi.gaussians.curvatures


def test_several_particles_keep_the_diagonal_step():
    """Two draws a step: ``dl/dm`` is their mean, no single draw's gradient: no fit."""
    model, X, y, _, _ = _regression(torch.float64)
    pyro.clear_param_store()
    guide = AutoNormal(model)
    cvi = CVI()
    svi = SVI(model, guide, cvi, Trace_ELBO(num_particles=2))
    for _ in range(3):
        svi.step(X, y)
    assert not cvi.gaussians.curvatures


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_only_the_draws_reparameterised_gradients_are_fitted(dtype):
    """``dl/ds = h eps - 1/s`` with ``h = dl/dm`` (Trace_ELBO's gradients at the draw) is
    recognised; the same with an analytic KL term in ``dl/ds`` (TraceMeanField_ELBO) is not."""
    g = torch.Generator().manual_seed(2)
    m, s = torch.randn(4, generator=g).to(dtype), (torch.rand(4, generator=g) + 0.5).to(dtype)
    u = m + s * torch.randn(4, generator=g).to(dtype)
    h = (3.0 * u - 1.0).to(dtype)
    gs = h * (u - m) / s - 1 / s
    args = [t.double() for t in (m, s, h, gs, u)]
    assert reparameterised(*args, dtype)
    args[3] = (h * (u - m) / s + s - 1 / s).double()  # + d KL(N(m, s) || N(0, 1)) / ds
    assert not reparameterised(*args, dtype)


def test_an_analytic_kl_keeps_the_diagonal_step():
    """A hand-written Normal guide under TraceMeanField_ELBO: the KL to the Normal prior is
    analytic, ``dl/dm`` is no gradient at the draw: nothing is fitted."""
    model, X, y, _, _ = _regression(torch.float64)
    d = X.shape[1]

    def guide(X, y):
        loc = pyro.param("w_loc", X.new_zeros(d))
        scale = pyro.param("w_scale", X.new_ones(d), constraint=dist.constraints.positive)
        pyro.sample("w", dist.Normal(loc, scale).to_event(1))

    for loss, fitted in ((TraceMeanField_ELBO(), False), (Trace_ELBO(), True)):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        cvi = CVI()
        svi = SVI(model, guide, cvi, loss)
        for _ in range(5):
            svi.step(X, y)
        assert any(c.n > 0 for c in cvi.gaussians.curvatures.values()) == fitted


def _tril_point(d: int, g: torch.Generator, dtype=torch.float64):
    m = torch.randn(d, generator=g, dtype=torch.float64)
    L = torch.linalg.cholesky(_spd(d, g) / d)
    return m.to(dtype), L.to(dtype)


def _tril_grads(m, L, eps, h_of):
    """Trace_ELBO's one-draw gradients of ``N(m, L L^T)`` at ``u = m + L eps``."""
    u = m + L @ eps
    h = h_of(u)
    return u, h, torch.outer(h, eps).tril() - torch.diag(1.0 / L.diagonal())


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_a_full_covariance_step_is_exact_on_linear_gradients(dtype):
    """Where ``h(u) = A u + c`` (a Gaussian posterior), from ``d + 2`` draws and two checked
    predictions on the corrected gradients are the exact expected ones: ``dl/dm = A m + c``
    and ``G = A - S^-1`` (Price's theorem), whatever the draw."""
    g = torch.Generator().manual_seed(3)
    d = 3
    A, c = _spd(d, g), torch.randn(d, generator=g, dtype=torch.float64)
    m, L = _tril_point(d, g, dtype)
    curv = DrawCurvature(d, d + 2, 2)
    results = []
    for _ in range(d + 5):
        eps = torch.randn(d, generator=g, dtype=torch.float64).to(dtype)
        u, h, gL = _tril_grads(m, L, eps, lambda u: (A @ u.double() + c).to(dtype))
        results.append(tril_with_draw(m, L, h, gL, u, curv))
    # d + 2 draws fitted; the fit predicts the next two, and the second is stepped with it
    assert all(r is None for r in results[: d + 3])
    assert all(r is not None for r in results[d + 3 :])
    gm, G = results[-1]
    L64 = L.double()
    P = torch.cholesky_inverse(L64)
    tol = 1e-6 if dtype == torch.float64 else 2e-3  # (the fit's ridge: 1e-8 of the spread)
    assert torch.allclose(gm.double(), A @ m.double() + c, atol=tol * 10, rtol=tol)
    assert torch.allclose(G.double(), A - P, atol=tol * 10, rtol=tol)


def test_the_full_covariance_control_variates_have_mean_zero_under_q():
    """With a wrong fit, the corrected ``dl/dm`` and ``G`` have the expectation of the plain
    ones, ``h`` and ``sym(h eps^T L^-1) - S^-1``: a 3-point Gauss-Hermite product rule in
    ``eps`` (exact for the corrections, of degree 2), nonlinear ``h``."""
    g = torch.Generator().manual_seed(4)
    d = 3
    m, L = _tril_point(d, g)
    x, w = np.polynomial.hermite_e.hermegauss(3)
    x, w = torch.tensor(x), torch.tensor(w / math.sqrt(2 * math.pi))
    fit = DrawCurvature(d, d + 2, 2)
    for _ in range(d + 5):
        fit.add(torch.randn(d, generator=g).double(), torch.randn(d, generator=g).double())
    Linv = torch.linalg.inv(L)
    P = Linv.T @ Linv
    dm = torch.zeros(d, dtype=torch.float64)
    dG = torch.zeros(d, d, dtype=torch.float64)
    for idx in itertools.product(range(3), repeat=d):
        eps = x[list(idx)]
        weight = float(torch.prod(w[list(idx)]))
        u, h, gL = _tril_grads(m, L, eps, lambda u: torch.tanh(u) + u**3 / 10)
        curv = DrawCurvature(d, d + 2, 2)
        curv.load(fit.state())
        curv.gains = lambda error, s: (True, False)  # type: ignore[method-assign]
        gm2, G2 = tril_with_draw(m, L, h, gL, u, curv)
        plain = torch.outer(h, eps) @ Linv
        dm += weight * (gm2 - h)
        dG += weight * (G2 - (0.5 * (plain + plain.T) - P))
    assert dm.abs().max() < 1e-12 and dG.abs().max() < 1e-12


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_only_a_full_covariance_draws_gradients_are_fitted(dtype):
    """``dl/dL = tril(h eps^T) - diag(1 / L_ii)`` is recognised; with an analytic KL's
    ``+ L`` it is not."""
    g = torch.Generator().manual_seed(5)
    m, L = _tril_point(3, g, dtype)
    eps = torch.randn(3, generator=g).to(dtype)
    u, h, gL = _tril_grads(m, L, eps, lambda u: 2.0 * u - 1.0)
    args = [t.double() for t in (m, L, h, gL, u)]
    assert tril_reparameterised(*args, dtype) is not None
    args[3] = (gL + L.tril()).double()
    assert tril_reparameterised(*args, dtype) is None
