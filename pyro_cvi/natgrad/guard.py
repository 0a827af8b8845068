"""Divergence of the guide sites ``CVI()`` steps by natural gradients, seen from the loss.

``CVI()`` steps the parameters of the guide's exponential-family sites from the gradients a
Pyro ELBO wrote; the loss's value (the -ELBO estimate ``F_t`` of the current ``q_t``) is formed
from the sites the loss ran (:meth:`pyro_cvi.natgrad.observe.SiteObserver.take_loss`; ``None``,
and nothing checked, where it cannot be). :class:`LossGuard` applies the rule of
:func:`pyro_cvi.divergence.check_loss` to it: the lowest loss so far, ``F_best``, is kept with
a clone of its ``q``'s Gaussian parameters, and a loss is divergent when::

    F_t is not finite,   or   F_t > F_best + growth * max(|F_best|, floor)

(``growth = 1000``: far beyond the noise of a single-sample estimate). Then the Gaussians are
put back to the best ``q``, their step controls start afresh, nothing is stepped, and
:class:`~pyro_cvi.DivergenceError` says so; the next ``svi.step`` continues from the best
``q``. A first loss that is not finite has no best ``q``: the error says the initial ``q`` is
invalid.
"""

from __future__ import annotations

import math
from typing import Dict, List

import pyro
import torch

from ..divergence import FLOOR, GROWTH, DivergenceError
from .roles import GaussianGroup

__all__ = ["LossGuard"]


class LossGuard:
    """The best loss of the Gaussians ``CVI()`` steps, and their parameters at it."""

    def __init__(self) -> None:
        self.best = math.inf
        self.step = 0
        self.seen = 0
        self.values: Dict[str, torch.Tensor] = {}

    def check(self, loss: float, groups: List[GaussianGroup]) -> bool:
        """Record ``loss`` (the -ELBO of the Gaussians' current values); on divergence put them
        back to the best ``q`` and raise :class:`~pyro_cvi.DivergenceError`. Returns whether
        the loss is a new best."""
        names = [n for g in groups for _, n in g.names]
        store = pyro.get_param_store()
        self.seen += 1
        if math.isfinite(loss) and loss <= self.best:
            self.best, self.step = loss, self.seen
            self.values = {n: store[n].unconstrained().detach().clone() for n in names}
            return True
        if math.isfinite(loss) and loss <= self.best + GROWTH * max(abs(self.best), FLOOR):
            return False
        labels = [g.label for g in groups]
        if not math.isfinite(self.best):
            self.seen -= 1
            raise DivergenceError(
                f"CVI(): the loss of the initial q is {loss} for the Gaussians {labels}: it "
                "cannot be fitted from there. Check the model at the guide's initial values "
                "(init_loc_fn=..., init_scale=...), or use float64."
            )
        with torch.no_grad():
            for n, v in self.values.items():
                if n in store and store[n].unconstrained().shape == v.shape:
                    store[n].unconstrained().copy_(v)
        what = "is not finite" if not math.isfinite(loss) else "grew by orders of magnitude"
        raise DivergenceError(
            f"CVI(): the fit diverged for the Gaussians {labels}: the loss {what} ({loss:.6g} "
            f"at step {self.seen}; the best so far was {self.best:.6g}, at step {self.step}). "
            "The Gaussians were put back to that best q, and the next svi.step continues from "
            "it. Fixes: the adaptive CVI() instead of a fixed step_size (or a smaller one), more "
            "particles in the ELBO (Trace_ELBO(num_particles=...)), a lower learning rate for "
            "the other parameters (CVI(optim_args={'lr': ...})), or float64."
        )
