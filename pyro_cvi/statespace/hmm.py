"""Pyro's ``dist.GaussianHMM`` as a latent: a linear-Gaussian chain with its hidden part.

A ``GaussianHMM`` site's value is the observed part ``y (T, k)`` of the generative model

    z_{-1} ~ N(m, S),  z_t = z_{t-1} M_t + w_t,  w_t ~ N(mu_t, Q_t),
    y_t = z_t G_t + v_t,  v_t ~ N(nu_t, R_t)

(row vectors, Pyro's convention), whose hidden states ``z (T, h)`` are summed out. The pair
``s_t = (z_t, y_t)`` is a Markov chain (column vectors, ``A = M', H = G'``)::

    s_0 ~ N([a_0; H_0 a_0 + nu_0], [[P_0, P_0 H_0'], [H_0 P_0, H_0 P_0 H_0' + R_0]]),
          a_0 = A_0 m + mu_0,  P_0 = A_0 S A_0' + Q_0
    s_t = [[A_t, 0], [H_t A_t, 0]] s_{t-1} + [mu_t; H_t mu_t + nu_t] + e_t,
          Cov(e_t) = [[Q_t, Q_t H_t'], [H_t Q_t, H_t Q_t H_t' + R_t]]

so the Markov block fits ``q(s) = p(s) prod_r sites_r(y) / Z`` by Kalman smoothing, with the
site factors on the ``y`` part only; its marginal ``q(y) = p(y) prod_r sites_r(y) / Z`` is the
site's ``q``, and ``KL(q(y) || p(y)) = KL(q(s) || p(s))`` (the sites do not touch ``z``), so
the ELBO is that of a dense Gaussian block on ``y`` with the HMM's marginal prior.
:class:`HiddenStates` is the layout between the site's value and the chain's states (the
interface of :class:`~pyro_cvi.statespace.increments.Increments`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pyro.distributions import GaussianHMM

from .kalman import LinearGaussianChain
from .posterior import chain_precision

__all__ = ["HiddenStates", "hmm_chain", "is_gaussian_hmm"]


def is_gaussian_hmm(base) -> bool:
    return isinstance(base, GaussianHMM)


def _gaussian(factor):
    """Pyro's information-form factor (``Gaussian``; ``AffineNormal`` converted)."""
    return factor.to_gaussian() if hasattr(factor, "to_gaussian") else factor


def _conditional(factor, n_old: int, T: int):
    """``(A (T, b, a), mu (T, b), Q (T, b, b))`` of ``x_new = A x_old + mu + N(0, Q)`` from the
    information form over ``(x_old [a], x_new [b])``: ``P_nn = Q^-1``, ``P_on = -A' Q^-1``,
    ``v_n = Q^-1 mu``."""
    g = _gaussian(factor)
    P, v = g.precision, g.info_vec
    n = P.shape[-1]
    P = P.expand((T, n, n))
    v = v.expand((T, n))
    Q = torch.cholesky_inverse(torch.linalg.cholesky(P[:, n_old:, n_old:]))
    A = -(P[:, :n_old, n_old:] @ Q).transpose(-1, -2)
    mu = (Q @ v[:, n_old:, None])[..., 0]
    return A, mu, Q


