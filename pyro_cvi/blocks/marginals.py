"""Marginal quantiles of a torch Distribution, deterministic and exact to grid accuracy.

``AutoCVI.median()`` and ``AutoCVI.quantiles()`` read every site's marginal quantiles here, so
that the median is always the 0.5 quantile (Pyro's contract: ``median()[name] ==
quantiles([..., 0.5, ...])[name][i]``), for every family:

* ``icdf`` where torch has one (Normal, Laplace, Cauchy, Uniform, Exponential, ...);
  Gaussians with a covariance through their marginal Normals ``N(m_i, S_ii)``;
* an elementwise monotone ``TransformedDistribution`` (LogNormal, the unconstrained-Gaussian
  fallback on a positive or unit-interval site): ``Q_Y(p) = T(Q_X(p))`` for increasing ``T``,
  ``T(Q_X(1 - p))`` for decreasing ones;
* any other univariate continuous law (Gamma, Beta, ...): the CDF by the trapezoidal rule of
  the density on the unconstrained line ``u`` (``y = T(u)``, density ``p(T(u)) |T'(u)|``),
  on a coarse grid that finds the bulk and a fine one over it, inverted by linear
  interpolation (error ``O(h^2)``: 1e-5 relative or better in the bulk of smooth laws, up
  to about 3e-4 in the far tails of shapes below 1);
* a Dirichlet through its Beta marginals ``Beta(a_i, a_0 - a_i)``;
* finite discrete laws through their CDF over ``enumerate_support`` (the smallest value
  whose CDF reaches ``p``);
* anything else (e.g. a Cholesky factor of a correlation matrix) from 4096 draws under a
  fixed seed (the caller's random state is restored), so repeated calls agree.
"""

from __future__ import annotations

from typing import Sequence

import pyro.distributions as pdist
import torch
from torch.distributions import (
    Dirichlet,
    Distribution,
    Independent,
    LowRankMultivariateNormal,
    MultivariateNormal,
    Normal,
    TransformedDistribution,
    biject_to,
)

from ..gaussian.quadrature import gauss_hermite

__all__ = [
    "marginal_quantiles",
    "marginal_median",
    "discrete_mode",
    "standard_posterior",
    "NormalPosterior",
    "IndependentNormalPosterior",
    "TransformedPosterior",
    "marginal_std",
]

_COARSE, _FINE, _DRAWS = 2001, 4001, 4096


def discrete_mode(d: Distribution) -> torch.Tensor:
    """A most probable value of a discrete law, always a value of its support: torch's
    ``mode`` is NaN at a tie (``Bernoulli(0.5)``); there the first most probable value of
    ``enumerate_support`` is taken."""
    m = d.mode.detach()
    if not (m.is_floating_point() and bool(torch.isnan(m).any())):
        return m
    if isinstance(d, Independent):  # (elementwise: the base law's mode)
        return discrete_mode(d.base_dist)
    support = d.enumerate_support(expand=True)  # (K, *batch, *event)
    lp = d.log_prob(support)  # (K, *batch)
    idx = lp.argmax(0).reshape(lp.shape[1:] + (1,) * len(d.event_shape))
    idx = idx.expand(support.shape[1:]).unsqueeze(0)
    return support.gather(0, idx).squeeze(0).to(m).detach()


def marginal_median(d: Distribution) -> torch.Tensor:
    """The elementwise median of ``d`` (its 0.5 quantile; discrete laws: the mode)."""
    base = _unwrap(d)
    if base.support.is_discrete:
        return discrete_mode(base)
    if isinstance(base, TransformedDistribution) and all(t.bijective for t in base.transforms):
        out = marginal_median(base.base_dist)  # (not through a folding map, e.g. HalfNormal)
        for t in base.transforms:
            out = t(out)
        return out.detach()
    return marginal_quantiles(d, [0.5])[0]


