"""The CVI message of a non-conjugate noise prior on a Gamma ``q(tau)`` (the bilinear block).

A noise latent ``v = tau^(1/k)`` (a precision ``k = 1``, a scale ``k = -2``, a variance
``k = -1``) whose prior is not a Gamma on the precision contributes, on ``q(tau) = Gamma(a, b)``,
the factor ``f(tau) = log p_v(tau^(1/k)) + log|1/k| + (1/k - 1) log tau``. Its expectation
``E_q[f]`` and its CVI message ``grad_m E_q[f]`` (eq. 12, ``m = (E[log tau], E[tau])``) are the
least-squares fit of ``f`` by ``T = (log tau, tau)`` under ``q``, by the trapezoid rule in
``log tau`` about the mode of ``q(log tau)``: exact when ``f`` is linear in ``T`` (an
InverseGamma variance: a conjugate prior written another way).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

__all__ = ["NoisePrior", "QUADRATURE_POINTS"]

#: trapezoid nodes of ``E_q[f(tau)]`` in ``log tau`` (a non-conjugate noise prior)
QUADRATURE_POINTS = 400


class NoisePrior:
    """The non-conjugate factor ``f(tau) = log p_v(tau^(1/k)) + log|1/k| + (1/k - 1) log tau``
    of a noise latent ``v = tau^(1/k)`` on ``q(tau) = Gamma(a, b)``: ``E_q[f]`` and its CVI
    message ``grad_m E_q[f]``, ``m = (E[log tau], E[tau])`` (eq. 12)."""

    def __init__(self, prior: torch.distributions.Distribution, power: float, dtype: torch.dtype):
        self.prior = prior
        self.inv = 1.0 / power
        big = torch.finfo(dtype).max
        #: ``|log tau|`` beyond which ``v`` would overflow the prior's dtype
        self.limit = 0.9 * math.log(big) / abs(self.inv)

    def f(self, log_tau: torch.Tensor) -> torch.Tensor:
        v = (self.inv * log_tau).exp()
        jac = math.log(abs(self.inv)) + (self.inv - 1.0) * log_tau
        return self.prior.log_prob(v) + jac

    def _nodes(self, a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(u, w)``: nodes in ``u = log tau`` and weights of ``q(u)`` (elementwise).

        ``u`` has density ``b^a/Gamma(a) exp(a u - b e^u)`` with mode ``log(a/b)``; its log falls
        by ``a (d - e^d + 1)`` at ``d`` from the mode, i.e. by 40 at ``d = log1p(sqrt(80/a) +
        40/a)`` right and ``-(sqrt(80/a) + 40/a)`` left. The trapezoid rule on that range
        (exponentially accurate for a smooth integrand decaying at both ends; cut where ``v``
        would overflow), self-normalised."""
        n = QUADRATURE_POINTS
        t = torch.linspace(0.0, 1.0, n, dtype=a.dtype, device=a.device)
        t = t.reshape((-1,) + (1,) * a.dim())
        x = (80 / a).sqrt() + 40 / a
        mode = (a / b).log()
        lo = torch.maximum(mode - x, -self.limit + 0 * a)
        hi = torch.minimum(mode + torch.log1p(x), self.limit + 0 * a)
        u = lo + (hi - lo) * t
        return u, torch.softmax(a * u - b * u.exp(), 0)

    def expected(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``E_q[f]`` elementwise (:meth:`_nodes`)."""
        u, w = self._nodes(a, b)
        return (w * self.f(u)).sum(0)

    def message(self, a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``grad_m E_q[f] = Cov_q(T)^-1 Cov_q(T, f)``, ``T = (log tau, tau)``: the coefficients
        of the least-squares fit of ``f`` by ``g_log log tau + g_tau tau + const`` under ``q``
        (float64, on :meth:`_nodes`). Fitted in the basis ``d = log tau - log tau*``,
        ``e^d - 1 - d`` (``tau* = a/b``; well conditioned at any ``a``), then
        ``g_log = beta_1 - beta_2``, ``g_tau = beta_2 / tau*``; exact when ``f`` is linear in
        ``T`` (a conjugate prior in another parameterisation)."""
        a64, b64 = a.detach().double(), b.detach().double()
        u, w = self._nodes(a64, b64)
        d = u - (a64 / b64).log()
        basis = [d, torch.expm1(d) - d]
        f = self.f(u).double()

        def centred(x: torch.Tensor) -> torch.Tensor:
            return x - (w * x).sum(0)

        p1, p2, fc = centred(basis[0]), centred(basis[1]), centred(f)
        s1, s2 = (w * p1 * p1).sum(0).sqrt(), (w * p2 * p2).sum(0).sqrt()
        p1, p2 = p1 / s1, p2 / s2
        c11, c22, c12 = (w * p1 * p1).sum(0), (w * p2 * p2).sum(0), (w * p1 * p2).sum(0)
        r1, r2 = (w * p1 * fc).sum(0), (w * p2 * fc).sum(0)
        det = c11 * c22 - c12 * c12
        beta1 = (c22 * r1 - c12 * r2) / det / s1
        beta2 = (c11 * r2 - c12 * r1) / det / s2
        return (beta1 - beta2).to(a), (beta2 * b64 / a64).to(a)
