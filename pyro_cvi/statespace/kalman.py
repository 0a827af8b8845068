"""The conjugate computation of a Markov Gaussian block: a Kalman smoother (App. E.2).

The prior is a linear-Gaussian state-space model

    x_0 ~ N(m0, P0),    x_t | x_{t-1} ~ N(A_t x_{t-1} + b_t, Q_t),    t = 1..T-1,

and the CVI sites (eq. 13) add ``exp(eta_t' x_t - x_t' J_t x_t / 2)`` at every step. ``q`` is
prior x sites / Z, with the log-normaliser

    log Z(eta, J) = log int p(x) prod_t exp(eta_t' x_t - x_t' J_t x_t / 2) dx.

**Forward** (a parallel reduction, Sarkka & Garcia-Fernandez 2021, with a log-normaliser
carried along): an element over steps ``i..j`` is the kernel
``K(x_{i-1}, x_j) = p(sites_{i..j} | x_{i-1}) p(x_j | x_{i-1}, sites_{i..j})``, stored as
``exp(g + e'x - x'Jx/2) N(x_j; A x + b, C)``; neighbours combine in closed form
(:func:`combine`) by a pairwise tree, log2(T) levels, O(T d^3) work. The root's ``g`` is
``log Z`` and its Gaussian the last smoothed marginal.

**Backward** (explicit, no autograd): down the same tree. For a node ``i..j`` split at ``k``,
``x_k | x_{i-1}, x_j, sites ~ N(F x_{i-1} + G x_j + u, S)`` (the left child's Gaussian,
updated by the right child's site information, then conditioned on ``x_j`` by a Kalman
gain), so the smoothed moments of ``x_k`` and ``Cov(x_k, x_{i-1})``, ``Cov(x_j, x_k)``
follow from those of the node's endpoints. At the leaves these are the marginals and the
lag-one covariances ``Cov(x_t, x_{t-1})``: one pass gives ``log Z``, marginals and lag-one
covariances. Both passes are plain tensor ops, so with ``keep_graph`` autograd
differentiates ``log Z`` and the marginals in the chain's tensors and the sites (the
hyperparameter gradient at fixed sites); without, nothing records a graph.

All tensors may carry leading batch dims (independent chains): ``m0 (*B, d)``,
``A (*B, T-1, d, d)``, ``eta (*B, T, d)``, ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from ..linalg import NotPositiveDefinite, cholesky
from . import scan as _scan
from . import sequential as _sequential
from . import soa
from .elements import LinearGaussianChain, _half, _log_det_g, _plus_eye, check_log_z, time_major
from .soa import add, cols, dot, hcat, inv, inv_det, mm, mv, sub, tr, vcat

__all__ = [
    "LinearGaussianChain",
    "Marginals",
    "NotPositiveDefinite",
    "log_normalizer",
    "smooth",
    "sample_prior",
    "sample_posterior",
    "log_prob_chain",
]


# ---------------------------------------------------------------------------- the elements
# An element is ``(A, b, C, e, J, g)`` (see the module docstring), a stack over time in either
# storage form of :mod:`.soa`: arrays for long stacks, packed below ``PACK_BELOW`` (the tree's
# top levels, where per-op overhead dominates).
Element = Tuple  # (A, b, C, e, J, g)
PACK_BELOW = 2048


def combine(i: Element, j: Element):
    """``(K_i o K_j)(x, z) = int K_i(x, y) K_j(y, z) dy`` (i earlier in time than j), and what
    the backward pass needs: ``W = M A_i``, ``nu = M (b_i + C_i e_j)``, ``P1 = M C_i`` (the
    law of ``y`` given ``x`` and the information of ``K_j``, ``M = (I + C_i J_j)^-1``) and
    ``A_j P1``."""
    if soa.is_packed(i[0]):
        return _combine_packed(i, j)
    Ai, bi, Ci, ei, Ji, gi = i
    Aj, bj, Cj, ej, Jj, gj = j
    Minv, det = inv_det(_plus_eye(mm(Ci, Jj)))
    P1 = mm(Minv, Ci)  # = (C_i^-1 + J_j)^-1, symmetric
    W = mm(Minv, Ai)
    nu = mv(Minv, add(bi, mv(Ci, ej)))
    AjP1 = mm(Aj, P1)
    Jb = mv(Jj, bi)
    r = sub(ej, Jb)  # the site's residual information at b_i
    # (I + J_j C_i)^-1 = ((I + C_i J_j)^-1)' for symmetric C, J: W' = A_i' (I + J_j C_i)^-1
    Wt = tr(W)
    A = mm(Aj, W)
    b = add(mv(Aj, nu), bj)
    C = add(mm(AjP1, tr(Aj)), Cj)
    e = add(mv(Wt, r), ei)
    J = add(mm(Wt, mm(Jj, Ai)), Ji)
    quad = dot(bi, sub(ej, _half(Jb))) + 0.5 * dot(r, mv(P1, r))
    g = _log_det_g(det, gi + gj + quad)
    return (A, b, C, e, J, g), (W, nu, P1, AjP1)


def _combine_packed(i: Element, j: Element):
    """:func:`combine` of packed stacks with the products sharing a left factor fused into one
    matmul each (``M [A_i | b_i + C_i e_j | C_i | C_i r]``, ``A_j [W | nu | P1]``, ...):
    a third of the ops, the same numbers."""
    Ai, bi, Ci, ei, Ji, gi = i
    Aj, bj, Cj, ej, Jj, gj = j
    d = Ai.shape[-1]
    CJ = Ci @ Jj
    CJ.diagonal(dim1=-2, dim2=-1).add_(1.0)
    Minv, det = inv_det(CJ)
    JbA = Jj @ torch.cat([bi, Ai], -1)
    Jb, JA = JbA[..., :1], JbA[..., 1:]
    r = ej - Jb
    Ce = Ci @ torch.cat([ej, r], -1)
    Y = Minv @ torch.cat([Ai, bi + Ce[..., :1], Ci, Ce[..., 1:]], -1)
    W, nu, P1, P1r = Y[..., :d], Y[..., d : d + 1], Y[..., d + 1 : 2 * d + 1], Y[..., -1:]
    Z = Aj @ Y[..., : 2 * d + 1]
    AjP1 = Z[..., d + 1 :]
    eJ = W.transpose(-1, -2) @ torch.cat([r, JA], -1)
    quad = (bi * (ej - 0.5 * Jb) + 0.5 * r * P1r).sum((-2, -1))
    A, b, C = Z[..., :d], Z[..., d : d + 1] + bj, AjP1 @ Aj.transpose(-1, -2) + Cj
    e, J = eJ[..., :1] + ei, eJ[..., 1:] + Ji
    return (A, b, C, e, J, _log_det_g(det, gi + gj + quad)), (W, nu, P1, AjP1)


def _vec_of(M):
    """A ``d x 1`` matrix as a vector."""
    return M if soa.is_packed(M) else [row[0] for row in M]


def _take(X, s: slice):
    return soa.tree_map(lambda t: t[s], X)


def _cat(X, Y):
    flat = [torch.cat([x, y], 0) for x, y in zip(soa.leaves(X), soa.leaves(Y))]
    return soa.unflatten(X, iter(flat))


def _interleave(X, Y):
    """``X_0, Y_0, X_1, Y_1, ...`` along time."""
    flat = [torch.stack([x, y], 1).flatten(0, 1) for x, y in zip(soa.leaves(X), soa.leaves(Y))]
    return soa.unflatten(X, iter(flat))


def _shift(X):
    """``X`` one step later along time, a zero first."""
    return soa.tree_map(lambda t: torch.cat([torch.zeros_like(t[:1]), t[:-1]], 0), X)


def _to_arrays(X):
    """A packed ``(mean, cov, cross)`` state -> arrays."""
    m, S, X = X
    return soa.to_arrays_vec(m), soa.to_arrays_mat(S), soa.to_arrays_mat(X)


def reduce(el: Element, levels: Optional[List] = None, stop: int = 1) -> Element:
    """The ordered product of all elements by pairwise (tree) reduction: log2(T) levels; an
    odd last element is carried up. With ``levels`` (a list), what the backward pass needs is
    appended per level. With ``stop``, the level with at most ``stop`` elements."""
    while el[5].shape[0] > stop:
        n = el[5].shape[0]
        if n <= PACK_BELOW and not soa.is_packed(el[1]):
            el = soa.pack(el)
        pairs = n // 2
        left, right = _take(el, slice(0, 2 * pairs, 2)), _take(el, slice(1, 2 * pairs, 2))
        parent, extra = combine(left, right)
        if levels is not None:
            levels.append((parent[:3], extra, n % 2))
        el = _cat(parent, _take(el, slice(n - 1, n))) if n % 2 else parent
    return el


def _descend(levels: List, state):
    """The smoothed ``(mean, cov, Cov(x_t, x_{t-1}))`` of every leaf's end state, packed, from
    those of the end states of the top level's elements (``state``, packed)."""
    for (Ap, bp, Cp), (W, nu, P1, ARP1), odd in reversed(levels):
        if not soa.is_packed(W) and soa.is_packed(state[0]):
            state = _to_arrays(state)
        mE, SE, X = state
        pairs = Ap[0][0].shape[0] if not soa.is_packed(Ap) else Ap.shape[0]
        mS, SS = _take(_shift(mE), slice(0, pairs)), _take(_shift(SE), slice(0, pairs))
        mJ, SJ, XJ = (_take(t, slice(0, pairs)) for t in (mE, SE, X))
        Kt = mm(inv(Cp), ARP1)  # K' = C_parent^-1 A_R P1 (C_parent = Cov(x_j | x_{i-1}))
        K = tr(Kt)
        FK = hcat(sub(W, mm(K, Ap)), K)  # [F G]: x_k | x_{i-1}, x_j ~ N(F x_{i-1} + G x_j + u, S)
        u = sub(nu, mv(K, bp))
        # [E x_k - u, Cov(x_k, x_{i-1}), Cov(x_k, x_j)] = [F G] [m_s S_s X'; m_j X S_j]
        R = mm(FK, vcat(hcat(soa.col(mS), SS, tr(XJ)), hcat(soa.col(mJ), XJ, SJ)))
        d = len(R) if not soa.is_packed(R) else R.shape[-2]
        mk = add(_vec_of(cols(R, 0, 1)), u)
        Y, Z = cols(R, 1, 1 + d), cols(R, 1 + d, 1 + 2 * d)
        Sk = add(sub(P1, mm(K, ARP1)), mm(cols(R, 1, 1 + 2 * d), tr(FK)))
        child = (_interleave(mk, mJ), _interleave(Sk, SJ), _interleave(Y, tr(Z)))
        if odd:
            child = tuple(_cat(c, _take(s, slice(pairs, pairs + 1))) for c, s in zip(child, state))
        state = child
    return soa.pack(state)


