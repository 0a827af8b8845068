"""Tests of the reference computations in ``bench.baselines`` against independent answers."""

from __future__ import annotations

import math

import pytest
import torch
from bench.baselines import (
    HistoryPoint,
    gaussian_kl_to_isotropic_prior,
    logreg_log_loss_bits,
    logreg_neg_elbo,
    make_logreg_model,
    plain_cvi_logreg,
    pyro_adam_logreg,
    time_to_target,
)
from bench.datasets import load_breast_cancer_sklearn

torch.set_num_threads(1)  # the problems are small; avoid contention on shared CI cores


def _random_problem(N: int, D: int, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, D, generator=g, dtype=dtype)
    X[:, 0] = 1.0
    w_true = torch.randn(D, generator=g, dtype=dtype)
    y = torch.bernoulli(torch.sigmoid(X @ w_true), generator=g)
    m = 0.5 * torch.randn(D, generator=g, dtype=dtype)
    A = torch.randn(D, D, generator=g, dtype=dtype)
    V = 0.3 * A @ A.T / D + 0.05 * torch.eye(D, dtype=dtype)
    return X, y, m, V


def _log_lik(X, y, w):
    eta = w @ X.T
    return (y * eta - torch.nn.functional.softplus(eta)).sum(-1)


@pytest.fixture(scope="module")
def bc():
    return load_breast_cancer_sklearn()


@pytest.fixture(scope="module")
def bc_fit(bc):
    return plain_cvi_logreg(bc.X_train, bc.y_train, bc.prior_precision, 0.4 / 1.4, 150)


# ------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------


def test_kl_closed_form_matches_torch():
    _, _, m, V = _random_problem(5, 4)
    delta = 2.5
    q = torch.distributions.MultivariateNormal(m, V)
    p = torch.distributions.MultivariateNormal(torch.zeros(4, dtype=m.dtype), torch.eye(4) / delta)
    expected = torch.distributions.kl_divergence(q, p)
    assert gaussian_kl_to_isotropic_prior(m, V, delta).item() == pytest.approx(expected.item())
    # diagonal covariance given as a vector
    v = torch.diagonal(V).clone()
    qd = torch.distributions.MultivariateNormal(m, torch.diag(v))
    expected = torch.distributions.kl_divergence(qd, p)
    assert gaussian_kl_to_isotropic_prior(m, v, delta).item() == pytest.approx(expected.item())


def test_neg_elbo_matches_grid_integral_2d():
    X, y, m, V = _random_problem(6, 2, seed=1)
    delta = 0.7
    L = torch.linalg.cholesky(V)
    # w = m + L z with z on a fine grid: E_q[g(w)] = int phi(z1) phi(z2) g(m + L z) dz
    z = torch.linspace(-9.0, 9.0, 1201, dtype=X.dtype)
    h = z[1] - z[0]
    Z = torch.stack(torch.meshgrid(z, z, indexing="ij"), -1).reshape(-1, 2)
    w = m + Z @ L.T
    weight = torch.exp(-0.5 * (Z * Z).sum(-1)) / (2 * math.pi) * h * h
    log_q = torch.distributions.MultivariateNormal(m, V).log_prob(w)
    log_prior = (
        torch.distributions.Normal(0.0, torch.tensor(delta, dtype=X.dtype).rsqrt())
        .log_prob(w)
        .sum(-1)
    )
    grid = (weight * (log_q - log_prior - _log_lik(X, y, w))).sum()
    quad = logreg_neg_elbo(X, y, m, V, delta)
    assert abs(weight.sum().item() - 1.0) < 1e-12
    assert quad.item() == pytest.approx(grid.item(), abs=1e-8)


def test_neg_elbo_accepts_cholesky_and_diagonal():
    X, y, m, V = _random_problem(20, 4, seed=5)
    L = torch.linalg.cholesky(V)
    full = logreg_neg_elbo(X, y, m, V, 0.9).item()
    assert logreg_neg_elbo(X, y, m, None, 0.9, scale_tril=L).item() == pytest.approx(full)
    ll = logreg_log_loss_bits(X, y, m, V)
    assert logreg_log_loss_bits(X, y, m, None, scale_tril=L) == pytest.approx(ll)
    v = torch.diagonal(V).clone()
    diag = logreg_neg_elbo(X, y, m, torch.diag(v), 0.9).item()
    assert logreg_neg_elbo(X, y, m, v, 0.9).item() == pytest.approx(diag)
    with pytest.raises(ValueError):
        logreg_neg_elbo(X, y, m, None, 0.9)


