"""A Gaussian natural-gradient step at one gradient's cost, with a step control that survives
Monte Carlo noise (the variational online Newton step of IVON, Shen et al. 2024, in CVI's form).

From one reparameterised draw ``u = m + L eps`` of ``q = N(m, S)``, ``P = S^-1``, and the
gradient ``g = grad f(u)`` of the non-Gaussian part ``f`` of the log joint (a known Gaussian
prior ``N(a, P0^-1)`` is split off and enters exactly), with the residual
``r = g + (P - P0)(u - m)`` (its control variate ``(P - P0)(u - m)`` has mean zero and cancels
``g``'s fluctuation where ``f`` is quadratic with Hessian ``-(P - P0)``, i.e. at the optimum of
a Gaussian posterior)::

    dl/dm = -r + P0 (m - a)                           (Bonnet, eq. 30)
    G     = -sym(S^-1 (u - m) r^T) = -sym(L^-T eps r^T) (Stein / reparameterisation Hessian,
                                                          eq. 31: G = P0 - E[hess f] - P)

(diagonal: ``G = -r eps / s``, IVON's ``h = g (z - m) / s^2``; no second derivative). The step
is the positive-definite one of Lin, Schmidt & Khan (2020)::

    P' = P + rho G + (rho^2 / 2) G S G,    m' = m - alpha S' gbar

with ``gbar`` the bias-corrected exponential average (``momentum``) of ``dl/dm``'s sampled part
(the prior's part is added exactly, not averaged). ``rho`` is small: ``P`` is the running
average of about ``1 / rho`` one-draw curvature estimates. ``alpha`` is a fraction of a Newton
step. Both decay by a cosine over ``horizon`` steps to ``final`` of their start
(:class:`Horizon`): the noise of one draw is averaged out by the decay, never read as
convergence.

They also halve where the step has stopped gaining beyond its noise (``plateau`` steps): over
each run of ``W = plateau`` steps the least-squares slope ``b`` of the block's own one-draw
bound estimates and its standard error ``se(b) = sigma sqrt(12 / (W (W^2 - 1)))`` give the
gain still to come over the next ``W`` steps; where it is not resolved from zero, ``-b <=
se(b)`` (the decrease within one standard error of none: the mean jitters in its noise ball
at this step size), a second factor halves (floored at ``final``), and the sizes are ``min(
cosine, factor)`` of their start. A small problem's steps reach their noise ball and decay
within a few hundred steps; a large one keeps its steps while its bound still falls
measurably, whatever its size or its step count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["Horizon", "HorizonControl", "RESTART_COS", "TrackedReport"]

#: the momentum restarts when the new gradient's cosine with it is below minus this
RESTART_COS = 0.5


@dataclass(frozen=True)
class Horizon:
    """The one-draw natural-gradient step and its schedule (see the module docstring).

    :param lr: ``alpha``, the mean's step as a fraction of a Newton step, at the start.
    :param rho: the precision's averaging rate at the start.
    :param momentum: the mean gradient's averaging rate ``beta1`` (0: none).
    :param horizon: steps over which both decay by a cosine to ``final`` of their start (they
        stay there after).
    :param final: the fraction of ``lr`` and ``rho`` left at the horizon (the defaults' mean
        step starts at a fifth of a Newton step and ends at a hundredth).
    :param warmup: steps over which the mean's step grows linearly to ``lr`` (the first
        steps' curvature is the initial guess's, and momentum would carry their error on).
    :param plateau: the steps of one slope test of the module docstring (0: the cosine alone).
    :param particles: reparameterised draws per step.
    :param report_pairs: antithetic pairs ``m +- L e_j`` of forward-only draws for the reported
        loss, run in the gradient draw's batched model run (from a generator of the block's
        own, so that the step's draws are unchanged): the reported loss is their mean, unbiased
        for the current ``q``'s bound, its odd Taylor terms cancelled in each pair, and
        independent of the step control's accept decision, which reads the gradient draw's
        estimate (0: the gradient draw's own estimate).
    :param report_track: with ``report_pairs >= 2``, the reported loss is
        :class:`TrackedReport`'s estimate (the same pairs also run at the previous ``q``).
    """

    lr: float = 0.2
    rho: float = 0.05
    momentum: float = 0.9
    horizon: int = 2000
    final: float = 0.05
    warmup: int = 0
    plateau: int = 100
    particles: int = 1
    report_pairs: int = 16
    report_track: bool = True

    def __post_init__(self) -> None:
        for name in ("lr", "rho"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ValueError(f"Horizon({name}={v!r}): a number in (0, 1]")
        if not (0 <= self.momentum < 1):
            raise ValueError(f"Horizon(momentum={self.momentum!r}): a number in [0, 1)")
        if not (isinstance(self.horizon, int) and self.horizon >= 1):
            raise ValueError(f"Horizon(horizon={self.horizon!r}): a positive integer (steps)")
        if not (isinstance(self.warmup, int) and self.warmup >= 0):
            raise ValueError(f"Horizon(warmup={self.warmup!r}): a non-negative integer (steps)")
        if not (0 < self.final <= 1):
            raise ValueError(f"Horizon(final={self.final!r}): a number in (0, 1]")
        if not (isinstance(self.plateau, int) and (self.plateau == 0 or self.plateau >= 3)):
            raise ValueError(f"Horizon(plateau={self.plateau!r}): 0 or an integer >= 3 (steps)")
        if not (isinstance(self.particles, int) and self.particles >= 1):
            raise ValueError(f"Horizon(particles={self.particles!r}): a positive integer")
        if not (isinstance(self.report_pairs, int) and self.report_pairs >= 0):
            raise ValueError(
                f"Horizon(report_pairs={self.report_pairs!r}): a non-negative integer (pairs)"
            )

    def control(self) -> HorizonControl:
        return HorizonControl(self)


class HorizonControl:
    """The state of one Gaussian's :class:`Horizon` step: the step number and the mean
    gradient's moving average. ``ceiling`` (the user's step size, if smaller) caps both
    sizes."""

    def __init__(self, rule: Horizon):
        self.rule = rule
        self.ceiling = 1.0
        self.t = 0
        self.gbar: Optional[torch.Tensor] = None
        #: the plateau test's factor and the current run of bound estimates
        self.factor = 1.0
        self.losses: List[float] = []
        self._loss: Optional[float] = None
        #: the reported loss's running estimate (``report_track``)
        self.tracked = TrackedReport()

    def decay(self) -> float:
        """The sizes' fraction of their start: ``min(cosine over the horizon, factor)``."""
        r = self.rule
        x = min(self.t, r.horizon) / r.horizon
        return min(r.final + (1.0 - r.final) * 0.5 * (1.0 + math.cos(math.pi * x)), self.factor)

    def record(self, loss: float) -> None:
        """This step's estimate of the block's loss (kept with the step at :meth:`observe`)."""
        self._loss = float(loss)

    def _plateau(self) -> None:
        """The slope test of the module docstring over the full run of losses."""
        y, h = self.losses, len(self.losses) // 2
        d = sorted(y[i + h] - y[i] for i in range(h))
        med = 0.5 * (d[(h - 1) // 2] + d[h // 2])
        mad = sorted(abs(v - med) for v in d)
        sd = 1.4826 * 0.5 * (mad[(h - 1) // 2] + mad[h // 2])
        if not math.isfinite(med) or -med <= 1.2533 * sd / math.sqrt(h):
            self.factor = max(self.rule.final, 0.5 * self.factor)
        self.losses = []

    def step_sizes(self) -> Tuple[float, float]:
        """``(rho, alpha)``: the precision's and the mean's step of the next step."""
        d = self.decay()
        warm = min(1.0, (self.t + 1) / self.rule.warmup) if self.rule.warmup > 0 else 1.0
        return min(self.ceiling, self.rule.rho * d), min(self.ceiling, self.rule.lr * d * warm)

    def step_size(self) -> float:
        return self.step_sizes()[0]

    def direction(
        self, gm: torch.Tensor, metric: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    ) -> torch.Tensor:
        """The bias-corrected moving average of the mean's sampled gradient, with ``gm``
        (not stored until :meth:`observe`: a rejected step leaves the average as it was).
        The average restarts from ``gm`` when it points clearly against it in ``q``'s metric
        (``cos(gbar, gm) < -RESTART_COS`` in the inner product of ``metric(x) = S x``): the
        adaptive restart of O'Donoghue & Candes (2015), which keeps the memory of large early
        gradients from carrying the mean past the optimum, while the sign flips of a noisy
        one-draw gradient (``|cos|`` small) do not reset it."""
        b = self.rule.momentum
        if b == 0:
            self._next, self._next_n = None, 0
            return gm
        restart = self.gbar is None or self.gbar.shape != gm.shape
        if not restart and metric is not None:
            Sg = metric(gm)
            dot = float((self.gbar * Sg).sum())
            if dot < 0:
                nn = float((self.gbar * metric(self.gbar)).sum()) * float((gm * Sg).sum())
                restart = dot * dot > RESTART_COS**2 * nn
        if restart:  # the average starts at zero
            self._next, n = (1.0 - b) * gm.detach(), 1
        else:
            self._next = b * self.gbar + (1.0 - b) * gm.detach()
            n = self._n + 1
        self._next_n = n
        return self._next / (1.0 - b**n)

    def center(self) -> Optional[torch.Tensor]:
        """The current moving average of ``-dl/dm``'s sampled part (``E[r]``), or ``None``."""
        b = self.rule.momentum
        if self.gbar is None or b == 0:
            return None
        return -self.gbar / (1.0 - b ** getattr(self, "_n", 1))

    def observe(self, d=None) -> None:
        """The step was taken: keep the average and move the clock."""
        self.t += 1
        nxt = getattr(self, "_next", None)
        if nxt is not None:
            self.gbar, self._n = nxt, self._next_n
            self._next = None
        if self._loss is not None and self.rule.plateau > 0:
            self.losses.append(self._loss)
            if len(self.losses) >= self.rule.plateau:
                self._plateau()
        self._loss = None

    def state(self) -> Dict:
        return {
            "t": self.t,
            "ceiling": self.ceiling,
            "gbar": self.gbar,
            "n": getattr(self, "_n", 0),
            "factor": self.factor,
            "losses": list(self.losses),
            "tracked": self.tracked.state(),
        }

    def load(self, state: Dict) -> None:
        self.t, self.ceiling = int(state["t"]), float(state["ceiling"])
        self.gbar, self._n = state.get("gbar"), int(state.get("n", 0))
        self.factor = float(state.get("factor", 1.0))
        self.losses, self._loss = list(state.get("losses", [])), None
        self.tracked = TrackedReport()
        self.tracked.load(state.get("tracked"))


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
    where there is no previous ``q`` or it is not finite."""

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
        fresh, var_f = float(pairs.mean()), float(pairs.var())
        value = fresh
        if prev is not None:
            d = pairs - prev.double()
            var_d = float(d.var())
            b = 1.0
            if self.var_d is not None and self.var_f:
                b = min(1.0, max(self.B_MIN, math.sqrt(self.var_d / self.var_f)))
            value = (1.0 - b) * (self.value + float(d.mean())) + b * fresh
            self.var_d = var_d if self.var_d is None else self._avg(self.var_d, var_d)
        self.var_f = var_f if self.var_f is None else self._avg(self.var_f, var_f)
        if not (math.isfinite(value) and math.isfinite(self.var_f)):
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
