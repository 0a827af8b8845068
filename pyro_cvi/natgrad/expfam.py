"""CVI's mirror-descent step for the Gamma, Beta and Dirichlet sites of a Pyro guide.

With natural parameters ``lam`` and mean parameters ``mu`` of ``q`` (:mod:`pyro_cvi.families`),
the loss ``l = -L`` and its gradient ``dl/dtheta`` in the distribution's own parameters
``theta`` (``theta`` is affine in ``lam``), the step (Khan & Lin 2017, eq. 12, Appendix F) is::

    dl/dlam = (dtheta/dlam)^T dl/dtheta,     dl/dmu = F(lam)^-1 dl/dlam      (eq. 72)
    lam'    = lam - b dl/dmu

(a natural-gradient step in ``lam``; exact in one step at ``b = 1`` on a conjugate model
with exact gradients). ``b`` is halved per batch element until ``lam'`` is in the family's
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
from typing import Callable, Dict, Optional, Tuple

import torch

from ..families import Beta, Dirichlet, Gamma
from ..families.base import ExponentialFamily
from ..gaussian.halving import MAX_HALVINGS, halve_until_valid

__all__ = ["CONCENTRATION_FAMILIES", "MAX_FACTOR", "concentration_step"]

#: the adaptive step changes a concentration by at most this factor per step
MAX_FACTOR = 10.0

Thetas = Tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class _Form:
    roles: Tuple[str, ...]
    signs: Tuple[float, ...]  # theta_k = sign_k * (lam_k + shift_k)
    shifts: Tuple[float, ...]
    family: Callable[[torch.Size], ExponentialFamily]
    event_dims: int

    def natural(self, theta: Thetas) -> Thetas:
        return tuple(s * t - c for s, c, t in zip(self.signs, self.shifts, theta))

    def theta(self, lam: Thetas) -> Thetas:
        return tuple(s * (n + c) for s, c, n in zip(self.signs, self.shifts, lam))

    def grad(self, g: Thetas) -> Thetas:
        return tuple(s * x for s, x in zip(self.signs, g))


CONCENTRATION_FAMILIES: Dict[str, _Form] = {
    "gamma": _Form(("concentration", "rate"), (1.0, -1.0), (1.0, 0.0), lambda e: Gamma(()), 0),
    "beta": _Form(
        ("concentration1", "concentration0"), (1.0, 1.0), (1.0, 1.0), lambda e: Beta(()), 0
    ),
    "dirichlet": _Form(("concentration",), (1.0,), (1.0,), lambda e: Dirichlet(e), 1),
}


def concentration_step(
    kind: str,
    theta: Dict[str, torch.Tensor],
    grads: Dict[str, torch.Tensor],
    beta: float,
    max_factor: Optional[float] = None,
) -> Tuple[Dict[str, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]:
    """One mirror-descent step of a Gamma/Beta/Dirichlet ``q`` from ``dl/dtheta``.

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
