"""CVI's mirror-descent step for the Gamma, Beta and Dirichlet sites of a Pyro guide.

With natural parameters ``lam`` and mean parameters ``mu`` of ``q`` (:mod:`pyro_cvi.families`),
the loss ``l = -L`` and its gradient ``dl/dtheta`` in the distribution's own parameters
``theta`` (``theta`` is affine in ``lam``), the step (Khan & Lin 2017, eq. 12, Appendix F) is::

    dl/dlam = (dtheta/dlam)^T dl/dtheta,     dl/dmu = F(lam)^-1 dl/dlam      (eq. 72)
    lam'    = lam - b dl/dmu

(a natural-gradient step in ``lam``; exact in one step at ``b = 1`` on a conjugate model
with exact gradients). Under a one-draw loss the direction is ``x - c x_s``, ``x_s`` the
natural gradient of the draw's score ``d log q(z) / d theta`` (a control variate:
:class:`~pyro_cvi.natgrad.control.ScoreCoefficient`). At the optimum of a conjugate model the
one-draw gradient of ``Trace_ELBO`` is the score alone, whose natural gradient has covariance
``F(lam)^-1``: for a Gamma of shape 28 that is a standard deviation of about 40 in the shape per
draw, which no step size averages out in a few hundred steps; with ``c = 1`` it is zero.
``b`` is halved per batch element until ``lam'`` is in the family's
domain (and, under the adaptive control, until every concentration changes by at most a
factor ``MAX_FACTOR``); elements with no valid step keep their value. The whitened direction
``d = (dl/dmu) * sqrt(diag F^-1)``-free form used by the noise control is ``dl/dmu`` relative
to ``1 + |lam|``.

=========  ==============================  ====================  =====================
family     theta                           lam                   dl/dlam
=========  ==============================  ====================  =====================
gamma      (alpha, beta)                   (alpha - 1, -beta)    (g_alpha, -g_beta)
beta       (c1, c0)                        (c1 - 1, c0 - 1)      (g_c1, g_c0)
dirichlet  (alpha,) [..., K]               (alpha - 1,)          (g_alpha,)
=========  ==============================  ====================  =====================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import pyro
import pyro.distributions as dist
import torch

from ..families import Beta, Dirichlet, Gamma
from ..families.base import ExponentialFamily
from ..gaussian.halving import MAX_HALVINGS, halve_until_valid
from .control import NoiseControl, ScoreCoefficient
from .observe import GuideSite
from .params import Selected, read, write_grad
from .roles import GaussianGroup
from .sites import unwrap

__all__ = [
    "CONCENTRATION_FAMILIES",
    "MAX_FACTOR",
    "concentration_group_step",
    "concentration_step",
    "gaussian_score_control",
    "site_score",
]

#: the adaptive step changes a concentration by at most this factor per step (a trust region:
#: far from the optimum one draw's natural gradient can be huge, and a Gamma shape moved by a
#: factor of 10 a step was measured to collapse towards 0 within five steps)
MAX_FACTOR = 2.0

Thetas = Tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class _Form:
    roles: Tuple[str, ...]
    signs: Tuple[float, ...]  # theta_k = sign_k * (lam_k + shift_k)
    shifts: Tuple[float, ...]
    family: Callable[[torch.Size], ExponentialFamily]
    event_dims: int
    #: the Pyro distribution of ``theta`` (to score a draw)
    dist: Callable[..., Any]

    def natural(self, theta: Thetas) -> Thetas:
        return tuple(s * t - c for s, c, t in zip(self.signs, self.shifts, theta))

    def theta(self, lam: Thetas) -> Thetas:
        return tuple(s * (n + c) for s, c, n in zip(self.signs, self.shifts, lam))

    def grad(self, g: Thetas) -> Thetas:
        return tuple(s * x for s, x in zip(self.signs, g))


CONCENTRATION_FAMILIES: Dict[str, _Form] = {
    "gamma": _Form(
        ("concentration", "rate"), (1.0, -1.0), (1.0, 0.0), lambda e: Gamma(()), 0, dist.Gamma
    ),
    "beta": _Form(
        ("concentration1", "concentration0"),
        (1.0, 1.0),
        (1.0, 1.0),
        lambda e: Beta(()),
        0,
        dist.Beta,
    ),
    "dirichlet": _Form(
        ("concentration",), (1.0,), (1.0,), lambda e: Dirichlet(e), 1, dist.Dirichlet
    ),
}


def concentration_step(
    kind: str,
    theta: Dict[str, torch.Tensor],
    grads: Dict[str, torch.Tensor],
    beta: float,
    max_factor: Optional[float] = None,
    score: Optional[Dict[str, torch.Tensor]] = None,
    coefficient: Optional[ScoreCoefficient] = None,
) -> Tuple[Dict[str, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]:
    """One mirror-descent step of a Gamma/Beta/Dirichlet ``q`` from ``dl/dtheta``.

    ``score``: ``d log q(z) / d theta`` of the loss's draw, weighted as ``grads``; with
    ``coefficient``, the direction is ``x - c x_s`` and ``c`` learns from this step.
    Returns the new ``theta`` by role and the whitened direction ``(d, d)`` for the noise
    control. Computed in float64, returned in ``theta``'s dtype."""
    form = CONCENTRATION_FAMILIES[kind]
    dtype = theta[form.roles[0]].dtype
    th = tuple(theta[r].detach().double() for r in form.roles)
    g = tuple(grads[r].detach().double() for r in form.roles)
    event = th[0].shape[-1:] if form.event_dims else torch.Size()
    family = form.family(event)
    lam = form.natural(th)
    x = family.mean_grad(lam, form.grad(g))
    if score is not None and coefficient is not None:
        sc = tuple(score[r].detach().double() for r in form.roles)
        x_s = family.mean_grad(lam, form.grad(sc))
        if all(bool(torch.isfinite(v).all()) for v in x_s):
            c = coefficient.value()
            flat = torch.cat([v.reshape(-1) for v in x])
            coefficient.observe(flat, torch.cat([v.reshape(-1) for v in x_s]))
            x = tuple(xi - c * si for xi, si in zip(x, x_s))
    batch = th[0].shape[: th[0].dim() - form.event_dims]

    def candidate(b: torch.Tensor) -> Thetas:
        bb = b.reshape(b.shape + (1,) * form.event_dims) if torch.is_tensor(b) else b
        return tuple(n - bb * xi for n, xi in zip(lam, x))

    def valid(new: Thetas) -> torch.Tensor:
        ok = family.is_valid(new)
        if max_factor is not None:
            for old, t in zip(th, form.theta(new)):
                r = (t / old).abs()
                within = (r <= max_factor) & (r >= 1.0 / max_factor) & (t * old > 0)
                ok = ok & (within.all(-1) if form.event_dims else within)
        return ok.expand(batch)

    b0 = torch.full(batch, float(beta), dtype=torch.float64, device=th[0].device)
    new, _, ok, _ = halve_until_valid(candidate, valid, b0, MAX_HALVINGS)
    keep = ok.reshape(ok.shape + (1,) * form.event_dims)
    new = tuple(torch.where(keep, n, o) for n, o in zip(new, lam))
    out = {r: t.to(dtype) for r, t in zip(form.roles, form.theta(new))}
    d = torch.cat([(xi / (1.0 + n.abs())).reshape(-1) for xi, n in zip(x, lam)])
    return out, (d, d)


