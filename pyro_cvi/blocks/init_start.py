"""A Gaussian block's start at ``init_loc_fn``'s values (as Pyro's autoguides start).

The block's natural parameters get one more term, a start offset ``h0 = Lambda (m_init - m)``
set after the block's first solve: ``q``'s mean moves to the given values, its precision stays.
No factor sends it a message (its target is zero), so eq. 12 shrinks it by ``1 - beta`` every
step and the fit ends where it would have without it. Without ``init_loc_fn`` there is no
offset parameter at all.

A Markov (Kalman chain) block (:class:`ChainInitStart`) has the same offset per step,
``h0 (T, d)``, added to the sites' information ``eta``: as ``d`` unit rows per step with
``w = 0`` and ``b = h0_t``, so ``log Z``, ``E_q[log sites]`` (hence the ELBO) and ``q``'s draws
all see it. ``Lambda delta`` is the chain's precision times ``delta``, in O(T d^2)
(:func:`chain_precision_times`).
"""

from __future__ import annotations

from typing import Dict, Optional

import pyro
import torch

from ..context import StepContext
from .base import stored

__all__ = ["ChainInitStart", "InitLocStart", "chain_precision_times"]


class InitLocStart:
    """Mixin of :class:`~pyro_cvi.blocks.gaussian.GaussianBlock`: the start offset (module
    docstring); the block calls :meth:`init_start_fields` in its constructor."""

    def init_start_fields(self, key: str) -> None:
        """The offset's parameter name ``key``; set (with the values q starts at) only when
        the set-up is given ``init_loc_fn``."""
        self.init_name: Optional[str] = None
        self._init_at: Optional[torch.Tensor] = None
        self._init_key = key

    setup_traces = ("init",)

    def setup(self, init) -> None:
        """The site parameters; with ``init_loc_fn``, the start offset (zero until
        :meth:`initialise` sets it from the block's first ``q``)."""
        super().setup(init)
        if init.init_loc_fn is None or init.init_trace is None:
            return
        at = {n: init.init_trace.nodes[n]["value"].detach() for n in self.names}
        self._init_at = self.spec.join(at).to(self.z_at)
        self.init_name = self._init_key
        pyro.param(self.init_name, lambda: self.z_at.new_zeros(self.spec.dim))

    def initialise(self, ctx: StepContext, fresh: bool) -> None:
        super().initialise(ctx, fresh)
        if self.init_name is None or not fresh or self._init_at is None:
            return
        # h0 = Lambda (m_init - m): q's mean moves to the values, its precision stays
        post = self.post
        delta = self._init_at - post.loc.detach()
        h0 = torch.linalg.solve(post.covariance(), delta)
        with torch.no_grad():
            pyro.param(self.init_name).copy_(h0.detach())
        self.post = self._solve()
        self._sync_rows()

    def continue_from(self, previous, values: Dict[str, torch.Tensor]) -> None:
        super().continue_from(previous, values)
        if isinstance(previous, InitLocStart) and previous.init_name is not None:
            self.init_name = previous.init_name  # (new data: the offset keeps shrinking)

    def _init_h(self) -> Optional[torch.Tensor]:
        return stored(self.init_name) if self.init_name else None


def chain_precision_times(prior, J: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``Lambda x`` for ``x (T, d)``, ``Lambda`` the precision of ``q = p(chain) x sites``: with
    ``r_t = x_t - A_t x_{t-1}`` (``A_0 = 0``, ``C_0 = P0``, ``C_t = Q_t``) and
    ``u_t = C_t^{-1} r_t``, ``(Lambda x)_t = u_t - A_{t+1}' u_{t+1} + J_t x_t``: the gradient of
    the prior's quadratic form, plus the sites' precision."""
    A, _, C = prior.all_steps()
    A, C = A.to(x), C.to(x)
    prev = torch.cat([torch.zeros_like(x[:1]), x[:-1]])
    r = x - (A @ prev.unsqueeze(-1)).squeeze(-1)
    u = torch.linalg.solve(C, r.unsqueeze(-1))
    out = u.squeeze(-1).clone()
    out[:-1] -= (A[1:].transpose(-1, -2) @ u[1:]).squeeze(-1)
    return out + (J.to(x) @ x.unsqueeze(-1)).squeeze(-1)


class ChainInitStart(InitLocStart):
    """Mixin of :class:`~pyro_cvi.blocks.markov.MarkovBlock`: the start offset of a Kalman
    chain (module docstring). The block adds :meth:`init_rows` to its site rows and steps the
    offset with its sites (target zero)."""

    def setup(self, init) -> None:
        super(InitLocStart, self).setup(init)  # (the site parameters, not InitLocStart's)
        if init.init_loc_fn is None or init.init_trace is None:
            return
        at = {n: init.init_trace.nodes[n]["value"].detach() for n in self.names}
        self._init_at = self.chain.states(self.spec.join(at).to(self.z_at))
        self.init_name = self._init_key
        pyro.param(self.init_name, lambda: self.z_at.new_zeros(self._init_at.shape))

    def initialise(self, ctx: StepContext, fresh: bool) -> None:
        super(InitLocStart, self).initialise(ctx, fresh)
        if self.init_name is None or not fresh or self._init_at is None:
            return
        # h0 = Lambda (m_init - m): q's means move to the values, its precision stays
        _, J = self._site_rows(self.rows, h0=None).information()
        delta = self._init_at - self.post.mean.detach()
        h0 = chain_precision_times(self.prior.detach(), J.detach(), delta)
        with torch.no_grad():
            pyro.param(self.init_name).copy_(h0.detach())
        self.post = self._solve(self.rows)
        self._solved_for = None

    def init_rows(self, h0: Optional[torch.Tensor]):
        """The offset as site rows ``(t, H, w, b)``: ``d`` unit rows per step, ``w = 0``."""
        if h0 is None:
            return None
        T, d = h0.shape
        t = torch.arange(T, device=h0.device).repeat_interleave(d)
        H = torch.eye(d, dtype=h0.dtype, device=h0.device).repeat(T, 1)
        return t, H, torch.zeros_like(h0).reshape(-1), h0.reshape(-1)
