"""Multi-class GP classification with coupled K x K CVI sites (contrib.gpytorch.multiclass)."""

import gpytorch
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.contrib.gpytorch import (
    CategoricalLogitsLikelihood,
    MultiClassCVIOptimizer,
    MultiClassCVIStrategy,
)
from pyro_cvi.messages.softmax import lse_expectations

F64 = torch.float64
K = 3


def _data(N=25, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(N, 1, generator=g, dtype=F64) * 4 - 2
    F = torch.cat([torch.sin(2 * X), X, -X], -1) * 2
    y = torch.distributions.Categorical(logits=F).sample()
    return X, y


class GP(gpytorch.models.ApproximateGP):
    def __init__(self, Z, N, train_inputs=None, batch=False, learn=False):
        strategy = MultiClassCVIStrategy(
            self, Z, N, K, learn, train_inputs=train_inputs, jitter_val=1e-8
        )
        super().__init__(strategy)
        shape = torch.Size([K]) if batch else torch.Size([])
        self.mean_module = gpytorch.means.ZeroMean(batch_shape=shape)
        self.covar_module = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(batch_shape=shape), batch_shape=shape
        )

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _cvi(model, X, y, steps=15, beta=1.0, lik=None):
    # the deterministic cubature and a fixed step: the exactness tests compare fixed points
    lik = lik or CategoricalLogitsLikelihood(K)
    opt = MultiClassCVIOptimizer(model, lik, beta, method="cubature", adaptive=False)
    losses = [float(opt.step(X, y)) for _ in range(steps)]
    return opt, losses


def test_full_gp_equals_the_pyro_softmax_sites():
    # the same model through two independent code paths: the Pyro guide's block (rotated
    # K-variate rows, primal solve) and the whitened K M x K M form of the adapter
    X, y = _data()
    N = X.shape[0]
    model = GP(X, N)
    _, losses = _cvi(model, X, y)
    with torch.no_grad():
        Kxx = model.covar_module(X).to_dense() + 1e-8 * torch.eye(N, dtype=F64)

    def pyro_model(y):
        fs = [
            pyro.sample(f"f{k}", dist.MultivariateNormal(X.new_zeros(N), covariance_matrix=Kxx))
            for k in range(K)
        ]
        with pyro.plate("data", N):
            pyro.sample("y", dist.Categorical(logits=torch.stack(fs, -1)), obs=y)

    pyro.clear_param_store()
    guide = AutoCVI(pyro_model)
    svi = SVI(pyro_model, guide, CVI(1.0), loss=CVI_ELBO())
    pl = [svi.step(y) for _ in range(15)]
    assert abs(losses[-1] - pl[-1]) < 1e-6 * abs(pl[-1])
    assert abs(losses[-1] - losses[-2]) < 1e-8  # converged


def test_sparse_with_inducing_points_at_the_data_equals_full_and_reports_the_elbo():
    X, y = _data()
    N = X.shape[0]
    full, sparse = GP(X, N), GP(X.clone(), N, train_inputs=X)
    _, lf = _cvi(full, X, y)
    _, ls = _cvi(sparse, X, y)
    assert abs(lf[-1] - ls[-1]) < 1e-8
    # the optimizer's -ELBO is VariationalELBO's (cubature likelihood) at the same q
    lik = CategoricalLogitsLikelihood(K)
    mll = gpytorch.mlls.VariationalELBO(lik, sparse, num_data=N)
    sparse.train()
    with torch.no_grad():
        assert abs(-float(mll(sparse(X), y)) * N - lf[-1]) < 1e-6


