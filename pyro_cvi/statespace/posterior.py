"""The Markov block's ``q``: site rows on the steps, and ``q`` as a Pyro distribution.

``q(x) = p(x) prod_t exp(eta_t' x_t - x_t' J_t x_t / 2) / Z`` where the per-step information
``(eta_t, J_t) = sum_{r: t_r = t} (b_r h_r, w_r h_r h_r')`` gathers the linear-predictor sites
``exp(b_r f_r - w_r f_r^2 / 2)`` on ``f_r = h_r' x_{t_r}`` (eq. 13).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from pyro.distributions import TorchDistribution, constraints

from .increments import Increments, NestedIncrements
from .kalman import LinearGaussianChain, Marginals, log_prob_chain, sample_posterior, smooth

__all__ = [
    "SiteRows",
    "MarkovPosterior",
    "IncrementPosterior",
    "conditional_entropy",
    "conditional_log_prob",
    "neg_kl",
    "chain_neg_kl",
    "KL_ROUNDING",
]

#: The rounding (nats) of ``log Z - E_q[log sites]`` past which a Markov block below float64
#: reads ``-KL`` off its conditionals (:func:`chain_neg_kl`): the first form loses about
#: ``eps |log Z|``, ``|log Z|`` near ``sum_r b_r^2 / 2 w_r`` (a local level of T = 10,000 steps
#: observed with sd 0.01: 139 nats in float32); the second the rounding of its conditional
#: covariances, thousandths of a nat there, more in smooth chains (a Matern-3/2 GP).
KL_ROUNDING = 1e-2


@dataclass
class SiteRows:
    """Rows ``r``: step ``t (R,)``, coefficients ``H (R, d)``, site ``w (R,)``, ``b (R,)``."""

    t: torch.Tensor
    H: torch.Tensor
    w: torch.Tensor
    b: torch.Tensor
    length: int

    def one_per_step(self) -> bool:
        """Whether row ``r`` is on step ``r`` for every step (``t = 0..T-1``): then gathering
        and scattering by ``t`` are the identity."""
        flag = self.__dict__.get("_one_per_step")
        if flag is None:
            t = self.t
            flag = t.shape[0] == self.length and bool(
                (t == torch.arange(self.length, device=t.device)).all()
            )
            self.__dict__["_one_per_step"] = flag
        return flag

    def scatter(self, v: torch.Tensor) -> torch.Tensor:
        """``sum_{r: t_r = t} v_r h_r`` for every step: ``(T, d)``."""
        if self.one_per_step():
            return v[:, None] * self.H
        out = self.H.new_zeros(self.length, self.H.shape[-1])
        return out.index_add_(0, self.t, v[:, None] * self.H)

    def information(self):
        """``eta (T, d)`` and ``J (T, d, d)``."""
        d = self.H.shape[-1]
        outer = self.w[:, None, None] * self.H[:, :, None] * self.H[:, None, :]
        if not self.one_per_step():
            outer = self.H.new_zeros(self.length, d, d).index_add_(0, self.t, outer)
        return self.scatter(self.b), outer

    def moments(self, mean: torch.Tensor, cov: torch.Tensor):
        """``E_q[f_r]`` and ``Var_q[f_r]`` from the smoothed marginals."""
        if not self.one_per_step():
            mean, cov = mean[self.t], cov[self.t]
        f_mean = (self.H * mean).sum(-1)
        f_var = (self.H.unsqueeze(-2) @ cov @ self.H.unsqueeze(-1)).reshape(-1)
        return f_mean, f_var

    def expected_log_sites(self, f_mean: torch.Tensor, f_var: torch.Tensor) -> torch.Tensor:
        return (self.b * f_mean - 0.5 * self.w * (f_var + f_mean**2)).sum()


class _ChainQ(TorchDistribution):
    """A real vector-valued ``q`` of a Markov block (no batch dims, no rsample)."""

    arg_constraints = {}
    has_rsample = False

    def __init__(self, event_shape):
        super().__init__(torch.Size(), torch.Size(event_shape), validate_args=False)

    @property
    def support(self):
        return constraints.independent(constraints.real, len(self.event_shape))


class MarkovPosterior(_ChainQ):
    """``q`` of a Markov block over its states (any ``event_shape`` with ``T * d`` elements):
    ``log_prob`` is exact, O(T d^3) (below float64 with a large ``log Z``, by the
    conditionals); ``sample`` draws by perturbation (needs every site
    ``w_r >= 0``, true for log-concave likelihoods)."""

    def __init__(self, prior: LinearGaussianChain, rows: SiteRows, post: Marginals, event_shape):
        self.prior, self.rows, self.post = prior, rows, post
        self.eta, self.J = rows.information()
        super().__init__(event_shape)

    @property
    def mean(self) -> torch.Tensor:
        return self.post.mean.reshape(self.event_shape)

    @property
    def variance(self) -> torch.Tensor:
        return self.post.cov.diagonal(dim1=-2, dim2=-1).reshape(self.event_shape)

    @property
    def precision_matrix(self) -> torch.Tensor:
        """The dense ``(T d, T d)`` precision of ``q`` over the flattened states (row-major
        ``(T, d)``): the chain's block-tridiagonal precision plus the sites' ``J_t`` on the
        diagonal blocks (computed on demand: O((T d)^2) memory)."""
        return chain_precision(self.prior.detach(), self.J.detach())

    @property
    def covariance_matrix(self) -> torch.Tensor:
        """The dense ``(T d, T d)`` covariance of ``q`` over the flattened states (row-major
        ``(T, d)``), the inverse of :attr:`precision_matrix` (computed on demand, O((T d)^3));
        its diagonal blocks are the smoothed marginals."""
        L = torch.linalg.cholesky(self.precision_matrix)
        return torch.cholesky_inverse(L)

    def _states(self, value):
        return value.reshape(
            value.shape[: value.dim() - len(self.event_shape)] + (-1, self.prior.dim)
        )

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        x = self._states(value)
        if self._by_conditionals(x):
            return conditional_log_prob(self.post, x)
        if x.dim() > 2:
            return torch.stack([self.log_prob(v) for v in x.reshape((-1,) + x.shape[-2:])]).reshape(
                x.shape[:-2]
            )
        return log_prob_chain(self.prior, x) + self.site_terms(x) - self.post.log_z.detach()

    def _by_conditionals(self, x: torch.Tensor) -> bool:
        """Whether ``log q(x)`` is read by :func:`conditional_log_prob` instead of ``log p(x) +
        sites(x) - log Z``: below float64, where ``eps |log Z|`` passes :data:`KL_ROUNDING`
        (the two cancel as in :func:`chain_neg_kl`), with the lag-one covariances at hand and
        no graph to keep."""
        lz, post = self.post.log_z, self.post
        return (
            lz.dtype != torch.float64
            and post.cross is not None
            and not x.requires_grad
            and not self.prior.requires_grad()
            and torch.finfo(lz.dtype).eps * float(lz.detach().abs()) > KL_ROUNDING
        )

    def site_terms(self, x: torch.Tensor) -> torch.Tensor:
        """``sum_t eta_t' x_t - x_t' J_t x_t / 2`` of states ``(..., T, d)``."""
        quad = torch.einsum("...ti,tij,...tj->...", x, self.J, x)
        return (self.eta * x).sum((-1, -2)) - 0.5 * quad

    def sample(self, sample_shape=()) -> torch.Tensor:
        if bool((self.rows.w < 0).any()):
            raise NotImplementedError(
                "sampling a Markov q with a negative site precision (a non-log-concave "
                "likelihood such as Student-t) is not implemented; use the marginals"
            )
        n = int(torch.Size(sample_shape).numel())
        scale = self.rows.w.sqrt()
        with torch.no_grad():
            draws = [
                sample_posterior(self.prior, self.eta, self.J, scale, self.rows.scatter)
                for _ in range(n)
            ]
        return torch.stack(draws).reshape(torch.Size(sample_shape) + self.event_shape)


class IncrementPosterior(_ChainQ):
    """``q(eps)`` of a random walk ``x = cumsum(eps)``: the exact image of the chain's ``q(x)``
    under ``eps = diff(x)`` (unit Jacobian: ``log q(eps) = log q_x(cumsum eps)``). Means are
    differences of the smoothed means, variances need the lag-one covariances
    (``post.cross``); draws are differenced draws of ``x``. With a
    :class:`~pyro_cvi.statespace.hmm.HiddenStates` layout (a ``GaussianHMM`` site) it is the
    marginal ``q(y)`` of the observed part of the states instead."""

    def __init__(self, states: MarkovPosterior, layout: Increments, event_shape):
        self.states, self.layout = states, layout
        super().__init__(event_shape)

    @property
    def mean(self) -> torch.Tensor:
        return self.layout.increments(self.states.post.mean).reshape(self.event_shape)

    @property
    def variance(self) -> torch.Tensor:
        post = self.states.post
        return self.layout.variance(post.cov, post.cross).reshape(self.event_shape)

    @property
    def covariance_matrix(self) -> torch.Tensor:
        """The dense ``(D, D)`` covariance of the flattened increments ``eps = M x``:
        ``M Cov(x) M'`` with ``M`` the differencing map (computed on demand, O(D^3))."""
        cov = self.states.covariance_matrix  # (T d, T d), states row-major
        T, d = self.layout.length, self.layout.state_dim
        half = self.layout.increments(cov.reshape(T * d, T, d))  # (T d, D): M applied to columns
        return self.layout.increments(half.T.reshape(-1, T, d))  # (D, D)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        lead = value.shape[: value.dim() - len(self.event_shape)]
        flat = value.reshape(lead + (-1,))
        x = self.layout.states(flat)
        if hasattr(self.layout, "prior_log_prob"):  # hidden states (GaussianHMM): summed out
            q = self.states  # log q(y) = log p(y) + sum_r log site_r(y) - log Z
            prior = self.layout.prior_log_prob(q.prior, flat)
            return prior + q.site_terms(x) - q.post.log_z.detach()
        if isinstance(self.layout, NestedIncrements):  # (no log Z: see conditional_log_prob)
            return conditional_log_prob(self.states.post, x)
        return self.states.log_prob(x)

    def sample(self, sample_shape=()) -> torch.Tensor:
        x = self.states.sample(sample_shape)  # (..., T, d)
        return self.layout.increments(x).reshape(torch.Size(sample_shape) + self.event_shape)


