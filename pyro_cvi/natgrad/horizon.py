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

The ``q`` the user holds is not the last iterate but their average (Polyak-Ruppert in an
exponential form, ``average = beta``): with ``theta_t`` the iterate's parameters after step
``t`` (mean and scale, Cholesky factor, or low-rank factors: each average of valid factors is
valid, a positive scale or diagonal stays positive)::

    A_t = beta A_{t-1} + (1 - beta) theta_t,    theta-bar_t = A_t / (1 - beta^t)

The step draws from and moves the iterate (held by :class:`HorizonControl`); the guide's
parameters hold ``theta-bar``, what every use outside a training step reads (the guide's
forward, ``median``, ``quantiles``, a checkpoint), and the reported loss is ``theta-bar``'s
bound. One draw's step keeps the iterate in a noise ball of its step size around the optimum;
the average's spread over ``1 / (1 - beta)`` steps is smaller by about that factor's root.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .report import TrackedReport

__all__ = ["AUTO_AVERAGE", "Horizon", "HorizonControl", "RESTART_COS"]

#: ``Horizon(average=None)``'s ``beta`` on the diagonal form
AUTO_AVERAGE = 0.99

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
        Pairs are off by default: each is two forward rows (four tracked) of the batched
        model run, cheap beside a step where the run's fixed cost dominates (the 13-8-3 wine
        network: 8 tracked pairs about +1.9 ms on a 4.5 ms step, 16 about +3.4 ms) and several
        steps' cost where its FLOPs do (a larger network: 4 untracked pairs doubled digits'
        step). They are rows of the draw's own batched run (the gradient reads the draw's row).
        With ``average > 0`` they are of the average's ``q``; with none, the reported loss is
        a tracked report of the average's bound from one draw a step (two forward rows).
    :param average: ``beta`` of the iterates' exponential average that the guide holds (the
        module docstring; 0: the guide holds the iterate, the step as before, bit for bit;
        ``None``: :data:`AUTO_AVERAGE` on the diagonal form, none on the full one). It needs
        the log joint batched over draws (the report runs in the step's batched model run):
        where a model runs once per draw the guide holds the iterate. Measured (float32, 5
        seeds, ``scripts/benchmark_onedraw_schedule.py``): on the diagonal form of the BNNs
        (139 and 1,482 coordinates) the average's bound at 300 steps is well below the
        iterate's; on the full form of a 4-coordinate ARMA recursion (the zoo's ``arma11``)
        the iterate still drifts at 300 steps and the average lags it (82.9 against 81.0).
    """

    lr: float = 0.2
    rho: float = 0.05
    momentum: float = 0.9
    horizon: int = 2000
    final: float = 0.05
    warmup: int = 0
    plateau: int = 100
    particles: int = 1
    report_pairs: int = 0
    report_track: bool = True
    average: Optional[float] = None

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
        if self.average is not None and not (
            isinstance(self.average, (int, float)) and 0 <= self.average < 1
        ):
            raise ValueError(
                f"Horizon(average={self.average!r}): None or a number in [0, 1) (0: no averaging)"
            )

    def beta(self, form: Optional[str], learns: bool = False) -> float:
        """The average's ``beta`` on a Gaussian of covariance ``form`` (0: none). By default
        none where the model ``learns`` parameters beside it: their gradient is read at the
        iterate's draw, while the loss reports the average."""
        if self.average is not None:
            return float(self.average)
        return AUTO_AVERAGE if form == "diag" and not learns else 0.0

    def control(self, form: Optional[str] = None, learns: bool = False) -> HorizonControl:
        return HorizonControl(self, form, learns)