def site_score(kind: str, site: GuideSite, g: GaussianGroup) -> Optional[Dict[str, torch.Tensor]]:
    """``d log q(z) / d theta`` at the draw ``z`` the loss used, by role, weighted as the loss's
    gradient is (``site.scale / particles``, summed over broadcast copies, over ``g.weight``);
    ``None`` where it is not known (no draw, a mask, a tensor ``poutine.scale``)."""
    form = CONCENTRATION_FAMILIES[kind]
    fn, z = site.fn, site.value
    if not torch.is_tensor(z) or not site.scale == site.scale:
        return None
    wrapper = fn
    while hasattr(wrapper, "base_dist"):
        if isinstance(wrapper, dist.MaskedDistribution):
            return None
        wrapper = wrapper.base_dist
    base = unwrap(fn)
    if base is None or isinstance(fn, torch.distributions.TransformedDistribution):
        return None
    store = pyro.get_param_store()
    with torch.enable_grad():
        leaves = [getattr(base, r).detach().clone().requires_grad_(True) for r in form.roles]
        try:
            lp = form.dist(*leaves, validate_args=False).log_prob(z.detach()).sum()
            full = torch.autograd.grad(lp, leaves)
        except (ValueError, RuntimeError):
            return None
    scale = site.scale if site.scale > 0 else 1.0
    out = {}
    maps, names = g.transforms, g.roles
    for r, s_full in zip(form.roles, full):
        m = maps.get(r)
        shape = m.idx.shape if isinstance(m, Selected) else store[names[r]].unconstrained().shape
        try:
            s_role = s_full.sum_to_size(shape)
        except RuntimeError:
            return None
        out[r] = s_role * (scale / max(site.particles, 1)) / g.weight
    return out