def chain_precision(chain: LinearGaussianChain, J: torch.Tensor) -> torch.Tensor:
    """Dense precision of ``p(x) prod_t exp(-x_t' J_t x_t / 2)`` over ``x (T, d)`` flattened
    row-major. With ``x_t = A_t x_{t-1} + b_t + N(0, C_t)`` (``x_{-1} = 0``; ``all_steps``):
    diagonal blocks ``C_t^-1 + A_{t+1}' C_{t+1}^-1 A_{t+1} + J_t``, off-diagonal blocks
    ``(t, t-1) = -C_t^-1 A_t``."""
    A, _, C = chain.all_steps()
    T, d = A.shape[0], A.shape[-1]
    Ci = torch.cholesky_inverse(torch.linalg.cholesky(C))
    diag = Ci + J
    nxt = A[1:].transpose(-1, -2) @ Ci[1:] @ A[1:]
    diag = torch.cat([diag[:-1] + nxt, diag[-1:]], 0)
    out = A.new_zeros(T, d, T, d)
    idx = torch.arange(T, device=A.device)
    out[idx, :, idx, :] = diag
    if T > 1:
        off = -(Ci[1:] @ A[1:])  # (t, t-1) for t = 1..T-1
        out[idx[1:], :, idx[:-1], :] = off
        out[idx[:-1], :, idx[1:], :] = off.transpose(-1, -2)
    return out.reshape(T * d, T * d)


