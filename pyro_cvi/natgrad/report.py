"""The reported loss of a Gaussian block tracked from step to step with common random numbers
(:class:`TrackedReport`; the pairs themselves: :func:`pyro_cvi.natgrad.joint.add_report` and
:func:`~pyro_cvi.natgrad.joint.onedraw_messages`)."""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch

__all__ = ["TrackedReport"]


class TrackedReport:
    """An estimate of the current ``q``'s bound that carries the previous step's forward with
    common random numbers::

        R_t = (1 - b) (R_{t-1} + D_t) + b F_t,    D_t = mean_j [f(q_t; e_j) - f(q_{t-1}; e_j)]

    with ``F_t`` the mean of fresh antithetic pairs at ``q_t`` and ``f(q; e)`` a pair's bound
    integrand at ``m + L e`` (the same ``e_j`` at both ``q``'s, so ``D_t`` is exact in mean and
    small where ``q`` moved little). ``E[D_t] = f(q_t) - f(q_{t-1})`` given the past, so
    ``R_t`` is unbiased for the current ``q_t``'s bound whenever ``R_{t-1}`` was for
    ``q_{t-1}``'s (by induction from ``R_0 = F_0``): not an average over a trajectory. Its
    variance is about ``b/2 var F + var D / (2 b)``, least at ``b = sd D / sd F``, read from
    the running variances of earlier steps (never this step's draws) and kept in
    ``[B_MIN, 1]``. It restarts from ``F_t`` (``b = 1``) where the log joint may have changed
    since the previous ``q`` (other data, a minibatch, the model's parameters: the ``key``),
    where there is no previous ``q`` or it is not finite.

    From one draw a step (no spread within the step) the variances are running means over the
    steps: ``var F`` of the fresh value's residual ``F_t - (R_{t-1} + D_t)`` and ``var D`` of
    ``D_t^2`` (an upper bound: it includes the bound's change), from the previous steps."""

    #: the running variances' averaging rate, and the least weight of a fresh estimate
    RATE = 0.1
    B_MIN = 0.02

    def __init__(self) -> None:
        self.value: Optional[float] = None
        self.params: Optional[Dict[str, torch.Tensor]] = None
        self.var_f: Optional[float] = None
        self.var_d: Optional[float] = None
        #: what the log joint read at the previous ``q`` (``None`` after a load: a resumed run
        #: continues on the data it was saved with)
        self.key = None
        self._loaded = False

    def previous(self, key) -> Optional[Dict[str, torch.Tensor]]:
        """The previous ``q``'s parameters where ``R_{t-1}`` carries on under ``key``."""
        if self.value is None or self.params is None:
            return None
        if self._loaded:
            self.key, self._loaded = key, False
        return self.params if key is not None and key == self.key else None

    def update(self, key, params, pairs: torch.Tensor, prev: Optional[torch.Tensor]) -> float:
        """``R_t`` from this step's pairs at ``q_t`` and (where :meth:`previous` gave a ``q``)
        the same pairs at ``q_{t-1}``; keeps ``(R_t, q_t)``."""
        pairs = pairs.double()
        one = pairs.numel() < 2
        fresh = float(pairs.mean())
        var_f = None if one else float(pairs.var())
        value = fresh
        if prev is not None:
            d = pairs - prev.double()
            var_d = float(d.pow(2).mean()) if one else float(d.var())
            b = 1.0
            if self.var_d is not None and self.var_f:
                b = min(1.0, max(self.B_MIN, math.sqrt(self.var_d / self.var_f)))
            carried = self.value + float(d.mean())
            value = (1.0 - b) * carried + b * fresh
            self.var_d = var_d if self.var_d is None else self._avg(self.var_d, var_d)
            if one:  # the fresh value's spread about the carried estimate
                var_f = (fresh - carried) ** 2
        if var_f is not None:
            self.var_f = var_f if self.var_f is None else self._avg(self.var_f, var_f)
        if not (math.isfinite(value) and math.isfinite(self.var_f or 0.0)):
            self.value = self.params = self.var_f = self.var_d = None
            return fresh
        self.value, self.key = value, key
        self.params = {k: v.detach().clone() for k, v in params.items()}
        return value

    def _avg(self, old: float, new: float) -> float:
        return old + self.RATE * (new - old) if math.isfinite(new) else old

    def state(self) -> Dict:
        return {
            "value": self.value,
            "params": self.params,
            "var_f": self.var_f,
            "var_d": self.var_d,
        }

    def load(self, state: Optional[Dict]) -> None:
        if not state:
            return
        self.value, self.params = state.get("value"), state.get("params")
        self.var_f, self.var_d = state.get("var_f"), state.get("var_d")
        self._loaded = True
