"""pyro_cvi.linalg: the shared Cholesky policies and the dual-form (R&W Alg. 3.2) solve."""

import pytest
import torch

from pyro_cvi.linalg import NotPositiveDefinite, cholesky, dual_solve

F64 = torch.float64


def _problem(n=6, seed=0, singular=False):
    """A kernel matrix, site precisions (two of them 0), site coefficients and a prior mean."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.linspace(0, 1, n, dtype=F64)
    if singular:
        # squared-exponential with a long lengthscale and a large signal variance: numerically
        # singular (its smallest eigenvalues are rounding noise of either sign)
        K = 50.0 * torch.exp(-0.5 * (x[:, None] - x[None, :]) ** 2)
    else:
        Q = torch.randn(n, n, dtype=F64, generator=gen)
        K = Q @ Q.T / n + 0.5 * torch.eye(n, dtype=F64)
    w = torch.rand(n, dtype=F64, generator=gen) + 0.2
    w[1] = 0.0
    w[-2] = 0.0
    b = torch.randn(n, dtype=F64, generator=gen)
    mu = torch.randn(n, dtype=F64, generator=gen)
    return K, w, b, mu


def test_dual_solve_matches_dense_inverse():
    K, w, b, mu = _problem()
    sol = dual_solve(K, w, b, mu)
    Kinv = torch.linalg.inv(K)
    Sigma = torch.linalg.inv(Kinv + torch.diag(w))
    m = Sigma @ (Kinv @ mu + b)
    tol = {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(sol.mean, m, **tol)
    torch.testing.assert_close(sol.var, Sigma.diagonal(), **tol)
    torch.testing.assert_close(sol.alpha, Kinv @ (m - mu), **tol)
    torch.testing.assert_close(K - sol.V.T @ sol.V, Sigma, **tol)
    logdet_B = torch.linalg.slogdet(K)[1] - torch.linalg.slogdet(Sigma)[1]
    torch.testing.assert_close(sol.logdet_B, logdet_B, **tol)
    B = torch.eye(6, dtype=F64) + sol.sqrt_w[:, None] * K * sol.sqrt_w
    torch.testing.assert_close(sol.L @ sol.L.T, B, **tol)
    # sites with w = 0 contribute only through b
    assert sol.sqrt_w[1] == 0 and sol.sqrt_w[-2] == 0
    # covariance at "new" points x (here the first three sites, k(X, x) = K[:, :3]) via
    # whiten(): k(x, x') - R^T R with R = L^-1 W^1/2 k(X, x)
    R = sol.whiten(K[:, :3])
    torch.testing.assert_close(K[:3, :3] - R.T @ R, Sigma[:3, :3], **tol)


def test_dual_solve_centred_sites_give_the_same_posterior():
    K, w, b, mu = _problem(seed=1)
    sol = dual_solve(K, w, b, mu)
    centred = dual_solve(K, w, b - w * mu)
    torch.testing.assert_close(centred.alpha, sol.alpha, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(mu + centred.mean, sol.mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(centred.var, sol.var, rtol=0, atol=0)


def test_dual_solve_numerically_singular_kernel():
    K, w, b, mu = _problem(n=12, singular=True)
    with pytest.raises(NotPositiveDefinite):
        cholesky(K, what="K")  # K itself cannot be factorised ...
    sol = dual_solve(K, w, b, mu)  # ... but B = I + W^1/2 K W^1/2 can
    # reference without K^-1: Sigma = (K^-1 + W)^-1 = (I + K W)^-1 K, m = (I + K W)^-1 (mu + K b)
    IKW = torch.eye(12, dtype=F64) + K * w
    Sigma = torch.linalg.solve(IKW, K)
    m = torch.linalg.solve(IKW, mu + K @ b)
    torch.testing.assert_close(sol.mean, m, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sol.var, Sigma.diagonal(), rtol=1e-8, atol=1e-10)
    assert bool(torch.isfinite(sol.logdet_B)) and float(sol.logdet_B) > 0


def test_dual_solve_is_batched():
    problems = [_problem(seed=s) for s in range(3)]
    K, w, b, mu = (torch.stack(t) for t in zip(*problems))
    sol = dual_solve(K, w, b, mu)
    for i, (Ki, wi, bi, mi) in enumerate(problems):
        one = dual_solve(Ki, wi, bi, mi)
        for name in ("alpha", "mean", "var", "logdet_B"):
            torch.testing.assert_close(getattr(sol, name)[i], getattr(one, name))


def test_dual_solve_gradients():
    K, w, b, mu = _problem(n=4)
    Q = torch.linalg.cholesky(K).requires_grad_(True)
    b = b.requires_grad_(True)

    def f(Q, b):
        sol = dual_solve(Q @ Q.T, w, b, mu)
        return sol.mean, sol.var, sol.logdet_B

    assert torch.autograd.gradcheck(f, (Q, b))


def test_dual_solve_invalid_b_raises_with_hint():
    K, w, b, mu = _problem()
    with pytest.raises(NotPositiveDefinite, match=r"B = I \+ W\^1/2 K W\^1/2.*Try this\.$"):
        dual_solve(-K, 100 * w + 1, b, mu, hint="Try this.")


# ------------------------------------------------------------------------------ Cholesky policies
def test_strict_raises_naming_the_matrix():
    M = torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=F64)
    with pytest.raises(NotPositiveDefinite, match=r"^my precision is not .*float64.*Do X\.$"):
        cholesky(M, what="my precision", hint="Do X.")
    # both a RuntimeError (guide, contrib) and a ValueError (Gaussian family)
    assert issubclass(NotPositiveDefinite, RuntimeError)
    assert issubclass(NotPositiveDefinite, ValueError)
    # batched: the message counts the failing entries
    Mb = torch.stack([torch.eye(2, dtype=F64), M, M])
    with pytest.raises(NotPositiveDefinite, match="2 of 3 batch entries"):
        cholesky(Mb, what="M")


def test_strict_rejects_a_non_finite_factor():
    M = torch.tensor([[float("inf")]], dtype=F64)
    with pytest.raises(NotPositiveDefinite, match="M is not positive definite"):
        cholesky(M, what="M")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [(0, 0), (3, 1), (5, 0), (5, 4), (5, 5)])
def test_strict_rejects_a_non_finite_entry_anywhere_in_the_lower_triangle(dtype, bad, where):
    K, *_ = _problem()
    M = K.to(dtype).clone()
    M[where] = bad
    M = torch.stack([K.to(dtype), M])  # batched: only the second entry fails
    with pytest.raises(NotPositiveDefinite, match="1 of 2 batch entries"):
        cholesky(M, what="M")
    with pytest.raises(NotPositiveDefinite):
        cholesky(M, what="M", jitter="eps")


def test_strict_is_exact_for_positive_definite_input():
    K, *_ = _problem()
    torch.testing.assert_close(cholesky(K), torch.linalg.cholesky(K), rtol=0, atol=0)


def _slightly_indefinite(dtype):
    """Eigenvalues about 2 and -1e-6: not positive definite as it is, but nearly."""
    return torch.tensor([[1.0, 1.0 + 1e-6], [1.0 + 1e-6, 1.0]], dtype=dtype)


def test_float32_policy_jitters_only_in_reduced_precision():
    M32 = _slightly_indefinite(torch.float32)
    assert int(torch.linalg.cholesky_ex(M32)[1]) != 0
    L = cholesky(M32, jitter="float32", what="precision")
    assert bool(torch.isfinite(L).all())
    torch.testing.assert_close(L @ L.T, M32, rtol=0, atol=1e-3)
    with pytest.raises(NotPositiveDefinite, match="precision is not positive definite in float64"):
        cholesky(M32.double(), jitter="float32", what="precision")
    # batched: only the failing entry is jittered, the others keep their exact factor
    good = torch.tensor([[2.0, 0.5], [0.5, 1.0]])
    Lb = cholesky(torch.stack([good, M32]), jitter="float32")
    assert torch.equal(Lb[0], torch.linalg.cholesky(good))
    assert torch.equal(Lb[1], L)


def test_float32_policy_gives_up_on_a_clearly_indefinite_matrix():
    M = torch.tensor([[1.0, 0.0], [0.0, -1.0]])
    with pytest.raises(NotPositiveDefinite, match="jitter up to 0.0001"):
        cholesky(M, jitter="float32")


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["f64", "f32"])
def test_grow_policy_factorises_a_rank_deficient_psd_matrix(dtype):
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=dtype)
    M = v @ v.T  # rank 2: the last pivot is exactly 0
    assert int(torch.linalg.cholesky_ex(M)[1]) != 0
    with pytest.raises(NotPositiveDefinite, match="covariance"):
        cholesky(M, what="covariance")
    L = cholesky(M, jitter="grow", what="covariance")
    assert bool(torch.isfinite(L).all())
    tol = 1e-8 if dtype == F64 else 1e-4
    torch.testing.assert_close(L @ L.T, M, rtol=0, atol=tol)


def test_grow_policy_gives_up_on_an_indefinite_matrix():
    M = torch.tensor([[1.0, 0.0], [0.0, -1.0]], dtype=F64)
    with pytest.raises(NotPositiveDefinite, match=r"covariance .*jitter up to 1e-05"):
        cholesky(M, jitter="grow", what="covariance")


def test_unknown_policy():
    with pytest.raises(ValueError, match="jitter must be"):
        cholesky(torch.eye(2), jitter="always")


def test_linear_gaussian_reexports_the_exception():
    from pyro_cvi.linear_gaussian import NotPositiveDefinite as Reexported

    assert Reexported is NotPositiveDefinite
