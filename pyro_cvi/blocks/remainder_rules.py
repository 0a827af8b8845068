"""The remainder kind's rules: what it admits (:func:`~pyro_cvi.blocks.registry.register_admission`)
and which step it takes by default.

A Gaussian block whose general (Monte Carlo) factors would take the gradient-only estimate
(``general_curvature="gradient"``, or ``"auto"`` above the dense-Hessian size) joins the
remainder's joint Gaussian (:mod:`pyro_cvi.model.remainder`); smaller blocks keep their exact
rows and Price's dense Hessian messages. Off (``AutoCVI(remainder="off")``) or in a
data-parallel run, the remainder admits nothing.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

import torch

from ..context import Options
from ..messages.gaussian import gradient_only
from ..strategies import Remainder
from .registry import register_admission

__all__ = [
    "remainder_admits",
    "log_joint_ops",
    "cheap_hessian",
    "price_beside",
    "HESSIAN_MAX_OPS",
    "LOWRANK_ONEDRAW_MOVE",
    "SCALED_HESSIAN_MAX_DIM",
]


def remainder_admits(options: Options) -> Dict[str, Any]:
    """``{"remainder": moves}``: ``moves(D)``, whether a Gaussian block of ``D`` coordinates
    with a general factor joins the remainder; ``None`` when the remainder takes nothing."""
    rem = options.remainder
    if rem is None or not rem.enabled or options.reducer is not None:
        return {"remainder": None}
    return {"remainder": lambda dim: gradient_only(options, dim)}


register_admission("remainder", remainder_admits)


#: Price's dense Hessians up to this many coordinates when a Gamma precision is kept beside
#: the remainder, or a remainder latent scales members Gaussian given the others: their
#: curvature scales with the precision, which moves between steps, so a running one-draw
#: curvature lags it while the Hessian at the step is exact
SCALED_HESSIAN_MAX_DIM = 64


def price_beside(strategy: Remainder, dim: int) -> bool:
    return strategy.curvature == "auto" and strategy.step is None and dim <= SCALED_HESSIAN_MAX_DIM


#: the default takes Price's dense Hessians only where the log joint is at most this many
#: autograd operations (a few vectorised tensor operations: a network layer, a cumulative sum);
#: a recursion or an ODE solver written as a Python loop records hundreds to thousands
HESSIAN_MAX_OPS = 256


def log_joint_ops(analysis, owned: Sequence[str]) -> int:
    """The number of autograd operations between the latents and the log joint of the
    factors ``owned`` (at the analysis' values): a property of how the model is written.

    Price's Hessian takes, besides the gradient's backward pass, a backward pass of the
    gradient's own graph batched over the ``D`` rows, and ``K`` draws: a fixed multiple of the
    work per operation. Where the log joint is a few vectorised operations that multiple is
    small beside a model run's fixed cost (Pyro's trace), and the Hessian is cheap by
    construction; where it is a long chain of small operations (a Python recursion, an ODE
    solver's steps) the chain is the cost, and the one-draw step (one gradient) is the
    default."""
    tr, _ = analysis.leaf_trace()
    total = None
    with torch.enable_grad():
        for name in owned:
            node = tr.nodes.get(name)
            if node is None or node.get("type") != "sample":
                continue
            lp = node["fn"].log_prob(node["value"]).sum()
            total = lp if total is None else total + lp
    if total is None or total.grad_fn is None:
        return 0
    seen, stack = set(), [total.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(f for f, _ in fn.next_functions)
    return len(seen)


def cheap_hessian(analysis, owned: Sequence[str]) -> bool:
    """Whether the log joint is short enough for Price's Hessians by default
    (:data:`HESSIAN_MAX_OPS`; a model whose trace cannot be read back keeps them)."""
    try:
        return log_joint_ops(analysis, owned) <= HESSIAN_MAX_OPS
    except (RuntimeError, ValueError, TypeError, KeyError, NotImplementedError):
        return True


#: the low-rank form's trust region under the one-draw step (largest move of a log s or W entry)
LOWRANK_ONEDRAW_MOVE = 0.2
