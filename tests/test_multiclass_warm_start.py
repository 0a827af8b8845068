"""The multi-class start in the tied-curvature family (``W_n = w_n C``, ``C = I - 1 1^T / K``) and
the posterior in the contrasts when every site ignores a common shift of the classes: both in
closed form, checked against the general coupled posterior and a dense computation."""

import gpytorch
import pytest
import torch

from pyro_cvi.contrib.gpytorch import (
    CategoricalLogitsLikelihood,
    MultiClassCVIOptimizer,
    MultiClassCVIStrategy,
)
from pyro_cvi.contrib.gpytorch import multiclass_posterior as mp
from pyro_cvi.contrib.gpytorch.multiclass_warm import project_targets, tied_posterior, tied_start

F64 = torch.float64
K, M, N = 4, 5, 23
DTYPES = [torch.float32, torch.float64]


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)


def _kernel(dtype, seed=0, lengthscales=None):
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(M, 2, generator=g, dtype=F64)
    X = torch.randn(N, 2, generator=g, dtype=F64)
    ls = torch.full((K,), 0.8, dtype=F64) if lengthscales is None else lengthscales

    def k(a, b):
        return 1.5 * torch.exp(-0.5 * torch.cdist(a, b).pow(2) / ls.view(K, 1, 1) ** 2)

    K_ZZ = k(Z, Z) + 1e-6 * torch.eye(M, dtype=F64)
    kxx = torch.full((K, N), 1.5, dtype=F64) + 0.1 * torch.arange(K, dtype=F64).view(K, 1)
    m0 = 0.3 * torch.randn(K, N, generator=g, dtype=F64)
    return [t.to(dtype) for t in (K_ZZ, k(Z, X), m0, kxx)], g


def _C(dtype=F64):
    return torch.eye(K, dtype=dtype) - 1.0 / K


def _dense(Phi, m0, kxx, lam1, lam2):
    """Mean, covariance and KL from the dense ``K M x K M`` precision (float64)."""
    Phi, m0, kxx, lam1, lam2 = (t.double() for t in (Phi, m0, kxx, lam1, lam2))
    Phi_n = torch.zeros(N, K, K * M, dtype=F64)
    for c in range(K):
        Phi_n[:, c, c * M : (c + 1) * M] = Phi[c].mT
    W = -2 * lam2
    P = torch.eye(K * M, dtype=F64) + (Phi_n.mT @ W @ Phi_n).sum(0)
    r = lam1 - (W @ m0.mT.unsqueeze(-1)).squeeze(-1)
    m_v = torch.linalg.solve(P, (Phi_n.mT @ r.unsqueeze(-1)).sum(0)).squeeze(-1)
    S = torch.linalg.inv(P)
    mean = m0.mT + Phi_n @ m_v
    cov = Phi_n @ S @ Phi_n.mT + torch.diag_embed((kxx - Phi.pow(2).sum(1)).mT)
    kl = 0.5 * (S.trace() + m_v @ m_v - K * M + torch.logdet(P))
    return mean, cov, kl


@pytest.mark.parametrize("dtype", DTYPES)
def test_tied_posterior_equals_the_dense_coupled_posterior(dtype):
    (K_ZZ, K_ZX, m0, kxx), g = _kernel(dtype)
    _, Phi = mp.MultiClassSitePosterior.whitening(K_ZZ, K_ZX)
    lam1 = torch.randn(N, K, generator=g, dtype=F64).to(dtype)
    w = torch.rand(N, generator=g, dtype=F64).to(dtype) * 2
    mean, cov, kl = tied_posterior(Phi[0], kxx, m0, lam1, w)
    lam2 = -0.5 * w[:, None, None] * _C(dtype)
    ref = _dense(Phi, m0, kxx, lam1, lam2)
    for got, want in zip((mean, cov, kl), ref):
        torch.testing.assert_close(got, want.to(dtype), **_tol(dtype))
    # the general posterior of the adapter, the same sites
    post = mp.MultiClassSitePosterior(K_ZZ, K_ZX, m0, lam1, lam2)
    p_mean, p_cov = post.predict(post.Phi, m0, kxx)
    torch.testing.assert_close(mean, p_mean, **_tol(dtype))
    torch.testing.assert_close(cov, p_cov, **_tol(dtype))
    torch.testing.assert_close(kl, post.kl(), **_tol(dtype))
    # empty sites: the prior (KL 0, covariance diag(k(x, x)))
    zero = tied_posterior(Phi[0], kxx, m0, torch.zeros_like(lam1), torch.zeros_like(w))
    torch.testing.assert_close(zero[0], m0.mT, **_tol(dtype))
    torch.testing.assert_close(zero[1], torch.diag_embed(kxx.mT), **_tol(dtype))
    assert abs(float(zero[2])) < 1e-4


