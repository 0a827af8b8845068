"""Softmax (multi-class) sites: the estimators of pyro_cvi.messages.softmax against a brute-force
tensor-product Gauss-Hermite reference, and the ``softmax-predictor`` factor kind of AutoCVI
(detection, K = 2 equals the binary logistic path, convergence to the brute-force optimum,
validity at every step size)."""

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.messages.quadrature import gauss_hermite
from pyro_cvi.messages.softmax import cubature_rule, lse_expectations, site_targets

F64 = torch.float64


def brute_lse(m, S, P=24):
    """``E lse, E softmax, E H`` by a P^K-point tensor-product Gauss-Hermite rule."""
    K = m.shape[-1]
    t, w = gauss_hermite(P, F64)
    grid = torch.stack(torch.meshgrid(*[t] * K, indexing="ij"), -1).reshape(-1, K)
    wg = torch.stack(torch.meshgrid(*[w] * K, indexing="ij"), -1).reshape(-1, K).prod(-1)
    eta = m.unsqueeze(-2) + grid @ torch.linalg.cholesky(S).mT
    p = eta.softmax(-1)
    H = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    value = (wg * eta.logsumexp(-1)).sum(-1)
    return value, (wg[:, None] * p).sum(-2), (wg[:, None, None] * H).sum(-3)


def _problem(K, scale, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(K, generator=g, dtype=F64)
    B = scale * torch.randn(K, K, generator=g, dtype=F64)
    return m, B @ B.T + 0.1 * torch.eye(K, dtype=F64)


def test_cubature_rule_is_exact_for_cubics_and_has_positive_weights():
    for K in (2, 3, 5):
        xi, w = cubature_rule(K, dtype=F64)
        assert xi.shape[0] == (2 * K + 1 if K < 3 else 2 * K) and bool((w > 0).all())
        assert torch.allclose(w.sum(), torch.ones((), dtype=F64))
        assert torch.allclose((w[:, None] * xi).sum(0), torch.zeros(K, dtype=F64))
        second = (w[:, None, None] * xi[:, :, None] * xi[:, None, :]).sum(0)
        assert torch.allclose(second, torch.eye(K, dtype=F64))
        assert torch.allclose((w[:, None] * xi**3).sum(0), torch.zeros(K, dtype=F64))


@pytest.mark.parametrize("K", [2, 3])
def test_cubature_matches_brute_force(K):
    # K = 2: Gauss-Hermite in the logit difference, exact to 1e-10. K = 3: the 6-point
    # spherical-radial rule, |error| < 5e-3 at posterior-like covariances (eigenvalues <= ~0.6)
    tol = 1e-10 if K == 2 else 5e-3
    for seed in range(3):
        m, S = _problem(K, 0.3, seed)
        ref = brute_lse(m, S)
        out = lse_expectations(m, S, "cubature")
        assert abs(float(out.value - ref[0])) < tol
        assert float((out.grad - ref[1]).abs().max()) < tol
        assert float((out.hess - ref[2]).abs().max()) < tol


@pytest.mark.parametrize("K", [2, 3])
def test_monte_carlo_matches_brute_force(K):
    # 20,000 antithetic draws (fixed seed) at covariances with eigenvalues up to ~4:
    # |error| < 5e-3 (about 4 standard errors of the value; the moments are closer)
    for seed in range(3):
        m, S = _problem(K, 1.0, seed)
        ref = brute_lse(m, S)
        gen = torch.Generator().manual_seed(seed)
        out = lse_expectations(m, S, "mc", num_samples=20000, generator=gen)
        assert abs(float(out.value - ref[0])) < 5e-3
        assert float((out.grad - ref[1]).abs().max()) < 5e-3
        assert float((out.hess - ref[2]).abs().max()) < 5e-3


@pytest.mark.parametrize("K", [2, 3])
def test_bohning_bound_bounds_the_brute_force_reference(K):
    # E lse <= bound, with equality as S -> 0; gradient softmax(m); H_B >= E[H] (Loewner)
    for seed in range(3):
        m, S = _problem(K, 1.0, seed)
        ref = brute_lse(m, S)
        out = lse_expectations(m, S, "bound")
        assert float(out.value) >= float(ref[0]) - 1e-12
        assert torch.allclose(out.grad, m.softmax(-1))
        assert float(torch.linalg.eigvalsh(out.hess - ref[2]).min()) > -1e-12
        tiny = lse_expectations(m, 1e-8 * S, "bound")
        assert abs(float(tiny.value - brute_lse(m, 1e-8 * S)[0])) < 1e-7


def test_site_targets_are_the_mean_parameter_gradients():
    # lam2 = dF/dS, lam1 = dF/dm - 2 lam2 m, against autograd of the brute-force F(m, S)
    K = 3
    m, S = _problem(K, 0.5, 4)
    y = torch.tensor([0.0, 1.0, 0.0], dtype=F64)
    n, w = torch.tensor(1.0, dtype=F64), torch.tensor(1.0, dtype=F64)
    mm, SS = m.clone().requires_grad_(True), S.clone().requires_grad_(True)
    F = (y * mm).sum() - brute_lse(mm, 0.5 * (SS + SS.T))[0]
    gm, gS = torch.autograd.grad(F, (mm, SS))
    mom = lse_expectations(
        m, S, "mc", num_samples=40000, generator=torch.Generator().manual_seed(0)
    )
    _, lam1, lam2 = site_targets(y, n, w, m, mom)
    assert torch.allclose(lam2, gS, atol=2e-3)
    assert torch.allclose(lam1, gm - 2 * gS @ m, atol=5e-3)
    assert float(torch.linalg.eigvalsh(lam2).max()) <= 1e-12  # NSD up to round-off


# ------------------------------------------------------------------------------------------------
# the softmax-predictor factor kind
# ------------------------------------------------------------------------------------------------
def _data(N=40, D=2, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, D, generator=g, dtype=F64)
    W = 1.5 * torch.randn(D, K, generator=g, dtype=F64)
    y = torch.distributions.Categorical(logits=X @ W).sample()
    return X, y


def softmax_regression(X, y, K=3, prior_scale=1.0):
    D = X.shape[1]
    w = pyro.sample("w", dist.Normal(X.new_zeros(D, K), prior_scale).to_event(2))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Categorical(logits=X @ w), obs=y)


