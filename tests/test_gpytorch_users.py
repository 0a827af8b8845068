"""What a GPyTorch user's code does with ``CVIVariationalStrategy`` swapped in: the objectives other
than the ELBO (the guarded backward step), labels, fantasy models, Pyro's integration and loading
state dicts saved with GPyTorch's own strategies."""

from __future__ import annotations

import math
import warnings

import gpytorch
import pyro
import pytest
import torch
from gpytorch.utils.warnings import OldVersionWarning

from pyro_cvi.contrib.gpytorch import (
    CVIOptimizer,
    CVIVariationalStrategy,
    LogisticBernoulliLikelihood,
)
from pyro_cvi.contrib.gpytorch.inducing import SiteMultivariateNormal, mean_param_targets
from pyro_cvi.contrib.gpytorch.state_convert import sites_from_whitened

DTYPES = [torch.float32, torch.float64]


def svgp(strategy_cls, Z, batch_shape=None, dist_cls=None, **kwargs):
    batch_shape = torch.Size([]) if batch_shape is None else batch_shape
    dist_cls = dist_cls or gpytorch.variational.CholeskyVariationalDistribution

    class SVGP(gpytorch.models.ApproximateGP):
        def __init__(self):
            dist = dist_cls(Z.shape[-2], batch_shape=batch_shape)
            super().__init__(strategy_cls(self, Z, dist, learn_inducing_locations=True, **kwargs))
            self.mean_module = gpytorch.means.ConstantMean(batch_shape=batch_shape)
            self.covar_module = gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.RBFKernel(batch_shape=batch_shape), batch_shape=batch_shape
            )

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(x), self.covar_module(x)
            )

    return SVGP().to(Z.dtype)


