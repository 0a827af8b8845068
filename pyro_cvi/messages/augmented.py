"""Factor kinds made conjugate by auxiliary variables: one file and one registration each.

A factor that is not conjugate to the natural-form latents it touches may become so once
auxiliary latent variables are added to the model (a Poisson over a sum of products: its
counts split into multinomial allocations, one per term). Under a mean-field ``q`` that also
covers the auxiliaries, their optimal ``q`` has a closed form, and so has each latent's
message, the exact expected natural parameter of the augmented factor (eq. 20). The bound the
kind reports is the augmented model's ``-ELBO``, an upper bound of the plain model's ``-ELBO``
for the same ``q`` of the original latents.

A kind is an object with

* ``name``: what ``explain()`` calls it;
* ``detect(an, spec, families) -> plan or None``: read the factor's structure once (cached per
  analysis);
* ``messages(plan, trace, q, want) -> (elbo, {latent: natural-parameter message})``: the
  auxiliaries' optimal ``q`` at the current ``q`` of the latents, the factor's term of the
  ELBO (auxiliary entropy included), and the messages to the latents in ``want``;
* ``describe(plan, latent) -> (kind, why)``: the line ``explain()`` prints for the factor's
  message to ``latent``.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..model.records import NATURAL

__all__ = [
    "augmented_plan",
    "register_augmented_kind",
    "registered_augmented_kinds",
    "unregister_augmented_kind",
]

_KINDS: List[Any] = []
#: per analysis: ``{site: (kind, plan) or None}``
_PLANS: weakref.WeakKeyDictionary[object, Dict[str, Optional[Tuple[Any, Any]]]] = (
    weakref.WeakKeyDictionary()
)


def register_augmented_kind(kind: Any) -> None:
    """Add an augmented factor kind (tried in registration order)."""
    if kind not in _KINDS:
        _KINDS.append(kind)


def unregister_augmented_kind(kind: Any) -> None:
    """Remove a registration (guides built afterwards no longer use the kind)."""
    if kind in _KINDS:
        _KINDS.remove(kind)


def registered_augmented_kinds() -> List[Any]:
    return list(_KINDS)


def augmented_plan(an, spec) -> Optional[Tuple[Any, Any]]:
    """``(kind, plan)`` of the first registered kind that claims factor ``spec`` (of the
    natural-form latents' families), or ``None`` (decided once per analysis and site)."""
    cache = _PLANS.setdefault(an, {})
    if spec.site not in cache:
        families = {n: i.family for n, i in an.latents.items() if i.form == NATURAL}
        found = None
        with torch.random.fork_rng(devices=[]):  # (probes leave the fit's random stream alone)
            for kind in _KINDS:
                plan = kind.detect(an, spec, families)
                if plan is not None:
                    found = (kind, plan)
                    break
        cache[spec.site] = found
    return cache[spec.site]