def test_neg_elbo_matches_monte_carlo():
    X, y, m, V = _random_problem(40, 5, seed=2)
    delta = 1.3
    q = torch.distributions.MultivariateNormal(m, V)
    prior = torch.distributions.Normal(0.0, torch.tensor(delta, dtype=X.dtype).rsqrt())
    torch.manual_seed(0)
    w = q.sample((200_000,))
    terms = q.log_prob(w) - prior.log_prob(w).sum(-1) - _log_lik(X, y, w)
    mc, se = terms.mean().item(), terms.std().item() / math.sqrt(terms.numel())
    quad = logreg_neg_elbo(X, y, m, V, delta).item()
    assert abs(quad - mc) < 5 * se + 1e-6, (quad, mc, se)


def test_log_loss_bits():
    X, y, m, V = _random_problem(30, 4, seed=3)
    # a point mass: the plain logistic log-loss
    p = torch.sigmoid(X @ m)
    plain = -(y * torch.log2(p) + (1 - y) * torch.log2(1 - p)).mean().item()
    tiny = 1e-14 * torch.eye(4, dtype=X.dtype)
    assert logreg_log_loss_bits(X, y, m, tiny) == pytest.approx(plain, rel=1e-10)
    # a broad q: p = E_q[sigmoid(eta)] by Monte Carlo
    torch.manual_seed(1)
    w = torch.distributions.MultivariateNormal(m, V).sample((400_000,))
    p_mc = torch.sigmoid(w @ X.T).mean(0)
    mc = -(y * torch.log2(p_mc) + (1 - y) * torch.log2(1 - p_mc)).mean().item()
    assert logreg_log_loss_bits(X, y, m, V) == pytest.approx(mc, abs=2e-3)
    # predictions never round to 0 or 1
    huge = logreg_log_loss_bits(X, 1 - y, 1e4 * m, tiny)
    assert math.isfinite(huge) and huge > 10


# ------------------------------------------------------------------------------------------
# Plain CVI
# ------------------------------------------------------------------------------------------


def _lbfgs_optimum(X, y, delta, iters=200):
    D = X.shape[1]
    m = torch.zeros(D, dtype=X.dtype, requires_grad=True)
    raw = torch.zeros(D, D, dtype=X.dtype)
    raw.diagonal().fill_(math.log(0.5))
    raw.requires_grad_(True)
    opt = torch.optim.LBFGS(
        [m, raw],
        lr=1.0,
        max_iter=iters,
        tolerance_grad=1e-12,
        tolerance_change=1e-15,
        history_size=50,
        line_search_fn="strong_wolfe",
    )

    def cov():
        L = torch.tril(raw, -1) + torch.diag(raw.diagonal().exp())
        return L @ L.T

    def closure():
        opt.zero_grad()
        loss = logreg_neg_elbo(X, y, m, cov(), delta)
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    with torch.no_grad():
        return m.detach(), cov(), logreg_neg_elbo(X, y, m, cov(), delta).item()


