"""CVIVariationalStrategy built the GPyTorch way: GPyTorch's own VariationalTestCase, the CVI step
from the ELBO's backward pass (exact against the collapsed SGPR bound), batches of GPs, GPyTorch's
multitask wrappers with CVIOptimizer, state_dict and fast_pred_var."""

import math
import unittest
import warnings

import gpytorch
import pytest
import torch
from gpytorch.test.variational_test_case import VariationalTestCase

from pyro_cvi.contrib.gpytorch import CVIOptimizer, CVIVariationalStrategy

DTYPES = [torch.float32, torch.float64]


# ------------------------------------------------------------------ GPyTorch's own harness
class TestCVIVariationalELBO(VariationalTestCase, unittest.TestCase):
    batch_shape = torch.Size([])
    distribution_cls = gpytorch.variational.CholeskyVariationalDistribution  # batch shape only
    mll_cls = gpytorch.mlls.VariationalELBO
    strategy_cls = CVIVariationalStrategy

    def test_forward_train_eval(self):
        model, _ = self._make_model_and_likelihood(
            num_inducing=5, strategy_cls=self.strategy_cls, distribution_cls=self.distribution_cls
        )
        x = torch.randn(6, 2)
        model.train()
        a = model(x)
        model.eval()
        b = model(x)
        self.assertAllClose(a.mean, b.mean)
        self.assertAllClose(a.variance, b.variance)

    # (GPyTorch's own test_fantasy_call runs as written: fantasy models from the sites)


class TestCVIPredictiveLogLikelihood(TestCVIVariationalELBO):
    mll_cls = gpytorch.mlls.PredictiveLogLikelihood


class TestCVIGammaRobustELBO(TestCVIVariationalELBO):
    mll_cls = gpytorch.mlls.GammaRobustVariationalELBO


# ------------------------------------------------------------------ helpers
class SVGP(gpytorch.models.ApproximateGP):
    def __init__(self, Z, batch_shape=(), wrap=None, **kw):
        batch_shape = torch.Size(batch_shape)
        dist = gpytorch.variational.CholeskyVariationalDistribution(
            Z.shape[-2], batch_shape=batch_shape
        )
        strategy = CVIVariationalStrategy(self, Z, dist, **kw)
        super().__init__(strategy if wrap is None else wrap(strategy))
        self.mean_module = gpytorch.means.ConstantMean(batch_shape=batch_shape)
        self.covar_module = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(batch_shape=batch_shape), batch_shape=batch_shape
        )
        self.mean_module.initialize(constant=0.3)
        self.covar_module.base_kernel.lengthscale = 0.4

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def titsias_bound(model, Z, X, y, noise):
    """The collapsed SGPR bound (Titsias 2009), computed independently in float64, with the
    strategy's jitter (added to K_ZZ and to every predictive variance)."""
    with torch.no_grad():
        K = model.covar_module
        jitter = model.variational_strategy.jitter
        Kzz = K(Z.double()).to_dense() + jitter * torch.eye(len(Z))
        Kzx = K(Z.double(), X.double()).to_dense()
        kxx = K(X.double(), diag=True)
        m0 = model.mean_module(X.double())
        Q = Kzx.mT @ torch.linalg.solve(Kzz, Kzx)
        cov = Q + noise * torch.eye(len(X), dtype=Q.dtype)
        log_marg = torch.distributions.MultivariateNormal(m0, cov).log_prob(y.double())
        return float(log_marg - ((kxx - Q.diagonal()).sum() + len(X) * jitter) / (2 * noise))