def _fit(model, args, steps=20, step_size=1.0, **kw):
    pyro.clear_param_store()
    guide = AutoCVI(model, **kw)
    svi = SVI(model, guide, CVI(step_size=step_size), loss=CVI_ELBO())
    losses = [svi.step(*args) for _ in range(steps)]
    return guide, losses


def test_k2_softmax_site_equals_the_binary_logistic_path():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(60, 3, generator=g, dtype=F64)
    y = (torch.rand(60, generator=g, dtype=F64) < torch.sigmoid(X[:, 0] - 2 * X[:, 1])).to(F64)

    def bernoulli(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(3), 1.0).to_event(1))
        with pyro.plate("data", 60):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    def categorical(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(3), 1.0).to_event(1))
        f = X @ w
        with pyro.plate("data", 60):
            logits = torch.stack([torch.zeros_like(f), f], -1)
            pyro.sample("y", dist.Categorical(logits=logits), obs=y.long())

    gb, lb = _fit(bernoulli, (X, y), steps=12)
    gc, lc = _fit(categorical, (X, y), steps=12)
    for a, b in zip(lb, lc):  # every step, not only the fixed point
        assert abs(a - b) < 1e-6
    assert torch.allclose(gb.posterior("w").loc, gc.posterior("w").loc, atol=1e-8)


