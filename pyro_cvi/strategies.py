"""The choices AutoCVI offers, as small objects with their own defaults (``AutoCVI(remainder=
Remainder(...))``; a plain string picks a choice with the other defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from .natgrad.control import SignalToNoise
from .natgrad.horizon import Horizon
from .natgrad.joint import HESSIAN_MAX_DIM

__all__ = [
    "Remainder",
    "Horizon",
    "SignalToNoise",
    "MAX_FULL_DIM",
    "HESSIAN_MAX_DIM",
    "COVARIANCES",
    "CURVATURES",
]

#: ``Remainder(covariance="auto")`` is full up to this many unconstrained coordinates (a
#: 151-dimensional stochastic volatility diverged with the low-rank form and fits with the full one)
MAX_FULL_DIM = 256
COVARIANCES = ("auto", "full", "lowrank", "diag")
CURVATURES = ("auto", "hessian", "gradient")


@dataclass(frozen=True)
class Remainder:
    """How AutoCVI treats the latents that receive no exact message (the *remainder*).

    :param covariance: ``"auto"`` (default: see :meth:`form`), ``"full"`` (as
        ``AutoMultivariateNormal``), ``"lowrank"`` (``diag(s) (I + W W^T) diag(s)``, as
        ``AutoLowRankMultivariateNormal``) or ``"diag"`` (as ``AutoNormal``).
    :param rank: the rank of ``W`` (default ``ceil(sqrt(D))``, Pyro's default).
    :param particles: reparameterised draws per step (the ELBO estimate and its gradient;
        default: the step's, one for :class:`Horizon`, four for :class:`SignalToNoise`).
    :param curvature: the precision's natural gradient, for full covariance: ``"hessian"``
        (Price's theorem: dense Hessians of the log joint at the draws, ``D`` backward passes;
        exact at once where the posterior is Gaussian in ``u``; stepped by
        :class:`SignalToNoise`), ``"gradient"`` (from the gradient at the draws only: Stein's
        lemma with :class:`Horizon`, the reparameterised gradient in ``S`` with
        :class:`SignalToNoise`), or ``"auto"`` (default: ``"gradient"``; with
        :class:`SignalToNoise`, Hessians up to :data:`HESSIAN_MAX_DIM` coordinates; a small
        full form takes them where its log joint is vectorised, the one-draw step elsewhere:
        ``blocks.remainder_rules``).
    :param step: the step and its control: :class:`Horizon` (one draw, the known Gaussian
        priors exact, momentum, a decay over a horizon of steps), :class:`SignalToNoise` (the
        signal-to-noise control of ``CVI()`` on Pyro's guides), or ``None`` (default: chosen
        by :meth:`choose_step`).
    :param init_scale: the initial standard deviation on the unconstrained space (AutoNormal's
        default 0.1; ``AutoCVI(init_scale=...)`` overrides it), around ``init_loc_fn``'s values
        (``init_to_median`` by default).
    :param enabled: ``False`` keeps those latents mean-field with Monte Carlo messages.
    """

    covariance: str = "auto"
    rank: Optional[int] = None
    particles: Optional[int] = None
    curvature: str = "auto"
    init_scale: float = 0.1
    enabled: bool = True
    step: Optional[Union[Horizon, SignalToNoise]] = None

    def __post_init__(self) -> None:
        if self.covariance not in COVARIANCES:
            raise ValueError(
                f"Remainder(covariance={self.covariance!r}): choose one of {COVARIANCES}"
            )
        if self.rank is not None and not (isinstance(self.rank, int) and self.rank >= 1):
            raise ValueError(f"Remainder(rank={self.rank!r}): a positive integer or None")
        if self.curvature not in CURVATURES:
            raise ValueError(f"Remainder(curvature={self.curvature!r}): choose one of {CURVATURES}")
        if self.step is not None and not isinstance(self.step, (Horizon, SignalToNoise)):
            raise TypeError(
                f"Remainder(step={self.step!r}): a Horizon(...) or a SignalToNoise(...)"
            )
        if self.particles is not None and not (
            isinstance(self.particles, int) and self.particles >= 1
        ):
            raise ValueError(f"Remainder(particles={self.particles!r}): a positive integer")
        if not self.init_scale > 0:
            raise ValueError(f"Remainder(init_scale={self.init_scale!r}): must be positive")

    @classmethod
    def of(cls, value) -> Remainder:
        """``AutoCVI(remainder=...)``: a :class:`Remainder`, a covariance name, or ``"off"``."""
        if isinstance(value, Remainder):
            return value
        if value in ("off", None, False):
            return cls(enabled=False)
        if isinstance(value, str):
            return cls(covariance=value)
        raise TypeError(
            f"AutoCVI(remainder={value!r}): a Remainder(...), one of {COVARIANCES} or 'off'"
        )

    def choose_step(self, hierarchical: bool) -> Union[Horizon, SignalToNoise]:
        """The step: the user's, else (``step=None``) :class:`Horizon`, unless a latent's
        prior depends on another latent of the remainder (a hierarchy: the funnel of a latent
        scale, where the one-draw curvature of the latent-scaled prior was measured to diverge
        on stochastic volatility), then :class:`SignalToNoise`.

        :param hierarchical: whether a remainder latent's prior depends on another's.
        """
        if self.step is not None:
            return self.step
        return SignalToNoise() if hierarchical else Horizon()

    def draws(self, step: Union[Horizon, SignalToNoise]) -> int:
        """Reparameterised draws per step."""
        return self.particles if self.particles is not None else step.particles

    def hessian(self, D: int, step: Union[Horizon, SignalToNoise]) -> bool:
        """Whether the full form takes dense Hessians (Price's theorem) at ``D`` coordinates."""
        if self.curvature == "hessian":
            return True
        return self.curvature == "auto" and isinstance(step, SignalToNoise) and D <= HESSIAN_MAX_DIM

    def form(self, D: int, step: Optional[Union[Horizon, SignalToNoise]] = None) -> str:
        """The covariance form at ``D`` coordinates. ``"auto"`` under :class:`Horizon`: full
        while the precision's running average (about ``1 / rho`` one-draw estimates of rank
        one or two) can fill a ``D x D`` matrix, ``D <= 2 / rho``, else diagonal (measured: the
        21-coordinate BNN regression fits better full, the 139-coordinate wine classifier
        diagonal, at half the cost per step); under :class:`SignalToNoise` full up to
        :data:`MAX_FULL_DIM`, low rank beyond."""
        if self.covariance != "auto":
            return self.covariance
        if isinstance(step, Horizon):
            return "full" if D <= 2.0 / step.rho else "diag"
        return "full" if D <= MAX_FULL_DIM else "lowrank"
