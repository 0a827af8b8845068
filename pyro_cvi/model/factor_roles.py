"""The roles a factor's parameters play for the mean-field latents (conditionally conjugate pairs).

For a factor (sample site) of the model, :func:`analyze_factor` reads its distribution off a
trace whose continuous latents are autograd leaves, finds which latents each parameter depends
on, and asks the registry (:mod:`~pyro_cvi.model.conjugate_pairs`) whether the factor is *exact*:
``log p_a`` multilinear in the sufficient statistics of all its latents, so that
``E_q[log p_a]`` is a closed-form function of the mean parameters and its gradient is the VMP
message (eq. 20 / 89). Every role is confirmed by probing the model (:mod:`~pyro_cvi.model.probes`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Optional, Set, Union

import torch

from ..gaussian.selection import SelectionJacobian, dense
from . import conjugate_pairs as cp
from . import probes
from .selection_probes import selection_jacobian
from .tracing import unwrap

__all__ = ["FactorSpec", "analyze_factor", "factor_spec", "minibatch_renames", "minibatch_spec"]


@dataclass
class FactorSpec:
    """How the mean-field part of CVI treats one factor (sample site) of the model."""

    site: str
    exact: bool
    reason: str
    pattern: Optional[cp.Pattern] = None
    roles: Dict[str, cp.Role] = field(default_factory=dict)
    value_kind: str = "observed"  # observed | discrete | latent
    continuous: Set[str] = field(default_factory=set)  # continuous latents (incl. its value)
    discrete: Set[str] = field(default_factory=set)  # discrete latents (incl. its value)
    # affine loc: (R, D), a SelectionJacobian where large and one non-zero per row
    jacobians: Dict[str, Union[torch.Tensor, SelectionJacobian]] = field(default_factory=dict)
    dynamic: bool = False  # an affine coefficient depends on learnable parameters
    collapsed: bool = False  # in the collapsed group (summed over discrete latents, collapsed.py)

    @property
    def latents(self) -> Set[str]:
        return self.continuous | self.discrete

    def dense_jacobian(self, name: str, columns: int) -> torch.Tensor:
        """The affine loc's Jacobian in ``name`` as a dense ``(R, D)`` matrix (a selection
        formed), zeros ``(R, columns)`` where the loc does not depend on ``name``."""
        A = self.jacobians.get(name)
        if A is not None:
            return dense(A)
        ref = next(iter(self.jacobians.values()))
        return torch.zeros(ref.shape[0], columns, dtype=ref.dtype, device=ref.device)


def analyze_factor(an, site_name: str, draws: Optional[list] = None) -> FactorSpec:
    """Classify one factor: exact (every parameter in a registered conjugate role) or not.

    ``an``: the :class:`~pyro_cvi.model.analysis.Analysis` (its traces, dependencies, families).
    ``draws``, if given, receives ``(shape, dtype, device)`` of every draw it takes from
    torch's random stream (the random projections of the dependency tests).
    """
    tr, leaves = an.leaf_trace()
    site = tr.nodes[site_name]
    deps = set(an.deps.get(site_name, set())) - an.leaves
    cont = {d for d in deps if d in an.continuous}
    disc = {d for d in deps if d in an.discrete}
    spec = FactorSpec(site_name, False, "", continuous=set(cont), discrete=set(disc))
    # (the latents are conditioned in analysis traces: decide by name, not is_observed)
    if site_name in an.discrete:
        spec.value_kind = "discrete"
        spec.discrete.add(site_name)
    elif site_name in an.continuous:
        spec.value_kind = "latent"
        spec.continuous.add(site_name)
    base = unwrap(site["fn"])[0]
    dname = type(base).__name__
    enumerated = f", enumerated over {', '.join(sorted(disc))}" if disc else ""
    if not cont and spec.value_kind != "latent":
        spec.exact = True
        spec.reason = f"{dname} with no continuous latent parameter{enumerated}"
        return spec
    pattern = cp.lookup(base)
    if pattern is None:
        spec.reason = f"{dname} has no conjugate pattern"
        return spec
    spec.pattern = pattern
    value_fam = an.families.get(site_name)
    if spec.value_kind == "latent" and not isinstance(value_fam, pattern.value_families):
        spec.reason = f"{dname} density of a {value_fam.name} q"
        return spec
    if spec.value_kind == "discrete" and not isinstance(value_fam, pattern.value_families):
        spec.reason = f"{dname} of a discrete latent"
        return spec
    covered: Set[str] = set()
    names = list(leaves)
    with torch.enable_grad():
        for name, (kinds, fams) in pattern.params.items():
            t = pattern.read(base, name)
            pdeps: Set[str] = set()
            if torch.is_tensor(t) and t.requires_grad and names:
                if draws is not None:
                    draws.append((t.shape, t.dtype, t.device))
                grads = torch.autograd.grad(
                    (t * torch.randn_like(t)).sum(),
                    [leaves[n] for n in names],
                    allow_unused=True,
                    retain_graph=True,
                )
                pdeps = {n for n, g in zip(names, grads) if g is not None}
            covered |= pdeps
            role = _role(an, spec, name, t, pdeps, kinds, fams)
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
    spec.reason = (f"{dname} {text} (probed)" if text else dname) + enumerated
    return spec


def factor_spec(an, site_name: str, kept: Optional[dict]) -> FactorSpec:
    """:func:`analyze_factor`, once per regrouping where it can be: ``kept`` holds the specs
    asked while the blocks are grouped (``kept[None]`` false) with the draws they took from
    torch's random stream. The classification (``kept[None]`` true) reads a kept
    spec instead of analysing the factor again (the same traces, dependencies and families:
    the same spec) and replays its draws, so the stream moves as the analysis would have
    moved it. A spec whose analysis took other draws (a model run that draws) is not kept."""
    if kept is None:
        return analyze_factor(an, site_name)
    if kept[None]:
        spec, draws = kept.pop(site_name, (None, None))
        if spec is None:
            return analyze_factor(an, site_name)
        for shape, dtype, device in draws:
            torch.randn(shape, dtype=dtype, device=device)
        return spec
    draws: list = []
    before = torch.get_rng_state()
    spec = analyze_factor(an, site_name, draws)
    after = torch.get_rng_state()
    if all(d[2].type == "cpu" for d in draws):
        torch.set_rng_state(before)  # the replay must move the stream exactly as the analysis
        for shape, dtype, device in draws:
            torch.randn(shape, dtype=dtype, device=device)
        if torch.equal(torch.get_rng_state(), after):
            kept[site_name] = (spec, draws)
        torch.set_rng_state(after)
    return spec


def _param_reader(an, site_name: str, pattern: cp.Pattern, name: str):
    def read(values):
        return pattern.read(unwrap(an.run(**values).nodes[site_name]["fn"])[0], name)

    return read


def _tagged_reader(an, site_name: str, pattern: cp.Pattern, name: str, p: str):
    """:func:`_param_reader` at ``{p: z}`` for the identity probes, whose tags are the same for
    every factor of ``p``: each tagged run is kept (in ``an.probe_cache``) and read by all of
    them, where it drew nothing from torch's random stream (a run that draws is not reused)."""

    def read(z: torch.Tensor):
        key = ("identity", p, z.dtype, tuple(z.shape), z.detach().cpu().numpy().tobytes())
        kept = an.probe_cache.get(key)
        if kept is None:
            state = torch.get_rng_state()
            trace = an.run(**{p: z})
            if torch.equal(state, torch.get_rng_state()):
                an.probe_cache[key] = [trace]
        else:
            trace = kept[0]
        return pattern.read(unwrap(trace.nodes[site_name]["fn"])[0], name)

    return read