def regression(dtype, n=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.linspace(0, 1, n, dtype=dtype)
    y = torch.cos(2 * math.pi * x) + 0.1 * torch.randn(n, generator=g, dtype=dtype)
    return x, y


def gpytorch_loop(model, likelihood, mll_cls, x, y, iters, lr=0.01):
    """GPyTorch's example loop: Adam on everything the model and likelihood expose."""
    mll = mll_cls(likelihood, model, num_data=y.numel())
    opt = torch.optim.Adam(list(model.parameters()) + list(likelihood.parameters()), lr=lr)
    model.train()
    likelihood.train()
    losses = []
    for _ in range(iters):
        opt.zero_grad()
        loss = -mll(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------- the guarded backward step
@pytest.mark.parametrize("dtype", DTYPES)
def test_clipped_targets_keep_the_mean_fixed_point(dtype):
    """With curvature clipped (a positive eigenvalue of dF/dS), lam1 is formed from the clipped
    lam2, so the fixed point lam = t still has m_v = dF/dm_v (stationarity of F - KL in m)."""
    g = torch.Generator().manual_seed(1)
    M = 6
    A = torch.randn(M, M, generator=g, dtype=dtype)
    gS = 0.5 * (A + A.mT)  # indefinite: some curvature is clipped
    gm = torch.randn(M, generator=g, dtype=dtype)
    t1, t2, clipped = mean_param_targets(gm, gm, gS)
    assert clipped == 1
    assert torch.linalg.eigvalsh(t2).max() <= 1e-5
    B = torch.eye(M, dtype=dtype) - 2 * t2
    torch.testing.assert_close(torch.linalg.solve(B, t1), gm)


def _fit(strategy_cls, mll_cls, dtype, iters, classify=False, seed=0, **kwargs):
    x, y = regression(dtype, seed=seed)
    if classify:
        y = (torch.cos(4 * math.pi * x) > 0).to(dtype)
        likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    else:
        likelihood = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
    torch.manual_seed(seed)
    model = svgp(strategy_cls, torch.linspace(0, 1, 16, dtype=dtype).unsqueeze(-1), **kwargs)
    losses = gpytorch_loop(model, likelihood, mll_cls, x.unsqueeze(-1), y, iters)
    return model, likelihood, losses


CASES = [
    (gpytorch.mlls.PredictiveLogLikelihood, False),
    (gpytorch.mlls.PredictiveLogLikelihood, True),
    (gpytorch.mlls.GammaRobustVariationalELBO, False),  # (GPyTorch's: Gaussian likelihoods only)
]
CASE_IDS = ["pll-regression", "pll-classification", "gamma-robust-regression"]


@pytest.mark.parametrize("mll_cls, classify", CASES, ids=CASE_IDS)
def test_other_objectives_train_in_float32_without_diverging(mll_cls, classify):
    """GPyTorch's loop (Adam lr 0.01) in float32 with the strategy swapped: the step taken in
    ``loss.backward()`` diverged on PredictiveLogLikelihood (regression loss 5e23 then
    NotPositiveDefinite; classification 0.69 -> 256). Now: every loss finite, never far above
    the first, and the last well below it."""
    model, _, losses = _fit(CVIVariationalStrategy, mll_cls, torch.float32, 100, classify)
    assert all(math.isfinite(v) for v in losses)
    assert max(losses) < losses[0] + 1.0
    assert losses[-1] < losses[0] - 0.3
    s = model.variational_strategy
    assert torch.isfinite(s._variational_distribution.lam2).all()


@pytest.mark.slow
@pytest.mark.parametrize("mll_cls, classify", CASES, ids=CASE_IDS)
def test_other_objectives_2000_iterations_match_gpytorch(mll_cls, classify):
    """2,000 iterations of GPyTorch's loop in float32: no divergence, and the final objective no
    worse than with GPyTorch's own VariationalStrategy (the same loop, the same seed)."""
    _, _, ours = _fit(CVIVariationalStrategy, mll_cls, torch.float32, 2000, classify)
    _, _, theirs = _fit(
        gpytorch.variational.VariationalStrategy, mll_cls, torch.float32, 2000, classify
    )
    ours_end, theirs_end = sum(ours[-20:]) / 20, sum(theirs[-20:]) / 20
    print(f"{mll_cls.__name__} classify={classify}: -bound {ours_end:.4f} vs {theirs_end:.4f}")
    assert all(math.isfinite(v) for v in ours)
    assert ours_end <= theirs_end + 0.01


def test_an_overshooting_step_is_undone():
    """step_size 1 on PredictiveLogLikelihood overshoots; the secant test undoes such steps
    (counted), and the loss sequence stays bounded."""
    _, y = regression(torch.float64)
    model, _, losses = _fit(
        CVIVariationalStrategy,
        gpytorch.mlls.PredictiveLogLikelihood,
        torch.float64,
        30,
        step_size=1.0,
    )
    guard = model.variational_strategy.step_guard
    assert guard.num_backtracks >= 1
    assert all(math.isfinite(v) for v in losses) and max(losses) < losses[0] + 1.0


# ------------------------------------------------------------------------------- labels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "lik_cls", [gpytorch.likelihoods.BernoulliLikelihood, LogisticBernoulliLikelihood]
)
def test_labels_minus_one_one_are_read_as_zero_one_by_cvi_optimizer(dtype, lik_cls):
    x = torch.linspace(0, 1, 30, dtype=dtype).unsqueeze(-1)
    y01 = (x[:, 0] > 0.5).to(dtype)
    sites = []
    for y in (y01, 2 * y01 - 1):
        torch.manual_seed(0)
        model = svgp(CVIVariationalStrategy, x[::3].clone())
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # GPyTorch's -1 deprecation warning never reached
            CVIOptimizer(model, lik_cls().to(dtype)).step(x, y)
        sites.append(model.variational_strategy._variational_distribution.lam1.clone())
    torch.testing.assert_close(sites[0], sites[1])
    model = svgp(CVIVariationalStrategy, x[::3].clone())
    with pytest.raises(ValueError, match=r"CVIOptimizer.step: targets y: 2.0 at index \[15\]"):
        CVIOptimizer(model, lik_cls().to(dtype)).step(x, 2 * y01)
    with pytest.raises(ValueError, match=r"-1 at index \[15\] mixed with 0 labels"):
        CVIOptimizer(model, lik_cls().to(dtype)).step(x, torch.where(y01 > 0, -1.0, 0.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_logistic_likelihood_labels_in_the_backward_step(dtype):
    """The one-line swap's loop: the same loss (and so the same step) for {0,1} and {-1,1}; other
    labels raise naming the argument."""
    x = torch.linspace(0, 1, 30, dtype=dtype).unsqueeze(-1)
    y01 = (x[:, 0] > 0.5).to(dtype)
    lik = LogisticBernoulliLikelihood()
    torch.manual_seed(0)
    model = svgp(CVIVariationalStrategy, x[::3].clone())
    mll = gpytorch.mlls.VariationalELBO(lik, model, 30)
    model.train()
    a, b = (mll(model(x), y).item() for y in (y01, 2 * y01 - 1))
    assert a == pytest.approx(b, rel=1e-6)
    pll = gpytorch.mlls.PredictiveLogLikelihood(lik, model, 30)
    assert pll(model(x), y01).item() == pytest.approx(pll(model(x), 2 * y01 - 1).item(), rel=1e-6)
    with pytest.raises(ValueError, match=r"LogisticBernoulliLikelihood: observations: 3.0"):
        mll(model(x), 3 * y01)


# ------------------------------------------------------------------------------ fantasy
def _fitted_regression(dtype):
    x, y = regression(dtype, n=60)
    model = svgp(CVIVariationalStrategy, torch.linspace(0, 1, 10, dtype=dtype).unsqueeze(-1))
    lik = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
    model.covar_module.base_kernel.lengthscale = 0.2
    lik.noise = 0.1
    CVIOptimizer(model, lik, step_size=1.0).step(x.unsqueeze(-1), y)  # exact in one step
    model.eval()
    lik.eval()
    model.likelihood = lik
    return model, lik


@pytest.mark.parametrize("dtype", DTYPES)
def test_pseudo_points_reproduce_q_and_the_fantasy_model_conditions_on_them(dtype):
    """The sites as pseudo-observations (Sigma~, u~): an exact GP on them gives q(f) (dense
    conditioning here, independent of GPyTorch's code), and the fantasy model adds the new
    points to that exact GP as GPyTorch's own strategies do."""
    model, lik = _fitted_regression(dtype)
    s = model.variational_strategy
    Z = s.inducing_points
    xt = torch.linspace(-0.2, 1.2, 15, dtype=dtype).unsqueeze(-1)
    xn = torch.tensor([[0.25], [0.75]], dtype=dtype)
    yn = torch.tensor([1.5, -1.5], dtype=dtype)
    with torch.no_grad():
        cov_p, target = s.pseudo_points
        q = model(xt)
        K = model.covar_module(torch.cat([Z, xn, xt])).to_dense()
        m0 = model.mean_module(torch.cat([Z, xn, xt]))
    M = Z.shape[0]
    # (q(f) carries the jitter 1e-6 / 1e-4 on K_ZZ and on its variance)
    tol = dict(rtol=1e-3, atol=2e-3) if dtype == torch.float32 else dict(rtol=1e-5, atol=1e-5)

    def condition(idx, obs, noise):
        G = K[idx][:, idx] + noise
        rest = slice(M + 2, None)
        mean = m0[rest] + K[rest][:, idx] @ torch.linalg.solve(G, obs - m0[idx])
        var = K[rest, rest].diagonal() - (
            K[rest][:, idx] * torch.linalg.solve(G, K[idx][:, rest]).T
        ).sum(-1)
        return mean, var

    u_obs = m0[:M] + target.squeeze(-1)
    mean, var = condition(torch.arange(M), u_obs, cov_p)
    torch.testing.assert_close(mean, q.mean, **tol)
    torch.testing.assert_close(var, q.variance, **tol)

    fantasy = model.get_fantasy_model(xn, yn)
    fantasy.eval()
    with torch.no_grad():
        f = fantasy(xt)
    noise = torch.block_diag(cov_p, lik.noise.detach() * torch.eye(2, dtype=dtype))
    mean, _ = condition(torch.arange(M + 2), torch.cat([u_obs, yn]), noise)
    # GPyTorch's fantasy model (as for its own strategies) moves towards the new points
    near = (xt[:, 0] - 0.25).abs().argmin()
    assert f.mean[near] > q.mean[near] + 0.1
    assert torch.isfinite(f.variance).all()
    assert (f.mean - mean).abs().max() < 0.5


def test_fantasy_model_equals_gpytorchs_strategy_with_the_same_q():
    """GPyTorch's VariationalStrategy holding the same whitened q(v) gives the same fantasy
    model (float64; GPyTorch recovers the pseudo-observations by a regularised inversion)."""
    dtype = torch.float64
    model, lik = _fitted_regression(dtype)
    q = model.variational_strategy.whitened_q()
    ref = svgp(
        gpytorch.variational.VariationalStrategy,
        model.variational_strategy.inducing_points.detach().clone(),
    )
    ref.mean_module.load_state_dict(model.mean_module.state_dict())
    ref.covar_module.load_state_dict(model.covar_module.state_dict())
    d = ref.variational_strategy._variational_distribution
    with torch.no_grad():
        d.variational_mean.copy_(q.m_v)
        d.chol_variational_covar.copy_(torch.linalg.cholesky(q.S_v))
    ref.variational_strategy.variational_params_initialized.fill_(1)
    ref.eval()
    ref.likelihood = lik
    xt = torch.linspace(0, 1, 9, dtype=dtype).unsqueeze(-1)
    xn, yn = torch.tensor([[0.3]], dtype=dtype), torch.tensor([1.2], dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(model(xt).mean, ref(xt).mean, rtol=1e-5, atol=1e-5)
    a, b = model.get_fantasy_model(xn, yn), ref.get_fantasy_model(xn, yn)
    a.eval()
    b.eval()
    with torch.no_grad():
        torch.testing.assert_close(a(xt).mean, b(xt).mean, rtol=1e-3, atol=1e-3)


def test_fantasy_errors_say_what_to_do():
    model, lik = _fitted_regression(torch.float64)
    model.likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    x = torch.zeros(1, 1, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="set model.likelihood to the model's Gaussian"):
        model.get_fantasy_model(x, x[:, 0])


# --------------------------------------------------------------------------------- Pyro
def test_expand_keeps_the_sites_kl_and_the_prior_has_qs_batch_shape():
    torch.manual_seed(0)
    Z = torch.linspace(0, 1, 5, dtype=torch.float64).unsqueeze(-1)
    model = svgp(CVIVariationalStrategy, Z, batch_shape=torch.Size([2]))
    model.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    s = model.variational_strategy
    s(Z)
    q, p = s.variational_distribution, s.prior_distribution
    assert isinstance(q, SiteMultivariateNormal)
    assert p.batch_shape == q.batch_shape == torch.Size([2])
    e = q.expand(torch.Size([3, 2]))
    assert e.batch_shape == torch.Size([3, 2])
    kl = torch.distributions.kl_divergence(e, p.expand(torch.Size([3, 2])))
    torch.testing.assert_close(kl, q.site_kl.expand(3, 2))
    # and the sites' KL is the closed form of q(v) against N(0, I)
    w = s.whitened_q()
    dense = torch.distributions.MultivariateNormal
    eye = torch.eye(5, dtype=torch.float64)
    closed = torch.distributions.kl_divergence(dense(w.m_v, w.S_v), dense(0 * w.m_v, eye))
    torch.testing.assert_close(q.site_kl, closed)


def test_pyro_svi_with_gpytorchs_pyro_gp_trains_q():
    """GPyTorch's PyroGP (pyro_model / pyro_guide) with TraceMeanField_ELBO and vectorised
    particles: q is stepped from the KL's probe and the data term's gradient."""
    pyro.clear_param_store()
    torch.manual_seed(0)
    x = torch.linspace(0, 1, 50)
    y = torch.sin(2 * math.pi * x) + 0.05 * torch.randn(50)

    class Model(gpytorch.models.pyro.PyroGP):
        def __init__(self):
            Z = torch.linspace(0, 1, 12).unsqueeze(-1)
            dist = gpytorch.variational.CholeskyVariationalDistribution(12)
            lik = gpytorch.likelihoods.GaussianLikelihood()
            super().__init__(
                CVIVariationalStrategy(self, Z, dist), lik, num_data=50, name_prefix="t"
            )
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(x), self.covar_module(x)
            )

    model = Model()
    model.train()
    elbo = pyro.infer.TraceMeanField_ELBO(
        num_particles=8, vectorize_particles=True, retain_graph=True
    )
    svi = pyro.infer.SVI(model.model, model.guide, pyro.optim.Adam({"lr": 0.02}), elbo)
    losses = [svi.step(x, y) for _ in range(40)]
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 10
    model.eval()
    with torch.no_grad():
        err = (model(x).mean - torch.sin(2 * math.pi * x)).abs().mean()
    assert err < 0.3


# ------------------------------------------------------------------- GPyTorch state dicts
@pytest.mark.parametrize("dtype", DTYPES)
def test_sites_from_whitened_q_give_back_q(dtype):
    g = torch.Generator().manual_seed(0)
    M = 5
    A = torch.randn(M, M, generator=g, dtype=dtype)
    S = torch.linalg.inv(torch.eye(M, dtype=dtype) + A @ A.mT)  # S <= I: exact
    m = torch.randn(M, generator=g, dtype=dtype)
    lam1, lam2, clipped = sites_from_whitened(m, S)
    assert clipped == 0
    B = torch.eye(M, dtype=dtype) - 2 * lam2
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else {}
    torch.testing.assert_close(torch.linalg.inv(B), S, **tol)
    torch.testing.assert_close(torch.linalg.solve(B, lam1), m, **tol)


@pytest.mark.parametrize(
    "source",
    [gpytorch.variational.VariationalStrategy, gpytorch.variational.UnwhitenedVariationalStrategy],
    ids=["whitened", "unwhitened"],
)
def test_loading_a_state_dict_saved_with_gpytorchs_strategy(source):
    """The hyperparameters and q(u) carry over (the unwhitened form says it was converted): the
    same predictive mean, and the same covariance except where q(v) was wider than the prior
    (no sites represent that; those directions get the prior's variance, never more)."""
    dtype = torch.float64
    x, y = regression(dtype, n=60)
    Z = torch.linspace(0, 1, 8, dtype=dtype).unsqueeze(-1)
    torch.manual_seed(0)
    ref = svgp(source, Z.clone())
    ref.covar_module.base_kernel.lengthscale = 0.15  # K_ZZ well conditioned: whitening is exact
    ref.covar_module.base_kernel.raw_lengthscale.requires_grad_(False)
    lik = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
    gpytorch_loop(ref, lik, gpytorch.mlls.VariationalELBO, x.unsqueeze(-1), y, 60, lr=0.05)
    ours = svgp(CVIVariationalStrategy, Z.clone())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours.load_state_dict(ref.state_dict())
        ours.variational_strategy.whitened_q()  # converts the unwhitened form
    unwhitened = source is gpytorch.variational.UnwhitenedVariationalStrategy
    assert any(issubclass(w.category, OldVersionWarning) for w in caught) == unwhitened
    torch.testing.assert_close(ours.covar_module.outputscale, ref.covar_module.outputscale.detach())
    ref.eval()
    ours.eval()
    xt = torch.linspace(-0.1, 1.1, 25, dtype=dtype).unsqueeze(-1)
    with torch.no_grad():
        a, b = ref(xt), ours(xt)
    torch.testing.assert_close(b.mean, a.mean, rtol=1e-6, atol=1e-6)
    # covariance: exact where q(v) is no wider than the prior; clipping only narrows it
    assert bool((b.variance <= a.variance + 1e-6).all())
    whitened = ref.variational_strategy._variational_distribution.chol_variational_covar.tril()
    if not unwhitened and torch.linalg.eigvalsh(whitened @ whitened.mT).max() <= 1:
        torch.testing.assert_close(b.variance, a.variance, rtol=1e-6, atol=1e-6)


def test_loading_a_point_estimate_refuses_clearly():
    Z = torch.linspace(0, 1, 4).unsqueeze(-1)
    ref = svgp(
        gpytorch.variational.VariationalStrategy,
        Z.clone(),
        dist_cls=gpytorch.variational.DeltaVariationalDistribution,
    )
    ours = svgp(CVIVariationalStrategy, Z.clone())
    with pytest.raises(ValueError, match="a point estimate has no CVI sites"):
        ours.load_state_dict(ref.state_dict())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("elbo_cls", [pyro.infer.Trace_ELBO, pyro.infer.TraceMeanField_ELBO])
def test_pyro_elbos_step_q_to_the_exact_sparse_posterior(elbo_cls, dtype):
    """GPyTorch's PyroGP under Pyro's SVI, hyperparameters fixed, Gaussian likelihood: q(u)
    goes to the optimal sparse q(u) (closed form) with Trace_ELBO's Monte Carlo KL as with
    TraceMeanField_ELBO's closed form (the probe is in ``log q(u)`` too, and q(u)'s mean and
    covariance carry no gradient of their own), within the Monte Carlo noise of the data term."""
    from gpytorch_user_changes import optimal_q

    pyro.clear_param_store()
    torch.manual_seed(0)
    x = torch.linspace(0, 1, 50, dtype=dtype)
    y = torch.sin(2 * math.pi * x) + 0.1 * torch.randn(50, dtype=dtype)

    class Model(gpytorch.models.pyro.PyroGP):
        def __init__(self):
            Z = torch.linspace(0, 1, 12, dtype=dtype).unsqueeze(-1)
            dist = gpytorch.variational.CholeskyVariationalDistribution(12)
            lik = gpytorch.likelihoods.GaussianLikelihood()
            super().__init__(
                CVIVariationalStrategy(self, Z, dist, lengthscale_search=False),
                lik,
                num_data=50,
                name_prefix="t",
            )
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
            self.covar_module.base_kernel.lengthscale = 0.2
            lik.noise = 0.05

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(x), self.covar_module(x)
            )

    model = Model().to(dtype)
    model.train()
    exact_mean, _ = optimal_q(model, x.unsqueeze(-1), y, 0.05)
    elbo = elbo_cls(num_particles=16, vectorize_particles=True, retain_graph=True)
    # lr 0: the hyperparameters stay where they are (they are Pyro params all the same)
    svi = pyro.infer.SVI(model.model, model.guide, pyro.optim.Adam({"lr": 0.0}), elbo)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "no KL term": q not stepped
        for _ in range(40):
            svi.step(x.unsqueeze(-1), y)
    with torch.no_grad():
        mean = model.variational_strategy.variational_distribution.mean.double()
    assert float((mean - exact_mean).abs().max()) < 0.1
    assert float(exact_mean.abs().max()) > 0.8  # q(u) moved from its start at the prior