def log_normalizer(chain: LinearGaussianChain, eta: torch.Tensor, J: torch.Tensor) -> torch.Tensor:
    """``log Z`` of prior x sites (see the module docstring); differentiable in everything."""
    T = eta.shape[-2]
    return reduce(time_major(chain, eta, J, T <= PACK_BELOW))[5][0]


@dataclass
class Marginals:
    """Smoothed marginals of ``q``: means ``(T, d)``, covariances ``(T, d, d)``, ``log Z``."""

    mean: torch.Tensor
    cov: torch.Tensor
    log_z: torch.Tensor
    cross: Optional[torch.Tensor] = None  # lag-one Cov(x_t, x_{t-1}) (T-1, d, d), if asked
    to_z: Optional[Callable] = None  # the block's joint z from states (a random walk: diff)

    @property
    def loc(self) -> torch.Tensor:
        """The mean of the block's joint z (as a Gaussian block's ``post.loc``)."""
        return self.mean.reshape(-1) if self.to_z is None else self.to_z(self.mean)


class TreeSmoother:
    """The reduction tree and its explicit descent (module docstring): ``O(T d^3)`` work in
    ``2 log2 T`` levels, the top ones packed, the long ones as arrays (:mod:`.soa`)."""

    name = "tree"

    def __call__(self, chain: LinearGaussianChain, eta, J, lag_one: bool):
        levels: List = []
        el = time_major(chain, eta, J, eta.shape[-2] <= PACK_BELOW)
        root = soa.pack(reduce(el, levels))
        log_z = root[5][0]
        check_log_z(log_z)
        A, b, C = root[:3]  # the root's start is the dummy x_{-1}: A = 0, the law of x_{T-1}
        m, S, X = _descend(levels, (b, C, torch.zeros_like(C)))
        return log_z, m, S, X


