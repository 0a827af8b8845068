"""Mean-field CVI (Algorithm 2 of Khan & Lin, 2017): VMP messages plus stochastic ones.

For a mean-field ``q(z) = prod_i q_i(z_i | lambda_i)`` with exponential-family factors, the
ELBO restricted to ``mu_i`` is (eq. 80)

    L(mu_i) = sum_a E_q[log p~_nc^{a,i}] + < mu_i, sum_a eta~_{a,i} - lambda_i > + A_i(lambda_i)

and one step of Algorithm 2 is

    lambda~_i = sum_{a in N_i} [ eta~_{a,i} + grad_{mu_i} E_q[log p~_nc^{a,i}] ]     (step 4)
    lambda_i <- (1 - beta) lambda_i + beta lambda~_i                               (step 5)

with the conjugate messages ``eta~_{a,i} = E_{q/i}[eta_{a,i}(x_{a/i})]`` (eq. 20). Both kinds are
``grad_{mu_i} E_q[log p_a]`` (eq. 89), which is how they are computed here:

* **exact factors** (every latent of the factor in a conjugate role, see
  :mod:`pyro_cvi.conjugate_pairs`): ``E_q[log p_a]`` is built in closed form as a differentiable
  function of the mean parameters (model runs at ``E z`` and ``exp(E log z)``, Jacobians of
  affine Gaussian parameters, and exact enumeration of discrete latents weighted by their
  ``q`` probabilities). Autograd of it with respect to ``mu_i`` *is* the VMP message (it is
  multilinear in the ``mu``'s), so with no other factor and ``beta = 1`` a step is CAVI.
* **general factors**: a Monte Carlo estimate of ``grad_mu E_q[log p_a]`` by implicit
  reparameterisation (``rsample``) with respect to ``lambda`` followed by a Fisher solve
  ``F^{-1} grad_lambda`` (Appendix F, eq. 72); discrete latents are still enumerated.

Schedules. ``parallel``: every site is updated from the same ``q_t``. ``sequential``: sites are
updated one after another (coordinate ascent; with ``beta = 1`` and exact factors each update
is the CAVI update, so the ELBO never decreases). Inside ``pyro.plate(..., subsample_size=B)``
(doubly stochastic, Hoffman et al. 2013), the sites of the subsampled plate (*local* sites)
first get a full update (``beta = 1``) for the minibatch, then the *global* sites take the
step with the minibatch messages, which Pyro scales by ``N / B``: the SVI update
``lambda <- (1 - beta) lambda + beta (eta + (N/B) sum_{n in batch} E_q[t(x_n, z_n)])``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
import torch.nn.functional as F
from pyro.distributions.util import scale_and_mask
from pyro.infer.enum import config_enumerate

from . import conjugacy as cj
from . import conjugate_pairs as cp
from .families import fisher_solve_mean_grad
from .families.base import sum_rightmost, x_trigamma_minus_one
from .tracing import is_random, trace_model, unwrap

__all__ = [
    "FactorSpec",
    "Analysis",
    "run_model",
    "max_plate_nesting",
    "discrete_dependencies",
    "compute",
    "sweep",
    "natural_step",
]

DISCRETE = ("categorical", "bernoulli")
GAUSS = ("gaussian", "gaussian_diag")


# ------------------------------------------------------------------------------------------------
# running the model
# ------------------------------------------------------------------------------------------------
def max_plate_nesting(trace) -> int:
    """The number of batch dims used by vectorised plates (enumeration goes left of them)."""
    dims = [
        -f.dim
        for s in trace.nodes.values()
        if s["type"] == "sample"
        for f in s["cond_indep_stack"]
        if f.vectorized and f.dim is not None
    ]
    return max(dims, default=0)


def run_model(model, values: Dict[str, torch.Tensor], args, kwargs, enum_dims: Optional[int]):
    """Trace ``model`` with ``values`` conditioned; discrete latents left free are enumerated in
    parallel left of ``enum_dims`` plate dims (``None``: no enumeration)."""
    if enum_dims is None:
        return trace_model(model, values, args, kwargs)
    fn = poutine.condition(model, data=values) if values else model
    fn = poutine.enum(config_enumerate(fn, default="parallel"), first_available_dim=-1 - enum_dims)
    return poutine.trace(fn).get_trace(*args, **kwargs)


def subsample_values(trace) -> Dict[str, torch.Tensor]:
    """The subsample indices of every plate in a trace (to replay the same minibatch)."""
    return {
        n: s["value"]
        for n, s in trace.nodes.items()
        if s["type"] == "sample" and not is_random(s) and type(s["fn"]).__name__ == "_Subsample"
    }


def discrete_dependencies(trace, discrete: Iterable[str]) -> Dict[str, Set[str]]:
    """For each sample site of an *enumerated* trace, the discrete latents it depends on.

    A site depends on discrete latent ``c`` exactly when its distribution's batch shape carries
    ``c``'s enumeration dim (parallel enumeration broadcasts along it); this is structural.
    """
    dims = {}
    for c in discrete:
        d = trace.nodes[c]["infer"].get("_enumerate_dim")
        if d is not None:
            dims[c] = d
    out: Dict[str, Set[str]] = {}
    for name, site in trace.nodes.items():
        if not is_random(site):
            continue
        shape = site["fn"].batch_shape
        out[name] = {c for c, d in dims.items() if c != name and len(shape) >= -d and shape[d] > 1}
    return out


# ------------------------------------------------------------------------------------------------
# analysis of factors (which are exact)
# ------------------------------------------------------------------------------------------------
@dataclass
class FactorSpec:
    """How CVI treats one factor (sample site) of the model."""

    site: str
    exact: bool
    reason: str
    pattern: Optional[cp.Pattern] = None
    roles: Dict[str, cp.Role] = field(default_factory=dict)
    value_kind: str = "observed"  # observed | discrete | latent
    continuous: Set[str] = field(default_factory=set)  # continuous latents (incl. its value)
    discrete: Set[str] = field(default_factory=set)  # discrete latents (incl. its value)
    jacobians: Dict[str, torch.Tensor] = field(default_factory=dict)  # affine loc: (R, D)
    dynamic: bool = False  # an affine coefficient depends on learnable parameters
    cache: Dict = field(default_factory=dict, repr=False)  # Jacobians per data / minibatch

    @property
    def latents(self) -> Set[str]:
        return self.continuous | self.discrete


def _rtol(dtype) -> float:
    return 1e-3 if dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-7


class Analysis:
    """Classifies every factor of a model for mean-field CVI, by tracing and probing it.

    :param families: the q family of every non-leaf latent site.
    :param values: reference values of the latents (a prior draw).
    :param leaves: latent sites no factor depends on (conditioned, never enumerated).
    :param deps: site -> the latents its distribution depends on (continuous and discrete).
    """

    def __init__(self, model, values, args, kwargs, families, leaves, deps, enum_dims, subsample):
        self.model = model
        self.args, self.kwargs = args, kwargs
        self.families = families
        self.leaves = set(leaves)
        self.deps = deps
        self.discrete = {n for n, f in families.items() if f.name in DISCRETE}
        self.continuous = {n for n in families if n not in self.discrete}
        self.enum_dims = enum_dims if self.discrete else None
        self.subsample = dict(subsample)
        self.ref = {n: v.detach() for n, v in values.items() if n in self.continuous}
        self.fixed = {n: values[n].detach() for n in self.leaves if n in values}
        self.specs: Dict[str, FactorSpec] = {}
        self._leaf_trace = None

    # -- model runs ---------------------------------------------------------------------------
    def _values(self, **override):
        return {**self.fixed, **self.subsample, **self.ref, **override}

    def run(self, **override):
        return run_model(
            self.model, self._values(**override), self.args, self.kwargs, self.enum_dims
        )

    def leaf_trace(self):
        """A trace whose continuous latent values are autograd leaves (for dependencies)."""
        if self._leaf_trace is None:
            leaves = {
                n: v.clone().requires_grad_(True)
                for n, v in self.ref.items()
                if v.is_floating_point()
            }
            with torch.enable_grad():
                tr = run_model(
                    self.model, self._values(**leaves), self.args, self.kwargs, self.enum_dims
                )
            self._leaf_trace = (tr, leaves)
        return self._leaf_trace

    def _param_of(self, site_name, pattern, name):
        def f(**override):
            tr = self.run(**override)
            return pattern.read(unwrap(tr.nodes[site_name]["fn"])[0], name)

        return f

    # -- classification -----------------------------------------------------------------------
    def spec(self, site_name: str) -> FactorSpec:
        if site_name not in self.specs:
            self.specs[site_name] = self._analyze(site_name)
        return self.specs[site_name]

    def _analyze(self, site_name: str) -> FactorSpec:
        tr, leaves = self.leaf_trace()
        site = tr.nodes[site_name]
        deps = set(self.deps.get(site_name, set()))
        cont = {d for d in deps if d in self.continuous}
        disc = {d for d in deps if d in self.discrete}
        spec = FactorSpec(site_name, False, "", continuous=set(cont), discrete=set(disc))
        # (the latents are conditioned in analysis traces: decide by name, not is_observed)
        if site_name in self.discrete:
            spec.value_kind = "discrete"
            spec.discrete.add(site_name)
        elif site_name in self.continuous:
            spec.value_kind = "latent"
            spec.continuous.add(site_name)
        else:
            spec.value_kind = "observed"
        base = unwrap(site["fn"])[0]
        dname = type(base).__name__
        if not cont and spec.value_kind != "latent":
            spec.exact = True
            spec.reason = f"{dname} with no continuous latent parameter"
            if disc:
                spec.reason += f", enumerated over {', '.join(sorted(disc))}"
            return spec
        pattern = cp.lookup(base)
        if pattern is None:
            spec.reason = f"{dname} has no conjugate pattern"
            return spec
        spec.pattern = pattern
        if spec.value_kind == "latent":
            fam = self.families[site_name].name
            if fam not in pattern.value_families:
                spec.reason = f"{dname} density of a {fam} q"
                return spec
        if spec.value_kind == "discrete" and "discrete" not in pattern.value_families:
            spec.reason = f"{dname} of a discrete latent"
            return spec
        # dependencies of each parameter
        rtol = _rtol(next(iter(self.ref.values())).dtype if self.ref else torch.float64)
        covered: Set[str] = set()
        with torch.enable_grad():
            for name, (kinds, fams) in pattern.params.items():
                t = pattern.read(base, name)
                pdeps: Set[str] = set()
                if torch.is_tensor(t) and t.requires_grad:
                    names = [n for n in leaves]
                    grads = torch.autograd.grad(
                        (t * torch.randn_like(t)).sum(),
                        [leaves[n] for n in names],
                        allow_unused=True,
                        retain_graph=True,
                    )
                    pdeps = {n for n, g in zip(names, grads) if g is not None}
                covered |= pdeps
                role = self._role(site_name, pattern, name, t, pdeps, kinds, fams, rtol, spec)
                if isinstance(role, str):
                    spec.reason = f"{dname} {name} {role}"
                    return spec
                spec.roles[name] = role
        if cont - covered:
            spec.reason = f"{dname} depends on {', '.join(sorted(cont - covered))} otherwise"
            return spec
        parents = [set(r.parents) for r in spec.roles.values() if r.kind != cp.CONST]
        for i in range(len(parents)):
            for j in range(i + 1, len(parents)):
                if parents[i] & parents[j]:
                    both = ", ".join(sorted(parents[i] & parents[j]))
                    spec.reason = f"{dname}: {both} enters two parameters"
                    return spec
        spec.exact = True
        text = cp.roles_text(pattern, spec.roles)
        spec.reason = f"{dname} {text} (probed)" if text else f"{dname}"
        if disc:
            spec.reason += f", enumerated over {', '.join(sorted(disc))}"
        return spec

    def _role(self, site_name, pattern, name, t, pdeps, kinds, fams, rtol, spec):
        if not pdeps:
            return cp.Role(cp.CONST)
        pf = {p: self.families[p].name for p in pdeps}
        listed = ", ".join(f"{p} ({f})" for p, f in sorted(pf.items()))
        if cp.MONOMIAL in kinds and all(f == "gamma" for f in pf.values()):
            f = self._param_of(site_name, pattern, name)
            for p in sorted(pdeps):
                why = cp.check_monomial(lambda z, p=p: f(**{p: z}), self.ref[p], rtol)
                if why is not None:
                    return f"{why.replace('it', p)}"
            return cp.Role(cp.MONOMIAL, tuple(sorted(pdeps)))
        if cp.AFFINE in kinds and all(f in GAUSS for f in pf.values()):
            tr, leaves = self.leaf_trace()
            with torch.enable_grad():
                jac = {p: cj.jacobian(t, leaves[p]).detach() for p in sorted(pdeps)}
            f = self._param_of(site_name, pattern, name)
            with torch.no_grad():
                t0 = t.detach().reshape(-1)
                g = torch.Generator(device="cpu").manual_seed(7)
                for _ in range(2):
                    dz, pred = {}, t0.clone()
                    for p in pdeps:
                        z0 = self.ref[p]
                        s = z0.abs().mean().clamp_min(1.0)
                        d = torch.randn(z0.shape, generator=g, dtype=torch.float64)
                        dz[p] = z0 + (s * d).to(z0)
                        pred = pred + jac[p] @ (dz[p] - z0).reshape(-1)
                    got = f(**dz).reshape(-1)
                    if not cp._close(got, pred, rtol * 10):
                        return f"is not affine in {', '.join(sorted(pdeps))} (probed)"
            spec.jacobians.update(jac)
            params = [n["value"] for n in tr.nodes.values() if n["type"] == "param"]
            with torch.enable_grad():
                spec.dynamic = spec.dynamic or any(
                    cj._depends_on_params(t, leaves[p], params) for p in sorted(pdeps)
                )
            return cp.Role(cp.AFFINE, tuple(sorted(pdeps)))
        if cp.IDENTITY in kinds and len(pdeps) == 1:
            (p,) = pdeps
            if pf[p] in fams:
                vector = pf[p] == "dirichlet"
                z0 = self.ref[p]
                f = self._param_of(site_name, pattern, name)
                idx, why = cp.find_identity_index(
                    lambda z: f(**{p: z}), z0.shape, vector, z0.dtype, z0.device, rtol
                )
                if idx is None:
                    return f"{why}"
                return cp.Role(cp.IDENTITY, (p,), idx)
        return f"depends on {listed}: no conjugate pattern"

    # -- explain() ----------------------------------------------------------------------------
    def factor(self, site_name: str, z: str, site_form_ok: bool = True) -> cj.Factor:
        """The :class:`~pyro_cvi.conjugacy.Factor` for the pair (``site_name``, ``z``)."""
        spec = self.spec(site_name)
        fam = self.families[z]
        if not spec.exact:
            if fam.name in GAUSS and site_form_ok:
                how = "stochastic message (Bonnet/Price in the site form)"
            else:
                how = "Monte Carlo gradient (implicit reparameterisation + Fisher solve, App. F)"
            return cj.Factor(site_name, z, cj.GENERAL, f"{spec.reason}: non-conjugate; {how}")
        msg = f"exact {fam.name} message (eq. 20)"
        if z in self.discrete:
            K = getattr(fam, "num_categories", 2)
            if site_name == z:
                why = f"{spec.reason}: enumerated (K={K}), exact"
                return cj.Factor(
                    site_name, z, cj.PRIOR if not spec.latents - {z} else cj.CONJUGATE, why
                )
            return cj.Factor(site_name, z, cj.CONJUGATE, f"{spec.reason} (K={K}): {msg}")
        if site_name == z:
            others = spec.latents - {z}
            if not others:
                return cj.Factor(
                    site_name, z, cj.PRIOR, f"{spec.reason} prior (same family as q): exact"
                )
            return cj.Factor(
                site_name,
                z,
                cj.CONJUGATE,
                f"{spec.reason} prior given {', '.join(sorted(others))}: {msg}",
            )
        f = cj.Factor(site_name, z, cj.CONJUGATE, f"{spec.reason}: {msg}")
        role = next((r for r in spec.roles.values() if z in r.parents), None)
        if fam.name in GAUSS and role is not None and role.kind == cp.AFFINE:
            if spec.discrete and site_form_ok:
                # site-form Gaussians take rows from a trace at the means: no enumeration there
                return cj.Factor(
                    site_name,
                    z,
                    cj.GENERAL,
                    f"{spec.reason}: a discrete parent needs the natural form",
                )
            f.param = "loc"
            f.jacobian = spec.jacobians[z]
            f.extra["given_others"] = bool(spec.latents - {z})
            if f.extra["given_others"] and site_form_ok:
                others = ", ".join(sorted(spec.latents - {z}))
                f.reason = (
                    f"{spec.reason}: rows with E_q[precision], given {others} "
                    "(conjugate given others, eq. 20)"
                )
        return f


# ------------------------------------------------------------------------------------------------
# initialisation
# ------------------------------------------------------------------------------------------------
def _prior_natural(fam, fn) -> Optional[Tuple[torch.Tensor, ...]]:
    batch = fn.batch_shape
    try:
        nat = fam.dist_to_natural(unwrap(fn)[0])
        nat = tuple(
            torch.broadcast_to(t, batch + s).detach() for t, s in zip(nat, fam.param_shapes)
        )
    except (TypeError, ValueError, RuntimeError, NotImplementedError):
        return None
    return nat if bool(fam.is_valid(nat).all()) else None


def natural_at(fam, value: torch.Tensor, prior=None) -> Tuple[torch.Tensor, ...]:
    """Natural parameters of a ``q`` with mean ``value`` and the prior's spread (when the prior
    is of ``q``'s family; else unit variance / shape 1 / concentration K)."""
    v = value.detach()
    dtype = v.dtype if v.is_floating_point() else torch.get_default_dtype()
    v = v.to(dtype)
    tiny = torch.finfo(dtype).tiny
    name = fam.name
    if name == "gaussian" and fam.event_dim > 0:
        D = fam.dim
        vb = v.reshape(v.shape[: v.dim() - fam.event_dim] + (D,))
        if prior is not None:
            P = -2 * prior[1]
        else:
            P = torch.eye(D, dtype=dtype, device=v.device).expand(vb.shape[:-1] + (D, D))
        return (P @ vb.unsqueeze(-1)).squeeze(-1), -0.5 * P
    if name in GAUSS:
        var = -0.5 / prior[1] if prior is not None else torch.ones_like(v)
        return v / var, -0.5 / var
    if name == "gamma":
        alpha = (prior[0] + 1).clamp(min=1.0) if prior is not None else torch.ones_like(v)
        return alpha - 1, -alpha / v.clamp(min=tiny)
    if name == "beta":
        k = (prior[0] + prior[1] + 2).clamp(min=2.0) if prior is not None else 2.0
        v = v.clamp(1e-6, 1 - 1e-6)
        return k * v - 1, k * (1 - v) - 1
    if name == "dirichlet":
        K = v.shape[-1]
        k = (
            (prior[0] + 1).sum(-1, keepdim=True).clamp(min=float(K))
            if prior is not None
            else float(K)
        )
        return (k * v.clamp(min=1e-6) - 1,)
    if prior is not None:
        return prior
    return fam.zero_natural(v.shape[: v.dim() - fam.event_dim], dtype, v.device)


