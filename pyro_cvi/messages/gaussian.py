"""Per-factor CVI messages: exact, linear-predictor (quadrature / Monte Carlo) and general.

Each function returns the factor's contribution to the ELBO (a tensor that keeps its graph to
the model's learnable parameters, so hyperparameters get gradients) and the *target* natural
parameters ``grad_mu E_q[log p_factor]`` that CVI averages into the factor's site parameters::

    lam_tilde <- (1 - beta) lam_tilde + beta * target          (Algorithm 1, eq. 12)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Optional

import pyro
import torch

from ..gaussian.price import price_target, stein_hessian
from ..gaussian.retraction import retraction_target as pd_preserving_target
from ..gaussian.sites import site_to_row
from ..model.probes import jacobian
from ..model.tracing import has_learnable_params, linear_param, unwrap, with_param
from .quadrature import expected_log_prob, mean_param_gradients, site_natural_params

__all__ = [
    "RowBlock",
    "normal_rows",
    "linear_predictor_rows",
    "linear_predictor_message",
    "linear_predictor_value",
    "linear_predictor_point_value",
    "general_gaussian_message",
    "poisson_expectation",
    "gradient_gaussian_message",
    "particle_gradients",
    "pd_preserving_target",
    "DENSE_HESSIAN_MAX_DIM",
    "gradient_particles",
    "general_message",
    "gradient_only",
    "FLAT_PRIOR_VAR",
]

#: The largest block dimension for which ``general_curvature="auto"`` takes the dense Price
#: Hessian (``S (D + 1)`` backward passes) instead of the gradient-only estimate (one batched
#: model run, one backward pass). Measured (``scripts/benchmark_general_blocks.py``, tanh
#: regression, D = 2..32): the gradient-only step was 10-40x cheaper at every D and reached the
#: same -ELBO at equal wall time. The dense path is kept for the smallest blocks, where it
#: costs a few backward passes per particle, is exact for quadratic factors at any particle
#: count, and keeps the step behaviour the earlier releases documented. With few particles
#: (``S = D``) and no curvature estimate yet, the gradient-only target can also overshoot: the
#: zoo's probabilistic PCA (a 15-dimensional ``W, mu`` block under a bilinear factor) diverged
#: with it (-ELBO 2e5 -> 3e8 in five steps) and converges with the dense Hessian, so blocks up
#: to 32 dimensions keep the dense path (about 10 ms per step there).
DENSE_HESSIAN_MAX_DIM = 32
#: Particles per dimension of the gradient-only estimate: its noise is about
#: ``sqrt(D / S)`` times the control variate's error, so ``S >= D`` particles make the
#: curvature iteration contract (measured on a 139-weight BNN: 64 particles wander for several
#: steps; 139 and 278 do not, and 139 reach about the same -ELBO at equal wall time at half the
#: cost per step); capped at :data:`MAX_GRADIENT_PARTICLES`.
GRADIENT_PARTICLES_PER_DIM = 1
MAX_GRADIENT_PARTICLES = 2048


def gradient_particles(dim: int, num_samples: int) -> int:
    """The number of particles of :func:`gradient_gaussian_message` for a block of ``dim``."""
    return max(num_samples, min(int(GRADIENT_PARTICLES_PER_DIM * dim), MAX_GRADIENT_PARTICLES))


@dataclass
class RowBlock:
    """Sites ``exp(b f - w f^2 / 2)`` on ``f = A z`` (``c``: the offset of ``eta = f + c``);
    ``param``, ``link``: the factor's parameter ``g(eta)`` (``link`` ``None``: the registered
    likelihood's, :func:`~pyro_cvi.model.tracing.linear_param`)."""

    A: torch.Tensor
    w: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor
    param: Optional[str] = None
    link: Optional[str] = None

    @property
    def link_of(self):
        """``(param, link)``, to carry into rows rebuilt from these."""
        return self.param, self.link


def _weight(site, like: torch.Tensor) -> torch.Tensor:
    base, mask, _ = unwrap(site["fn"])
    w = torch.ones_like(like)
    if mask is not None:
        w = w * mask.to(like.dtype)
    m = site["mask"]
    if m is False:
        w = w * 0
    elif m is not None and m is not True:
        w = w * m.to(like.dtype)
    return w * site["scale"]