class TreeScalarSmoother:
    """The tree's long levels, then the scalar pass (:mod:`.sequential`) on the chain of the
    end states of the level with at most ``top`` elements (:func:`.sequential.reduced`), then
    the tree's descent from its marginals: the tree's short levels, where per-op overhead is all
    the time, become one pass of scalar arithmetic. Problems the pass does not take (batched,
    differentiable, GPU, ``d > 2``) and a failed pass take the tree."""

    def __init__(self, top: int):
        self.top = top
        self.name = f"tree-scalar-{top}"

    def __call__(self, chain: LinearGaussianChain, eta, J, lag_one: bool):
        if not _sequential.applies(chain, eta, J):
            return TREE(chain, eta, J, lag_one)
        levels: List = []
        T, d = eta.shape[-2], eta.shape[-1]
        packed = T <= PACK_BELOW
        first = not packed and d == 2 and _sequential._first_coordinate(eta, J)
        el = reduce(time_major(chain, eta, J, packed, first), levels, self.top)
        el = soa.pack(el)
        top = _sequential.reduced(el)
        if top is None:
            root = soa.pack(reduce(el, levels))
            check_log_z(root[5][0])
            state = (root[1], root[2], torch.zeros_like(root[2]))
        else:
            like = dict(dtype=eta.dtype, device=eta.device)
            log_z = torch.tensor(top[0], **like)
            check_log_z(log_z)
            state = tuple(t.to(**like) for t in top[1:])
            root = (None,) * 5 + (log_z.reshape(1),)
        m, S, X = _descend(levels, state)
        return root[5][0], m, S, X


