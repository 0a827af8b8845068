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

from ..model import probes
from .elements import LinearGaussianChain

__all__ = ["Increments", "NestedIncrements"]


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
    def site_dim(self) -> int:
        """The site's other dims, flattened (the state's, for one site)."""
        return int(self.shape.numel()) // self.length

    @property
    def state_dim(self) -> int:
        return self.site_dim

    def _moved(self) -> torch.Size:
        s = list(self.shape)
        return torch.Size([s.pop(self.dim)] + s)

    def layout(self, v: torch.Tensor) -> torch.Tensor:
        """A tensor of the site's shape (after leading dims) as ``(..., T, d)``, time first."""
        lead = v.shape[: v.dim() - len(self.shape)]
        v = v.movedim(len(lead) + self.dim, len(lead))
        return v.reshape(lead + (self.length, self.site_dim))

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

    def prior(self, bases) -> LinearGaussianChain:
        """The chain of ``x = cumsum(eps)``, ``eps ~ Normal(mu, s)`` independent (``bases``:
        the site's Normal): ``A = I``, ``b_t = mu_t``, ``Q_t = diag s_t^2``, ``m0 = mu_0``,
        ``P0 = diag s_0^2``."""
        (base,) = bases
        loc = self.layout(base.loc.expand(self.shape))
        var = self.layout((base.scale**2).expand(self.shape))
        T, d = loc.shape
        eye = torch.eye(d, dtype=loc.dtype, device=loc.device).expand(T - 1, d, d)
        return LinearGaussianChain(
            loc[0], torch.diag(var[0]), eye, loc[1:], torch.diag_embed(var[1:])
        )