def _role(an, spec, name, t, pdeps, kinds, fams) -> Union[cp.Role, str]:
    """The role of parameter ``name`` (value ``t``, latent parents ``pdeps``), or why none."""
    if not pdeps:
        return cp.Role(cp.CONST)
    pf = {p: an.families[p] for p in pdeps}
    listed = ", ".join(f"{p} ({f.name})" for p, f in sorted(pf.items()))
    read = _param_reader(an, spec.site, spec.pattern, name)
    tol = probes.rtol(t.dtype)
    if cp.MONOMIAL in kinds and all(isinstance(f, fams) for f in pf.values()):
        for p in sorted(pdeps):
            why = cp.check_monomial(lambda z, p=p: read({p: z}), an.ref[p], tol)
            if why is not None:
                return why.replace("it", p)
        return cp.Role(cp.MONOMIAL, tuple(sorted(pdeps)))
    if cp.AFFINE in kinds and all(isinstance(f, fams) for f in pf.values()):
        _, leaves = an.leaf_trace()
        if not probes.affine_graph(t, [leaves[p] for p in sorted(pdeps)]):
            return f"is not affine in {', '.join(sorted(pdeps))} (a non-linear operation)"
        with torch.enable_grad():
            jac = {p: _affine_jacobian(t, leaves[p]) for p in sorted(pdeps)}
        if not probes.check_affine(read, {p: an.ref[p] for p in pdeps}, jac, f0=t.detach()):
            return f"is not affine in {', '.join(sorted(pdeps))} (probed)"
        spec.jacobians.update(jac)
        tr, _ = an.leaf_trace()
        params = [n["value"] for n in tr.nodes.values() if n["type"] == "param"]
        with torch.enable_grad():
            dyn = probes.depends_on_params(t, [leaves[p] for p in sorted(pdeps)], params)
        spec.dynamic = spec.dynamic or dyn
        return cp.Role(cp.AFFINE, tuple(sorted(pdeps)))
    if cp.IDENTITY in kinds and len(pdeps) == 1:
        (p,) = pdeps
        if isinstance(pf[p], fams):
            z0 = an.ref[p]
            tagged = _tagged_reader(an, spec.site, spec.pattern, name, p)
            idx, why = cp.find_identity_index(
                tagged, z0.shape, pf[p].vector_valued, z0.dtype, z0.device, tol
            )
            if idx is None:
                return why
            return cp.Role(cp.IDENTITY, (p,), idx)
    return f"depends on {listed}: no conjugate pattern"


