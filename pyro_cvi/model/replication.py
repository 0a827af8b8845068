"""Which latents a data-parallel run holds in full on every rank (the analysis's view; the
collectives are :mod:`pyro_cvi.scale.distributed`)."""

from __future__ import annotations

from typing import Set

__all__ = ["replicated_sites"]


def replicated_sites(analysis) -> Set[str]:
    """The latent sites every rank holds in full (the same factor on every rank): those in no
    plate that also holds an observed site. The others (observations, per-row latents) are
    the rank's shard. Shard the data along the observations' plate."""
    nodes = {n: v for n, v in analysis.structure.nodes.items() if v["type"] == "sample"}
    latent = set(analysis.values)
    data = {f.name for n, v in nodes.items() if n not in latent for f in v["cond_indep_stack"]}
    return {
        n
        for n in latent
        if n in nodes and not any(f.name in data for f in nodes[n]["cond_indep_stack"])
    }
