"""The CVI engine: one pipeline from a model's traces to ``q`` (see docs/architecture.md).

    trace -> analyse factors -> blocks: messages per factor -> one update -> q
             (model/)           (blocks/, messages/)         (update.py)

An :class:`Engine` belongs to one :class:`~pyro_cvi.AutoCVI` guide. It owns the blocks
(:class:`~pyro_cvi.blocks.base.Block`: the Gaussian site blocks of Algorithm 1, Markov chains,
and the mean-field block of Algorithm 2) and loops over them without knowing their kinds: it
assembles the ELBO so that every factor is counted exactly once (its owner is decided by the
analysis), lets every block write its natural gradients ``target - lambda`` into ``.grad``, and
takes the step with the schedule: ``parallel`` (every block from the same ``q_t``), ``sequential``
(coordinate ascent; with exact factors and ``beta = 1`` it is CAVI) or a list of site names;
inside a subsampled plate the local natural blocks first take a full (``beta = 1``) update for
the minibatch (doubly stochastic CVI, Hoffman et al. 2013).

Model runs per step (parallel schedule): one trace at the current means (where a block reads
it, or what the model reads changed: :func:`~pyro_cvi.model.signature.model_state`), plus for the
mean-field part one enumerated trace at the means (and one at the geometric means where a Gamma
latent enters a rate), plus ``num_general_samples`` traces per Monte Carlo message (one if
vectorised), plus ``num_general_samples`` per Gaussian block with general factors.
"""

from __future__ import annotations

from functools import partial
from typing import Dict, List, Optional

import pyro
import torch
from pyro.infer.autoguide.initialization import init_to_mean, init_to_median

from .blocks import Block, BlockInit, Found, StepReport, build_blocks, init_messenger, stored
from .blocks.constant_terms import elbo_terms
from .blocks.registry import analysis_options
from .blocks.seen_params import recorded, watched
from .context import GIVEN, Options, StepContext
from .model.analysis import Analysis
from .model.signature import check_signature, closure_key, data_key, model_state, signature
from .model.tracing import DeferredTrace, is_random, trace_model
from .model.validation import check_analysis, check_observations, check_structure, per_index
from .step_control import (
    Snapshot,
    StepControl,
    WarningLog,
    backtrack_message,
    controlled_evaluation,
    initial_failure,
    initial_failures,
    is_numerical_error,
    warn_step_counts,
)
from .update import StepCounts, register_owner

__all__ = ["Engine"]
_ONE = torch.ones((), dtype=torch.float64)  # (the step counter's increment: no Python 1 wrapped)