def _conditionals(post: Marginals):
    """``q(x_t | x_(t-1)) = N(m_t + G_t (x_(t-1) - m_(t-1)), C_t)`` of a Markov ``q`` from its
    marginals and lag-one covariances (float64): ``G_t = X_t S_(t-1)^-1``, ``C_t = S_t - G_t
    X_t'``, and ``C_0 = S_0``."""
    S, X = post.cov.detach().double(), post.cross.detach().double()
    G = torch.linalg.solve(S[:-1], X.mT).mT
    C = S[1:] - G @ X.mT
    C = torch.cat([S[:1], 0.5 * (C + C.mT)], 0)
    return G, torch.linalg.cholesky(C)


def conditional_entropy(post: Marginals) -> torch.Tensor:
    """``H(q) = H(x_0) + sum_t H(x_t | x_(t-1))`` of a Markov ``q`` (:func:`_conditionals`):
    the entropy without ``log Z - E_q[log sites]``, two sums that cancel to a few digits when
    the states are large (a trend's level in float32)."""
    _, L = _conditionals(post)
    T, d = post.mean.shape
    half_logdet = torch.log(torch.diagonal(L, dim1=-2, dim2=-1)).sum()
    return (half_logdet + 0.5 * T * d * (1.0 + math.log(2 * math.pi))).to(post.mean)


