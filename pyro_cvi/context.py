"""The state of one CVI step, passed as an argument through the pipeline.

A :class:`StepContext` is made by the engine when a loss is evaluated and consumed by the
optimizer's step: the model's arguments, the minibatch (subsample indices of every subsampled
plate, one draw per step), the trace of the model at the current ``q`` (natural-form latents at
their means, Gaussian blocks at a fixed point), and a sampler of the current ``q``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch

#: the model keyword under which an ``AutoGuideList`` passes its other parts' values to the
#: AutoCVI part (:mod:`pyro_cvi.methods.guide_list`): its ELBO keeps its graph to them
GIVEN = "_cvi_other_parts"

__all__ = ["StepContext", "Options"]


@dataclass
class Options:
    """The guide's numerical options (see :class:`~pyro_cvi.AutoCVI`)."""

    covariance: str = "full"
    num_quad_points: int = 32
    num_samples: Optional[int] = None
    num_general_samples: int = 8
    init_sites: str = "laplace"
    schedule: Any = "parallel"
    vectorize_particles: bool = False
    #: ``{site: family name}`` overrides of the q family (``"gaussian"``: on the unconstrained
    #: space), see :func:`~pyro_cvi.families.choose_family`
    families: Optional[Dict[str, str]] = None
    #: ``"auto"``, ``"collapse"`` or ``"mean_field"``: which discrete latents are summed out
    discrete: str = "auto"
    #: initial spread of natural-form sites (``None``: the prior's)
    init_scale: Optional[float] = None
    #: sums row statistics and ELBO terms over the ranks of a data-parallel run
    #: (:class:`pyro_cvi.scale.distributed.Reducer`); ``None`` for one process
    reducer: Any = None
    softmax: str = "cubature"
    #: curvature of general factors on Gaussian blocks: ``"hessian"`` (dense Price),
    #: ``"gradient"`` (Stein's lemma, gradients only) or ``"auto"`` (by the block's dimension)
    general_curvature: str = "auto"
    #: the remainder's strategy (:class:`~pyro_cvi.blocks.remainder.Remainder`); ``None``: off
    remainder: Any = None


@dataclass
class StepContext:
    model: Callable
    args: Tuple
    kwargs: Dict
    subsample: Dict[str, torch.Tensor] = field(default_factory=dict)
    trace: Any = None
    #: ``exclude -> {site: value}``: one joint draw of every non-leaf latent from the current q
    #: (minibatch-restricted), except the sites in ``exclude``
    sample_q: Optional[Callable] = None
    #: ``name -> Distribution``: the current ``q`` of latent ``name`` (its block's marginal)
    marginal: Optional[Callable] = None
    #: ``name -> Block``: the block that holds latent ``name`` (its joint ``q``)
    block_for: Optional[Callable] = None
    #: ``() -> trace``: the model traced again at the current q (the sequential schedule)
    retrace: Optional[Callable] = None
    #: ``StepReport -> None``: counts (and warns about) a step taken inside the loss
    report: Optional[Callable] = None
    grads: bool = False
    #: the ELBO's graph to the model's parameters is wanted (``loss_and_grads``,
    #: ``differentiable_loss``): Gaussian blocks then re-solve ``q`` from the prior and their
    #: sites with graph, so the gradient is that of the loss at fixed site parameters
    graph: bool = False
    #: identifies the data (the arguments' identities, versions and shapes)
    data_key: Any = None
    #: the variance of the loss's Monte Carlo part (``None``: the loss is exact), summed over
    #: the Monte Carlo estimators that ran (for the step control, :mod:`~pyro_cvi.step_control`)
    mc_var: Optional[float] = None
    #: the ELBO value of the loss computed in this context (set by the engine): the value the
    #: step control decides on
    elbo: Optional[float] = None
    #: what the reported loss adds to :attr:`elbo`: a block whose report is an estimate
    #: independent of the step's draws (the remainder's report pairs) adds ``report - its own
    #: term``, so that the step control's accept decision never selects the reported value
    report_shift: float = 0.0
    #: the steps the guide has taken (its counter, saved in checkpoints)
    steps: int = 0
    #: the step's ceiling: the adaptive step's ``max_beta``, or the fixed step size
    max_beta: Optional[float] = None

    def add_mc_samples(self, values: torch.Tensor) -> None:
        """Record the i.i.d. per-sample values whose mean is a Monte Carlo term of the loss."""
        values = values.detach().reshape(-1)
        var = float(values.var()) / values.numel() if values.numel() > 1 else float("inf")
        self.mc_var = (self.mc_var or 0.0) + var