class Engine:
    """The CVI pipeline of one guide (see the module docstring)."""

    def __init__(self, model, prefix: str, options: Options):
        self.model, self.prefix, self.options = model, prefix, options
        self.analysis: Optional[Analysis] = None
        #: every block, in the order of the ELBO and the step (the kinds' ranks:
        #: :mod:`~pyro_cvi.blocks.registry`)
        self.blocks: List[Block] = []
        #: whether every continuous latent gets a q of its own (a start at init_loc_fn's values)
        self.own_leaves = False
        #: the same blocks by the name of the kind that built them
        self.kinds: Dict[str, List[Block]] = {}
        #: latent name -> the block that steps it in the sequential schedule
        self.stepper: Dict[str, Block] = {}
        self.pending: Optional[StepContext] = None
        self.last_mc_var: Optional[float] = None  # (the last loss's Monte Carlo variance)
        self.counts = StepCounts()
        self.warnings = WarningLog()
        self.data_key = None
        # model_state at the last structure check (skipped while it holds), this step's, and
        # at the last comparison of the data key
        self._checked, self._state_for, self._data_state = None, None, None
        #: the adaptive step control (``CVI(step_size="auto")``), made by the first auto step
        self.control: Optional[StepControl] = None
        self.steps_name = f"{prefix}.num_steps"

    # ------------------------------------------------------------------ set-up
    def setup(self, args, kwargs, prototype_trace, init_loc_fn=None, subsample=None) -> None:
        """Analyse the model and register every block's parameters. Parameters already in the
        param store (a restored checkpoint) are kept as they are."""
        store = pyro.get_param_store()
        fresh = not any(k.startswith(self.prefix + ".") for k in store.keys())
        # a start at init_loc_fn's values needs a q of its own at every latent (no leaves)
        self.own_leaves = init_loc_fn is not None
        self._analyse(args, kwargs, prototype_trace)
        an = self.analysis
        if self.options.reducer is not None:  # data-parallel: rank 0's parameters everywhere
            self.options.reducer.setup(an, store.named_parameters(), self.prefix)
        init_trace = start_trace = None
        wanted = {t for b in self.blocks for t in b.setup_traces}
        if init_loc_fn is not None and "init" in wanted:
            model = init_messenger(init_loc_fn)(self.model)
            init_trace = pyro.poutine.trace(model).get_trace(*args, **kwargs)
        if "median" in wanted:
            model = init_messenger(init_loc_fn or init_to_median)(self.model)
            with initial_failures():
                start_trace = pyro.poutine.trace(model).get_trace(*args, **kwargs)
        mean_trace = None
        if "mean" in wanted and init_loc_fn is None:
            with initial_failures():
                mean_trace = pyro.poutine.trace(init_messenger(init_to_mean)(self.model)).get_trace(
                    *args, **kwargs
                )
        start = (init_trace, init_loc_fn, self.options.init_scale, start_trace, mean_trace)
        init = BlockInit(an.values, prototype_trace, *start)
        for block in self.blocks:
            block.setup(init)
        floats = (v for v in an.values.values() if v.is_floating_point())
        like = next(floats, torch.zeros(()))  # (a discrete latent's value is an integer)
        pyro.param(self.steps_name, lambda: torch.zeros((), dtype=like.dtype, device=like.device))
        self._tag_params()  # known to CVI() from the start, whatever the loss
        # the data just analysed (the context reads its state; the first step's new_data
        # finds it the same: no reanalysis, no RNG states saved)
        state = model_state(self.model, args, kwargs)
        self._state_for = (args, kwargs, state)
        with torch.no_grad():
            ctx = self.context(args, kwargs, subsample or {}, grads=False)
            for block in self.blocks:
                block.initialise(ctx, fresh)
        self._data_state = state

    def _analyse(self, args, kwargs, prototype_trace) -> None:
        o, self.seen = self.options, None  # (the parameters as the engine left them: none yet)
        with torch.enable_grad():  # (its probes differentiate, also under evaluate_loss)
            an = Analysis(
                self.model,
                args,
                kwargs,
                prototype_trace,
                o.covariance,
                o.families,
                o.discrete,
                own_leaves=self.own_leaves,
                **analysis_options(o),  # (what the kinds admit: blocks/registry.py)
            )
        self.analysis = an
        self.data_key = data_key(args, kwargs) + closure_key(self.model)
        self._data_held = (args, kwargs)  # (the key's identities stay unique while held)
        self._checked = self._data_state = None
        self.signature = None  # of the first step's trace (model/signature.py)
        # the sample sites, and which are observed (the analysis trace conditions the latents)
        self.structure = {
            n: n not in an.values
            for n, s in an.structure.nodes.items()
            if is_random(s) and not per_index(s)
        }
        check_analysis(an, self.structure, args, kwargs)
        found = Found(an, self.prefix, self.options, self.sequential_order)
        self.kinds = build_blocks(found)
        self.blocks = list(found.built)
        self.stepper = {n: s for b in self.blocks for n, s in b.steppers().items()}
        # A model with no learnable parameter, no natural-form latent and no subsampling has
        # the same trace at the blocks' fixed point every step: it is traced once per data.
        self._has_params = any(s["type"] == "param" for s in an.structure.nodes.values())
        self.minibatch = any(
            s["type"] == "sample"
            and s["name"] in an.subsample
            and s["fn"].subsample_size not in (None, s["fn"].size)
            for s in an.structure.nodes.values()
        )
        self._static = (
            not self.minibatch
            and not self._has_params
            and not any(b.moves_trace for b in self.blocks)
        )
        self._static_trace = None
        self._deferrable = not self.minibatch and not self._has_params  # (trace when read)

    def block_for(self, name: str) -> Block:
        """The block that holds the ``q`` of latent site ``name`` (``KeyError``: none, a leaf
        or a summed-out site)."""
        for block in self.blocks:
            if name in block.names:
                return block
        raise KeyError(f"{name!r} is held by no block (a leaf, or summed out)")

    block_of = block_for

    def natural_targets(self, args, kwargs, subsample=None) -> Dict:
        """The Algorithm 2 targets of every natural-parameter latent at the current q."""
        ctx = self.context(args, kwargs, subsample or {}, grads=False)
        out: Dict = {}
        for block in self.blocks:
            out.update(block.natural_targets(ctx))
        return out

    def param_names(self) -> List[str]:
        return [n for b in self.blocks for n in b.param_names()]

    # ------------------------------------------------------------------ the owner protocol
    # (what the CVI optimizer asks: pyro_cvi.update.NaturalGradientOwner)
    @property
    def reducer(self):
        return self.options.reducer

    def has_pending_step(self) -> bool:
        return self.pending is not None

    def pending_loss(self):
        ctx = self.pending
        if ctx is None or ctx.subsample or self.minibatch:
            return None
        return ctx.elbo, ctx.mc_var

    def step_labels(self) -> List[str]:
        return [label for b in self.blocks for label in b.labels]

    def params_missing(self) -> bool:
        """Whether the param store lost this engine's parameters (``pyro.clear_param_store()``)."""
        store = pyro.get_param_store()
        return self.steps_name not in store or any(n not in store for n in self.param_names())

    def invalidate(self) -> None:
        """The parameters were set from outside (a checkpoint): drop every cached ``q``."""
        self.pending, self.control, self._static_trace = None, None, None
        self._checked = self.seen = None
        for block in self.blocks:
            block.forget()

    def new_data(self, args, kwargs) -> bool:
        """Whether the model may read other data than at the last step (``False``: its
        :func:`~pyro_cvi.model.signature.model_state` is the one last seen), in which case
        :meth:`reanalyse_if_new_data` has nothing to do. The key is kept for this step."""
        state = model_state(self.model, args, kwargs)
        self._state_for = (args, kwargs, state)
        # (it names every tensor the data key names: those are the same too)
        return state is None or state != self._data_state

    def reanalyse_if_new_data(self, args, kwargs, prototype) -> None:
        """New data (other tensors): the affine coefficients are re-probed (on the trace
        ``prototype(args, kwargs)``); the site parameters are kept, so the number of data
        points must not change."""
        pending = self._state_for
        if pending is None or pending[0] is not args or pending[1] is not kwargs:
            self.new_data(args, kwargs)
        state = self._state_for[2]
        if state is not None and state == self._data_state:
            return
        key = data_key(args, kwargs) + closure_key(self.model)  # (closure data too)
        if key != self.data_key:
            old = {b.label: b for b in self.blocks}
            self._analyse(args, kwargs, prototype(args, kwargs))
            for block in self.blocks:
                block.continue_from(old.get(block.label), self.analysis.values)
        self._data_state = state

    def _tag_params(self) -> None:
        """Register this engine's parameters; ``pyro.param`` lets SVI capture them (the step
        counter only where it is the only one: SVI finds the engine by any)."""
        register_owner(stored(self.steps_name).unconstrained(), self)
        for name in self.param_names() or [self.steps_name]:
            register_owner(pyro.param(name).unconstrained(), self)

    # ------------------------------------------------------------------ the current q
    def trace_values(self, subsample) -> Dict[str, torch.Tensor]:
        """Latent values for the step's trace: natural-form latents at their means (discrete:
        the mode); Gaussian blocks at a fixed point (their factors are affine in them, so the
        point does not matter, and a fixed one keeps the offsets ``c`` bitwise stable, which
        makes checkpoint/resume exact)."""
        values = {}
        for block in self._sampling_order():
            values.update(block.trace_values(subsample))
        return values

    def _sampling_order(self) -> List[Block]:
        # the order in which q is drawn (the random stream) is part of a run
        return [b for b in self.blocks if b.draws_first] + [
            b for b in self.blocks if not b.draws_first
        ]

    def sample_q(self, subsample, exclude=(), at_means: bool = False) -> Dict[str, torch.Tensor]:
        """One joint draw (or the means) of every non-leaf latent outside ``exclude``."""
        out = {}
        for block in self._sampling_order():
            out.update(block.sample(subsample, exclude, at_means))
        out.update(subsample)
        return out

    def context(self, args, kwargs, subsample, grads: bool, graph: bool = False) -> StepContext:
        kw = dict(grads=grads, graph=grads or graph, data_key=self.data_key)
        ctx = StepContext(self.model, args, kwargs, dict(subsample), **kw)
        ctx.steps = int(stored(self.steps_name)) if self.steps_name in pyro.get_param_store() else 0
        # (no closure over ctx: a context in a reference cycle would wait for the collector)
        ctx.sample_q = partial(self.sample_q, ctx.subsample)
        ctx.marginal = lambda name: self.block_for(name).marginal(name)
        ctx.block_for = self.block_for
        ctx.retrace = partial(self._trace, args, kwargs, ctx.subsample)
        ctx.report = self._report
        state = self._model_state(args, kwargs)
        if state is not None and state == self._checked and not ctx.subsample:
            # the model reads what it read when its structure was last checked
            ctx.trace = self._static_trace
            if ctx.trace is None:  # (read by a block, it is traced and checked then)
                ctx.trace = DeferredTrace(lambda: self._checked_trace(ctx))
            return ctx
        if self._static_trace is not None and not ctx.subsample:
            fresh = self._trace(args, kwargs, ctx.subsample)  # (a changed model is seen)
            check_structure(fresh, self.structure)
            check_signature(fresh, self.signature)
            ctx.trace = self._static_trace
        else:
            ctx.trace = self._checked_trace(ctx)
            if self._static:
                self._static_trace = ctx.trace
        if self._static_trace is not None or self._deferrable:
            self._checked = None if ctx.subsample else state
        return ctx

    def _model_state(self, args, kwargs):
        """``model_state`` of this step's arguments (:meth:`reanalyse_if_new_data`'s, once)."""
        pending, self._state_for = self._state_for, None
        if pending is not None and pending[0] is args and pending[1] is kwargs:
            return pending[2]
        return model_state(self.model, args, kwargs)

    def _checked_trace(self, ctx: StepContext):
        """The model traced at the current q, its observations and structure checked."""
        trace = self._trace(ctx.args, ctx.kwargs, ctx.subsample)
        check_observations(trace, self.structure)
        if self.signature is None:
            self.signature = signature(trace)
        check_signature(trace, self.signature)
        return trace

    def _trace(self, args, kwargs, subsample):
        """The model traced at the current q (:meth:`trace_values`) and the step's minibatch."""
        values = {**self.trace_values(subsample), **subsample}
        return trace_model(self.model, values, args, kwargs)

    # ------------------------------------------------------------------ the loss
    @watched  # (parameters set from outside since the engine's last write: q afresh)
    def loss(self, args, kwargs, subsample, grads: bool, graph: bool = False) -> torch.Tensor:
        """The ELBO of the current q (exact where closed forms exist, an unbiased estimate
        otherwise); with ``grads``, the natural gradients of every block are written and the
        step's context is kept for :meth:`step`. (Autograd is on inside, also under
        ``torch.no_grad()`` as in ``SVI.evaluate_loss``: quadrature and the mean-field
        messages differentiate expectations.)"""
        if not torch.is_grad_enabled():  # (entered only where it is off: the common case
            with torch.enable_grad():  # is SVI.step, under grad mode)
                return self.loss(args, kwargs, subsample, grads, graph)
        if grads and self.control is not None:
            return self._controlled_loss(args, kwargs, subsample)
        try:
            return self._loss(args, kwargs, subsample, grads, graph)
        except (ValueError, RuntimeError, FloatingPointError) as e:
            if not is_numerical_error(e) or not grads:
                raise
            if float(pyro.param(self.steps_name).detach()) == 0:
                raise initial_failure(e) from e
            raise ValueError(
                "AutoCVI: q became invalid after a fixed-size CVI step (a numerical "
                f"failure: {str(e).splitlines()[0][:200]}). Use the adaptive default "
                "CVI() (step_size='auto'), which undoes and shrinks such steps, or a "
                "smaller step_size."
            ) from e

    # ------------------------------------------------------------------ step control
    def _param_values(self) -> Dict[str, torch.Tensor]:
        return {n: stored(n).unconstrained().detach().clone() for n in self.param_names()}

    def _restore(self, values: Dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, v in values.items():
                stored(n).unconstrained().copy_(v)
        for block in self.blocks:
            block.forget()

    def enable_control(self, max_beta: float, state: Optional[Dict] = None) -> StepControl:
        """Switch on the adaptive step (:mod:`~pyro_cvi.step_control`); the pending loss's
        point becomes the first accepted one (or ``state`` is restored, from a checkpoint)."""
        if self.control is None:
            self.control = StepControl(max_beta=max_beta)
            if state is not None:
                self.control.load(state)
                return self.control
            ctx = self.pending
            self.control.start(ctx is not None and ctx.mc_var is not None)
            if ctx is not None and ctx.elbo is not None:
                snap = Snapshot(self._param_values(), ctx.elbo, ctx.mc_var)
                self.control.accepted(snap, comparable=not (ctx.subsample or self.minibatch))
        return self.control

    def _controlled_loss(self, args, kwargs, subsample) -> torch.Tensor:
        """The loss with :func:`~pyro_cvi.step_control.controlled_evaluation` (backtracking)."""

        def evaluate():
            elbo = self._loss(args, kwargs, subsample, True)
            return elbo, self.pending.mc_var

        return controlled_evaluation(
            self.control,
            evaluate,
            self._param_values,
            self._restore,
            comparable=not (subsample or self.minibatch),
            hybrid=self._has_params,
            warn=self._warn_backtrack,
            decision=lambda elbo: self.pending.elbo,
        )

    def _warn_backtrack(self, beta: float, error) -> None:
        labels = [label for b in self.blocks for label in b.labels]
        kind = "step undone (numerical)" if error is not None else "step undone"
        self.warnings.warn(labels, kind, backtrack_message(labels, beta, error), stacklevel=4)

    def _loss(self, args, kwargs, subsample, grads: bool, graph=False) -> torch.Tensor:
        ctx = self.context(args, kwargs, subsample, grads, graph)
        if grads:
            self._tag_params()
        elbo = elbo_terms(self.analysis, ctx, self.blocks, self.options.reducer)  # (ctx.elbo)
        self.pending = ctx if grads else None
        self.last_mc_var = ctx.mc_var
        if ctx.report_shift or ctx.elbo == 0.0:  # (x + 0.0 is x but for x = -0.0)
            elbo = elbo + ctx.report_shift  # (a constant: the gradient is the decision's)
        # without learnable parameters in the model there is nothing to back-propagate into
        return elbo if self._has_params or GIVEN in kwargs else elbo.detach()

    # ------------------------------------------------------------------ the step
    @recorded
    def step(self, beta: Optional[float]) -> None:
        """Apply the pending step (the last loss computed with gradients) with step size beta
        (``None``: the adaptive step of :attr:`control`, see :meth:`enable_control`)."""
        ctx, self.pending = self.pending, None
        if ctx is None:
            return
        # blocks with their own noise control (the remainder) step by the user's ceiling, not
        # by the exact blocks' noise-decayed beta; below its floor (numerical failures) by beta
        ctx.max_beta = beta
        if beta is None:
            c = self.control
            ctx.max_beta = c.max_beta if c.beta >= c.min_ceiling else c.beta
        if beta is None:
            beta = self.control.step_size(minibatch=bool(ctx.subsample) or self.minibatch)
            try:
                self._step(ctx, beta)
            except (ValueError, RuntimeError, FloatingPointError) as e:
                if not is_numerical_error(e) or self.control.snapshot is None:
                    raise
                self._restore(self.control.snapshot.values)
                self._warn_backtrack(self.control.rejected(numerical=True), e)
            return
        try:
            self._step(ctx, beta)
        except (ValueError, RuntimeError, FloatingPointError) as e:
            if not is_numerical_error(e):
                raise
            raise ValueError(
                f"AutoCVI: a CVI step of size {beta:g} failed numerically "
                f"({str(e).splitlines()[0][:200]}). Use the adaptive default CVI() "
                "(step_size='auto'), which undoes and shrinks such steps, or a smaller step_size."
            ) from e

    def _step(self, ctx: StepContext, beta: float) -> None:
        if ctx.steps == 0 and self.blocks and all(b.start_is_step for b in self.blocks):
            pass  # the start was the first step (the Laplace start): q stays there
        elif self.options.schedule != "parallel" and any(b.sweeps for b in self.blocks):
            self._sweep(ctx, beta)
        else:
            for block in self.blocks:
                for report in block.step(beta, ctx):
                    self._report(report)
        stored(self.steps_name).detach().add_(_ONE)  # (in place, as under no_grad)

    def sequential_order(self) -> List[str]:
        """Order of the sequential schedule: the user's list, or reverse model order."""
        active = [n for n in self.analysis.latents if n not in self.analysis.leaves]
        schedule = self.options.schedule
        if isinstance(schedule, (list, tuple)):
            unknown = [n for n in schedule if n not in active]
            if unknown:
                raise ValueError(
                    f"schedule names {unknown}, which are not non-leaf latent sites; "
                    f"choose from {active}"
                )
            return list(schedule) + [n for n in active if n not in schedule]
        return active[::-1]

    def _sweep(self, ctx: StepContext, beta: float) -> None:
        """One sequential (coordinate-ascent) sweep: each latent's block in turn gets its
        target from the current q of the others and takes the step (each block once)."""
        done: set = set()
        for name in self.sequential_order():
            for report in self.stepper[name].sweep(name, ctx, beta, done):
                self._report(report)

    def _report(self, report: StepReport) -> None:
        """Count shrunk and rejected steps and warn (once per site and kind: the text carries
        no counts; see ``guide.num_shrunk`` / ``guide.num_rejected``)."""
        self.counts += report.counts
        warn_step_counts(
            report.label, report.kind, report.beta, report.counts, stacklevel=6, log=self.warnings
        )