def conditional_log_prob(post: Marginals, x: torch.Tensor) -> torch.Tensor:
    """``log q(x)`` of states ``(..., T, d)`` as ``log q(x_0) + sum_t log q(x_t | x_(t-1))``
    (:func:`_conditionals`; no ``log Z``)."""
    G, L = _conditionals(post)
    m, xd = post.mean.detach().double(), x.double()
    loc = m[1:] + ((xd[..., :-1, :] - m[:-1]).unsqueeze(-2) @ G.mT).squeeze(-2)
    loc = torch.cat([m[:1].expand(xd.shape[:-2] + (1, m.shape[-1])), loc], -2)
    lp = torch.distributions.MultivariateNormal(loc, scale_tril=L).log_prob(xd)
    return lp.sum(-1).to(x)


def neg_kl(prior: LinearGaussianChain, post: Marginals) -> Optional[torch.Tensor]:
    """``-KL(q || p) = H(q) + E_q[log p(x)]`` of a Markov ``q`` from its marginals and lag-one
    covariances, in float64 (:func:`conditional_entropy`; ``E_q[log N(x_t; A_t x_(t-1) + b_t,
    Q_t)]`` from ``r_t = m_t - A_t m_(t-1) - b_t`` and ``Cov_q(x_t - A_t x_(t-1)) = S_t - A_t
    X_t' - X_t A_t' + A_t S_(t-1) A_t'``). It is ``log Z - E_q[log sites]`` (App. E.2) without
    that form's two large sums (each about ``sum_r b_r^2 / 2 w_r``: precise observations far
    from zero). Its own rounding is in the conditional covariances, so it suits rough chains
    (walks, precise sites) and not smooth ones (``x_t`` nearly ``A_t x_(t-1)``); ``None`` where
    a conditional covariance is not positive definite in the rounded marginals."""
    f = torch.float64
    A, b, C = (t.detach().to(f) for t in prior.all_steps())
    m, S = post.mean.detach().to(f), post.cov.detach().to(f)
    try:
        entropy = conditional_entropy(post).to(f)
    except RuntimeError:  # (torch.linalg's error of a Cholesky factorisation)
        return None
    d = m.shape[-1]
    zero = S.new_zeros(1, d, d)
    Sp = torch.cat([zero, S[:-1]])
    X = torch.cat([zero, post.cross.detach().to(f)])
    V = S - A @ X.mT - X @ A.mT + A @ Sp @ A.mT
    r = m - (A @ torch.cat([m.new_zeros(1, d), m[:-1]]).unsqueeze(-1)).squeeze(-1) - b
    L = torch.linalg.cholesky(C)
    quad = (torch.cholesky_inverse(L) * (V + r.unsqueeze(-1) * r.unsqueeze(-2))).sum()
    logdet = 2.0 * torch.log(torch.diagonal(L, dim1=-2, dim2=-1)).sum()
    value = entropy - 0.5 * (m.numel() * math.log(2 * math.pi) + logdet + quad)
    return value.to(post.mean.dtype) if bool(torch.isfinite(value)) else None


def chain_neg_kl(
    log_z: torch.Tensor,
    sites: torch.Tensor,
    prior: LinearGaussianChain,
    post: Marginals,
    rows: SiteRows,
) -> torch.Tensor:
    """``-KL(q || p) = log Z - E_q[log sites]`` (``sites``: that expectation) of ``q = p x
    rows / Z``. Below float64, where the rounding of the two sums passes :data:`KL_ROUNDING`,
    its value by :func:`neg_kl` instead (with one more smoother pass for the lag-one
    covariances where ``post`` has none), the first form's graph kept; where that is not
    finite, the first form. In float64: the first form, as it is."""
    value = log_z - sites
    if value.dtype == torch.float64:
        return value
    eps = torch.finfo(value.dtype).eps
    if eps * (float(log_z.detach().abs()) + float(sites.detach().abs())) <= KL_ROUNDING:
        return value
    if post.cross is None:
        eta, J = rows.information()
        post = smooth(prior.detach(), eta.detach(), J.detach(), lag_one=True)
    stable = neg_kl(prior, post)
    return value if stable is None else value + (stable - value).detach()
