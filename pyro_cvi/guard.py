"""No silent divergence: a non-finite loss, or one that grows by orders of magnitude, raises.

Every training loss of an :class:`~pyro_cvi.AutoCVI` guide (``CVI_ELBO`` with gradients) is
the -ELBO ``F_t`` of the current ``q_t``. The guard keeps the lowest one seen, ``F_best``, and
the CVI parameters of its ``q`` (a clone when a new best is found). A loss is *divergent* when

    F_t is not finite,   or   F_t > F_best + growth * max(|F_best|, floor)

(``growth = 100``: two orders of magnitude above the best bound's scale, far beyond Monte Carlo
noise or a backtracked step, which the step control undoes by itself). Then the guide is put
back to its best ``q`` (the step's open transaction is dropped, cached solves and the adaptive
step control are reset) and :class:`DivergenceError` names the sites, the two values and what
to do; the next ``svi.step`` continues from the best ``q``. A first loss that is not finite
has no best ``q`` to go back to: the error says so (the initial ``q`` is invalid).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Dict

import torch

from .transaction import commit

__all__ = ["DivergenceError", "check_loss"]

GROWTH = 100.0
FLOOR = 10.0


class DivergenceError(ValueError):
    """The fit diverged: a non-finite loss, or one orders of magnitude above the best so far.
    The guide holds its best ``q`` when this is raised."""


@dataclass
class _Best:
    loss: float = math.inf
    step: int = 0
    values: Dict[str, torch.Tensor] = field(default_factory=dict)
    seen: int = 0


_BEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _labels(engine) -> list:
    return [label for b in engine.blocks for label in b.labels]


def check_loss(engine, loss: torch.Tensor) -> None:
    """Record the training loss ``loss`` (the -ELBO, detached) of ``engine``'s current ``q``; raise
    :class:`DivergenceError` after restoring the best ``q`` if it diverged (module docstring)."""
    value = float(loss.detach()) if torch.is_tensor(loss) else float(loss)
    best = _BEST.get(engine)
    if best is None:
        best = _BEST[engine] = _Best()
    best.seen += 1
    if math.isfinite(value) and value <= best.loss:
        best.loss, best.step = value, best.seen
        best.values = engine._param_values()
        return
    if math.isfinite(value) and value <= best.loss + GROWTH * max(abs(best.loss), FLOOR):
        return
    labels = _labels(engine)
    if not math.isfinite(best.loss):  # no finite loss yet: no q to go back to
        commit([engine])
        engine.pending = None
        raise DivergenceError(
            f"AutoCVI: the -ELBO of the initial q is {value} on sites {labels}: it cannot be "
            "fitted from there. Check the model at the prior's scale (a prior far wider than the "
            "data's scale makes exp(...) or a likelihood overflow), start q at the data "
            "(init_sites='laplace', the default; init_loc_fn=...), or use float64."
        )
    commit([engine])  # the pending step is not taken: its open transaction is dropped
    engine._restore(best.values)
    engine.invalidate()  # cached solves and the adaptive step control start afresh
    what = "is not finite" if not math.isfinite(value) else "grew by orders of magnitude"
    raise DivergenceError(
        f"AutoCVI: the fit diverged on sites {labels}: the -ELBO {what} ({value:.6g} at step "
        f"{best.seen}; the best so far was {best.loss:.6g}, at step {best.step}). The guide was "
        "rolled back to that best q, and the next svi.step continues from it. Fixes: the "
        "adaptive CVI() instead of a fixed step_size (or a smaller one), more Monte Carlo "
        "samples (AutoCVI(num_samples=..., num_general_samples=...)), a lower learning rate "
        "for the model's pyro.param hyperparameters (CVI(optim_args={'lr': ...})), or float64."
    )
