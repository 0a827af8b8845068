"""Tests for the GPyTorch adapter (pyro_cvi.contrib.gpytorch)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

gpytorch = pytest.importorskip("gpytorch")

from pyro_cvi.contrib.gpytorch import (  # noqa: E402
    CVIOptimizer,
    CVIVariationalStrategy,
    LogisticBernoulliLikelihood,
    logistic_expected_log_prob,
    logistic_expected_prob,
)
from pyro_cvi.messages.quadrature import expected_log_prob  # noqa: E402

USPS_FULL_NELBO_SF2 = 126.70  # independent plain-torch CVI solution, log sf = 2, log l = 2.5


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Small dense problems run much faster on one thread (no OpenMP contention)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class GPModel(gpytorch.models.ApproximateGP):
    def __init__(self, strategy_fn, mean: str = "zero"):
        super().__init__(strategy_fn(self))
        if mean == "zero":
            self.mean_module = gpytorch.means.ZeroMean()
        else:
            self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def full_model(X, log_sf=0.0, log_l=0.0, dtype=torch.float64, **kw):
    m = GPModel(lambda s: CVIVariationalStrategy(s, X, X.shape[0]), **kw).to(dtype)
    set_hypers(m, log_sf, log_l)
    return m


def sparse_model(X, Z, log_sf=0.0, log_l=0.0, dtype=torch.float64, learn=False, **kw):
    m = GPModel(
        lambda s: CVIVariationalStrategy(
            s, Z, X.shape[0], learn_inducing_locations=learn, train_inputs=X
        ),
        **kw,
    ).to(dtype)
    set_hypers(m, log_sf, log_l)
    return m


def set_hypers(m, log_sf, log_l):
    m.covar_module.outputscale = math.exp(2 * log_sf)
    m.covar_module.base_kernel.lengthscale = math.exp(log_l)


def rbf(A, B, log_sf, log_l):
    return math.exp(2 * log_sf) * torch.exp(-(torch.cdist(A, B) ** 2) / (2 * math.exp(2 * log_l)))


def neg_elbo(model, likelihood, X, y):
    """-ELBO (sum over data) as gpytorch's VariationalELBO computes it."""
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=X.shape[0])
    model.train()
    with torch.no_grad():
        return -mll(model(X), y).item() * X.shape[0]


def toy_regression(n=60, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 1, generator=g, dtype=dtype) * 6 - 3
    y = torch.sin(2 * X[:, 0]) + 0.2 * torch.randn(n, generator=g, dtype=dtype)
    return X, y


def toy_classification(n=200, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 2, generator=g, dtype=dtype) * 4 - 2
    f = 2.0 * torch.sin(1.5 * X[:, 0]) + X[:, 1]
    y = (torch.rand(n, generator=g, dtype=dtype) < torch.sigmoid(3 * f)).to(dtype)
    return X, y


@pytest.fixture(scope="module")
def usps():
    from bench.datasets import load_usps_3vs5

    try:
        return load_usps_3vs5()
    except FileNotFoundError as e:  # pragma: no cover
        pytest.skip(f"USPS data not found: {e}")


