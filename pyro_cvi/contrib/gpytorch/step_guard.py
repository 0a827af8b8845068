"""Backtracking for the CVI step taken inside ``loss.backward()`` (inducing-site form).

The backward pass gives the gradient of the objective, never its value, so the test that
:class:`~pyro_cvi.contrib.gpytorch.CVIOptimizer` makes on the -ELBO is made here on its
gradients. In the mean parameters ``mu = (m_v, S_v + m_v m_v^T)`` of q(v) the gradient of the
objective ``G = F - KL`` (``F`` the data term, at full-data scale) is the natural gradient
(Khan & Lin 2017, eqs. 11-13)::

    dG/dmu = t - lam,          t = the CVI target (``mean_param_targets``), lam = the sites,

so after a step ``mu_k -> mu_{k+1}`` the change of ``G`` is, by the trapezoidal rule along the
step (exact when ``G`` is quadratic in ``mu``, as it is for a Gaussian likelihood),

    Delta G ~= 1/2 <mu_{k+1} - mu_k, (t_k - lam_k) + (t_{k+1} - lam_{k+1})>.

A step with ``Delta G < -tol`` made the objective worse (it overshot by more than twice the
optimum along its line): it is undone (the sites go back to ``lam_k``) and ``beta <- shrink *
beta``; the next backward pass takes the step from ``lam_k`` with that ``beta`` towards the target
it computes there. The step is not redone towards the stored ``t_k``: ``t_k`` belongs to the
objective of step ``k``, and between two backward passes the user may have changed it (a noise,
a lengthscale or the targets set by hand, another likelihood) in ways the strategy cannot see;
the fresh target is always the current objective's. Each batch element (each GP of a batched or
multitask model) has its own ``beta``; an accepted step lets it grow back by ``grow`` up to the
strategy's ``step_size``. The test is only made between two steps on the same inputs with the
same weight of the KL (full-batch training: a minibatch's gradient is a different objective's),
as ``CVIOptimizer`` only backtracks full-batch steps; the hyperparameters' own step between the
two is small at GPyTorch's learning rates.

Every new value of the sites is also retracted into the valid set: ``B = I - 2 lam2`` must have a
Cholesky factor in the working precision and the sites must be finite. If not, ``beta`` is
shrunk until it is (the blend of two negative semidefinite ``lam2`` is one, so a small enough
step always is), and if even ``min_step_size`` fails the sites are left as they were.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from pyro_cvi.linalg import NotPositiveDefinite
from pyro_cvi.update import cvi_update

__all__ = ["SecantBacktracking"]

Pair = Tuple[Tensor, Tensor]


def _mean_params(m: Tensor, S: Tensor) -> Pair:
    return m, S + m.unsqueeze(-1) * m.unsqueeze(-2)


def _pair_dot(a: Pair, b: Pair) -> Tensor:
    """``<a, b>`` of (vector, matrix) pairs, per batch element."""
    return (a[0] * b[0]).sum(-1) + (a[1] * b[1]).sum((-2, -1))


class _Point:
    """The state at one accepted step: sites, q(v)'s mean parameters, targets, inputs, weight."""

    __slots__ = ("lam", "mu", "target", "inputs", "weight")

    def __init__(self, lam: Pair, mu: Pair, target: Pair, inputs, weight: Tensor):
        self.lam = tuple(t.detach().clone() for t in lam)
        self.mu = tuple(t.detach().clone() for t in mu)
        self.target = tuple(t.detach().clone() for t in target)
        self.inputs, self.weight = inputs, weight.detach().clone()

    def gradient(self) -> Pair:
        return self.target[0] - self.lam[0], self.target[1] - self.lam[1]


