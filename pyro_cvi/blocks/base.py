"""The block protocol: one parameterisation of part of ``q`` that owns its messages.

Every kind of ``q`` is a :class:`Block` (docs/architecture.md). The engine
(:mod:`pyro_cvi.engine`) loops over its blocks without knowing their kinds:

* ``setup(init)``: register the block's parameters in Pyro's param store (Algorithm 1/2's
  start), from the :class:`BlockInit` of the guide's first call;
* ``initialise(ctx, fresh)``: optional work once ``q`` exists (e.g. sites at the prior mean);
* ``messages(ctx) -> ELBO terms``: re-read the prior and the factors from the step's trace
  (``refresh``), compute the block's messages and return the ELBO terms the block owns; with
  ``ctx.grads`` the natural targets are delivered as ``.grad = target - lambda`` on the block's
  parameters (the natural gradient of eq. 12, which :class:`~pyro_cvi.CVI` applies);
* ``step(beta, ctx) -> [StepReport]``: ``lambda <- lambda + beta (target - lambda)`` with the
  one update policy of :mod:`~pyro_cvi.update` (shrink until valid, reject after the halvings);
* ``sweep(name, ctx, beta, done)``: the sequential (coordinate-ascent) schedule's step of the
  latent ``name``;
* ``valid()``, ``trace_values(subsample)``, ``sample(subsample, exclude, at_means)``,
  ``marginal(name)``, ``joint(names)``: the current ``q``;
* ``incoming(analysis) -> [Incoming]``: the factors that send the block messages, each with
  its rule of Algorithm 2 (exact expected, Monte Carlo expected, or CVI sites):
  ``guide.explain()`` prints them per block.

A new kind of block is one class deriving from :class:`Block` plus one registration
(:mod:`~pyro_cvi.blocks.registry`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, List, NamedTuple, Optional, Sequence, Tuple

import pyro
import torch

from ..context import StepContext
from ..model.explain import MESSAGE_RULES
from ..update import StepCounts
from .marginals import marginal_median

__all__ = [
    "Block",
    "BlockInit",
    "GuideDraw",
    "Incoming",
    "StepReport",
    "stored",
]


def stored(name: str) -> torch.Tensor:
    """``pyro.param(name)`` of a parameter already in the param store, read from the store
    directly: the same tensor, without a trip through the effect handlers. (The engine
    declares its parameters with ``pyro.param`` once per step with gradients, where
    ``SVI.step`` captures them; every other read in a step needs no handler.) A parameter the
    store has handed out as its own constrained value (an identity transform: unconstrained)
    is returned as it is, without the transform."""
    store = pyro.get_param_store()
    params = getattr(store.keys(), "mapping", None)  # (the store's own dict, read-only)
    value = params.get(name) if params is not None else None
    if value is not None:
        ref = value.__dict__.get("unconstrained")
        if ref is not None and ref() is value:
            return value  # (what ``store[name]`` returns: the identity transform of itself)
    return store[name]


class Incoming(NamedTuple):
    """One message a block receives: from factor ``factor`` to its latent ``latent`` (a site,
    or the block's label for a joint block), by ``rule``: ``"exact expected"`` (the closed-form
    expected natural parameter, VMP), ``"Monte Carlo expected"`` (the same averaged over draws
    of the neighbours) or ``"sites"`` (CVI sites or Monte Carlo gradients: not conjugate);
    ``note``: ``(kind, why)`` where the block's message is not the one the analysis's record
    describes (``explain()`` prints it instead)."""

    factor: str
    latent: str
    rule: str
    note: Optional[Tuple[str, str]] = None


class StepReport(NamedTuple):
    """What one step did to one part of a block: its label (a site or a block), the kind of
    parameter (``"precision"`` or a family name), the step size and the counts."""

    label: str
    kind: str
    beta: float
    counts: StepCounts


@dataclass
class GuideDraw:
    """What a block needs to sample its sites inside the guide (``AutoCVI.forward``)."""

    #: the guide's param-store prefix (names of auxiliary sites)
    prefix: str
    #: ``name -> context manager``: the guide's plates around latent site ``name``
    plates: Callable[[str], ContextManager]
    #: ``q -> q``: the identity, or ``q`` with detached tensors under ``torch.jit.trace``
    frozen: Callable[[Any], Any]
    #: the subsample indices of the step's subsampled plates
    subsample: Dict[str, torch.Tensor]
    #: ``name -> number of event dims`` of latent site ``name``
    event_dim: Callable[[str], int]


@dataclass
class BlockInit:
    """What a block may read when it registers its parameters (the guide's first call)."""

    #: latent values of the analysis trace (a prior draw)
    values: Dict[str, torch.Tensor]
    #: the guide's prototype trace, and a trace at ``init_loc_fn``'s values (or ``None``)
    prototype_trace: Any = None
    init_trace: Any = None
    init_loc_fn: Optional[Callable] = None
    init_scale: Optional[float] = None
    #: a trace at ``init_loc_fn``'s values, else at the prior medians (Pyro's autoguides' start)
    median_trace: Any = None
    #: without ``init_loc_fn``, a trace at the prior means (each site's parents at theirs)
    mean_trace: Any = None


class Block(abc.ABC):
    """One parameterisation of part of ``q`` with its messages (see the module docstring)."""

    #: the latent sites whose ``q`` this block holds
    names: Tuple[str, ...] = ()
    #: whether the point at which the step's trace is taken moves with ``q`` (else the model
    #: is traced once per data when nothing else changes between steps)
    moves_trace: bool = False
    #: whether a non-parallel schedule steps the block's latents one by one (coordinate ascent)
    sweeps: bool = False
    #: whether its ``q`` is drawn before the other blocks' (the order of the random stream)
    draws_first: bool = False
    #: the set-up traces it reads from :class:`BlockInit`: ``"init"`` (at ``init_loc_fn``'s
    #: values, when one is given), ``"median"`` (at ``init_loc_fn``'s values, else the medians),
    #: ``"mean"`` (without ``init_loc_fn``: at the prior means)
    setup_traces: Tuple[str, ...] = ()
    #: whether :meth:`joint` of several of its sites is a Gaussian (``guide.joint_posterior``)
    gaussian_joint: bool = False
    #: whether its start is its first step (the Laplace start of a softmax regression): the
    #: first call then leaves ``q`` there, when every block's start is
    start_is_step: bool = False

    @property
    def label(self) -> str:
        """A name for messages and warnings (the block's sites)."""
        return "+".join(self.names)

    @property
    def labels(self) -> List[str]:
        """The labels a failed step names (one per independently stepped part)."""
        return [self.label]

    # ------------------------------------------------------------------ parameters
    @abc.abstractmethod
    def param_names(self) -> List[str]:
        """The param-store names of the block's CVI parameters."""

    @abc.abstractmethod
    def setup(self, init: BlockInit) -> None:
        """Register the parameters (kept as they are when already in the param store)."""

    def initialise(self, ctx: StepContext, fresh: bool) -> None:
        """Work once the parameters exist (``fresh``: none came from a checkpoint)."""
        return None

    def continue_from(self, previous: Optional[Block], values: Dict[str, torch.Tensor]) -> None:
        """New data: the block replaces ``previous`` (the same label, re-analysed); ``values``
        are the new analysis trace's latent values."""
        return None

    # ------------------------------------------------------------------ messages and steps
    @abc.abstractmethod
    def messages(self, ctx: StepContext) -> torch.Tensor:
        """The ELBO terms this block owns at the current ``q``; with ``ctx.grads`` its natural
        targets are written as ``.grad = target - lambda`` on its parameters."""

    @abc.abstractmethod
    def step(self, beta: float, ctx: Optional[StepContext] = None) -> List[StepReport]:
        """Apply eq. 12 with step size ``beta`` to the targets held in ``.grad``."""

    def sweep(self, name: str, ctx: StepContext, beta: float, done: set) -> List[StepReport]:
        """The sequential schedule reaches latent ``name``: message and step (default: the
        whole block, once per sweep; ``done`` holds the blocks already stepped)."""
        if id(self) in done:
            return []
        done.add(id(self))
        ctx.trace = ctx.retrace()
        ctx.grads = True
        self.messages(ctx)
        return self.step(beta, ctx)

    def steppers(self) -> Dict[str, Block]:
        """``latent name -> the block that steps it`` in the sequential schedule (default:
        this block for each of its sites; a group of blocks returns its members)."""
        return {n: self for n in self.names}

    def natural_targets(self, ctx: StepContext) -> Dict[str, Any]:
        """The Algorithm 2 targets of its natural-parameter latents at the current ``q``
        (no step; default: none)."""
        return {}

    def state_objects(self) -> List[Any]:
        """Objects besides the block whose attributes a step rebinds (e.g. a step-size
        control): a transaction snapshots and restores them with the block."""
        return []

    def forget(self) -> None:
        """The parameters were set from outside (a step undone): rebuild ``q`` from them."""
        return None

    def valid(self) -> bool:
        """Whether every natural parameter of the block is valid (finite, in its domain)."""
        return all(bool(torch.isfinite(pyro.param(n).detach()).all()) for n in self.param_names())

    def incoming(self, analysis: Any) -> List[Incoming]:
        """The messages the block receives (see :class:`Incoming`); default: the analysis's
        record of each factor touching the block's sites, by its kind's rule
        (:data:`~pyro_cvi.model.explain.MESSAGE_RULES`). A kind whose messages differ from
        its records' kinds overrides it."""
        names = set(self.names)
        records = [f for info in analysis.latents.values() for f in info.factors]
        records += list(getattr(analysis, "remainder_factors", []))
        # a factor with a record for one of the block's sites speaks for itself; a joint
        # block's records (latent: the block) only for sites that have none
        own = {f.site for f in records if f.latent in names}
        # a factor with a record addressed to the block itself: that record's rule (another
        # block's record of the same factor is that block's message)
        mine = {f.site for f in records if f.latent == self.label}
        others = {b.label for b in getattr(analysis, "blocks", ())} - {self.label}
        out: List[Incoming] = []
        for f in records:
            rule = MESSAGE_RULES.get(f.kind)
            if rule is None:
                continue
            if f.latent in names:
                latent = f.latent
            elif (
                f.latent not in analysis.latents
                and f.site not in own
                and (f.site not in mine or f.latent == self.label)
                and f.latent not in others
                and analysis.latents_of(f.site) & names
            ):
                latent = self.label
            else:
                continue
            item = Incoming(f.site, latent, rule)
            if item not in out:
                out.append(item)
        return out

    # ------------------------------------------------------------------ the current q
    @abc.abstractmethod
    def trace_values(self, subsample: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Latent values at which the step's trace is taken."""

    @abc.abstractmethod
    def sample(
        self,
        subsample: Dict[str, torch.Tensor],
        exclude: Sequence[str] = (),
        at_means: bool = False,
    ) -> Dict[str, torch.Tensor]:
        """One joint draw (or the means) of the block's latents outside ``exclude``."""

    @abc.abstractmethod
    def marginal(self, name: str) -> torch.distributions.Distribution:
        """``q`` of latent ``name`` as a torch Distribution."""

    def joint(self, names: Optional[Sequence[str]] = None) -> torch.distributions.Distribution:
        """The joint ``q`` of ``names`` (default: the whole block)."""
        if names is not None and len(names) == 1:
            return self.marginal(names[0])
        raise ValueError(f"block {self.label!r} has no joint q over {names}")

    def joint_sample(self) -> torch.Tensor:
        """One draw of the whole block's joint ``q`` (flattened, concatenated)."""
        return self.joint().sample()

    def mean_values(self) -> Dict[str, torch.Tensor]:
        """``E_q`` of each of the block's sites (default: its marginal's mean)."""
        return {n: self.marginal(n).mean.detach() for n in self.names}

    def variance_along(self, parts: Dict[str, torch.Tensor]) -> torch.Tensor:
        """``Var_q(sum_n A_n z_n)`` over the block's sites ``n`` (``A_n``: ``(R, size of n)``),
        e.g. the variance of a linear predictor that the mean field reads (default: the sites
        independent, each with its marginal's variances)."""
        total = None
        for n, A in parts.items():
            var = self.marginal(n).variance.detach().reshape(-1).to(A)
            term = (A * A) @ var
            total = term if total is None else total + term
        return total

    # ------------------------------------------------------------------ the guide's methods
    def guide_sample(self, name: str, draw: GuideDraw) -> Dict[str, torch.Tensor]:
        """Sample, inside the guide, what the block draws when the model order reaches latent
        ``name`` (default: that site from its marginal, in its plates). A block that draws its
        sites jointly returns all of them at its first site."""
        with draw.plates(name):
            return {name: pyro.sample(name, draw.frozen(self.marginal(name)))}

    def median_values(self) -> Dict[str, torch.Tensor]:
        """The median of each of the block's sites (default: its marginal's)."""
        return {n: marginal_median(self.marginal(n)).detach() for n in self.names}

    def packed_factors(self) -> List[Tuple[Sequence[str], Sequence[torch.Size], Any, bool]]:
        """``(names, unconstrained shapes, q, joint)`` per factor of ``q`` over the packed
        unconstrained latent (``guide.get_posterior()``; default: one per continuous site)."""
        out = []
        for n in self.names:
            q = self.marginal(n)
            if not q.support.is_discrete:
                out.append(((n,), (q.batch_shape + q.event_shape,), q, False))
        return out

    def extra_state(self) -> Dict[str, Any]:
        """State besides the param store that an exact resume needs (tensors and plain
        values, for a safe checkpoint); default: none."""
        return {}

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`extra_state` (from a checkpoint)."""
        return None