class HorizonControl:
    """The state of one Gaussian's :class:`Horizon` step: the step number and the mean
    gradient's moving average. ``ceiling`` (the user's step size, if smaller) caps both
    sizes."""

    def __init__(self, rule: Horizon, form: Optional[str] = None, learns: bool = False):
        self.rule = rule
        #: the average's ``beta`` (``rule.beta(form, learns)``; 0: none)
        self.beta = rule.beta(form, learns)
        self.ceiling = 1.0
        self.t = 0
        self.gbar: Optional[torch.Tensor] = None
        #: the plateau test's factor and the current run of bound estimates
        self.factor = 1.0
        self.losses: List[float] = []
        self._loss: Optional[float] = None
        #: the reported loss's running estimate (``report_track``)
        self.tracked = TrackedReport()
        #: iterate averaging (``rule.average``): the step's iterate, the average's sums and
        #: count, and the average as last written to the guide's parameters
        self.averaging = self.beta > 0
        self.iterate: Optional[Dict[str, torch.Tensor]] = None
        self.sums: Optional[Dict[str, torch.Tensor]] = None
        self.n_avg = 0
        self.shown: Optional[Dict[str, torch.Tensor]] = None
        self._trust_store = False

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

    def step_params(self, store: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The iterate the step draws from and moves, given the guide's parameters ``store``
        (the average): the one kept, unless the store no longer holds the average last
        written (set from outside: the step restarts from it, the average too)."""
        if self._trust_store:  # restored from a checkpoint: the store is the saved average
            self.shown, self._trust_store = _clone(store), False
        same = (
            self.iterate is not None
            and self.shown is not None
            and self.shown.keys() == store.keys()
            and all(torch.equal(self.shown[k], v) for k, v in store.items())
        )
        if not same:
            self.iterate, self.sums, self.n_avg, self.shown = _clone(store), None, 0, None
        return self.iterate

    def average_in(self, new: Dict[str, torch.Tensor], batched: bool) -> Dict[str, torch.Tensor]:
        """Keep the step's new iterate ``new`` and return the average to write; where the log
        joint is not ``batched`` over draws (no cheap report of the average), ``new``: the
        guide holds the iterate from then on."""
        if not batched:
            self.stop_averaging()
            return new
        b = self.beta
        self.iterate = _clone(new)
        if self.sums is None:
            self.sums = {k: (1.0 - b) * v for k, v in self.iterate.items()}
        else:
            self.sums = {k: b * self.sums[k] + (1.0 - b) * v for k, v in self.iterate.items()}
        self.n_avg += 1
        c = 1.0 - b**self.n_avg
        return {k: v / c for k, v in self.sums.items()}

    def written(self, store: Dict[str, torch.Tensor]) -> None:
        """The guide's parameters as written after :meth:`average_in`."""
        self.shown = _clone(store) if self.averaging else None

    def stop_averaging(self) -> None:
        """The guide holds the iterate from now on (a log joint run once per draw)."""
        self.averaging = False
        self.iterate = self.sums = self.shown = None
        self.n_avg = 0

    def state(self) -> Dict:
        return {
            "t": self.t,
            "ceiling": self.ceiling,
            "gbar": self.gbar,
            "n": getattr(self, "_n", 0),
            "factor": self.factor,
            "losses": list(self.losses),
            "tracked": self.tracked.state(),
            "averaging": self.averaging,
            "iterate": self.iterate,
            "sums": self.sums,
            "n_avg": self.n_avg,
        }

    def load(self, state: Dict) -> None:
        self.t, self.ceiling = int(state["t"]), float(state["ceiling"])
        self.gbar, self._n = state.get("gbar"), int(state.get("n", 0))
        self.factor = float(state.get("factor", 1.0))
        self.losses, self._loss = list(state.get("losses", [])), None
        self.tracked = TrackedReport()
        self.tracked.load(state.get("tracked"))
        self.averaging = bool(state.get("averaging", self.beta > 0))
        self.iterate, self.sums = state.get("iterate"), state.get("sums")
        self.n_avg, self.shown = int(state.get("n_avg", 0)), None
        self._trust_store = self.iterate is not None


def _clone(p: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in p.items()}
