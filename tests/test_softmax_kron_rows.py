"""A softmax factor's sites with a Kronecker Jacobian ``A = X (x) G``: the natural parameters
summed over the pairs ``i <= j`` of features, and the logits' covariance blocks, equal the
dense rows' (rotated scalar rows, ``A`` as a matrix) and the brute-force sums over points."""

import pytest
import torch

from pyro_cvi.linear_gaussian import GaussianPrior, solve
from pyro_cvi.messages.softmax_sites import SoftmaxRows

F64 = torch.float64


def _problem(dtype, N=37, D=5, K=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, D, generator=g, dtype=F64)
    G = torch.randn(K, K, generator=g, dtype=F64)
    B = torch.randn(N, K, K, generator=g, dtype=F64)
    lam2 = -0.5 * (B @ B.mT + 0.1 * torch.eye(K, dtype=F64))  # negative definite sites
    lam1 = torch.randn(N, K, generator=g, dtype=F64)
    sites = torch.cat([lam1.unsqueeze(-1), lam2], -1)
    c = 0.3 * torch.randn(N * K, generator=g, dtype=F64)
    A = torch.kron(X, G)
    ones = torch.ones(N, dtype=F64)
    Y = torch.nn.functional.one_hot(torch.arange(N) % K, K).to(F64)
    args = (c, K, Y, ones, ones, torch.zeros(N, dtype=F64))
    dense = SoftmaxRows(A.to(dtype), *(a.to(dtype) if torch.is_tensor(a) else a for a in args))
    kron = SoftmaxRows(
        A.to(dtype),
        *(a.to(dtype) if torch.is_tensor(a) else a for a in args),
        kron=(X.to(dtype), G.to(dtype)),
    )
    return dense, kron, sites.to(dtype), X, G, lam2


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_kronecker_natural_parameters_and_covariance_blocks_equal_the_dense_ones(dtype):
    dense, kron, sites, X, G, lam2 = _problem(dtype)
    N, D = X.shape
    K = G.shape[0]
    *_, nat = kron.rows(sites)
    h, P = nat
    # brute force: P = sum_n (x_n (x) G)^T W_n (x_n (x) G), W_n = -2 lam2_n
    ref = sum(
        torch.kron(X[n : n + 1], G).mT @ (-2 * lam2[n]) @ torch.kron(X[n : n + 1], G)
        for n in range(N)
    )
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == F64 else dict(rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(P.double(), ref, **tol)
    prior = GaussianPrior(
        torch.zeros(D * K, dtype=dtype), var=torch.full((D * K,), 0.7, dtype=dtype)
    )
    A_rot, w, b, U, none = dense.rows(sites)
    assert none is None
    q_dense = solve(prior, A_rot, w, b)
    q_kron = solve(prior, A_rot[:0], w[:0], b[:0], h, P)
    torch.testing.assert_close(q_kron.loc, q_dense.loc, **tol)
    torch.testing.assert_close(q_kron.covariance(), q_dense.covariance(), **tol)
    q_dense.blocks = [(None, slice(0, N * K))]
    cov_dense = dense.cov_blocks(q_dense, slice(0, N * K), U)
    cov_kron = kron.cov_blocks(q_kron, slice(0, N * K), None)
    S = q_dense.covariance().double()
    An = kron.A.double().reshape(N, K, D * K)
    torch.testing.assert_close(cov_kron.double(), An @ S @ An.mT, **tol)
    torch.testing.assert_close(cov_kron, cov_dense, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_a_probed_kronecker_product_keeps_its_factors_until_edited(dtype):
    """The Jacobian probe's dense ``X (x) G`` gives its own factors (exact) and products
    ``A v`` by them; once ``A`` is edited in place it is read entry by entry again (and
    refused when it is no longer a product)."""
    from pyro_cvi.messages.softmax_sites import kron_factors
    from pyro_cvi.model.kron_probes import kron_factors_of, kron_product, matvec

    g = torch.Generator().manual_seed(3)
    X = torch.randn(9, 3, generator=g, dtype=F64).to(dtype)
    G = torch.randn(4, 4, generator=g, dtype=F64).to(dtype)
    A = kron_product(X, G)
    assert kron_factors_of(A) == (X, G)
    assert kron_factors(A, 4) == (X, G)
    v = torch.randn(12, generator=g, dtype=F64).to(dtype)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(matvec(A, v), A @ v, **tol)
    B = kron_product(X, G)
    B[0, 0] += 1.0  # no longer a Kronecker product
    assert kron_factors_of(B) is None
    assert kron_factors(B, 4) is None
    torch.testing.assert_close(matvec(B, v), B @ v, **tol)
    assert kron_factors_of(A.clone()) is None  # (a copy is not known as one)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_the_probed_product_is_torch_kron_bit_for_bit(dtype):
    from pyro_cvi.model.kron_probes import kron_product

    g = torch.Generator().manual_seed(4)
    X = torch.randn(7, 3, generator=g, dtype=F64).to(dtype)
    G = torch.randn(4, 5, generator=g, dtype=F64).to(dtype)
    assert torch.equal(kron_product(X, G), torch.kron(X, G))
