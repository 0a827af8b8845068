"""``AutoCVI``: a Pyro guide with one exponential-family factor per latent site.

Each latent site ``z`` gets ``q(z)`` from the family its support calls for (real -> Gaussian,
positive -> Gamma, unit interval -> Beta, simplex -> Dirichlet). The factors of the model are
classified by :mod:`pyro_cvi.conjugacy`, and ``q`` is held in one of two forms:

* **site form** (a Gaussian site with no batch dims and full covariance): the natural
  parameters are ``lambda = eta + sum_f lambda_tilde_f`` (Theorem 1, eq. 11). ``eta`` is the
  exact message of the conjugate factors (the prior and Normal likelihoods with an affine loc),
  recomputed from the model each step, so a conjugate model is solved exactly. Every
  linear-predictor factor owns O(N) site parameters ``(lam1_n, lam2_n)`` (eq. 13, Appendix E.1),
  and general factors own a ``(h, Lambda)`` pair. The conjugate computation (step 4 of
  Algorithm 1) is a Bayesian linear regression, solved in primal or dual form
  (:mod:`pyro_cvi.linear_gaussian`).
* **natural form** (everything else): the natural parameters ``lambda`` of ``q`` themselves,
  updated by ``lambda <- (1 - beta) lambda + beta grad_mu E_q[log p]`` with the exact message
  of a same-family prior and Monte Carlo (implicit reparameterisation + Fisher solve,
  Appendix F) for the rest.

The parameters live in Pyro's param store under ``"<guide name>.<kind>.<site>"``. Their
``.grad`` (written by :class:`~pyro_cvi.CVI_ELBO`) is the natural gradient
``target - lambda_tilde``, so the step ``lambda_tilde += beta * grad`` is eq. 12, and the
:class:`~pyro_cvi.CVI` optimizer applies it with step shrinking to keep ``q`` valid.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer.autoguide import AutoGuide

from . import conjugacy as cj
from .families import family_for_support
from .linear_gaussian import GaussianPosterior, GaussianPrior, NotPositiveDefinite, solve
from .tracing import is_random, trace_model, unwrap
from .validation import check_observations

__all__ = ["AutoCVI"]

SITE_FORM = "site"
NATURAL_FORM = "natural"
LEAF_FORM = "leaf"


@dataclass
class LatentInfo:
    name: str
    family: object
    form: str
    event_shape: torch.Size
    batch_shape: torch.Size
    factors: List[cj.Factor] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return int(torch.Size(self.event_shape).numel())


@dataclass
class StepRecord:
    """What CVI needs to apply a step without re-tracing the model."""

    prior: GaussianPrior
    rows: list  # [(factor_site or None, RowBlock)]
    z_at: torch.Tensor


class AutoCVI(AutoGuide):
    """Conjugate-computation variational inference guide (Khan & Lin, 2017).

    :param model: a Pyro model.
    :param covariance: ``"full"`` (default) or ``"diag"`` for Gaussian sites.
    :param num_quad_points: Gauss-Hermite points for linear-predictor factors.
    :param num_samples: ``None`` for exact (quadrature) gradients of linear-predictor factors,
        or the number of Monte Carlo samples (eq. 29) to use instead.
    :param num_general_samples: Monte Carlo samples for general non-conjugate factors.
    :param init_sites: ``"laplace"`` (default) starts linear-predictor sites at the
        likelihood's curvature at the prior mean; ``"prior"`` starts them at zero, so that
        ``q = prior`` initially, as in Algorithm 1.
    :param schedule: how natural-form (mean-field) sites are updated (Algorithm 2):
        ``"parallel"`` (all from the same ``q_t``), ``"sequential"`` (coordinate ascent, in
        reverse model order: local sites before the global ones they inform), or an explicit
        list of latent site names. With exact factors and ``step_size=1``, ``"sequential"``
        is CAVI and the ELBO never decreases.
    :param vectorize_particles: draw the ``num_general_samples`` Monte Carlo samples of the
        natural-form sites in one model run, with a particle dim left of the model's plates
        (the model must broadcast over it, as for ``Trace_ELBO(vectorize_particles=True)``).
    :param init_loc_fn: optional Pyro init strategy (e.g. ``init_to_value``,
        ``init_to_sample``) for natural-form sites: ``q`` starts with its mean there (and
        the prior's spread) instead of at the prior; use it to break symmetries (mixtures,
        factorisations).
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
    ):
        if covariance not in ("full", "diag"):
            raise ValueError(f"covariance must be 'full' or 'diag', got {covariance!r}")
        super().__init__(model, create_plates=create_plates)
        self.covariance = covariance
        self.num_quad_points = num_quad_points
        self.num_samples = num_samples
        self.num_general_samples = num_general_samples
        if init_sites not in ("laplace", "prior"):
            raise ValueError(f"init_sites must be 'laplace' or 'prior', got {init_sites!r}")
        self.init_sites = init_sites
        self._latents: OrderedDict[str, LatentInfo] = OrderedDict()
        self._posts: Dict[str, GaussianPosterior] = {}
        self._records: Dict[str, StepRecord] = {}
        self._args_key = None
        self.num_shrunk = 0
        self.num_rejected = 0
        # mean-field (natural-form) options, see pyro_cvi.meanfield
        if not (schedule in ("parallel", "sequential") or isinstance(schedule, (list, tuple))):
            raise ValueError(
                f"schedule must be 'parallel', 'sequential' or a list of latent site names, "
                f"got {schedule!r}"
            )
        self.schedule = schedule
        self.init_loc_fn = init_loc_fn
        self.vectorize_particles = vectorize_particles
        self._analysis = None
        self._step_subsample: Dict[str, torch.Tensor] = {}
        self._leaf_values: Dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ set-up
    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        self._posts, self._records, self._param_names = {}, {}, set()
        values = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            if is_random(site):
                values[name] = site["value"].detach()
        self._proto_values = values
        self._structure = trace_model(self.model, {}, args, kwargs)
        check_observations(self._structure, self._structure)
        self._classify(values, args, kwargs)
        self._args_key = _key(args, kwargs)
        prefix = self._pyro_name + "."
        # parameters already in the param store (a restored checkpoint) are kept as they are
        fresh = not any(k.startswith(prefix) for k in pyro.get_param_store().keys())
        for name, info in self._latents.items():
            if info.form == SITE_FORM:
                self._init_site_form(info)
            elif info.form == NATURAL_FORM:
                self._init_natural_form(info, self._init_site(name, args, kwargs))
        with torch.no_grad():
            tr = self._trace_at_means(args, kwargs)
            for info in self._latents.values():
                if info.form == SITE_FORM:
                    if self.init_sites == "laplace" and fresh:
                        self._init_sites_at_prior_mean(info, tr)
                    self._refresh_site_form(info, tr)

    def _classify(self, values, args, kwargs):
        tr = self.prototype_trace
        latents = [n for n in values]
        deps = cj.dependencies(self.model, values, args, kwargs)
        deps = self._add_discrete_dependencies(values, deps, args, kwargs)
        referenced = set().union(*[d for n, d in deps.items()]) if deps else set()
        leaves = {n for n in latents if n not in referenced}
        infos = OrderedDict()
        for name in latents:
            site = tr.nodes[name]
            fn = site["fn"]
            event_shape = fn.event_shape
            batch_shape = fn.batch_shape
            if name in leaves:
                infos[name] = LatentInfo(name, None, LEAF_FORM, event_shape, batch_shape)
                continue
            try:
                family = family_for_support(fn.support, event_shape, self.covariance)
            except ValueError as e:
                raise ValueError(f"latent site {name!r}: {e}") from None
            infos[name] = LatentInfo(name, family, NATURAL_FORM, event_shape, batch_shape)
        gaussian = {
            n for n, i in infos.items() if i.family is not None and "gaussian" in i.family.name
        }
        analysis = self._mean_field_analysis(values, args, kwargs, infos, leaves, deps)
        factors = cj.classify(
            self.model, values, args, kwargs, gaussian, deps, leaves, latents, analyzer=analysis
        )
        for f in factors:
            infos[f.latent].factors.append(f)
        for name, info in infos.items():
            if info.form == LEAF_FORM:
                continue
            prior = next((f for f in info.factors if f.site == name), None)
            if (
                info.family.name == "gaussian"
                and len(info.batch_shape) == 0
                and prior is not None
                and prior.kind == cj.PRIOR
            ):
                info.form = SITE_FORM
                for f in info.factors:
                    if f.kind == cj.GENERAL and f.site != name:
                        f.extra["general"] = True
        self._relabel_natural_form(infos, analysis)
        self._latents = infos
        self._deps = deps

    def _param_name(self, kind: str, site: str) -> str:
        return f"{self._pyro_name}.{kind}.{site}"

    def _init_site_form(self, info: LatentInfo):
        D = info.numel
        proto = self._proto_values[info.name]
        for f in info.factors:
            if f.kind == cj.LINEAR:
                R = f.jacobian.shape[0]
                self._register(self._param_name("sites", f.site), lambda R=R: proto.new_zeros(R, 2))
        if any(f.kind == cj.GENERAL for f in info.factors):
            self._register(self._param_name("general_h", info.name), lambda: proto.new_zeros(D))
            self._register(self._param_name("general_P", info.name), lambda: proto.new_zeros(D, D))

    def _init_natural_form(self, info: LatentInfo, site):
        """Register the natural parameters of a natural-form site, at full plate sizes.

        ``q`` starts at the prior when the prior is of ``q``'s family (Algorithm 2's
        ``lambda_0``); with ``init_loc_fn`` (or a prior of another family) it starts with its
        mean at the init value (:func:`pyro_cvi.meanfield.initial_natural`).
        """
        from .meanfield import initial_natural

        init = initial_natural(info.family, site, self.init_loc_fn)
        for i, t in enumerate(init):
            t = t.detach().clone()
            self._register(self._param_name(f"natural{i}", info.name), lambda t=t: t)

    def _init_sites_at_prior_mean(self, info: LatentInfo, tr) -> None:
        """Start each linear-predictor site at the factor's curvature at the prior mean.

        The site target of eq. 13 evaluated for a point mass at ``eta = A m0 + c`` is
        ``(f'(eta) - f''(eta) eta, f''(eta) / 2)``: a Newton/Laplace step from the prior mean.
        It starts q near the posterior instead of at the prior (``init_sites="prior"``, the
        paper's ``lambda_tilde_0 = 0``), which matters for flat priors (australian,
        ``delta = 1e-5``), where the first steps from the prior overshoot. Positive
        curvature (non-log-concave likelihoods) is clipped to zero.
        """
        from .messages import linear_predictor_message, linear_predictor_rows

        m0 = _gaussian_prior(tr.nodes[info.name]["fn"], info.numel).loc.detach()
        z_at = tr.nodes[info.name]["value"].detach().reshape(-1)
        for f in info.factors:
            if f.kind != cj.LINEAR:
                continue
            p = pyro.param(self._param_name("sites", f.site))
            rows = linear_predictor_rows(tr.nodes[f.site], f, z_at, p.detach())
            f_mean = f.jacobian @ m0
            var = torch.full_like(f_mean, 1e-4)
            with torch.enable_grad():
                _, target = linear_predictor_message(
                    tr.nodes[f.site], rows, f_mean, var, self.num_quad_points, None
                )
            target[:, 1] = target[:, 1].clamp(max=0.0)
            target[:, 0] = torch.where(target[:, 1] == 0, 0.0, target[:, 0])
            if bool(torch.isfinite(target).all()):
                p.data.copy_(target)

    def _register(self, name: str, init: Callable[[], torch.Tensor]) -> torch.Tensor:
        if init is not None:
            if not hasattr(self, "_param_names"):
                self._param_names = set()
            self._param_names.add(name)
        return pyro.param(name, init)

    def _params_missing(self) -> bool:
        """Whether the param store lost this guide's parameters (``pyro.clear_param_store()``)."""
        names = getattr(self, "_param_names", None)
        if not names:
            return False
        store = pyro.get_param_store()
        return any(n not in store for n in names)

    def natural_params(self) -> Dict[str, torch.Tensor]:
        """The guide's CVI parameters (site and natural parameters) by param-store name."""
        store = pyro.get_param_store()
        prefix = self._pyro_name + "."
        return {k: store[k] for k in store.keys() if k.startswith(prefix)}

    # ------------------------------------------------------------------ tracing helpers
    def _current_values(self) -> Dict[str, torch.Tensor]:
        """Latent values for the per-step trace: natural-form sites at their means; site-form
        sites at their fixed prototype value (their factors are affine in them, so the trace
        point does not matter, and a fixed point keeps the offsets ``c`` bitwise stable from
        step to step, which makes checkpoint/resume exact)."""
        values = {}
        for name, info in self._latents.items():
            if info.form == NATURAL_FORM:
                q = self._natural_dist(info)
                values[name] = _mean_of(q)
            elif info.form != LEAF_FORM:
                values[name] = self._proto_values[name]
        return values

    def _trace_at_means(self, args, kwargs):
        saved = self._step_subsample
        if not saved:  # outside a step, a subsampling model still needs one minibatch
            self._step_subsample = self._draw_subsample(args, kwargs)
        try:
            values = {**self._current_values(), **self._step_subsample}  # the step's minibatch
            return trace_model(self.model, values, args, kwargs)
        finally:
            self._step_subsample = saved

    def _maybe_reclassify(self, args, kwargs):
        key = _key(args, kwargs)
        if key == self._args_key:
            return
        self._args_key = key
        self._classify(self._proto_values, args, kwargs)
        for info in self._latents.values():
            if info.form == SITE_FORM:
                for f in info.factors:
                    if f.kind == cj.LINEAR:
                        p = pyro.param(self._param_name("sites", f.site))
                        if p.shape[0] != f.jacobian.shape[0]:
                            raise ValueError(
                                f"site {f.site!r} now has {f.jacobian.shape[0]} elements but the "
                                f"guide was fitted with {p.shape[0]}. AutoCVI keeps one site per "
                                "data point: pass the training data to svi.step, and use "
                                "Predictive(model, guide=guide) for new inputs."
                            )

    # ------------------------------------------------------------------ site form
    def _site_params(self, info):
        sites = {}
        for f in info.factors:
            if f.kind == cj.LINEAR:
                sites[f.site] = self._register(self._param_name("sites", f.site), None)
        general = None
        if any(f.kind == cj.GENERAL for f in info.factors):
            general = (
                self._register(self._param_name("general_h", info.name), None),
                self._register(self._param_name("general_P", info.name), None),
            )
        return sites, general

    def _refresh_site_form(self, info: LatentInfo, tr):
        """Rebuild the step record (prior, rows) from a trace, and solve for the current q."""
        from .messages import linear_predictor_rows, normal_rows

        z_at = tr.nodes[info.name]["value"].detach().reshape(-1)
        prior = _gaussian_prior(tr.nodes[info.name]["fn"], info.numel)
        rows, elbo_fns = [], []
        sites, general = self._site_params(info)
        for f in info.factors:
            site = tr.nodes[f.site]
            if f.dynamic:
                f.jacobian = self._recompute_jacobian(f, tr)
            if f.kind == cj.CONJUGATE:
                r, fn = normal_rows(site, f, z_at)
                rows.append((None, r))
                if not f.extra.get("given_others"):
                    # a factor shared with natural-form latents (e.g. an unknown noise
                    # precision) sends rows at E_q[precision]; its ELBO term is exact in the
                    # mean-field part (pyro_cvi.meanfield), not here
                    elbo_fns.append((len(rows) - 1, fn))
            elif f.kind == cj.LINEAR:
                rows.append((f.site, linear_predictor_rows(site, f, z_at, sites[f.site].detach())))
        record = StepRecord(prior.detach(), rows, z_at)
        post = self._posts.get(info.name)
        if post is None or not _same_record(self._records.get(info.name), record) or general:
            self._records[info.name] = record
            post = self._solve(info.name, general)
            self._posts[info.name] = post
        else:  # nothing changed since the last step's conjugate computation: reuse it
            self._records[info.name] = record
        return prior, rows, elbo_fns, post, sites, general

    def _solve(self, name, general, site_values=None, general_values=None):
        rec = self._records[name]
        blocks = []
        for site_name, r in rec.rows:
            if site_name is not None and site_values is not None:
                s = site_values[site_name]
                blocks.append((r.A, -2 * s[:, 1], s[:, 0] + 2 * s[:, 1] * r.c))
            else:
                blocks.append((r.A, r.w, r.b))
        D = rec.prior.loc.numel()
        like = rec.prior.loc
        if blocks:
            A = torch.cat([b[0] for b in blocks], 0)
            w = torch.cat([b[1] for b in blocks], 0)
            b = torch.cat([b[2] for b in blocks], 0)
        else:
            A, w, b = like.new_zeros(0, D), like.new_zeros(0), like.new_zeros(0)
        extra_h = extra_P = None
        if general is not None:
            h, P = general_values if general_values is not None else general
            extra_h, extra_P = h.detach(), P.detach()
        post = solve(rec.prior, A, w, b, extra_h, extra_P)
        # split the row marginals back per block
        post.blocks = []
        i = 0
        for site_name, r in rec.rows:
            n = r.A.shape[0]
            post.blocks.append((site_name, slice(i, i + n)))
            i += n
        return post

    def _recompute_jacobian(self, f, tr):
        z0 = tr.nodes[f.latent]["value"].detach().clone().requires_grad_(True)
        values = {
            k: v["value"].detach()
            for k, v in tr.nodes.items()
            if k in self._latents and self._latents[k].form != LEAF_FORM
        }
        values[f.latent] = z0
        with torch.enable_grad():
            t = trace_model(self.model, values, self._last_args, self._last_kwargs)
            from .tracing import linear_param

            value = linear_param(unwrap(t.nodes[f.site]["fn"])[0])[1]
            return cj.jacobian(value, z0).detach()

    def _apply_site_step(self, info, beta: float) -> None:
        """``lambda_tilde += beta * grad`` for the site form, shrinking beta until q is valid."""
        sites, general = self._site_params(info)
        old = {k: v.detach().clone() for k, v in sites.items()}
        old_g = None if general is None else tuple(t.detach().clone() for t in general)
        b = beta
        for _ in range(12):
            new_sites = {
                k: old[k] + b * (sites[k].grad if sites[k].grad is not None else 0) for k in sites
            }
            new_g = None
            if general is not None:
                new_g = tuple(
                    o + b * (p.grad if p.grad is not None else 0) for o, p in zip(old_g, general)
                )
            try:
                post = self._solve(info.name, general, new_sites, new_g)
                if not torch.isfinite(post.loc).all():
                    raise NotPositiveDefinite("non-finite mean")
            except NotPositiveDefinite:
                b = b / 2
                self.num_shrunk += 1
                continue
            with torch.no_grad():
                for k, p in sites.items():
                    p.copy_(new_sites[k])
                if general is not None:
                    for p, v in zip(general, new_g):
                        p.copy_(v)
            self._posts[info.name] = post
            # keep the record's rows consistent with the new site values
            rec = self._records[info.name]
            for site_name, r in rec.rows:
                if site_name is not None:
                    s = new_sites[site_name]
                    r.w, r.b = -2 * s[:, 1], s[:, 0] + 2 * s[:, 1] * r.c
            if b < beta:
                warnings.warn(
                    f"AutoCVI: step on site {info.name!r} shrunk from {beta:g} to {b:g} to keep "
                    "the precision positive definite",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return
        self.num_rejected += 1
        warnings.warn(
            f"AutoCVI: step on site {info.name!r} rejected: no step size down to {b:g} keeps the "
            "precision positive definite. Lower the step size.",
            RuntimeWarning,
            stacklevel=3,
        )

    # ------------------------------------------------------------------ natural form
    # Mean-field sites (Algorithm 2). The messages and targets are computed by
    # pyro_cvi.meanfield; these methods hold the parameters and take the steps.
    def _natural_params_of(self, info):
        n = len(info.family.param_shapes)
        return tuple(
            self._register(self._param_name(f"natural{i}", info.name), None) for i in range(n)
        )

    def _natural_dist(self, info, plates=None):
        """``q`` of a natural-form site; restricted to the minibatch while a step is running
        (or to the subsample of ``plates``, the guide's plates in :meth:`forward`)."""
        from .meanfield import slice_params

        nat = tuple(p.detach() for p in self._natural_params_of(info))
        if plates is not None:
            sub = {n: p.indices for n, p in plates.items() if p.subsample_size != p.size}
            saved, self._step_subsample = self._step_subsample, sub
            try:
                nat = slice_params(self, info, nat)
            finally:
                self._step_subsample = saved
        else:
            nat = slice_params(self, info, nat)
        return info.family.natural_to_dist(nat)

    def _apply_natural_step(self, info, beta: float) -> None:
        """``lambda <- lambda + beta * grad`` (``grad = target - lambda``, eq. 12 / Alg. 2 step 5)
        with per-element step shrinking to stay in the natural domain."""
        from .meanfield import natural_step

        params = self._natural_params_of(info)
        if all(p.grad is None for p in params):
            return
        old = tuple(p.detach() for p in params)
        target = tuple(
            o + (p.grad if p.grad is not None else torch.zeros_like(p)) for o, p in zip(old, params)
        )
        new, shrunk, rejected = natural_step(info.family, old, target, beta, info.name)
        self.num_shrunk += shrunk
        self.num_rejected += rejected
        from .meanfield import _warn_step

        _warn_step(info, shrunk, rejected)
        with torch.no_grad():
            for p, v in zip(params, new):
                p.copy_(v)

    def _init_site(self, name: str, args, kwargs):
        """The prototype site of ``name``; with ``init_loc_fn``, from a trace of the model run at
        the init values (so that priors with latent parents are evaluated there)."""
        if self.init_loc_fn is None:
            return self.prototype_trace.nodes[name]
        if getattr(self, "_init_trace", None) is None:
            from .meanfield import init_messenger

            model = init_messenger(self.init_loc_fn)(self.model)
            self._init_trace = poutine.trace(model).get_trace(*args, **kwargs)
        return self._init_trace.nodes[name]

    def _draw_subsample(self, args, kwargs) -> Dict[str, torch.Tensor]:
        """Fresh indices of every subsampled plate (``pyro.plate(subsample_size=...)``)."""
        frames = getattr(self, "_prototype_frames", None) or {}
        if not any((f.full_size or f.size) != f.size for f in frames.values()):
            return {}
        plates = self._create_plates(*args, **kwargs)
        return {n: p.indices for n, p in plates.items() if p.subsample_size != p.size}

    def _frames_of(self, name: str):
        """The vectorised plates of a latent site (from the prototype trace)."""
        site = self.prototype_trace.nodes[name]
        return [f for f in site["cond_indep_stack"] if f.vectorized]

    def _sequential_order(self) -> List[str]:
        """Order of the sequential schedule: the user's list, or reverse model order."""
        active = [n for n, i in self._latents.items() if i.form != LEAF_FORM]
        if isinstance(self.schedule, (list, tuple)):
            unknown = [n for n in self.schedule if n not in active]
            if unknown:
                raise ValueError(
                    f"schedule names {unknown}, which are not non-leaf latent sites; "
                    f"choose from {active}"
                )
            return list(self.schedule) + [n for n in active if n not in self.schedule]
        return active[::-1]

    def _add_discrete_dependencies(self, values, deps, args, kwargs):
        """Add, for every site, the discrete latents it depends on (found by enumeration)."""
        from .families import Bernoulli, Categorical
        from .meanfield import discrete_dependencies, max_plate_nesting, run_model

        discrete = []
        for name in values:
            fn = self.prototype_trace.nodes[name]["fn"]
            try:
                fam = family_for_support(fn.support, fn.event_shape, self.covariance)
            except ValueError:
                continue
            if isinstance(fam, (Bernoulli, Categorical)):
                discrete.append(name)
        self._mf_structure = trace_model(self.model, dict(values), args, kwargs)
        self._enum_dims = max_plate_nesting(self._mf_structure)
        if not discrete:
            return deps
        cont = {n: v for n, v in values.items() if n not in discrete}
        sub = self._subsample_of(self._mf_structure)
        tr = run_model(self.model, {**cont, **sub}, args, kwargs, self._enum_dims)
        extra = discrete_dependencies(tr, discrete)
        return {n: set(d) | extra.get(n, set()) for n, d in deps.items()}

    def _subsample_of(self, trace) -> Dict[str, torch.Tensor]:
        from .meanfield import subsample_values

        return subsample_values(trace)

    def _mean_field_analysis(self, values, args, kwargs, infos, leaves, deps):
        from .meanfield import Analysis

        families = {n: i.family for n, i in infos.items() if i.family is not None}
        self._leaf_values = {n: values[n] for n in leaves}
        return Analysis(
            self.model,
            values,
            args,
            kwargs,
            families,
            leaves,
            deps,
            self._enum_dims,
            self._subsample_of(self._mf_structure),
        )

    def _relabel_natural_form(self, infos, analysis) -> None:
        """Natural-form sites take every message from the mean-field analysis (Algorithm 2)."""
        for name, info in infos.items():
            if info.form == NATURAL_FORM:
                info.factors = [
                    analysis.factor(f.site, name, site_form_ok=False) for f in info.factors
                ]
        for name, site in self._mf_structure.nodes.items():
            if not is_random(site) or (name in infos and infos[name].form == LEAF_FORM):
                continue
            if analysis.deps.get(name) or name in infos:
                analysis.spec(name)
        self._analysis = analysis

    def _apply_step(self, beta: float) -> None:
        """Called by :class:`~pyro_cvi.CVI`: one mirror-descent step on every CVI parameter."""
        from .meanfield import sweep

        try:
            if self.schedule != "parallel" and any(
                i.form == NATURAL_FORM for i in self._latents.values()
            ):
                sweep(self, beta)
                return
            for info in self._latents.values():
                if info.form == SITE_FORM:
                    self._apply_site_step(info, beta)
                elif info.form == NATURAL_FORM:
                    self._apply_natural_step(info, beta)
        finally:
            self._step_subsample = {}

    # ------------------------------------------------------------------ the guide itself
    def forward(self, *args, **kwargs):
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        plates = self._create_plates(*args, **kwargs)
        result = {}
        for name, info in self._latents.items():
            if info.form == LEAF_FORM:
                continue
            site = self.prototype_trace.nodes[name]
            with ExitStack() as stack:
                for frame in site["cond_indep_stack"]:
                    if frame.vectorized:
                        stack.enter_context(plates[frame.name])
                q = self._natural_dist(info, plates) if info.form == NATURAL_FORM else None
                result[name] = pyro.sample(name, q if q is not None else self.posterior(name))
        leaves = [n for n, i in self._latents.items() if i.form == LEAF_FORM]
        if leaves:
            tr = poutine.block(trace_model)(self.model, result, args, kwargs)
            for name in leaves:
                site = tr.nodes[name]
                with ExitStack() as stack:
                    for frame in site["cond_indep_stack"]:
                        if frame.vectorized:
                            stack.enter_context(plates[frame.name])
                    fn = site["fn"]
                    if site["mask"] is not None:
                        fn = fn.mask(site["mask"])
                    result[name] = pyro.sample(name, fn)
        return result

    def posterior(self, name: str) -> torch.distributions.Distribution:
        """The current ``q`` of latent site ``name`` as a torch Distribution."""
        if self.prototype_trace is None:
            raise RuntimeError("AutoCVI has not seen the model yet: call svi.step(...) first")
        if name not in self._latents:
            raise KeyError(
                f"{name!r} is not a latent site of the model; latent sites: {list(self._latents)}"
            )
        info = self._latents[name]
        if info.form == SITE_FORM:
            post = self._posts[name]
            shape = info.event_shape
            if len(shape) == 0:
                return dist.Normal(post.loc[0], post.covariance()[0, 0].sqrt())
            mvn = dist.MultivariateNormal(post.loc, scale_tril=post.scale_tril())
            if len(shape) == 1:
                return mvn
            return dist.TransformedDistribution(
                mvn, torch.distributions.transforms.ReshapeTransform(mvn.event_shape, shape)
            )
        if info.form == NATURAL_FORM:
            return self._natural_dist(info)
        raise ValueError(
            f"{name!r} is a leaf latent: its q is the model's conditional prior given its "
            "parents, sampled by the guide; it has no free parameters"
        )

    @torch.no_grad()
    def median(self, *args, **kwargs) -> Dict[str, torch.Tensor]:
        """The posterior median (the mean, for Gaussian factors) of each non-leaf latent site."""
        return {
            n: _mean_of(self.posterior(n)) for n, i in self._latents.items() if i.form != LEAF_FORM
        }

    def explain(self) -> str:
        """One line per (factor, latent site): the kind CVI gives it, and why."""
        if self.prototype_trace is None:
            raise RuntimeError("AutoCVI has not seen the model yet: call svi.step(...) first")
        lines = [f"{'factor':>20s}    {'latent':<12s} {'kind':<17s} why"]
        for name, info in self._latents.items():
            fam = info.family.name if info.family is not None else "conditional prior"
            lines.append(f"# {name}: q = {fam} ({info.form} form)")
            for f in info.factors:
                lines.append(f.describe())
        return "\n".join(lines)


def _same_record(old: Optional[StepRecord], new: StepRecord) -> bool:
    if old is None or len(old.rows) != len(new.rows):
        return False
    if not old.prior.equal(new.prior):
        return False
    for (_, r1), (_, r2) in zip(old.rows, new.rows):
        if r1.A is not r2.A and not torch.equal(r1.A, r2.A):
            return False
        if not (torch.equal(r1.w, r2.w) and torch.equal(r1.b, r2.b)):
            return False
    return True


def _key(args, kwargs):
    items = list(args) + [kwargs[k] for k in sorted(kwargs)]
    return tuple(
        (id(a), a._version, tuple(a.shape)) if torch.is_tensor(a) else id(a) for a in items
    )


def _mean_of(q):
    if q.support.is_discrete:  # discrete natural-form sites: the mode (a valid value)
        return q.mode.detach()
    try:
        return q.mean.detach()
    except NotImplementedError:
        return q.sample().detach()


def _gaussian_prior(fn, D: int) -> GaussianPrior:
    base, _, _ = unwrap(fn)
    if isinstance(base, torch.distributions.MultivariateNormal):
        loc = base.loc.expand(base.batch_shape + base.event_shape).reshape(-1)
        if "precision_matrix" in vars(base):  # the model gave a precision: keep it
            return GaussianPrior(loc, precision=base.precision_matrix)
        return GaussianPrior(loc, cov=base.covariance_matrix)
    loc = base.loc.expand(fn.shape()).reshape(-1)
    var = (base.scale**2).expand(fn.shape()).reshape(-1)
    if loc.numel() != D:
        raise ValueError(f"prior has {loc.numel()} elements, expected {D}")
    return GaussianPrior(loc, var=var)
