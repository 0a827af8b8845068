"""Blocks: one parameterisation of part of ``q`` each, with one small protocol.

A block holds its parameters in Pyro's param store and answers to the engine
(:mod:`pyro_cvi.engine`):

* ``setup(...)``: register its parameters (the start of Algorithm 1 / 2);
* the loss writes ``target - lambda`` into the parameters' ``.grad`` (its messages);
* ``step(beta, ...) -> StepCounts``: the CVI update with the one step policy
  (:mod:`pyro_cvi.update`);
* ``marginal(name)`` / ``joint(...)``: the current ``q`` as a torch Distribution.

:class:`GaussianBlock` is the site form (a joint Gaussian over a group of sites, Algorithm 1);
:class:`MarkovBlock` is the site form on a linear-Gaussian chain prior (Kalman smoother,
App. E.2); :class:`NaturalBlock` is a mean-field exponential-family factor (Algorithm 2). A new
kind of block is one class and one registration (:mod:`~pyro_cvi.blocks.registry`).
"""

from . import remainder_rules  # noqa: F401  (the remainder's admission and step rules)
from .base import Block, BlockInit, StepReport, stored
from .bilinear import BilinearBlock
from .gaussian import GaussianBlock
from .markov import MarkovBlock
from .mean_field import MeanFieldBlock
from .natural import NaturalBlock, init_messenger, initial_natural
from .regime_markov import RegimeMarkovBlock
from .registry import (
    BlockKind,
    Found,
    build_blocks,
    register_block_kind,
    register_kind,
    registered_block_kinds,
    registered_kinds,
    unregister_block_kind,
    unregister_kind,
)
from .remainder import RemainderBlock
from .scaled_markov import ScaledMarkovBlock  # noqa: F401  (a chain beside its scales)
from .scaled_walk import find_scaled_walks  # noqa: F401  (the same, written with cumsum)
from .site_form import SiteFormBlock

__all__ = [
    "BilinearBlock",
    "Block",
    "BlockInit",
    "BlockKind",
    "Found",
    "build_blocks",
    "GaussianBlock",
    "MarkovBlock",
    "RegimeMarkovBlock",
    "MeanFieldBlock",
    "NaturalBlock",
    "RemainderBlock",
    "SiteFormBlock",
    "StepReport",
    "stored",
    "init_messenger",
    "initial_natural",
    "register_block_kind",
    "register_kind",
    "registered_block_kinds",
    "registered_kinds",
    "unregister_block_kind",
    "unregister_kind",
]