# --------------------------------------------------------------------------- exactness
def test_gaussian_one_step_is_exact_gp_regression():
    X, y = toy_regression()
    Xs = torch.linspace(-4, 4, 25, dtype=X.dtype).unsqueeze(-1)
    log_sf, log_l, noise = 0.3, -0.4, 0.05
    model = full_model(X, log_sf, log_l, mean="constant")
    model.mean_module.constant.data.fill_(0.7)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    lik.noise = noise
    CVIOptimizer(model, lik, step_size=1.0).step(X, y)

    K = rbf(X, X, log_sf, log_l)
    Ks = rbf(Xs, X, log_sf, log_l)
    A = K + noise * torch.eye(len(X), dtype=X.dtype)
    mean_exact = 0.7 + Ks @ torch.linalg.solve(A, y - 0.7)
    cov_exact = rbf(Xs, Xs, log_sf, log_l) - Ks @ torch.linalg.solve(A, Ks.T)
    model.eval()
    with torch.no_grad():
        q = model(Xs)
        jitter = model.variational_strategy.jitter
        cov = q.covariance_matrix - jitter * torch.eye(len(Xs), dtype=X.dtype)
        torch.testing.assert_close(q.mean, mean_exact, atol=1e-6, rtol=0)
        torch.testing.assert_close(cov, cov_exact, atol=1e-6, rtol=0)
        # the training marginals too
        post_train = model(X)
        f_exact = 0.7 + K @ torch.linalg.solve(A, y - 0.7)
        torch.testing.assert_close(post_train.mean, f_exact, atol=1e-6, rtol=0)
        # the pseudo-observations are the data and the noise
        target, site_noise = model.variational_strategy.pseudo_observations()
        torch.testing.assert_close(target, y, atol=1e-8, rtol=0)
        torch.testing.assert_close(site_noise, torch.full_like(y, noise), atol=1e-8, rtol=1e-6)


def test_gaussian_sparse_step_is_titsias_sgpr():
    X, y = toy_regression(n=80)
    Z = torch.linspace(-3, 3, 12, dtype=X.dtype).unsqueeze(-1)
    log_sf, log_l, noise = 0.0, -0.3, 0.04
    model = sparse_model(X, Z, log_sf, log_l)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    lik.noise = noise
    CVIOptimizer(model, lik, step_size=1.0).step(X, y)
    # Optimal q(u) of Titsias (2009): S = Kzz (Kzz + Kzx Kxz / s2)^-1 Kzz, m = S Kzz^-1 Kzx y / s2
    jit = model.variational_strategy.jitter
    Kzz = rbf(Z, Z, log_sf, log_l) + jit * torch.eye(len(Z), dtype=X.dtype)
    Kzx = rbf(Z, X, log_sf, log_l)
    Sigma = Kzz + Kzx @ Kzx.T / noise
    S = Kzz @ torch.linalg.solve(Sigma, Kzz)
    m = Kzz @ torch.linalg.solve(Sigma, Kzx @ y) / noise
    q = model.variational_strategy.variational_distribution
    torch.testing.assert_close(q.mean, m, atol=1e-6, rtol=0)
    torch.testing.assert_close(
        q.covariance_matrix - jit * torch.eye(len(Z)).double(), S, atol=1e-6, rtol=0
    )


def test_sparse_with_all_inputs_equals_full():
    X, y = toy_classification(n=80)
    lik = LogisticBernoulliLikelihood().double()
    full = full_model(X, 0.5, -0.2)
    sparse = sparse_model(X, X.clone(), 0.5, -0.2)
    sparse.variational_strategy.jitter_val = 1e-10
    o1, o2 = CVIOptimizer(full, lik, 1.0), CVIOptimizer(sparse, lik, 1.0)
    for _ in range(15):
        l1, l2 = o1.step(X, y), o2.step(X, y)
    assert abs(l1.item() - l2.item()) < 1e-4
    assert abs(neg_elbo(full, lik, X, y) - neg_elbo(sparse, lik, X, y)) < 1e-4