def test_detection_and_explain_wording():
    X, y = _data()
    guide, _ = _fit(softmax_regression, (X, y), steps=1)
    text = guide.explain()
    assert "softmax-predictor" in text
    assert "Categorical logits = A z + c (probed, A: 120x6); 40 coupled K=3 sites" in text
    (p,) = [v for k, v in pyro.get_param_store().items() if k.endswith("sites.y")]
    assert p.shape == (40, 3, 4)  # O(N K^2): [N, K, K + 1]

    def onehot(X, Y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(2, 3), 1.0).to_event(2))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.OneHotCategorical(logits=X @ w), obs=Y)

    def multinomial(X, Y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(2, 3), 1.0).to_event(2))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Multinomial(4, logits=X @ w), obs=Y)

    def not_affine(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(2, 3), 1.0).to_event(2))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Categorical(logits=(X @ w) ** 2), obs=y)

    Y = torch.nn.functional.one_hot(y, 3).to(F64)
    g, _ = _fit(onehot, (X, Y), steps=1)
    assert "OneHotCategorical logits = A z + c" in g.explain()
    g, _ = _fit(multinomial, (X, 4 * Y), steps=1)
    assert "Multinomial logits = A z + c" in g.explain()
    g, _ = _fit(not_affine, (X, y), steps=1, num_general_samples=2)
    assert "Categorical logits are not affine in w (probed)" in g.explain()


def _exact_neg_elbo(X, y, m, L, K=3):
    """-ELBO of q = N(m, L L^T) over vec(w) (D x K, row-major) by tensor-product quadrature."""
    N, D = X.shape
    S = L @ L.T
    A = torch.kron(X, torch.eye(K, dtype=F64)).reshape(N, K, D * K)  # eta_n = A_n vec(w)
    mean, cov = A @ m, A @ S @ A.mT
    Y = torch.nn.functional.one_hot(y, K).to(F64)
    lse = brute_lse(mean, cov + 1e-12 * torch.eye(K, dtype=F64), P=16)[0]
    ell = (Y * mean).sum() - lse.sum()
    Dk = D * K
    kl = 0.5 * (torch.trace(S) + m @ m - Dk - 2 * L.diagonal().abs().log().sum())
    return -(ell - kl)