def test_q_is_the_optimum_of_the_cubature_elbo():
    # at the fixed point no Gaussian q(u) does better: perturbing the sites (hence q) along
    # random directions can only increase the -ELBO (a stationary point, to second order)
    X, y = _data(N=15)
    N = X.shape[0]
    model = GP(X[::3].clone(), N, train_inputs=X)
    opt, losses = _cvi(model, X, y, steps=25)
    s = model.variational_strategy
    lam1, lam2 = s.site_lam1.clone(), s.site_lam2.clone()
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        d1 = 1e-3 * torch.randn(lam1.shape, generator=g, dtype=F64)
        s.set_sites(lam1 + d1, lam2)
        up = float(opt.step(X, y))
        s.set_sites(lam1, lam2)
        assert up >= losses[-1] - 1e-9


@pytest.mark.parametrize("beta", [0.05, 0.3, 0.7, 1.0])
def test_every_step_size_is_valid(beta):
    X, y = _data(N=40, seed=1)
    model = GP(X[::4].clone(), 40, train_inputs=X, batch=True)
    with torch.no_grad():
        model.covar_module.outputscale = torch.full((K,), 20.0, dtype=F64)  # large variances
    opt, losses = _cvi(model, X, y, steps=10, beta=beta)
    assert all(torch.isfinite(torch.tensor(losses)))
    ev = torch.linalg.eigvalsh(model.variational_strategy.site_lam2)
    assert float(ev.max()) <= 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("likelihood", ["softmax", "categorical"])
def test_hybrid_learning_and_prediction(likelihood):
    X, y = _data(N=60, seed=2)
    N = X.shape[0]
    Z = torch.linspace(-2, 2, 8, dtype=F64).unsqueeze(-1).expand(K, 8, 1).clone()
    model = GP(Z, N, train_inputs=X, batch=True, learn=True)  # per-class inducing points
    if likelihood == "softmax":
        lik = gpytorch.likelihoods.SoftmaxLikelihood(num_classes=K, mixing_weights=False)
    else:
        lik = CategoricalLogitsLikelihood(K)
    cvi = MultiClassCVIOptimizer(model, lik, 1.0)
    adam = torch.optim.Adam(model.parameters(), lr=0.05)
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=N)
    model.train()
    first = None
    for _ in range(40):
        loss = float(cvi.step(X, y))
        first = first if first is not None else loss
        adam.zero_grad()
        (-mll(model(X), y)).backward()
        adam.step()
    assert loss < first - 5  # hyperparameters (and inducing points) learned
    model.eval()
    lik.eval()
    with torch.no_grad():
        pred = lik(model(X))
        probs = pred.probs.mean(0) if pred.probs.dim() == 3 else pred.probs
        f = model(X)
    assert probs.shape == (N, K)
    assert torch.allclose(probs.sum(-1), torch.ones(N, dtype=F64))
    acc = float((probs.argmax(-1) == y).to(F64).mean())
    assert acc > 0.75
    # the cubature likelihood's prediction is E[softmax(f)] under the coupled marginals
    if likelihood == "categorical":
        mean, cov = f.mean, f.lazy_covariance_matrix.base_linear_op.to_dense()
        assert torch.allclose(probs, lse_expectations(mean, cov).grad)


def _digits_gp(N=120, M=20):
    # digits, K = 10, outputscale 10: latent variances ~5-8, where beta = 1 overshoots
    from sklearn.datasets import load_digits

    Xn, yn = load_digits(return_X_y=True)
    X, y = torch.tensor(Xn[:N] / 16.0, dtype=F64), torch.tensor(yn[:N])

    class DigitsGP(gpytorch.models.ApproximateGP):
        def __init__(self):
            super().__init__(MultiClassCVIStrategy(self, X[:M].clone(), N, 10, train_inputs=X))
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
            self.covar_module.base_kernel.lengthscale = 2.0
            self.covar_module.outputscale = 10.0

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(x), self.covar_module(x)
            )

    return DigitsGP, X, y


