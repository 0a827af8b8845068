"""The choices AutoCVI offers, as small objects with their own defaults (``AutoCVI(remainder=
Remainder(...))``; a plain string picks a choice with the other defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["Remainder", "MAX_FULL_DIM", "HESSIAN_MAX_DIM", "COVARIANCES", "CURVATURES"]

#: ``Remainder(covariance="auto")`` is full up to this many unconstrained coordinates (a
#: 151-dimensional stochastic volatility diverged with the low-rank form and fits with the full one)
MAX_FULL_DIM = 256
#: ``Remainder(curvature="auto")`` uses dense Hessians (Price's theorem) up to this many
HESSIAN_MAX_DIM = 32
COVARIANCES = ("auto", "full", "lowrank", "diag")
CURVATURES = ("auto", "hessian", "gradient")


@dataclass(frozen=True)
class Remainder:
    """How AutoCVI treats the latents that receive no exact message (the *remainder*).

    :param covariance: ``"auto"`` (default: ``"full"`` up to :data:`MAX_FULL_DIM` unconstrained
        coordinates, ``"lowrank"`` beyond), ``"full"`` (as ``AutoMultivariateNormal``),
        ``"lowrank"`` (``diag(s) (I + W W^T) diag(s)``, as ``AutoLowRankMultivariateNormal``)
        or ``"diag"`` (as ``AutoNormal``).
    :param rank: the rank of ``W`` (default ``ceil(sqrt(D))``, Pyro's default).
    :param particles: reparameterised draws per step (the ELBO estimate and its gradient).
    :param curvature: the precision's natural gradient, for full covariance: ``"hessian"``
        (Price's theorem: dense Hessians of the log joint at the draws, ``D`` backward passes;
        exact at once where the posterior is Gaussian in ``u``), ``"gradient"`` (the
        reparameterised gradient in ``S``, "sticking the landing"), or ``"auto"`` (default:
        Hessians up to :data:`HESSIAN_MAX_DIM` coordinates).
    :param init_scale: the initial standard deviation on the unconstrained space (AutoNormal's
        default 0.1; ``AutoCVI(init_scale=...)`` overrides it), around ``init_loc_fn``'s values
        (``init_to_median`` by default).
    :param enabled: ``False`` keeps those latents mean-field with Monte Carlo messages.
    """

    covariance: str = "auto"
    rank: Optional[int] = None
    particles: int = 4
    curvature: str = "auto"
    init_scale: float = 0.1
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.covariance not in COVARIANCES:
            raise ValueError(
                f"Remainder(covariance={self.covariance!r}): choose one of {COVARIANCES}"
            )
        if self.rank is not None and not (isinstance(self.rank, int) and self.rank >= 1):
            raise ValueError(f"Remainder(rank={self.rank!r}): a positive integer or None")
        if self.curvature not in CURVATURES:
            raise ValueError(f"Remainder(curvature={self.curvature!r}): choose one of {CURVATURES}")
        if not (isinstance(self.particles, int) and self.particles >= 1):
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

    def form(self, D: int) -> str:
        if self.covariance != "auto":
            return self.covariance
        return "full" if D <= MAX_FULL_DIM else "lowrank"