@pytest.mark.parametrize("form", ["full", "sparse"])
def test_variational_elbo_matches_closed_form(form):
    """gpytorch's VariationalELBO with the strategy == closed-form KL + quadrature."""
    X, y = toy_classification(n=70)
    Z = X[::5].clone()
    model = full_model(X, 0.4, -0.1) if form == "full" else sparse_model(X, Z, 0.4, -0.1)
    lik = LogisticBernoulliLikelihood().double()
    opt = CVIOptimizer(model, lik, 0.7)
    for _ in range(4):
        opt.step(X, y)
    strategy = model.variational_strategy
    jit = strategy.jitter
    # Independent computation of q(f(X)) from the sites, with dense linear algebra.
    lam1, lam2 = strategy.site_lam1, strategy.site_lam2
    W = torch.diag(-2 * lam2)
    Kxx = rbf(X, X, 0.4, -0.1)
    if form == "full":
        Kinv = torch.linalg.inv(Kxx)
        V = torch.linalg.inv(Kinv + W)
        m = V @ lam1
        kl = 0.5 * (
            torch.trace(Kinv @ V) + m @ Kinv @ m - len(X) + torch.logdet(Kxx) - torch.logdet(V)
        )
        fm, fv = m, V.diagonal() + jit
    else:
        Kzz = rbf(Z, Z, 0.4, -0.1) + jit * torch.eye(len(Z), dtype=X.dtype)
        A = rbf(X, Z, 0.4, -0.1) @ torch.linalg.inv(Kzz)
        S = torch.linalg.inv(torch.linalg.inv(Kzz) + A.T @ W @ A)
        mu = S @ A.T @ lam1
        p_u = torch.distributions.MultivariateNormal(torch.zeros(len(Z), dtype=X.dtype), Kzz)
        q_u = torch.distributions.MultivariateNormal(mu, S)
        kl = torch.distributions.kl_divergence(q_u, p_u)
        fm = A @ mu
        fv = Kxx.diagonal() - (A * (Kzz @ A.T).T).sum(-1) + (A * (S @ A.T).T).sum(-1) + jit
    ell = logistic_expected_log_prob((2 * y - 1) * fm, fv).sum()
    expected = (kl - ell).item()
    assert abs(strategy.kl_divergence().item() - kl.item()) < 1e-6
    assert abs(neg_elbo(model, lik, X, y) - expected) < 1e-6
    # And the generic KL between the dense q(u) and p(u) agrees with the closed form.
    with torch.no_grad():
        q_u, p_u = strategy.variational_distribution, strategy.prior_distribution
        p_u = gpytorch.distributions.MultivariateNormal(
            p_u.mean, p_u.covariance_matrix + jit * torch.eye(p_u.mean.shape[-1]).double()
        )
        generic = torch.distributions.kl_divergence(q_u, p_u).item()
    assert abs(generic - kl.item()) < 1e-3


# ------------------------------------------------------------------------ likelihoods
@pytest.mark.parametrize("sd", [0.3, 1.0, 1.6, 3.0, 10.0, 60.0])
def test_logistic_expectations_are_accurate(sd):
    integrate = pytest.importorskip("scipy.integrate")
    means = [-40.0, -3.0, -0.5, 0.0, 0.7, 4.0, 200.0]

    def ref(fun, m):
        dens = lambda x: np.exp(-0.5 * ((x - m) / sd) ** 2) / (sd * np.sqrt(2 * np.pi))  # noqa: E731
        lo, hi = m - 40 * sd - 50, m + 40 * sd + 50
        pts = sorted({0.0, m})
        return integrate.quad(lambda x: fun(x) * dens(x), lo, hi, points=pts, limit=500)[0]

    logsig = lambda x: -np.logaddexp(0, -x)  # noqa: E731
    sig = lambda x: 0.5 * (1 + np.tanh(0.5 * x))  # noqa: E731
    m = torch.tensor(means, dtype=torch.float64)
    v = torch.full_like(m, sd * sd)
    got = logistic_expected_log_prob(m, v)
    want = torch.tensor([ref(logsig, mm) for mm in means], dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-9)
    gotp = logistic_expected_prob(m, v)
    wantp = torch.tensor([ref(sig, mm) for mm in means], dtype=torch.float64)
    torch.testing.assert_close(gotp, wantp, atol=1e-7, rtol=0)