@dataclass(frozen=True)
class NestedIncrements(Increments):
    """``k = len(sites)`` increments sites of one ``shape`` (time dim ``dim``) inside ``k``
    nested cumsums: ``z^1 = cumsum(e^1)``, ``z^j = cumsum(z^(j-1) + e^j)`` (a local linear
    trend: ``slope = z^1 = cumsum(eta)``, ``level = z^2 = cumsum(slope + eps)``). With
    ``b^j = z^j - z^(j-1)`` (``z^0 = 0``) the state ``x_t = (b^1_t, ..., b^k_t)`` (each ``m``
    of the site's other dims, ``d = k m``) is the chain

        x_t = L x_(t-1) + e_t,   L = lower-triangular ones (x) I_m,   z^j_t = sum_(i<=j) b^i_t,

    whose innovations are the sites themselves (a diagonal ``Q`` for independent Normal
    increments). ``e -> x`` is unit lower-triangular in time-major order (Jacobian one), so
    ``q(e)`` and ``q(x)`` are the same Gaussian. Flat values are the sites' flattened values
    concatenated in ``sites`` order."""

    sites: tuple = ()

    def describe(self, site: str) -> str:
        inner = ", ".join(self.sites)
        return f"nested random walk of ({inner}): z^j = cumsum(z^(j-1) + e^j, dim={self.dim})"

    @property
    def levels(self) -> int:
        return len(self.sites)

    @property
    def site_size(self) -> int:
        return int(self.shape.numel())

    @property
    def state_dim(self) -> int:
        return self.levels * self.site_dim

    def transition(self, like: torch.Tensor) -> torch.Tensor:
        """``L (x) I_m``, ``(d, d)``."""
        ones = torch.ones(self.levels, self.levels, dtype=like.dtype, device=like.device)
        eye = torch.eye(self.site_dim, dtype=like.dtype, device=like.device)
        return torch.kron(torch.tril(ones), eye)

    def layout(self, v: torch.Tensor) -> torch.Tensor:
        """Flat values ``(..., k D1)`` (the sites concatenated) as ``(..., T, d)``."""
        lead = v.shape[:-1]
        parts = v.split(self.site_size, -1)
        one = super().layout
        return torch.cat([one(p.reshape(lead + self.shape)) for p in parts], -1)

    def unlayout(self, v: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`layout`: ``(..., T, d) -> (..., k D1)``."""
        one = super().unlayout
        return torch.cat([one(p) for p in v.split(self.site_dim, -1)], -1)

    def _split(self, v: torch.Tensor) -> torch.Tensor:
        return v.reshape(v.shape[:-1] + (self.levels, self.site_dim))

    def states(self, z: torch.Tensor) -> torch.Tensor:
        """``x (..., T, d)`` from the flat increments ``z (..., k D1)``: the nested cumsums
        ``z^j``, then ``b^j = z^j - z^(j-1)``."""
        e = self._split(self.layout(z))  # (..., T, k, m)
        zs, prev = [], None
        for j in range(self.levels):
            cur = e[..., j, :] if prev is None else prev + e[..., j, :]
            prev = cur.cumsum(-2)
            zs.append(prev)
        z_all = torch.stack(zs, -2)
        b = torch.cat([z_all[..., :1, :], z_all.diff(dim=-2)], -2)
        return b.reshape(b.shape[:-2] + (self.state_dim,))

    def increments(self, x: torch.Tensor) -> torch.Tensor:
        """``e_t = x_t - L x_(t-1)`` (``x_(-1) = 0``), flat ``(..., k D1)``."""
        z = self._split(x).cumsum(-2)  # (..., T, k, m): (L x_t) per level
        prev = z.reshape(z.shape[:-2] + (self.state_dim,))[..., :-1, :]
        e = torch.cat([x[..., :1, :], x[..., 1:, :] - prev], -2)
        return self.unlayout(e)

    def variance(self, cov: torch.Tensor, cross: torch.Tensor) -> torch.Tensor:
        """``Var(e)`` flat: ``Var(e_t) = S_t - L X_t' - X_t L' + L S_(t-1) L'`` (diagonals)."""
        L = self.transition(cov)
        C = cov[1:] - L @ cross.mT - cross @ L.mT + L @ cov[:-1] @ L.mT
        rest = C.diagonal(dim1=-2, dim2=-1)
        return self.unlayout(torch.cat([cov[:1].diagonal(dim1=-2, dim2=-1), rest], 0))

    def prior(self, bases) -> LinearGaussianChain:
        """The chain of independent Normal increments ``e^j ~ Normal(mu^j, s^j)`` (``bases``,
        in ``sites`` order): ``A = L (x) I_m``, ``b_t = mu_t``, ``Q_t = diag s_t^2``,
        ``m0 = mu_0``, ``P0 = diag s_0^2`` (``mu_t``, ``s_t``: the levels' stacked)."""
        loc = self.layout(torch.cat([b.loc.expand(self.shape).reshape(-1) for b in bases]))
        var = self.layout(torch.cat([(b.scale**2).expand(self.shape).reshape(-1) for b in bases]))
        T, d = loc.shape
        A = self.transition(loc).expand(T - 1, d, d)
        return LinearGaussianChain(
            loc[0], torch.diag(var[0]), A, loc[1:], torch.diag_embed(var[1:])
        )

    def rows(self, flat: torch.Tensor, xs, create_graph: bool = False):
        """``(t_r, h_r)`` of ``flat`` read on the sites' leaves ``xs`` (as
        :func:`~pyro_cvi.statespace.detect.observation_rows`: JVPs along state directions
        lifted to the sites, ``e = x_t - L x_(t-1)``; a random JVP confirms one step per
        element), or ``ValueError``."""
        T, d = self.length, self.state_dim
        sizes = [x.numel() for x in xs]

        def sites(flat_e):
            return [p.reshape(x.shape) for p, x in zip(flat_e.split(sizes, -1), xs)]

        def lift(dx):
            return sites(self.increments(dx))

        def paired(vs, ls):
            terms = [(v * w).sum() for v, w in zip(vs, ls) if v is not None]
            if not terms:
                raise ValueError("no element reads the walk")
            return sum(terms[1:], terms[0])

        g0 = torch.autograd.grad(flat[0], xs, retain_graph=True, allow_unused=True)
        dx0 = xs[0].new_zeros(T, d, requires_grad=True)
        with torch.enable_grad():
            gd = [g.detach() if g is not None else None for g in g0]
            (gs,) = torch.autograd.grad(paired(gd, lift(dx0)), dx0, allow_unused=True)
        if gs is not None and bool(torch.isfinite(gs).all()):  # (an early refusal)
            per_step = gs.abs().amax(-1)
            floor = 100.0 * probes.rtol(dx0.dtype) * (1.0 + float(per_step.max()))
            if int((per_step > floor).sum()) >= 2:
                raise ValueError("an element depends on more than one step")
        u = torch.zeros_like(flat, requires_grad=True)
        vjps = torch.autograd.grad((flat * u).sum(), xs, create_graph=True, allow_unused=True)

        def jvp(dx, graph=False, moved=None):
            moved = lift(dx) if moved is None else moved
            (out,) = torch.autograd.grad(
                paired(vjps, moved), u, retain_graph=True, create_graph=graph
            )
            return out if graph else out.detach()

        eye = torch.eye(d, dtype=dx0.dtype, device=dx0.device)
        H = torch.stack([jvp(eye[k].expand(T, d), create_graph) for k in range(d)], -1)
        g = torch.Generator().manual_seed(3)
        weights = torch.rand(d, generator=g, dtype=dx0.dtype, device=g.device).to(dx0) + 0.5
        steps = torch.arange(1, T + 1, dtype=dx0.dtype, device=dx0.device)[:, None] * weights
        denom = H.detach() @ weights
        ratio = jvp(steps) / torch.where(denom == 0, torch.ones_like(denom), denom)
        t = torch.where(denom == 0, torch.zeros_like(ratio), ratio - 1).round().long()
        t = t.clamp(0, T - 1)
        # the check moves the increments (a random direction of the states would move them by
        # differences that the nested cumsums cancel again: T^1.5 rounding in float32)
        g = torch.Generator().manual_seed(5)
        de = torch.randn(T * d, generator=g, dtype=dx0.dtype, device=g.device).to(dx0)
        found = jvp(None, moved=sites(de))
        if not probes.close(
            found, (H.detach() * self.states(de)[t]).sum(-1), probes.rtol(de.dtype)
        ):
            raise ValueError("an element depends on more than one step")
        return t, H
