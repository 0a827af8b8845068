"""Divergence of the guide sites ``CVI()`` steps by natural gradients, seen from the loss.

``CVI()`` steps the parameters of the guide's exponential-family sites from the gradients a
Pyro ELBO wrote; the loss's value (the -ELBO estimate ``F_t`` of the current ``q_t``) is formed
from the sites the loss ran (:meth:`pyro_cvi.natgrad.observe.SiteObserver.take_loss`; ``None``,
and nothing checked, where it cannot be). :class:`LossGuard` applies the rule of
:func:`pyro_cvi.divergence.check_loss` to it: the lowest loss so far, ``F_best``, is kept with
a clone of its ``q``'s Gaussian parameters, and a loss is *suspect* when::

    F_t is not finite,   or   F_t > F_best + growth * max(|F_best|, floor)

(``growth = 1000``: far beyond the noise of a single-sample estimate). A one-draw estimate
can still land there with a fine ``q`` (heavy tails: a Gamma scale drawn near 0), so one
suspect loss is not a divergence: that step is skipped (its gradients are dropped, the guide
and every other parameter stay as they were) and the next step draws afresh from the same
``q``. Only ``SUSPECTS = 3`` suspect losses in a row (a ``q`` whose loss stays that far up)
are a divergence: the Gaussians are put back to the best ``q``, their step controls start
afresh, and :class:`~pyro_cvi.DivergenceError` says so; the next ``svi.step`` continues from
the best ``q``. Any loss below the limit resets the count. A first loss that is not finite
has no best ``q``: the error says at once that the initial ``q`` is invalid.
"""

from __future__ import annotations

import math
from typing import Dict, List

import pyro
import torch

from ..divergence import FLOOR, GROWTH, DivergenceError
from .roles import GaussianGroup

__all__ = ["LossGuard", "SUSPECTS"]

#: suspect losses in a row that make a divergence
SUSPECTS = 3


class LossGuard:
    """The best loss of the Gaussians ``CVI()`` steps, their parameters at it, and the count
    of suspect losses in a row."""

    def __init__(self) -> None:
        self.best = math.inf
        self.step = 0
        self.seen = 0
        #: suspect losses in a row (their steps were skipped)
        self.suspects = 0
        #: suspect losses in all (steps skipped)
        self.skipped = 0
        self.values: Dict[str, torch.Tensor] = {}
        #: the last loss checked
        self.last = math.nan

    def limit(self) -> float:
        """The loss above which a loss is suspect: ``F_best + growth * max(|F_best|, floor)``."""
        return self.best + GROWTH * max(abs(self.best), FLOOR)

    def check(self, loss: float, groups: List[GaussianGroup]) -> bool:
        """Record ``loss`` (the -ELBO of the Gaussians' current values). Returns whether the
        step is to be taken: ``False`` for a suspect loss (the caller skips the step). At the
        ``SUSPECTS``-th suspect loss in a row, put the Gaussians back to the best ``q`` and
        raise :class:`~pyro_cvi.DivergenceError`."""
        names = [n for g in groups for _, n in g.names]
        store = pyro.get_param_store()
        self.seen += 1
        self.last = loss
        if math.isfinite(loss) and loss <= self.best:
            self.best, self.step, self.suspects = loss, self.seen, 0
            self.values = {n: store[n].unconstrained().detach().clone() for n in names}
            return True
        if math.isfinite(loss) and loss <= self.limit():
            self.suspects = 0
            return True
        labels = [g.label for g in groups]
        if not math.isfinite(self.best):
            self.seen -= 1
            raise DivergenceError(
                f"CVI(): the loss of the initial q is {loss} for the Gaussians {labels}: it "
                "cannot be fitted from there. Check the model at the guide's initial values "
                "(init_loc_fn=..., init_scale=...), or use float64."
            )
        self.suspects += 1
        self.skipped += 1
        if self.suspects < SUSPECTS:
            return False
        self.suspects = 0
        with torch.no_grad():
            for n, v in self.values.items():
                if n in store and store[n].unconstrained().shape == v.shape:
                    store[n].unconstrained().copy_(v)
        what = "is not finite" if not math.isfinite(loss) else "grew by orders of magnitude"
        raise DivergenceError(
            f"CVI(): the fit diverged for the Gaussians {labels}: the loss {what} ({loss:.6g} "
            f"at step {self.seen}, the last of {SUSPECTS} losses in a row above the limit "
            f"{self.limit():.6g}; the best so far was {self.best:.6g}, at step {self.step}). "
            "The Gaussians were put back to that best q, and the next svi.step continues from "
            "it. Fixes: the adaptive CVI() instead of a fixed step_size (or a smaller one), more "
            "particles in the ELBO (Trace_ELBO(num_particles=...)), a lower learning rate for "
            "the other parameters (CVI(optim_args={'lr': ...})), or float64."
        )