def regression_data(n=40, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    X = torch.rand(n, 1, generator=g, dtype=dtype) * 3
    y = torch.sin(2 * X[:, 0]) + 0.2 * torch.randn(n, generator=g, dtype=dtype)
    return X, y


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_step_is_exact_for_a_gaussian_likelihood(dtype):
    """The GPyTorch loop's backward pass with step_size=1: one step gives the optimal q(u), so the
    ELBO equals the collapsed bound; the sites are buffers (Adam only sees hyperparameters)."""
    X, y = regression_data(dtype=dtype)
    Z = X[::4].clone()
    model = SVGP(Z, learn_inducing_locations=False, step_size=1.0).to(dtype)
    lik = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
    lik.noise = 0.05
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(X))
    model.train()
    names = {n for n, _ in model.named_parameters()}
    assert not any("lam" in n for n in names)
    (-mll(model(X), y)).backward()  # the CVI step happens here
    elbo = float(mll(model(X), y).detach()) * len(X)
    expected = titsias_bound(model, Z, X, y, float(lik.noise))
    tol = 1e-6 * abs(expected) if dtype == torch.float64 else 2e-2 * abs(expected)
    assert elbo == pytest.approx(expected, abs=tol)
    assert model.variational_strategy.variational_params_initialized.item() == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_cvi_optimizer_on_the_inducing_form_is_exact_and_matches_the_backward_step(dtype):
    X, y = regression_data(dtype=dtype)
    Z = X[::4].clone()
    out = []
    for use_opt in (False, True):
        torch.manual_seed(1)
        model = SVGP(Z, learn_inducing_locations=False, step_size=1.0).to(dtype)
        lik = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
        lik.noise = 0.05
        mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(X))
        model.train()
        if use_opt:
            opt = CVIOptimizer(model, lik, step_size=1.0)
            with torch.no_grad():
                before = -float(mll(model(X), y)) * len(X)
            assert float(opt.step(X, y)) == pytest.approx(before, rel=1e-5)  # -ELBO before
        else:
            (-mll(model(X), y)).backward()
        with torch.no_grad():
            out.append(float(mll(model(X), y)) * len(X))
    tol = 1e-8 if dtype == torch.float64 else 1e-2
    assert out[0] == pytest.approx(out[1], rel=tol)


def test_backward_steps_reach_gpytorchs_optimum_for_a_bernoulli_likelihood():
    """Fixed hyperparameters: the tutorial's loss.backward() trains q to (below) the -ELBO that
    GPyTorch's VariationalStrategy reaches with 1,500 Adam steps on its variational parameters."""
    torch.manual_seed(0)
    X = torch.linspace(0, 1, 60, dtype=torch.float64)
    y = torch.sign(torch.cos(X * 4 * math.pi)).add(1).div(2)
    Z = X[::3].unsqueeze(-1).clone()
    lik = gpytorch.likelihoods.BernoulliLikelihood()

    def build(cls):
        m = SVGP.__new__(SVGP)
        gpytorch.models.ApproximateGP.__init__(
            m,
            cls(m, Z, gpytorch.variational.CholeskyVariationalDistribution(20), False),
        )
        m.mean_module = gpytorch.means.ConstantMean()
        m.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        m.covar_module.base_kernel.lengthscale = 0.1
        m.covar_module.outputscale = 4.0
        return m.double()

    ref = build(gpytorch.variational.VariationalStrategy)
    mll = gpytorch.mlls.VariationalELBO(lik, ref, 60)
    adam = torch.optim.Adam(ref.variational_strategy._variational_distribution.parameters(), 0.05)
    for _ in range(1500):
        adam.zero_grad()
        loss = -mll(ref(X), y)
        loss.backward()
        adam.step()
    ref_loss = float(loss) * 60
    model = build(CVIVariationalStrategy)
    mll = gpytorch.mlls.VariationalELBO(lik, model, 60)
    for _ in range(30):
        loss = -mll(model(X), y)
        loss.backward()
    cvi_loss = float(-mll(model(X), y)) * 60
    assert cvi_loss <= ref_loss + 1e-6
    assert cvi_loss == pytest.approx(ref_loss, abs=0.05)


def test_a_loss_without_kl_warns_and_leaves_q():
    X, y = regression_data(dtype=torch.float64)
    model = SVGP(X[::4].clone()).double()
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    model.train()
    model(X)
    before = model.variational_strategy.site_lam1.clone()
    with pytest.warns(RuntimeWarning, match="no KL term"):
        lik.expected_log_prob(y, model(X)).sum().neg().backward()
    assert torch.equal(before, model.variational_strategy.site_lam1)


# ------------------------------------------------------------------ batches and wrappers
def test_a_batch_of_two_gps_trains_with_cvi_optimizer():
    X, y = regression_data(dtype=torch.float64)
    Xb = torch.stack([X, X + 0.1])
    yb = torch.stack([y, -y])
    Z = X[::4].clone()
    model = SVGP(
        Z.expand(2, -1, -1).clone(), batch_shape=torch.Size([2]), learn_inducing_locations=False
    ).double()
    lik = gpytorch.likelihoods.GaussianLikelihood(batch_shape=torch.Size([2])).double()
    lik.noise = 0.05
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(X))
    model.train()
    opt = CVIOptimizer(model, lik, step_size=1.0)
    opt.step(Xb, yb)
    with torch.no_grad():
        elbo = mll(model(Xb), yb) * len(X)
    assert elbo.shape == (2,)
    for b in range(2):
        single = SVGP(Z).double()
        single.mean_module.constant.data.copy_(model.mean_module.constant[b])
        single.covar_module.outputscale = model.covar_module.outputscale[b]
        single.covar_module.base_kernel.lengthscale = model.covar_module.base_kernel.lengthscale[b]
        expected = titsias_bound(single, Z, Xb[b], yb[b], 0.05)
        assert float(elbo[b]) == pytest.approx(expected, rel=1e-6)


