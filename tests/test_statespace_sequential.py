"""The scalar sequential pass (``statespace.sequential``) on the problems a fit hands it step
after step: the transition rows of the last chain are reused only while the chain is equal
(in place changes and new chains are seen), and long chains of sites on the first coordinate
(a Markov GP) equal the tree in both dtypes."""

import pytest
import torch

from pyro_cvi.statespace import LinearGaussianChain, Matern32, kalman, sequential, smooth
from pyro_cvi.statespace.distribution import MarkovGP

D64 = torch.float64


def _gp_problem(T, seed, dtype=D64):
    chain = MarkovGP(torch.arange(T, dtype=D64) * 0.5, Matern32(4.0, 1.5)).chain
    g = torch.Generator().manual_seed(seed)
    eta = torch.zeros(T, 2, dtype=D64)
    eta[:, 0] = torch.randn(T, generator=g, dtype=D64)
    J = torch.zeros(T, 2, 2, dtype=D64)
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
def test_a_long_markov_gp_chain_equals_the_tree(lag_one, dtype):
    """At the longest chain the rule gives the scalar pass (``d = 2``): ``q`` equal to the
    tree's and the scan's (relative ``log Z``: it sums ``T`` terms)."""
    T = kalman.SEQUENTIAL_MAX_T[2]
    assert kalman.choose_smoother(T, 2) is kalman.SEQUENTIAL
    chain, eta, J = _gp_problem(T, seed=2, dtype=dtype)
    a = smooth(chain, eta, J, lag_one=lag_one)
    b = smooth(chain, eta, J, lag_one=lag_one, method=kalman.TREE)
    _assert_same(a, b, dtype)
    assert (a.cross is None) == (not lag_one)