class ScanSmoother:
    """The associative-scan filter and smoother (:mod:`.scan`): ``O(T d^3 log T)`` work in
    ``2 log2 T`` levels of few, large ops; fewer ops than the tree's descent."""

    name = "scan"

    def __call__(self, chain: LinearGaussianChain, eta, J, lag_one: bool):
        return _scan.smooth_scan(chain, eta, J, lag_one)


#: The longest chain, per state dimension, for which the scan is the faster (CPU, one thread,
#: float64, measured by ``scripts/benchmark_kalman.py``: its fewer ops win while the time is
#: per-op overhead, its ``log T`` factor of work loses beyond); longer chains, larger states
#: and chains shorter than ``SCAN_MIN_T`` take the tree.
SCAN_MAX_T = {1: 800, 2: 400, 3: 128, 4: 32, 5: 24, 6: 16}
SCAN_MIN_T = 4
#: The longest chain, per state dimension, for which the scalar sequential pass
#: (:mod:`.sequential`) is the faster: below it no tensor operation's fixed cost is paid per
#: step; longer chains of these ``d`` take the tree with a scalar top
#: (:class:`TreeScalarSmoother`). ``d = 2``: where a Markov-GP CVI step (sites on the first
#: coordinate, one transition, the pass's own output path: ``scripts/compare_markov_step.py``)
#: is as fast with either; sites on the whole state cross earlier (near 700 steps in
#: ``scripts/benchmark_kalman.py``). ``d = 1``: the crossing in ``benchmark_kalman.py``
#: (1000-1500 steps) moved up a little for the pass's own output path.
SEQUENTIAL_MAX_T = {1: 1400, 2: 2200}
#: The same for ``d = 2`` sites on the whole state (not on the first coordinate only: the
#: pass's general form, three times the update's operations), above which such a chain takes
#: the tree with a scalar top: one ``smooth`` both ways interleaved
#: (``scripts/benchmark_sequential_sites_max_t.py``, random stable chain, one thread, under
#: load) crosses near 1450 steps without lag-one covariances and near 1250 with.
SEQUENTIAL_FULL_SITES_MAX_T = {2: 1400}
#: The same for the Markov block's short path (:mod:`.first_sites`: a GP observed through its
#: first coordinate, fed by its rows directly), which costs less per step than the pass above:
#: where a Markov-GP CVI step is as fast with it as with the tree with a scalar top, measured by
#: ``scripts/benchmark_first_sites_max_t.py`` (both ways interleaved in one process, six runs
#: under load): ``d = 1`` (Matern-1/2) between 1600 and 2000 steps, ``d = 2`` (Matern-3/2)
#: between 2100 and 2450; the ratio is flat there (within 10% of 1 over a few hundred steps).
FIRST_SITES_MAX_T = {1: 1800, 2: 2200}


def tensor_smoother(T: int, d: int):
    """The faster of the two tensor smoothers (the tree, the scan) for ``T`` steps of ``d``."""
    return SCAN if SCAN_MIN_T <= T <= SCAN_MAX_T.get(d, 0) else TREE