def test_step_one_is_guarded_and_converges():
    pytest.importorskip("sklearn")
    DigitsGP, X, y = _digits_gp()
    lik = CategoricalLogitsLikelihood(10)

    def run(steps, **kw):
        opt = MultiClassCVIOptimizer(DigitsGP(), lik, method="cubature", **kw)
        return opt, [float(opt.step(X, y)) for _ in range(steps)]

    _, slow = run(35, step_size=0.4, adaptive=False)  # the converged value (186.93)
    assert abs(slow[-1] - slow[-2]) < 1e-4
    # the undamped iteration with a full first step from the prior: a 2-cycle
    _, wild = run(15, step_size=1.0, adaptive=False, first_step_size=None)
    assert min(wild[-4:]) > 10 * slow[-1]
    # the same with the default first step (0.3 from the prior) converges here
    _, tame = run(15, step_size=1.0, adaptive=False)
    assert abs(tame[-1] - slow[-1]) < 1e-2
    # a full first step as in the unguarded runs (with the default first step of 0.3 the guard
    # stops 0.08 nat below the iteration's fixed point: the cubature's E[H] is not the
    # S-derivative of its value, so its -ELBO is not minimal at that fixed point)
    opt, guarded = run(12, step_size=1.0, first_step_size=None)
    assert all(torch.isfinite(torch.tensor(guarded)))
    assert all(b <= a + 1e-9 * abs(a) for a, b in zip(guarded, guarded[1:]))  # monotone
    # the cubature's E[H] is not exactly the S-derivative of its value: the monotone guard may
    # stop a little below the fixed point of the iteration (measured: 2e-3 nat)
    assert abs(guarded[-1] - slow[-1]) < 1e-2
    assert opt.num_backtracks >= 1
    # the default estimator (Monte Carlo, common random numbers) at step 1.0, guarded, too
    opt = MultiClassCVIOptimizer(DigitsGP(), lik, step_size=1.0)
    losses = [float(opt.step(X, y)) for _ in range(12)]
    assert all(b <= a + 1e-9 * abs(a) for a, b in zip(losses, losses[1:]))
    assert abs(losses[-1] - losses[-2]) < 1e-2


def _brute_force_fixed_point(model, X, y, steps=20, beta=0.7, P=14):
    """CVI with the moments of a P^3-point tensor-product Gauss-Hermite rule (the reference)."""
    from test_softmax import brute_lse

    from pyro_cvi.messages.softmax import LSEMoments, site_targets

    s = model.variational_strategy
    Y = torch.nn.functional.one_hot(y, K).to(F64)
    ones = torch.ones(y.shape[0], dtype=F64)
    for _ in range(steps):
        m, S = s.site_marginals()
        _, lam1, lam2 = site_targets(Y, ones, ones, m, LSEMoments(*brute_lse(m, S, P)))
        s.set_sites(
            s.site_lam1 + beta * (lam1 - s.site_lam1), s.site_lam2 + beta * (lam2 - s.site_lam2)
        )


def _brute_force_neg_elbo(model, y, P=14):
    from test_softmax import brute_lse

    s = model.variational_strategy
    m, S = s.site_marginals()
    value = brute_lse(m, S, P)[0]
    with torch.no_grad():
        kl = float(s.kl_divergence())
    return kl - float((m.gather(-1, y[:, None]).squeeze(-1) - value).sum()), m


