"""The Laplace start of a block whose only likelihood is a softmax regression: ``q`` after
set-up is the Laplace approximation at the mode, against an independent Newton iteration with
the exact Hessian; the mode by L-BFGS matches it with a dense prior and a dense Jacobian too."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_cvi import AutoCVI
from pyro_cvi.linear_gaussian import GaussianPrior
from pyro_cvi.messages.softmax_sites import SoftmaxRows, kron_factors
from pyro_cvi.messages.warm_start import softmax_mode

F64 = torch.float64
K = 3


def _data(dtype, N=150, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.cat([torch.randn(N, D - 1, generator=g, dtype=F64), torch.ones(N, 1, dtype=F64)], 1)
    W = 1.5 * torch.randn(D, K, generator=g, dtype=F64)
    y = torch.distributions.Categorical(logits=X @ W).sample()
    return X.to(dtype), y


def _model(X, y):
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1], K), 0.8).to_event(2))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Categorical(logits=X @ w), obs=y)


def _newton(X, y, P0):
    """The mode of ``-w^T P0 w / 2 + sum_n log softmax(x_n^T W)_{y_n}`` and the Hessian of the
    negative log joint there, by Newton's method in float64 (the reference)."""
    X = X.double()
    N, D = X.shape
    Y = torch.nn.functional.one_hot(y, K).double()
    w = torch.zeros(D * K, dtype=F64)
    for _ in range(50):
        P = (X @ w.reshape(D, K)).softmax(-1)
        g = (X.T @ (P - Y)).reshape(-1) + P0 @ w
        Hn = torch.diag_embed(P) - P[:, :, None] * P[:, None, :]
        H = torch.einsum("nd,ne,nkl->dkel", X, X, Hn).reshape(D * K, D * K) + P0
        w = w - torch.linalg.solve(H, g)
        if float(g.abs().max()) < 1e-12:
            break
    return w, H


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_set_up_starts_q_at_the_laplace_approximation(dtype):
    """Mean: the mode (its centred logits ``W (I - 1 1^T / K)``; the shift along ``1`` is the
    prior's); covariance: ``(-hess L)^-1``. The sites are the log-likelihood's second-order
    expansion at the L-BFGS mode, so ``q``'s mean is one Newton step from it: the mode to
    round-off in float64 (1e-9), and the covariance the inverse Hessian there (1e-7)."""
    X, y = _data(dtype)
    D = X.shape[1]
    pyro.clear_param_store()
    guide = AutoCVI(_model)
    guide(X, y)
    q = guide.posterior("w")
    q = q.base_dist if hasattr(q, "base_dist") else q
    w, H = _newton(X, y, torch.eye(D * K, dtype=F64) / 0.64)
    C = torch.eye(K, dtype=F64) - 1.0 / K
    m = q.loc.double().reshape(D, K)
    tol = 1e-9 if dtype == F64 else 2e-3
    torch.testing.assert_close(m @ C, w.reshape(D, K) @ C, rtol=tol, atol=tol)
    torch.testing.assert_close(m.sum(-1), w.reshape(D, K).sum(-1), rtol=tol, atol=tol)
    S = q.covariance_matrix.double()
    tol = 1e-7 if dtype == F64 else 5e-3  # (the reference's Hessian: at its last iterate but one)
    torch.testing.assert_close(S, torch.linalg.inv(H), rtol=tol, atol=tol * float(S.abs().max()))


def _rows(X, y, dense: bool):
    N, D = X.shape
    A = torch.kron(X, torch.eye(K, dtype=X.dtype) - 1.0 / K)
    Y = torch.nn.functional.one_hot(y, K).to(X.dtype)
    ones = X.new_ones(N)
    kron = None if dense else kron_factors(A, K)
    assert dense or kron is not None
    return SoftmaxRows(A, A.new_zeros(N * K), K, Y, ones, ones, X.new_zeros(N), kron)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("dense", [False, True], ids=["kron", "dense"])
def test_the_mode_by_lbfgs_is_newtons(dtype, dense):
    """Diagonal prior with a Kronecker Jacobian, and a dense prior precision with a dense one:
    the L-BFGS mode equals Newton's to ``rtol`` of the problem."""
    X, y = _data(dtype, seed=1)
    D = X.shape[1]
    g = torch.Generator().manual_seed(2)
    if dense:
        B = torch.randn(D * K, D * K, generator=g, dtype=F64) / (D * K) ** 0.5
        P0 = B @ B.T + torch.eye(D * K, dtype=F64)
        prior = GaussianPrior(torch.zeros(D * K, dtype=dtype), precision=P0.to(dtype))
    else:
        v = 0.5 + torch.rand(D * K, generator=g, dtype=F64)
        P0 = torch.diag(1 / v)
        prior = GaussianPrior(torch.zeros(D * K, dtype=dtype), var=v.to(dtype))
    m = softmax_mode(prior, [(None, _rows(X, y, dense))])
    w, _ = _newton(X, y, P0)
    assert m is not None and m.dtype == dtype
    tol = 1e-5 if dtype == F64 else 3e-3
    torch.testing.assert_close(m.double(), w, rtol=tol, atol=tol)


def _plug_in_log_loss(W, X, y):
    return float(-(X.double() @ W.double()).log_softmax(-1)[torch.arange(len(y)), y].mean())


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_the_first_call_leaves_q_at_the_laplace_approximation(dtype):
    """The Laplace start is the first step: after the first ``svi.step`` (any step size)
    ``q``'s mean is still the mode, so its plug-in predictions are MAP's (the same log-loss
    as Newton's mode, 1e-10 in float64), and the second call returns the same loss (the same
    ``q``) before the steps move it to the CVI fixed point (a lower -ELBO)."""
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO

    X, y = _data(dtype)
    D = X.shape[1]
    w, _ = _newton(X, y, torch.eye(D * K, dtype=F64) / 0.64)
    for optim in (CVI(), CVI(step_size=1.0)):
        pyro.clear_param_store()
        guide = AutoCVI(_model)
        svi = SVI(_model, guide, optim, loss=CVI_ELBO())
        first = svi.step(X, y)
        m = guide.posterior("w").mean.reshape(D, K)
        tol = 1e-10 if dtype == F64 else 1e-4
        assert abs(_plug_in_log_loss(m, X, y) - _plug_in_log_loss(w.reshape(D, K), X, y)) < tol
        second = svi.step(X, y)
        assert second == pytest.approx(first, rel=1e-12 if dtype == F64 else 1e-6)
        losses = [svi.step(X, y) for _ in range(8)]
        assert min(losses) < first - 0.1
        m8 = guide.posterior("w").mean.reshape(D, K)
        assert float((m8.double() - m.double()).abs().max()) > 1e-3  # the steps move q


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_a_softmax_block_with_another_likelihood_steps_at_the_first_call(dtype):
    """Where the block has a likelihood factor beside the softmax one, it keeps the prior-mean
    start and the first call steps ``q`` (its mean moves)."""
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO

    X, y = _data(dtype)
    D = X.shape[1]
    z = X @ torch.linspace(-1.0, 1.0, D, dtype=dtype)

    def model(X, y, z):
        w = pyro.sample("w", dist.Normal(X.new_zeros(D, K), 0.8).to_event(2))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Categorical(logits=X @ w), obs=y)
            pyro.sample("z", dist.Normal((X @ w).sum(-1), 1.0), obs=z)

    pyro.clear_param_store()
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
    guide(X, y, z)
    before = guide.posterior("w").mean.clone()
    svi.step(X, y, z)
    assert float((guide.posterior("w").mean - before).abs().max()) > 1e-3