@pytest.mark.parametrize("dtype", DTYPES)
def test_projection_onto_the_tied_family(dtype):
    g = torch.Generator().manual_seed(3)
    mean = torch.randn(N, K, generator=g, dtype=F64)
    A = torch.randn(N, K, K, generator=g, dtype=F64)
    W = _C() @ A @ A.mT @ _C()  # W 1 = 0, as the softmax's E[H]
    lam1 = torch.randn(N, K, generator=g, dtype=F64)
    p1, w = project_targets(*(t.to(dtype) for t in (mean, lam1, -0.5 * W)))
    # w = <W, C> / <C, C> = tr(W) / (K - 1); lam1 keeps the linear part at the mean
    want_w = W.diagonal(dim1=-2, dim2=-1).sum(-1) / (K - 1)
    torch.testing.assert_close(w, want_w.to(dtype), **_tol(dtype))
    want_1 = lam1 - (W @ mean.unsqueeze(-1)).squeeze(-1) + want_w[:, None] * (mean @ _C())
    torch.testing.assert_close(p1, want_1.to(dtype), **_tol(dtype))
    # a target already in the family is its own projection
    tied = -0.5 * want_w[:, None, None] * _C()
    q1, v = project_targets(*(t.to(dtype) for t in (mean, lam1, tied)))
    torch.testing.assert_close(v, want_w.to(dtype), **_tol(dtype))
    torch.testing.assert_close(q1, lam1.to(dtype), **_tol(dtype))


def _shift_free_sites(g, dtype):
    A = torch.randn(N, K, K, generator=g, dtype=F64)
    lam2 = -0.5 * _C() @ A @ A.mT @ _C()
    lam1 = torch.randn(N, K, generator=g, dtype=F64) @ _C()
    return lam1.to(dtype), lam2.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sites_that_ignore_a_common_shift_solve_the_contrasts_only(dtype):
    """``W_n 1 = 0``, ``1^T r_n = 0``: the reduced ``(K - 1) M`` solve gives the posterior of the
    full one (means, marginals, KL, ``S_v``, ``q(u)``); other sites are not reduced."""
    (K_ZZ, K_ZX, m0, kxx), g = _kernel(dtype)
    lam1, lam2 = _shift_free_sites(g, dtype)
    L_Z, Phi = mp.MultiClassSitePosterior.whitening(K_ZZ, K_ZX)
    Psi = mp.shared_products(Phi)
    fast = mp.MultiClassSitePosterior(K_ZZ, K_ZX, m0, lam1, lam2, whitened=(L_Z, Phi), products=Psi)
    general = mp.MultiClassSitePosterior(K_ZZ, K_ZX, m0, lam1, lam2, whitened=(L_Z, Phi))
    assert fast.B is not None and general.B is None
    assert fast.L_P.shape[-1] == (K - 1) * M
    tol = _tol(dtype)
    want = general.predict(Phi, m0, kxx)
    for a, b in zip(fast.predict(Phi, m0, kxx, products=Psi), want):
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(fast.predict(Phi, m0, kxx, chunk=4), want):  # other points: S_v assembled
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(fast.kl(), general.kl(), **tol)
    torch.testing.assert_close(fast.m_v, general.m_v, **tol)
    torch.testing.assert_close(fast.S_v(), general.S_v(), **tol)
    for a, b in zip(fast.q_u(m0[:, :M]), general.q_u(m0[:, :M])):
        torch.testing.assert_close(a, b, **tol)
    ref = _dense(Phi, m0, kxx, lam1, lam2)
    torch.testing.assert_close(fast.kl(), ref[2].to(dtype), **tol)
    # a site that moves the common shift (1^T lam1 != 0) keeps the full solve
    moved = lam1.clone()
    moved[3, 0] += 0.5
    p = mp.MultiClassSitePosterior(K_ZZ, K_ZX, m0, moved, lam2, whitened=(L_Z, Phi), products=Psi)
    assert p.B is None
    B = mp.contrast_basis(K, dtype, torch.device("cpu"))
    torch.testing.assert_close(B.mT @ B, torch.eye(K - 1, dtype=dtype), **tol)
    torch.testing.assert_close(B.sum(0), torch.zeros(K - 1, dtype=dtype), **tol)


def test_one_kernel_is_whitened_once_bitwise():
    (K_ZZ, K_ZX, _, _), _ = _kernel(F64)
    L, Phi = mp.MultiClassSitePosterior.whitening(K_ZZ, K_ZX)
    L_ref = torch.linalg.cholesky(K_ZZ)
    Phi_ref = torch.linalg.solve_triangular(L_ref, K_ZX, upper=False)
    torch.testing.assert_close(Phi, Phi_ref, rtol=1e-12, atol=1e-12)
    assert Phi.stride(0) == 0  # one solve, expanded over the classes
    ls = torch.linspace(0.6, 1.4, K, dtype=F64)
    (K_ZZ2, K_ZX2, _, _), _ = _kernel(F64, lengthscales=ls)
    assert mp.MultiClassSitePosterior.whitening(K_ZZ2, K_ZX2)[1].stride(0) != 0


