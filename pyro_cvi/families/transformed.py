"""A Gaussian on the unconstrained space: the fallback family for any continuous support.

For a latent whose support no conjugate family covers (an interval, ``greater_than(1)``,
lower-Cholesky, correlation-Cholesky, ordered vectors, ...) ``q`` is a Gaussian over
``u = T^-1(z)`` with ``T = torch.distributions.biject_to(support)``, pushed through ``T``: the
natural-gradient counterpart of AutoNormal / AutoMultivariateNormal. The natural parameters are
those of the Gaussian in ``u`` (full covariance within one batch element's event), so every
map of this family is the Gaussian's; only the value differs:

* ``z = T(u)``, ``log q(z) = log N(u) - log |det dT/du|``;
* the ELBO's entropy term is ``H[q_z] = H[N(u)] + E[log |det dT/du|]``: the family gives the
  first, and the Monte Carlo messages (:mod:`pyro_cvi.messages.montecarlo`) add the second as one
  more
  term of ``E_q[log p]`` (:meth:`log_abs_det_jacobian`), so its gradient enters the target.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import pyro.distributions as dist
import torch
from torch import Tensor
from torch.distributions import Distribution, biject_to, constraints

from .base import ExponentialFamily, Params
from .gaussian import Gaussian
from .shapes import sympy_free

__all__ = ["UnconstrainedGaussian"]


class UnconstrainedGaussian(ExponentialFamily):
    """``q(z) = T_# N(u | lambda)`` with ``T = biject_to(support)`` (see the module docstring)."""

    name = "gaussian (unconstrained)"
    domain = "sym(eta2) negative definite"

    def __init__(self, support: constraints.Constraint, event_shape: Sequence[int] = ()):
        super().__init__(event_shape)
        self.support = support
        # (the same map, its shape arithmetic free of sympy: families/shapes.py)
        self.transform = sympy_free(biject_to(support))
        unconstrained = self.transform.inverse_shape(torch.Size(event_shape))
        self.event_dim_u = self.transform.domain.event_dim
        self.u_shape = torch.Size(unconstrained[len(unconstrained) - self.event_dim_u :])
        self.base = Gaussian(self.u_shape)

    def __repr__(self) -> str:
        return f"UnconstrainedGaussian({self.support}, event_shape={tuple(self.event_shape)})"

    @property
    def param_shapes(self) -> Tuple[torch.Size, ...]:
        return self.base.param_shapes

    # the Gaussian's maps, in u
    def natural_to_mean(self, nat: Params) -> Params:
        return self.base.natural_to_mean(nat)

    def mean_to_natural(self, mean: Params) -> Params:
        return self.base.mean_to_natural(mean)

    def log_partition(self, nat: Params) -> Tensor:
        return self.base.log_partition(nat)

    def sufficient_stats(self, x: Tensor) -> Params:
        return self.base.sufficient_stats(self.transform.inv(x))

    def _in_domain(self, nat: Params) -> Tensor:
        return self.base._in_domain(nat)

    def entropy(self, nat: Params) -> Tensor:
        """``H[N(u)]``; the ``E[log |det dT/du|]`` part is a Monte Carlo term (module doc)."""
        return self.base.entropy(nat)

    def kl(self, nat_q: Params, nat_p: Params) -> Tensor:
        return self.base.kl(nat_q, nat_p)

    def symmetrize(self, params: Params) -> Params:
        return self.base.symmetrize(params)

    def mean_grad(self, nat: Params, grad_nat: Params) -> Params:
        return self.base.mean_grad(nat, grad_nat)

    def fisher_null_projector(self, dtype, device):
        return self.base.fisher_null_projector(dtype, device)

    # values live in z = T(u)
    def natural_to_dist(self, nat: Params) -> Distribution:
        return dist.TransformedDistribution(self.base.natural_to_dist(nat), [self.transform])

    def dist_to_natural(self, d: Distribution) -> Params:
        raise TypeError(f"{self!r}: a prior is never of this family; q starts at its value")

    def natural_at(self, value: Tensor, prior_nat: Optional[Params] = None) -> Params:
        """A unit-variance Gaussian in ``u`` around ``T^-1(value)``."""
        return self.base.natural_at(self.transform.inv(value.detach()), None)

    def natural_with_spread(self, value: Tensor, scale: float) -> Params:
        """A Gaussian in ``u`` around ``T^-1(value)`` with standard deviation ``scale``."""
        return self.base.natural_with_spread(self.transform.inv(value.detach()), scale)

    def mean_value(self, nat: Params, mean: Params) -> Optional[Tensor]:
        """``T(E u)``: a valid value (the median of ``q`` for elementwise transforms)."""
        loc = mean[0].detach()
        batch = loc.shape[: loc.dim() - len(self.base.param_shapes[0])]
        return self.transform(loc.reshape(batch + self.u_shape))

    def sample_with_log_det(self, nat: Params, sample_shape: Sequence[int] = ()):
        """``(z, log |det dT/du|)`` for a reparameterised draw ``u ~ N(lambda)``, ``z = T(u)``."""
        u = self.base.natural_to_dist(nat).rsample(torch.Size(sample_shape))
        z = self.transform(u)
        return z, self.transform.log_abs_det_jacobian(u, z)