@pytest.mark.slow
def test_multinomial_regression_converges_to_the_brute_force_optimum():
    X, y = _data(N=30)
    guide, losses = _fit(softmax_regression, (X, y), steps=25)
    q = guide.posterior("w")
    base = q.base_dist if hasattr(q, "base_dist") else q
    m, L = base.loc.detach(), base.scale_tril.detach()
    cvi = float(_exact_neg_elbo(X, y, m, L))
    # the brute-force optimum: L-BFGS on the exact (quadrature) -ELBO over (m, L)
    mp = m.clone().contiguous().requires_grad_(True)
    Lp = L.clone().contiguous().requires_grad_(True)
    opt = torch.optim.LBFGS([mp, Lp], max_iter=100, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = _exact_neg_elbo(X, y, mp, torch.tril(Lp))
        loss.backward()
        return loss

    opt.step(closure)
    best = float(_exact_neg_elbo(X, y, mp.detach(), torch.tril(Lp.detach())))
    assert best <= cvi + 1e-9
    assert cvi - best < 1e-3, (cvi, best)  # CVI's q is within 1e-3 nats of the optimum
    assert abs(losses[-1] - cvi) < 5e-2  # its reported (cubature) -ELBO: within 0.05 nats
    assert float((mp.detach() - m).abs().max()) < 1e-2


@pytest.mark.parametrize("method", ["cubature", "mc", "bound"])
def test_every_step_size_keeps_sites_valid(method):
    # from q = prior (the Laplace start is already near the optimum, where the losses of
    # different step sizes differ by Monte Carlo noise only)
    X, y = _data(N=30, seed=3)
    finals = []
    for b in (0.05, 0.3, 0.7, 1.0):
        guide, losses = _fit(
            softmax_regression, (X, y), steps=8, step_size=b, softmax=method, num_samples=50,
            init_sites="prior",
        )  # fmt: skip
        assert all(math.isfinite(v) for v in losses)
        assert guide.num_rejected == 0
        (p,) = [v for k, v in pyro.get_param_store().items() if k.endswith("sites.y")]
        lam2 = p.detach()[..., 1:]
        assert float(torch.linalg.eigvalsh(0.5 * (lam2 + lam2.mT)).max()) <= 1e-10
        finals.append(losses[-1])
    assert finals[-1] <= finals[0] + 1e-6  # a full step gets at least as far in 8 steps


def _kron_reference(A, K):
    """The Kronecker factors by the whole-matrix pivot and :func:`probes.close` (one pass of
    full-size temporaries): what the chunked test must agree with."""
    from pyro_cvi.model import probes

    R, Dz = A.shape
    A4 = A.reshape(R // K, K, Dz // K, K)
    n0, k0, d0, l0 = (int(i) for i in np.unravel_index(int(A4.abs().argmax()), A4.shape))
    G = A4[n0, :, d0, :]
    X = A4[:, k0, :, l0] / G[k0, l0]
    ok = probes.close(A4, X[:, None, :, None] * G[None, :, None, :], probes.rtol(A.dtype))
    return (X, G) if ok else None


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("chunk", [1, 64, 1 << 16])
def test_kron_factors_over_chunks_equal_the_whole_matrix_test(chunk, dtype, monkeypatch):
    """``A = X (x) G`` (a design with a bias column and a full ``G``) is found over chunks of
    any size: the same pivot, ``X`` and ``G`` as the whole-matrix test, and ``X (x) G = A`` to
    rounding; one entry off by 5%, a NaN or an infinity anywhere, or a
    non-Kronecker ``A`` gives ``None``."""
    from pyro_cvi.messages import softmax_sites

    monkeypatch.setattr(softmax_sites, "KRON_CHUNK", chunk)
    g = torch.Generator().manual_seed(chunk)
    N, D, K = 37, 4, 3
    X = torch.cat([torch.randn(N, D - 1, generator=g, dtype=F64), torch.ones(N, 1, dtype=F64)], 1)
    G = torch.randn(K, K, generator=g, dtype=F64)
    A = torch.kron(X, G).to(dtype)  # rows n K + k, columns d K + l
    found = softmax_sites._kron_factors(A, K)
    ref = _kron_reference(A, K)
    assert found is not None and ref is not None
    torch.testing.assert_close(found[0], ref[0], rtol=0, atol=0)
    torch.testing.assert_close(found[1], ref[1], rtol=0, atol=0)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.kron(*found), A, **tol)
    for r, c, v in [(N * K - 1, D * K - 2, None), (5, 0, float("nan")), (40, 7, float("inf"))]:
        B = A.clone()
        B[r, c] = B[r, c] * 1.05 + 0.05 if v is None else v
        assert softmax_sites._kron_factors(B, K) is None
        assert _kron_reference(B, K) is None
    C = torch.randn(N * K, D * K, generator=g, dtype=F64).to(dtype)
    assert softmax_sites._kron_factors(C, K) is None
    assert softmax_sites._kron_factors(A[:, :-1], K) is None  # columns not a multiple of K


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_prior_row_cov_blocks_of_a_kronecker_jacobian_equal_the_dense_ones(dtype):
    """``Cov(A_n z)`` under a diagonal prior by the Kronecker factors equals ``A_n diag(v)
    A_n^T`` formed densely; a Jacobian off the structure takes the dense product."""
    from pyro_cvi.linear_gaussian import GaussianPrior
    from pyro_cvi.messages.warm_start import prior_row_cov_blocks

    g = torch.Generator().manual_seed(7)
    N, D, K = 23, 5, 4
    X = torch.randn(N, D, generator=g, dtype=F64)
    G = torch.randn(K, K, generator=g, dtype=F64)
    v = torch.rand(D * K, generator=g, dtype=F64) + 0.1
    for A in (torch.kron(X, G), torch.randn(N * K, D * K, generator=g, dtype=F64)):
        An = A.reshape(N, K, D * K)
        dense = (An * v) @ An.mT
        prior = GaussianPrior(torch.zeros(D * K, dtype=dtype), var=v.to(dtype))
        got = prior_row_cov_blocks(prior, A.to(dtype), K)
        assert got.dtype == dtype and got.shape == (N, K, K)
        tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.double(), dense, **tol)