@torch.no_grad()
def marginal_quantiles(d: Distribution, ps: Sequence[float]) -> torch.Tensor:
    """Elementwise quantiles of ``d`` stacked on a new leading dim: shape
    ``(len(ps),) + batch_shape + event_shape`` (see the module docstring for the method)."""
    d = _unwrap(d)
    like = d.mean if not d.support.is_discrete else d.sample().to(torch.get_default_dtype())
    ps_t = torch.as_tensor(list(ps), dtype=like.dtype, device=like.device)
    shape = d.batch_shape + d.event_shape
    if isinstance(d, (MultivariateNormal, LowRankMultivariateNormal)):
        d = Normal(d.mean, d.variance.sqrt())
    if isinstance(d, TransformedDistribution) and _monotone(d):
        sign = 1
        for t in d.transforms:
            sign = sign * int(t.sign)
        base_ps = ps_t if sign > 0 else 1 - ps_t
        out = marginal_quantiles(d.base_dist, base_ps.tolist())
        for t in d.transforms:
            out = t(out)
        return out.reshape((len(ps_t),) + shape)
    if d.support.is_discrete:
        return _discrete(d, ps_t).reshape((len(ps_t),) + shape)
    try:
        p = ps_t.reshape((-1,) + (1,) * len(d.batch_shape + d.event_shape))
        return d.icdf(p.expand((len(ps_t),) + shape)).detach()
    except (NotImplementedError, AttributeError, ValueError, RuntimeError):
        pass
    if isinstance(d, Dirichlet):
        a = d.concentration
        beta = torch.distributions.Beta(a, a.sum(-1, keepdim=True) - a)
        return _grid(beta, ps_t)
    if not d.event_shape:
        return _grid(d, ps_t)
    return _monte_carlo(d, ps_t)


def _unwrap(d: Distribution) -> Distribution:
    """Strip ``Independent`` (reinterpreted dims do not change the marginals)."""
    while isinstance(d, Independent):
        d = d.base_dist
    return d


def _elementwise(d: TransformedDistribution) -> bool:
    return _elementwise_transforms(d.transforms)


def _elementwise_transforms(transforms) -> bool:
    try:
        return all(t.domain.event_dim == 0 and t.codomain.event_dim == 0 for t in transforms)
    except NotImplementedError:
        return False


def _is_reshape(t) -> bool:
    return isinstance(t, torch.distributions.transforms.ReshapeTransform)


def _monotone(d: TransformedDistribution) -> bool:
    """Elementwise, bijective transforms with a known sign (quantiles map through them); not
    e.g. ``HalfNormal``'s ``AbsTransform``, which folds the line (its own ``icdf`` is used)."""
    if not _elementwise(d):
        return False
    try:
        return all(t.bijective and int(t.sign) in (-1, 1) for t in d.transforms)
    except NotImplementedError:
        return False


def _discrete(d: Distribution, ps: torch.Tensor) -> torch.Tensor:
    support = d.enumerate_support(expand=True)  # (K,) + batch
    cdf = d.log_prob(support).exp().cumsum(0)
    p = ps.reshape((-1, 1) + (1,) * (cdf.dim() - 1))
    idx = (cdf.unsqueeze(0) < p - 1e-12).sum(1).clamp(max=support.shape[0] - 1)
    return support.gather(0, idx).to(ps.dtype)