def test_logistic_gradients_match_finite_differences():
    m = torch.tensor([-2.0, 0.3, 5.0, 40.0], dtype=torch.float64, requires_grad=True)
    v = torch.tensor([0.5, 4.0, 30.0, 2500.0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: logistic_expected_log_prob(a, b), (m, v))


def test_logistic_likelihood_agrees_with_gauss_hermite_when_narrow():
    lik = LogisticBernoulliLikelihood().double()
    mean = torch.tensor([-1.0, 0.2, 2.0], dtype=torch.float64)
    var = torch.tensor([0.3, 0.8, 1.2], dtype=torch.float64)
    y = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    dist = gpytorch.distributions.MultivariateNormal(mean, torch.diag(var))
    s = 2 * y - 1
    want = expected_log_prob(lambda e: -torch.nn.functional.softplus(-s * e), mean, var, 60)
    torch.testing.assert_close(lik.expected_log_prob(y, dist), want, atol=1e-9, rtol=0)


# ------------------------------------------------------------------------------ USPS
@pytest.mark.slow
@pytest.mark.data
def test_usps_full_logistic_matches_reference(usps):
    X, y = usps.X_train, usps.y_train
    model = full_model(X, 2.0, 2.5)
    lik = LogisticBernoulliLikelihood().double()
    opt = CVIOptimizer(model, lik, step_size=0.8)
    for _ in range(40):
        opt.step(X, y)
    value = neg_elbo(model, lik, X, y)
    assert abs(value - USPS_FULL_NELBO_SF2) < 0.05, value
    # predictions work as in any gpytorch model
    model.eval()
    with torch.no_grad():
        p = lik(model(usps.X_test)).probs
    acc = ((p > 0.5).double() == usps.y_test).double().mean().item()
    assert acc > 0.97


@pytest.mark.slow
@pytest.mark.data
def test_usps_probit_matches_gpytorch_ngd(usps):
    X, y = usps.X_train, usps.y_train
    lik = gpytorch.likelihoods.BernoulliLikelihood().double()
    model = full_model(X, 2.0, 2.5)
    opt = CVIOptimizer(model, lik, step_size=0.8)
    for _ in range(40):
        opt.step(X, y)
    cvi_value = neg_elbo(model, lik, X, y)

    ngd_model = _fit_ngd(X, X, y, lik, 35)
    ngd_value = neg_elbo(ngd_model, lik, X, y)
    assert abs(cvi_value - ngd_value) < 0.1, (cvi_value, ngd_value)


def _fit_ngd(Z, X, y, lik, iters):
    """GPyTorch's own NGD with a NaturalVariationalDistribution on inducing set Z (log sf 2)."""
    N = X.shape[0]
    ngd_model = GPModel(
        lambda s: gpytorch.variational.VariationalStrategy(
            s,
            Z,
            gpytorch.variational.NaturalVariationalDistribution(Z.shape[0]),
            learn_inducing_locations=False,
        )
    ).double()
    set_hypers(ngd_model, 2.0, 2.5)
    ngd = gpytorch.optim.NGD(ngd_model.variational_parameters(), num_data=N, lr=0.5)
    mll = gpytorch.mlls.VariationalELBO(lik, ngd_model, num_data=N)
    ngd_model.train()
    for _ in range(iters):
        ngd.zero_grad()
        (-mll(ngd_model(X), y)).backward()
        ngd.step()
    return ngd_model


@pytest.mark.slow
@pytest.mark.data
def test_usps_badly_conditioned_sf5(usps):
    X, y = usps.X_train, usps.y_train
    model = full_model(X, 5.0, 2.5)
    lik = LogisticBernoulliLikelihood().double()
    opt = CVIOptimizer(model, lik, step_size=1.0)
    hist = [opt.step(X, y).item() for _ in range(40)]
    assert all(math.isfinite(h) for h in hist)
    assert all(b <= a + 1e-6 * abs(a) for a, b in zip(hist, hist[1:])), (
        "backtracking keeps it monotone"
    )
    assert opt.num_backtracks >= 1
    value = neg_elbo(model, lik, X, y)
    assert math.isfinite(value) and value < 169.2, value
    assert torch.all(model.variational_strategy.site_lam2 <= 0)


@pytest.mark.slow
@pytest.mark.data
def test_usps_sparse_matches_gpytorch_ngd_with_same_inducing_points(usps):
    """The sparse form is exact for its family: same optimum as NGD with the same Z (M=100)."""
    X, y = usps.X_train, usps.y_train
    N = X.shape[0]
    Z = X[torch.randperm(N, generator=torch.Generator().manual_seed(0))[:100]].clone()
    lik = LogisticBernoulliLikelihood().double()
    model = sparse_model(X, Z, 2.0, 2.5)
    opt = CVIOptimizer(model, lik, step_size=0.8)
    for _ in range(40):
        opt.step(X, y)
    cvi_value = neg_elbo(model, lik, X, y)
    ngd_model = _fit_ngd(Z, X, y, lik, 60)
    ngd_value = neg_elbo(ngd_model, lik, X, y)
    assert abs(cvi_value - ngd_value) < 1e-3, (cvi_value, ngd_value)


# ----------------------------------------------------------------------------- sparse
def test_sparse_m100_within_two_percent_of_full():
    """On a smooth 2-D problem, M=100 inducing points are within 2% of the full GP."""
    X, y = toy_classification(n=600, seed=3)
    lik = LogisticBernoulliLikelihood().double()
    full = full_model(X, 1.0, 0.0)
    o = CVIOptimizer(full, lik, 0.8)
    for _ in range(30):
        o.step(X, y)
    g = torch.Generator().manual_seed(1)
    Z = X[torch.randperm(len(X), generator=g)[:100]].clone()
    sparse = sparse_model(X, Z, 1.0, 0.0)
    o = CVIOptimizer(sparse, lik, 0.8)
    for _ in range(30):
        o.step(X, y)
    f, s = neg_elbo(full, lik, X, y), neg_elbo(sparse, lik, X, y)
    assert s >= f - 1e-6
    assert (s - f) / f < 0.02, (f, s)


def test_sparse_minibatch_sites_converge_to_full_batch():
    X, y = toy_classification(n=300, seed=1)
    Z = X[:30].clone()
    lik = LogisticBernoulliLikelihood().double()
    ref = sparse_model(X, Z, 0.5, -0.3)
    o = CVIOptimizer(ref, lik, 0.8)
    for _ in range(30):
        o.step(X, y)
    target = neg_elbo(ref, lik, X, y)
    mb = sparse_model(X, Z, 0.5, -0.3)
    o = CVIOptimizer(mb, lik, 0.8)
    g = torch.Generator().manual_seed(0)
    for _epoch in range(15):
        for idx in torch.randperm(len(X), generator=g).split(50):
            o.step(X[idx], y[idx], indices=idx)
    assert abs(neg_elbo(mb, lik, X, y) - target) < 1e-3


def test_sparse_never_builds_an_n_by_n_matrix():
    """N = 40,000 with M = 20: an N x N float64 matrix would need 12.8 GB."""
    n = 40_000
    g = torch.Generator().manual_seed(0)
    X = torch.rand(n, 1, generator=g, dtype=torch.float64) * 10
    y = (torch.sin(X[:, 0]) > 0).double()
    Z = torch.linspace(0, 10, 20, dtype=torch.float64).unsqueeze(-1)
    model = sparse_model(X, Z, 0.5, 0.0)
    lik = LogisticBernoulliLikelihood().double()
    opt = CVIOptimizer(model, lik, 0.8)
    losses = [opt.step(X, y).item() for _ in range(3)]
    assert losses[-1] < losses[0]
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=n)
    loss = -mll(model(X), y)
    loss.backward()
    assert model.covar_module.raw_outputscale.grad is not None


