"""Chain structures the analysis looks for, by registration: the block kind that fits a chain
(:mod:`pyro_cvi.blocks.markov`, with the detection of :mod:`pyro_cvi.statespace`) registers
how to find one and how to read its factors, so the analysis imports no state-space code.

* a *finder* ``find(analysis, used) -> [chain]`` returns chains over latents not in ``used``
  (the finders run in registration order; each sees the latents the earlier ones took);
* the *rules* read a chain's factors: ``observation_factor(site, chain, base, trace, leaves,
  moved, dx)`` (an observation affine in one step's state) and ``prepare_loop(chain, trace,
  leaves, moved, label)`` (a ``pyro.markov`` loop's transitions, read once at set-up).
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional

__all__ = ["ChainRules", "chain_rules", "find_chains", "register_chain_finder"]


class ChainRules(NamedTuple):
    """How the analysis reads a chain's factors (see the module docstring)."""

    observation_factor: Callable[..., Any]
    prepare_loop: Callable[..., None]


_FINDERS: List[Callable[[Any, set], List[Any]]] = []
_RULES: List[ChainRules] = []


def register_chain_finder(
    find: Callable[[Any, set], List[Any]], rules: Optional[ChainRules] = None
) -> None:
    """Register a chain finder (and, once, the rules that read the chains' factors)."""
    _FINDERS.append(find)
    if rules is not None:
        _RULES[:] = [rules]


def find_chains(analysis) -> List[Any]:
    """Every registered finder's chains, each over latents no earlier chain holds."""
    chains: List[Any] = []
    for find in _FINDERS:
        chains += find(analysis, {n for c in chains for n in c.names})
    return chains


def chain_rules() -> ChainRules:
    """The registered rules (a chain was found, so its kind registered them)."""
    return _RULES[0]
