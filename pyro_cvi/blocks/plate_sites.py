"""Linear-predictor sites of a subsampled plate: the incremental form of Algorithm 1.

A factor in ``pyro.plate(..., subsample_size=B)`` whose linked parameter is affine in a
Gaussian block keeps one site ``(lam1_n, lam2_n)`` per data point of the *whole* plate (eq. 13).
A step sees the minibatch's rows ``a_n`` only; the natural parameters of every stored site are
held in a running sum beside them (Neal & Hinton's incremental form)::

    h = sum_n a_n b_n,   P = sum_n a_n w_n a_n^T        ((w_n, b_n): site n as a row, eq. 2)

so ``q = prior + (h, P)``, with the minibatch's rows entering at their current values and the
sum less them as an extra natural parameter. A step moves the minibatch's sites to their
targets at the current ``q`` (Pyro's ``N / B`` scale taken out: a site is one point's) and
the sum by their old rows out and new rows in. The targets are exact (quadrature), not noisy
averages, so the block steps by the step's ceiling, not the minibatch schedule's decayed
``beta``; a fixed point is full-batch CVI's.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import pyro
import torch

from ..context import StepContext
from ..gaussian.sites import site_to_row
from ..model.tracing import subsample_values
from .base import StepReport, stored

__all__ = ["PlateSites", "batch_rows", "subsample_scale"]


class PlateSites:
    """Mixin of :class:`~pyro_cvi.blocks.gaussian.GaussianBlock`: its per-point sites of
    subsampled plates (``self.minibatch``, the module docstring)."""

    def init_plate_sites(self, prefix: str) -> None:
        self.sum_names = {f.site: f"{prefix}.site_sums.{f.site}" for f in self.minibatch}
        #: this step's minibatch of each such factor: (rows of its sites, A, offsets c)
        self._batch: Dict[str, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        #: per factor: ``(key, the objects keyed, (h, P))`` of :meth:`_others_of_plate`
        self._others: Dict[str, tuple] = {}

    def setup_plate_sites(self, like: torch.Tensor) -> None:
        """Register the sites (zero: ``q = prior``) and their running sums."""
        if self.minibatch and self.options.reducer is not None:
            raise NotImplementedError(
                f"block {self.spec.label!r}: data-parallel CVI (process_group) does not take "
                f"subsampled plates ({[f.site for f in self.minibatch]}): split the data over "
                "the ranks instead of subsampling, or run in one process (process_group=None)."
            )
        D = self.spec.dim
        for f in self.minibatch:
            R = math.prod(f.minibatch[1])
            pyro.param(self.site_names[f.site], lambda R=R: like.new_zeros(R, 2))
            pyro.param(self.sum_names[f.site], lambda: like.new_zeros(D, D + 1))

    def plate_view(self, f, sites: Dict[str, torch.Tensor], trace) -> Dict[str, torch.Tensor]:
        """The sites as factor ``f``'s rows see them: a plate factor's, this minibatch's."""
        if f.minibatch is None:
            return sites
        idx = batch_rows(f, subsample_values(trace)[f.plate])
        self._batch[f.site] = (idx, None, None)
        return {**sites, f.site: sites[f.site][idx]}

    def keep_batch(self, f, rows) -> None:
        """Record the minibatch's rows ``A`` and offsets ``c`` of a plate factor."""
        if f.minibatch is not None:
            self._batch[f.site] = (self._batch[f.site][0], rows.A, rows.c)

    def batch_of(self, site: str, values: torch.Tensor) -> torch.Tensor:
        """``values`` (one row per site) at this minibatch's rows, for a plate factor."""
        return values[self._batch[site][0]] if site in self._batch else values

    def write_site_grad(self, param: torch.Tensor, target: torch.Tensor, node) -> None:
        """``.grad = target - lambda`` (eq. 12's direction); for a plate factor on its
        minibatch's rows only, with Pyro's ``N / B`` taken out of the target (a site is one
        point's)."""
        name = node["name"]
        if name not in self._batch:
            param.grad = target - param.detach()
            return
        idx = self._batch[name][0]
        grad = torch.zeros_like(param)
        grad[idx] = target / subsample_scale(node) - param.detach()[idx]
        param.grad = grad

    def step(self, beta: float, ctx: Optional[StepContext] = None) -> List[StepReport]:
        """Without general factors, a block with per-point plate sites steps by the step's
        ceiling (the module docstring)."""
        if self.minibatch and not self.general and ctx is not None and ctx.max_beta:
            beta = max(beta, float(ctx.max_beta))
        return super().step(beta, ctx)  # type: ignore[misc]

    def _rows_sum(self, site: str, sites: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(A^T b, A^T W A)`` of this minibatch's rows of ``site`` at site values ``sites``
        (every point of the plate)."""
        idx, A, c = self._batch[site]
        s = sites.detach()[idx]
        w, b = site_to_row(s[:, 0], s[:, 1], c)
        return A.T @ b, A.T @ (w[:, None] * A)

    def _others_of_plate(self, site: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """The natural parameters ``(h, P)`` of every stored site of ``site`` but this
        minibatch's: the running sum less this minibatch's stored rows (eq. 11 over the whole
        plate, whose other rows this step does not see). Kept for the step's minibatch (its
        record in ``_batch``, held) while both parameters are the same tensors, unedited."""
        total, sites = stored(self.sum_names[site]), stored(self.site_names[site])
        held = (self._batch[site], total, sites)
        key = tuple((id(o), getattr(o, "_version", None)) for o in held)
        hit = self._others.get(site)
        if hit is not None and hit[0] == key:
            return hit[2]
        h, P = self._rows_sum(site, sites)
        t = total.detach()
        out = (t[:, -1] - h, t[:, :-1] - P)
        self._others = {**self._others, site: (key, held, out)}  # (rebound: see transaction)
        return out

    def plate_extras(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """The natural parameters outside this step's rows, one pair per plate factor."""
        return [self._others_of_plate(f.site) for f in self.minibatch if f.site in self._batch]

    def update_plate_sums(self, new_sites: Dict[str, torch.Tensor]) -> None:
        """Before the new site values are stored: the sums with this minibatch's old rows out
        and its new rows in."""
        for f in self.minibatch:
            if f.site in self._batch:
                h_out, P_out = self._others_of_plate(f.site)
                h, P = self._rows_sum(f.site, new_sites[f.site])
                stored(self.sum_names[f.site]).copy_(
                    torch.cat([P_out + P, (h_out + h)[:, None]], 1)
                )


def batch_rows(f, index: torch.Tensor) -> torch.Tensor:
    """The rows (of a factor's per-point sites over the full plate) of this minibatch's
    elements, in the order of the minibatch's linked value."""
    axis, full = f.minibatch
    rows = torch.arange(math.prod(full), device=index.device).reshape(full)
    return rows.index_select(axis, index.reshape(-1).long()).reshape(-1)


def subsample_scale(site) -> float:
    """The factor ``size / subsample_size`` of a site's subsampled plates (Pyro's scale of a
    minibatch's log-density), which per-point sites do not carry."""
    scale = 1.0
    for frame in site["cond_indep_stack"]:
        if frame.vectorized and frame.full_size is not None and frame.full_size != frame.size:
            scale *= frame.full_size / frame.size
    return scale