def test_plain_cvi_matches_lbfgs_optimum(bc):
    X, y = bc.X_train[:, :3], bc.y_train  # bias and two features: D = 3
    m_ref, V_ref, f_ref = _lbfgs_optimum(X, y, bc.prior_precision)
    fit = plain_cvi_logreg(X, y, bc.prior_precision, step_size=0.5, num_iters=200, tol=1e-12)
    m, V, hist = fit
    assert hist[-1].neg_elbo == pytest.approx(f_ref, abs=1e-4)
    assert logreg_neg_elbo(X, y, m, V, bc.prior_precision).item() == pytest.approx(f_ref, abs=1e-4)
    assert f_ref <= hist[-1].neg_elbo + 1e-6  # L-BFGS found the optimum, CVI got there
    torch.testing.assert_close(m, m_ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(V, V_ref, atol=1e-4, rtol=0)


def test_plain_cvi_is_a_stationary_point(bc, bc_fit):
    """At the fixed point of CVI the gradient of the exact -ELBO vanishes (eqs. 12-13)."""
    X, y, delta = bc.X_train, bc.y_train, bc.prior_precision
    m = bc_fit.loc.clone().requires_grad_(True)
    V = bc_fit.covariance.clone().requires_grad_(True)
    f = logreg_neg_elbo(X, y, m, V, delta)
    gm, gV = torch.autograd.grad(f, (m, V))
    assert gm.abs().max().item() < 1e-6
    assert gV.abs().max().item() < 1e-6
    # history: starts at the prior, the last value is the exact -ELBO of the returned q
    hist = bc_fit.history
    assert hist[0].iteration == 0 and hist[-1].iteration == 150
    assert hist[0].neg_elbo > hist[-1].neg_elbo
    assert hist[-1].neg_elbo == pytest.approx(f.item(), abs=1e-9)
    assert all(b.seconds >= a.seconds for a, b in zip(hist, hist[1:]))
    # the sites of a log-concave likelihood have negative precision parameters
    assert (bc_fit.extra["lam2"] < 0).all()


def test_primal_and_dual_agree(bc):
    X, y, delta = bc.X_train, bc.y_train, bc.prior_precision
    p = plain_cvi_logreg(X, y, delta, 0.3, 40, form="primal")
    d = plain_cvi_logreg(X, y, delta, 0.3, 40, form="dual")
    assert p.extra["form"] == "primal" and d.extra["form"] == "dual"
    torch.testing.assert_close(p.loc, d.loc, atol=1e-8, rtol=0)
    torch.testing.assert_close(p.covariance, d.covariance, atol=1e-8, rtol=0)
    for a, b in zip(p.history, d.history):
        assert a.neg_elbo == pytest.approx(b.neg_elbo, abs=1e-8)


def test_auto_form_and_dual_when_wide():
    X, y, _, _ = _random_problem(12, 40, seed=4)
    fit = plain_cvi_logreg(X, y, 2.0, 0.5, 300)
    assert fit.extra["form"] == "dual"
    primal = plain_cvi_logreg(X, y, 2.0, 0.5, 300, form="primal")
    torch.testing.assert_close(fit.loc, primal.loc, atol=1e-8, rtol=0)
    torch.testing.assert_close(fit.covariance, primal.covariance, atol=1e-8, rtol=0)
    m = fit.loc.clone().requires_grad_(True)
    (gm,) = torch.autograd.grad(logreg_neg_elbo(X, y, m, fit.covariance, 2.0), m)
    assert gm.abs().max().item() < 1e-6


def test_plain_cvi_options(bc):
    X, y, delta = bc.X_train, bc.y_train, bc.prior_precision
    # a callable step size, a callback that stops early, and no covariance
    seen = []

    def callback(t, point):
        seen.append(t)
        return t == 5

    fit = plain_cvi_logreg(
        X, y, delta, lambda t: 1.0 / (t + 1), 100, callback=callback, return_covariance=False
    )
    assert seen == [0, 1, 2, 3, 4, 5] and fit.num_iters == 5 and fit.covariance.numel() == 0
    # tol stops the loop once the -ELBO settles
    fit = plain_cvi_logreg(X, y, delta, 0.5, 500, tol=1e-6)
    assert fit.num_iters < 500
    assert abs(fit.history[-1].neg_elbo - fit.history[-2].neg_elbo) < 1e-6
    with pytest.raises(ValueError):
        plain_cvi_logreg(X, y, delta, 0.5, 1, form="cholesky")


def test_plain_cvi_monte_carlo_gradients(bc, bc_fit):
    """The paper's stochastic CVI (10 samples per data point) gets close to the optimum."""
    X, y, delta = bc.X_train, bc.y_train, bc.prior_precision
    torch.manual_seed(0)
    fit = plain_cvi_logreg(X, y, delta, 0.3 / 1.3, 100, num_samples=10)
    best = bc_fit.history[-1].neg_elbo
    assert best - 1e-6 <= fit.history[-1].neg_elbo < best + 0.5


def test_plain_cvi_follows_dtype(bc):
    X, y = bc.X_train.float(), bc.y_train.float()
    fit = plain_cvi_logreg(X, y, bc.prior_precision, 0.5, 30)
    assert fit.loc.dtype == torch.float32 and fit.covariance.dtype == torch.float32
    ref = plain_cvi_logreg(bc.X_train, bc.y_train, bc.prior_precision, 0.5, 30)
    torch.testing.assert_close(fit.loc.double(), ref.loc, atol=1e-3, rtol=1e-3)


# ------------------------------------------------------------------------------------------
# Pyro Adam baseline and timing helpers
# ------------------------------------------------------------------------------------------


def test_pyro_adam_baseline(bc, bc_fit):
    X, y, delta = bc.X_train, bc.y_train, bc.prior_precision
    model = make_logreg_model(delta)
    fit = pyro_adam_logreg(
        model, X, y, lr=0.05, num_iters=400, prior_precision=delta, checkpoint_every=50
    )
    its = [p.iteration for p in fit.history]
    assert its == list(range(0, 401, 50))
    assert all(b.seconds >= a.seconds for a, b in zip(fit.history, fit.history[1:]))
    best = bc_fit.history[-1].neg_elbo
    assert fit.history[-1].neg_elbo < fit.history[0].neg_elbo
    assert best - 1e-6 <= fit.history[-1].neg_elbo < best + 25.0
    assert fit.loc.shape == (31,) and fit.covariance.shape == (31, 31)
    assert len(fit.extra["losses"]) == 400
    # a time limit stops it early
    short = pyro_adam_logreg(model, X, y, 0.05, 10_000, time_limit=0.05, checkpoint_every=5)
    assert short.num_iters < 10_000
    assert math.isnan(short.history[0].neg_elbo)  # Monte Carlo losses when no delta is given


def test_time_to_target():
    hist = [HistoryPoint(0, 0.0, 100.0), HistoryPoint(5, 0.1, 10.4), HistoryPoint(9, 0.3, 10.0)]
    assert time_to_target(hist, 10.0) == (5, 0.1)
    assert time_to_target(hist, 10.0, tol=0.1) == (9, 0.3)
    assert time_to_target(hist, 5.0) is None


# ------------------------------------------------------------------------------------------
# Cross-check of the Pyro API against the plain loop
# ------------------------------------------------------------------------------------------


def _api():
    try:
        from pyro_cvi import CVI, CVI_ELBO, AutoCVI
    except ImportError as e:  # the core API is developed alongside
        pytest.skip(f"pyro_cvi API not importable: {e}")
    return AutoCVI, CVI, CVI_ELBO


def test_pyro_api_follows_plain_cvi_iterates(bc):
    """From q = prior, AutoCVI + CVI + CVI_ELBO and the plain loop take the same steps."""
    import inspect

    import pyro
    from pyro.infer import SVI

    AutoCVI, CVI, CVI_ELBO = _api()
    if "init_sites" not in inspect.signature(AutoCVI.__init__).parameters:
        pytest.skip("AutoCVI has no init_sites option")
    X, y, delta = bc.X_train, bc.y_train, bc.prior_precision
    model = make_logreg_model(delta)
    pyro.clear_param_store()
    guide = AutoCVI(model, init_sites="prior")
    svi = SVI(model, guide, CVI(step_size=0.3), loss=CVI_ELBO())
    losses = [svi.step(X, y) for _ in range(10)]
    fit = plain_cvi_logreg(X, y, delta, 0.3, 10, num_points=guide.num_quad_points)
    # svi.step returns the -ELBO of q before the step: the plain history at t = 0..9
    for loss, point in zip(losses, fit.history):
        assert loss == pytest.approx(point.neg_elbo, abs=1e-9)
    q = guide.posterior("w")
    torch.testing.assert_close(q.loc, fit.loc, atol=1e-10, rtol=0)
    torch.testing.assert_close(q.covariance_matrix, fit.covariance, atol=1e-10, rtol=0)


def test_pyro_api_converges_to_plain_cvi_optimum(bc, bc_fit):
    import pyro
    from pyro.infer import SVI

    AutoCVI, CVI, CVI_ELBO = _api()
    X, y, delta = bc.X_train, bc.y_train, bc.prior_precision
    model = make_logreg_model(delta)
    pyro.clear_param_store()
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=0.4 / 1.4), loss=CVI_ELBO())
    for _ in range(120):
        svi.step(X, y)
    q = guide.posterior("w")
    neg_elbo = logreg_neg_elbo(X, y, q.loc.detach(), q.covariance_matrix.detach(), delta).item()
    assert neg_elbo == pytest.approx(bc_fit.history[-1].neg_elbo, abs=1e-4)
    assert logreg_log_loss_bits(
        bc.X_test, bc.y_test, q.loc.detach(), q.covariance_matrix.detach()
    ) == pytest.approx(bc_fit.log_loss_bits(bc.X_test, bc.y_test), abs=1e-4)


# ------------------------------------------------------------------------------------------
# The paper's a1a experiment
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.data
def test_plain_cvi_a1a():
    from bench.datasets import load_logreg

    try:
        d = load_logreg("a1a")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    fit = plain_cvi_logreg(d.X_train, d.y_train, d.prior_precision, 0.4 / 1.4, 200, tol=1e-4)
    m, V, hist = fit
    neg_elbo = logreg_neg_elbo(d.X_train, d.y_train, m, V, d.prior_precision).item()
    log_loss = logreg_log_loss_bits(d.X_test, d.y_test, m, V)
    assert neg_elbo == pytest.approx(hist[-1].neg_elbo, abs=1e-8)
    assert neg_elbo <= 592.2  # converged: 591.7
    assert log_loss <= 0.495  # converged: 0.489
    assert time_to_target(hist, 591.7) is not None
