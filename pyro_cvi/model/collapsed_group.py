"""The collapsed group of ``AutoCVI(discrete="collapse")``: which sites are summed out with the
finite discrete latents (their messages: :mod:`pyro_cvi.messages.collapsed`)."""

from __future__ import annotations

from typing import Dict, Iterable, List, Set

from .factor_roles import FactorSpec

__all__ = ["collapsed_sites", "collapsed_spec", "infinite_support_error"]


def collapsed_sites(nodes: Iterable[str], deps: Dict[str, Set[str]], latents: Set[str]) -> List:
    """The collapsed group: the sites (in model order) that are, or directly depend on, a
    collapsed latent."""
    return [n for n in nodes if n in latents or (deps.get(n, set()) & latents)]


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
