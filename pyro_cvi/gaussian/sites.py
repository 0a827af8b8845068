"""Gaussian sites and the rows of a Bayesian linear regression.

CVI replaces a non-conjugate factor that touches the Gaussian latent through ``eta = f + c``,
``f = a^T z``, by a Gaussian site in ``eta`` (Khan & Lin 2017, eq. 13, Appendix E.1)::

    exp(lam1 eta + lam2 eta^2)  ∝  exp(b f - w f^2 / 2)   (as a function of f)

    w = -2 lam2,        b = lam1 + 2 lam2 c                 (site -> row)
    lam2 = -w / 2,      lam1 = b + w c                      (row -> site)

so the conjugate computation (eq. 11) is a Bayesian linear regression with rows ``(a, w, b)``:
``P = P0 + A^T W A``, ``P m = P0 m0 + A^T b`` (:mod:`pyro_cvi.linear_gaussian`). ``w`` is the
row's precision and ``b / w`` its pseudo-observation of ``f`` (a Gaussian likelihood
``N(b / w | f, 1 / w)``). For a K-variate site ``exp(lam1^T eta + eta^T lam2 eta)`` on
``eta = f + c`` (a softmax factor's logits) the same algebra gives
``W = -(lam2 + lam2^T)`` (``-2 lam2`` symmetrised) and ``b = lam1 + 2 lam2 c``.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

__all__ = ["pseudo_observations", "row_to_site", "site_to_row", "site_to_row_multivariate"]


def site_to_row(lam1: Tensor, lam2: Tensor, c: Tensor) -> Tuple[Tensor, Tensor]:
    """``(w, b) = (-2 lam2, lam1 + 2 lam2 c)``: the site ``exp(lam1 eta + lam2 eta^2)`` on
    ``eta = f + c`` as a row ``exp(b f - w f^2 / 2)`` in ``f`` (element-wise)."""
    return -2 * lam2, lam1 + 2 * lam2 * c


def row_to_site(w: Tensor, b: Tensor, c: Tensor) -> Tuple[Tensor, Tensor]:
    """``(lam1, lam2) = (b + w c, -w / 2)``: the inverse of :func:`site_to_row`."""
    return b + w * c, -0.5 * w


def site_to_row_multivariate(lam1: Tensor, lam2: Tensor, c: Tensor) -> Tuple[Tensor, Tensor]:
    """``(W, b) = (-(lam2 + lam2^T), lam1 + 2 lam2 c)`` for K-variate sites (``lam1 [..., K]``,
    ``lam2 [..., K, K]`` symmetric, ``c [..., K]``): :func:`site_to_row` with ``-2 lam2``
    symmetrised against round-off."""
    return -(lam2 + lam2.mT), lam1 + 2 * (lam2 @ c.unsqueeze(-1)).squeeze(-1)


def pseudo_observations(lam1: Tensor, lam2: Tensor) -> Tuple[Tensor, Tensor]:
    """Pseudo-targets ``lam1 / w`` and noise variances ``1 / w`` (``w = -2 lam2``) of sites on
    ``f`` itself (``c = 0``); a site with ``w = 0`` carries no information: noise ``inf``,
    target 0."""
    w = -2 * lam2  # (b = lam1 at c = 0)
    noise = torch.where(w > 0, 1.0 / w, torch.full_like(w, float("inf")))
    target = torch.where(w > 0, lam1 / w.clamp_min(1e-300), torch.zeros_like(w))
    return target, noise
