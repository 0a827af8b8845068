"""``AutoCVI``: a Pyro guide with one exponential-family factor per latent site (or block).

Each latent site gets ``q`` from the family its support calls for (real -> Gaussian, positive
-> Gamma, unit interval -> Beta, simplex -> Dirichlet, finite discrete -> Bernoulli /
Categorical, any other continuous support -> a Gaussian on its unconstrained space).
Gaussian sites with no batch dims and a Normal/MVN prior are grouped by shared factors into
joint Gaussian blocks (site form, Algorithm 1: one full covariance per block, as
AutoMultivariateNormal); every other site is a natural-parameter block (mean field,
Algorithm 2). The guide is thin: the analysis, messages and steps live in
:class:`~pyro_cvi.engine.Engine` (see docs/architecture.md).

The parameters live in Pyro's param store under ``"<guide name>.<kind>.<site>"`` and are the
guide's own ``nn.Parameter`` objects at ``<kind>.<site>`` (one tensor object in both views,
as for Pyro's ``PyroModule``: see :mod:`pyro_cvi.guide_state`), so a guide pickles, saves
with ``torch.save``, deep-copies and loads a ``state_dict``; their ``.grad`` (written by
:class:`~pyro_cvi.CVI_ELBO`) is the natural gradient ``target - lambda``, and the
:class:`~pyro_cvi.CVI` optimizer applies eq. 12.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Callable, Dict, Optional

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer.autoguide import AutoGuide

from .blocks.base import GuideDraw
from .blocks.marginals import standard_posterior
from .blocks.packed import PackedLatent
from .blocks.summaries import Summaries
from .context import Options
from .divergence import check_loss
from .engine import Engine
from .guide_state import (
    GuideState,
    StoredShapes,
    Unsampled,
    bind_parameters,
    check_prefix,
    claim_prefix,
    detach_distribution,
    leaf_stages,
    option_property,
    refuse_inside_svi_step,
    rng_preserved,
    sync_parameters,
    unbind_parameters,
)
from .messages.collapsed import check_mode, sample_posterior
from .messages.softmax import METHODS
from .methods.bound_check import BoundChecked, check_setup_draws
from .methods.guide_list import step_inside_pyro_elbo
from .model.records import SITE_CHOICES
from .model.tracing import subsample_values, trace_model
from .model.validation import data_shapes, explained
from .scale.distributed import as_reducer
from .step_control import WarningLog, initial_failures
from .strategies import Remainder
from .transaction import rolled_back
from .update import CountedSteps, StepCounts

__all__ = ["AutoCVI"]


class AutoCVI(GuideState, PackedLatent, Summaries, BoundChecked, CountedSteps, AutoGuide):
    """Conjugate-computation variational inference guide (Khan & Lin, 2017).

    Example::

        guide = AutoCVI(model)
        svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
        for _ in range(20):
            loss = svi.step(X, y)          # the -ELBO of the current q
        guide.posterior("w")               # a torch Distribution
        print(guide.explain())             # how each factor is treated, and why

    :param model: a Pyro model.
    :param covariance: ``"full"`` (default) or ``"diag"`` for Gaussian sites.
    :param num_quad_points: Gauss-Hermite points for linear-predictor factors.
    :param num_samples: ``None`` for exact (quadrature) gradients of linear-predictor factors,
        or the number of Monte Carlo samples (eq. 29) to use instead.
    :param num_general_samples: Monte Carlo samples for general non-conjugate factors.
    :param init_sites: ``"laplace"`` (default) starts linear-predictor sites at the
        likelihood's curvature at the prior mean; ``"prior"`` starts them at zero, so that
        ``q = prior`` initially, as in Algorithm 1.
    :param schedule: how blocks are updated: ``"parallel"`` (all from the same ``q_t``),
        ``"sequential"`` (coordinate ascent, in reverse model order: local sites before the
        global ones they inform), or an explicit list of latent site names. With exact
        factors and ``step_size=1``, ``"sequential"`` is CAVI and the ELBO never decreases.
    :param init_loc_fn: optional Pyro init strategy (e.g. ``init_to_value``) for natural-form
        sites: ``q`` starts with its mean there instead of at the prior (to break symmetries).
    :param families: ``{site: name}``: ``"gaussian"`` puts a Gaussian on the unconstrained
        space of ``biject_to(support)`` (``log sigma`` for a positive site instead of a Gamma;
        ``theta ~ Normal(mu, tau)``, ``tau`` in the remainder: an exact block beside it, which
        ``"joint"`` forbids: by default the joint up to 64 coordinates); ``"gaussian_diag"``
        keeps a real site out of any joint Gaussian block (the rules: docs/architecture.md,
        "Mean field or a joint Gaussian"); a native name (``"gamma"``, ``"beta"``, ...) must
        match the support. ``explain()`` names the fallback sites.
    :param vectorize_particles: draw the ``num_general_samples`` Monte Carlo samples of the
        natural-form sites in one model run, with a particle dim left of the model's plates.
    :param discrete: ``"auto"`` (default) sums out exactly, as ``TraceEnum_ELBO`` does, the
        finite discrete latents the model marks ``infer={"enumerate": ...}`` (the guide has no
        site for them: :mod:`pyro_cvi.messages.collapsed`; ``Predictive`` draws them from the
        model's prior, :meth:`sample_discrete` from their posterior) and gives every other one
        its own Categorical/Bernoulli factor of ``q``; ``"collapse"`` sums out all of them,
        ``"mean_field"`` none (docs/discrete_latents.md).
    :param init_scale: ``None`` (default): natural-form sites start with the prior's spread;
        a float: with that spread (as AutoNormal's ``init_scale``: a standard deviation, on
        the log scale for Gamma and the logit scale for Beta/Dirichlet) around the
        ``init_loc_fn`` value. A tight start keeps multimodal models (mixtures) near the
        mode they start in, as AutoNormal's default 0.1 does.
    :param process_group: data-parallel CVI on ``torch.distributed``
        (:mod:`pyro_cvi.scale.distributed`): ``None`` (one process, default),
        :data:`pyro_cvi.scale.distributed.WORLD` or a process group. Each rank passes its own shard
        of the data; the conjugate statistics are all-reduced every step, so every rank holds
        the exact full-batch ``q``.
    :param softmax: expectations of softmax factors (Categorical logits affine in a Gaussian):
        ``"cubature"`` (default: 2K+1-point unscented rule, Gauss-Hermite at K = 2), ``"mc"``
        (Monte Carlo, ``num_samples`` draws, default 100) or ``"bound"`` (Böhning's bound);
        see :mod:`pyro_cvi.messages.softmax`.
    :param general_curvature: the expected Hessian of general (Monte Carlo) factors on a
        Gaussian block: ``"hessian"`` (a dense Hessian per particle, Price's theorem),
        ``"gradient"`` (gradients only, one batched model run: Stein's lemma,
        ``E[H] = E[S^-1 (z - m) grad^T]``, ``max(num_general_samples, D)`` particles) or
        ``"auto"`` (default: dense up to
        :data:`~pyro_cvi.messages.gaussian.DENSE_HESSIAN_MAX_DIM` dimensions).
    :param remainder: latents without an exact message (:mod:`pyro_cvi.model.remainder`) get
        one joint Gaussian on their unconstrained space, stepped by natural gradients
        (:class:`~pyro_cvi.strategies.Remainder`): ``"auto"`` (default: full covariance
        up to 256 coordinates, low rank beyond), ``"full"``, ``"lowrank"``, ``"diag"``, a
        ``Remainder(...)``, or ``"off"`` (mean field with Monte Carlo messages).
    :param prefix: of the guide's names in Pyro's param store (``"<prefix>.<kind>.<site>"``):
        two guides in one process need two (:func:`pyro_cvi.guide_state.claim_prefix`).
    :param check_at_setup: ``0`` (default) or a number of ``Trace_ELBO`` draws: at set-up, the
        loss of the initial ``q`` is compared with that many draws of ``Trace_ELBO`` over the
        guide (:meth:`check_bound`), and a disagreement warns ``BoundMismatchWarning``.
    """

    def __init__(
        self,
        model: Callable,
        *,
        covariance: str = "full",
        num_quad_points: int = 32,
        num_samples: Optional[int] = None,
        num_general_samples: int = 8,
        init_sites: str = "laplace",
        create_plates: Optional[Callable] = None,
        schedule="parallel",
        init_loc_fn: Optional[Callable] = None,
        vectorize_particles: bool = False,
        families: Optional[Dict[str, str]] = None,
        discrete: str = "auto",
        init_scale: Optional[float] = None,
        process_group=None,
        softmax: str = "cubature",
        general_curvature: str = "auto",
        remainder="auto",
        prefix: str = "AutoCVI",
        check_at_setup: int = 0,
    ):
        check_prefix(prefix)
        check_setup_draws(check_at_setup)
        if general_curvature not in ("auto", "hessian", "gradient"):
            raise ValueError(
                "general_curvature must be 'auto', 'hessian' or 'gradient', "
                f"got {general_curvature!r}"
            )
        if softmax not in METHODS:
            raise ValueError(f"softmax must be one of {METHODS}, got {softmax!r}")
        if covariance not in ("full", "diag"):
            raise ValueError(f"covariance must be 'full' or 'diag', got {covariance!r}")
        if init_sites not in ("laplace", "prior"):
            raise ValueError(f"init_sites must be 'laplace' or 'prior', got {init_sites!r}")
        if not (schedule in ("parallel", "sequential") or isinstance(schedule, (list, tuple))):
            raise ValueError(
                f"schedule must be 'parallel', 'sequential' or a list of latent site names, "
                f"got {schedule!r}"
            )
        bad = {k: v for k, v in (families or {}).items() if v not in SITE_CHOICES}
        if bad:
            raise ValueError(
                f"AutoCVI(families={bad}): unknown family name; use one of {SITE_CHOICES}"
            )
        if init_scale is not None and not init_scale > 0:
            raise ValueError(f"init_scale must be positive, got {init_scale!r}")
        super().__init__(model, create_plates=create_plates)
        # the PyroModule name is the param store names' prefix: "<prefix>.<kind>.<site>"
        self._pyro_name = prefix
        self.options = Options(
            covariance,
            num_quad_points,
            num_samples,
            num_general_samples,
            init_sites,
            schedule,
            vectorize_particles,
            dict(families or {}),
            check_mode(discrete),
            init_scale,
            as_reducer(process_group),
            softmax,
            general_curvature=general_curvature,
            remainder=Remainder.of(remainder),
        )
        self.init_loc_fn = init_loc_fn
        self.counts = StepCounts()
        self.warning_log = WarningLog()
        self.engine: Optional[Engine] = None
        self._minibatch_plates: set = set()
        #: a checkpoint loaded before the guide saw the model (:mod:`pyro_cvi.checkpoints`):
        #: applied, after its check against the model, at the end of the set-up
        self.pending_restore: Optional[Callable] = None
        self.data_shapes: Dict[str, tuple] = {}  # of the data the guide was built with
        self.check_at_setup = check_at_setup

    # ------------------------------------------------------------------ counters
    @property
    def warning_counts(self) -> dict:
        """``{(site, kind): count}`` of the step warnings so far (each is shown only once)."""
        return dict(self.warning_log.counts)

    @property
    def reducer(self):
        """The data-parallel :class:`~pyro_cvi.scale.distributed.Reducer`, or ``None``."""
        return self.options.reducer

    @property
    def num_backtracks(self) -> int:
        """Steps undone by the adaptive step control (``CVI()``, ``step_size="auto"``)."""
        control = self.engine.control if self.engine is not None else None
        return 0 if control is None else control.num_backtracks

    @property
    def param_prefix(self) -> str:
        """The prefix of this guide's names in Pyro's param store."""
        return self._pyro_name

    # ------------------------------------------------------------------ set-up and the loss
    def _setup_prototype(self, *args, **kwargs):
        with rolled_back(self), initial_failures():  # a failed set-up leaves no trace
            claim_prefix(self)  # another live guide under this prefix: a clear error
            super()._setup_prototype(*args, **kwargs)
            self.data_shapes = data_shapes(args, kwargs)
            self._minibatch_plates = {
                n
                for n, v in subsample_values(self.prototype_trace).items()
                if len(v) < self.prototype_trace.nodes[n]["fn"].size
            }
            self._build_engine(args, kwargs)
            if self.pending_restore is not None:
                # checks the checkpoint against the model first; refused, it is dropped (the
                # set-up is rolled back and the next step starts from the guide's own init)
                self.pending_restore(self)
                self.pending_restore = None
        if self.check_at_setup:
            self.check_bound(*args, num_particles=self.check_at_setup, **kwargs)

    def _build_engine(self, args, kwargs) -> None:
        """Analyse the model and set up the blocks (a restored or copied guide's kept)."""
        sync_parameters(self)
        self.engine = Engine(self.model, self._pyro_name, self.options)
        self.engine.counts, self.engine.warnings = self.counts, self.warning_log
        sub = self.draw_subsample(args, kwargs)
        with poutine.block(), StoredShapes(self.param_prefix):  # (hidden from an outer trace)
            self.engine.setup(args, kwargs, self.prototype_trace, self.init_loc_fn, sub)
        bind_parameters(self, self.engine.param_names() + [self.engine.steps_name])

    def _ready(self, args=(), kwargs=None) -> Engine:
        """The engine, set up on first use (from ``args``) or rebuilt after unpickling or
        copying (from ``args``, else the prototype trace's recorded inputs; without moving
        the random state); the module's and the param store's parameters made one."""
        kwargs = kwargs or {}
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        elif self.engine is None:
            if self._model is None or self._model[0] is None:
                raise ValueError(
                    "this AutoCVI was pickled without its model (the model could not be pickled, "
                    "e.g. a function defined inside another): set guide.model = model, or define "
                    "the model at module level so that it pickles with the guide"
                )
            if not args and not kwargs:
                inputs = self.prototype_trace.nodes["_INPUT"]
                args, kwargs = inputs["args"], inputs["kwargs"]
            with rng_preserved():
                self._build_engine(args, kwargs)
        elif self.engine.params_missing() and (args or kwargs):
            unbind_parameters(self)  # (the store was cleared under a live guide: restart)
            self._setup_prototype(*args, **kwargs)
        else:  # (a query without data after a cleared store: the guide's values, as Pyro's)
            sync_parameters(self)
        return self.engine

    def elbo(self, args, kwargs, grads: bool = False, graph: bool = False) -> torch.Tensor:
        """The ELBO of the current q for the model's arguments. ``grads``: the natural gradients
        go into the CVI parameters' ``.grad`` for the next CVI step; ``grads`` or ``graph``: its
        graph to the model's parameters is kept (the gradient at fixed CVI parameters, q
        re-solved from the prior and sites). A transaction (:mod:`pyro_cvi.transaction`): a
        failed loss leaves the guide as it was; with ``grads`` it stays open until the step."""
        with rolled_back(self, keep_open=grads) as txn:
            try:
                self._ready(args, kwargs)  # first call, a restored guide, or a cleared store
                if self.engine.new_data(args, kwargs):  # (without moving the loss's draws)
                    with rng_preserved():
                        self.engine.reanalyse_if_new_data(args, kwargs, self._prototype_for)
                sub = self.draw_subsample(args, kwargs)
                loss = self.engine.loss(args, kwargs, sub, grads, graph)
                if grads:  # a non-finite or exploding loss: an error, and back to the best q
                    check_loss(self.engine, -float(loss.detach()))
                return txn.kept(loss)
            except (ZeroDivisionError, ValueError, RuntimeError):
                with explained(args, kwargs, self.data_shapes):  # (in the data's terms)
                    raise

    def _prototype_for(self, args, kwargs):
        """The prototype trace, or a fresh one when a subsampled plate's minibatch has another
        size than the prototype's (e.g. the short last minibatch of an epoch): the analysis
        then runs the model at values of the right shapes."""
        frames = self._prototype_frames or {}
        if all((f.full_size or f.size) == f.size for f in frames.values()):
            return self.prototype_trace
        plates = self._create_plates(*args, **kwargs)
        if all(plates[n].subsample_size == f.size for n, f in frames.items() if n in plates):
            return self.prototype_trace
        model = poutine.block(self.model, self._prototype_hide_fn)
        return poutine.block(poutine.trace(model).get_trace)(*args, **kwargs)

    def draw_subsample(self, args, kwargs) -> Dict[str, torch.Tensor]:
        """Fresh indices of every subsampled plate (``pyro.plate(subsample_size=...)``): the
        guide's plates for those with latents; a fresh draw for observation-only plates
        (vectorised or sequential), so every model run of a step sees the same minibatch."""
        frames = self._prototype_frames or {}
        out = {}
        if any((f.full_size or f.size) != f.size for f in frames.values()):
            plates = self._create_plates(*args, **kwargs)
            out = {n: p.indices for n, p in plates.items() if p.subsample_size != p.size}
        for name, node in self.prototype_trace.nodes.items() if self._minibatch_plates else ():
            if name not in out and name in self._minibatch_plates:
                out[name] = node["fn"].sample()
        analysis = getattr(self.engine, "analysis", None)
        if analysis is not None and analysis.minibatch_plates:  # observation-only plates
            for name in sorted(analysis.minibatch_plates - set(out)):
                node = analysis.structure.nodes[name]
                if node["fn"].subsample_size is not None:  # (not pyro.plate(subsample=idx))
                    out[name] = node["fn"].sample()
        return out

    def natural_params(self) -> Dict[str, torch.Tensor]:
        """The guide's CVI parameters (site and natural parameters) by param-store name."""
        if self.engine is None:
            return {}
        store = pyro.get_param_store()
        return {k: store[k] for k in self.engine.param_names() if k in store}

    # ------------------------------------------------------------------ the guide itself
    def forward(self, *args, **kwargs):
        stepped = step_inside_pyro_elbo(self, args, kwargs)  # a guide list's part: CVI's step
        engine = self._ready(args, kwargs)
        if not stepped:
            refuse_inside_svi_step(self)
        # under torch.jit.trace (or stepped by CVI above) q is drawn as constants (detached)
        frozen = detach_distribution if stepped or torch.jit.is_tracing() else (lambda d: d)
        plates = self._create_plates(*args, **kwargs)
        sub = {n: p.indices for n, p in plates.items() if p.subsample_size != p.size}
        latents = engine.analysis.latents
        draw = GuideDraw(
            self._pyro_name,
            lambda n: self._plates_of(n, plates),
            frozen,
            sub,
            lambda n: len(latents[n].event_shape),
        )
        result: Dict[str, torch.Tensor] = {}
        leaves = []
        for name in latents:  # model order (the guide's RNG stream)
            if name in engine.analysis.leaves:
                leaves.append(name)
            elif name not in result:
                result.update(engine.block_for(name).guide_sample(name, draw))
        run = poutine.block(Unsampled(leaves)(trace_model))
        for stage in leaf_stages(leaves, engine.analysis.deps):
            tr = run(self.model, result, args, kwargs)
            for name in stage:
                site = tr.nodes[name]
                with self._plates_of(name, plates, site):
                    fn = site["fn"]
                    if site["mask"] is not None:
                        fn = fn.mask(site["mask"])
                    result[name] = pyro.sample(name, frozen(fn))
        return result

    def _plates_of(self, name: str, plates, site=None) -> ExitStack:
        """The guide's plates (``pyro.plate`` objects) around site ``name``."""
        site = site if site is not None else self.prototype_trace.nodes[name]
        stack = ExitStack()
        for frame in site["cond_indep_stack"]:
            if frame.vectorized:
                stack.enter_context(plates[frame.name])
        return stack

    def _info(self, name: str):
        if self.prototype_trace is None:
            raise RuntimeError("AutoCVI has not seen the model yet: call svi.step(...) first")
        latents = self._ready().analysis.latents
        if name in self.engine.analysis.collapsed:
            raise ValueError(
                f"{name!r} is summed out (see guide.explain()): it has no q; draw it from its "
                "posterior with guide.sample_discrete(*args)"
            )
        if name not in latents:
            raise KeyError(
                f"{name!r} is not a latent site of the model; latent sites: {list(latents)}"
            )
        return latents[name]

    def posterior(self, name: str) -> torch.distributions.Distribution:
        """The current ``q`` of latent site ``name``, a torch Distribution with ``mean`` and
        ``variance`` (and ``covariance_matrix`` for a Gaussian over more than one value): a
        marginal, for a site in a joint block; for a *leaf* (a site nothing depends on, whose
        ``q`` is its conditional prior), that prior with its parents at their ``q`` means."""
        self._info(name)
        if name in self.engine.analysis.leaves:
            q = self._leaf_priors()[name]
        else:
            q = self.engine.block_for(name).marginal(name)
        return standard_posterior(q)

    def _leaf_priors(self, args=None, kwargs=None) -> Dict[str, torch.distributions.Distribution]:
        """Each leaf's conditional prior, in one model run with every other latent at its mean
        (``args``: the model's, default the prototype trace's)."""
        if args is None and not kwargs:
            inputs = self.prototype_trace.nodes["_INPUT"]
            args, kwargs = inputs["args"], inputs["kwargs"]
        values = self.engine.sample_q({}, at_means=True)
        run = poutine.block(Unsampled(self.engine.analysis.leaves)(trace_model))
        with rng_preserved():
            tr = run(self.model, values, tuple(args), kwargs or {})
        out = {}
        for name in self.engine.analysis.leaves:
            site = tr.nodes[name]
            fn = site["fn"]
            out[name] = fn.mask(site["mask"]) if site["mask"] is not None else fn
        return out

    def joint_posterior(self, *names: str) -> dist.MultivariateNormal:
        """The joint Gaussian ``q`` of sites of one block, over the concatenation of their
        flattened values in the given order (e.g. ``joint_posterior("a", "b")``)."""
        for n in names:
            self._info(n)
        engine = self.engine
        joints = [b for b in engine.blocks if b.gaussian_joint]
        holders = {id(engine.block_for(n)) if n in engine.stepper else None for n in names}
        block = engine.block_for(names[0]) if names[0] in engine.stepper else None
        if len(holders) != 1 or block is None or not block.gaussian_joint:
            raise ValueError(
                f"sites {list(names)} do not lie in one Gaussian block; blocks: "
                f"{[b.names for b in joints]}"
            )
        return block.joint(list(names))

    @torch.no_grad()
    def sample_discrete(self, *args, **kwargs) -> Dict[str, torch.Tensor]:
        """One joint draw of every latent: the continuous ones from ``q``, the collapsed
        discrete ones (summed out: see :meth:`explain`) from ``p(z | x, theta)`` given that draw."""
        tr = poutine.trace(self).get_trace(*args, **kwargs)
        values = {n: s["value"] for n, s in tr.iter_stochastic_nodes()}
        if not self.engine.analysis.collapsed:
            return values
        dims = self.engine.analysis.plate_dims
        post = sample_posterior(self.model, values, dims, args, kwargs)
        values.update({n: post.nodes[n]["value"] for n in self.engine.analysis.collapsed})
        return values

    def explain(self) -> str:
        """One line per (factor, latent or block): the kind CVI gives it, and why; then, for
        each block, which factors send it exact expected messages, which Monte Carlo expected
        messages, and which CVI sites."""
        if self.prototype_trace is None:
            raise RuntimeError("AutoCVI has not seen the model yet: call svi.step(...) first")
        return self.engine.analysis.explain(self.engine.blocks)


for _name in (
    "covariance",
    "num_quad_points",
    "num_samples",
    "num_general_samples",
    "init_sites",
    "schedule",
    "vectorize_particles",
    "discrete",
    "softmax",
    "general_curvature",
):
    setattr(AutoCVI, _name, option_property(_name))
