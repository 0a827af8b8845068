"""The explicit forward-backward Kalman smoother (``statespace.kalman.smooth``) against a dense
Gaussian computation: ``log Z``, marginals, lag-one covariances, in float32 and float64, both
storage forms, odd and even lengths, batched chains, and gradients with ``keep_graph``."""

import pytest
import torch

from pyro_cvi.statespace import LinearGaussianChain, kalman, smooth
from pyro_cvi.statespace.kalman import NotPositiveDefinite, log_normalizer

D64 = torch.float64


def _chain(T, d, seed=0, batch=()):
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*batch, *s, generator=g, dtype=D64)

    def spd(*s):
        M = r(*s, d, d)
        return M @ M.transpose(-1, -2) / d + 0.3 * torch.eye(d, dtype=D64)

    chain = LinearGaussianChain(r(d), spd(), 0.7 * r(T - 1, d, d), r(T - 1, d), spd(T - 1))
    return chain, r(T, d), spd(T)


def _dense(chain, eta, J):
    """``log Z``, mean, full covariance of ``q`` from the joint precision of ``x`` (T d)."""
    A, b, C = chain.all_steps()
    T, d = eta.shape
    n = T * d
    # x = L^-1 (b + noise): x_t - A_t x_{t-1} = b_t + w_t
    Lm = torch.eye(n, dtype=D64)
    for t in range(1, T):
        Lm[t * d : (t + 1) * d, (t - 1) * d : t * d] = -A[t]
    Ci = torch.block_diag(*torch.linalg.inv(C))
    P = Lm.T @ Ci @ Lm + torch.block_diag(*J)
    h = Lm.T @ Ci @ b.reshape(-1) + eta.reshape(-1)
    cov = torch.linalg.inv(P)
    mean = cov @ h
    log_z = (
        0.5 * h @ mean
        - 0.5 * torch.logdet(P)
        - 0.5 * torch.logdet(C).sum()
        - 0.5 * (b.reshape(-1) @ Ci @ b.reshape(-1))
    )
    return log_z, mean.reshape(T, d), cov


def _blocks(cov, T, d, lag):
    out = [cov[t * d : (t + 1) * d, (t - lag) * d : (t - lag + 1) * d] for t in range(lag, T)]
    return torch.stack(out) if out else cov.new_zeros(0, d, d)


