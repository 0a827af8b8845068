"""What the remainder kind admits (:func:`~pyro_cvi.blocks.registry.register_admission`).

A Gaussian block whose general (Monte Carlo) factors would take the gradient-only estimate
(``general_curvature="gradient"``, or ``"auto"`` above the dense-Hessian size) joins the
remainder's joint Gaussian (:mod:`pyro_cvi.model.remainder`); smaller blocks keep their exact
rows and Price's dense Hessian messages. Off (``AutoCVI(remainder="off")``) or in a
data-parallel run, the remainder admits nothing.
"""

from __future__ import annotations

from typing import Any, Dict

from ..context import Options
from ..messages.gaussian import gradient_only
from .registry import register_admission

__all__ = ["remainder_admits"]


def remainder_admits(options: Options) -> Dict[str, Any]:
    """``{"remainder": moves}``: ``moves(D)``, whether a Gaussian block of ``D`` coordinates
    with a general factor joins the remainder; ``None`` when the remainder takes nothing."""
    rem = options.remainder
    if rem is None or not rem.enabled or options.reducer is not None:
        return {"remainder": None}
    return {"remainder": lambda dim: gradient_only(options, dim)}


register_admission("remainder", remainder_admits)
