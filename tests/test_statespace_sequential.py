"""The scalar sequential pass (``statespace.sequential``) on the problems a fit hands it step
after step: the transition rows of the last chain are reused only while the chain is equal
(in place changes and new chains are seen), and long chains of sites on the first coordinate
(a Markov GP) equal the tree in both dtypes."""

import pytest
import torch

from pyro_cvi.statespace import LinearGaussianChain, Matern12, Matern32, kalman, sequential, smooth
from pyro_cvi.statespace.distribution import MarkovGP

D64 = torch.float64


def _gp_problem(T, seed, dtype=D64, d=2):
    kernel = Matern32(4.0, 1.5) if d == 2 else Matern12(4.0, 1.5)
    chain = MarkovGP(torch.arange(T, dtype=D64) * 0.5, kernel).chain
    g = torch.Generator().manual_seed(seed)
    eta = torch.zeros(T, d, dtype=D64)
    eta[:, 0] = torch.randn(T, generator=g, dtype=D64)
    J = torch.zeros(T, d, d, dtype=D64)
    J[:, 0, 0] = torch.rand(T, generator=g, dtype=D64) * 2.0 + 0.1
    cast = LinearGaussianChain(*(t.to(dtype) for t in chain.tensors()))
    return cast, eta.to(dtype), J.to(dtype)


def _assert_same(a, b, dtype):
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == D64 else dict(rtol=2e-4, atol=2e-4)
    for x, y in [(a.log_z, b.log_z), (a.mean, b.mean), (a.cov, b.cov)]:
        torch.testing.assert_close(x.double(), y.double(), **tol)
    if a.cross is not None or b.cross is not None:
        torch.testing.assert_close(a.cross.double(), b.cross.double(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, D64], ids=["f32", "f64"])
def test_reused_transitions_follow_changes_of_the_chain(dtype):
    """The same chain twice: its rows are reused (one object); ``A`` changed in place, ``Q``
    replaced, or another length: the pass sees the change and equals the tree every time."""
    chain, eta, J = _gp_problem(40, seed=1, dtype=dtype)
    A = chain.A.clone()
    chain = LinearGaussianChain(chain.m0, chain.P0, A, chain.b, chain.Q)
    first = sequential._rows(chain, eta, J, 2)[2]
    assert sequential._rows(chain.detach(), eta, J, 2)[2] is first
    for change in ("in place", "new Q", "shorter"):
        if change == "in place":
            A[7, 0, 1] += 0.01
        elif change == "new Q":
            chain = LinearGaussianChain(chain.m0, chain.P0, A, chain.b, 0.9 * chain.Q)
        else:
            chain = LinearGaussianChain(chain.m0, chain.P0, A[:-5], chain.b[:-5], chain.Q[:-5])
            eta, J = eta[:-5], J[:-5]
        assert sequential._rows(chain, eta, J, 2)[2] is not first
        a = smooth(chain, eta, J, lag_one=True, method=kalman.SEQUENTIAL)
        b = smooth(chain, eta, J, lag_one=True, method=kalman.TREE)
        _assert_same(a, b, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, D64], ids=["f32", "f64"])
@pytest.mark.parametrize("lag_one", [False, True])
@pytest.mark.parametrize("d", [1, 2])
def test_a_long_markov_gp_chain_equals_the_tree(d, lag_one, dtype):
    """At the longest chain the rule gives the scalar pass (Matern-1/2: ``d = 1``, Matern-3/2:
    ``d = 2``): ``q`` equal to the tree's (relative ``log Z``: it sums ``T`` terms)."""
    T = kalman.SEQUENTIAL_MAX_T[d]
    assert kalman.choose_smoother(T, d) is kalman.SEQUENTIAL
    chain, eta, J = _gp_problem(T, seed=2, dtype=dtype, d=d)
    a = smooth(chain, eta, J, lag_one=lag_one)
    b = smooth(chain, eta, J, lag_one=lag_one, method=kalman.TREE)
    _assert_same(a, b, dtype)
    assert (a.cross is None) == (not lag_one)


@pytest.mark.parametrize("dtype", [torch.float32, D64], ids=["f32", "f64"])
def test_a_longer_markov_gp_chain_takes_the_tree_with_a_scalar_top(dtype):
    """Past the scalar pass's rule, a GP chain (sites on the first coordinate: the tree's
    leaves for them) takes the tree with a scalar top: ``q`` equal to the tree's."""
    T = 2 * kalman.PACK_BELOW + 3
    assert kalman.choose_smoother(T, 2) is kalman.TREE_SCALAR
    chain, eta, J = _gp_problem(T, seed=4, dtype=dtype)
    a = smooth(chain, eta, J, lag_one=True)
    b = smooth(chain, eta, J, lag_one=True, method=kalman.TREE)
    _assert_same(a, b, dtype)


