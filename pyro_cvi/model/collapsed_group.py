"""Which finite discrete latents are summed out (no ``q``), and the sites summed with them
(their messages: :mod:`pyro_cvi.messages.collapsed`).

The rule (``AutoCVI(discrete=...)``):

* ``"auto"`` (the default) honours the model's own marker, read where Pyro reads it
  (``msg["infer"].get("enumerate")``, set by ``infer={"enumerate": ...}``,
  ``config_enumerate``, ``poutine.infer_config``): a *global* site (in no vectorised plate)
  marked ``"parallel"`` or ``"sequential"`` is summed out, as ``TraceEnum_ELBO`` sums it for
  a guide with no site for it, so the bound is ``E_q[log sum_z p(x, z, theta)] + H[q]``;
  a marked site inside a plate (mixture assignments, HMM states of a batch of sequences)
  and an unmarked one get a mean-field Categorical/Bernoulli ``q``. The plate-local rule is
  measured: summed out, the zoo's Gaussian mixture ends at -ELBO 108 instead of 73.8 and
  ``examples/hmm.py`` at 354.6 instead of 342.5 (the Monte Carlo messages leave the
  symmetric start slowly, docs/discrete_latents.md);
* ``"collapse"`` sums out every finite discrete latent; ``"mean_field"`` none.

A summed-out group is contracted over all its discrete latents, so an unmarked discrete
latent that shares a factor with the group (or a dependent of it) is summed out with it.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Set

from ..families import choose_families
from .factor_roles import FactorSpec
from .records import PLACEMENTS

__all__ = [
    "MODES",
    "check_mode",
    "choose_summed_out",
    "collapsed_sites",
    "collapsed_spec",
    "families_summing_marked",
    "infinite_support_error",
    "is_global",
    "marked_for_enumeration",
    "summed_out",
]

#: the ``discrete=`` choices of :class:`~pyro_cvi.AutoCVI`
MODES = ("auto", "collapse", "mean_field")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"discrete must be one of {MODES}, got {mode!r}")
    return mode


def marked_for_enumeration(site) -> bool:
    """Whether a model site asks to be enumerated, as ``TraceEnum_ELBO`` reads it."""
    return (site.get("infer") or {}).get("enumerate") in ("parallel", "sequential")


def is_global(site) -> bool:
    """Whether a site lies in no vectorised plate."""
    return not any(f.vectorized for f in site["cond_indep_stack"])


def collapsed_sites(nodes: Iterable[str], deps: Dict[str, Set[str]], latents: Set[str]) -> List:
    """The collapsed group: the sites (in model order) that are, or directly depend on, a
    collapsed latent."""
    return [n for n in nodes if n in latents or (deps.get(n, set()) & latents)]


def choose_summed_out(
    mode: str, discrete: Set[str], nodes, deps: Dict[str, Set[str]]
) -> Dict[str, str]:
    """The summed-out latents among ``discrete`` (the finite discrete latents that are not
    leaves), each with why, by the rule of the module docstring; ``nodes``: the model's sites
    (model order), ``deps``: each site's latent dependencies."""
    if mode == "collapse":
        return {n: "discrete='collapse'" for n in discrete}
    if mode != "auto":
        return {}
    why = {
        n: f"the model marks it infer={{'enumerate': {nodes[n]['infer']['enumerate']!r}}}"
        for n in discrete
        if marked_for_enumeration(nodes[n]) and is_global(nodes[n])
    }
    while True:  # an unmarked discrete latent in the group's factors joins it
        group = collapsed_sites(nodes, deps, set(why))
        more = {d for s in group for d in ({s} | deps.get(s, set())) & discrete} - set(why)
        if not more:
            return why
        for n in sorted(more):
            shared = next(s for s in group if n in {s} | deps.get(s, set()))
            why[n] = f"shares factor {shared!r} with a summed-out site"


def collapsed_spec(site: str, deps: Set[str], continuous: Set[str], latents: Set[str]):
    """The factor spec of a collapsed factor: a general factor of its continuous latents."""
    cont = {d for d in deps if d in continuous}
    if site in continuous:
        cont.add(site)
    summed = sorted(({site} | set(deps)) & latents)
    reason = f"summed over {', '.join(summed)} (TraceEnum contraction)"
    return FactorSpec(site, False, reason, continuous=cont, collapsed=True)


def infinite_support_error(name: str, fn) -> ValueError:
    """A discrete latent whose support cannot be enumerated (Poisson, Geometric, ...)."""
    return ValueError(
        f"latent site {name!r} is discrete with an infinite support ({fn.support}): it can be "
        "neither enumerated (discrete='collapse') nor given a Categorical q. Truncate it (e.g. "
        "sample a Categorical over 0..K-1 with the same probabilities, renormalised), or "
        "marginalise it by hand in the model (e.g. a Poisson count thinned by a Binomial is a "
        "Poisson), or block the site and give it its own guide."
    )


def families_summing_marked(proto, names: List[str], covariance, overrides, mode: str):
    """:func:`~pyro_cvi.families.choose_families`, where an enumerable site that no family
    covers is summed out (counted discrete) with ``"collapse"``, or with ``"auto"`` when the
    model marks it for enumeration. A latent placed ``"joint"`` keeps the family it would have
    unnamed (:data:`~pyro_cvi.model.records.PLACEMENTS`); it must be a real latent."""
    placed = {n for n, f in (overrides or {}).items() if f in PLACEMENTS}
    overrides = {n: f for n, f in (overrides or {}).items() if n not in placed}
    for n in sorted(placed):
        fn = proto.nodes[n]["fn"] if n in names else None
        if fn is None or fn.support.is_discrete:
            raise ValueError(
                f"AutoCVI(families={{{n!r}: 'joint'}}): 'joint' places a continuous latent site "
                f"in the remainder's joint Gaussian; {n!r} is "
                + ("discrete" if fn is not None else f"not a latent site (latent sites: {names})")
            )
    out = choose_families(proto, names, covariance, overrides, mode == "collapse")
    families, fallback, discrete, unsupported = out
    for n in list(unsupported) if mode == "auto" else []:
        fn = proto.nodes[n]["fn"]
        if fn.support.is_discrete and fn.has_enumerate_support:
            if marked_for_enumeration(proto.nodes[n]) and is_global(proto.nodes[n]):
                discrete.add(n)
                del unsupported[n]
    return families, fallback, discrete, unsupported


def summed_out(an, mode: str) -> Set[str]:
    """The summed-out latents of analysis ``an`` (:func:`choose_summed_out`); records why in
    ``an.summed_why`` (``explain()`` prints it)."""
    nodes = an.structure.nodes
    an.discrete_mode = mode  # (a GLM factor's plate-local parents: model/discrete_glm.py)
    an.summed_why = choose_summed_out(mode, an.discrete - an.leaves, nodes, an.deps)
    for n in an.discrete - an.leaves - set(an.summed_why) if mode == "auto" else ():
        if marked_for_enumeration(nodes[n]):  # (explain() prints it beside q)
            an.fallback[n] = "marked for enumeration but plate-local: mean field by default"
    return set(an.summed_why)