TREE, SCAN = TreeSmoother(), ScanSmoother()
SEQUENTIAL = _sequential.SequentialSmoother(tensor_smoother)
#: The top level's size for :class:`TreeScalarSmoother` (measured as ``SCAN_MAX_T``).
TREE_SCALAR = TreeScalarSmoother(320)


def choose_smoother(T: int, d: int):
    """The fastest exact smoother for a chain of ``T`` steps of dimension ``d``: the scalar
    pass for short chains of ``d <= 2`` (which hands batched, differentiable or GPU problems to
    :func:`tensor_smoother`), else the tree or the scan."""
    if T <= SEQUENTIAL_MAX_T.get(d, 0):
        return SEQUENTIAL
    return TREE_SCALAR if d in SEQUENTIAL_MAX_T else tensor_smoother(T, d)


def sites_smoother(strategy: Callable, eta: torch.Tensor, J: torch.Tensor) -> Callable:
    """``strategy`` (:func:`choose_smoother`'s pick), or the tree with a scalar top where it
    is the scalar pass on a chain of ``d = 2`` past ``SEQUENTIAL_FULL_SITES_MAX_T`` whose
    sites are not all on the first coordinate (one chain: batched ones go on as before)."""
    T, d = eta.shape[-2], eta.shape[-1]
    if strategy is not SEQUENTIAL or T <= SEQUENTIAL_FULL_SITES_MAX_T.get(d, T):
        return strategy
    if eta.dim() != 2 or J.dim() != 3 or _sequential._first_coordinate(eta, J):
        return strategy
    return TREE_SCALAR


def smooth(
    chain: LinearGaussianChain,
    eta: torch.Tensor,
    J: torch.Tensor,
    keep_graph: bool = False,
    lag_one: bool = False,
    method: Optional[Callable] = None,
) -> Marginals:
    """``log Z``, the smoothed marginals and (``lag_one``) ``Cov(x_t, x_{t-1})`` in one
    forward-backward pass over the reduction tree (module docstring); O(T d^3).

    With ``keep_graph``, ``log_z`` and the marginals keep their graph to the chain's tensors
    and to ``eta`` and ``J``: ``q`` is then differentiable in the model's parameters at fixed
    sites. Without, nothing records a graph. Leading batch dims: independent chains.
    ``method``: :data:`TREE`, :data:`SCAN` or :data:`SEQUENTIAL` (same numbers); default by
    :func:`choose_smoother` and the sites (:func:`sites_smoother`).
    """
    strategy = method
    if method is None:
        strategy = sites_smoother(choose_smoother(eta.shape[-2], eta.shape[-1]), eta, J)
    # (a strategy with its own no-graph output, the scalar pass: its result as it is)
    own = getattr(strategy, "marginals", None) if not keep_graph and method is None else None
    if own is not None:
        fast = own(chain, eta, J, lag_one)
        if fast is not None:
            if fast[0] is None:
                raise NotPositiveDefinite("q is not positive definite: a marginal variance <= 0")
            return Marginals(*fast)
    if not keep_graph:
        chain, eta, J = chain.detach(), eta.detach(), J.detach()
    out = None if keep_graph or method is not None else _stationary_prior(chain, eta, J)
    with torch.set_grad_enabled(keep_graph):
        log_z, m, S, X = out if out is not None else strategy(chain, eta, J, lag_one)
    mean = m.squeeze(-1).movedim(0, -2)
    cov = S.movedim(0, -3)
    cov = 0.5 * (cov + cov.transpose(-1, -2))
    diag = cov.diagonal(dim1=-2, dim2=-1)
    if not bool(torch.isfinite(cov).all()) or bool((diag <= 0).any()):
        raise NotPositiveDefinite("q is not positive definite: a marginal variance <= 0")
    cross = X[1:].movedim(0, -3) if lag_one else None
    if cross is not None and not keep_graph:
        cross = cross.detach()
    return Marginals(mean, cov, log_z, cross)


