"""The positive-definite natural-gradient step of a Gaussian (Lin, Schmidt & Khan 2020).

CVI's step of a Gaussian ``q = N(m, S)``, ``P = S^-1`` (Khan & Lin 2017, eqs. 10-13), moves the
precision by ``P' = P + b G`` with ``G = -2 dL/dS`` (``G = P_target - P`` for a CVI target).
Under Monte Carlo noise or non-convexity ``G`` may be indefinite and ``P'`` invalid. The
retraction of Lin, Schmidt & Khan (2020, eqs. 8-9) adds the second-order term::

    P' = P + b G + (b^2 / 2) G S G = P / 2 + (P + b G) S (P + b G) / 2

which is positive definite for every symmetric ``G`` and every ``b``: the sum of a positive
definite and a positive semi-definite matrix. Its fixed point (``G = 0``) is the plain step's.
Three forms: full (:func:`retract`), element-wise for a diagonal Gaussian
(:func:`retract_diagonal`, ``p' = p + b g + (b g)^2 / (2 p)``), and as a CVI *target*
(:func:`retraction_target`) for callers whose update is the convex combination
``x + b (target - x)`` of eq. 12.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["retract", "retract_diagonal", "retraction_target"]


def retract(P: torch.Tensor, G: torch.Tensor, S: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``P / 2 + (P + b G) S (P + b G) / 2`` (batched; ``S = P^-1``, ``b`` broadcasts as
    ``[..., 1, 1]``): positive definite for every symmetric ``G``."""
    A = P + b * G
    return 0.5 * P + 0.5 * (A @ S @ A)


def retract_diagonal(p: torch.Tensor, g: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The element-wise retraction ``p + b g + (b g)^2 / (2 p)`` (precisions ``p > 0``): it is
    ``(p^2 + (p + b g)^2) / (2 p) > 0`` for every ``g`` and ``b``."""
    return p + b * g + 0.5 * (b * g).pow(2) / p


def retraction_target(
    old: Tuple[torch.Tensor, torch.Tensor],
    target: Tuple[torch.Tensor, torch.Tensor],
    loc: torch.Tensor,
    cov: torch.Tensor,
    beta: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The target ``(h', P')`` of a pair ``(h, P)`` in precision form (``h = P m``) that makes
    the plain step ``x + b (target' - x)`` the retraction (Lin, Schmidt & Khan 2020, eq. 8)::

        Lambda <- Lambda - b G + (b^2 / 2) G S G,   m <- m + b Lambda_new^-1 grad_m,
        G = P - P_target,   S = Lambda^-1,   grad_m = eta1* - Lambda* m

    i.e. ``P' = P_target + C`` and ``h' = h_target + C m`` with ``C = (beta / 2) G S G``, for
    ``b = beta``. For a shrunk step ``b <= beta`` the added ``(b beta / 2) G S G`` is at least
    ``(b^2 / 2) G S G``, so ``Lambda`` stays positive definite:
    ``Lambda - b G + (b^2/2) G S G = (Lambda + (Lambda - b G) S (Lambda - b G)) / 2``. The
    fixed point (``G = 0``) is that of the plain step.
    """
    G = old[1] - target[1]
    C = G @ cov @ G
    C = 0.25 * beta * (C + C.T)
    return target[0] + C @ loc, target[1] + C