def _affine_jacobian(t: torch.Tensor, z: torch.Tensor) -> Union[torch.Tensor, SelectionJacobian]:
    """``d t / d z`` of an affine ``t``: a selection where it is a large one (never formed
    densely, :mod:`~pyro_cvi.model.selection_probes`), else the dense matrix."""
    sel = selection_jacobian(t, z)
    return sel if sel is not None else probes.jacobian(t, z).detach()


def _sequential_minibatch_plate(an, node) -> Optional[str]:
    for frame in node["cond_indep_stack"]:
        if frame.name in an.minibatch_plates and not frame.vectorized:
            return frame.name
    return None


def minibatch_renames(an, trace) -> Dict[str, Optional[str]]:
    """Sites of a sequential subsampled plate (``for i in pyro.plate(..., subsample_size=B):
    pyro.sample(f"obs_{i}", ...)``) are named by data index, so each minibatch has sites the
    analysis never saw and lacks some it saw. Returns ``{site: template}`` for every observed
    site of ``trace`` in such a plate: the analysed site of the same plate, distribution type
    and observed-ness whose classification it shares (itself where the analysis saw it;
    ``None`` where no analysed site matches). Analysed sites absent from ``trace`` are not
    in this minibatch: skip them."""
    out: Dict[str, Optional[str]] = {}
    by_key: Dict[tuple, str] = {}
    for name in an.owner:
        node = an.structure.nodes.get(name)
        if node is None or not node.get("is_observed"):
            continue
        plate = _sequential_minibatch_plate(an, node)
        if plate is not None:
            by_key.setdefault((plate, type(unwrap(node["fn"])[0])), name)
    if not by_key:
        return out
    for name, node in trace.nodes.items():
        if node.get("type") != "sample" or not node.get("is_observed"):
            continue
        plate = _sequential_minibatch_plate(an, node)
        if plate is None:
            continue
        if name in an.owner:
            out[name] = name
        else:
            out[name] = by_key.get((plate, type(unwrap(node["fn"])[0])))
    return out


def minibatch_spec(an, site: str, template: str) -> FactorSpec:
    """The template's :class:`FactorSpec` for a minibatch site it stands for (same roles and
    pattern: the plate's sites share their structure; Jacobians are re-read per site)."""
    spec = an.spec(template)
    if site == template:
        return spec
    return dataclasses.replace(spec, site=site, jacobians={})
