"""The Monte Carlo softmax moments without a graph (written in place) equal those with one."""

import pytest
import torch

from pyro_cvi.messages.softmax import contrasts, lse_expectations


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_moments_without_a_graph_equal_those_with_one_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(4)
    N, K, S = 9, 5, 12
    mean = 3 * torch.randn(N, K, generator=g, dtype=torch.float64).to(dtype)
    A = torch.randn(N, K, K, generator=g, dtype=torch.float64).to(dtype)
    cov = A @ A.mT + 0.1 * torch.eye(K, dtype=dtype)
    eps = torch.randn(S // 2, N, K, generator=g, dtype=torch.float64).to(dtype)
    plain = lse_expectations(mean, cov, "mc", num_samples=S, draws=eps)
    m, c = mean.clone().requires_grad_(True), cov.clone().requires_grad_(True)
    graph = lse_expectations(m, c, "mc", num_samples=S, draws=eps)
    assert graph.value.requires_grad and not plain.value.requires_grad
    for a, b in zip((plain.value, plain.grad, plain.hess), (graph.value, graph.grad, graph.hess)):
        assert torch.equal(a, b.detach())
    # the value's graph: d E[lse] / d mean is E[softmax] (Bonnet), here of the same draws
    (dm,) = torch.autograd.grad(graph.value.sum(), m)
    torch.testing.assert_close(dm, plain.grad)
    # and a brute-force average over the same antithetic draws (in the K - 1 logit contrasts)
    Q = contrasts(K, dtype)
    L = torch.linalg.cholesky(Q.mT @ cov @ Q)
    d = (L @ eps[..., : K - 1].unsqueeze(-1)).squeeze(-1) @ Q.mT
    eta = torch.cat([mean + d, mean - d])
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(plain.grad, eta.softmax(-1).mean(0), **tol)
