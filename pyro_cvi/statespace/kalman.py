"""The conjugate computation of a Markov Gaussian block: a Kalman smoother (App. E.2).

The prior is a linear-Gaussian state-space model

    x_0 ~ N(m0, P0),    x_t | x_{t-1} ~ N(A_t x_{t-1} + b_t, Q_t),    t = 1..T-1,

and the CVI sites (eq. 13) add ``exp(eta_t' x_t - x_t' J_t x_t / 2)`` at every step. ``q`` is
prior x sites / Z. Everything here comes from one function, the log-normaliser

    log Z(eta, J) = log int p(x) prod_t exp(eta_t' x_t - x_t' J_t x_t / 2) dx,

computed by a parallel (associative) reduction of affine-Gaussian kernels (Sarkka &
Garcia-Fernandez 2021, with a log-normaliser carried along): O(T d^3) work, O(log T) depth.
Its gradients are the smoothed marginals (the exponential-family identity ``dlogZ/d lambda =
mu``): ``E[x_t] = dlogZ/d eta_t`` and ``E[x_t x_t'] = -2 dlogZ/d J_t``; one backward pass is
the RTS smoother. With the sites fixed, ``d log Z / d theta = E_q[d log p_theta(x) / d theta]``
(Fisher's identity). ``smooth(..., keep_graph=True)`` keeps the graph of the marginals too (the
backward pass with ``create_graph``), for the derivative of the whole ELBO at fixed sites.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Tuple

import torch

from ..linalg import NotPositiveDefinite

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


@dataclass
class LinearGaussianChain:
    """The prior: ``m0 (d), P0 (d, d), A (T-1, d, d), b (T-1, d), Q (T-1, d, d)``."""

    m0: torch.Tensor
    P0: torch.Tensor
    A: torch.Tensor
    b: torch.Tensor
    Q: torch.Tensor

    @property
    def length(self) -> int:
        return self.A.shape[0] + 1

    @property
    def dim(self) -> int:
        return self.m0.shape[-1]

    def detach(self) -> LinearGaussianChain:
        return LinearGaussianChain(*(t.detach() for t in self.tensors()))

    def tensors(self):
        return (self.m0, self.P0, self.A, self.b, self.Q)

    def requires_grad(self) -> bool:
        return any(t.requires_grad for t in self.tensors())

    def zero_mean(self) -> LinearGaussianChain:
        return LinearGaussianChain(
            torch.zeros_like(self.m0), self.P0, self.A, torch.zeros_like(self.b), self.Q
        )

    def all_steps(self):
        """``(A, b, C)`` for t = 0..T-1, the first a kernel from a dummy ``x_{-1}``."""
        d = self.dim
        A = torch.cat([self.m0.new_zeros(1, d, d), self.A], 0)
        b = torch.cat([self.m0.reshape(1, d), self.b], 0)
        C = torch.cat([self.P0.reshape(1, d, d), self.Q], 0)
        return A, b, C


# An element is the kernel K(x, y) = exp(g + e'x - x'Jx/2) N(y; A x + b, C), stacked on a
# leading dim n. Long stacks are stored as a "structure of arrays": a d x d matrix is a list of
# d rows of d tensors (n,), a vector a list of d tensors; for d <= 4 elementwise ops on
# contiguous arrays are several times faster on a CPU than batched GEMMs of tiny matrices.
# Short stacks (n <= PACK_BELOW, the tree's top levels) are plain tensors (n, d, d) / (n, d):
# fewer, larger ops, where per-op overhead dominates. The helpers below take either form.
Element = Tuple  # (A, b, C, e, J, g)
PACK_BELOW = 2048


def _mat(M: torch.Tensor):
    Mt = M.permute(1, 2, 0).contiguous()
    return [[Mt[i, j] for j in range(M.shape[-1])] for i in range(M.shape[-2])]


def _vec(v: torch.Tensor):
    vt = v.transpose(0, 1).contiguous()
    return [vt[i] for i in range(v.shape[-1])]


def _pack(X):
    """Structure of arrays -> stacked tensors."""
    if isinstance(X, tuple):
        return tuple(_pack(x) for x in X)
    if isinstance(X, list) and isinstance(X[0], list):
        return torch.stack([torch.stack(row, -1) for row in X], -2)
    if isinstance(X, list):
        return torch.stack(X, -1)
    return X


def _dot(xs, ys):
    if torch.is_tensor(xs):
        return (xs * ys).sum(-1)
    out = xs[0] * ys[0]
    for x, y in zip(xs[1:], ys[1:]):
        out = torch.addcmul(out, x, y)
    return out


def _mv(M, v):
    if torch.is_tensor(M):
        return (M @ v.unsqueeze(-1)).squeeze(-1)
    return [_dot(row, v) for row in M]


def _t(M):
    if torch.is_tensor(M):
        return M.transpose(-1, -2)
    return [list(col) for col in zip(*M)]


def _mm(X, Y):
    if torch.is_tensor(X):
        return X @ Y
    Yt = _t(Y)
    return [[_dot(row, col) for col in Yt] for row in X]


def _add(X, Y):
    if isinstance(X, list):
        return [_add(x, y) for x, y in zip(X, Y)]
    return X + Y


def _sub(X, Y):
    if isinstance(X, list):
        return [_sub(x, y) for x, y in zip(X, Y)]
    return X - Y


def _map(fn, X):
    if isinstance(X, (list, tuple)):
        return type(X)(_map(fn, x) for x in X)
    return fn(X)


def _leaves(X):
    if isinstance(X, (list, tuple)):
        return [t for x in X for t in _leaves(x)]
    return [X]


def _unflatten(template, flat):
    """``template``'s structure filled with the tensors of the iterator ``flat``."""
    if isinstance(template, (list, tuple)):
        return type(template)(_unflatten(x, flat) for x in template)
    return next(flat)