def hmm_chain(hmm: GaussianHMM) -> LinearGaussianChain:
    """The augmented chain of ``s_t = (z_t, y_t)`` (see the module docstring); it keeps the
    graph to the HMM's parameters (learnable hyperparameters get gradients through it)."""
    if len(hmm.batch_shape):
        raise ValueError("a GaussianHMM latent with batch dims is not supported; use one chain")
    T, h = int(hmm.event_shape[0]), int(hmm.hidden_dim)
    g0 = _gaussian(hmm._init)
    S = torch.cholesky_inverse(torch.linalg.cholesky(g0.precision))
    m = (S @ g0.info_vec[..., None])[..., 0]
    A, mu, Q = _conditional(hmm._trans, h, T)
    H, nu, R = _conditional(hmm._obs, h, T)
    a0 = A[0] @ m + mu[0]
    P0 = A[0] @ S @ A[0].T + Q[0]
    HP = H[0] @ P0
    m0 = torch.cat([a0, H[0] @ a0 + nu[0]])
    P0 = torch.cat([torch.cat([P0, HP.T], 1), torch.cat([HP, HP @ H[0].T + R[0]], 1)], 0)
    A, mu, Q, H, nu, R = A[1:], mu[1:], Q[1:], H[1:], nu[1:], R[1:]
    zero = A.new_zeros(A.shape[:-2] + (h + H.shape[-2], H.shape[-2]))
    HA = H @ A
    A_aug = torch.cat([torch.cat([A, HA], -2), zero], -1)
    b_aug = torch.cat([mu, (H @ mu[..., None])[..., 0] + nu], -1)
    HQ = H @ Q
    Q_aug = torch.cat(
        [
            torch.cat([Q, HQ.transpose(-1, -2)], -1),
            torch.cat([HQ, HQ @ H.transpose(-1, -2) + R], -1),
        ],
        -2,
    )
    return LinearGaussianChain(m0, P0, A_aug, b_aug, Q_aug)


@dataclass(frozen=True)
class HiddenStates:
    """Layout of a ``GaussianHMM`` site: its value ``y (T, k)`` is the last ``k`` components of
    the chain's states ``s (T, h + k)``; the first ``h`` (the HMM's hidden states) are not a
    site. Directions and points on ``y`` lift to states with a zero hidden part."""

    length: int
    hidden: int
    observed: int
    dim: int = 0  # the time dim of the site's value

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.length, self.observed])

    @property
    def state_dim(self) -> int:
        return self.hidden + self.observed

    def describe(self, site: str) -> str:
        return f"GaussianHMM {site}: chain of (z_t, y_t), hidden z (dim {self.hidden}) summed out"

    def states(self, z: torch.Tensor) -> torch.Tensor:
        """States ``(..., T, h + k)`` with ``y`` from the flat site value ``z (..., T k)`` and
        a zero hidden part."""
        y = z.reshape(z.shape[:-1] + self.shape)
        return torch.cat([y.new_zeros(y.shape[:-1] + (self.hidden,)), y], -1)

    def increments(self, x: torch.Tensor) -> torch.Tensor:
        """The site's flat value ``(..., T k)``: the ``y`` part of states ``(..., T, h + k)``."""
        return x[..., self.hidden :].reshape(x.shape[:-2] + (-1,))

    def variance(self, cov: torch.Tensor, cross=None) -> torch.Tensor:
        """``Var(y)`` flat ``(T k,)`` from the marginal covariances ``(T, h + k, h + k)``."""
        return cov.diagonal(dim1=-2, dim2=-1)[:, self.hidden :].reshape(-1)

    def prior_log_prob(self, chain: LinearGaussianChain, y: torch.Tensor) -> torch.Tensor:
        """``log p(y)`` of flat values ``(..., T k)`` under the chain's marginal over ``y``
        (dense: O((T (h + k))^3), for scoring draws)."""
        T, D = self.length, self.state_dim
        zero_J = chain.m0.new_zeros(T, D, D)
        cov = torch.cholesky_inverse(torch.linalg.cholesky(chain_precision(chain, zero_J)))
        mean = _chain_mean(chain)
        keep = torch.arange(T * D, device=cov.device).reshape(T, D)[:, self.hidden :].reshape(-1)
        mvn = torch.distributions.MultivariateNormal(
            mean.reshape(-1)[keep], covariance_matrix=cov[keep][:, keep]
        )
        return mvn.log_prob(y)


def _chain_mean(chain: LinearGaussianChain) -> torch.Tensor:
    A, b, _ = chain.all_steps()
    x = [b[0]]
    for t in range(1, A.shape[0]):
        x.append(A[t] @ x[-1] + b[t])
    return torch.stack(x)