def test_default_estimator_reaches_the_brute_force_fixed_point():
    # large latent variances (outputscale 20, up to ~12): the default Monte Carlo estimator
    # (common random numbers) lands on the brute-force optimum; the 5-point cubature does not
    X, y = _data(N=40, seed=1)

    def gp():
        model = GP(X[::4].clone(), 40, train_inputs=X, batch=True)
        with torch.no_grad():
            model.covar_module.outputscale = torch.full((K,), 20.0, dtype=F64)
        return model

    ref = gp()
    _brute_force_fixed_point(ref, X, y)
    best, m_ref = _brute_force_neg_elbo(ref, y)
    gaps, errs = {}, {}
    for method in (None, "cubature"):
        model = gp()
        opt = MultiClassCVIOptimizer(model, CategoricalLogitsLikelihood(K), method=method)
        for _ in range(25):
            opt.step(X, y)
        value, m = _brute_force_neg_elbo(model, y)
        gaps[method], errs[method] = value - best, float((m - m_ref).abs().max())
    assert opt.method == "cubature" and -1e-6 < gaps[None] < 0.03 and errs[None] < 0.3
    assert gaps["cubature"] > 5 * gaps[None] and errs["cubature"] > 2 * errs[None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_coupled_posterior_matches_a_dense_computation(dtype):
    """``MultiClassSitePosterior`` (the Gram one block column at a time, the marginals one class
    at a time in chunks) against the dense formulas built here: ``P = I + sum_n Phi_n^T W_n
    Phi_n`` with the ``K x KM`` block-diagonal ``Phi_n``, ``m_v = P^-1 h`` and ``Cov f(x_n) =
    diag(k(x, x) - |phi|^2) + Phi_n P^-1 Phi_n^T``; with every site empty, q is the prior."""
    from pyro_cvi.contrib.gpytorch.multiclass_posterior import MultiClassSitePosterior

    g = torch.Generator().manual_seed(0)
    K, M, N = 3, 4, 11
    Z = torch.randn(M, 2, generator=g, dtype=torch.float64)
    X = torch.randn(N, 2, generator=g, dtype=torch.float64)
    ls = torch.tensor([0.7, 1.0, 1.5], dtype=torch.float64)

    def k(a, b):
        return 2.0 * torch.exp(-0.5 * torch.cdist(a, b).pow(2) / ls.view(K, 1, 1) ** 2)

    K_ZZ = k(Z, Z) + 1e-6 * torch.eye(M, dtype=torch.float64)
    K_ZX, kxx = k(Z, X), torch.full((K, N), 2.0, dtype=torch.float64)
    m0 = 0.1 * torch.randn(K, N, generator=g, dtype=torch.float64)
    A = torch.randn(N, K, K, generator=g, dtype=torch.float64)
    lam2 = -0.5 * A @ A.mT
    lam1 = torch.randn(N, K, generator=g, dtype=torch.float64)
    # the dense reference, in float64
    Phi = torch.linalg.solve_triangular(torch.linalg.cholesky(K_ZZ), K_ZX, upper=False)
    Phi_n = torch.zeros(N, K, K * M, dtype=torch.float64)
    for c in range(K):
        Phi_n[:, c, c * M : (c + 1) * M] = Phi[c].mT
    W = -2 * lam2
    P = torch.eye(K * M, dtype=torch.float64) + (Phi_n.mT @ W @ Phi_n).sum(0)
    h = (Phi_n.mT @ (lam1 - (W @ m0.mT.unsqueeze(-1)).squeeze(-1)).unsqueeze(-1)).sum(0)
    m_v = torch.linalg.solve(P, h).squeeze(-1)
    mean = m0.mT + (Phi_n @ m_v)
    cov = Phi_n @ torch.linalg.inv(P) @ Phi_n.mT + torch.diag_embed((kxx - Phi.pow(2).sum(1)).mT)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-9)
    cast = [t.to(dtype) for t in (K_ZZ, K_ZX, m0, lam1, lam2)]
    post = MultiClassSitePosterior(*cast)
    assert not post.is_prior
    got_mean, got_cov = post.predict(post.Phi, m0.to(dtype), kxx.to(dtype), chunk=4)
    torch.testing.assert_close(got_mean, mean.to(dtype), **tol)
    torch.testing.assert_close(got_cov, cov.to(dtype), **tol)
    prior = MultiClassSitePosterior(*cast[:3], torch.zeros_like(cast[3]), torch.zeros_like(cast[4]))
    assert prior.is_prior and float(prior.kl()) == 0.0
    p_mean, p_cov = prior.predict(prior.Phi, m0.to(dtype), kxx.to(dtype))
    torch.testing.assert_close(p_mean, m0.mT.to(dtype), **tol)
    torch.testing.assert_close(p_cov, torch.diag_embed(kxx.mT).to(dtype), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("adaptive", [False, True])
def test_a_step_from_the_prior_is_capped_at_first_step_size(dtype, adaptive):
    """From empty sites the update is ``lam = min(first_step_size, beta) lam*`` (the targets
    read off a copy stepped with ``beta = 1`` and no cap); later steps use ``beta``; a
    minibatch step from the prior is not capped; a bad value is refused by name."""
    X, y = _data()
    X = X.to(dtype)

    def model():  # 6 inducing points, sites on the 25 inputs
        m = GP(X[::4].clone(), X.shape[0], train_inputs=X).to(dtype)
        m.variational_strategy.jitter_val = 1e-4
        return m

    lik = CategoricalLogitsLikelihood(K)
    kw = dict(method="cubature", adaptive=adaptive, warm_start=())  # the coupled first step
    ref = model()
    MultiClassCVIOptimizer(ref, lik, 1.0, first_step_size=None, **kw).step(X, y)
    t1, t2 = ref.variational_strategy.site_lam1, ref.variational_strategy.site_lam2
    m = model()
    opt = MultiClassCVIOptimizer(m, lik, 0.8, **kw)
    opt.step(X, y)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m.variational_strategy.site_lam1, 0.3 * t1, **tol)
    torch.testing.assert_close(m.variational_strategy.site_lam2, 0.3 * t2, **tol)
    # a minibatch step from the prior: the batch's sites move by beta = 0.8
    mb = model()
    idx = torch.arange(10)
    MultiClassCVIOptimizer(mb, lik, 0.8, method="cubature", adaptive=False).step(
        X[idx], y[idx], idx
    )
    torch.testing.assert_close(mb.variational_strategy.site_lam1[idx], 0.8 * t1[idx], **tol)
    with pytest.raises(ValueError, match="first_step_size must be in"):
        MultiClassCVIOptimizer(model(), lik, first_step_size=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("change", ["outputscale", "lengthscale", "inducing_points"])
def test_the_kernel_part_of_q_follows_a_change_between_steps(dtype, change):
    """The kernel's part of q (``K_ZZ``, ``L_Z``, ``Phi``) is reused across CVI steps while the
    hyperparameters and inducing points are unchanged; a change made by hand between steps
    (a parameter, or the inducing-point buffer in place) is seen at the next step: the
    marginals equal those of a fresh model with the same sites and the new values."""
    X, y = _data()
    X = X.to(dtype)

    def model():
        m = GP(X[::3].clone(), X.shape[0], train_inputs=X).to(dtype)
        m.variational_strategy.jitter_val = 1e-5
        return m

    m = model()
    opt = MultiClassCVIOptimizer(m, CategoricalLogitsLikelihood(K), method="cubature")
    for _ in range(2):
        opt.step(X, y)
    s = m.variational_strategy
    before = s.site_marginals()
    assert s._kernel_cache is not None  # the steps reused it
    with torch.no_grad():
        if change == "outputscale":
            m.covar_module.outputscale = 2.5
        elif change == "lengthscale":
            m.covar_module.base_kernel.lengthscale = 0.4
        else:
            s.inducing_points.add_(0.7)
    got = s.site_marginals()
    fresh = model()
    fresh.load_state_dict(m.state_dict())
    want = fresh.variational_strategy.site_marginals()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    for a, b, old in zip(got, want, before):
        torch.testing.assert_close(a, b, **tol)
        assert float((a - old).abs().max()) > 1e-3  # the change matters
    opt.step(X, y)  # and the next step runs on the new kernel without a complaint
    assert torch.isfinite(s.site_lam2).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_site_nsd_check_refuses_a_positive_eigenvalue_and_accepts_a_singular_site(dtype):
    """``set_sites`` checks ``lam2`` by a Cholesky test of ``tol I - lam2``: a singular
    negative semidefinite site (the softmax Hessian, null direction 1) is accepted; one with an
    eigenvalue of +1e-3 is refused by name, and the sites are left as they were."""
    X, y = _data()
    m = GP(X[::3].clone(), X.shape[0], train_inputs=X).to(dtype)
    s = m.variational_strategy
    p = torch.softmax(torch.randn(X.shape[0], K, dtype=dtype), -1)
    hess = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)  # PSD, H 1 = 0
    lam1 = torch.randn(X.shape[0], K, dtype=dtype)
    s.set_sites(lam1, -0.5 * hess)
    torch.testing.assert_close(s.site_lam2, -0.5 * hess)
    bad = -0.5 * hess
    bad[4] += 1e-3 * torch.eye(K, dtype=dtype)
    with pytest.raises(ValueError, match="negative semidefinite"):
        s.set_sites(lam1, bad)
    torch.testing.assert_close(s.site_lam2, -0.5 * hess)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_target_projection_equals_the_eigenvalue_clip(dtype):
    """``site_targets`` decomposes only the ``lam2`` with an eigenvalue above round-off (a
    Cholesky test); the result equals clipping every matrix's eigenvalues at zero (the
    projection onto the negative semidefinite cone), including matrices that need it."""
    from pyro_cvi.messages.softmax import LSEMoments, site_targets

    g = torch.Generator().manual_seed(1)
    n = 40
    p = torch.softmax(torch.randn(n, K, generator=g, dtype=F64), -1)
    hess = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    A = torch.randn(n, K, K, generator=g, dtype=F64)
    hess[::4] -= 0.05 * (A[::4] + A[::4].mT)  # some indefinite: these need the projection
    mean = torch.randn(n, K, generator=g, dtype=F64)
    Y = torch.nn.functional.one_hot(torch.arange(n) % K, K).to(F64)
    ones = torch.ones(n, dtype=F64)
    v, pr, h, Y, ones, mean = (t.to(dtype) for t in (ones, p, hess, Y, ones, mean))
    _, _, lam2 = site_targets(Y, ones, ones, mean, LSEMoments(v, pr, h))
    e, U = torch.linalg.eigh(-0.5 * 0.5 * (hess + hess.mT))
    want = (U * e.clamp_max(0).unsqueeze(-2)) @ U.mT
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lam2, want.to(dtype), **tol)
    assert float(torch.linalg.eigvalsh(lam2.to(F64)).amax()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kept_monte_carlo_draws_equal_the_reseeded_generator(dtype):
    """The optimizer keeps its Monte Carlo draws (the generator is re-seeded at every step):
    ``lse_expectations(draws=...)`` equals drawing from the re-seeded generator, bit for bit, and
    the optimizer's step equals one with the draws discarded; draws of another shape are refused
    by name."""
    g = torch.Generator().manual_seed(3)
    mean = torch.randn(7, K, generator=g, dtype=dtype)
    A = torch.randn(7, K, K, generator=g, dtype=dtype)
    cov = A @ A.mT / K + 0.1 * torch.eye(K, dtype=dtype)
    fresh = lse_expectations(mean, cov, "mc", num_samples=10, generator=g.manual_seed(5))
    eps = torch.randn(5, 7, K, dtype=dtype, generator=g.manual_seed(5))
    kept = lse_expectations(mean, cov, "mc", num_samples=10, draws=eps)
    for a, b in zip((fresh.value, fresh.grad, fresh.hess), (kept.value, kept.grad, kept.hess)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="draws must have shape"):
        lse_expectations(mean, cov, "mc", num_samples=12, draws=eps)
    X, y = _data()
    X = X.to(dtype)
    losses = []
    for discard in (False, True):
        m = GP(X[::3].clone(), X.shape[0], train_inputs=X).to(dtype)
        m.variational_strategy.jitter_val = 1e-5
        opt = MultiClassCVIOptimizer(m, CategoricalLogitsLikelihood(K), method="mc")
        run = []
        for _ in range(3):
            if discard:
                opt._draw_cache = None
            run.append(float(opt.step(X, y)))
        losses.append(run)
    assert losses[0] == losses[1]
