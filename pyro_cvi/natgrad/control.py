"""The adaptive step size of natural-gradient steps on Pyro's Gaussian guides.

The optimizer never sees the loss value (Pyro's ``SVI`` hands it parameters only), so the
ELBO-based backtracking of :mod:`pyro_cvi.step_control` cannot run here. What it can see is the
natural-gradient direction ``d_t`` of every step (whitened: dimensionless). Its signal-to-noise
ratio decides the step::

    r_t = |E d|^2 / E |d|^2   (exponential moving averages, rate ``rho``, bias-corrected;
                               ``d`` clipped at 3 times the running RMS of ``|d|``)
    b_t = min(start * grow^t, ceiling * clip(r_t, min_ratio, 1))

once for the precision's direction and once for the mean's (each its own ``b``).

The warm-up ``start * grow^t`` (0.1, 0.15, ... up to the ceiling within 6 steps) guards the
first steps: a one-sample reparameterisation gradient of ``scale`` far from the optimum is
dominated by ``(m - m_opt) eps`` terms, and a full step on it throws ``q`` far away. A
direction that persists across steps (exact gradients, or far from the optimum) gives
``r = 1`` and the full step (a fixed ``CVI(step_size=1.0)`` is the exact posterior in one step
on a conjugate model with exact gradients). Under Monte Carlo noise alone ``d_t`` is
independent with mean zero and ``r`` falls to about ``rho / (2 - rho)``; the step then shrinks,
but no further than ``min_ratio`` (0.3) of the ceiling: a slow drift buried in noise (the
funnel of a centred hierarchy, where the scale creeps towards zero) still moves at a useful
rate, and the step grows back as soon as a direction persists (new data, a moving
hyperparameter). The averaging of the noise at the optimum is the ceiling's: once both ratios
stay below ``noisy_ratio`` for ``patience`` steps in a row, it decays by ``decay`` (to
``min_ceiling`` at the least), as the ceiling of :mod:`pyro_cvi.step_control` does under noise: a
constant step leaves ``q`` jittering around the optimum with an amplitude that grows with the
step. (Measured on the centred eight schools, AutoNormal: a floor of 0.01 left the bound at
35.3 after 2,000 steps; 0.3 reaches 33.6 in 250, where Adam needs 2,000 steps for 34.1:
``scripts/benchmark_natgrad_control.py``.) Each step is also capped by a trust
region (``max_rel`` in :mod:`pyro_cvi.gaussian.steps`).

The decay is undone once a direction persists again (``q`` is off its
optimum: the data or a hyperparameter moved, or the noise fell, e.g. a control variate took it
out): when the larger ratio is at least ``signal_ratio`` (0.4) for ``patience`` steps in a
row, the decayed ceiling doubles each step, back to 1. (A direction far larger than the noise
before it is clipped at 3 running RMS each step, and its ratio then settles near 0.46, not 1:
hence 0.4. Noise alone is at 0.4 or above five steps running about once in 2,500 steps for a
one-dimensional direction, never in 20,000 for two or more.) Measured: a Normal guide whose
data move by 18 posterior deviations after 400 steps is back within Pyro's tolerance in 16-33
steps, 63-85 without the recovery (``tests/test_natgrad.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

from .report import TrackedReport

__all__ = ["NoiseControl", "ScoreCoefficient", "SignalToNoise"]

# ``grow ** t`` is only needed until the warm-up reaches the ceiling (a few steps): bounded
# here, it never overflows however long the run (``1.5 ** 1751`` is past float range).
_WARM_STEPS = 64


@dataclass
class _Ratio:
    """Bias-corrected exponential moving averages of a direction and of its squared norm."""

    rho: float = 0.1
    clip: float = 3.0
    mean: Optional[torch.Tensor] = None
    sq: float = 0.0
    t: int = 0

    def observe(self, d: torch.Tensor) -> None:
        d = d.detach().double().reshape(-1)
        norm = float(d.norm())
        if not (math.isfinite(norm) and norm > 0):
            return
        if self.mean is not None and self.mean.shape == d.shape and self.t > 0:
            rms = math.sqrt(self.sq / (1.0 - (1.0 - self.rho) ** self.t))
            if norm > self.clip * rms > 0:  # one outlying step must not rule the ratio
                d = d * (self.clip * rms / norm)
        if self.mean is None or self.mean.shape != d.shape:
            self.mean, self.sq, self.t = torch.zeros_like(d), 0.0, 0
        self.t += 1
        self.mean = (1.0 - self.rho) * self.mean + self.rho * d
        self.sq = (1.0 - self.rho) * self.sq + self.rho * float(d.pow(2).sum())

    def ratio(self) -> float:
        if self.t == 0 or self.mean is None:
            return 1.0
        c = 1.0 - (1.0 - self.rho) ** self.t
        if not self.sq > 0:
            return 1.0
        return min(1.0, float((self.mean / c).pow(2).sum()) / (self.sq / c))


@dataclass
class ScoreCoefficient:
    """The coefficient ``c`` of the score control variate of a one-draw natural gradient.

    A loss that evaluates ``log q`` at its draw ``z`` (``Trace_ELBO``) carries the score
    ``s = d log q(z) / d theta`` in its gradient; ``E_q[s] = 0``, so ``x - c x_s`` (``x``, ``x_s``:
    the natural gradients of the loss's gradient and of ``s``) is unbiased for every ``c``
    fixed before the draw. Its variance is least at ``c* = E<x, x_s> / E|x_s|^2``: about 1 near
    the optimum of a loss with the score term (there the pathwise term vanishes on a conjugate
    model and the variance with it), 0 for one without (an analytic entropy or KL). ``c`` is
    estimated by averages over the last few steps (weights ``max(1/t, rho)``: the steps far
    from the optimum, where ``x`` is large, are soon forgotten), clipped to ``[0, 1]``,
    and used after ``warm`` steps where the squared correlation of ``x`` and ``x_s`` is at
    least ``min_r2`` (a variance reduction of that fraction; a loss without the score term
    has a correlation near 0, and a ``c`` learnt from noise would only add variance)."""

    rho: float = 0.2
    warm: int = 3
    min_r2: float = 0.25
    xy: float = 0.0
    yy: float = 0.0
    xx: float = 0.0
    t: int = 0

    def value(self) -> float:
        if self.t < self.warm or not (self.yy > 0 and self.xx > 0):
            return 0.0
        if self.xy <= 0 or self.xy * self.xy < self.min_r2 * self.xx * self.yy:
            return 0.0
        return min(1.0, self.xy / self.yy)

    def observe(self, x: torch.Tensor, x_s: torch.Tensor) -> None:
        xy, yy, xx = float((x * x_s).sum()), float(x_s.pow(2).sum()), float(x.pow(2).sum())
        if not (math.isfinite(xy) and math.isfinite(yy) and math.isfinite(xx) and yy > 0):
            return
        self.t += 1
        w = max(1.0 / self.t, self.rho)
        self.xy = (1.0 - w) * self.xy + w * xy
        self.yy = (1.0 - w) * self.yy + w * yy
        self.xx = (1.0 - w) * self.xx + w * xx


@dataclass
class NoiseControl:
    """The step-size state of one Gaussian of the guide: one ratio for the precision's
    direction, one for the mean's (the mean gets its own step, see
    :func:`pyro_cvi.gaussian.steps.diag_step`)."""

    ceiling: float = 1.0
    start: float = 0.1
    grow: float = 1.5
    min_ratio: float = 0.3
    noisy_ratio: float = 0.1
    patience: int = 5
    decay: float = 0.9
    min_ceiling: float = 0.05
    signal_ratio: float = 0.4
    recover: float = 2.0
    decayed: float = 1.0
    _flat: int = 0
    _lively: int = 0
    prec: _Ratio = field(default_factory=_Ratio)
    mean: _Ratio = field(default_factory=_Ratio)
    t: int = 0
    #: the score control variate's coefficient (concentration families)
    score: ScoreCoefficient = field(default_factory=ScoreCoefficient)
    #: the reported loss's running estimate (``SignalToNoise(report_track=True)``)
    tracked: TrackedReport = field(default_factory=TrackedReport)

    def _size(self, r: _Ratio) -> float:
        # the smaller of the two caps, not their product: the engine's ceiling falls after
        # steps its accept test rejected, on the same noise that decays ``decayed``; the
        # product counted it twice and froze the step (``0.05 * 0.05 * 0.3``)
        ceiling = min(self.ceiling, self.decayed)
        # the warm-up saturates at the ceiling: the exponent is bounded so it never overflows
        warm = min(ceiling, self.start * self.grow ** min(self.t, _WARM_STEPS))
        return min(warm, ceiling * min(1.0, max(self.min_ratio, r.ratio())))

    def step_sizes(self) -> Tuple[float, float]:
        """``(b for the precision, b for the mean)`` of the next step."""
        return self._size(self.prec), self._size(self.mean)

    def step_size(self) -> float:
        return self.step_sizes()[0]

    def observe(self, d: Tuple[torch.Tensor, torch.Tensor]) -> None:
        """Record the whitened directions ``(mean, precision)`` of the step just taken; decay
        the ceiling once both are noise-dominated ``patience`` steps in a row."""
        self.t += 1
        self.mean.observe(d[0])
        self.prec.observe(d[1])
        ratio = max(self.mean.ratio(), self.prec.ratio())
        self._flat = self._flat + 1 if ratio < self.noisy_ratio else 0
        if self._flat >= self.patience:
            self.decayed = max(self.min_ceiling, self.decayed * self.decay)
            self._flat = 0
        self._lively = self._lively + 1 if ratio >= self.signal_ratio else 0
        if self._lively >= self.patience:  # a direction persists again: q is off its optimum
            self.decayed = min(1.0, self.decayed * self.recover)

    def state(self) -> Dict:
        return {
            "t": self.t,
            "ceiling": self.ceiling,
            "decayed": self.decayed,
            "flat": self._flat,
            "lively": self._lively,
            "prec": (self.prec.mean, self.prec.sq, self.prec.t),
            "mean": (self.mean.mean, self.mean.sq, self.mean.t),
            "score": (self.score.xy, self.score.yy, self.score.xx, self.score.t),
            "tracked": self.tracked.state(),
        }

    def load(self, state: Dict) -> None:
        self.t, self.ceiling = int(state["t"]), float(state["ceiling"])
        self.decayed, self._flat = float(state["decayed"]), int(state["flat"])
        self._lively = int(state.get("lively", 0))
        self.prec.mean, self.prec.sq, self.prec.t = state["prec"]
        self.mean.mean, self.mean.sq, self.mean.t = state["mean"]
        if "score" in state:
            self.score.xy, self.score.yy, self.score.xx, self.score.t = state["score"]
        self.tracked = TrackedReport()
        self.tracked.load(state.get("tracked"))


@dataclass(frozen=True)
class SignalToNoise:
    """The step of ``Remainder(step=...)`` controlled by :class:`NoiseControl` (the
    signal-to-noise ratio of the whitened direction), ``particles`` draws per step.

    ``report_pairs``: under Price's Hessians with a vectorised log joint, the reported loss is
    the mean of up to this many antithetic pairs ``m +- L e`` of forward-only draws (one
    batched run, from a generator of the block's own: the step's draws and its accept
    decisions are unchanged; :func:`pyro_cvi.natgrad.joint.add_report`), at most ``K D / 2``
    (``K = particles``); 0: the step's own estimate. ``report_track``: the same pairs also
    run at the previous ``q`` and the report is
    :class:`~pyro_cvi.natgrad.report.TrackedReport`'s (the control's ``tracked``)."""

    particles: int = 4
    report_pairs: int = 64
    report_track: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.report_pairs, int) and self.report_pairs >= 0):
            raise ValueError(
                f"SignalToNoise(report_pairs={self.report_pairs!r}): a non-negative integer (pairs)"
            )

    def control(self) -> NoiseControl:
        return NoiseControl()
