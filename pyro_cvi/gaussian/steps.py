"""Natural-gradient (CVI) steps of a Gaussian ``q = N(m, S)`` from the loss gradients.

CVI's mirror-descent step (Khan & Lin 2017, eqs. 10-13) for a Gaussian is, with the loss
``l = -L`` (Pyro's sign) and its gradients ``dl/dm``, ``dl/dS`` (symmetric)::

    P'  = P + b G,              G = 2 dl/dS = -2 dL/dS        (natural parameter -P/2, eq. 12)
    m'  = m - b S' dl/dm                                       (natural parameter P m)

since ``grad_mu L`` is ``(dL/dm - 2 dL/dS m, dL/dS)``. On a conjugate Gaussian model with exact
gradients, ``b = 1`` gives the exact posterior in one step (``G = P_post - P``, and
``-S' dl/dm = m_post - m``). ``G`` may be indefinite under Monte Carlo noise or
non-convexity; the default ``retraction`` form (Lin, Schmidt & Khan 2020, eq. 9,
:mod:`pyro_cvi.gaussian.retraction`)::

    P' = P + b G + (b^2 / 2) G S G = P / 2 + (P + b G) S (P + b G) / 2

is positive definite for every symmetric ``G`` and every ``b``: no step makes ``S'`` invalid.
The ``"natural"`` form keeps the plain step and halves ``b`` (per Gaussian, per element for a
diagonal one) until ``P'`` is positive definite (:mod:`pyro_cvi.gaussian.halving`).
``beta_mean`` (the adaptive step) gives the mean its own step size: a block-diagonal scaling of
the natural gradient, still an ascent direction, and the mean's direction is far less noisy
than ``G``'s under Monte Carlo.

``dl/dS`` comes from the gradients of the guide's own parameterisation by the chain rule:
diagonal ``S = diag(s^2)``: ``dl/dS = (dl/ds) / (2 s)``; Cholesky ``S = L L^T``: the reverse
mode of the Cholesky factorisation (``dl/dS = Phi(L^T dl/dL)`` pulled back by ``L^-1``),
taken from torch's own ``cholesky`` backward.

Low rank ``S = diag(s) (I + W W^T) diag(s)`` (``AutoLowRankMultivariateNormal``): the
natural gradient of that family (:mod:`pyro_cvi.gaussian.lowrank`).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from .conversions import precision_from_scale_tril
from .halving import MAX_HALVINGS, halve_until_valid
from .retraction import retract, retract_diagonal

__all__ = ["MEAN_MAX_MOVE", "chol_grad_to_cov_grad", "diag_step", "tril_step"]

#: ``(P', dl/dm) -> (M^-1 dl/dm, sqrt(diag M^-1))``: a full metric for a diagonal mean's step
Precondition = Callable[[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]

#: the adaptive step moves the mean by at most this many marginal standard deviations of q'
MEAN_MAX_MOVE = 3.0


def diag_step(
    m: torch.Tensor,
    s: torch.Tensor,
    gm: torch.Tensor,
    gs: torch.Tensor,
    beta: float,
    retraction: bool = True,
    max_rel: Optional[float] = None,
    beta_mean: Optional[float] = None,
    precondition: Optional[Precondition] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """One step of independent Normals ``N(m_i, s_i^2)`` (any shape, element-wise): ``G =
    2 dl/dv = (dl/ds) / s``. Returns ``(m', s', d)``; ``d`` is the whitened direction
    ``(s dl/dm, G s^2)``, dimensionless, for the noise control. ``max_rel`` caps the
    relative precision change ``b |G| / P`` per element (a trust region; see
    :func:`tril_step`). ``precondition(P', dl/dm) -> (M^-1 dl/dm, sqrt(diag M^-1))``
    replaces the mean's metric ``P'`` by a full one ``M`` (its trust region then scales the
    whole step, in ``M``'s marginal deviations; :mod:`pyro_cvi.natgrad.curvature`)."""
    p = s.pow(-2)
    g = gs / s
    b = torch.full_like(p, beta)
    if max_rel is not None:
        b = torch.minimum(b, max_rel * p / g.abs().clamp_min(torch.finfo(p.dtype).tiny))
    if retraction:
        p_new = retract_diagonal(p, g, b)
    else:
        p_new, b, ok, _ = halve_until_valid(
            lambda b: p + b * g, lambda new: new > 0, b, MAX_HALVINGS
        )
        p_new = torch.where(ok, p_new, p)
    bm = b if beta_mean is None else torch.full_like(p, beta_mean)
    if precondition is not None:
        direction, sd = precondition(p_new, gm)
        step = bm * direction
        if max_rel is not None:  # the whole step: at most MEAN_MAX_MOVE deviations of M
            z = (step.abs() / sd).amax()
            step = step * (MEAN_MAX_MOVE / z.clamp_min(MEAN_MAX_MOVE))
    else:
        step = bm * gm / p_new
    if precondition is None and max_rel is not None:  # at most MEAN_MAX_MOVE sd of q'
        z = step.abs() * p_new.sqrt()
        step = step * (MEAN_MAX_MOVE / z.clamp_min(MEAN_MAX_MOVE))
    m_new = m - step
    return m_new, p_new.rsqrt(), ((s * gm).reshape(-1), (g / p).reshape(-1))


def chol_grad_to_cov_grad(L: torch.Tensor, gL: torch.Tensor) -> torch.Tensor:
    """``dl/dS`` (symmetric) from ``dl/dL`` for ``L = cholesky(S)`` (lower triangles only)."""
    with torch.enable_grad():
        S = (L @ L.transpose(-1, -2)).detach().requires_grad_(True)
        Lc = torch.linalg.cholesky(S)
        # (a scalar output, not grad_outputs: torch imports sympy for explicit grad_outputs;
        # the cotangent reaching Lc is gL.tril() exactly either way)
        (gS,) = torch.autograd.grad((Lc * gL.tril()).sum(), S)
    return 0.5 * (gS + gS.transpose(-1, -2))


def tril_step(
    m: torch.Tensor,
    L: torch.Tensor,
    gm: torch.Tensor,
    gL: torch.Tensor,
    beta: float,
    retraction: bool = True,
    max_rel: Optional[float] = None,
    beta_mean: Optional[float] = None,
    G: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """One step of ``N(m, L L^T)`` (batched over leading dims), in float64 inside.
    Returns ``(m', L', d)`` with ``d = (L^T dl/dm, L^T G L)`` whitened. ``G = 2 dl/dS`` may be
    given instead of ``gL`` (e.g. by Price's theorem, ``G = -E_q[grad^2 log p] - S^-1``).

    ``max_rel`` (the adaptive step only) caps ``b`` so that the whitened precision change
    ``b ||L^T G L||_2`` is at most ``max_rel``: under heavy Monte Carlo noise the retraction's
    ``b^2 G S G / 2``, positive whatever the sign of ``G``, would otherwise inflate the
    precision (collapse ``S``) systematically."""
    dtype = m.dtype
    m, L, gm = (t.double() for t in (m, L, gm))
    G = 2.0 * chol_grad_to_cov_grad(L, gL.double()) if G is None else G.double()
    P = precision_from_scale_tril(L)
    S = L @ L.transpose(-1, -2)
    b = torch.full(P.shape[:-2] + (1, 1), float(beta), dtype=P.dtype, device=P.device)
    Lt = L.transpose(-1, -2)
    white = Lt @ G @ L
    if not bool(torch.isfinite(white).all() and torch.isfinite(gm).all()):
        nan = torch.full_like(m, float("nan"))  # the caller skips a non-finite step
        return nan.to(dtype), L.to(dtype), (nan, white.reshape(-1))
    if max_rel is not None:
        norm = torch.linalg.matrix_norm(white, ord=2)[..., None, None]
        b = torch.minimum(b, max_rel / norm.clamp_min(torch.finfo(P.dtype).tiny))
    if retraction:
        P_new = retract(P, G, S, b)
        LP, info = torch.linalg.cholesky_ex(0.5 * (P_new + P_new.transpose(-1, -2)))
    else:
        last: Dict[str, torch.Tensor] = {}

        def factor_ok(new: torch.Tensor) -> torch.Tensor:  # (the last factorisation is kept)
            last["LP"], last["info"] = torch.linalg.cholesky_ex(new)
            return (last["info"] == 0)[..., None, None]

        P_new, b, _, _ = halve_until_valid(lambda b: P + b * G, factor_ok, b, MAX_HALVINGS)
        LP, info = last["LP"], last["info"]
    if bool((info > 0).any()):  # round-off only (retraction) or no valid step: keep q
        keep = (info > 0)[..., None, None]
        P_new = torch.where(keep, P, P_new)
        b = torch.where(keep, torch.zeros_like(b), b)
        LP = torch.linalg.cholesky(0.5 * (P_new + P_new.transpose(-1, -2)))
    S_new = torch.cholesky_inverse(LP)
    L_new = torch.linalg.cholesky(0.5 * (S_new + S_new.transpose(-1, -2)))
    bm = b[..., 0] if beta_mean is None else beta_mean
    step = bm * (S_new @ gm.unsqueeze(-1)).squeeze(-1)
    if max_rel is not None:
        z = (step.abs() / S_new.diagonal(dim1=-2, dim2=-1).sqrt()).amax(-1, keepdim=True)
        step = step * (MEAN_MAX_MOVE / z.clamp_min(MEAN_MAX_MOVE))
    m_new = m - step
    d = ((Lt @ gm.unsqueeze(-1)).reshape(-1), white.reshape(-1))
    return m_new.to(dtype), L_new.to(dtype), d