@pytest.mark.parametrize("dtype", [torch.float32, D64], ids=["f32", "f64"])
@pytest.mark.parametrize("pack_below", [0, 2048], ids=["arrays", "packed"])
@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("T", [1, 2, 7, 37])
def test_smoother_equals_dense(T, d, pack_below, dtype, monkeypatch):
    monkeypatch.setattr(kalman, "PACK_BELOW", pack_below)
    chain, eta, J = _chain(T, d, seed=T * 10 + d)
    log_z, mean, cov = _dense(chain, eta, J)
    cast = LinearGaussianChain(*(t.to(dtype) for t in chain.tensors()))
    post = smooth(cast, eta.to(dtype), J.to(dtype), lag_one=True)
    assert post.mean.dtype == dtype and post.cov.dtype == dtype
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == D64 else dict(rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(post.log_z.double(), log_z, **tol)
    torch.testing.assert_close(post.mean.double(), mean, **tol)
    torch.testing.assert_close(post.cov.double(), _blocks(cov, T, d, 0), **tol)
    torch.testing.assert_close(
        post.cross.double(), _blocks(cov, T, d, 1).reshape(T - 1, d, d), **tol
    )
    torch.testing.assert_close(
        log_normalizer(cast, eta.to(dtype), J.to(dtype)).double(), log_z, **tol
    )


def test_batched_chains_equal_one_by_one():
    T, d, B = 13, 2, (3, 2)
    chain, eta, J = _chain(T, d, seed=5, batch=B)
    post = smooth(chain, eta, J, lag_one=True)
    assert post.mean.shape == B + (T, d) and post.cov.shape == B + (T, d, d)
    assert post.cross.shape == B + (T - 1, d, d) and post.log_z.shape == B
    for i in range(B[0]):
        for j in range(B[1]):
            one = LinearGaussianChain(*(t[i, j] for t in chain.tensors()))
            p = smooth(one, eta[i, j], J[i, j], lag_one=True)
            torch.testing.assert_close(post.mean[i, j], p.mean, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(post.cov[i, j], p.cov, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(post.cross[i, j], p.cross, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(post.log_z[i, j], p.log_z, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pack_below", [0, 2048], ids=["arrays", "packed"])
def test_keep_graph_gradients_equal_the_dense_gradients(pack_below, monkeypatch):
    """With ``keep_graph`` the pass is differentiable: d(log Z + sum of moments)/d(chain)
    equals autograd through the dense computation."""
    monkeypatch.setattr(kalman, "PACK_BELOW", pack_below)
    T, d = 11, 2
    chain, eta, J = _chain(T, d, seed=3)
    leaves = [t.clone().requires_grad_(True) for t in chain.tensors()]

    def objective(post_like):
        log_z, mean, var = post_like
        return log_z + (mean**2).sum() + var.sum()

    post = smooth(LinearGaussianChain(*leaves), eta, J, keep_graph=True)
    var = post.cov.diagonal(dim1=-2, dim2=-1)
    g_new = torch.autograd.grad(objective((post.log_z, post.mean, var)), leaves)
    log_z, mean, cov = _dense(LinearGaussianChain(*leaves), eta, J)
    g_ref = torch.autograd.grad(
        objective((log_z, mean, cov.diagonal().reshape(T, d))), leaves, allow_unused=True
    )
    for k, (a, b) in enumerate(zip(g_new, g_ref)):
        b = torch.zeros_like(a) if b is None else b
        if k in (1, 4):  # P0, Q: symmetric, only the symmetrised gradient is defined
            a, b = a + a.transpose(-1, -2), b + b.transpose(-1, -2)
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_without_keep_graph_nothing_records_a_graph():
    chain, eta, J = _chain(9, 2)
    leaves = [t.clone().requires_grad_(True) for t in chain.tensors()]
    post = smooth(LinearGaussianChain(*leaves), eta.requires_grad_(True), J, lag_one=True)
    assert not any(t.requires_grad for t in (post.log_z, post.mean, post.cov, post.cross))


def test_an_indefinite_q_raises():
    chain, eta, J = _chain(9, 2)
    with pytest.raises(NotPositiveDefinite):
        smooth(chain, eta, -50.0 * J)


# ---------------------------------------------------------------- the associative scan
def _sequential(chain, eta, J):
    """An independent reference: the textbook forward Kalman filter (sites as information
    updates, ``log Z`` by the chain rule of the sites' marginal likelihoods) and the RTS
    backward pass, one step at a time."""
    A, b, C = chain.all_steps()
    T, d = eta.shape
    mf, Pf, mp, Pp = [], [], [], []
    log_z = eta.new_zeros(())
    m, P = b[0], C[0]
    for t in range(T):
        if t > 0:
            m, P = A[t] @ mf[-1] + b[t], A[t] @ Pf[-1] @ A[t].T + C[t]
        mp.append(m)
        Pp.append(P)
        Pi = torch.linalg.inv(P)
        S = torch.linalg.inv(Pi + J[t])
        h = Pi @ m + eta[t]
        mu = S @ h
        log_z = log_z + 0.5 * (h @ mu - m @ Pi @ m)
        log_z = log_z + 0.5 * (torch.logdet(S) - torch.logdet(P))
        mf.append(mu)
        Pf.append(0.5 * (S + S.T))
    ms, Ps, cross = [mf[-1]], [Pf[-1]], []
    for t in range(T - 2, -1, -1):
        G = Pf[t] @ A[t + 1].T @ torch.linalg.inv(Pp[t + 1])
        ms.insert(0, mf[t] + G @ (ms[0] - mp[t + 1]))
        cross.insert(0, Ps[0] @ G.T)  # Cov(x_{t+1}, x_t)
        Ps.insert(0, Pf[t] + G @ (Ps[0] - Pp[t + 1]) @ G.T)
    stack = torch.stack
    return log_z, stack(ms), stack(Ps), stack(cross) if cross else eta.new_zeros(0, d, d)


METHODS = [
    kalman.TREE,
    kalman.SCAN,
    kalman.SEQUENTIAL,
    kalman.TREE_SCALAR,
    kalman.TreeScalarSmoother(4),
]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
@pytest.mark.parametrize("dtype", [torch.float32, D64], ids=["f32", "f64"])
@pytest.mark.parametrize("d", [1, 2, 3, 4])
@pytest.mark.parametrize("T", [1, 2, 3, 7, 64])
def test_both_smoothers_equal_dense(T, d, dtype, method):
    chain, eta, J = _chain(T, d, seed=T * 10 + d)
    log_z, mean, cov = _dense(chain, eta, J)
    cast = LinearGaussianChain(*(t.to(dtype) for t in chain.tensors()))
    post = smooth(cast, eta.to(dtype), J.to(dtype), lag_one=True, method=method)
    assert post.mean.dtype == dtype and post.cov.dtype == dtype
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == D64 else dict(rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(post.log_z.double(), log_z, **tol)
    torch.testing.assert_close(post.mean.double(), mean, **tol)
    torch.testing.assert_close(post.cov.double(), _blocks(cov, T, d, 0), **tol)
    torch.testing.assert_close(
        post.cross.double(), _blocks(cov, T, d, 1).reshape(T - 1, d, d), **tol
    )


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
@pytest.mark.parametrize("dtype", [torch.float32, D64], ids=["f32", "f64"])
@pytest.mark.parametrize("d", [1, 2, 3, 5])
@pytest.mark.parametrize("T", [1, 2, 3, 7, 64, 1000])
def test_both_smoothers_equal_the_sequential_filter_and_rts(T, d, dtype, method):
    """Against the one-step-at-a-time Kalman filter and RTS smoother, in float64 (a long
    chain's ``log Z`` sums ``T`` terms: relative tolerance there)."""
    chain, eta, J = _chain(T, d, seed=T + 100 * d)
    log_z, mean, cov, cross = _sequential(chain, eta, J)
    cast = LinearGaussianChain(*(t.to(dtype) for t in chain.tensors()))
    post = smooth(cast, eta.to(dtype), J.to(dtype), lag_one=True, method=method)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == D64 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(post.log_z.double(), log_z, **tol)
    torch.testing.assert_close(post.mean.double(), mean, **tol)
    torch.testing.assert_close(post.cov.double(), cov, **tol)
    torch.testing.assert_close(post.cross.double(), cross, **tol)


def test_the_scan_on_batched_chains_equals_the_tree():
    T, d, B = 13, 3, (3, 2)
    chain, eta, J = _chain(T, d, seed=7, batch=B)
    a = smooth(chain, eta, J, lag_one=True, method=kalman.SCAN)
    b = smooth(chain, eta, J, lag_one=True, method=kalman.TREE)
    for x, y in [(a.log_z, b.log_z), (a.mean, b.mean), (a.cov, b.cov), (a.cross, b.cross)]:
        assert x.shape == y.shape
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_the_scan_keeps_the_graph_and_its_gradients_equal_the_dense_ones():
    T, d = 11, 2
    chain, eta, J = _chain(T, d, seed=3)
    leaves = [t.clone().requires_grad_(True) for t in chain.tensors()]
    eta = eta.clone().requires_grad_(True)

    def objective(log_z, mean, var):
        return log_z + (mean**2).sum() + var.sum()

    post = smooth(LinearGaussianChain(*leaves), eta, J, keep_graph=True, method=kalman.SCAN)
    var = post.cov.diagonal(dim1=-2, dim2=-1)
    g_new = torch.autograd.grad(objective(post.log_z, post.mean, var), leaves + [eta])
    log_z, mean, cov = _dense(LinearGaussianChain(*leaves), eta, J)
    g_ref = torch.autograd.grad(
        objective(log_z, mean, cov.diagonal().reshape(T, d)), leaves + [eta], allow_unused=True
    )
    for k, (a, b) in enumerate(zip(g_new, g_ref)):
        b = torch.zeros_like(a) if b is None else b
        if k in (1, 4):  # P0, Q: symmetric, only the symmetrised gradient is defined
            a, b = a + a.transpose(-1, -2), b + b.transpose(-1, -2)
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_the_scan_raises_on_an_indefinite_q():
    chain, eta, J = _chain(9, 2)
    with pytest.raises(NotPositiveDefinite):
        smooth(chain, eta, -50.0 * J, method=kalman.SCAN)


def test_the_rule_picks_the_tree_for_long_chains_and_large_states():
    assert kalman.choose_smoother(10**6, 2) is kalman.TREE_SCALAR
    assert kalman.choose_smoother(10**6, 3) is kalman.TREE
    assert kalman.choose_smoother(64, 8) is kalman.TREE
    assert kalman.tensor_smoother(1, 1) is kalman.TREE
    for d, T in kalman.SCAN_MAX_T.items():
        assert kalman.tensor_smoother(T, d) is kalman.SCAN
        assert kalman.tensor_smoother(kalman.SCAN_MIN_T, d) is kalman.SCAN
        assert kalman.tensor_smoother(T + 1, d) is kalman.TREE
        if d not in kalman.SEQUENTIAL_MAX_T:
            assert kalman.choose_smoother(T, d) is kalman.SCAN
    for d, T in kalman.SEQUENTIAL_MAX_T.items():
        assert kalman.choose_smoother(1, d) is kalman.SEQUENTIAL
        assert kalman.choose_smoother(T, d) is kalman.SEQUENTIAL
        assert kalman.choose_smoother(T + 1, d) is kalman.TREE_SCALAR


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_sites_on_the_whole_state_take_the_tree_earlier(dtype, monkeypatch):
    """``d = 2`` past ``SEQUENTIAL_FULL_SITES_MAX_T``: sites on the whole state go to the tree
    with a scalar top, sites on the first coordinate stay with the scalar pass (to
    ``SEQUENTIAL_MAX_T``); the answer is the scalar pass's, to rounding."""
    T = kalman.SEQUENTIAL_FULL_SITES_MAX_T[2] + 1
    assert T <= kalman.SEQUENTIAL_MAX_T[2]
    chain, eta, J = _chain(T, 2, seed=3)
    first_eta = torch.stack([eta[:, 0], torch.zeros_like(eta[:, 0])], -1)
    first_J = torch.zeros_like(J)
    first_J[:, 0, 0] = J[:, 0, 0]
    seq = kalman.SEQUENTIAL
    assert kalman.sites_smoother(seq, eta, J) is kalman.TREE_SCALAR
    assert kalman.sites_smoother(seq, first_eta, first_J) is seq
    assert kalman.sites_smoother(seq, eta[:-1], J[:-1]) is seq  # (at the limit itself)
    assert kalman.sites_smoother(kalman.TREE, eta, J) is kalman.TREE
    parts = (chain.m0, chain.P0, chain.A, chain.b, chain.Q)
    chain, eta, J = LinearGaussianChain(*(p.to(dtype) for p in parts)), eta.to(dtype), J.to(dtype)
    used = []
    tree_call = type(kalman.TREE_SCALAR).__call__
    monkeypatch.setattr(
        type(kalman.TREE_SCALAR), "__call__", lambda *a, **k: used.append(1) or tree_call(*a, **k)
    )
    got = smooth(chain, eta, J)
    want = smooth(chain, eta, J, method=seq)
    assert used  # (smooth took the tree by the rule, the scalar pass when named)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-10)
    assert torch.allclose(got.log_z, want.log_z, **tol)
    assert torch.allclose(got.mean, want.mean, **tol)
    assert torch.allclose(got.cov, want.cov, **tol)


@pytest.mark.parametrize("d", [1, 2])
def test_the_sequential_pass_hands_batched_and_differentiable_problems_on(d, monkeypatch):
    """Batched chains and ``keep_graph`` go to the tensor strategy: the same numbers as the
    tree, and gradients where asked; the scalar pass itself is never entered for them."""
    from pyro_cvi.statespace import sequential

    entered = []
    solve = sequential.SequentialSmoother._solve
    monkeypatch.setattr(
        sequential.SequentialSmoother,
        "_solve",
        staticmethod(lambda *a: entered.append(1) or solve(*a)),
    )
    chain, eta, J = _chain(9, d, seed=5, batch=(3,))
    a = smooth(chain, eta, J, lag_one=True, method=kalman.SEQUENTIAL)
    b = smooth(chain, eta, J, lag_one=True, method=kalman.TREE)
    for x, y in [(a.log_z, b.log_z), (a.mean, b.mean), (a.cov, b.cov), (a.cross, b.cross)]:
        assert x.shape == y.shape
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    assert not entered
    chain, eta, J = _chain(9, d, seed=6)
    eta = eta.clone().requires_grad_(True)
    post = smooth(chain, eta, J, keep_graph=True, method=kalman.SEQUENTIAL)
    (g,) = torch.autograd.grad(post.log_z, eta)
    torch.testing.assert_close(g, post.mean.detach(), rtol=1e-10, atol=1e-10)  # dlogZ/deta = E x
    assert not entered
    smooth(chain, eta.detach(), J, method=kalman.SEQUENTIAL)
    assert entered


@pytest.mark.parametrize("dtype", [torch.float32, D64], ids=["f32", "f64"])
@pytest.mark.parametrize("d", [1, 2])
def test_the_tree_with_a_scalar_top_equals_the_tree(d, dtype, monkeypatch):
    """The tree's long levels, the scalar pass on the chain of a level's end states and the
    tree's descent: the tree's numbers on a long chain (GP-like sites on the first coordinate
    and full ones), the pass entered; batched and differentiable problems and a failed pass
    take the tree."""
    from pyro_cvi.statespace import sequential

    calls = []
    real = sequential.reduced
    monkeypatch.setattr(sequential, "reduced", lambda el: calls.append(1) or real(el))
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == D64 else dict(rtol=1e-3, atol=1e-3)
    method = kalman.TreeScalarSmoother(100)
    for T, first in [(3001, True), (1234, False), (101, False), (1, False)]:
        chain, eta, J = _chain(T, d, seed=T)
        if first:
            eta[:, 1:], J[:, 1:, :], J[:, :, 1:] = 0.0, 0.0, 0.0
        cast = LinearGaussianChain(*(t.to(dtype) for t in chain.tensors()))
        eta, J = eta.to(dtype), J.to(dtype)
        a = smooth(cast, eta, J, lag_one=True, method=method)
        b = smooth(chain, eta.double(), J.double(), lag_one=True, method=kalman.TREE)
        for x, y in [(a.log_z, b.log_z), (a.mean, b.mean), (a.cov, b.cov), (a.cross, b.cross)]:
            assert x.dtype == dtype and x.shape == y.shape
            torch.testing.assert_close(x.double(), y, **tol)
    assert len(calls) == 4
    chain, eta, J = _chain(300, d, seed=5, batch=(3,))
    a = smooth(chain, eta, J, lag_one=True, method=method)
    b = smooth(chain, eta, J, lag_one=True, method=kalman.TREE)
    torch.testing.assert_close(a.cov, b.cov, rtol=1e-12, atol=1e-12)
    chain, eta, J = _chain(300, d, seed=6)
    eta = eta.clone().requires_grad_(True)
    post = smooth(chain, eta, J, keep_graph=True, method=method)
    (g,) = torch.autograd.grad(post.log_z, eta)
    torch.testing.assert_close(g, post.mean.detach(), rtol=1e-10, atol=1e-10)  # dlogZ/deta = E x
    assert len(calls) == 4
    monkeypatch.setattr(sequential, "reduced", lambda el: calls.append(1))
    a = smooth(chain, eta.detach(), J, lag_one=True, method=method)
    b = smooth(chain, eta.detach(), J, lag_one=True, method=kalman.TREE)
    torch.testing.assert_close(a.cov, b.cov, rtol=0, atol=0)
    torch.testing.assert_close(a.log_z, b.log_z, rtol=0, atol=0)
    assert len(calls) == 5
    with pytest.raises(NotPositiveDefinite):
        smooth(chain, eta.detach(), -50.0 * J, method=method)


@pytest.mark.parametrize("d", [1, 2])
def test_the_sequential_pass_raises_on_an_indefinite_q(d):
    chain, eta, J = _chain(9, d)
    with pytest.raises(NotPositiveDefinite):
        smooth(chain, eta, -50.0 * J, method=kalman.SEQUENTIAL)


@pytest.mark.parametrize("dtype", [torch.float32, D64], ids=["f32", "f64"])
@pytest.mark.parametrize("d", [1, 2, 3, 4])
def test_small_inverses_and_determinants_equal_lapack_in_both_forms(d, dtype):
    from pyro_cvi.statespace import soa

    g = torch.Generator().manual_seed(d)
    M = torch.randn(50, 3, d, d, generator=g, dtype=D64) + 2 * torch.eye(d, dtype=D64)
    inv_ref, det_ref = torch.linalg.inv(M), torch.linalg.det(M)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == D64 else dict(rtol=1e-4, atol=1e-4)
    inv, det = soa.inv_det(M.to(dtype))
    torch.testing.assert_close(inv.double(), inv_ref, **tol)
    torch.testing.assert_close(det.double(), det_ref, **tol)
    inv_a, det_a = soa.inv_det(soa.to_arrays_mat(M.to(dtype)))
    torch.testing.assert_close(soa.pack(inv_a).double(), inv_ref, **tol)
    torch.testing.assert_close(det_a.double(), det_ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, D64], ids=["f32", "f64"])
@pytest.mark.parametrize("start", ["zero", "shifted", "not stationary"])
@pytest.mark.parametrize("T", [1, 2, 9, 300])
def test_without_sites_q_is_the_prior_by_every_path(T, start, dtype, monkeypatch):
    """Zero sites: ``log Z = 0`` and the prior's marginals and lag-one covariances, by the
    default path (the stationary shortcut where it applies) and by the tree, equal to the
    dense computation; the shortcut is taken exactly for a stationary chain in float64."""
    from pyro_cvi.statespace import Matern32
    from pyro_cvi.statespace.distribution import MarkovGP

    chain = MarkovGP(torch.arange(T, dtype=D64) * 0.7, Matern32(3.0, 1.3)).chain
    if start == "shifted":  # the covariances stay stationary, the means move
        chain = LinearGaussianChain(chain.m0 + 0.5, chain.P0, chain.A, chain.b + 0.1, chain.Q)
    if start == "not stationary":
        chain = LinearGaussianChain(chain.m0, 2.0 * chain.P0, chain.A, chain.b, chain.Q)
    eta, J = torch.zeros(T, 2, dtype=D64), torch.zeros(T, 2, 2, dtype=D64)
    _, mean, cov = _dense(chain, eta, J)
    taken = []
    shortcut = kalman._stationary_prior
    monkeypatch.setattr(kalman, "_stationary_prior", lambda *a: taken.append(1) or shortcut(*a))
    cast = LinearGaussianChain(*(t.to(dtype) for t in chain.tensors()))
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == D64 else dict(rtol=2e-4, atol=2e-4)
    for method in (None, kalman.TREE):
        post = smooth(cast, eta.to(dtype), J.to(dtype), lag_one=True, method=method)
        assert post.cov.dtype == dtype
        torch.testing.assert_close(post.log_z.double(), torch.zeros((), dtype=D64), **tol)
        torch.testing.assert_close(post.mean.double(), mean, **tol)
        torch.testing.assert_close(post.cov.double(), _blocks(cov, T, 2, 0), **tol)
        torch.testing.assert_close(
            post.cross.double(), _blocks(cov, T, 2, 1).reshape(T - 1, 2, 2), **tol
        )
    assert len(taken) == 1  # looked at by the default path only
    if dtype == D64:
        assert (shortcut(cast, eta, J) is not None) == (start != "not stationary" or T == 1)


@pytest.mark.parametrize("dtype", [torch.float32, D64], ids=["f32", "f64"])
@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize("T", [3, 64])
def test_the_sequential_pass_with_one_transition_for_every_step(T, d, dtype):
    """A chain with the same ``(A, b, Q)`` at every step (a stationary kernel on a regular
    grid) takes one transition row; ``q`` equals the dense one, and bit for bit the pass over
    the list of ``T - 1`` equal rows."""
    from pyro_cvi.statespace import sequential

    base, eta, J = _chain(T, d, seed=3 * T + d)
    A, b, Q = base.A[:1].expand(T - 1, d, d), base.b[:1].expand(T - 1, d), base.Q[:1]
    chain = LinearGaussianChain(base.m0, base.P0, A, b, Q.expand(T - 1, d, d).clone())
    log_z, mean, cov = _dense(chain, eta, J)
    cast = LinearGaussianChain(*(t.to(dtype) for t in chain.tensors()))
    post = smooth(cast, eta.to(dtype), J.to(dtype), lag_one=True, method=kalman.SEQUENTIAL)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == D64 else dict(rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(post.log_z.double(), log_z, **tol)
    torch.testing.assert_close(post.mean.double(), mean, **tol)
    torch.testing.assert_close(post.cov.double(), _blocks(cov, T, d, 0), **tol)
    rows = sequential._rows(cast, eta.to(dtype), J.to(dtype), d)
    assert isinstance(rows[2], sequential._Repeated)
    listed = (*rows[:2], [rows[2][t] for t in range(len(rows[2]))], rows[3])
    one_row = (sequential._pass_1 if d == 1 else sequential._pass_2)(*rows, True)
    assert one_row == (sequential._pass_1 if d == 1 else sequential._pass_2)(*listed, True)
    changed = chain.A.clone()
    changed[-1, 0, 0] = -0.0 if float(changed[-1, 0, 0]) == 0.0 else -changed[-1, 0, 0]
    varying = LinearGaussianChain(chain.m0, chain.P0, changed, chain.b, chain.Q)
    assert isinstance(sequential._rows(varying, eta, J, d)[2], list)


def _first_coordinate_sites(T, seed, negative=False):
    """Sites on ``x_0`` only (a process observed through ``f = x_0``): ``eta = (e, 0)``,
    ``J = diag(j, 0)``, ``j > 0`` (or of mixed sign)."""
    chain, eta, _ = _chain(T, 2, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    j = torch.rand(T, generator=g, dtype=D64) * 3.0 + 0.05
    if negative:
        j = j - 0.5
    eta = torch.stack([eta[:, 0], torch.zeros(T, dtype=D64)], 1)
    J = torch.zeros(T, 2, 2, dtype=D64)
    J[:, 0, 0] = j
    return chain, eta, J


@pytest.mark.parametrize("dtype", [torch.float32, D64], ids=["f32", "f64"])
@pytest.mark.parametrize("lag_one", [False, True])
@pytest.mark.parametrize("T", [1, 2, 3, 9, 64])
def test_the_sequential_pass_with_sites_on_the_first_coordinate(T, lag_one, dtype):
    """Sites on ``x_0`` alone take the scalar update (two columns of sites); ``q`` equals the
    dense one and the one-step-at-a-time reference, and the general ``d = 2`` filter on the same
    problem to rounding."""
    from pyro_cvi.statespace import sequential

    chain, eta, J = _first_coordinate_sites(T, seed=T)
    log_z, mean, cov = _dense(chain, eta, J)
    ref = _sequential(chain, eta, J)
    cast = LinearGaussianChain(*(t.to(dtype) for t in chain.tensors()))
    e, Jd = eta.to(dtype), J.to(dtype)
    rows = sequential._rows(cast, e, Jd, 2)
    assert isinstance(rows[3], sequential.OnFirst)
    post = smooth(cast, e, Jd, lag_one=lag_one, method=kalman.SEQUENTIAL)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == D64 else dict(rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(post.log_z.double(), log_z, **tol)
    torch.testing.assert_close(post.log_z.double(), ref[0], **tol)
    torch.testing.assert_close(post.mean.double(), mean, **tol)
    torch.testing.assert_close(post.cov.double(), _blocks(cov, T, 2, 0), **tol)
    torch.testing.assert_close(post.cov.double(), ref[2], **tol)
    if lag_one:
        torch.testing.assert_close(
            post.cross.double(), _blocks(cov, T, 2, 1).reshape(T - 1, 2, 2), **tol
        )
        torch.testing.assert_close(post.cross.double(), ref[3], **tol)
    else:
        assert post.cross is None
    first = sequential._rows(chain, eta, J, 2)
    general = (*first[:3], [[e, 0.0, j, 0.0, 0.0, 0.0] for e, j in zip(*first[3])])
    a = sequential._pass_2(*first, True)
    b = sequential._pass_2(*general, True)
    assert a[0] == pytest.approx(b[0], rel=1e-12, abs=1e-12)
    torch.testing.assert_close(torch.tensor(a[1]), torch.tensor(b[1]), rtol=1e-12, atol=1e-12)


def test_sites_off_the_first_coordinate_take_the_general_pass():
    """Any non-zero (or NaN) entry of ``eta_1`` or ``J`` off ``(0, 0)`` keeps six columns; a
    NaN there reaches ``log Z`` and is refused as before."""
    from pyro_cvi.statespace import sequential

    chain, eta, J = _first_coordinate_sites(7, seed=1)
    for k, where in enumerate([(eta, (3, 1)), (J, (2, 1, 1)), (J, (4, 0, 1)), (J, (0, 1, 0))]):
        e, Jk = eta.clone(), J.clone()
        (e if where[0] is eta else Jk)[where[1]] = 0.25 if k != 1 else float("nan")
        rows = sequential._rows(chain, e, Jk, 2)
        assert isinstance(rows[3], list) and all(len(site) == 6 for site in rows[3])
    e = eta.clone()
    e[3, 1] = float("nan")
    with pytest.raises(NotPositiveDefinite):
        smooth(chain, e, J, method=kalman.SEQUENTIAL)


def test_the_first_coordinate_pass_hands_an_indefinite_step_on():
    """``1 + p00 j <= 0`` at a step: the tensor strategy decides (and raises); a mixed-sign
    ``j`` that keeps ``q`` positive definite gives the dense ``q``."""
    chain, eta, J = _first_coordinate_sites(9, seed=2)
    with pytest.raises(NotPositiveDefinite):
        smooth(chain, eta, -50.0 * J, method=kalman.SEQUENTIAL)
    chain, eta, J = _first_coordinate_sites(9, seed=3, negative=True)
    J = 0.1 * J
    log_z, mean, cov = _dense(chain, eta, J)
    post = smooth(chain, eta, J, method=kalman.SEQUENTIAL)
    torch.testing.assert_close(post.log_z, log_z, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(post.cov, _blocks(cov, 9, 2, 0), rtol=1e-10, atol=1e-10)
