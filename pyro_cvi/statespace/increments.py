"""A vectorised random walk: a site ``eps`` of increments whose cumulative sum is the chain.

``x = eps.cumsum(a)`` (time dim ``a`` of the site's value, any other dims flattened into the
state, ``x (T, d)``) is the bijection ``x_t = x_{t-1} + eps_t``, ``x_0 = eps_0``, with inverse
``eps = diff(x)``; its Jacobian is unit lower-triangular, so densities and KLs agree:
``q(eps) = q_x(cumsum eps)`` and ``KL(q(eps) || p(eps)) = KL(q_x || p_x)``. Independent
Normal increments ``eps_t ~ N(mu_t, diag s_t^2)`` make ``x`` the chain ``A = I, b_t = mu_t,
Q_t = diag s_t^2`` (``m0 = mu_0, P0 = diag s_0^2``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Increments"]


@dataclass(frozen=True)
class Increments:
    """Layout of an increments site: its value ``shape`` and the time dim ``dim`` (>= 0)."""

    shape: torch.Size
    dim: int

    def describe(self, site: str) -> str:
        return f"random walk x = cumsum({site}, dim={self.dim})"

    @property
    def length(self) -> int:
        return int(self.shape[self.dim])

    @property
    def state_dim(self) -> int:
        return int(self.shape.numel()) // self.length

    def _moved(self) -> torch.Size:
        s = list(self.shape)
        return torch.Size([s.pop(self.dim)] + s)

    def layout(self, v: torch.Tensor) -> torch.Tensor:
        """A tensor of the site's shape (after leading dims) as ``(..., T, d)``, time first."""
        lead = v.shape[: v.dim() - len(self.shape)]
        v = v.movedim(len(lead) + self.dim, len(lead))
        return v.reshape(lead + (self.length, self.state_dim))

    def unlayout(self, v: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`layout`, flattened: ``(..., T, d) -> (..., D)``."""
        lead = v.shape[:-2]
        v = v.reshape(lead + self._moved()).movedim(len(lead), len(lead) + self.dim)
        return v.reshape(lead + (-1,))

    def states(self, z: torch.Tensor) -> torch.Tensor:
        """``x = cumsum(eps)`` ``(..., T, d)`` from the flat increments ``z (..., D)``."""
        return self.layout(z.reshape(z.shape[:-1] + self.shape)).cumsum(-2)

    def increments(self, x: torch.Tensor) -> torch.Tensor:
        """``eps = diff(x)`` (``eps_0 = x_0``), flat ``(..., D)``, from states ``(..., T, d)``."""
        return self.unlayout(torch.cat([x[..., :1, :], x.diff(dim=-2)], -2))

    def variance(self, cov: torch.Tensor, cross: torch.Tensor) -> torch.Tensor:
        """``Var(eps)`` flat ``(D,)`` from the marginal covariances ``cov (T, d, d)`` and the
        lag-one ``cross[t-1] = Cov(x_t, x_{t-1}) (T-1, d, d)``:
        ``Var(eps_t) = S_t + S_{t-1} - C_t - C_t'`` (diagonals)."""
        var = cov.diagonal(dim1=-2, dim2=-1)
        lag = cross.diagonal(dim1=-2, dim2=-1)
        rest = var[1:] + var[:-1] - 2 * lag
        return self.unlayout(torch.cat([var[:1], rest], 0))