def _multitask_model(wrap, num_latents):
    X, y = regression_data(dtype=torch.float64)
    Z = X[::4].clone().expand(num_latents, -1, -1).clone()
    model = SVGP(
        Z, batch_shape=torch.Size([num_latents]), wrap=wrap, learn_inducing_locations=False
    ).double()
    Y = torch.stack([y, 0.5 * y, torch.cos(X[:, 0])], -1)
    return model, X, Y


def test_independent_multitask_with_three_tasks_is_exact_with_cvi_optimizer():
    wrap = lambda s: gpytorch.variational.IndependentMultitaskVariationalStrategy(s, num_tasks=3)  # noqa: E731
    model, X, Y = _multitask_model(wrap, 3)
    lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(
        num_tasks=3, rank=0, has_global_noise=False
    ).double()
    lik.task_noises = torch.tensor([0.05, 0.1, 0.2], dtype=torch.float64)
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(X))
    model.train()
    opt = CVIOptimizer(model, lik, step_size=1.0)
    opt.step(X, Y)
    with torch.no_grad():
        elbo = float(mll(model(X), Y)) * len(X)
    expected = 0.0
    for t in range(3):
        single = SVGP(X[::4].clone()).double()
        single.mean_module.constant.data.copy_(model.mean_module.constant[t])
        single.covar_module.outputscale = model.covar_module.outputscale[t]
        single.covar_module.base_kernel.lengthscale = model.covar_module.base_kernel.lengthscale[t]
        expected += titsias_bound(single, X[::4], X, Y[:, t], float(lik.task_noises[t]))
    assert elbo == pytest.approx(expected, rel=1e-6)


def test_lmc_wrapper_trains_with_cvi_optimizer_and_hyperparameters():
    wrap = lambda s: gpytorch.variational.LMCVariationalStrategy(  # noqa: E731
        s, num_tasks=3, num_latents=2, latent_dim=-1
    )
    model, X, Y = _multitask_model(wrap, 2)
    lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=3).double()
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(X))
    model.train()
    opt = CVIOptimizer(model, lik)
    adam = torch.optim.Adam(list(model.parameters()) + list(lik.parameters()), lr=0.05)
    losses = []
    for _ in range(30):
        losses.append(float(opt.step(X, Y)))
        adam.zero_grad()
        (-mll(model(X), Y)).backward()
        adam.step()
    assert losses[-1] < losses[0] - 0.2 * abs(losses[0])
    assert all(math.isfinite(v) for v in losses)


# ------------------------------------------------------------------ state, caches, errors
def test_state_dict_round_trip_and_fast_pred_var():
    X, y = regression_data(dtype=torch.float64)
    model = SVGP(X[::4].clone(), step_size=1.0).double()
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(X))
    model.train()
    (-mll(model(X), y)).backward()
    fresh = SVGP(torch.zeros_like(X[::4])).double()
    fresh.load_state_dict(model.state_dict())
    model.eval()
    fresh.eval()
    xs = torch.linspace(0, 3, 17, dtype=torch.float64).unsqueeze(-1)
    with torch.no_grad():
        a = model(xs)
        b = fresh(xs)
        with gpytorch.settings.fast_pred_var():
            c = fresh(xs)
    torch.testing.assert_close(a.mean, b.mean)
    torch.testing.assert_close(a.variance, b.variance)
    torch.testing.assert_close(c.mean, a.mean)
    torch.testing.assert_close(c.variance, a.variance)


def test_data_site_state_dict_loads_into_a_model_built_without_train_inputs():
    X, y = regression_data(dtype=torch.float64)
    Z = X[::4].clone()

    class Sparse(SVGP):
        def __init__(self, train_inputs=None):
            gpytorch.models.ApproximateGP.__init__(
                self, CVIVariationalStrategy(self, Z, len(X), train_inputs=train_inputs)
            )
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    model = Sparse(X).double()
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    CVIOptimizer(model, lik, step_size=1.0).step(X, y)
    fresh = Sparse().double()
    fresh.load_state_dict(model.state_dict())
    model.eval()
    fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(X[:5]).mean, model(X[:5]).mean)


