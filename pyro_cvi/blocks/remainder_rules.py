"""The remainder kind's rules: what it admits (:func:`~pyro_cvi.blocks.registry.register_admission`)
and which step it takes by default.

A Gaussian block whose general (Monte Carlo) factors would take the gradient-only estimate
(``general_curvature="gradient"``, or ``"auto"`` above the dense-Hessian size) joins the
remainder's joint Gaussian (:mod:`pyro_cvi.model.remainder`); smaller blocks keep their exact
rows and Price's dense Hessian messages. Off (``AutoCVI(remainder="off")``) or in a
data-parallel run, the remainder admits nothing.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.distributions import biject_to, constraints

from ..context import Options
from ..messages.gaussian import gradient_only
from ..strategies import Remainder
from .registry import register_admission

__all__ = [
    "remainder_admits",
    "log_joint_span",
    "log_joint_graph",
    "discrete_chain",
    "cheap_hessian",
    "price_beside",
    "DenseHessianRule",
    "VectorisedLogJoint",
    "DEFAULT_HESSIAN_RULE",
    "VECTORISED_MAX_SPAN",
    "PRICE_MAX_WORK",
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


class DenseHessianRule:
    """Whether the remainder's default step takes Price's dense Hessians (for a full form no
    larger than the sizes above): a property of how the model is written, never of timing.
    A subclass decides from the model's analysis and the factors the remainder owns."""

    def dense(self, analysis, owned: Sequence[str]) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError


class VectorisedLogJoint(DenseHessianRule):
    """Dense Hessians where the remainder's log joint is *vectorised*; the one-draw step
    (one gradient) where it is *sequential*.

    Price's Hessian (:func:`~pyro_cvi.gaussian.price.expected_hessian`) adds to the gradient
    a backward pass of the gradient's own graph, batched over its ``D`` rows and the draws:
    cheap where that graph is a few large vectorised operations, while on a long chain of
    small ones (a loop's steps) the per-operation cost of the batched second-order pass is the
    whole cost. A log joint is vectorised when its chain is set by its formula, not its data:

    1. its *span*, the longest chain of dependent autograd operations from a latent to the log
       joint of the owned factors (:func:`log_joint_span`), is at most
       :data:`VECTORISED_MAX_SPAN`. Sites batched over plates (a GLM's linear predictor, a
       network's layers, a hierarchy's ``mu + tau * eta``) keep the same span at any data
       size (12-21 operations on every such zoo model), a distribution's own scan
       (``DiscreteHMM``) grows with ``log T``; a recursion or an ODE solver written as a
       Python loop chains one step after another (250-2,100 on GARCH, ARMA,
       pharmacokinetic and Lotka-Volterra models);
    2. no summed-out discrete latent depends on another (:func:`discrete_chain`): a Markov
       chain of enumerated states (a ``pyro.markov`` loop) is contracted one step after
       another, whatever each site's span;
    3. the batched pass's work, ``D`` times the *size* of the log joint's graph (the elements
       of the tensors its operations hand back, :func:`log_joint_graph`), is at most
       :data:`PRICE_MAX_WORK`: on small data the per-operation cost dominates and the ``D``
       rows come almost free, on large data they cost ``D`` gradients' arithmetic.

    Opt in elsewhere with ``Remainder(curvature="hessian")``; opt out with
    ``Remainder(step=Horizon())`` or ``curvature="gradient"``.
    """

    def dense(self, analysis, owned: Sequence[str]) -> bool:
        if discrete_chain(analysis):
            return False
        try:
            span, size = log_joint_graph(analysis, owned)
            return span <= VECTORISED_MAX_SPAN and _dim(analysis) * size <= PRICE_MAX_WORK
        except (RuntimeError, ValueError, TypeError, KeyError, NotImplementedError):
            return True  # a trace that cannot be read back keeps them (as before)


#: the longest chain of dependent operations a vectorised log joint has (see
#: :class:`VectorisedLogJoint`; its measured spans are 12-21, a ``DiscreteHMM`` 87 at T = 40,
#: 124 at 400, 159 at 4,000; a GARCH recursion over 120 returns 253)
VECTORISED_MAX_SPAN = 192

