"""A Poisson over a sum of products of Gamma latents, through multinomial allocations.

The factor ``y_r ~ Poisson(sum_t c_t z_{i_t} w_{j_t})`` (``c_t >= 0`` fixed: Poisson
factorisation's ``Poisson(z @ w)``, the sparse gamma DEF's bottom layer) is the marginal of
``y_r = sum_{t in r} s_t``, ``s_t ~ Poisson(c_t z_{i_t} w_{j_t})``. Under a mean field that
adds ``q(s_r) = Multinomial(y_r, phi_r)``, every factor is conjugate:

    phi_t ∝ c_t exp(E[log z_{i_t}] + E[log w_{j_t}])          (the allocations' optimal q)
    z_i:  shape - 1 += sum_{t: i_t = i} y_{r_t} phi_t,   -rate += -sum_{t: i_t = i} c_t E[w_{j_t}]

(and alike for ``w``): the exact expected natural parameter of the augmented factor (eq. 20).
Its ELBO term, with the allocations' entropy, at the optimal ``phi``:

    sum_r [ y_r log sum_{t in r} c_t exp(E log z + E log w) - log y_r! ] - sum_t c_t E z E w,

a lower bound of ``E_q[log p(y | z, w)]`` (Jensen), so the reported bound stays a true
``-ELBO`` (of the augmented ``q``) above ``-log Z``.

The terms are found once by probing the model: the rate's Jacobian in ``z`` at a few random
``w`` gives each ``c_t`` (it is linear in ``w``), and the bilinear form is confirmed at fresh
random points; a rate with any other term, a negative coefficient, or a graph to the model's
parameters is not this kind.

The kind is not registered by default: its bound is the augmented ``-ELBO``, looser than the
plain ``-ELBO`` of the same ``q`` (by the allocations' Jensen gap: 4.3 nats on the tests'
small factorisation), so the reported loss is not Trace_ELBO's estimate of the guide, and on
Poisson factorisation its fixed point ends 1.5 nats worse on the plain bound than CVI's Monte
Carlo messages. Opt in with ``register_augmented_kind(PoissonAllocation())`` (and
``unregister_augmented_kind`` to leave).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Set, Tuple

import torch

from ..families.gamma import Gamma
from ..model import probes
from ..model.tracing import unwrap
from .expected_natural import _weight

__all__ = ["PoissonAllocation"]

#: the largest ``R * I * J`` (rate elements times the two latents' sizes) probed densely
MAX_PROBED = 5e7


@dataclass
class AllocationPlan:
    """The terms ``c_t z_{i_t} w_{j_t}`` of rate element ``r_t`` (flat indices)."""

    site: str
    z: str
    w: str
    r: torch.Tensor
    i: torch.Tensor
    j: torch.Tensor
    log_c: torch.Tensor
    c: torch.Tensor
    num_rates: int


def _rate_of(an, site: str, values: Dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
    base = unwrap(an.run(**values).nodes[site]["fn"])[0]
    return base.rate if isinstance(base, torch.distributions.Poisson) else None


def _jacobian(an, site: str, z: str, zv: torch.Tensor, values) -> Optional[torch.Tensor]:
    """``d rate / d z`` (R x I) at ``values``."""
    with torch.enable_grad():
        leaf = zv.detach().clone().requires_grad_(True)
        rate = _rate_of(an, site, {**values, z: leaf})
        if rate is None or not rate.requires_grad:
            return None
        r = rate.reshape(-1)
        eye = torch.eye(r.numel(), dtype=r.dtype, device=r.device)
        (g,) = torch.autograd.grad(r, leaf, eye, is_grads_batched=True, allow_unused=True)
    return None if g is None else g.reshape(r.numel(), -1)


def _positive(like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    u = torch.rand(like.shape, generator=gen, dtype=torch.float64, device=gen.device)
    return (0.5 + 1.5 * u).to(like)


class PoissonAllocation:
    """The augmented factor kind of the module docstring."""

    name = "Poisson allocation"

    def detect(self, an, spec, families) -> Optional[AllocationPlan]:
        if spec.exact or spec.collapsed or spec.discrete or spec.value_kind != "observed":
            return None
        lat = sorted(spec.continuous)
        if len(lat) != 2 or not all(isinstance(families.get(n), Gamma) for n in lat):
            return None
        if an.minibatch_plate(spec.site) is not None or not _conjugate_otherwise(an, spec, lat):
            return None
        tr, leaves = an.leaf_trace()
        node = tr.nodes[spec.site]
        base = unwrap(node["fn"])[0]
        if not isinstance(base, torch.distributions.Poisson) or base.rate.shape != base.batch_shape:
            return None
        params = [s["value"] for s in tr.nodes.values() if s["type"] == "param"]
        if params and base.rate.requires_grad:
            with torch.enable_grad():
                gs = torch.autograd.grad(
                    base.rate.sum(), params, allow_unused=True, retain_graph=True
                )
            if any(g is not None for g in gs):
                return None  # coefficients that move with the parameters
        ref = {n: an.ref[n] for n in lat}
        return self._terms(an, spec.site, lat, ref)

    def _terms(self, an, site: str, lat, ref) -> Optional[AllocationPlan]:
        zname, wname = lat
        R, I, J = _rate_numel(an, site, ref), ref[zname].numel(), ref[wname].numel()
        if R == 0 or R * I * J > MAX_PROBED:
            return None
        gen = torch.Generator().manual_seed(0)
        zv = ref[zname]
        # which w each rate element reads: the rate's Jacobian in w at a random z
        wgrad = _jacobian(an, site, wname, _positive(ref[wname], gen), {zname: _positive(zv, gen)})
        if wgrad is None:
            return None
        pattern_w = wgrad != 0  # (R, J)
        m = int(pattern_w.sum(1).max()) if R else 0
        if m == 0:
            return None
        # Jz(w)[r, i] = sum_j C_rij w_j: linear in w; its values at m + 2 random w
        S = m + 2
        ws = [_positive(ref[wname], gen) for _ in range(S)]
        jz = []
        for wv in ws:
            g = _jacobian(an, site, zname, _positive(zv, gen), {wname: wv})
            if g is None:
                return None
            jz.append(g)
        Y = torch.stack(jz, 1).to(torch.float64)  # (R, S, I)
        Wf = torch.stack([wv.reshape(-1) for wv in ws], 0).to(torch.float64)  # (S, J)
        # per rate element: the columns of the w it reads (zero padding: min-norm solve)
        order = torch.sort((~pattern_w).to(torch.int8), dim=1, stable=True).indices[:, :m]
        valid = torch.gather(pattern_w, 1, order)  # (R, m)
        X = Wf[:, order].permute(1, 0, 2) * valid[:, None, :]  # (R, S, m)
        coef = torch.linalg.lstsq(X, Y, driver="gelsd").solution  # (R, m, I)
        scale = coef.abs().amax().clamp_min(1e-300)
        keep = (coef.abs() > 1e-8 * scale) & valid[:, :, None]
        if bool((coef[keep] < -1e-8 * scale).any()):
            return None  # a negative term: not a sum of rates
        r, k, i = keep.nonzero(as_tuple=True)
        j = order[r, k]
        c = coef[r, k, i].clamp_min(0.0)
        plan = AllocationPlan(site, zname, wname, r, i, j, c.log().to(zv.dtype), c.to(zv.dtype), R)
        return plan if self._confirms(an, site, plan, ref, gen) else None

    def _confirms(self, an, site, plan, ref, gen) -> bool:
        """The bilinear form at fresh random points (no other term: no intercept, no
        linear-only part, no product the probe missed)."""
        for _ in range(2):
            zv, wv = _positive(ref[plan.z], gen), _positive(ref[plan.w], gen)
            with torch.no_grad():
                rate = _rate_of(an, site, {plan.z: zv, plan.w: wv})
            if rate is None:
                return False
            want = _rates(plan, zv.reshape(-1).log(), wv.reshape(-1).log())
            if not probes.close(rate.reshape(-1), want, probes.rtol(rate.dtype)):
                return False
        return True

    def describe(self, plan: AllocationPlan, latent: str) -> Tuple[str, str]:
        """``(kind, why)`` of the factor's message to ``latent`` for ``explain()``."""
        other = plan.w if latent == plan.z else plan.z
        why = (
            f"Poisson rate = sum of {plan.c.numel()} products {plan.z} * {plan.w} (probed): "
            f"multinomial allocations, exact Gamma message given E[log {other}], E[{other}] "
            "(eq. 20 on the augmented model)"
        )
        return "conjugate (alloc)", why

    def messages(
        self, plan: AllocationPlan, trace, q, want: Set[str]
    ) -> Tuple[torch.Tensor, Dict[str, Tuple[torch.Tensor, ...]]]:
        """The factor's augmented ELBO term and its messages to the latents in ``want``."""
        node = trace.nodes[plan.site]
        fn = node["fn"]
        base = unwrap(fn)[0]
        full = fn.batch_shape + fn.event_shape[: fn.event_dim - base.event_dim]
        y = torch.broadcast_to(node["value"], full).reshape(-1).detach()
        wt = _weight(node, full).to(y).reshape(-1)
        elz, ez = (t.detach().reshape(-1) for t in q.mu[plan.z])
        elw, ew = (t.detach().reshape(-1) for t in q.mu[plan.w])
        a = plan.log_c + elz[plan.i] + elw[plan.j]
        top = torch.full((plan.num_rates,), -torch.inf, dtype=a.dtype, device=a.device)
        top = top.scatter_reduce(0, plan.r, a, "amax", include_self=True)
        e = torch.exp(a - top[plan.r])
        tot = torch.zeros_like(top).index_add_(0, plan.r, e)
        lse = top + tot.log()
        phi = e / tot[plan.r]
        counts = (wt * y)[plan.r] * phi  # expected allocations, weighted
        cw = wt[plan.r] * plan.c
        used = tot > 0
        fit = torch.where(used, wt * (y * lse.where(used, 0.0)), 0.0)
        elbo = (fit - wt * torch.lgamma(y + 1)).sum() - (cw * ez[plan.i] * ew[plan.j]).sum()
        out = {}
        for name, idx, other, size in (
            (plan.z, plan.i, ew[plan.j], elz.numel()),
            (plan.w, plan.j, ez[plan.i], elw.numel()),
        ):
            if name not in want:
                continue
            shape = torch.zeros(size, dtype=a.dtype, device=a.device).index_add_(0, idx, counts)
            rate = torch.zeros_like(shape).index_add_(0, idx, cw * other)
            mu = q.mu[name]
            out[name] = (shape.reshape(mu[0].shape), -rate.reshape(mu[1].shape))
        return elbo, out


def _conjugate_otherwise(an, spec, lat) -> bool:
    """Whether every other factor of the two latents is exact, so that their whole update is
    coordinate ascent on the augmented bound. Beside non-conjugate neighbours (the sparse
    gamma DEF's ``Gamma(a, b / (z @ w))`` layers) the augmented bound's coordinate steps
    were measured to fit worse from the default start than the factor's Monte Carlo
    gradient (``scripts/zoo_record.py --models sparse_gamma_def``), so the kind stays out."""
    for site in an.owner:
        if site == spec.site:
            continue
        other = an.spec(site)
        if other.latents & set(lat) and not other.exact:
            return False
    return True


def _rate_numel(an, site: str, ref) -> int:
    with torch.no_grad():
        rate = _rate_of(an, site, ref)
    return 0 if rate is None else rate.numel()


def _rates(plan: AllocationPlan, logz: torch.Tensor, logw: torch.Tensor) -> torch.Tensor:
    terms = plan.c * torch.exp(logz[plan.i] + logw[plan.j])
    return torch.zeros(plan.num_rates, dtype=terms.dtype, device=terms.device).index_add_(
        0, plan.r, terms
    )