def test_constructor_argument_checks_and_legacy_signature():
    X, _ = regression_data(dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        legacy = SVGP.__new__(SVGP)
        gpytorch.models.ApproximateGP.__init__(legacy, CVIVariationalStrategy(legacy, X, len(X)))
    s = legacy.variational_strategy
    assert not s.inducing_form and s.num_data == len(X) and s.is_full
    assert SVGP(X[::4].clone()).variational_strategy.inducing_form
    wrong = gpytorch.variational.CholeskyVariationalDistribution(3)
    with pytest.raises(ValueError, match="3 inducing points"):
        m = SVGP.__new__(SVGP)
        gpytorch.models.ApproximateGP.__init__(m, CVIVariationalStrategy(m, X[::4], wrong))
    with pytest.raises(TypeError, match="_VariationalDistribution"):
        m = SVGP.__new__(SVGP)
        gpytorch.models.ApproximateGP.__init__(m, CVIVariationalStrategy(m, X[::4], "cholesky"))


def test_tutorial_loop_equals_gpytorch_ngd_on_whitened_natural_parameters():
    """The tutorial loop (Adam on model.parameters(), -VariationalELBO) with the adapter swapped
    in is GPyTorch's NGD (lr = step_size) on NaturalVariationalDistribution + VariationalStrategy
    with the same Adam: CVI in whitened coordinates is that natural-gradient step (eq. 13). (The
    first step's lengthscale search, which NGD does not have, is off here.)"""
    X = torch.linspace(0, 1, 30, dtype=torch.float64)
    y = torch.sign(torch.cos(X * 4 * math.pi)).add(1).div(2)
    lik = gpytorch.likelihoods.BernoulliLikelihood()
    out = []
    for cvi in (True, False):
        torch.manual_seed(0)
        m = SVGP.__new__(SVGP)
        if cvi:
            strategy = CVIVariationalStrategy(
                m, X.unsqueeze(-1), None, False, step_size=0.5, lengthscale_search=False
            )
        else:
            dist = gpytorch.variational.NaturalVariationalDistribution(30)
            strategy = gpytorch.variational.VariationalStrategy(m, X.unsqueeze(-1), dist, False)
        gpytorch.models.ApproximateGP.__init__(m, strategy)
        m.mean_module = gpytorch.means.ConstantMean()
        m.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        m = m.double()
        hyper = [p for n, p in m.named_parameters() if "variational" not in n]
        adam = torch.optim.Adam(hyper, lr=0.1)
        ngd = None
        if not cvi:
            ngd = gpytorch.optim.NGD(m.variational_strategy.parameters(), num_data=30, lr=0.5)
        mll = gpytorch.mlls.VariationalELBO(lik, m, 30)
        m.train()
        for _ in range(15):
            adam.zero_grad()
            if ngd is not None:
                ngd.zero_grad()
            loss = -mll(m(X), y)
            loss.backward()
            adam.step()
            if ngd is not None:
                ngd.step()
        out.append((float(loss), [p.detach().clone() for p in hyper]))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-6)
    for a, b in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_multiclass_variational_distribution_is_a_distribution_with_the_sites_kl():
    from pyro_cvi.contrib.gpytorch import (
        CategoricalLogitsLikelihood,
        MultiClassCVIOptimizer,
        MultiClassCVIStrategy,
    )

    K, N, M = 3, 25, 8
    g = torch.Generator().manual_seed(0)
    X = torch.rand(N, 1, generator=g, dtype=torch.float64) * 4 - 2
    y = torch.distributions.Categorical(logits=torch.cat([2 * X, -X, X**2], -1)).sample()

    class GP(gpytorch.models.ApproximateGP):
        def __init__(self):
            super().__init__(MultiClassCVIStrategy(self, X[:M].clone(), N, K, train_inputs=X))
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(x), self.covar_module(x)
            )

    model = GP().double()
    lik = CategoricalLogitsLikelihood(K)
    opt = MultiClassCVIOptimizer(model, lik, 1.0, method="cubature", adaptive=False)
    for _ in range(5):
        opt.step(X, y)
    s = model.variational_strategy
    q = s.variational_distribution
    assert isinstance(q, torch.distributions.Distribution)
    assert q.mean.shape == (M, K)
    # KL[q(u) || p(u)] from the distribution (dense, class-major) equals the sites' closed form
    with torch.no_grad():
        p = s.prior_distribution
        Kzz = torch.block_diag(*p.covariance_matrix.expand(K, M, M))
        q_flat = torch.distributions.MultivariateNormal(q.mean.mT.reshape(-1), q.covariance_matrix)
        p_flat = torch.distributions.MultivariateNormal(p.mean.expand(K, M).reshape(-1), Kzz)
        dense = torch.distributions.kl_divergence(q_flat, p_flat)
        # (the jitter 1e-6 on q's covariance is the only difference)
        assert float(dense) == pytest.approx(float(s.kl_divergence()), rel=1e-4)
    model(X[:3])
    assert s.variational_params_initialized.item() == 1