#: the most work (coordinates times graph elements, :class:`VectorisedLogJoint`) the default
#: gives Price's batched Hessian pass. Measured (float32, one thread): the 42-coordinate
#: horseshoe logistic regression on 200 points (59,808) steps at 1.5x the four-draw gradient
#: step and reaches its bound in a fifth of the steps; on 2,000 points (437,808) at 4x, behind
#: it for the first 2 CPU s, 1.5 nats ahead after 6; on 20,000 (4.2 million) at 19x, 11 nats
#: behind after 8 CPU s. Every zoo model that takes Price is below 10^5
PRICE_MAX_WORK = 2**20

#: the rule :class:`~pyro_cvi.blocks.remainder.RemainderBlock` applies by default
DEFAULT_HESSIAN_RULE: DenseHessianRule = VectorisedLogJoint()


def _log_joint(analysis, owned: Sequence[str]):
    """The owned factors' log joint at the analysis' values (with its graph to the latents)."""
    tr, _ = analysis.leaf_trace()
    total = None
    with torch.enable_grad():
        for name in owned:
            node = tr.nodes.get(name)
            if node is None or node.get("type") != "sample":
                continue
            lp = node["fn"].log_prob(node["value"]).sum()
            total = lp if total is None else total + lp
    return total


def log_joint_span(analysis, owned: Sequence[str]) -> int:
    """The span of the owned factors' log joint: the number of autograd operations on the
    longest chain from a latent to it (0 where it does not depend on a latent)."""
    return log_joint_graph(analysis, owned)[0]


def log_joint_graph(analysis, owned: Sequence[str]) -> Tuple[int, int]:
    """``(span, size)`` of the owned factors' log joint: the span (:func:`log_joint_span`)
    and the number of elements of the tensors its autograd operations hand back (what a
    backward pass through it touches)."""
    total = _log_joint(analysis, owned)
    if total is None or total.grad_fn is None:
        return 0, 0
    span: Dict[Any, int] = {}
    size = 0
    stack: List[Tuple[Any, bool]] = [(total.grad_fn, False)]
    while stack:  # post-order: a node's inputs before the node
        fn, ready = stack.pop()
        if ready:
            if fn in span:
                continue
            span[fn] = 1 + max((span[f] for f, _ in fn.next_functions if f is not None), default=0)
            size += sum(math.prod(m.shape) for m in getattr(fn, "_input_metadata", ()))
        elif fn not in span:
            stack.append((fn, True))
            stack.extend(
                (f, False) for f, _ in fn.next_functions if f is not None and f not in span
            )
    return span[total.grad_fn], size


def _dim(analysis) -> int:
    """The remainder's coordinate count (its sites' unconstrained sizes)."""
    return sum(
        int(biject_to(analysis.structure.nodes[n]["fn"].support).inv(analysis.values[n]).numel())
        for n in analysis.remainder
    )


def discrete_chain(analysis) -> bool:
    """Whether a discrete latent the remainder sums out depends on another one (a Markov
    chain of enumerated states, contracted step by step)."""
    discrete = set(getattr(analysis, "remainder_discrete", ()))
    return any(analysis.deps.get(n, set()) & (discrete - {n}) for n in discrete)


def cheap_hessian(analysis, owned: Sequence[str]) -> bool:
    """Whether the default takes Price's Hessians: :data:`DEFAULT_HESSIAN_RULE`'s answer."""
    return DEFAULT_HESSIAN_RULE.dense(analysis, owned)


#: the low-rank form's trust region under the one-draw step (largest move of a log s or W entry)
LOWRANK_ONEDRAW_MOVE = 0.2


def holds_every_latent(analysis, owned: Sequence[str]) -> bool:
    """Every latent is one of ``owned`` and no plate is subsampled: the step's trace at ``q``
    has no other free site, so the remainder need not read it. (A discrete latent summed out
    in the remainder is drawn in that trace, part of the run's random stream: such a model
    keeps reading it.)"""
    return set(analysis.values) <= set(owned) and all(
        node["fn"].subsample_size in (None, node["fn"].size)
        for n, node in analysis.structure.nodes.items()
        if n in analysis.subsample
    )


def is_real_support(c) -> bool:
    """A support that is the real line (under ``independent`` wrappers)."""
    while isinstance(c, constraints.independent):
        c = c.base_constraint
    return c is constraints.real