def _inv_det(M):
    """``(M^-1, det M)`` of a batch of small matrices: closed forms for d = 1, 2."""
    if torch.is_tensor(M):
        return torch.linalg.inv(M), torch.linalg.det(M)
    d = len(M)
    if d == 1:
        return [[M[0][0].reciprocal()]], M[0][0]
    if d == 2:
        (a, b), (c, e) = M
        det = a * e - b * c
        r = det.reciprocal()
        return [[e * r, -b * r], [-c * r, a * r]], det
    full = torch.stack([torch.stack(row, -1) for row in M], -2)
    return _mat(torch.linalg.inv(full)), torch.linalg.det(full)


def combine(i: Element, j: Element) -> Element:
    """``(K_i o K_j)(x, z) = int K_i(x, y) K_j(y, z) dy`` (i earlier in time than j)."""
    Ai, bi, Ci, ei, Ji, gi = i
    Aj, bj, Cj, ej, Jj, gj = j
    CJ = _mm(Ci, Jj)
    if torch.is_tensor(CJ):
        CJ = CJ + torch.eye(CJ.shape[-1], dtype=CJ.dtype, device=CJ.device)
    else:
        for k in range(len(CJ)):
            CJ[k][k] = CJ[k][k] + 1.0
    Minv, det = _inv_det(CJ)  # (I + C_i J_j)^-1
    Minv_Ci = _mm(Minv, Ci)  # = (C_i^-1 + J_j)^-1, symmetric
    Jb = _mv(Jj, bi)
    r = _sub(ej, Jb)  # the site's residual information at b_i
    AjM = _mm(Aj, Minv)
    A = _mm(AjM, Ai)
    b = _add(_mv(AjM, _add(bi, _mv(Ci, ej))), bj)
    C = _add(_mm(_mm(Aj, Minv_Ci), _t(Aj)), Cj)
    # (I + J_j C_i)^-1 = ((I + C_i J_j)^-1)' for symmetric C, J
    AtN = _mm(_t(Ai), _t(Minv))
    e = _add(_mv(AtN, r), ei)
    J = _add(_mm(_mm(AtN, Jj), Ai), Ji)
    quad = _dot(ej, bi) - 0.5 * _dot(bi, Jb) + 0.5 * _dot(r, _mv(Minv_Ci, r))
    bad = det <= 0
    g = gi + gj - 0.5 * torch.where(bad, torch.ones_like(det), det).log() + quad
    g = torch.where(bad, torch.full_like(g, float("nan")), g)
    return A, b, C, e, J, g


def _identity_like(el: Element, n: int) -> Element:
    like = el[5]
    if torch.is_tensor(el[1]):
        d = el[1].shape[-1]
        eye = torch.eye(d, dtype=like.dtype, device=like.device).expand(n, d, d)
        z, zz = like.new_zeros(n, d), like.new_zeros(n, d, d)
        return eye, z, zz, z, zz, like.new_zeros(n)
    d = len(el[1])
    one, zero = like.new_ones(n), like.new_zeros(n)
    eye = [[one if i == j else zero for j in range(d)] for i in range(d)]
    zz = [[zero] * d for _ in range(d)]
    return eye, [zero] * d, zz, [zero] * d, zz, zero


def reduce(elements: Element) -> Element:
    """The ordered product of all elements by pairwise (tree) reduction: log2(T) levels."""
    el = elements
    while el[5].shape[0] > 1:
        n = el[5].shape[0]
        if n <= PACK_BELOW and not torch.is_tensor(el[1]):
            el = _pack(el)
        if n % 2:
            pad = _leaves(_identity_like(el, 1))
            flat = [torch.cat([t, p], 0) for t, p in zip(_leaves(el), pad)]
            el = _unflatten(el, iter(flat))
        left = _map(lambda t: t[0::2], el)
        right = _map(lambda t: t[1::2], el)
        el = combine(left, right)
    return el


