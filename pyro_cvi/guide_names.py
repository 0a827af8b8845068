"""Parameter names per guide: a prefix of its own, and a clear error where two guides collide.

A guide keeps its parameters in Pyro's param store under ``"<prefix>.<kind>.<site>"``, the
prefix being its ``PyroModule`` name (``"AutoCVI"`` by default, as Pyro's autoguides use their
class name). Two guides with one prefix in one process would read and write each other's
parameters: the second guide's set-up would start from the first guide's ``q`` and each step
of one would overwrite the other's (two logistic regressions stepped in turn got each other's
sites). Each guide therefore claims its prefix at its set-up: the claim fails with a
``ValueError`` naming the prefix and the fix (``AutoCVI(model, prefix="...")``) while another
live guide is bound to the very tensors the store holds under that prefix. A guide that was
dropped, or whose parameters left the store (``pyro.clear_param_store()``, a checkpoint
loaded over them), holds no claim.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Dict, List

import pyro

from .guide_state import bound_parameters

__all__ = ["check_prefix", "claim_prefix"]

#: prefix -> the guides that claimed it (weakly: a dropped guide holds no claim)
_CLAIMS: Dict[str, List[weakref.ref]] = {}


def check_prefix(prefix: Any, owner: str = "AutoCVI") -> str:
    """A valid prefix (a non-empty string without leading or trailing dots), or a ``ValueError``."""
    if not isinstance(prefix, str) or not prefix.strip(".") or prefix != prefix.strip("."):
        raise ValueError(
            f"{owner}(prefix={prefix!r}): the prefix of the guide's parameter names must be a "
            "non-empty string that neither starts nor ends with a dot, e.g. prefix='logreg'"
        )
    return prefix


def _holds_store_tensors(guide: Any) -> bool:
    """Whether ``guide`` is set up and bound to tensors the store holds under its names."""
    if getattr(guide, "prototype_trace", None) is None:
        return False
    store = pyro.get_param_store()
    return any(
        name in store and param is store.get_param(name).unconstrained()
        for name, param in bound_parameters(guide).items()
    )


def claim_prefix(guide: Any) -> None:
    """Claim ``guide``'s prefix for its set-up; ``ValueError`` if another live guide holds it."""
    prefix = guide._pyro_name
    for attempt in range(2):
        refs = [r for r in _CLAIMS.get(prefix, []) if r() is not None and r() is not guide]
        others = [r() for r in refs]
        if not any(_holds_store_tensors(g) for g in others):
            break
        if attempt == 0:
            gc.collect()  # a dropped guide in a reference cycle holds no claim
            continue
        kind = type(guide).__name__
        raise ValueError(
            f"{kind}: another guide in this process already keeps its parameters under the "
            f"prefix {prefix!r} in Pyro's param store ({prefix}.*); two guides with one prefix "
            "would read and overwrite each other's parameters. Give each guide its own prefix, "
            f"e.g. {kind}(model, prefix='{prefix}_2'), or call pyro.clear_param_store() to start "
            "a new run without the old guide's parameters."
        )
    _CLAIMS[prefix] = [r for r in _CLAIMS.get(prefix, []) if r() is not None and r() is not guide]
    _CLAIMS[prefix].append(weakref.ref(guide))