def test_data_site_form_without_cvi_optimizer_warns_once():
    X, y = regression_data(dtype=torch.float64)
    m = SVGP.__new__(SVGP)
    gpytorch.models.ApproximateGP.__init__(m, CVIVariationalStrategy(m, X, len(X)))
    m.mean_module = gpytorch.means.ZeroMean()
    m.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    m = m.double()
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    mll = gpytorch.mlls.VariationalELBO(lik, m, num_data=len(X))
    m.train()
    with pytest.warns(RuntimeWarning, match="Add CVIOptimizer") as record:
        for _ in range(3):
            (-mll(m(X), y)).backward()
    assert sum("CVIOptimizer" in str(w.message) for w in record) == 1
    m2 = SVGP.__new__(SVGP)
    gpytorch.models.ApproximateGP.__init__(m2, CVIVariationalStrategy(m2, X, len(X)))
    m2.mean_module, m2.covar_module = m.mean_module, m.covar_module
    m2 = m2.double()
    CVIOptimizer(m2, lik)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        m2.train()
        m2(X)


@pytest.mark.parametrize("dtype", DTYPES)
def test_minibatch_running_sums_equal_a_full_recomputation(dtype):
    """Sparse data-site form: minibatch steps update sum_n phi_n W_n phi_n^T and sum_n phi_n r_n
    by the batch's rows (O(B M^2)); the q they give equals q rebuilt from all N sites."""
    g = torch.Generator().manual_seed(0)
    N, M, B = 300, 15, 32
    X = torch.rand(N, 1, generator=g, dtype=dtype) * 4
    y = (torch.sin(2 * X[:, 0]) + 0.3 * torch.randn(N, generator=g, dtype=dtype) > 0).to(dtype)
    Z = X[:M].clone()

    class Sparse(SVGP):
        def __init__(self):
            gpytorch.models.ApproximateGP.__init__(
                self, CVIVariationalStrategy(self, Z, N, train_inputs=X)
            )
            self.mean_module = gpytorch.means.ConstantMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    model = Sparse().to(dtype)
    lik = gpytorch.likelihoods.BernoulliLikelihood()
    opt = CVIOptimizer(model, lik, step_size=0.5)
    s = model.variational_strategy
    for _ in range(20):
        idx = torch.randperm(N, generator=g)[:B]
        opt.step(X[idx], y[idx], indices=idx)
    sums = s._prior_cache[1]["sums"]
    assert sums.updates > 0  # the running sums were used
    with torch.no_grad():
        m_run, v_run = s.site_marginals()
        kl_run = s.kl_divergence()
    model.load_state_dict(model.state_dict())  # drops every cache: q from all N sites
    with torch.no_grad():
        m_full, v_full = s.site_marginals()
        kl_full = s.kl_divergence()
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(m_run, m_full, **tol)
    torch.testing.assert_close(v_run, v_full, **tol)
    torch.testing.assert_close(kl_run, kl_full, **tol)


def test_inducing_form_minibatches_need_num_data():
    X, y = regression_data(dtype=torch.float64)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    model = SVGP(X[::4].clone()).double()
    with pytest.raises(ValueError, match="num_data=N"):
        CVIOptimizer(model, lik).step(X[:8], y[:8], indices=torch.arange(8))
    opt = CVIOptimizer(model, lik)
    opt.step(X, y)
    with pytest.raises(ValueError, match="num_data=N"):
        opt.step(X[:8], y[:8])
    # with num_data, a minibatch step's -ELBO is the unbiased N/B estimate: all batches averaged
    # over a partition of the data give the full-batch value
    opt = CVIOptimizer(model, lik, num_data=len(X), backtrack=False)
    with torch.no_grad():
        full = -float(gpytorch.mlls.VariationalELBO(lik, model, len(X))(model(X), y)) * len(X)
    s = model.variational_strategy
    before = (s.site_lam1.clone(), s.site_lam2.clone())
    parts = []
    for idx in torch.arange(len(X)).chunk(4):
        s.set_sites(*before)
        parts.append(float(opt.step(X[idx], y[idx], indices=idx)))
    assert sum(parts) / 4 == pytest.approx(full, rel=1e-9)
