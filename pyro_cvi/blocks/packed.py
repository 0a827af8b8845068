"""``AutoCVI.get_posterior()``: ``q`` over the packed unconstrained latent, as Pyro's
``AutoContinuous.get_posterior()`` returns it.

The packed latent ``u (D,)`` concatenates every continuous latent site's value mapped to the
unconstrained space (``u_i = biject_to(support_i)^-1(z_i)``, flattened) in model order, as
``AutoContinuous`` packs it (discrete sites are not part of it). ``q(u)`` is the product of
the guide's factors: a joint Gaussian block is one factor over its sites (their correlations
included), every other site its own factor. The distribution has

* ``mean``, ``variance`` and ``covariance_matrix`` (block diagonal over the factors): exact for
  Gaussian factors and for Gaussians pushed through the site's own bijection (the
  unconstrained-Gaussian ``q``, log-normal leaves); closed forms for Gamma (``log z``:
  ``psi(a) - log b``, ``psi'(a)``) and Beta (``logit z``: ``psi(a) - psi(b)``,
  ``psi'(a) + psi'(b)``); otherwise from 4096 draws under a fixed seed;
* ``sample`` / ``rsample`` (each factor drawn and mapped) and ``log_prob`` (each factor's
  density with the Jacobian of its map, ``log q(T(u)) + log |T'(u)|``).

A leaf (a site nothing depends on) is its conditional prior with its parents at their means,
as in ``guide.posterior(name)``.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import pyro
import torch
from pyro.distributions import TorchDistribution, constraints
from torch.distributions import Beta, Gamma, Independent, MultivariateNormal, biject_to

__all__ = ["PackedPosterior", "PackedLatent", "Factor", "packed_posterior"]

_DRAWS = 4096

#: one factor: the site names it covers (in its own order), their shapes, and its q
Factor = Tuple[Sequence[str], Sequence[torch.Size], torch.distributions.Distribution, bool]


class PackedPosterior(TorchDistribution):
    """``q(u)`` over the packed unconstrained latent (see the module docstring).

    :param factors: ``(names, shapes, q, joint)`` per factor; ``joint``: ``q`` is one
        Gaussian over the concatenated flattened values of ``names`` (all real-valued).
    :param order: the site names in packing (model) order.
    """

    arg_constraints = {}
    support = constraints.real_vector
    has_rsample = False

    def __init__(self, factors: Sequence[Factor], order: Sequence[str]):
        self.factors = list(factors)
        sizes = {}
        for names, shapes, _, _ in self.factors:
            for n, s in zip(names, shapes):
                sizes[n] = int(torch.Size(s).numel())
        self.order = [n for n in order if n in sizes]
        start, self.slices = 0, {}
        for n in self.order:
            self.slices[n] = slice(start, start + sizes[n])
            start += sizes[n]
        super().__init__(torch.Size(), torch.Size([start]), validate_args=False)
        self._moments = None

    # ------------------------------------------------------------------ per-factor maps
    def _index(self, names) -> torch.Tensor:
        return torch.cat([torch.arange(self.slices[n].start, self.slices[n].stop) for n in names])

    def _unconstrain(self, q, z):
        t = biject_to(q.support)
        return t.inv(z), t

    def _factor_moments(self, names, shapes, q, joint):
        """Mean ``(n,)`` and covariance ``(n, n)`` of the factor's unconstrained values."""
        if joint:
            return q.mean.reshape(-1), q.covariance_matrix
        base = q.base_dist if isinstance(q, Independent) else q
        if isinstance(base, Gamma):
            a, b = base.concentration, base.rate
            mean, var = torch.digamma(a) - b.log(), torch.polygamma(1, a)
        elif isinstance(base, Beta):
            a, b = base.concentration1, base.concentration0
            mean = torch.digamma(a) - torch.digamma(b)
            var = torch.polygamma(1, a) + torch.polygamma(1, b)
        elif (
            q.support is constraints.real or isinstance(q, MultivariateNormal) or (_real(q.support))
        ):
            if isinstance(q, MultivariateNormal) or hasattr(q, "covariance_matrix"):
                try:
                    cov = q.covariance_matrix
                    if cov.shape[-1] == q.mean.numel():
                        return q.mean.reshape(-1), cov.reshape(cov.shape[-1], -1)
                except (NotImplementedError, AttributeError, RuntimeError):
                    pass
            mean, var = q.mean, q.variance
        else:
            gauss = _gaussian_on_unconstrained(q)
            if gauss is not None:
                mean, var = gauss
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(0)
                    u = self._unconstrain(q, q.sample((_DRAWS,)))[0]
                u = u.reshape(_DRAWS, -1)
                return u.mean(0), torch.cov(u.T).reshape(u.shape[1], u.shape[1])
        mean, var = mean.reshape(-1), var.reshape(-1)
        return mean, torch.diag_embed(var)

    def _all_moments(self):
        if self._moments is None:
            D = self.event_shape[0]
            like = None
            parts = []
            for names, shapes, q, joint in self.factors:
                m, c = self._factor_moments(names, shapes, q, joint)
                parts.append((self._index(names), m, c))
                like = m
            mean = like.new_zeros(D)
            cov = like.new_zeros(D, D)
            for idx, m, c in parts:
                mean[idx] = m.to(like).detach()
                cov[idx[:, None], idx[None, :]] = c.to(like).detach()
            self._moments = (mean, cov)
        return self._moments

    @property
    def mean(self) -> torch.Tensor:
        return self._all_moments()[0]

    @property
    def covariance_matrix(self) -> torch.Tensor:
        return self._all_moments()[1]

    @property
    def variance(self) -> torch.Tensor:
        return self.covariance_matrix.diagonal()

    # ------------------------------------------------------------------ draws and densities
    def sample(self, sample_shape=()) -> torch.Tensor:
        sample_shape = torch.Size(sample_shape)
        out: List[Tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for names, _, q, joint in self.factors:
                z = q.sample(sample_shape)
                u = z if joint else self._unconstrain(q, z)[0]
                out.append((self._index(names), u.reshape(sample_shape + (-1,))))
        like = out[0][1]
        flat = like.new_zeros(sample_shape + self.event_shape)
        for idx, u in out:
            flat[..., idx] = u.to(like)
        return flat

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        lead = value.shape[:-1]
        total = value.new_zeros(lead)
        for names, shapes, q, joint in self.factors:
            u = value[..., self._index(names)]
            if joint:
                total = total + q.log_prob(u)
                continue
            u = u.reshape(lead + torch.Size(shapes[0]))
            t = biject_to(q.support)
            z = t(u)
            jac = t.log_abs_det_jacobian(u, z).reshape(lead + (-1,)).sum(-1)
            lp = q.log_prob(z).reshape(lead + (-1,)).sum(-1)
            total = total + lp + jac
        return total


def _real(support) -> bool:
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    return support is constraints.real


def _gaussian_on_unconstrained(q):
    """``(mean, var)`` when ``q`` is a Gaussian pushed through its support's own bijection
    (then its unconstrained value is the Gaussian draw), else ``None``."""
    base = q
    if isinstance(base, Independent):
        base = base.base_dist
    if not isinstance(base, torch.distributions.TransformedDistribution):
        return None
    inner = base.base_dist
    if isinstance(inner, Independent):
        inner = inner.base_dist
    if not isinstance(inner, (torch.distributions.Normal, MultivariateNormal)):
        return None
    t = biject_to(q.support)
    x = inner.mean + inner.stddev * torch.tensor([-1.3, 0.4, 1.7]).to(inner.mean).reshape(
        (3,) + (1,) * inner.mean.dim()
    )
    y = x
    for tr in base.transforms:
        y = tr(y)
    if not torch.allclose(t.inv(y), x, rtol=1e-5, atol=1e-6):
        return None
    return inner.mean, inner.variance


def packed_posterior(engine, leaves) -> PackedPosterior:
    """The :class:`PackedPosterior` of an engine's ``q``: one factor per joint Gaussian block
    (over its sites) and per other continuous site; ``leaves``: each leaf's conditional prior
    (discrete and summed-out sites are left out)."""
    an = engine.analysis
    factors = [f for block in engine.blocks for f in block.packed_factors()]
    for name, q in leaves.items():
        if name not in an.collapsed and not q.support.is_discrete:
            factors.append(((name,), (q.batch_shape + q.event_shape,), q, False))
    if not factors:
        raise ValueError("AutoCVI.get_posterior(): the model has no continuous latent site")
    return PackedPosterior(factors, list(an.latents))


class PackedLatent:
    """Mixin for :class:`~pyro_cvi.AutoCVI` (before ``AutoGuide`` in the bases): Pyro's
    ``get_posterior()`` and ``sample_latent()`` over the packed unconstrained latent."""

    def get_posterior(self, *args, **kwargs) -> PackedPosterior:
        """``q`` over the packed unconstrained latent (every continuous latent site mapped by
        ``biject_to(support)^-1``, flattened, in model order), as Pyro's
        ``AutoContinuous.get_posterior`` gives it: see :class:`PackedPosterior` (``mean``,
        ``variance``, ``covariance_matrix``, ``sample``, ``log_prob``)."""
        engine = self._ready(args, kwargs)
        leaves = self._leaf_priors(args or None, kwargs) if engine.analysis.leaves else {}
        return packed_posterior(engine, leaves)

    def sample_latent(self, *args, **kwargs) -> torch.Tensor:
        """A draw of the packed unconstrained latent from :meth:`get_posterior`, as an
        auxiliary site ``_<name>_latent`` (Pyro's ``AutoContinuous.sample_latent``)."""
        return pyro.sample(
            f"_{self._pyro_name}_latent",
            self.get_posterior(*args, **kwargs),
            infer={"is_auxiliary": True},
        )