def concentration_group_step(
    g: GaussianGroup,
    cons: Mapping[str, object],
    beta: float,
    max_factor: Optional[float],
    site: Optional[GuideSite] = None,
    control: Optional[NoiseControl] = None,
) -> Tuple[Dict[str, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`concentration_step` of a guide's Gamma/Beta/Dirichlet site from the gradients
    the loss left, with the score control variate of ``site``'s draw where it is known."""
    form = CONCENTRATION_FAMILIES[g.family]
    theta, grads = {}, {}
    for role in form.roles:
        theta[role], grad = read(g.roles[role], cons, g.transforms.get(role))
        grads[role] = grad if g.weight == 1.0 else grad / g.weight
    score = site_score(g.family, site, g) if site is not None and control is not None else None
    if score is not None and any(score[r].shape != theta[r].shape for r in form.roles):
        score = None
    coefficient = control.score if control is not None else None
    return concentration_step(g.family, theta, grads, beta, max_factor, score, coefficient)


#: the Gaussian groups of a guide site whose one-draw gradients get the score control variate:
#: ``(distribution, attribute of each role)``
_GAUSSIANS: Dict[str, Tuple[Callable[..., Any], Tuple[Tuple[str, str], ...]]] = {
    "diag": (dist.Normal, (("loc", "loc"), ("scale", "scale"))),
    "tril": (
        lambda m, L, **kw: dist.MultivariateNormal(m, scale_tril=L, **kw),
        (("loc", "loc"), ("scale_tril", "_unbroadcasted_scale_tril")),
    ),
}


def _base_value(fn: Any, z: torch.Tensor) -> Optional[torch.Tensor]:
    """The draw of the exponential family under ``fn``'s wrappers (``None``: masked)."""
    while True:
        if isinstance(fn, dist.MaskedDistribution):
            return None
        if isinstance(fn, torch.distributions.TransformedDistribution):
            for t in reversed(fn.transforms):
                z = t.inv(z)
        if not hasattr(fn, "base_dist"):
            return z
        fn = fn.base_dist


def gaussian_score_control(
    g: GaussianGroup, site: Optional[GuideSite], control: NoiseControl, cons: Mapping[str, object]
) -> bool:
    """Replace a guide Gaussian's loss gradient ``g_theta`` by ``g_theta - c s`` (``s``: the
    score of the loss's draw, weighted as the gradient; ``c``:
    :class:`~pyro_cvi.natgrad.control.ScoreCoefficient`, regressed in the Fisher metric
    ``diag(sigma^2, sigma^2 / 2)`` of ``(loc, scale)``, row norms of ``L`` for a Cholesky
    factor) before the Gaussian's step reads it. At the optimum of a conjugate model a
    one-draw ``Trace_ELBO`` gradient is the score alone; a Cholesky factor's natural gradient
    from it is a one-degree-of-freedom Wishart draw, which the step size alone averages out
    only over a hundred steps. Returns whether the gradient was changed."""
    spec = _GAUSSIANS.get(g.family)
    if spec is None or site is None or not torch.is_tensor(site.value):
        return False
    if not site.scale == site.scale:
        return False
    make, roles = spec
    base = unwrap(site.fn)
    z = _base_value(site.fn, site.value.detach())
    if base is None or z is None:
        return False
    store = pyro.get_param_store()
    with torch.enable_grad():
        leaves = [getattr(base, a).detach().clone().requires_grad_(True) for _, a in roles]
        try:
            lp = make(*leaves, validate_args=False).log_prob(z).sum()
            full = torch.autograd.grad(lp, leaves)
        except (ValueError, RuntimeError, NotImplementedError):
            return False
    scale = site.scale if site.scale > 0 else 1.0
    grads, scores, values = {}, {}, {}
    for (r, _), s_full in zip(roles, full):
        m, name = g.transforms.get(r), g.roles[r]
        shape = m.idx.shape if isinstance(m, Selected) else store[name].unconstrained().shape
        try:
            s_role = s_full.sum_to_size(shape)
        except RuntimeError:
            return False
        values[r], grad = read(name, cons, m)
        if grad.shape != s_role.shape:
            return False
        grads[r] = grad / g.weight
        scores[r] = s_role * (scale / max(site.particles, 1)) / g.weight
    if g.family == "diag":
        var = values["scale"].pow(2)
        metric = {"loc": var, "scale": var / 2}
    else:
        rows = values["scale_tril"].pow(2).sum(-1)
        metric = {"loc": rows, "scale_tril": rows.unsqueeze(-1).expand_as(values["scale_tril"]) / 2}
    w = {r: metric[r].detach().double().sqrt() for r in grads}
    x = torch.cat([(grads[r].double() * w[r]).reshape(-1) for r in grads])
    x_s = torch.cat([(scores[r].double() * w[r]).reshape(-1) for r in grads])
    if not bool(torch.isfinite(x_s).all()):
        return False
    c = control.score.value()
    control.score.observe(x, x_s)
    if c == 0.0:
        return False
    for r, _ in roles:
        write_grad(
            g.roles[r],
            (grads[r] - c * scores[r].to(grads[r])) * g.weight,
            cons,
            g.transforms.get(r),
        )
    return True