def site_elements(chain: LinearGaussianChain, eta: torch.Tensor, J: torch.Tensor) -> Element:
    """Per step, the transition kernel followed by its site (``eta (T, d)``, ``J (T, d, d)``)."""
    A, b, C = chain.all_steps()
    T, d = eta.shape
    zero = eta.new_zeros(T)
    trans = (_mat(A), _vec(b), _mat(C), [zero] * d, [[zero] * d for _ in range(d)], zero)
    site = _identity_like(trans, T)
    site = (site[0], site[1], site[2], _vec(eta), _mat(J), zero)
    return combine(trans, site)


def log_normalizer(chain: LinearGaussianChain, eta: torch.Tensor, J: torch.Tensor) -> torch.Tensor:
    """``log Z`` of prior x sites (see the module docstring); differentiable in everything."""
    total = reduce(site_elements(chain, eta, J))
    return total[5][0]


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


def smooth(
    chain: LinearGaussianChain,
    eta: torch.Tensor,
    J: torch.Tensor,
    keep_graph: bool = False,
    lag_one: bool = False,
) -> Marginals:
    """Forward reduction + one backward pass (the RTS smoother as the gradient of log Z).

    With ``keep_graph``, ``log_z`` and the marginals keep their graph to the chain's tensors
    and to ``eta`` and ``J`` (the marginals by a differentiable backward pass): ``q`` is then
    differentiable in the model's parameters at fixed sites. Without, nothing has a graph.
    With ``lag_one``, also ``Cov(x_t, x_{t-1})`` (always detached) from ``G_t = dlogZ/dA_t =
    Q_t^-1 E[(x_t - A_t x_{t-1} - b_t) x_{t-1}']``: ``Cov = Q_t G_t + A_t S_{t-1} + (A_t m_{t-1}
    + b_t - m_t) m_{t-1}'``.
    """
    with torch.enable_grad():
        e, Jl = (_input(t, keep_graph) for t in (eta, J))
        ch = chain if keep_graph else chain.detach()
        wrt = (e, Jl)
        if lag_one:
            A = ch.A if ch.A.requires_grad else ch.A.detach().clone().requires_grad_(True)
            ch = replace(ch, A=A)
            wrt = wrt + (A,)
        log_z = log_normalizer(ch, e, Jl)
        if not bool(torch.isfinite(log_z)):
            raise NotPositiveDefinite("q is not positive definite: log Z is not finite")
        grads = torch.autograd.grad(log_z, wrt, retain_graph=keep_graph, create_graph=keep_graph)
    mean = grads[0] if keep_graph else grads[0].detach()
    g_J = grads[1] if keep_graph else grads[1].detach()
    second = -(g_J + g_J.transpose(-1, -2))  # E[x x'] (symmetrised)
    cov = second - mean.unsqueeze(-1) * mean.unsqueeze(-2)
    diag = cov.diagonal(dim1=-2, dim2=-1)
    if not bool(torch.isfinite(cov).all()) or bool((diag <= 0).any()):
        raise NotPositiveDefinite("q is not positive definite: a marginal variance <= 0")
    cross = None
    if lag_one:
        A, b, Q = (t.detach() for t in (ch.A, ch.b, ch.Q))
        m, S = mean.detach(), cov.detach()
        prev = m[:-1]
        resid = _tmv(A, prev) + b - m[1:]
        cross = Q @ grads[2].detach() + A @ S[:-1] + resid.unsqueeze(-1) * prev.unsqueeze(-2)
    return Marginals(mean, cov, log_z if keep_graph else log_z.detach(), cross)


def _input(t: torch.Tensor, keep_graph: bool) -> torch.Tensor:
    """``t`` itself when its graph is kept (autograd differentiates at it), else a new leaf."""
    return t if keep_graph and t.requires_grad else t.detach().clone().requires_grad_(True)


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
    L = torch.linalg.cholesky(C + _jitter(C))
    eps = torch.randn(b.shape, dtype=b.dtype, device=b.device, generator=generator)
    return prefix_affine(A, b + _tmv(L, eps))


def _jitter(C: torch.Tensor) -> torch.Tensor:
    eps = torch.finfo(C.dtype).eps
    scale = C.diagonal(dim1=-2, dim2=-1).abs().amax(-1).clamp(min=eps)
    eye = torch.eye(C.shape[-1], dtype=C.dtype, device=C.device)
    return (10 * eps * scale)[..., None, None] * eye


def log_prob_chain(chain: LinearGaussianChain, x: torch.Tensor) -> torch.Tensor:
    """``log p(x)`` of states ``x (T, d)`` under the chain: O(T d^3)."""
    A, b, C = chain.all_steps()
    prev = torch.cat([x.new_zeros(1, x.shape[-1]), x[:-1]], 0)
    loc = _tmv(A, prev) + b
    mvn = torch.distributions.MultivariateNormal(loc, covariance_matrix=C, validate_args=False)
    return mvn.log_prob(x).sum()


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
