"""Automatic conjugacy detection from model traces.

Every factor of the model (the prior of a latent site, or any sample site whose distribution
depends on it) is classified, for each latent site ``z`` it touches, as one of

* ``conjugate``: ``log p`` is linear in ``q(z)``'s sufficient statistics, so its natural-parameter
  message is exact (eq. 2). Recognised: a Normal / MultivariateNormal prior of a Gaussian ``z``;
  a Normal likelihood whose ``loc`` is affine in ``z`` and whose ``scale`` does not depend on ``z``.
* ``linear-predictor``: the factor depends on a Gaussian ``z`` only through ``eta = A z + c``
  (``logits``, ``log(rate)`` or ``loc`` of a registered likelihood), so it gets one
  ``(lam1, lam2)`` site per element of ``eta`` (Appendix E.1).
* ``general``: anything else; its message is a stochastic estimate of ``grad_mu E_q[log p]``.
* ``leaf``: a latent site that no other site depends on. Its ``q`` is its conditional prior
  ``p(x | parents)``, which integrates it out exactly; it sends no message.

Detection is sound, not pattern matching alone: the dependence structure comes from autograd
through a trace with the latent values as leaves, and every affine pattern is confirmed by
probing the model at random points and comparing with the Jacobian ``A`` (computed once, by
batched vector-Jacobian products).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set

import torch

from .tracing import is_random, linear_param, trace_model, unwrap

__all__ = ["Factor", "classify", "dependencies", "jacobian", "check_affine"]

CONJUGATE = "conjugate"
LINEAR = "linear-predictor"
GENERAL = "general"
LEAF = "leaf"
PRIOR = "conjugate prior"


@dataclass
class Factor:
    """One (factor site, latent site) pair and how CVI treats it."""

    site: str
    latent: str
    kind: str
    reason: str
    param: Optional[str] = None
    jacobian: Optional[torch.Tensor] = None  # (R, D): d link(param) / d z, flattened
    dynamic: bool = False  # the Jacobian depends on learnable parameters: recompute each step
    extra: Dict = field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.site:>20s} -> {self.latent:<12s} {self.kind:<17s} {self.reason}"


def _float_params(fn) -> List[torch.Tensor]:
    base, mask, _ = unwrap(fn)
    out = []
    for name in getattr(base, "arg_constraints", {}):
        try:
            v = getattr(base, name)
        except Exception:  # lazy parameters that cannot be computed
            continue
        if torch.is_tensor(v) and v.is_floating_point():
            out.append(v)
    return out


def dependencies(
    model: Callable, values: Dict[str, torch.Tensor], args, kwargs
) -> Dict[str, Set[str]]:
    """For each sample site, the set of latent sites its distribution depends on.

    Found by autograd: the latent values are leaves that require grad, and a latent is a
    dependency of a site when the gradient of the site's parameters with respect to it is not
    identically absent. This is structural (exact), not numeric.
    """
    # discrete latents cannot be autograd leaves: their dependants are found by enumeration
    # (pyro_cvi.meanfield.discrete_dependencies); here they are held at their values
    leaves = {
        k: v.detach().clone().requires_grad_(True)
        for k, v in values.items()
        if v.is_floating_point()
    }
    fixed = {k: v for k, v in values.items() if k not in leaves}
    with torch.enable_grad():
        tr = trace_model(model, {**fixed, **leaves}, args, kwargs)
        names = list(leaves)
        deps: Dict[str, Set[str]] = {}
        for name, site in tr.nodes.items():
            if not is_random(site):
                continue
            params = [p for p in _float_params(site["fn"]) if p.requires_grad]
            deps[name] = set()
            if not params:
                continue
            total = sum((p * torch.randn_like(p)).sum() for p in params)
            grads = torch.autograd.grad(
                total, [leaves[n] for n in names], allow_unused=True, retain_graph=True
            )
            deps[name] = {n for n, g in zip(names, grads) if g is not None}
    return deps


def _linked(tr, site_name):
    base, mask, ndims = unwrap(tr.nodes[site_name]["fn"])
    lp = linear_param(base)
    if lp is None:
        return None
    return lp


def jacobian(
    out: torch.Tensor, z: torch.Tensor, chunk: int = 512, loop_below: int = 200
) -> torch.Tensor:
    """Dense Jacobian ``d out / d z`` of shape ``(out.numel(), z.numel())``.

    Reverse mode with batched vector-Jacobian products when ``out`` is the smaller side,
    otherwise reverse-of-reverse (a batched Jacobian of the linear map ``v -> A^T v``).
    """
    R, D = out.numel(), z.numel()
    flat = out.reshape(-1)
    rows = []
    if min(R, D) <= loop_below:  # plain backward passes: no vmap (and no torch.fx import)
        if R <= D:
            for i in range(R):
                (g,) = torch.autograd.grad(flat[i], z, retain_graph=True)
                rows.append(g.reshape(-1))
            return torch.stack(rows, 0)
        v = torch.zeros(R, dtype=out.dtype, device=out.device, requires_grad=True)
        (atv,) = torch.autograd.grad(flat, z, v, retain_graph=True, create_graph=True)
        atv = atv.reshape(-1)
        for j in range(D):
            (g,) = torch.autograd.grad(atv[j], v, retain_graph=True)
            rows.append(g)
        return torch.stack(rows, 1)
    if R <= D:
        eye = torch.eye(R, dtype=out.dtype, device=out.device)
        for i in range(0, R, chunk):
            (g,) = torch.autograd.grad(
                flat, z, eye[i : i + chunk], retain_graph=True, is_grads_batched=True
            )
            rows.append(g.reshape(-1, D))
        return torch.cat(rows, 0)
    v = torch.zeros(R, dtype=out.dtype, device=out.device, requires_grad=True)
    (atv,) = torch.autograd.grad(flat, z, v, retain_graph=True, create_graph=True)
    atv = atv.reshape(-1)
    eye = torch.eye(D, dtype=out.dtype, device=out.device)
    for i in range(0, D, chunk):
        (g,) = torch.autograd.grad(
            atv, v, eye[i : i + chunk], retain_graph=True, is_grads_batched=True
        )
        rows.append(g)
    return torch.cat(rows, 0).T.contiguous()


def check_affine(
    fn_of_z: Callable[[torch.Tensor], torch.Tensor],
    z0: torch.Tensor,
    A: torch.Tensor,
    scale: torch.Tensor,
    num_probes: int = 2,
    rtol: float = 1e-5,
) -> bool:
    """Probe ``fn_of_z`` at random points and confirm ``fn(z) = fn(z0) + A (z - z0)``."""
    with torch.no_grad():
        p0 = fn_of_z(z0).reshape(-1)
        for _ in range(num_probes):
            dz = torch.randn_like(z0) * scale
            p = fn_of_z(z0 + dz).reshape(-1)
            pred = p0 + A @ dz.reshape(-1)
            tol = rtol * (1.0 + p.abs().max() + pred.abs().max())
            if not torch.isfinite(p).all() or (p - pred).abs().max() > tol:
                return False
    return True


def _rtol(dtype):
    return 1e-4 if dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-7


def classify(
    model: Callable,
    values: Dict[str, torch.Tensor],
    args,
    kwargs,
    gaussian: Set[str],
    deps: Dict[str, Set[str]],
    leaves: Set[str],
    latent_names: List[str],
    analyzer=None,
) -> List[Factor]:
    """Classify every (factor, latent) pair. ``gaussian`` names the latents with a Gaussian q.

    ``analyzer`` (a :class:`pyro_cvi.meanfield.Analysis`) classifies the pairs of non-Gaussian
    latents and of factors with several latents (conditionally conjugate pairs, eq. 18-20).
    """
    factors: List[Factor] = []
    for site_name, site_deps in deps.items():
        for z in latent_names:
            if z in leaves:
                if site_name == z:
                    reason = "no site depends on it: q is its conditional prior (exact)"
                    factors.append(Factor(site_name, z, LEAF, reason))
                continue
            if site_name in leaves:
                continue  # a leaf's prior integrates to one: it sends no message
            if (
                analyzer is not None
                and (site_name == z or z in site_deps)
                and (
                    z not in gaussian or len(site_deps - {z}) > 0 or (site_name == z and site_deps)
                )
            ):
                # non-Gaussian q, or a factor shared with other latents: mean-field analysis
                factors.append(analyzer.factor(site_name, z))
            elif site_name == z:
                factors.append(_classify_prior(values, args, kwargs, model, z, site_deps, gaussian))
            elif z in site_deps:
                factors.append(
                    _classify_factor(model, values, args, kwargs, site_name, z, site_deps, gaussian)
                )
    return factors


def _classify_prior(values, args, kwargs, model, z, site_deps, gaussian) -> Factor:
    tr = trace_model(model, values, args, kwargs)
    base, _, _ = unwrap(tr.nodes[z]["fn"])
    if site_deps:
        others = ", ".join(sorted(site_deps))
        return Factor(z, z, GENERAL, f"prior parameters depend on latent {others}")
    if z in gaussian and isinstance(
        base, (torch.distributions.Normal, torch.distributions.MultivariateNormal)
    ):
        return Factor(z, z, PRIOR, f"{type(base).__name__} prior of a Gaussian q (eq. 2)")
    if z in gaussian:
        return Factor(z, z, GENERAL, f"{type(base).__name__} prior is not Gaussian")
    return Factor(z, z, PRIOR, f"{type(base).__name__} prior (same family as q: exact)")


def _classify_factor(model, values, args, kwargs, site_name, z, site_deps, gaussian) -> Factor:
    if len(site_deps) > 1:
        others = ", ".join(sorted(site_deps - {z}))
        return Factor(site_name, z, GENERAL, f"also depends on latent {others}")
    tr0 = trace_model(model, values, args, kwargs)
    base, _, _ = unwrap(tr0.nodes[site_name]["fn"])
    kind_name = type(base).__name__
    if z not in gaussian:
        return Factor(site_name, z, GENERAL, f"{kind_name} factor of a non-Gaussian q")
    if _linked(tr0, site_name) is None:
        return Factor(site_name, z, GENERAL, f"{kind_name} is not a registered likelihood")
    # which parameters depend on z, and is the linear one affine?
    z0 = values[z].detach().clone().requires_grad_(True)
    with torch.enable_grad():
        tr = trace_model(model, {**values, z: z0}, args, kwargs)
        name, value, others = _linked(tr, site_name)
        for oname, ov in others.items():
            if torch.is_tensor(ov) and ov.requires_grad:
                (g,) = torch.autograd.grad(ov.sum(), z0, allow_unused=True, retain_graph=True)
                if g is not None:
                    return Factor(site_name, z, GENERAL, f"{kind_name} {oname} depends on {z}")
        if not value.requires_grad:
            return Factor(site_name, z, GENERAL, f"{kind_name} {name} does not depend on {z}")
        A = jacobian(value, z0).detach()
        params = [s["value"] for s in tr.nodes.values() if s["type"] == "param"]
        dynamic = _depends_on_params(value, z0, params)

    def probe(zv):
        t = trace_model(model, {**values, z: zv}, args, kwargs)
        return _linked(t, site_name)[1]

    scale = values[z].detach().abs().mean().clamp_min(1.0)
    link = "log(rate)" if name == "rate" else name
    if not check_affine(probe, values[z].detach(), A, scale, rtol=_rtol(A.dtype)):
        return Factor(site_name, z, GENERAL, f"{kind_name} {link} is not affine in {z} (probed)")
    R, D = A.shape
    if isinstance(base, torch.distributions.Normal) and name == "loc":
        reason = f"Normal loc affine in {z} (probed, A: {R}x{D}), scale free of {z}"
        return Factor(site_name, z, CONJUGATE, reason, name, A, dynamic)
    reason = f"{kind_name} {link} = A {z} + c (probed, A: {R}x{D}); {R} sites"
    return Factor(site_name, z, LINEAR, reason, name, A, dynamic)


def _depends_on_params(value: torch.Tensor, z0: torch.Tensor, params) -> bool:
    """Whether ``d value / d z`` depends on any of the model's learnable ``params``."""
    params = [p for p in params if torch.is_tensor(p) and p.requires_grad]
    if not params:
        return False
    (g,) = torch.autograd.grad(
        value, z0, torch.randn_like(value), retain_graph=True, create_graph=True
    )
    if not g.requires_grad:
        return False
    grads = torch.autograd.grad(g.sum(), params, allow_unused=True, retain_graph=True)
    return any(x is not None for x in grads)
