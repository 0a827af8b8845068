"""Pyro distributions of linear-Gaussian chains, which AutoCVI fits by Kalman smoothing.

* :class:`LinearGaussianSSM`: states ``x (T, d)`` of ``x_0 ~ N(m0, P0)``,
  ``x_t ~ N(A_t x_{t-1} + b_t, Q_t)``; ``log_prob`` and ``sample`` cost O(T d^3).
* :class:`MarkovGP`: the states of a Matern (or sum) GP at sorted 1-D inputs (exact SDE
  discretisation, :mod:`~pyro_cvi.statespace.kernels_sde`); ``f = x @ H``.
* :func:`markov_gp`: ``f = markov_gp("f", times, kernel)`` inside a model.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence, Tuple, Union

import pyro
import torch
from pyro.distributions import TorchDistribution, constraints

from .kalman import LinearGaussianChain, log_prob_chain, sample_prior
from .kernels_sde import SDEKernel

_Shape = Union[torch.Size, Sequence[int]]

__all__ = ["LinearGaussianSSM", "MarkovGP", "markov_gp"]


class LinearGaussianSSM(TorchDistribution):
    """A linear-Gaussian state-space prior over states ``x (T, d)`` (see the module docstring)."""

    arg_constraints = {
        "m0": constraints.real_vector,
        "P0": constraints.positive_definite,
        "A": constraints.real,
        "b": constraints.real,
        "Q": constraints.real,
    }
    support = constraints.independent(constraints.real, 2)
    has_rsample = False

    def __init__(
        self,
        m0: torch.Tensor,
        P0: torch.Tensor,
        A: torch.Tensor,
        b: torch.Tensor,
        Q: torch.Tensor,
        validate_args: Optional[bool] = None,
    ) -> None:
        self.m0, self.P0, self.A, self.b, self.Q = m0, P0, A, b, Q
        T, d = A.shape[0] + 1, m0.shape[-1]
        super().__init__(torch.Size(), torch.Size((T, d)), validate_args=False)

    @property
    def chain(self) -> LinearGaussianChain:
        return LinearGaussianChain(self.m0, self.P0, self.A, self.b, self.Q)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if value.dim() > 2:
            return torch.stack([self.log_prob(v) for v in value.reshape((-1,) + value.shape[-2:])])
        return log_prob_chain(self.chain, value)

    def sample(self, sample_shape: _Shape = ()) -> torch.Tensor:
        n = int(torch.Size(sample_shape).numel())
        with torch.no_grad():
            draws = [sample_prior(self.chain) for _ in range(n)]
        return torch.stack(draws).reshape(torch.Size(sample_shape) + self.event_shape)

    def expand(
        self, batch_shape: _Shape, _instance: Optional[LinearGaussianSSM] = None
    ) -> LinearGaussianSSM:
        if torch.Size(batch_shape) != torch.Size():
            raise NotImplementedError("LinearGaussianSSM has no batch dims")
        return self


class MarkovGP(LinearGaussianSSM):
    """``f ~ GP(0, kernel)`` at sorted inputs ``times (T,)`` as a chain of SDE states.

    :param times: strictly increasing inputs (irregular spacing is fine).
    :param kernel: a :class:`~pyro_cvi.statespace.kernels_sde.SDEKernel` (Matern, or sums).
    """

    def __init__(
        self, times: torch.Tensor, kernel: SDEKernel, validate_args: Optional[bool] = None
    ) -> None:
        self.times, self.kernel = times, kernel
        A, Q, P = _prior_of(times, kernel)
        m0 = times.new_zeros(P.shape[-1])
        b = times.new_zeros(A.shape[:-1])
        super().__init__(m0, P, A, b, Q)

    @property
    def emission(self) -> torch.Tensor:
        return self.kernel.emission(self.m0)


#: The last few priors of kernels with fixed hyperparameters, by the identity (and version)
#: of their inputs: a model that builds ``MarkovGP(times, Matern32(20.0, 1.0))`` every step
#: pays the matrix exponentials once. Short chains only (the entries hold ``A``, ``Q``).
_Prior = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_PRIORS: OrderedDict[Tuple[object, ...], Tuple[torch.Tensor, _Prior]] = OrderedDict()
_PRIORS_SIZE, _PRIORS_MAX_T = 4, 20_000


def _transitions(times: torch.Tensor, kernel: SDEKernel) -> _Prior:
    dt = times[1:] - times[:-1]
    if bool((dt <= 0).any()):
        raise ValueError(
            "MarkovGP needs strictly increasing inputs: sort them (and merge duplicates) "
            "before building the prior"
        )
    A, Q = kernel.transitions(dt)
    return A, Q, kernel.stationary_cov(times)


def _prior_of(times: torch.Tensor, kernel: SDEKernel) -> _Prior:
    """``(A, Q, P_inf)`` of the kernel at the inputs, from :data:`_PRIORS` when the kernel's
    hyperparameters are numbers and ``times`` is the same, unmodified, grad-free tensor."""
    kkey = kernel.key()
    if kkey is None or times.requires_grad or times.numel() > _PRIORS_MAX_T:
        return _transitions(times, kernel)
    key = (id(times), times._version, times.dtype, times.device, kkey)
    hit = _PRIORS.get(key)
    if hit is not None and hit[0] is times:  # (the reference keeps the id from being reused)
        _PRIORS.move_to_end(key)
        return hit[1]
    out = _transitions(times, kernel)
    _PRIORS[key] = (times, out)
    while len(_PRIORS) > _PRIORS_SIZE:
        _PRIORS.popitem(last=False)
    return out


def markov_gp(name: str, times: torch.Tensor, kernel: SDEKernel) -> torch.Tensor:
    """Sample the SDE states of a Markov GP at site ``name`` and return ``f = x @ H``."""
    prior = MarkovGP(times, kernel)
    x = pyro.sample(name, prior)
    return x @ prior.emission