def _general_problem(T, d, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    A = 0.9 * torch.eye(d, dtype=D64) + 0.05 * torch.randn(T - 1, d, d, generator=g, dtype=D64)
    chain = LinearGaussianChain(
        torch.randn(d, generator=g, dtype=D64),
        torch.eye(d, dtype=D64),
        A,
        0.1 * torch.randn(T - 1, d, generator=g, dtype=D64),
        0.2 * torch.eye(d, dtype=D64).expand(T - 1, d, d),
    )
    eta = torch.randn(T, d, generator=g, dtype=D64)
    J = torch.diag_embed(torch.rand(T, d, generator=g, dtype=D64) + 0.1)
    cast = LinearGaussianChain(*(t.to(dtype) for t in chain.tensors()))
    return cast, eta.to(dtype), J.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, D64], ids=["f32", "f64"])
@pytest.mark.parametrize("lag_one", [False, True])
@pytest.mark.parametrize("kind", ["gp", "d1", "d2"])
def test_smooth_without_graph_equals_the_sequential_strategy_bit_for_bit(kind, lag_one, dtype):
    """``smooth``'s own path for the scalar pass (its output laid out without the tensor
    strategies' reshaping) returns the numbers ``method=SEQUENTIAL`` returns, bit for bit, in the
    same dtypes and shapes, without graph; a chain whose covariance is kept (all sites zero)
    still gets the prior's closed form."""
    for T in (1, 2, 3, 60):
        if kind == "gp":
            chain, eta, J = _gp_problem(T, seed=T, dtype=dtype)
        else:
            chain, eta, J = _general_problem(T, 1 if kind == "d1" else 2, seed=T, dtype=dtype)
        assert kalman.choose_smoother(T, eta.shape[-1]) is kalman.SEQUENTIAL
        a = smooth(chain, eta, J, lag_one=lag_one)
        b = smooth(chain, eta, J, lag_one=lag_one, method=kalman.SEQUENTIAL)
        for x, y in [(a.log_z, b.log_z), (a.mean, b.mean), (a.cov, b.cov), (a.cross, b.cross)]:
            if y is None:
                assert x is None
                continue
            assert x.dtype == y.dtype == dtype and x.shape == y.shape and not x.requires_grad
            assert torch.equal(x, y)
        if T > 1:  # the same problem through the tree, to the dtype's rounding
            _assert_same(a, smooth(chain, eta, J, lag_one=lag_one, method=kalman.TREE), dtype)
    gp = MarkovGP(torch.arange(30, dtype=D64), Matern32(4.0, 1.5)).chain
    gp = LinearGaussianChain(*(t.to(dtype) for t in gp.tensors()))
    zero, J0 = torch.zeros(30, 2, dtype=dtype), torch.zeros(30, 2, 2, dtype=dtype)
    prior = smooth(gp, zero, J0, lag_one=lag_one)
    closed = kalman._stationary_prior(gp, zero, J0)
    if dtype == D64:  # (float32's rounding of A P0 A' + Q misses the closed form's 1e-12)
        assert closed is not None and prior.log_z.item() == 0.0
        assert torch.equal(prior.cov, gp.P0.expand(30, 2, 2))  # (exact)
    else:
        assert closed is None
        same = smooth(gp, zero, J0, lag_one=lag_one, method=kalman.SEQUENTIAL)
        assert torch.equal(prior.cov, same.cov) and torch.equal(prior.mean, same.mean)


@pytest.mark.parametrize("dtype", [torch.float32, D64], ids=["f32", "f64"])
def test_smooth_without_graph_still_rejects_a_q_that_is_not_positive_definite(dtype):
    """A site with negative curvature beyond the prior's (``1 + P J <= 0``): the pass hands the
    problem on and ``smooth`` raises ``NotPositiveDefinite``, as with the strategy named."""
    chain, eta, J = _gp_problem(20, seed=3, dtype=dtype)
    J[7, 0, 0] = -50.0
    for method in (None, kalman.SEQUENTIAL):
        with pytest.raises(kalman.NotPositiveDefinite):
            smooth(chain, eta, J, method=method)


def _outcome(f):
    try:
        out = f()
    except kalman.NotPositiveDefinite as e:
        return ("raised", str(e))
    return ("value", out.log_z, out.mean, out.cov)


@pytest.mark.parametrize("dtype", [torch.float32, D64], ids=["f32", "f64"])
@pytest.mark.parametrize("where", ["eta", "J"])
@pytest.mark.parametrize("value", [1e12, 1e30, 1e250, -1e300, float("inf"), float("nan")])
def test_smooth_without_graph_fails_as_the_sequential_strategy_does(value, where, dtype):
    """Extreme or non-finite sites (a large precision, one that overflows, NaN): ``smooth``'s
    own path for the scalar pass returns the same numbers, or raises the same
    ``NotPositiveDefinite`` with the same message, as ``method=SEQUENTIAL``."""
    chain, eta, J = _gp_problem(20, seed=4, dtype=D64)
    (eta[7, :1] if where == "eta" else J[7, 0, :1]).fill_(value)
    chain = LinearGaussianChain(*(t.to(dtype) for t in chain.tensors()))
    eta, J = eta.to(dtype), J.to(dtype)
    a = _outcome(lambda: smooth(chain, eta, J))
    b = _outcome(lambda: smooth(chain, eta, J, method=kalman.SEQUENTIAL))
    assert a[0] == b[0]
    if a[0] == "raised":
        assert a[1] == b[1]
    else:
        assert all(torch.equal(x, y) for x, y in zip(a[1:], b[1:]))
