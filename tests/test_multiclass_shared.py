"""The multi-class posterior when the classes share ``phi`` (one kernel, shared inducing inputs):
the Gram ``I + sum_n W_n (x) phi_n phi_n^T`` and the marginals by one product with the table of
the products ``phi_ni phi_nj`` must equal the general per-class computation and a dense one."""

import pytest
import torch

from pyro_cvi.contrib.gpytorch import multiclass_posterior as mp
from pyro_cvi.contrib.gpytorch.multiclass_posterior import MultiClassSitePosterior

K, M, N = 4, 5, 23


def _problem(dtype, shared=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(M, 2, generator=g, dtype=torch.float64)
    X = torch.randn(N, 2, generator=g, dtype=torch.float64)
    ls = torch.full((K,), 0.8, dtype=torch.float64) if shared else torch.linspace(0.6, 1.4, K)
    ls = ls.to(torch.float64)

    def k(a, b):
        return 1.5 * torch.exp(-0.5 * torch.cdist(a, b).pow(2) / ls.view(K, 1, 1) ** 2)

    K_ZZ = k(Z, Z) + 1e-6 * torch.eye(M, dtype=torch.float64)
    K_ZX, kxx = k(Z, X), torch.full((K, N), 1.5, dtype=torch.float64)
    m0 = 0.1 * torch.randn(K, N, generator=g, dtype=torch.float64)
    A = torch.randn(N, K, K, generator=g, dtype=torch.float64)
    lam2 = -0.5 * A @ A.mT
    lam1 = torch.randn(N, K, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (K_ZZ, K_ZX, m0, lam1, lam2, kxx)]


def _dense(K_ZZ, K_ZX, m0, lam1, lam2, kxx):
    """``P``, ``m_v`` and the marginals from the ``K x KM`` block-diagonal ``Phi_n``, in f64."""
    K_ZZ, K_ZX, m0, lam1, lam2, kxx = (t.double() for t in (K_ZZ, K_ZX, m0, lam1, lam2, kxx))
    Phi = torch.linalg.solve_triangular(torch.linalg.cholesky(K_ZZ), K_ZX, upper=False)
    Phi_n = torch.zeros(N, K, K * M, dtype=torch.float64)
    for c in range(K):
        Phi_n[:, c, c * M : (c + 1) * M] = Phi[c].mT
    W = -2 * lam2
    P = torch.eye(K * M, dtype=torch.float64) + (Phi_n.mT @ W @ Phi_n).sum(0)
    h = (Phi_n.mT @ (lam1 - (W @ m0.mT.unsqueeze(-1)).squeeze(-1)).unsqueeze(-1)).sum(0)
    m_v = torch.linalg.solve(P, h).squeeze(-1)
    mean = m0.mT + Phi_n @ m_v
    cov = Phi_n @ torch.linalg.inv(P) @ Phi_n.mT + torch.diag_embed((kxx - Phi.pow(2).sum(1)).mT)
    return P, m_v.reshape(K, M), mean, cov


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_products_table_is_built_only_for_a_shared_phi(dtype):
    K_ZZ, K_ZX = _problem(dtype)[:2]
    _, Phi = MultiClassSitePosterior.whitening(K_ZZ, K_ZX)
    Psi = mp.shared_products(Phi)
    iu = torch.triu_indices(M, M)
    assert Psi is not None and Psi.shape == (M * (M + 1) // 2, N)
    torch.testing.assert_close(Psi, Phi[0][iu[0]] * Phi[0][iu[1]], rtol=0, atol=0)
    K_ZZ, K_ZX = _problem(dtype, shared=False)[:2]
    assert mp.shared_products(MultiClassSitePosterior.whitening(K_ZZ, K_ZX)[1]) is None
    assert mp.shared_products(Phi.clone().requires_grad_(True)) is None  # a graph: general form


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shared_posterior_equals_the_general_and_the_dense_computation(dtype):
    K_ZZ, K_ZX, m0, lam1, lam2, kxx = _problem(dtype)
    L_Z, Phi = MultiClassSitePosterior.whitening(K_ZZ, K_ZX)
    Psi = mp.shared_products(Phi)
    assert Psi is not None
    fast = MultiClassSitePosterior(K_ZZ, K_ZX, m0, lam1, lam2, whitened=(L_Z, Phi), products=Psi)
    general = MultiClassSitePosterior(K_ZZ, K_ZX, m0, lam1, lam2, whitened=(L_Z, Phi))
    P, m_v, mean, cov = _dense(K_ZZ, K_ZX, m0, lam1, lam2, kxx)
    # the lower triangle of P is what the factorisation reads: its factor is P's
    L = torch.linalg.cholesky(P).to(dtype)
    torch.testing.assert_close(fast.L_P, L, **_tol(dtype))
    torch.testing.assert_close(fast.L_P, general.L_P, **_tol(dtype))
    torch.testing.assert_close(fast.m_v, m_v.to(dtype), **_tol(dtype))
    torch.testing.assert_close(fast.kl(), general.kl(), **_tol(dtype))
    got = fast.predict(Phi, m0, kxx, products=Psi)
    ref = general.predict(Phi, m0, kxx)
    for a, b, d in zip(got, ref, (mean, cov)):
        torch.testing.assert_close(a, d.to(dtype), **_tol(dtype))
        torch.testing.assert_close(a, b, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [1, 4, None])
def test_marginals_without_a_graph_equal_those_with_one(dtype, chunk):
    """The chunked marginals (a reused buffer, no graph) against the differentiable form, and
    the gradient of the latter against the dense formula's."""
    K_ZZ, K_ZX, m0, lam1, lam2, kxx = _problem(dtype, shared=False, seed=1)
    post = MultiClassSitePosterior(K_ZZ, K_ZX, m0, lam1, lam2)
    with torch.no_grad():
        fast = post.predict(post.Phi, m0, kxx, chunk=chunk)
    Phi = post.Phi.clone().requires_grad_(True)
    slow = post.predict(Phi, m0, kxx, chunk=chunk)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b.detach(), **_tol(dtype))
    _, _, mean, cov = _dense(K_ZZ, K_ZX, m0, lam1, lam2, kxx)
    torch.testing.assert_close(fast[1], cov.to(dtype), **_tol(dtype))
    # d sum(cov) / d Phi of the graph form against the same with the dense S_v
    (g,) = torch.autograd.grad(slow[1].sum(), Phi)
    Phi_d = post.Phi.detach().double().requires_grad_(True)
    S = post.S_v().double()
    ref = torch.einsum("kin,kilj,ljn->nkl", Phi_d, S, Phi_d)
    ref = ref - torch.diag_embed(Phi_d.pow(2).sum(1).mT)
    (g_ref,) = torch.autograd.grad(ref.sum(), Phi_d)
    torch.testing.assert_close(g, g_ref.to(dtype), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch", [False, True])
def test_steps_with_the_products_table_equal_the_general_form(dtype, batch, monkeypatch):
    """A kernel shared by the classes (or a batch of equal ones): the strategy builds the table,
    and five Monte Carlo steps (the -ELBO, the sites, the predictions at the training inputs and
    at new ones) equal those of the general form (the table refused by its size limit)."""
    import gpytorch

    from pyro_cvi.contrib.gpytorch import (
        CategoricalLogitsLikelihood,
        MultiClassCVIOptimizer,
        MultiClassCVIStrategy,
    )

    class GP(gpytorch.models.ApproximateGP):
        def __init__(self, Z, X):
            super().__init__(MultiClassCVIStrategy(self, Z, X.shape[0], K, train_inputs=X))
            shape = torch.Size([K]) if batch else torch.Size([])
            self.mean_module = gpytorch.means.ConstantMean(batch_shape=shape)
            self.covar_module = gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.RBFKernel(batch_shape=shape), batch_shape=shape
            )
            self.covar_module.outputscale = 4.0

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(x), self.covar_module(x)
            )

    g = torch.Generator().manual_seed(2)
    X = torch.rand(N, 2, generator=g, dtype=torch.float64).to(dtype) * 4 - 2
    y = torch.randint(0, K, (N,), generator=g)
    X_new = torch.rand(6, 2, generator=g, dtype=torch.float64).to(dtype)
    runs = []
    for limit in (mp.PACK_ELEMENTS, 0):
        monkeypatch.setattr(mp, "PACK_ELEMENTS", limit)
        torch.manual_seed(0)
        model = GP(X[:M].clone(), X).to(dtype)
        opt = MultiClassCVIOptimizer(model, CategoricalLogitsLikelihood(K), method="mc")
        losses = [opt.step(X, y) for _ in range(5)]
        s = model.variational_strategy
        with torch.no_grad():
            assert (s.posterior()[0].Psi is not None) == (limit > 0)
            f, f_new = model(X), model(X_new)
        runs.append((torch.stack(losses), s.site_lam1.clone(), s.site_lam2.clone(), f.mean,
                     f.covariance_matrix, f_new.mean, f_new.covariance_matrix))  # fmt: skip
    assert float(runs[0][0][-1]) < float(runs[0][0][0])  # the steps did fit
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared", [False, True])
def test_a_precision_that_is_not_positive_definite_is_refused_by_name(dtype, shared):
    """Sites whose ``W = -2 lam2`` is far from positive semidefinite make ``P`` indefinite (or
    NaN sites make it non-finite): the factorisation fails with the error naming ``P``."""
    from pyro_cvi.linalg import NotPositiveDefinite

    K_ZZ, K_ZX, m0, lam1, lam2, _ = _problem(dtype, shared=shared)
    L_Z, Phi = MultiClassSitePosterior.whitening(K_ZZ, K_ZX)
    Psi = mp.shared_products(Phi)
    assert (Psi is not None) == shared
    eye = torch.eye(K, dtype=dtype)
    for bad in (1e3 * eye.expand(N, K, K), torch.full_like(lam2, float("nan"))):
        with pytest.raises(NotPositiveDefinite, match=r"P = I \+ sum_n"):
            MultiClassSitePosterior(
                K_ZZ, K_ZX, m0, lam1, bad.clone(), whitened=(L_Z, Phi), products=Psi
            )