def test_learned_inducing_locations_move_and_help():
    X, y = toy_classification(n=200, seed=2)
    Z = X[:10].clone()
    model = sparse_model(X, Z, 0.5, -0.3, learn=True)
    assert any(p is model.variational_strategy.inducing_points for p in model.parameters())
    lik = LogisticBernoulliLikelihood().double()
    cvi = CVIOptimizer(model, lik, 0.8)
    adam = torch.optim.Adam([model.variational_strategy.inducing_points], lr=0.05)
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(X))
    for _ in range(20):
        cvi.step(X, y)
    before = neg_elbo(model, lik, X, y)
    for _ in range(60):
        cvi.step(X, y)
        adam.zero_grad()
        (-mll(model(X), y)).backward()
        adam.step()
    for _ in range(10):
        cvi.step(X, y)
    assert not torch.allclose(model.variational_strategy.inducing_points, Z)
    assert neg_elbo(model, lik, X, y) < before - 1.0


# ----------------------------------------------------------- likelihoods and validity
@pytest.mark.parametrize(
    "name",
    ["probit", "logistic", "poisson", "gaussian"],
)
def test_log_concave_likelihoods_converge(name):
    X, yc = toy_classification(n=120)
    f = torch.sin(2 * X[:, 0])
    likelihoods = {
        "probit": (gpytorch.likelihoods.BernoulliLikelihood(), yc),
        "logistic": (LogisticBernoulliLikelihood(), yc),
        "poisson": (
            gpytorch.likelihoods.PoissonLikelihood(),
            torch.poisson(
                torch.nn.functional.softplus(2 * f), generator=torch.Generator().manual_seed(0)
            ),
        ),
        "gaussian": (gpytorch.likelihoods.GaussianLikelihood(), f + 0.1),
    }
    lik, y = likelihoods[name]
    lik = lik.double()
    model = full_model(X, 0.0, -0.5)
    opt = CVIOptimizer(model, lik, 1.0)
    hist = [opt.step(X, y).item() for _ in range(40)]
    assert all(math.isfinite(h) for h in hist)
    assert hist[-1] < hist[0]
    assert abs(hist[-1] - hist[-2]) < 1e-6 * max(1.0, abs(hist[-1]))
    assert opt.num_clipped == 0
    assert torch.all(model.variational_strategy.site_lam2 < 0)