def _stationary_prior(chain: LinearGaussianChain, eta: torch.Tensor, J: torch.Tensor):
    """Without sites (``eta = 0``, ``J = 0``) on a chain that keeps its start covariance
    (``A_t P_0 A_t' + Q_t = P_0`` for every ``t``, as a stationary SDE prior does), ``q`` is
    the prior: ``log Z = 0``, every covariance ``P_0``, ``Cov(x_t, x_{t-1}) = A_t P_0`` and
    the means ``m_t = A_t m_{t-1} + b_t`` (zero for a zero-mean chain), in a few ops instead
    of a smoother; ``None`` where that does not hold (one chain, no batch dims)."""
    if chain.A.dim() != 3 or eta.dim() != 2 or bool(eta.any()) or bool(J.any()):
        return None
    A, P0, Q = chain.A, chain.P0, chain.Q
    AP = A @ P0
    kept = AP @ A.transpose(-1, -2) + Q
    scale = float(P0.abs().max())
    if not (scale > 0.0 and bool(((kept - P0).abs() <= 1e-12 * scale).all())):
        return None
    T, d = eta.shape
    S = P0.expand(T, d, d)
    X = torch.cat([P0.new_zeros(1, d, d), AP], 0)
    if bool(chain.m0.any()) or bool(chain.b.any()):
        A_all, b_all, _ = chain.all_steps()
        m = prefix_affine(A_all, b_all).unsqueeze(-1)
    else:
        m = eta.new_zeros(T, d, 1)
    return eta.new_zeros(()), m, S, X


def _tmv(M: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Batched ``M v`` of stacked tensors."""
    return (M @ v.unsqueeze(-1)).squeeze(-1)


def prefix_affine(A: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x_t = A_t x_{t-1} + b_t`` from ``x_{-1} = 0`` for every t, by a parallel prefix scan
    of affine maps (``(A_j, b_j) o (A_i, b_i) = (A_j A_i, A_j b_i + b_j)``)."""
    T = A.shape[0]
    if T == 1:
        return b.clone()
    n = T - T % 2
    A2 = A[1:n:2] @ A[0:n:2]
    b2 = _tmv(A[1:n:2], b[0:n:2]) + b[1:n:2]
    odd = prefix_affine(A2, b2)  # x at t = 1, 3, 5, ...
    out = torch.empty_like(b)
    out[1:n:2] = odd
    out[0] = b[0]
    if T > 2:
        even_idx = torch.arange(2, T, 2, device=b.device)
        out[even_idx] = _tmv(A[even_idx], odd[: even_idx.shape[0]]) + b[even_idx]
    return out


def sample_prior(chain: LinearGaussianChain, generator: Optional[torch.Generator] = None):
    """One draw of the chain (ancestral sampling as a parallel scan)."""
    A, b, C = chain.all_steps()
    L = cholesky(C, jitter="eps", what="chain step covariance")
    eps = torch.randn(b.shape, dtype=b.dtype, device=b.device, generator=generator)
    return prefix_affine(A, b + _tmv(L, eps))


def log_prob_chain(chain: LinearGaussianChain, x: torch.Tensor) -> torch.Tensor:
    """``log p(x)`` of states ``x (T, d)`` under the chain: O(T d^3)."""
    A, b, C = chain.all_steps()
    prev = torch.cat([x.new_zeros(1, x.shape[-1]), x[:-1]], 0)
    loc = _tmv(A, prev) + b
    # (by hand: torch's MultivariateNormal calls broadcast_shapes, which imports sympy)
    L = torch.linalg.cholesky(C)
    u = torch.linalg.solve_triangular(L, (x - loc).unsqueeze(-1), upper=False).squeeze(-1)
    logdet = torch.log(torch.diagonal(L, dim1=-2, dim2=-1)).sum()
    d = x.shape[-1] * x.shape[0]
    return -0.5 * (u * u).sum() - logdet - 0.5 * d * math.log(2 * math.pi)


def sample_posterior(
    chain: LinearGaussianChain,
    eta: torch.Tensor,
    J: torch.Tensor,
    noise_scale: torch.Tensor,
    noise_rows: torch.Tensor,
) -> torch.Tensor:
    """One draw of ``q`` by perturbation (Papandreou & Yuille): ``x~ ~ p``, ``eps ~ N(0, J)``,
    ``x = x~ + E_q0[x | eta + eps - J x~]`` with ``q0`` the zero-mean chain with the same
    sites. ``J_t = sum_r w_r h_r h_r'`` is sampled row-wise: ``eps_t = sum_r sqrt(w_r) n_r h_r``
    (``noise_scale (R,)``, ``noise_rows``: a function scattering ``(R, d)`` rows onto steps).
    """
    x0 = sample_prior(chain.detach())
    n = torch.randn_like(noise_scale) * noise_scale
    eps = noise_rows(n)
    shift = eta + eps - _tmv(J, x0)
    return x0 + smooth(chain.zero_mean(), shift, J).mean