def test_tied_start_undoes_a_step_that_raises_the_elbo():
    (K_ZZ, K_ZX, m0, kxx), g = _kernel(F64)
    _, Phi = mp.MultiClassSitePosterior.whitening(K_ZZ, K_ZX)
    y = torch.randint(0, K, (N,), generator=g)
    Y = torch.nn.functional.one_hot(y, K).to(F64)
    from pyro_cvi.messages.softmax import lse_expectations, site_targets

    calls = []

    def targets(mean, cov, spoil=False):
        mom = lse_expectations(mean, cov, "cubature")
        ones = torch.ones(N, dtype=F64)
        F, t1, t2 = site_targets(Y, ones, ones, mean, mom)
        calls.append(1)
        if spoil and len(calls) == 3:
            return F.sum() - 1e6, t1, t2  # the q after two steps looks far worse: undone
        return F.sum(), t1, t2

    one = tied_start(Phi[0], kxx, m0, targets, (0.3,))  # the sites after the first step
    calls.clear()
    spoilt = tied_start(Phi[0], kxx, m0, lambda m, c: targets(m, c, True), (0.3, 0.5, 0.5))
    torch.testing.assert_close(spoilt[0], one[0], rtol=0, atol=0)
    torch.testing.assert_close(spoilt[1], one[1], rtol=0, atol=0)
    # the -ELBO at the prior: KL 0, minus the expected log-likelihood there
    prior = targets(m0.mT, torch.diag_embed(kxx.mT))[0]
    torch.testing.assert_close(one[2], -prior, rtol=1e-12, atol=1e-9)
    assert spoilt[1].shape == (N, K, K)
    w = -2 * spoilt[1][:, 0, 0] / (1 - 1 / K)
    torch.testing.assert_close(spoilt[1], -0.5 * w[:, None, None] * _C(), rtol=1e-12, atol=1e-12)


class GP(gpytorch.models.ApproximateGP):
    def __init__(self, Z, X, batch_lengthscales=None):
        super().__init__(MultiClassCVIStrategy(self, Z, X.shape[0], 3, train_inputs=X))
        shape = torch.Size([3]) if batch_lengthscales is not None else torch.Size([])
        self.mean_module = gpytorch.means.ZeroMean(batch_shape=shape)
        self.covar_module = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(batch_shape=shape), batch_shape=shape
        )
        self.covar_module.outputscale = 4.0
        if batch_lengthscales is not None:
            self.covar_module.base_kernel.lengthscale = batch_lengthscales.view(3, 1, 1)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _data(dtype, n=40):
    g = torch.Generator().manual_seed(1)
    X = (torch.rand(n, 1, generator=g, dtype=F64) * 4 - 2).to(dtype)
    F = torch.cat([torch.sin(2 * X), X, -X], -1) * 2
    return X, torch.distributions.Categorical(logits=F.double()).sample()


@pytest.mark.parametrize("dtype", DTYPES)
def test_first_step_runs_the_tied_start_and_reaches_the_same_fixed_point(dtype):
    X, y = _data(dtype)
    lik = CategoricalLogitsLikelihood(3)

    def fit(steps, **kw):
        model = GP(X[::5].clone(), X).to(dtype)
        opt = MultiClassCVIOptimizer(model, lik, method="cubature", **kw)
        return model, opt, [float(opt.step(X, y)) for _ in range(steps)]

    model, opt, losses = fit(1)
    s = model.variational_strategy
    C = torch.eye(3, dtype=dtype) - 1.0 / 3
    w = -2 * s.site_lam2[:, 0, 0] / (1 - 1 / 3)
    assert float(w.min()) > 0  # tied sites, every point informative
    torch.testing.assert_close(s.site_lam2, -0.5 * w[:, None, None] * C, **_tol(dtype))
    # the step's own report is the -ELBO at the prior (the first evaluation)
    with torch.no_grad():
        post, b = s.posterior()
    _, _, ref = fit(1, warm_start=())
    assert abs(losses[0] - ref[0]) < 1e-3 * abs(ref[0])
    # the fixed point is that of the coupled iteration (the start only moves the path)
    _, _, warm = fit(25)
    _, _, cold = fit(25, warm_start=())
    assert abs(warm[-1] - cold[-1]) < (1e-2 if dtype == torch.float32 else 1e-6)
    assert all(b <= a + 1e-6 * abs(a) for a, b in zip(warm, warm[1:]))  # guarded: monotone


@pytest.mark.parametrize("dtype", DTYPES)
def test_classes_with_their_own_phi_take_the_damped_coupled_first_step(dtype):
    X, y = _data(dtype)
    lik = CategoricalLogitsLikelihood(3)
    ls = torch.tensor([0.5, 1.0, 2.0], dtype=dtype)
    model = GP(X[::5].clone(), X, ls).to(dtype)
    ref = GP(X[::5].clone(), X, ls).to(dtype)
    MultiClassCVIOptimizer(model, lik, method="cubature").step(X, y)
    MultiClassCVIOptimizer(ref, lik, method="cubature", warm_start=()).step(X, y)
    for a, b in ((model, ref),):
        sa, sb = a.variational_strategy, b.variational_strategy
        torch.testing.assert_close(sa.site_lam1, sb.site_lam1, rtol=0, atol=0)
        torch.testing.assert_close(sa.site_lam2, sb.site_lam2, rtol=0, atol=0)
    with pytest.raises(ValueError, match="warm_start step sizes"):
        MultiClassCVIOptimizer(model, lik, warm_start=(0.3, 1.5))