def init_messenger(init_loc_fn):
    """A ``pyro.poutine`` InitMessenger for ``init_loc_fn`` that leaves discrete sites to
    their prior (Pyro's init strategies cannot place a discrete value)."""
    from pyro.infer.autoguide.initialization import InitMessenger

    def init_fn(site):
        if site["fn"].support.is_discrete:
            return site["fn"].sample().detach()
        return init_loc_fn(site)

    return InitMessenger(init_fn)


def initial_natural(fam, site, init_loc_fn=None) -> Tuple[torch.Tensor, ...]:
    """Initial natural parameters of a natural-form site, at full plate sizes.

    The prior's natural parameters when the prior is of ``q``'s family and no ``init_loc_fn``
    is given; otherwise :func:`natural_at` the init value (or the prototype draw).
    """
    from pyro.ops.tensor_utils import periodic_repeat

    fn = site["fn"]
    prior = _prior_natural(fam, fn)
    if prior is not None and (init_loc_fn is None or fam.name in DISCRETE):
        nat = prior  # discrete sites start at their prior (symmetry is broken by the others)
    else:
        value = init_loc_fn(site) if init_loc_fn is not None else site["value"]
        nat = natural_at(fam, value, prior)
    batch = fn.batch_shape
    out = []
    for t, s in zip(nat, fam.param_shapes):
        t = torch.broadcast_to(t, batch + s)
        for frame in site["cond_indep_stack"]:
            full = frame.full_size or frame.size
            if frame.vectorized and full != frame.size:
                dim = t.dim() + frame.dim - len(s)
                t = (
                    periodic_repeat(t, full, dim)
                    if t.shape[dim] > 1
                    else t.expand(t.shape[:dim] + (full,) + t.shape[dim + 1 :])
                )
        out.append(t.contiguous().clone())
    return tuple(out)