class SecantBacktracking:
    """The step policy of the backward-pass CVI step (module docstring).

    :param step_size: the largest ``beta`` (the strategy's ``step_size``).
    :param shrink: factor on ``beta`` for an undone step, and for a retraction.
    :param grow: factor on ``beta`` after an accepted step (capped at ``step_size``).
    :param min_step_size: below this ``beta`` steps are no longer undone.
    :param rel_tol: ``tol = abs_tol + rel_tol (|<dmu, g_k>| + |<dmu, g_{k+1}>|)``.
    :param abs_tol: in nats (the objective at full-data scale).
    """

    def __init__(
        self,
        step_size: float,
        shrink: float = 0.5,
        grow: float = 1.25,
        min_step_size: float = 1e-3,
        rel_tol: float = 0.01,
        abs_tol: float = 1e-2,
    ):
        self.step_size = float(step_size)
        self.shrink, self.grow = float(shrink), float(grow)
        self.min_step_size = float(min_step_size)
        self.rel_tol, self.abs_tol = float(rel_tol), float(abs_tol)
        self.beta: Optional[Tensor] = None
        self.last: Optional[_Point] = None
        self.version: Optional[int] = None
        #: steps undone and redone with a smaller ``beta`` (summed over batch elements)
        self.num_backtracks = 0
        #: steps whose size was cut to keep ``B`` positive definite in the working precision
        self.num_retractions = 0

    def reset(self) -> None:
        """Forget the last step (the sites or the objective changed from outside)."""
        self.last, self.version = None, None

    def _betas(self, like: Tensor) -> Tensor:
        if self.beta is None or self.beta.shape != like.shape[:-1]:
            self.beta = torch.full(like.shape[:-1], self.step_size, dtype=torch.float64)
        return self.beta

    def comparable(self, version: int, inputs, weight: Tensor) -> bool:
        """Whether the last step was taken from the sites now held (``version``), on the same
        inputs and with the same KL weight, so that its test is meaningful."""
        last = self.last
        if last is None or self.version != version or inputs is None or last.inputs is None:
            return False
        if len(inputs) != len(last.inputs) or last.weight.shape != weight.shape:
            return False
        same = all(
            a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
            for a, b in zip(inputs, last.inputs)
        )
        return same and bool(torch.equal(last.weight, weight))

    def step(
        self,
        lam: Pair,
        mu_v: Pair,
        target: Pair,
        inputs,
        weight: Tensor,
        version: int,
        check,
    ) -> Optional[Pair]:
        """The new sites from the current ``lam`` (q(v) ``mu_v = (m_v, S_v)``) and the CVI
        ``target``; ``check(lam1, lam2)`` raises :class:`NotPositiveDefinite` for invalid sites.
        Returns ``None`` if no valid step exists (the sites must stay as they are)."""
        beta = self._betas(lam[0])
        mu = _mean_params(*mu_v)
        here = _Point(lam, mu, target, inputs, weight)
        base = here
        undo = torch.zeros(beta.shape, dtype=torch.bool)
        if self.comparable(version, inputs, weight):
            last = self.last
            d_mu = (mu[0] - last.mu[0], mu[1] - last.mu[1])
            a, b = _pair_dot(d_mu, last.gradient()), _pair_dot(d_mu, here.gradient())
            change = 0.5 * (a + b)
            tol = self.abs_tol + self.rel_tol * (a.abs() + b.abs())
            undo = ((change < -tol) & (beta.to(change) > self.min_step_size)).cpu()
            if bool(undo.any()):
                self.num_backtracks += int(undo.sum())
                beta = torch.where(undo, beta * self.shrink, beta)
                base = _Point(  # undone elements: back to the last sites, no step (see above)
                    tuple(torch.where(self._expand(undo, o), o, h) for o, h in zip(last.lam, lam)),
                    tuple(torch.where(self._expand(undo, o), o, h) for o, h in zip(last.mu, mu)),
                    tuple(
                        torch.where(self._expand(undo, o), o, h)
                        for o, h in zip(last.target, target)
                    ),
                    inputs,
                    weight,
                )
            beta = torch.where(undo, beta, (beta * self.grow).clamp_max(self.step_size))
        new = self._retract(base, torch.where(undo, torch.zeros_like(beta), beta), check)
        if new is None:
            self.reset()
            return None
        self.last, self.beta = base, torch.where(undo, beta, self.beta_used)
        return new

    @staticmethod
    def _expand(mask: Tensor, like: Tensor) -> Tensor:
        extra = like.dim() - mask.dim()
        return mask.to(like.device).reshape(mask.shape + (1,) * extra)

    def _retract(self, base: _Point, beta: Tensor, check) -> Optional[Pair]:
        """Blend ``base.lam`` towards ``base.target`` with ``beta`` (0: stay), shrinking ``beta``
        (every moving element) until ``check`` passes; ``None`` if it never does above
        ``min_step_size``."""
        while True:
            b = beta.to(base.lam[0])
            lam1, lam2 = cvi_update(base.lam, base.target, b)
            lam2 = 0.5 * (lam2 + lam2.mT)
            try:
                if not bool(torch.isfinite(lam1).all() and torch.isfinite(lam2).all()):
                    raise NotPositiveDefinite("non-finite sites")
                check(lam1, lam2)
            except NotPositiveDefinite:
                if float(beta.max()) <= self.min_step_size:
                    return None
                self.num_retractions += 1
                shrunk = (beta * self.shrink).clamp_min(self.min_step_size * self.shrink)
                beta = torch.where(beta > 0, shrunk, beta)  # undone elements stay put
                continue
            self.beta_used = beta
            return lam1, lam2
