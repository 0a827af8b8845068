"""Factors with discrete parents on a Gaussian site block (Algorithm 2's messages, eq. 20).

Two kinds, both weighted by the mean-field ``q`` of the discrete parents and owned by the mean
field (which computes their ELBO terms and their messages to ``q(s)``):

* ``CONJUGATE_ENUM``: a Normal with loc affine in the block given ``s``: exact rows per
  enumerated value (:mod:`pyro_cvi.messages.enumerated`);
* ``LINEAR_ENUM``: a GLM whose linked parameter is affine in the block given ``s``: one
  linear-predictor site ``(lam1, lam2)`` per enumerated value and element (eq. 13), target
  ``q(s = k)`` times the branch's quadrature target (eqs. 30-31,
  :mod:`pyro_cvi.messages.enumerated_glm`). At ``beta = 1`` the block is the exact CVI /
  VMP update of ``q(z)`` given ``q(s)`` for the quadrature's ``E_q[log p]``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import pyro
import torch

from ..context import StepContext
from ..messages.enumerated import enumerated_normal_rows
from ..messages.enumerated_glm import enumerated_site
from ..messages.gaussian import RowBlock, linear_predictor_message, linear_predictor_rows
from ..model.records import CONJUGATE_ENUM, LINEAR_ENUM

__all__ = ["ENUMERATED", "EnumeratedSites"]

#: the kinds this mixin builds rows for
ENUMERATED = (CONJUGATE_ENUM, LINEAR_ENUM)


class EnumeratedSites:
    """Mixin of :class:`~pyro_cvi.blocks.gaussian.GaussianBlock` (see the module docstring)."""

    def init_enumerated_sites(self, prefix: str) -> None:
        self.enum_sites = {f.site: f for f in self.spec.factors if f.kind == LINEAR_ENUM}
        self.site_names.update({s: f"{prefix}.sites.{s}" for s in self.enum_sites})
        self._enum_nodes: Dict[str, dict] = {}

    def setup_enumerated_sites(self, like: torch.Tensor) -> None:
        """One zero site per enumerated value and element (``q = prior``)."""
        for site, f in self.enum_sites.items():
            R = f.jacobian.shape[0]
            pyro.param(self.site_names[site], lambda R=R: like.new_zeros(R, 2))

    def enumerated_rows(self, ctx: StepContext, f) -> Tuple[Optional[str], RowBlock]:
        """The rows of a factor with discrete parents at this step's ``q``."""
        if f.kind == CONJUGATE_ENUM:
            return None, enumerated_normal_rows(ctx, f, self.spec, self.z_at)
        node = enumerated_site(ctx, f, self.spec, self.z_at)
        self._enum_nodes[f.site] = node
        sites = pyro.param(self.site_names[f.site]).detach()
        return f.site, linear_predictor_rows(node, f, self.z_at, sites)

    def enumerated_grad(self, ctx: StepContext, site: str, post, sl: slice, rows) -> bool:
        """For a ``LINEAR_ENUM`` site: write its natural gradient ``target - lambda`` (with
        ``ctx.grads``) and return ``True`` (its ELBO term is the mean field's); ``False`` for
        any other site."""
        if site not in self.enum_sites:
            return False
        if ctx.grads:
            _, target = linear_predictor_message(
                self._enum_nodes[site],
                rows,
                post.f_mean[sl],
                post.f_var[sl],
                self.options.num_quad_points,
                self.options.num_samples,
            )
            param = pyro.param(self.site_names[site])
            param.grad = target - param.detach()
        return True
