"""A Gaussian block's start at ``init_loc_fn``'s values (as Pyro's autoguides start).

The block's natural parameters get one more term, a start offset ``h0 = Lambda (m_init - m)``
set after the block's first solve: ``q``'s mean moves to the given values, its precision stays.
No factor sends it a message (its target is zero), so eq. 12 shrinks it by ``1 - beta`` every
step and the fit ends where it would have without it. Without ``init_loc_fn`` there is no
offset parameter at all.
"""

from __future__ import annotations

from typing import Dict, Optional

import pyro
import torch

from ..context import StepContext

__all__ = ["InitLocStart"]


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
        return pyro.param(self.init_name) if self.init_name else None