# ------------------------------------------------------------------------------------------------
# the step: q state, moments, exact expectations and Monte Carlo messages
# ------------------------------------------------------------------------------------------------
def _slices(guide, info) -> List[Tuple[int, torch.Tensor]]:
    """(batch dim, indices) of the subsampled plates of a latent for the current step."""
    out = []
    sub = getattr(guide, "_step_subsample", None) or {}
    for frame in guide._frames_of(info.name):
        if frame.name in sub:
            out.append((frame.dim, sub[frame.name]))
    return out


def slice_params(guide, info, params: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """Restrict natural parameters to the current minibatch (identity without subsampling)."""
    sl = _slices(guide, info)
    if not sl:
        return tuple(params)
    out = []
    for p, shape in zip(params, info.family.param_shapes):
        for dim, idx in sl:
            p = p.index_select(p.dim() + dim - len(shape), idx)
        out.append(p)
    return tuple(out)


def write_params(guide, info, params, values) -> None:
    """Write (minibatch-restricted) natural parameters back into the full parameters."""
    sl = _slices(guide, info)
    with torch.no_grad():
        for p, v, shape in zip(params, values, info.family.param_shapes):
            if not sl:
                p.copy_(v)
                continue
            if len(sl) > 1:
                raise NotImplementedError("a latent in two subsampled plates")
            dim, idx = sl[0]
            p.index_copy_(p.dim() + dim - len(shape), idx, v.to(p.dtype))


def _local_scale(guide, info) -> float:
    s = 1.0
    sub = getattr(guide, "_step_subsample", None) or {}
    for frame in guide._frames_of(info.name):
        if frame.name in sub:
            s *= (frame.full_size or frame.size) / len(sub[frame.name])
    return s


class QState:
    """The current ``q`` for one step: mean parameters of natural-form latents as autograd
    leaves (restricted to the minibatch), site-form posteriors, and substitution values."""

    def __init__(self, guide, grad_names: Set[str]):
        from .autoguide import LEAF_FORM, NATURAL_FORM, SITE_FORM

        self.guide = guide
        self.lam: Dict[str, Tuple[torch.Tensor, ...]] = {}
        self.mu: Dict[str, Tuple[torch.Tensor, ...]] = {}
        self.fam = {}
        self.site_post = {}
        self.cond: Dict[str, torch.Tensor] = {}  # values given to the mean trace
        self.geo: Dict[str, torch.Tensor] = {}
        self.fixed: Dict[str, torch.Tensor] = {}
        for name, info in guide._latents.items():
            if info.form == NATURAL_FORM:
                fam = info.family
                lam = tuple(
                    t.detach() for t in slice_params(guide, info, guide._natural_params_of(info))
                )
                mu = tuple(t.detach() for t in fam.natural_to_mean(lam))
                if name in grad_names:
                    mu = tuple(t.requires_grad_(True) for t in mu)
                self.lam[name], self.mu[name], self.fam[name] = lam, mu, fam
                shape = lam[0].shape[: lam[0].dim() - len(fam.param_shapes[0])] + info.event_shape
                if fam.name in GAUSS:
                    v = mu[0] if mu[0].requires_grad else mu[0].detach().requires_grad_(True)
                    self.cond[name] = v.reshape(shape)
                elif fam.name == "gamma":
                    self.cond[name] = mu[1]
                    self.geo[name] = torch.exp(mu[0])
                elif fam.name == "beta":
                    a, b = lam[0] + 1, lam[1] + 1
                    self.cond[name] = a / (a + b)
                elif fam.name == "dirichlet":
                    a = lam[0] + 1
                    self.cond[name] = a / a.sum(-1, keepdim=True)
            elif info.form == SITE_FORM:
                q = guide.posterior(name)
                loc = q.mean.detach()
                self.site_post[name] = (loc.reshape(-1), _cov(q).detach())
                self.cond[name] = loc.clone().reshape(info.event_shape).requires_grad_(True)
            elif info.form == LEAF_FORM:
                self.fixed[name] = guide._leaf_values[name]
        self.fixed.update(getattr(guide, "_step_subsample", None) or {})

    def values(self, mode: str) -> Dict[str, torch.Tensor]:
        vals = {**self.fixed, **self.cond}
        if mode == "geo":
            vals.update(self.geo)
        return vals

    def probs(self, name: str) -> torch.Tensor:
        """q probabilities of a discrete latent over its K values (last dim), differentiable."""
        mu = self.mu[name][0]
        if self.fam[name].name == "bernoulli":
            return torch.stack([1 - mu, mu], -1)
        return torch.cat([mu, 1 - mu.sum(-1, keepdim=True)], -1)

    def var_of(self, name: str, A: torch.Tensor) -> torch.Tensor:
        """``diag(A Cov(z) A^T)`` for a Gaussian latent ``z`` (``A``: ``(R, numel z)``)."""
        if name in self.site_post:
            cov = self.site_post[name][1]
            return ((A @ cov) * A).sum(-1)
        fam, (m, m2) = self.fam[name], self.mu[name]
        if fam.name == "gaussian" and fam.event_dim > 0:
            D = fam.dim
            cov = m2 - m.unsqueeze(-1) * m.unsqueeze(-2)
            Ab = A.reshape(A.shape[0], -1, D)
            return torch.einsum("rbi,bij,rbj->r", Ab, cov.reshape(-1, D, D), Ab)
        v = (m2 - m.square()).reshape(-1)
        return A.square() @ v


def _cov(q) -> torch.Tensor:
    if isinstance(q, torch.distributions.MultivariateNormal):
        return q.covariance_matrix
    if isinstance(q, torch.distributions.Normal):
        return q.variance.reshape(1, 1)
    base = q.base_dist if hasattr(q, "base_dist") else q
    return base.covariance_matrix


class FactorMoments:
    """The expectations a pattern's ``elp`` asks for, for one factor at one step."""

    def __init__(self, spec: FactorSpec, traces, q: QState):
        self.spec, self.q = spec, q
        site = traces["mean"].nodes[spec.site]
        self.site = site
        self.base = unwrap(site["fn"])[0]
        geo = traces.get("geo")
        self.base_geo = unwrap(geo.nodes[spec.site]["fn"])[0] if geo is not None else self.base
        self.x = site["value"]
        self.pattern = spec.pattern

    def _role(self, name):
        return self.spec.roles[name]

    def _read(self, base, name):
        return self.pattern.read(base, name)

    def E(self, name):
        role = self._role(name)
        if role.kind == cp.IDENTITY:
            raise NotImplementedError
        return self._read(self.base, name)

    def Elog(self, name):
        role = self._role(name)
        if role.kind == cp.CONST:
            if name == "probs":
                return -F.softplus(-self.base.logits)
            return torch.log(self._read(self.base, name))
        if role.kind == cp.MONOMIAL:
            return torch.log(self._read(self.base_geo, name))
        if role.kind == cp.IDENTITY:
            (p,) = role.parents
            return cp.gather_rows(self.q.mu[p][0], role.idx, False)
        raise NotImplementedError(role.kind)

    def Elog1m(self, name):
        role = self._role(name)
        if role.kind == cp.CONST:
            return -F.softplus(self.base.logits)
        (p,) = role.parents
        return cp.gather_rows(self.q.mu[p][1], role.idx, False)

    def Elogvec(self, name):
        role = self._role(name)
        if role.kind == cp.CONST:
            return self.base.logits
        (p,) = role.parents
        return cp.gather_rows(self.q.mu[p][0], role.idx, True)

    def Var(self, name):
        role = self._role(name)
        t = self._read(self.base, name)
        if role.kind == cp.CONST:
            return torch.zeros((), dtype=t.dtype, device=t.device)
        total = 0.0
        for p in role.parents:
            total = total + self.q.var_of(p, self._jacobian(name, p, t))
        return total.reshape(t.shape)

    def _jacobian(self, name, p, t):
        """``d theta / d z_p`` (affine, so constant): cached per data and minibatch unless
        it depends on learnable parameters."""
        g = self.q.guide
        key = (
            g._args_key,
            tuple((k, tuple(v.tolist())) for k, v in sorted((g._step_subsample or {}).items())),
        )
        hit = self.spec.cache.get((name, p))
        if hit is not None and hit[0] == key and not self.spec.dynamic:
            return hit[1]
        A = cj.jacobian(t, self.q.cond[p]).detach()
        self.spec.cache[(name, p)] = (key, A)
        return A

    # value moments
    def x_float(self):
        x = self.x
        return x if x.is_floating_point() else x.to(self.base.mean.dtype)

    def _mu(self):
        return self.q.mu[self.spec.site]

    def x_gauss(self):
        if self.spec.value_kind != "latent":
            return self.x, 0.0
        fam = self.q.fam[self.spec.site]
        m, m2 = self._mu()
        shape = self.x.shape
        if fam.name == "gaussian" and fam.event_dim > 0:
            var = m2.diagonal(dim1=-2, dim2=-1) - m.square()
        else:
            var = m2 - m.square()
        return m.reshape(shape), var.reshape(shape)

    def x_gamma(self):
        if self.spec.value_kind != "latent":
            return torch.log(self.x), self.x
        return self._mu()

    def x_beta(self):
        if self.spec.value_kind != "latent":
            return torch.log(self.x), torch.log1p(-self.x)
        return self._mu()

    def x_dirichlet(self):
        if self.spec.value_kind != "latent":
            return torch.log(self.x)
        return self._mu()[0]


def _reduce(fn, lp: torch.Tensor) -> torch.Tensor:
    """Reduce an elementwise log-density of ``fn``'s base distribution (shape ``batch +
    reinterpreted event dims``) like ``fn.log_prob`` does: the ``.mask()`` and ``to_event``
    wrappers are applied innermost first."""
    layers = []
    d = fn
    while True:
        if isinstance(d, dist.MaskedDistribution):
            layers.append(("mask", d._mask))
            d = d.base_dist
        elif isinstance(d, torch.distributions.Independent):
            layers.append(("sum", d.reinterpreted_batch_ndims))
            d = d.base_dist
        elif isinstance(d, dist.ExpandedDistribution):
            d = d.base_dist
        else:
            break
    for kind, v in reversed(layers):
        if kind == "sum":
            lp = sum_rightmost(lp, v)
        elif v is not True:
            lp = torch.where(v, lp, torch.zeros_like(lp)) if v is not False else lp * 0
    return lp


def _weight(site, lp: torch.Tensor) -> torch.Tensor:
    """Apply the site's ``poutine.mask`` / ``obs_mask`` and ``poutine.scale`` (plates)."""
    return scale_and_mask(lp, site["scale"], site["mask"])


def _discrete_weight(spec: FactorSpec, trace, q: QState):
    w = None
    for c in sorted(spec.discrete):
        value = trace.nodes[c]["value"]
        probs = q.probs(c)
        oh = F.one_hot(value.long(), probs.shape[-1]).to(probs.dtype)
        pc = (oh * probs).sum(-1)
        w = pc if w is None else w * pc
    return w


def expected_log_prob(spec: FactorSpec, traces, q: QState) -> torch.Tensor:
    """``E_q[log p_a]`` in closed form (summed; scaled and masked like the site's log-prob)."""
    site = traces["mean"].nodes[spec.site]
    fn = site["fn"]
    base = unwrap(fn)[0]
    if spec.pattern is None:
        lp = base.log_prob(site["value"])
    else:
        lp = spec.pattern.elp(FactorMoments(spec, traces, q))
    extra = fn.event_dim - base.event_dim
    shape = fn.batch_shape + fn.event_shape[:extra]
    lp = lp.expand(torch.broadcast_shapes(lp.shape, shape))
    lp = _reduce(fn, lp)
    w = _discrete_weight(spec, traces["mean"], q)
    if w is not None:
        lp = lp * w
    return _weight(site, lp).sum()


# ------------------------------------------------------------------------------------------------
# mean-parameter gradients of Monte Carlo estimates (Appendix F)
# ------------------------------------------------------------------------------------------------
def mean_grad(fam, lam, g_lam) -> Tuple[torch.Tensor, ...]:
    """``F(lam)^{-1} g_lam`` (eq. 72); closed-form 2x2 solves for Gamma and Beta."""
    if fam.name == "gamma":
        alpha, rate = lam[0] + 1, -lam[1]
        g1, g2 = g_lam
        # F = [[psi'(a), 1/b], [1/b, a/b^2]], det = (a psi'(a) - 1) / b^2
        det = x_trigamma_minus_one(alpha)
        x1 = (alpha * g1 - rate * g2) / det
        x2 = (-rate * g1 + rate.square() * torch.polygamma(1, alpha) * g2) / det
        return x1, x2
    if fam.name == "gaussian_diag" or (fam.name == "gaussian" and fam.event_dim == 0):
        # F = d(m, v + m^2)/d(m/v, -1/(2v)) = [[v, 2mv], [2mv, 4m^2 v + 2v^2]], det = 2 v^3
        v = -0.5 / lam[1]
        m = lam[0] * v
        g1, g2 = g_lam
        return ((2 * m.square() + v) * g1 - m * g2) / v.square(), (g2 / 2 - m * g1) / v.square()
    if fam.name == "beta":
        a, b = lam[0] + 1, lam[1] + 1
        ta, tb, tab = torch.polygamma(1, a), torch.polygamma(1, b), torch.polygamma(1, a + b)
        f11, f22, f12 = ta - tab, tb - tab, -tab
        det = f11 * f22 - f12 * f12
        g1, g2 = g_lam
        return (f22 * g1 - f12 * g2) / det, (-f12 * g1 + f11 * g2) / det
    return fisher_solve_mean_grad(fam, lam, g_lam)


# ------------------------------------------------------------------------------------------------
# ELBO and targets
# ------------------------------------------------------------------------------------------------
@dataclass
class StepResult:
    elbo: torch.Tensor
    targets: Dict[str, Tuple[torch.Tensor, ...]]


def _specs(guide):
    return guide._analysis.specs


def compute(
    guide, args, kwargs, counted: Set[str], want: Optional[Set[str]] = None, value: bool = True
) -> StepResult:
    """Exact + Monte Carlo ``E_q[log p]`` over the factors touching natural-form latents, the
    entropies, and (for the latents in ``want``) the targets ``grad_mu E_q[log p]``.

    ``counted``: factors whose ELBO term another part of CVI_ELBO already added (they still
    send messages). With ``value=False`` only the factors touching ``want`` are evaluated.
    """
    from .autoguide import LEAF_FORM, NATURAL_FORM

    natural = {n for n, i in guide._latents.items() if i.form == NATURAL_FORM}
    want = set(natural) if want is None else set(want) & natural
    q = QState(guide, want)
    an = guide._analysis
    specs = []
    for name, spec in an.specs.items():
        if name in guide._latents and guide._latents[name].form == LEAF_FORM:
            continue
        if not (spec.latents & natural):
            continue
        if not value and not (spec.latents & want):
            continue
        specs.append(spec)
    exact = [s for s in specs if s.exact]
    general = [s for s in specs if not s.exact]
    dtype_like = next(iter(q.mu.values()))[0] if q.mu else None
    zero = torch.zeros(
        (),
        dtype=dtype_like.dtype if dtype_like is not None else None,
        device=dtype_like.device if dtype_like is not None else None,
    )
    grad_total, elbo = zero, zero
    with torch.enable_grad():
        mc_grads: Dict[str, Tuple[torch.Tensor, ...]] = {}
        first = None
        if general:
            v, mc_grads, first = _monte_carlo(guide, general, q, want, args, kwargs, an)
            elbo = elbo + sum((v[s.site] for s in general if s.site not in counted), zero)
        if exact:
            # factors whose parameters are all free of continuous latents (e.g. priors with
            # fixed hyperparameters) can be read off any trace: reuse a Monte Carlo one
            plain = first is not None and all(
                not s.discrete and all(r.kind == cp.CONST for r in s.roles.values()) for s in exact
            )
            traces = {
                "mean": first
                if plain
                else run_model(guide.model, q.values("mean"), args, kwargs, an.enum_dims)
            }
            if q.geo and any(r.kind == cp.MONOMIAL for s in exact for r in s.roles.values()):
                traces["geo"] = run_model(guide.model, q.values("geo"), args, kwargs, an.enum_dims)
            for spec in exact:
                e = expected_log_prob(spec, traces, q)
                grad_total = grad_total + e
                if spec.site not in counted:
                    elbo = elbo + e.detach()
        targets: Dict[str, Tuple[torch.Tensor, ...]] = {}
        names = [n for n in want]
        leaves = [t for n in names for t in q.mu[n]]
        if leaves and grad_total.requires_grad:
            gs = torch.autograd.grad(grad_total, leaves, allow_unused=True)
        else:
            gs = [None] * len(leaves)
        k = 0
        for n in names:
            parts = []
            for t in q.mu[n]:
                g = gs[k]
                parts.append(torch.zeros_like(t) if g is None else g.detach())
                k += 1
            if n in mc_grads:
                parts = [a + b for a, b in zip(parts, mc_grads[n])]
            # a minibatch local's terms, its entropy included, all carry the plate scale N/B:
            # its natural-gradient target is the unscaled message
            s = _local_scale(guide, guide._latents[n])
            if s != 1.0:
                parts = [t / s for t in parts]
            targets[n] = tuple(q.fam[n].symmetrize(tuple(parts)))
    if value:
        for n, info in guide._latents.items():  # (the guide's order: a fixed float sum)
            if n in natural:
                elbo = elbo + q.fam[n].entropy(q.lam[n]).sum() * _local_scale(guide, info)
    return StepResult(elbo, targets)


def _monte_carlo_vectorized(guide, general, q, args, kwargs, an, S, lat, cont, dists, values):
    """All ``S`` samples in one model run, in a particle plate left of the model's plates (and
    enumeration left of that), like ``Trace_ELBO(vectorize_particles=True)``."""
    P = an.enum_dims if an.enum_dims is not None else guide._enum_dims
    vals = {k: v.detach() for k, v in q.values("mean").items()}

    def lead(z, batch_dims):
        return z.reshape((S,) + (1,) * (P - batch_dims) + z.shape[1:])

    for n in cont:
        d = dists[n]
        z = d.rsample((S,)) if d.has_rsample else d.sample((S,))
        vals[n] = lead(z, len(d.batch_shape))
    for n in q.site_post:
        if n in lat:
            vals[n] = lead(guide.posterior(n).sample((S,)), 0)

    def particles(*a, **k):
        with pyro.plate("_cvi_particles", S, dim=-1 - P):
            return guide.model(*a, **k)

    try:
        tr = run_model(particles, vals, args, kwargs, P + 1 if an.enum_dims is not None else None)
    except (RuntimeError, ValueError) as e:
        raise ValueError(
            "AutoCVI(vectorize_particles=True) runs the model once with a leading particle "
            f"dimension of size {S} left of its plates, and the model failed to broadcast over "
            f"it ({e}). Write the model with broadcasting operations (e.g. (Z.unsqueeze(-1) * "
            "W).sum(-2) rather than Z @ W), or use vectorize_particles=False."
        ) from e
    total = 0.0
    room = P + 1 + (len(tr.nodes[next(iter(an.discrete))]["value"].shape) - P if an.discrete else 0)
    for spec in general:
        site = tr.nodes[spec.site]
        shape = site["fn"].batch_shape
        if len(shape) > room or len(shape) < P + 1 or shape[-1 - P] != S:
            raise ValueError(
                f"AutoCVI(vectorize_particles=True): site {spec.site!r} has batch shape "
                f"{tuple(shape)} with {S} particles left of {P} plate dims: the model does not "
                "broadcast over a leading particle dimension (e.g. Z @ W mixes batch and matrix "
                "dims; write (Z.unsqueeze(-1) * W).sum(-2)), or use vectorize_particles=False."
            )
        lp = site["fn"].log_prob(site["value"])
        w = _discrete_weight(spec, tr, q)
        if w is not None:
            lp = lp * w
        lp = _weight(site, lp).sum() / S
        values[spec.site] = values[spec.site] + lp.detach()
        total = total + lp
    return total


def _monte_carlo(guide, general, q: QState, want, args, kwargs, an):
    """Monte Carlo ``E_q[log p_a]`` of the general factors and its mean-parameter gradients."""
    S = max(1, int(guide.num_general_samples))
    lat = set().union(*[s.latents for s in general])
    cont = [n for n in sorted(lat) if n in q.lam and n not in an.discrete]  # fixed RNG order
    lam_leaves = {n: tuple(t.clone().requires_grad_(n in want) for t in q.lam[n]) for n in cont}
    dists = {n: q.fam[n].natural_to_dist(lam_leaves[n]) for n in cont}
    values = {s.site: 0.0 for s in general}
    total = 0.0
    first = None
    if S > 1 and getattr(guide, "vectorize_particles", False):
        total = _monte_carlo_vectorized(
            guide, general, q, args, kwargs, an, S, lat, cont, dists, values
        )
    for _ in range(0 if torch.is_tensor(total) else S):
        vals = q.values("mean")
        vals = {k: v.detach() for k, v in vals.items()}
        for n in cont:
            z = dists[n].rsample() if dists[n].has_rsample else dists[n].sample()
            vals[n] = z
        for n in q.site_post:
            if n in lat:
                vals[n] = guide.posterior(n).sample()
        tr = run_model(guide.model, vals, args, kwargs, an.enum_dims)
        first = tr if first is None else first
        for spec in general:
            site = tr.nodes[spec.site]
            lp = site["fn"].log_prob(site["value"])
            w = _discrete_weight(spec, tr, q)
            if w is not None:
                lp = lp * w
            lp = _weight(site, lp).sum()
            values[spec.site] = values[spec.site] + lp.detach() / S
            total = total + lp / S
    grads: Dict[str, Tuple[torch.Tensor, ...]] = {}
    targets = [n for n in want if n in lam_leaves] + [
        n for n in want if n in an.discrete and n in lat
    ]
    if torch.is_tensor(total) and total.requires_grad and targets:
        inputs = []
        for n in targets:
            inputs.extend(lam_leaves[n] if n in lam_leaves else q.mu[n])
        gs = torch.autograd.grad(total, inputs, allow_unused=True, retain_graph=True)
        k = 0
        for n in targets:
            src = lam_leaves[n] if n in lam_leaves else q.mu[n]
            g = []
            for t in src:
                g.append(torch.zeros_like(t) if gs[k] is None else gs[k].detach())
                k += 1
            if n in lam_leaves:
                g = mean_grad(q.fam[n], q.lam[n], tuple(g))
                g = tuple(torch.nan_to_num(x, nan=0.0) for x in g)
            grads[n] = tuple(g)
    return values, grads, first


# ------------------------------------------------------------------------------------------------
# steps
# ------------------------------------------------------------------------------------------------
def natural_step(
    fam, old: Sequence[torch.Tensor], target: Sequence[torch.Tensor], beta: float, site: str = "?"
) -> Tuple[Tuple[torch.Tensor, ...], int, int]:
    """``lambda + b (target - lambda)`` with ``b = beta`` halved per batch element (up to 30
    times) wherever the result would leave the natural domain; elements still invalid keep
    their old value. Returns ``(new, num_shrunk, num_rejected)``."""
    old = tuple(o.detach() for o in old)
    grads = tuple(t - o for t, o in zip(target, old))
    if fam.name in _BOX:
        return _box_step(fam, old, grads, beta)
    bshape = fam.is_valid(old).shape
    b = torch.full(bshape, float(beta), dtype=old[0].dtype, device=old[0].device)
    shrunk = 0

    def expand(x, like):
        return x.reshape(x.shape + (1,) * (like.dim() - x.dim()))

    for _ in range(30):
        new = tuple(o + expand(b, o) * g for o, g in zip(old, grads))
        ok = fam.is_valid(new)
        if bool(ok.all()):
            return new, shrunk, 0
        shrunk += int((~ok).sum())
        b = torch.where(ok, b, b / 2)
    new = tuple(torch.where(expand(ok, o), n, o) for o, n in zip(old, new))
    return new, shrunk, int((~ok).sum())


# families whose natural domain is a box: (lower, upper) bound of each natural parameter
_BOX = {
    "gamma": ((-1.0, None), (None, 0.0)),
    "beta": ((-1.0, None), (-1.0, None)),
    "dirichlet": ((-1.0, None),),
}
#: fraction-to-the-boundary: a shrunk step covers at most this fraction of the distance from
#: the current point to the boundary of the domain
_TO_BOUNDARY = 0.5


def _box_step(fam, old, grads, beta: float):
    """:func:`natural_step` for box-shaped domains (Gamma, Beta, Dirichlet), in closed form.

    Where the target ``lambda + grad`` is valid (always, for exact conjugate messages) the
    step is the plain convex combination (the domain is convex). Where it is not (a noisy
    Monte Carlo target), ``b = beta / 2^k`` with the smallest ``k`` such that no parameter
    moves more than half way to its bound: a damped "shrink until within the constraints"
    (the paper's rule, Section 7) that keeps shapes and rates from collapsing to ~0.
    """
    bound = None  # largest allowed step per element (inf where unconstrained)
    finite = None
    for o, g, (lo, hi), shape in zip(old, grads, _BOX[fam.name], fam.param_shapes):
        lim = torch.full_like(o, float("inf"))
        if lo is not None:
            lim = torch.where(g < 0, (lo - o) / g, lim)
        if hi is not None:
            lim = torch.where(g > 0, (hi - o) / g, lim)
        lim = lim.reshape(lim.shape[: lim.dim() - len(shape)] + (-1,)).amin(-1)
        ok = torch.isfinite(g).reshape(lim.shape + (-1,)).all(-1)
        bound = lim if bound is None else torch.minimum(bound, lim)
        finite = ok if finite is None else finite & ok
    bound = torch.where(finite, bound, torch.zeros_like(bound))
    target_ok = bound > 1.0  # lambda + 1 * grad is inside the domain
    allowed = torch.where(target_ok, bound, _TO_BOUNDARY * bound)
    b = torch.full_like(bound, float(beta))
    k = torch.ceil(torch.log2(b / allowed.clamp_min(1e-300))).clamp(min=0)
    k = torch.where(b <= allowed, torch.zeros_like(k), torch.maximum(k, torch.ones_like(k)))
    b = b * torch.exp2(-k)
    b = torch.where((b <= allowed) | (b < bound), b, b / 2)
    rejected = (k > 30) | ~finite
    b = torch.where(rejected, torch.zeros_like(b), b)

    def expand(x, like):
        return x.reshape(x.shape + (1,) * (like.dim() - x.dim()))

    new = tuple(o + expand(b, o) * torch.nan_to_num(g) for o, g in zip(old, grads))
    shrunk = int(((k > 0) & ~rejected).sum())
    return new, shrunk, int(rejected.sum())


def apply_target(guide, info, target, beta: float) -> None:
    """Step the natural parameters of ``info`` (minibatch slice) towards ``target``."""
    params = guide._natural_params_of(info)
    old = slice_params(guide, info, params)
    new, shrunk, rejected = natural_step(info.family, old, target, beta, info.name)
    guide.num_shrunk += shrunk
    guide.num_rejected += rejected
    _warn_step(info, shrunk, rejected)
    write_params(guide, info, params, new)


def _warn_step(info, shrunk: int, rejected: int) -> None:
    """Warn (once per site and kind: the text has no counts; see ``guide.num_shrunk`` and
    ``guide.num_rejected``) that a step was shrunk or rejected to keep ``q`` valid."""
    if shrunk:
        warnings.warn(
            f"AutoCVI: steps on site {info.name!r} were shrunk to keep the {info.family.name} "
            "natural parameters valid (counted in guide.num_shrunk)",
            RuntimeWarning,
            stacklevel=4,
        )
    if rejected:
        warnings.warn(
            f"AutoCVI: elements of site {info.name!r} rejected a step that would make the "
            "natural parameters invalid (counted in guide.num_rejected); lower the step size "
            "or raise num_general_samples",
            RuntimeWarning,
            stacklevel=4,
        )


def is_local(guide, name: str) -> bool:
    sub = getattr(guide, "_step_subsample", None) or {}
    return any(f.name in sub for f in guide._frames_of(name))


def update_locals(guide, args, kwargs) -> None:
    """Doubly stochastic CVI: a full (``beta = 1``) update of every natural-form latent in a
    subsampled plate, for the current minibatch, in the sequential order."""
    for name in guide._sequential_order():
        info = guide._latents[name]
        if info.form != "natural" or not is_local(guide, name):
            continue
        res = compute(guide, args, kwargs, set(), want={name}, value=False)
        apply_target(guide, info, res.targets[name], 1.0)


def sweep(guide, beta: float) -> None:
    """One sequential (coordinate-ascent) sweep: each latent in turn gets its target from the
    current ``q`` of the others and takes the step (minibatch locals: ``beta = 1``)."""
    from .autoguide import NATURAL_FORM, SITE_FORM
    from .elbo import CVI_ELBO

    args, kwargs = guide._last_args, guide._last_kwargs
    for name in guide._sequential_order():
        info = guide._latents[name]
        if info.form == NATURAL_FORM:
            res = compute(guide, args, kwargs, set(), want={name}, value=False)
            b = 1.0 if is_local(guide, name) else beta
            apply_target(guide, info, res.targets[name], b)
        elif info.form == SITE_FORM:
            tr = guide._trace_at_means(args, kwargs)
            CVI_ELBO()._site_form(guide, info, tr, args, kwargs, True, set())
            guide._apply_site_step(info, beta)


def elbo_value_check(x) -> float:
    v = float(x)
    if not math.isfinite(v):
        raise FloatingPointError("non-finite ELBO")
    return v
