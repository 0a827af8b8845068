"""``probes.jacobian``: the matrix of a linear predictor ``X @ w`` read off autograd's record
equals the Jacobian by backward passes; every other graph takes the backward passes."""

import pytest
import torch

from pyro_cvi.model import probes
from pyro_cvi.model.kron_probes import kron_jacobian


def _loop(out, z):
    """The Jacobian row by row, by plain backward passes (the reference)."""
    rows = [torch.autograd.grad(o, z, retain_graph=True)[0] for o in out.reshape(-1)]
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("expand", [False, True], ids=["plain", "plate-expand"])
def test_a_linear_predictor_jacobian_is_its_matrix(dtype, expand):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(300, 7, generator=g, dtype=dtype)
    w = torch.randn(7, generator=g, dtype=dtype, requires_grad=True)
    out = X @ w
    if expand:
        out = out.expand(300)
    assert probes._matvec_jacobian(out, w) is not None
    J = probes.jacobian(out, w)
    torch.testing.assert_close(J, _loop(out, w), rtol=0, atol=0)
    torch.testing.assert_close(J, X, rtol=0, atol=0)
    assert J.data_ptr() != X.data_ptr()  # a copy: the user's data is not aliased


def _graphs():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(40, 5, generator=g, dtype=torch.float64)
    b = torch.randn(40, generator=g, dtype=torch.float64)
    w = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    Xg = X.clone().requires_grad_(True)
    return [
        ("offset", lambda: X @ w + b, w),
        ("scaled", lambda: X @ (2.0 * w), w),
        ("matrix needs grad", lambda: Xg @ w, w),
        ("broadcast expand", lambda: (X @ w).expand(3, 40), w),
        ("nonlinear", lambda: torch.tanh(X @ w), w),
    ]


@pytest.mark.parametrize("case", _graphs(), ids=lambda c: c[0])
def test_other_graphs_take_the_backward_passes(case):
    _, make, w = case
    out = make()
    assert probes._matvec_jacobian(out, w) is None
    torch.testing.assert_close(probes.jacobian(out, w), _loop(out, w), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tall", [True, False], ids=["tall", "wide"])
def test_every_strategy_gives_the_jacobian_of_the_backward_passes(tall, dtype):
    """Plain backward passes (rows, or columns of ``v -> A^T v`` for a tall Jacobian) and the
    batched passes give the row-by-row Jacobian, also with ``create_graph``."""
    g = torch.Generator().manual_seed(2)
    R, D = (300, 12) if tall else (12, 300)
    X = torch.randn(R, D, generator=g, dtype=dtype)
    w = torch.randn(D, generator=g, dtype=dtype, requires_grad=True)
    out = torch.tanh(X @ w) * X.sum(-1)
    ref = _loop(out, w)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for loop_below, loop_columns in ((10**6, 0), (0, 10**6), (0, 0)):  # loops, columns, batched
        J = probes.jacobian(out, w, loop_below=loop_below, loop_columns=loop_columns)
        torch.testing.assert_close(J, ref, **tol)
    s = torch.ones((), dtype=dtype, requires_grad=True)
    out = torch.tanh(X @ w) * s  # J(s) = s diag(1 - tanh^2) X: dJ.sum()/ds = J(1).sum()
    want = float(((1 - torch.tanh(X @ w.detach()) ** 2)[:, None] * X).sum())
    for loop_below, loop_columns in ((10**6, 0), (0, 10**6), (0, 0)):
        J = probes.jacobian(out, w, loop_below, loop_columns=loop_columns, create_graph=True)
        (ds,) = torch.autograd.grad(J.sum(), s)
        assert float(ds) == pytest.approx(want, rel=tol["rtol"] * 10)


def _softmax_regression(dtype, N=240, D=6, K=4, seed=3):
    g = torch.Generator().manual_seed(seed)
    X = torch.cat(
        [torch.randn(N, D - 1, generator=g, dtype=dtype), torch.ones(N, 1, dtype=dtype)], 1
    )
    W = torch.randn(D, K, generator=g, dtype=dtype, requires_grad=True)
    return X, W


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_softmax_regression_jacobian_is_read_from_few_columns(dtype):
    """Centred logits of ``Categorical(logits = X W)``: ``X (x) (I - 1 1^T / K)``, equal to the
    row-by-row Jacobian; ``jacobian`` takes that path and returns the same matrix."""
    X, W = _softmax_regression(dtype)
    K = W.shape[1]
    logits = torch.distributions.Categorical(logits=X @ W).logits
    out = logits - logits.mean(-1, keepdim=True)
    ref = _loop(out, W).flatten(1)
    kron = kron_jacobian(out, W, probes.rtol(out.dtype))
    assert kron is not None
    Xk, G = kron
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.kron(Xk, G), ref, **tol)
    # the factors are the design and the centring, up to one scale shared between them
    c = G[0, 0] / (1 - 1 / K)
    torch.testing.assert_close(G / c, torch.eye(K, dtype=dtype) - 1 / K, **tol)
    torch.testing.assert_close(Xk * c, X, **tol)
    torch.testing.assert_close(probes.jacobian(out, W, loop_below=10), ref, **tol)


def _not_kronecker():
    X, W = _softmax_regression(torch.float64)
    g = torch.Generator().manual_seed(4)
    X2 = torch.randn(X.shape, generator=g, dtype=torch.float64)
    c = torch.arange(1.0, W.shape[1] + 1, dtype=torch.float64)
    return [
        ("sum of two products", lambda: X @ W + (X2 @ W) * c, W),
        ("nonlinear", lambda: torch.tanh(X @ W), W),
        (
            "one entry off",
            lambda: X @ W + 1e-3 * W[2, 1] * (torch.arange(X.shape[0]) == 7)[:, None],
            W,
        ),
    ]


@pytest.mark.parametrize("case", _not_kronecker(), ids=lambda c: c[0])
def test_a_jacobian_that_is_not_a_kronecker_product_is_refused(case):
    _, make, W = case
    out = make()
    assert kron_jacobian(out, W, probes.rtol(out.dtype)) is None
    J = probes.jacobian(out, W, loop_below=10)
    torch.testing.assert_close(J, _loop(out, W).flatten(1), rtol=1e-12, atol=1e-12)