def _grid(d: Distribution, ps: torch.Tensor) -> torch.Tensor:
    """Univariate quantiles by the CDF on the unconstrained line: a wide pass (60 delta-method
    standard deviations of ``u`` each side of ``T^-1(mean)``) brackets the bulk, a fine one
    over the bracket is inverted."""
    t = biject_to(d.support)
    tiny = torch.finfo(ps.dtype).tiny
    mean = d.mean.clamp_min(tiny) if _positive(d) else d.mean
    centre = torch.nan_to_num(t.inv(mean), nan=0.0, posinf=0.0, neginf=0.0)
    try:
        slope = t.log_abs_det_jacobian(centre, t(centre)).exp()
        width = 60.0 * torch.nan_to_num(d.stddev / slope, nan=10.0, posinf=10.0)
    except (NotImplementedError, AttributeError):
        width = torch.full_like(centre, 600.0)
    width = torch.maximum(width, 1e-6 * (1 + centre.abs()))
    u, cdf = _cdf(d, t, centre - width, centre + width, _COARSE)
    below = ((cdf <= 1e-12).sum(0) - 1).clamp(0, _COARSE - 1)
    above = (_COARSE - (cdf >= 1 - 1e-12).sum(0)).clamp(0, _COARSE - 1)
    lo, hi = u.gather(0, below[None])[0], u.gather(0, above[None])[0]
    hi = torch.where(hi > lo, hi, lo + width / (_COARSE - 1))
    u, cdf = _cdf(d, t, lo, hi, _FINE)
    out = []
    for p in ps:
        k = (cdf < p).sum(0).clamp(1, _FINE - 1)
        c0, c1 = cdf.gather(0, (k - 1)[None])[0], cdf.gather(0, k[None])[0]
        u0, u1 = u.gather(0, (k - 1)[None])[0], u.gather(0, k[None])[0]
        w = ((p - c0) / (c1 - c0).clamp_min(tiny)).clamp(0, 1)
        out.append(t(u0 + w * (u1 - u0)))
    return torch.stack(out)


def _positive(d: Distribution) -> bool:
    return d.support is torch.distributions.constraints.positive


def _cdf(d, t, lo, hi, n):
    steps = torch.linspace(0, 1, n, dtype=lo.dtype, device=lo.device)
    u = lo + steps.reshape((-1,) + (1,) * lo.dim()) * (hi - lo)
    if isinstance(d, torch.distributions.Beta):  # exact in u: no rounding of y = sigmoid(u)
        a, b = d.concentration1, d.concentration0
        norm = torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b)
        logp = a * torch.nn.functional.logsigmoid(u) + b * torch.nn.functional.logsigmoid(-u) - norm
    else:
        y = t(u)
        logp = d.log_prob(y) + t.log_abs_det_jacobian(u, y)
    dens = torch.nan_to_num(logp.exp(), nan=0.0, posinf=0.0)
    du = (hi - lo) / (n - 1)
    inc = 0.5 * (dens[1:] + dens[:-1]) * du
    cdf = torch.cat([torch.zeros_like(dens[:1]), inc.cumsum(0)])
    total = cdf[-1:].clamp_min(torch.finfo(dens.dtype).tiny)
    return u, cdf / total


def _monte_carlo(d: Distribution, ps: torch.Tensor) -> torch.Tensor:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        draws = d.sample((_DRAWS,))
    q = torch.quantile(draws.double(), ps.double().to(draws.device), dim=0)
    return q.to(draws.dtype)


# --------------------------------------------------------------------------- standard q objects
class NormalPosterior(pdist.Normal):
    """A mean-field Gaussian ``q`` with its ``covariance_matrix``: ``batch_shape + (1, 1)``
    (torch's convention for a scalar event: one 1 x 1 block per element)."""

    @property
    def covariance_matrix(self) -> torch.Tensor:
        return self.variance[..., None, None]


class IndependentNormalPosterior(pdist.Independent):
    """``Independent(Normal)`` with ``covariance_matrix = diag(variance)`` over the flattened
    event: ``batch_shape + (e, e)``, ``e`` the number of event elements."""

    @property
    def covariance_matrix(self) -> torch.Tensor:
        var = self.variance
        n = len(self.event_shape)
        return torch.diag_embed(var.reshape(var.shape[: var.dim() - n] + (-1,)))