def test_student_t_step_one_stays_finite_and_valid():
    X, _ = toy_regression(n=150, seed=1)
    g = torch.Generator().manual_seed(5)
    outlier = (torch.rand(150, generator=g) < 0.1).double()
    y = torch.sin(2 * X[:, 0]) + 0.1 * torch.randn(150, generator=g).double()
    y = y + outlier * 5 * torch.randn(150, generator=g).double()
    lik = gpytorch.likelihoods.StudentTLikelihood().double()
    lik.noise, lik.deg_free = 0.01, 3.0
    for backtrack in (False, True):
        model = full_model(X, 0.0, -0.5)
        opt = CVIOptimizer(model, lik, step_size=1.0, backtrack=backtrack)
        hist = [opt.step(X, y).item() for _ in range(500)]
        lam1, lam2 = model.variational_strategy.site_lam1, model.variational_strategy.site_lam2
        assert all(math.isfinite(h) for h in hist)
        assert torch.isfinite(lam1).all() and torch.all(lam2 <= 0)
        assert opt.num_clipped > 0
        model.eval()
        with torch.no_grad():
            assert torch.all(model(X).variance > 0)
    # with backtracking (the default) the StudentT fit converges, with the outliers clipped
    assert hist[-1] <= min(hist) + 1e-4
    assert 0 < opt.last_num_clipped < 40