def _flat_obs(site, like: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The observations, with masked-out entries (``obs_mask``, NaN placeholders) set to 0."""
    obs = site["value"]
    if obs.shape != like.shape and obs.numel() < like.numel():
        obs = obs.expand(like.shape)
    return torch.where(weight != 0, obs, torch.zeros_like(obs))


def normal_rows(site, factor, z_at: torch.Tensor, A: Optional[torch.Tensor] = None):
    """Exact message of ``Normal(y | A z + c, sigma)``: rows with ``w = 1/sigma^2``.

    ``z_at`` is the latent value the trace was taken at. Returns ``(rows, elbo_fn)`` where
    ``elbo_fn(f_mean, f_var)`` gives, with ``E eta = f_mean + c``,
    ``sum E_q[log N(y | eta, sigma^2)] = log N(y | E eta, sigma^2) - Var(eta) / (2 sigma^2)``.
    With ``A`` given (the Jacobian with its graph, see :func:`linear_predictor_rows`) the rows
    keep their graph to the model's parameters (``A``, ``c`` and ``sigma``), and so does a
    ``q`` solved from them; ``elbo_fn`` then takes that ``q``'s row moments.
    """
    base, _, _ = unwrap(site["fn"])
    loc = base.loc
    scale = base.scale.expand(loc.shape)
    weight = _weight(site, loc)
    y = _flat_obs(site, loc, weight)
    graph = A is not None
    A = factor.jacobian if A is None else A
    prec = (weight / (scale if graph else scale.detach()) ** 2).reshape(-1)
    c = (loc if graph else loc.detach()).reshape(-1) - A @ z_at.reshape(-1)
    rows = RowBlock(A, prec, prec * (y.reshape(-1) - c), c)

    def elbo(f_mean: torch.Tensor, f_var: torch.Tensor) -> torch.Tensor:
        mean = (f_mean + c).reshape(loc.shape)
        if not graph:  # the fixed-q gradient to the offset (A is free of parameters here)
            mean = mean + (loc - loc.detach())
        lp = torch.distributions.Normal(mean, scale, validate_args=False).log_prob(y)
        return (weight * lp).sum() - (weight * f_var.reshape(loc.shape) / (2 * scale**2)).sum()

    return rows, elbo


def linear_predictor_rows(
    site, factor, z_at, sites: torch.Tensor, A: Optional[torch.Tensor] = None
) -> RowBlock:
    """Rows of a linear-predictor factor from its site parameters ``(lam1, lam2)`` (eq. 13).

    In ``f = A z`` coordinates with ``eta = f + c`` the site is a row ``exp(b f - w f^2 / 2)``
    (:func:`pyro_cvi.gaussian.sites.site_to_row`).
    With ``A`` given (``factor.jacobian`` with its graph to learnable parameters, or the same
    constant) the rows keep their graph: ``c = eta(z_at) - A z_at`` with ``eta``'s graph, so a
    ``q`` solved from them moves with the parameters at fixed ``(lam1, lam2)``.
    """
    _, eta_at, _ = linear_param(unwrap(site["fn"])[0], factor.param, factor.link)
    graph = A is not None
    A = factor.jacobian if A is None else A
    c = (eta_at if graph else eta_at.detach()).reshape(-1) - A @ z_at.reshape(-1)
    return RowBlock(A, *site_to_row(sites[..., 0], sites[..., 1], c), c, factor.param, factor.link)


def linear_predictor_message(
    site,
    rows: RowBlock,
    f_mean: torch.Tensor,
    f_var: torch.Tensor,
    num_points: int = 20,
    num_samples: Optional[int] = None,
):
    """ELBO term and target sites of a linear-predictor factor (Appendix B.1, E.1).

    ``E_q[log p(y | eta)]`` with ``eta ~ N(f_mean + c, f_var)`` by Gauss-Hermite (or Monte
    Carlo gradients when ``num_samples`` is set); the target is
    ``(df/dm - 2 m df/dv, df/dv)`` (eqs. 30-31).
    """
    base, _, _ = unwrap(site["fn"])
    _, eta_now, _ = linear_param(base, rows.param, rows.link)
    shape = eta_now.shape
    weight = _weight(site, eta_now)
    y = _flat_obs(site, eta_now, weight)
    mean = (f_mean + rows.c).reshape(shape)
    # keep the graph to hyperparameters through the offset c (eta_now carries it)
    mean = mean + (eta_now - eta_now.detach())
    var = f_var.reshape(shape)

    def log_prob(eta):
        return weight * with_param(base, eta, rows.param, rows.link).log_prob(y)

    closed = _closed_form(base, rows) if num_samples is None else None
    if closed is not None:
        f, gm, gv = closed(weight, y, mean, var)
        lam1, lam2 = site_natural_params(mean.detach(), gm, gv)
        target = torch.stack([lam1.reshape(-1), lam2.reshape(-1)], -1)
        return (f.sum() if f.requires_grad else f.sum().detach()), target
    f, gm, gv = mean_param_gradients(log_prob, mean, var, num_points, num_samples)
    lam1, lam2 = site_natural_params(mean.detach(), gm, gv)
    target = torch.stack([lam1.reshape(-1), lam2.reshape(-1)], -1)
    if mean.requires_grad:  # the offset depends on hyperparameters: keep that graph
        return expected_log_prob(log_prob, mean, var, num_points).sum(), target
    if has_learnable_params(base, rows.param, rows.link):  # a learned scale (say): f has it
        return f.sum(), target
    return f.sum().detach(), target  # (no graph to keep: no backward pass for it)


def linear_predictor_value(
    site, rows: RowBlock, f_mean: torch.Tensor, f_var: torch.Tensor, num_points: int = 20
) -> torch.Tensor:
    """``sum E_q[log p(y | eta)]``, ``eta ~ N(f_mean + c, f_var)``, by Gauss-Hermite, with its
    graph to ``f_mean``, ``f_var``, ``c`` and the likelihood's other parameters (the value
    :func:`linear_predictor_message` returns, for rows and moments that keep their graph)."""
    base, _, _ = unwrap(site["fn"])
    _, eta_now, _ = linear_param(base, rows.param, rows.link)
    weight = _weight(site, eta_now)
    y = _flat_obs(site, eta_now, weight)
    mean = (f_mean + rows.c).reshape(eta_now.shape)

    def log_prob(eta):
        return weight * with_param(base, eta, rows.param, rows.link).log_prob(y)

    var = f_var.reshape(eta_now.shape)
    closed = _closed_form(base, rows)
    if closed is not None:
        return closed(weight, y, mean, var)[0].sum()
    return expected_log_prob(log_prob, mean, var, num_points).sum()


def linear_predictor_point_value(site, rows: RowBlock, f: torch.Tensor) -> torch.Tensor:
    """``sum log p(y | eta)`` at ``eta = f + c`` (a point mass: :func:`linear_predictor_value`
    at zero variance, without the quadrature's ``K`` equal nodes), no graph kept."""
    base, _, _ = unwrap(site["fn"])
    _, eta_now, _ = linear_param(base, rows.param, rows.link)
    weight = _weight(site, eta_now)
    y = _flat_obs(site, eta_now, weight)
    eta = (f + rows.c).reshape(eta_now.shape).detach()
    closed = _closed_form(base, rows)
    if closed is not None:
        return closed(weight, y, eta, torch.zeros_like(eta))[0].sum().detach()
    return (weight * with_param(base, eta, rows.param, rows.link).log_prob(y)).sum().detach()


def _closed_form(base, rows: RowBlock):
    """The closed-form expectation of a factor (``(weight, y, mean, var) -> (f, df/dm,
    df/dv)``), where there is one: a Poisson's log rate, a Normal's log scale; else ``None``."""
    if isinstance(base, torch.distributions.Poisson) and rows.link in (None, "exp"):
        return poisson_expectation
    if isinstance(base, torch.distributions.Normal) and (rows.param, rows.link) == (
        "scale",
        "exp",
    ):
        return partial(normal_scale_expectation, base.loc)
    return None


def poisson_expectation(weight, y, mean, var):
    """``E[log Poisson(y | exp(eta))]`` for ``eta ~ N(mean, var)`` in closed form,
    ``w (y m - exp(m + v/2) - lgamma(y + 1))``, and its exact derivatives in ``m`` and ``v``
    (eq. 29 without quadrature): ``w (y - exp(m + v/2))``, ``-w exp(m + v/2) / 2``. The value
    keeps the graph of ``mean`` and ``var``; the derivatives have none."""
    rate = torch.exp(mean + 0.5 * var)
    f = weight * (y * mean - rate - torch.lgamma(y + 1))
    r = rate.detach()
    return f, weight * (y - r), -0.5 * weight * r


def normal_scale_expectation(loc, weight, y, mean, var):
    """``E[log Normal(y | loc, exp(eta))]`` for ``eta ~ N(mean, var)`` in closed form,
    ``w (-log(2 pi) / 2 - m - r^2 exp(-2 m + 2 v) / 2)`` with ``r = y - loc`` (the log-normal
    moment ``E[exp(-2 eta)]``), and its exact derivatives in ``m`` and ``v``:
    ``w (r^2 e - 1)`` and ``-w r^2 e`` with ``e = exp(-2 m + 2 v)``. The value keeps the graph
    of ``loc``, ``mean`` and ``var``; the derivatives have none."""
    r2 = (y - loc).square()
    e = torch.exp(2 * (var - mean))
    f = weight * (-0.5 * math.log(2 * math.pi) - mean - 0.5 * r2 * e)
    q = (r2 * e).detach()
    return f, weight * (q - 1), -weight * q


#: a prior variance of a linear predictor above which the prior is "flat" on the likelihood's
#: scale: its moments say nothing about the curvature there (australian, ``delta = 1e-5``)
FLAT_PRIOR_VAR = 100.0


def warm_start_target(
    site,
    rows: RowBlock,
    f_mean: torch.Tensor,
    num_points: int = 20,
    prior_var: Optional[torch.Tensor] = None,
):
    """Site targets of a linear-predictor factor at a near point mass (variance ``1e-4``) at
    ``f_mean``: the warm start of its sites (``lam2 <= 0``; ``lam1 = 0`` where ``lam2 = 0``),
    or ``None`` when they are not finite.

    With the rows' prior variances ``prior_var``: per row, the target at the prior's own
    moments (Algorithm 1's first full step from ``q`` = prior) where that prior is not flat
    (variance <= ``FLAT_PRIOR_VAR``) and it gives the row less curvature than the point mass
    (the more conservative start). Measured: a1a (logistic, prior variance ~5) needs 12 steps
    at a fixed step 0.4 from the point mass, whose curvature overstates the precision."""
    var = torch.full_like(f_mean, 1e-4)
    with torch.enable_grad():
        _, target = linear_predictor_message(site, rows, f_mean, var, num_points, None)
        if prior_var is not None and bool((prior_var <= FLAT_PRIOR_VAR).any()):
            _, at_prior = linear_predictor_message(site, rows, f_mean, prior_var, num_points)
            pick = (prior_var <= FLAT_PRIOR_VAR) & (at_prior[:, 1].abs() < target[:, 1].abs())
            target = torch.where(pick[:, None], at_prior, target)
    target[:, 1] = target[:, 1].clamp(max=0.0)
    target[:, 0] = torch.where(target[:, 1] == 0, 0.0, target[:, 0])
    return target if bool(torch.isfinite(target).all()) else None


def general_gaussian_message(log_joint, loc, scale_tril, num_samples: int, on_samples=None):
    """Bonnet/Price estimate of ``grad_mu E_q[f(z)]`` for a Gaussian ``q = N(loc, L L^T)``.

    ``g = E[grad f]``, ``G = E[hess f] / 2`` (Opper & Archambeau, eq. 29), with antithetic pairs
    ``z = m +- L eps``: the pair average cancels the linear term of ``grad f`` around the mean,
    which is the control variate ``hess f(m) (z - m)`` at no cost. The target natural
    parameters are ``(g - 2 G m, G)``; returned in precision form ``(h, P) = (g + P m, -2 G)``.
    ``log_joint(z)`` returns ``(f, v)``: ``f`` for autograd in ``z``, and ``v`` the part of it
    whose Monte Carlo average is returned as the ELBO value (it keeps its graph to
    hyperparameters). ``on_samples``, if given, receives the i.i.d. per-pair values of ``v``.
    """
    D = loc.numel()
    half = max(1, num_samples // 2)
    eps = torch.randn(half, D, dtype=loc.dtype, device=loc.device)
    eps = torch.cat([eps, -eps], 0)
    g_sum = torch.zeros(D, dtype=loc.dtype, device=loc.device)
    H_sum = torch.zeros(D, D, dtype=loc.dtype, device=loc.device)
    values = []
    for e in eps:
        z = (loc + scale_tril @ e).detach().requires_grad_(True)
        with torch.enable_grad():
            f, v = log_joint(z)
            grads = (
                torch.autograd.grad(f, z, create_graph=True, allow_unused=True)
                if f.requires_grad
                else (None,)
            )  # (a log density that autograd does not see depend on z: no gradient)
            g = grads[0] if grads[0] is not None else torch.zeros_like(z)
            H = jacobian(g.reshape(-1), z)
        g_sum += g.detach().reshape(-1)
        H_sum += 0.5 * (H + H.T).detach()
        values.append(v)
    S = eps.shape[0]
    g, H = g_sum / S, H_sum / S
    h, P = price_target(g, H, loc)
    if on_samples is not None:  # the antithetic pairs' means are the i.i.d. samples
        pairs = torch.stack([torch.as_tensor(v).detach() for v in values]).reshape(2, -1)
        on_samples(pairs.mean(0))
    return sum(values) / S, h, P


#: what a model that cannot run under :func:`torch.func.vmap` raises there (data-dependent
#: control flow, in-place writes, ``.item()``): the particles then run in a loop
_VMAP_ERRORS = (RuntimeError, ValueError, TypeError, NotImplementedError, IndexError)


def particle_gradients(log_joint, Z: torch.Tensor, vectorize: bool = True):
    """``f``, ``v`` and ``grad f`` of ``log_joint`` at the rows of ``Z`` (``S x D``).

    With ``vectorize`` the ``S`` particles are one batched model run (:func:`torch.func.vmap`,
    Pyro's validation off inside it, independent randomness per particle); a model that cannot
    be vectorised runs in a loop instead. Either way the gradients come from one backward
    pass of ``sum_s f(z_s)``. Returns ``(F, V, G, vectorised)``: ``V`` keeps its graph to the
    model's parameters (the ELBO value), ``vectorised`` says whether the batched run worked.
    """
    Z = Z.detach().requires_grad_(True)
    with torch.enable_grad():
        out, batched = None, False
        if vectorize:
            try:
                with pyro.validation_enabled(False):
                    out = torch.func.vmap(log_joint, randomness="different")(Z)
                batched = True
            except _VMAP_ERRORS:
                out = None
        if out is None:
            pairs = [log_joint(z) for z in Z]
            out = (torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))
        F, V = out
        (G,) = torch.autograd.grad(F.sum(), Z, retain_graph=True)
    return F.detach(), V, G.detach(), batched


def gradient_gaussian_message(
    log_joint,
    loc: torch.Tensor,
    scale_tril: torch.Tensor,
    num_samples: int,
    curvature: Optional[torch.Tensor] = None,
    on_samples=None,
    vectorize: bool = True,
):
    """The target of :func:`general_gaussian_message` from gradients only (no Hessian).

    ``g = E[grad f]`` (Bonnet) as there; ``E[hess f]`` (Price) by Stein's lemma,
    ``E[(z - m) grad f(z)^T] = S E[hess f]``, i.e. ``E[hess f] = E[S^-1 (z - m) grad f^T]``
    (the reparameterisation form of Lin, Schmidt & Khan 2020, eq. 7), with ``z - m = L eps`` so
    ``S^-1 (z - m) = L^-T eps``. ``curvature`` ``H0`` (the current estimate of ``E[hess f]``,
    symmetric) is a control variate: since ``E[L^-T eps eps^T L^T] = I``,
    ``E[hess f] = H0 + E[L^-T eps (grad f - H0 L eps)^T]``, exact for a quadratic ``f`` once
    ``H0`` is (with antithetic pairs the constant part of the residual cancels). The estimate is
    symmetrised. Cost: one batched model run and one backward pass (:func:`particle_gradients`)
    instead of ``S (D + 1)`` backward passes. Returns ``(value, h, P, vectorised)``.
    """
    D = loc.numel()
    half = max(1, num_samples // 2)
    eps = torch.randn(half, D, dtype=loc.dtype, device=loc.device)
    eps = torch.cat([eps, -eps], 0)
    L = scale_tril.detach()
    dz = eps @ L.T  # z - m
    _, V, G, vectorised = particle_gradients(log_joint, loc.detach() + dz, vectorize)
    g = G.mean(0)
    H0 = torch.zeros_like(L) if curvature is None else curvature.detach()
    H = stein_hessian(eps, dz, L, G, H0)
    h, P = price_target(g, H, loc.detach())
    if on_samples is not None:  # the antithetic pairs' means are the i.i.d. samples
        on_samples(V.detach().reshape(2, -1).mean(0))
    return V.mean(), h, P, vectorised


def gradient_only(options, dim: int) -> bool:
    """Whether a block of ``dim`` takes the gradient-only estimate (``general_curvature``)."""
    mode = options.general_curvature
    return mode == "gradient" or (mode == "auto" and dim > DENSE_HESSIAN_MAX_DIM)


def general_message(options, log_joint, post, curvature: torch.Tensor, ctx, vectorise: bool):
    """The general factors' message on a Gaussian block ``q = post`` with the estimator that
    ``options.general_curvature`` chooses: gradients only (Stein's lemma, ``curvature`` the
    current estimate of ``E[hess f]`` as control variate, :func:`gradient_particles`) or a
    dense Hessian per particle. Returns ``(value, h, P, vectorise)`` (``vectorise``: whether
    the batched model run works, for the next call)."""
    n, D = options.num_general_samples, post.loc.numel()
    args = (log_joint, post.loc, post.scale_tril())
    if gradient_only(options, D):
        return gradient_gaussian_message(
            *args, gradient_particles(D, n), curvature.detach(), ctx.add_mc_samples, vectorise
        )
    return (*general_gaussian_message(*args, n, ctx.add_mc_samples), vectorise)