class TransformedPosterior(pdist.TransformedDistribution):
    """A Gaussian pushed through a transform (the unconstrained-Gaussian ``q``) with ``mean``
    and ``variance``: for elementwise transforms ``E[T(X)]`` and ``Var[T(X)]`` by 64-point
    Gauss-Hermite quadrature on each base Normal marginal (exact for smooth ``T`` to round-off);
    otherwise from 4096 draws under a fixed seed (the caller's random state is kept)."""

    def _moments(self):
        cached = self.__dict__.get("_cvi_moments")
        if cached is not None:
            return cached
        base = _unwrap(self.base_dist)
        if isinstance(base, (MultivariateNormal, LowRankMultivariateNormal)):
            base = Normal(base.mean, base.variance.sqrt())
        # a reshape moves the Normal marginals (a Gaussian of any event shape): exact
        transforms = list(self.transforms)
        while isinstance(base, Normal) and transforms and _is_reshape(transforms[0]):
            t = transforms.pop(0)
            base = Normal(t(base.loc), t(base.scale))
        if isinstance(base, Normal) and not transforms:
            mean, var = base.loc, base.scale**2
        elif isinstance(base, Normal) and _elementwise_transforms(transforms):
            x, w = gauss_hermite(64, base.loc.dtype, base.loc.device)
            z = base.loc + base.scale * x.reshape((-1,) + (1,) * base.loc.dim())
            for t in transforms:
                z = t(z)
            w = w.reshape((-1,) + (1,) * base.loc.dim())
            mean = (w * z).sum(0)
            var = (w * (z - mean) ** 2).sum(0)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                draws = self.sample((_DRAWS,))
            mean, var = draws.mean(0), draws.var(0)
        shape = self.batch_shape + self.event_shape
        out = (mean.detach().reshape(shape), var.detach().reshape(shape))
        self.__dict__["_cvi_moments"] = out
        return out

    @property
    def mean(self) -> torch.Tensor:
        return self._moments()[0]

    @property
    def variance(self) -> torch.Tensor:
        return self._moments()[1]

    @property
    def covariance_matrix(self) -> torch.Tensor:
        """A reshaped Gaussian's covariance over its flattened values (row-major, as
        ``mean.reshape(-1)``); other transforms have none in closed form."""
        base = self.base_dist
        if not all(_is_reshape(t) for t in self.transforms) or not isinstance(
            base, (MultivariateNormal, LowRankMultivariateNormal)
        ):
            raise AttributeError(
                "covariance_matrix: this q is a Gaussian pushed through a nonlinear transform "
                "(use mean and variance, or sample)"
            )
        return base.covariance_matrix


def standard_posterior(d: Distribution) -> Distribution:
    """``d`` as one of the classes above where it is a Normal, an ``Independent`` Normal or
    a transformed Gaussian (same parameters, same draws), so that every ``q`` has ``mean``,
    ``variance`` and, for Gaussians, ``covariance_matrix``; any other ``d`` unchanged."""
    if type(d) in (Normal, pdist.Normal):
        return NormalPosterior(d.loc, d.scale, validate_args=False)
    if type(d) in (Independent, pdist.Independent) and type(d.base_dist) in (
        Normal,
        pdist.Normal,
    ):
        base = NormalPosterior(d.base_dist.loc, d.base_dist.scale, validate_args=False)
        return IndependentNormalPosterior(base, d.reinterpreted_batch_ndims, validate_args=False)
    if type(d) in (TransformedDistribution, pdist.TransformedDistribution):
        return TransformedPosterior(d.base_dist, d.transforms, validate_args=False)
    return d


def marginal_std(q: Distribution) -> torch.Tensor:
    """Elementwise standard deviation of a Gaussian ``q`` (of its base, when transformed)."""
    if isinstance(q, TransformedDistribution):
        q = q.base_dist
    if isinstance(q, MultivariateNormal):
        return q.covariance_matrix.diagonal(dim1=-2, dim2=-1).sqrt()
    return q.stddev
