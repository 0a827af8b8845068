"""The registry of block kinds: what the analysis found, mapped to blocks.

A *kind* is one class of :class:`~pyro_cvi.blocks.base.Block` plus one registration
(:func:`register_kind`) in its own file: ``build(found) -> [Block]`` reads the
:class:`Found` (the analysis and what earlier kinds already built) and returns its blocks.
:func:`build_blocks` consults the kinds by ``rank`` (lower first); the engine holds the list it
returns and never names a kind. The built-in kinds:

========  ==========================  ==================================================
rank      kind                        what it takes
========  ==========================  ==================================================
10        ``site``                    every Gaussian block spec (Algorithm 1): the first
                                      :func:`register_block_kind` that accepts it
                                      (Markov chains, the full joint Gaussian, a user's)
20        ``mean field``              the natural-form latents and collapsed sums
                                      (Algorithm 2)
30        ``remainder``               latents without exact messages: one joint Gaussian
40        ``bilinear``                a bilinear Normal factor's ``z``, ``W``, ``mu``, noise
                                      (PPCA, factor analysis: VMP, :mod:`pyro_cvi.blocks.bilinear`)
========  ==========================  ==================================================

Factors are owned once (``analysis.owner``), so a kind's blocks compute the ELBO terms of the
factors the analysis gave them, and read the other blocks' ``q`` through the protocol only.

A kind may also tell the analysis what it admits (:func:`register_admission`):
``rule(options)`` returns keyword arguments of :class:`~pyro_cvi.model.analysis.Analysis`
(the remainder: which Gaussian blocks with a general factor it takes,
:mod:`pyro_cvi.blocks.remainder_rules`). :func:`analysis_options` merges them, so the engine passes
them on without naming the kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

from ..context import Options
from .base import Block

__all__ = [
    "BlockKind",
    "Found",
    "analysis_options",
    "register_admission",
    "build_blocks",
    "register_block_kind",
    "register_kind",
    "registered_block_kinds",
    "registered_kinds",
    "unregister_block_kind",
    "unregister_kind",
]


@dataclass
class Found:
    """What a kind reads to build its blocks."""

    #: the model's :class:`~pyro_cvi.model.analysis.Analysis`
    analysis: object
    #: the guide's param-store prefix and options
    prefix: str
    options: Options
    #: ``() -> [latent names]``: the sequential schedule's order
    order: Callable[[], List[str]]
    #: the blocks built so far (by the kinds of lower rank), in order
    built: List[Block] = field(default_factory=list)
    #: the Gaussian block specs no kind has taken yet (``analysis.blocks``, in order)
    specs: List = field(default_factory=list)

    def __post_init__(self) -> None:
        self.specs = list(self.analysis.blocks)  # type: ignore[attr-defined]

    def take_specs(self, accepts: Callable) -> List:
        """Claim the Gaussian block specs that ``accepts(spec)``: no later kind sees them."""
        taken = [s for s in self.specs if accepts(s)]
        self.specs = [s for s in self.specs if not accepts(s)]
        return taken

    def owned_by(self, owner) -> List[str]:
        """The factor sites whose ELBO terms the analysis gave to ``owner``."""
        return [s for s, o in self.analysis.owner.items() if o == owner]  # type: ignore[attr-defined]


class BlockKind(NamedTuple):
    """One kind of block: its name, where its blocks sit in the engine's list, its builder."""

    name: str
    rank: int
    build: Callable[[Found], List[Block]]


_KINDS: Dict[str, BlockKind] = {}
#: kind name -> ``(options) -> {Analysis keyword: value}``: what the kind asks of the analysis
_ADMISSIONS: Dict[str, Callable[[Options], Dict[str, Any]]] = {}


def register_kind(name: str, rank: int, build: Callable[[Found], List[Block]]) -> BlockKind:
    """Register (or replace) the kind ``name``: ``build(found) -> [Block]`` is called by
    :func:`build_blocks` after every kind of lower ``rank``."""
    kind = BlockKind(name, rank, build)
    _KINDS[name] = kind
    return kind


def register_admission(kind: str, rule: Callable[[Options], Dict[str, Any]]) -> None:
    """Register (or replace) what kind ``kind`` admits: ``rule(options)`` returns the
    :class:`~pyro_cvi.model.analysis.Analysis` keywords it decides, read by
    :func:`analysis_options` before the analysis runs (a kind not registered: ignored)."""
    _ADMISSIONS[kind] = rule


def analysis_options(options: Options) -> Dict[str, Any]:
    """The registered kinds' :class:`~pyro_cvi.model.analysis.Analysis` keywords for
    ``options``, merged in rank order (a keyword two kinds decide is an error)."""
    out: Dict[str, Any] = {}
    for kind in registered_kinds():
        rule = _ADMISSIONS.get(kind.name)
        for key, value in (rule(options) if rule is not None else {}).items():
            if key in out:
                raise ValueError(f"block kinds {kind.name!r} and another both decide {key!r}")
            out[key] = value
    return out


def unregister_kind(name: str) -> None:
    """Remove a registration (tests)."""
    _KINDS.pop(name, None)


def registered_kinds() -> List[BlockKind]:
    """The kinds, in the order :func:`build_blocks` consults them."""
    return sorted(_KINDS.values(), key=lambda k: k.rank)


def build_blocks(found: Found) -> Dict[str, List[Block]]:
    """Every kind's blocks, ``{kind name: [Block]}`` in rank order (kinds with none left out);
    ``found.built`` holds them all in that order afterwards."""
    out: Dict[str, List[Block]] = {}
    for kind in registered_kinds():
        blocks = kind.build(found)
        if blocks:
            out[kind.name] = blocks
            found.built.extend(blocks)
    return out


# ---------------------------------------------------------------------- Gaussian block specs
#: ``[(accepts(spec) -> bool, factory(spec, prefix, owned, options) -> Block, fallback)]``
_SPEC_KINDS: List[Tuple[Callable, Callable, bool]] = []


def register_block_kind(accepts: Callable, factory: Callable, fallback: bool = False) -> None:
    """Register a block for Gaussian block specs: ``accepts(spec)`` says whether it takes a
    :class:`~pyro_cvi.model.records.BlockSpec`, ``factory(spec, prefix, owned, options)``
    builds it. Later registrations are consulted first; ``fallback`` ones (the built-in
    kinds) after every other."""
    entry = (accepts, factory, fallback)
    if fallback:
        _SPEC_KINDS.append(entry)
    else:
        _SPEC_KINDS.insert(0, entry)


def unregister_block_kind(factory: Callable) -> None:
    """Remove a registration (tests)."""
    _SPEC_KINDS[:] = [k for k in _SPEC_KINDS if k[1] is not factory]


def registered_block_kinds() -> List[Tuple[Callable, Callable]]:
    """``[(accepts, factory)]`` in the order they are consulted."""
    ordered = [k for k in _SPEC_KINDS if not k[2]] + [k for k in _SPEC_KINDS if k[2]]
    return [(a, f) for a, f, _ in ordered]


def _site_blocks(found: Found) -> List[Block]:
    """One block per Gaussian block spec: the first registered kind that accepts it."""
    out = []
    for spec in found.take_specs(lambda spec: True):
        owned = found.owned_by(spec.index)
        factory = next((f for a, f in registered_block_kinds() if a(spec)), None)
        if factory is None:
            raise ValueError(f"no block kind accepts the Gaussian block {spec.names}")
        out.append(factory(spec, found.prefix, owned, found.options))
    return out


register_kind("site", 10, _site_blocks)
