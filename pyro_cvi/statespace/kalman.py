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
(Fisher's identity): the hyperparameter gradient of ``-KL(q || p_theta)`` at fixed q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

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


# An element is the kernel K(x, y) = exp(g + e'x - x'Jx/2) N(y; A x + b, C), stacked on dim 0.
Element = Tuple[torch.Tensor, ...]  # (A, b, C, e, J, g)


def _mv(M, v):
    return (M * v.unsqueeze(-2)).sum(-1)


def _mm(A, B):
    """Batched product of small matrices by broadcasting (faster than bmm for d <= 4)."""
    if A.shape[-1] == 1:
        return A * B
    return (A.unsqueeze(-1) * B.unsqueeze(-3)).sum(-2)


def _t(A):
    return A.transpose(-1, -2)


def _inv_det(M):
    """``(M^-1, det M)`` of a batch of small matrices: closed forms for d = 1, 2."""
    d = M.shape[-1]
    if d == 1:
        return M.reciprocal(), M[..., 0, 0]
    if d == 2:
        a, b, c, e = M[..., 0, 0], M[..., 0, 1], M[..., 1, 0], M[..., 1, 1]
        det = a * e - b * c
        adj = torch.stack([torch.stack([e, -b], -1), torch.stack([-c, a], -1)], -2)
        return adj / det[..., None, None], det
    return torch.linalg.inv(M), torch.linalg.det(M)


def combine(i: Element, j: Element) -> Element:
    """``(K_i o K_j)(x, z) = int K_i(x, y) K_j(y, z) dy`` (i earlier in time than j)."""
    Ai, bi, Ci, ei, Ji, gi = i
    Aj, bj, Cj, ej, Jj, gj = j
    eye = torch.eye(Ai.shape[-1], dtype=Ai.dtype, device=Ai.device)
    Minv, det = _inv_det(eye + _mm(Ci, Jj))  # (I + C_i J_j)^-1
    Minv_Ci = _mm(Minv, Ci)  # = (C_i^-1 + J_j)^-1, symmetric
    r = ej - _mv(Jj, bi)  # the site's residual information at b_i
    AjM = _mm(Aj, Minv)
    A = _mm(AjM, Ai)
    b = _mv(AjM, bi + _mv(Ci, ej)) + bj
    C = _mm(_mm(Aj, Minv_Ci), _t(Aj)) + Cj
    # (I + J_j C_i)^-1 = ((I + C_i J_j)^-1)' for symmetric C, J
    AtN = _mm(_t(Ai), _t(Minv))
    e = _mv(AtN, r) + ei
    J = _mm(_mm(AtN, Jj), Ai) + Ji
    quad = (ej * bi).sum(-1) - 0.5 * (bi * _mv(Jj, bi)).sum(-1) + 0.5 * (r * _mv(Minv_Ci, r)).sum(-1)
    bad = det <= 0
    g = gi + gj - 0.5 * torch.where(bad, torch.ones_like(det), det).log() + quad
    g = torch.where(bad, torch.full_like(g, float("nan")), g)
    return A, b, C, e, J, g


def _identity_like(el: Element, n: int) -> Element:
    A = el[0]
    d = A.shape[-1]
    eye = torch.eye(d, dtype=A.dtype, device=A.device).expand(n, d, d)
    z = A.new_zeros(n, d)
    zz = A.new_zeros(n, d, d)
    return eye, z, zz, z, zz, A.new_zeros(n)


def reduce(elements: Element) -> Element:
    """The ordered product of all elements by pairwise (tree) reduction: log2(T) levels."""
    el = elements
    while el[0].shape[0] > 1:
        n = el[0].shape[0]
        if n % 2:
            el = tuple(torch.cat([t, p], 0) for t, p in zip(el, _identity_like(el, 1)))
        left = tuple(t[0::2] for t in el)
        right = tuple(t[1::2] for t in el)
        el = combine(left, right)
    return el


def site_elements(chain: LinearGaussianChain, eta: torch.Tensor, J: torch.Tensor) -> Element:
    """Per step, the transition kernel followed by its site (``eta (T, d)``, ``J (T, d, d)``)."""
    A, b, C = chain.all_steps()
    T, d = eta.shape
    zeros_d, zeros_dd = eta.new_zeros(T, d), eta.new_zeros(T, d, d)
    trans = (A, b, C, zeros_d, zeros_dd, eta.new_zeros(T))
    eye = torch.eye(d, dtype=eta.dtype, device=eta.device).expand(T, d, d)
    site = (eye, zeros_d, zeros_dd, eta, J, eta.new_zeros(T))
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

    @property
    def loc(self) -> torch.Tensor:
        """The means flattened (as a Gaussian block's ``post.loc``)."""
        return self.mean.reshape(-1)


def smooth(
    chain: LinearGaussianChain, eta: torch.Tensor, J: torch.Tensor, keep_graph: bool = False
) -> Marginals:
    """Forward reduction + one backward pass (the RTS smoother as the gradient of log Z).

    With ``keep_graph``, the returned ``log_z`` keeps its graph to the chain's tensors (for
    hyperparameter gradients); the marginals are always detached.
    """
    with torch.enable_grad():
        e = eta.detach().clone().requires_grad_(True)
        Jl = J.detach().clone().requires_grad_(True)
        ch = chain if keep_graph else chain.detach()
        log_z = log_normalizer(ch, e, Jl)
        if not bool(torch.isfinite(log_z)):
            raise NotPositiveDefinite("q is not positive definite: log Z is not finite")
        g_e, g_J = torch.autograd.grad(log_z, (e, Jl), retain_graph=keep_graph)
    mean = g_e.detach()
    second = -(g_J + g_J.transpose(-1, -2)).detach()  # E[x x'] (symmetrised)
    cov = second - mean.unsqueeze(-1) * mean.unsqueeze(-2)
    diag = cov.diagonal(dim1=-2, dim2=-1)
    if not bool(torch.isfinite(cov).all()) or bool((diag <= 0).any()):
        raise NotPositiveDefinite("q is not positive definite: a marginal variance <= 0")
    return Marginals(mean, cov, log_z if keep_graph else log_z.detach())


def prefix_affine(A: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x_t = A_t x_{t-1} + b_t`` from ``x_{-1} = 0`` for every t, by a parallel prefix scan
    of affine maps (``(A_j, b_j) o (A_i, b_i) = (A_j A_i, A_j b_i + b_j)``)."""
    T = A.shape[0]
    if T == 1:
        return b.clone()
    n = T - T % 2
    A2 = A[1:n:2] @ A[0:n:2]
    b2 = _mv(A[1:n:2], b[0:n:2]) + b[1:n:2]
    odd = prefix_affine(A2, b2)  # x at t = 1, 3, 5, ...
    out = torch.empty_like(b)
    out[1:n:2] = odd
    out[0] = b[0]
    if T > 2:
        even_idx = torch.arange(2, T, 2, device=b.device)
        out[even_idx] = _mv(A[even_idx], odd[: even_idx.shape[0]]) + b[even_idx]
    return out


def sample_prior(chain: LinearGaussianChain, generator: Optional[torch.Generator] = None):
    """One draw of the chain (ancestral sampling as a parallel scan)."""
    A, b, C = chain.all_steps()
    L = torch.linalg.cholesky(C + _jitter(C))
    eps = torch.randn(b.shape, dtype=b.dtype, device=b.device, generator=generator)
    return prefix_affine(A, b + _mv(L, eps))


def _jitter(C: torch.Tensor) -> torch.Tensor:
    eps = torch.finfo(C.dtype).eps
    scale = C.diagonal(dim1=-2, dim2=-1).abs().amax(-1).clamp(min=eps)
    eye = torch.eye(C.shape[-1], dtype=C.dtype, device=C.device)
    return (10 * eps * scale)[..., None, None] * eye


def log_prob_chain(chain: LinearGaussianChain, x: torch.Tensor) -> torch.Tensor:
    """``log p(x)`` of states ``x (T, d)`` under the chain: O(T d^3)."""
    A, b, C = chain.all_steps()
    prev = torch.cat([x.new_zeros(1, x.shape[-1]), x[:-1]], 0)
    loc = _mv(A, prev) + b
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
    shift = eta + eps - _mv(J, x0)
    return x0 + smooth(chain.zero_mean(), shift, J).mean