def test_invalid_inputs_raise_clear_errors():
    X, y = toy_classification(n=50)
    lik = LogisticBernoulliLikelihood().double()
    model = full_model(X)
    opt = CVIOptimizer(model, lik)
    with pytest.raises(ValueError, match="indices"):
        opt.step(X[:10], y[:10])
    with pytest.raises(ValueError, match="do not match|does not match"):
        opt.step(X.flip(0), y)
    with pytest.raises(ValueError, match="cannot be"):
        GPModel(lambda s: CVIVariationalStrategy(s, X, 50, learn_inducing_locations=True))
    with pytest.raises(TypeError):
        CVIOptimizer(
            GPModel(
                lambda s: gpytorch.variational.VariationalStrategy(
                    s, X, gpytorch.variational.CholeskyVariationalDistribution(50)
                )
            ),
            lik,
        )
    with pytest.raises(ValueError):
        model.variational_strategy.set_sites(torch.zeros(50).double(), torch.ones(50).double())
    with pytest.raises(ValueError, match=r"targets y: nan at index \[0\] is not finite"):
        bad = y.clone()
        bad[0] = float("nan")
        opt.step(X, bad)
    assert torch.isfinite(model.variational_strategy.site_lam1).all()


# ------------------------------------------------------------------ hybrid + plumbing
def test_hybrid_training_improves_elbo_and_predicts():
    X, y = toy_classification(n=150)
    lik = LogisticBernoulliLikelihood().double()
    model = full_model(X, 0.0, 1.0)
    cvi = CVIOptimizer(model, lik, step_size=0.8)
    assert len(list(model.parameters())) == 2  # hyperparameters only; sites are buffers
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(X))
    for _ in range(20):
        cvi.step(X, y)
    fixed = neg_elbo(model, lik, X, y)
    for _ in range(60):
        cvi.step(X, y)
        adam.zero_grad()
        loss = -mll(model(X), y)
        loss.backward()
        adam.step()
    for _ in range(10):
        cvi.step(X, y)
    learned = neg_elbo(model, lik, X, y)
    assert learned < fixed - 1.0
    model.eval()
    lik.eval()
    with torch.no_grad():
        p = lik(model(X)).probs
    assert ((p > 0.5).double() == y).double().mean() > 0.85


def test_eval_cache_follows_hyperparameter_changes():
    X, y = toy_classification(n=60)
    lik = LogisticBernoulliLikelihood().double()
    model = full_model(X)
    opt = CVIOptimizer(model, lik, 0.8)
    for _ in range(5):
        opt.step(X, y)
    Xs = torch.randn(7, 2, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        before = model(Xs).mean
        model.covar_module.base_kernel.lengthscale = 3.0  # in place, while in eval mode
        after = model(Xs).mean
    assert not torch.allclose(before, after)
    model.train()
    with torch.no_grad():
        diag = model(X)
    model.eval()
    with torch.no_grad():
        full = model(X)
    torch.testing.assert_close(diag.mean, full.mean)
    torch.testing.assert_close(diag.variance, full.variance, atol=1e-8, rtol=1e-6)


def test_float32_and_state_dict_roundtrip():
    X, y = toy_classification(n=100, dtype=torch.float32)
    lik = LogisticBernoulliLikelihood()
    model = full_model(X, 0.5, -0.2, dtype=torch.float32)
    opt = CVIOptimizer(model, lik, 0.8)
    hist = [opt.step(X, y).item() for _ in range(20)]
    assert model.variational_strategy.site_lam1.dtype == torch.float32
    assert all(math.isfinite(h) for h in hist) and hist[-1] < hist[0]
    model64 = full_model(X.double(), 0.5, -0.2)
    model64.load_state_dict(model.state_dict())
    lik64 = LogisticBernoulliLikelihood().double()
    assert abs(neg_elbo(model64, lik64, X.double(), y.double()) - hist[-1]) < 0.5


def test_deepcopy_and_save_after_training():
    import copy
    import io

    X, y = toy_classification(n=50)
    lik = LogisticBernoulliLikelihood().double()
    model = full_model(X)
    CVIOptimizer(model, lik).step(X, y)
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(X))
    _ = -mll(model(X), y)  # leaves a cache with an autograd graph behind
    clone = copy.deepcopy(model)
    torch.save(model.state_dict(), io.BytesIO())
    torch.save(model, io.BytesIO())
    assert abs(neg_elbo(clone, lik, X, y) - neg_elbo(model, lik, X, y)) < 1e-10
