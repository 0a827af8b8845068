"""Model analysis: the one classifier of CVI (step 1 of the pipeline, see docs/architecture.md).

From traces of the model at a prior draw, :class:`Analysis` decides

* the **q family** of every latent site, from its support
  (:func:`~pyro_cvi.families.family_for_support`);
* the **leaves**: latent sites no other site depends on. Their ``q`` is their conditional prior,
  which integrates them out exactly; they send and receive no message;
* the **Gaussian blocks** (site form, Algorithm 1): Gaussian latents with no batch dims and a
  Normal/MVN prior free of other latents, grouped into connected components over shared
  factors, so one block holds one joint Gaussian with full covariance across its sites
  (as AutoMultivariateNormal does). A conjugate linear-Gaussian model is then exact in one
  step however its coefficients are split into sample sites;
* the **kind** of every (factor, latent or block) pair: ``conjugate prior``, ``conjugate``
  (exact natural-parameter message, eq. 2 / eq. 20), ``linear-predictor`` (O(N) sites, App. E.1),
  ``softmax-predictor`` (O(N K^2) coupled K-dimensional sites,
  :mod:`~pyro_cvi.messages.softmax_sites`),
  ``general`` (Monte Carlo), ``leaf``; for the natural-form (mean-field, Algorithm 2) latents
  through the conjugate-pair registry (:mod:`~pyro_cvi.model.factor_roles`);
* the **owner** of every factor's ELBO term: the Gaussian block it lies in, the mean-field
  expectations, or nobody (a constant of q), so that every factor is counted exactly once.

Dependencies come from autograd (structural) and from Pyro's enumeration bookkeeping for
discrete latents; every affine pattern is confirmed by probing (:mod:`~pyro_cvi.model.probes`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Set

import torch

from . import dependencies as dep
from . import gaussian_tree, probes
from .bilinear import BILINEAR_FORM, bilinear_factor, find_bilinear
from .block_factors import (
    chain_factor,
    cross_factor,
    enumerated_factor,
    plate_factor,
    softmax_factor,
)
from .collapsed_group import collapsed_sites, collapsed_spec, infinite_support_error, summed_out
from .collapsed_group import families_summing_marked as choose_families
from .discrete_glm import discrete_glm_factor, unites
from .explain import explain
from .factor_roles import FactorSpec, factor_spec
from .prior_factor import beside_factors
from .records import (
    COLLAPSED,
    CONJUGATE,
    CONSTANT,
    GENERAL,
    LEAF,
    LEAF_FORM,
    LINEAR,
    MEANFIELD,
    NATURAL,
    PRIOR,
    REMAINDER,
    REMAINDER_OWNER,
    SITE,
    BlockSpec,
    Factor,
    LatentInfo,
    centred_logits,
)
from .remainder import apply_remainder, remainder_factor, remainder_sets
from .structures import find_chains
from .tracing import (
    describe_link,
    is_random,
    linear_candidates,
    linear_param,
    linked_reader,
    max_plate_nesting,
    no_link_reason,
    rebuilds,
    run_model,
    subsample_values,
    trace_model,
    unwrap,
)
from .weights import leaf_latents, weighted_chain

__all__ = ["Analysis", "SITE", "NATURAL", "LEAF_FORM", "REMAINDER"]  # (records: model.records)


class Analysis:
    """Classifies a model's latents and factors for CVI (see the module docstring).

    :param model: the Pyro model. :param args, kwargs: its arguments (the training data).
    :param prototype_trace: a trace of the model (a prior draw of every latent).
    :param covariance: ``"full"`` or ``"diag"`` Gaussians.
    :param own_leaves: give a leaf with a Normal or MultivariateNormal prior a ``q`` of its
        own (a start at ``init_loc_fn``'s values; the steps take that ``q`` to its prior).
    :param discrete: ``"auto"`` sums out the discrete latents the model marks for enumeration,
        ``"collapse"`` all, ``"mean_field"`` none (the rule: :mod:`.collapsed_group`); the others
        get their own Categorical/Bernoulli ``q``.
    """

    def __init__(
        self,
        model: Callable,
        args,
        kwargs,
        prototype_trace,
        covariance: str = "full",
        families: Optional[Dict[str, str]] = None,
        discrete: str = "auto",
        remainder: Optional[Callable[[int], bool]] = None,
        own_leaves: bool = False,
    ):
        self.model, self.args, self.kwargs = model, args, kwargs
        self.placed = (families, remainder)  # (AutoCVI's families and remainder: chain finders)
        proto = prototype_trace
        self.values: Dict[str, torch.Tensor] = {
            n: s["value"].detach() for n, s in proto.iter_stochastic_nodes() if is_random(s)
        }
        self.families, self.fallback, self.discrete, unsupported = choose_families(
            proto, list(self.values), covariance, families, discrete
        )
        self.continuous = {
            n for n, v in self.values.items() if n not in self.discrete and v.is_floating_point()
        }
        # one trace at the prototype values with every continuous latent an autograd leaf:
        # the structure, the plates and the continuous dependencies
        leaves = {n: self.values[n].clone().requires_grad_(True) for n in self.continuous}
        fixed = {n: v for n, v in self.values.items() if n not in leaves}
        with torch.enable_grad():
            self.structure = trace_model(model, {**fixed, **leaves}, args, kwargs)
        self.subsample = subsample_values(self.structure)
        self.minibatch_plates = {
            n for n, v in self.subsample.items() if len(v) < self.structure.nodes[n]["fn"].size
        }
        self.plate_dims = max_plate_nesting(self.structure)
        self.enum_dims = self.plate_dims if self.discrete else None
        found = dep.discover(
            model,
            args,
            kwargs,
            self.structure,
            self.values,
            leaves,
            fixed,
            self.discrete,
            self.subsample,
            self.plate_dims,
        )
        self.deps, self.random_sites, tr, not_enumerable = found
        self._leaf_trace = (tr, leaves)
        if not_enumerable is not None:  # (run as Pyro's Trace_ELBO would)
            self.enum_dims = None
        referenced = set().union(*self.deps.values()) if self.deps else set()
        # a leaf's q is its conditional prior, the optimum only for an unweighted prior: a
        # tempered leaf (poutine.scale / mask) gets a q of its own, q ~ p^c
        self.leaves = leaf_latents(self.values, referenced, self.structure.nodes, own_leaves)
        if (why := not_enumerable) is not None:
            self.leaves = dep.unenumerated_leaves(
                self.leaves, self.deps, self.values, self.discrete, self.structure.nodes, why
            )
        for name, e in unsupported.items():
            fn = proto.nodes[name]["fn"]
            if name in self.leaves:
                continue
            if fn.support.is_discrete and not fn.has_enumerate_support:
                raise infinite_support_error(name, fn)
            hint = " Or AutoCVI(discrete='collapse') sums it out." if fn.support.is_discrete else ""
            raise ValueError(f"latent site {name!r}: {e}{hint}") from None
        # summed-out discrete latents (marked for enumeration, or "collapse"): no q
        self.collapsed = summed_out(self, discrete)
        self.collapsed_sites = collapsed_sites(self.structure.nodes, self.deps, self.collapsed)
        self._feeds_collapsed = set().union(
            set(self.collapsed_sites), *[self.deps[s] for s in self.collapsed_sites]
        )
        self.continuous -= self.leaves
        self.ref = {n: self.values[n] for n in self.continuous}
        self.fixed = {n: self.values[n] for n in self.leaves}
        self.latents: OrderedDict[str, LatentInfo] = OrderedDict()
        for name in self.values:
            if name in self.collapsed:
                continue
            site = proto.nodes[name]
            form = LEAF_FORM if name in self.leaves else NATURAL
            frames = [f for f in site["cond_indep_stack"] if f.vectorized]
            fam = None if name in self.leaves else self.families[name]
            fn = site["fn"]
            self.latents[name] = LatentInfo(name, fam, form, fn.event_shape, fn.batch_shape, frames)
        self.chains = find_chains(self)  # (the registered finders: model/structures.py)
        # a chain with a weight its Kalman block cannot temper (a masked-out transition, a
        # weighted random walk) goes to the blocks that weigh its prior element by element
        self.chains = [c for c in self.chains if not weighted_chain(self.structure, c)]
        self.probe_cache: Dict[object, list] = {}
        #: per subsampled plate: whether its minibatch is the same in every run (block_factors)
        self.fixed_subsamples: Dict[str, bool] = {}
        #: the remainder's latents (model order; a kept chain's scales at once), discrete summed
        self.remainder: List[str] = [z for c in self.chains for z in getattr(c, "scales", ())]
        self.remainder_discrete: Set[str] = set()
        #: Gamma precisions kept beside the remainder: ``{latent: its Normal factors}``
        self.precisions: Dict[str, List[str]] = {}
        chosen = {n for n in (families or {})}
        #: bilinear Normal factors with their own block (:mod:`~pyro_cvi.model.bilinear`)
        self.bilinear = find_bilinear(self, chosen) if remainder else []
        for b in self.bilinear:
            for n in b.names:
                self.latents[n].form = BILINEAR_FORM
        #: remainder latents Gaussian given the others with a scale inside it (model/remainder)
        self.scaled_gaussians: List[str] = []
        self.regroup()
        if remainder:
            chosen = {n for n, f in (families or {}).items() if f not in ("gaussian", "joint")}
            apply_remainder(self, *remainder_sets(self, chosen, remainder, families))

    def regroup(self) -> None:
        """Group the Gaussian blocks and classify every factor (again, after latents moved)."""
        self.specs: Dict[str, FactorSpec] = {}  # (asked while grouping; reset after)
        self.kept_specs: Optional[dict] = {None: False}  # (read once: factor_spec)
        self.blocks = self._group_blocks()
        self.probe_cache.clear()  # (block indices may have changed)
        self.specs, self.kept_specs[None] = {}, True
        self.owner: Dict[str, object] = {}
        self._classify()
        self.probe_cache.clear()
        self.kept_specs = None

    # ------------------------------------------------------------------ model runs
    def run(self, **override):
        """Trace the model at the reference values (discrete latents enumerated), overridden."""
        values = {**self.fixed, **self.subsample, **self.ref, **override}
        return run_model(self.model, values, self.args, self.kwargs, self.enum_dims)

    def leaf_trace(self):
        """A trace whose continuous latent values are autograd leaves, and the leaves."""
        return self._leaf_trace

    # ------------------------------------------------------------------ blocks
    def _site_form_candidate(self, name: str) -> bool:
        info = self.latents[name]
        fam, chained = info.family, any(name in c.names for c in self.chains)
        if info.form in (LEAF_FORM, REMAINDER, BILINEAR_FORM) or not fam.is_gaussian:
            return False
        if not fam.full_covariance or chained:
            return False
        if name in self._feeds_collapsed:
            return False
        # batch dims that no plate declares independent are one joint value (as to_event)
        if (len(info.batch_shape) and info.frames) or self.deps.get(name):  # a tree?
            return bool(self.deps.get(name)) and gaussian_tree.may_join(self, name)
        base = unwrap(self.structure.nodes[name]["fn"])[0]
        return isinstance(
            base, (torch.distributions.Normal, torch.distributions.MultivariateNormal)
        )

    def _group_blocks(self) -> List[BlockSpec]:
        """Connected components of the site-form candidates over shared factors (union-find)."""
        cand = [n for n in self.latents if self._site_form_candidate(n)]
        reset = self.probe_cache.clear
        return gaussian_tree.group(self, cand, self._union_blocks, self._probes, reset)

    def _union_blocks(self, cand: List[str]) -> List[BlockSpec]:
        parent = {n: n for n in cand}

        def find(n):
            while parent[n] != n:
                parent[n] = parent[parent[n]]
                n = parent[n]
            return n

        for site, deps in self.deps.items():
            if site in self.leaves:
                continue
            members = [n for n in cand if n in deps or n == site]
            if not unites(self, site):
                continue  # a discrete parent: the factor is enumerated by the mean field
            for m in members[1:]:
                parent[find(m)] = find(members[0])
        groups: OrderedDict[str, List[str]] = OrderedDict()
        for n in cand:
            groups.setdefault(find(n), []).append(n)
        blocks = []
        for n in self.latents:  # (a regrouping starts from the mean field)
            if self.latents[n].form == SITE:
                self.latents[n].form, self.latents[n].block = NATURAL, None
        self.chains = [c for c in self.chains if not set(c.names) & set(self.remainder)]
        for i, names in enumerate(groups.values()):
            shapes = tuple(torch.Size(self.values[n].shape) for n in names)
            blocks.append(BlockSpec(i, tuple(names), shapes))
            for n in names:
                self.latents[n].form, self.latents[n].block = SITE, i
        for c in self.chains:  # a Markov block per chain (shapes: whole values, plates too)
            shapes = tuple(self.values[n].shape for n in c.names)
            blocks.append(BlockSpec(len(blocks), c.names, shapes, chain=c))
            for n in c.names:
                self.latents[n].form, self.latents[n].block = SITE, len(blocks) - 1
        return blocks

    # ------------------------------------------------------------------ classification
    def spec(self, site: str) -> FactorSpec:
        """The mean-field analysis of a factor (conjugate pair roles, or general)."""
        if site not in self.specs and site in self.collapsed_sites:
            deps = self.deps.get(site, set())
            self.specs[site] = collapsed_spec(site, deps, self.continuous, self.collapsed)
        if site not in self.specs:
            self.specs[site] = factor_spec(self, site, getattr(self, "kept_specs", None))
        return self.specs[site]

    def latents_of(self, site: str) -> Set[str]:
        own = {site} if site in self.latents and site not in self.leaves else set()
        return (self.deps.get(site, set()) | own) - self.leaves

    def _classify(self) -> None:
        self.remainder_factors: List[Factor] = []
        natural = {n for n, i in self.latents.items() if i.form == NATURAL}
        inside = set(self.remainder) | self.remainder_discrete
        for site, node in self.structure.nodes.items():
            if not is_random(node) or site in self.leaves:
                continue
            if bilinear_factor(self, site):  # (model/bilinear.py)
                continue
            if site in inside or self.latents_of(site) & inside:  # (model/remainder.py)
                self.owner[site] = REMAINDER_OWNER
                self.remainder_factors.append(remainder_factor(site))
                cross_factor(self, site, inside)
                for name, beside in beside_factors(self, site):  # (model/beside.py)
                    self.latents[name].factors.append(beside)
                continue
            lat = self.latents_of(site) - self.collapsed
            blocks = {self.latents[n].block for n in lat if self.latents[n].form == SITE}
            if site in self.collapsed_sites:  # (its latents are all natural-form)
                self.owner[site] = MEANFIELD
                spec = self.spec(site)
                why = f"{spec.reason}: Monte Carlo message weighted by p(z | x, theta)"
                for z in sorted(lat, key=list(self.latents).index):
                    self.latents[z].factors.append(Factor(site, z, COLLAPSED, why))
            elif not lat:
                self.owner[site] = CONSTANT
            elif not (lat & natural) and len(blocks) == 1:
                (b,) = blocks
                self.owner[site] = b
                self.blocks[b].factors.append(self._block_factor(site, self.blocks[b]))
            else:
                self.owner[site] = MEANFIELD
                spec = self.spec(site)
                for b in sorted(blocks):
                    self.blocks[b].factors.append(self._shared_block_factor(spec, self.blocks[b]))
                for z in sorted(lat & natural, key=list(self.latents).index):
                    self.latents[z].factors.append(self._natural_factor(spec, z))
        for name in self.leaves:
            why = "no site depends on it: q is its conditional prior (exact)"
            self.latents[name].factors.append(Factor(name, name, LEAF, why))
        for block in self.blocks:
            for n in block.names:
                self.latents[n].factors = block.factors

    def _block_factor(self, site: str, block: BlockSpec) -> Factor:
        """A factor whose latents all lie in one Gaussian block: prior, conjugate Normal,
        linear predictor (the linked parameter affine in the joint z, probed) or general."""
        label = block.label
        tr, leaves = self.leaf_trace()
        base = unwrap(tr.nodes[site]["fn"])[0]
        kind_name = type(base).__name__
        if block.chain is not None:
            return chain_factor(self, site, block, base)
        if site in block.names:
            return Factor(site, label, PRIOR, f"{kind_name} prior of {site} (eq. 2)")
        plate = self.minibatch_plate(site)
        if plate is not None:
            # one site per data point, the minibatch's updated in place (incremental form);
            # else a damped stochastic message (doubly stochastic CVI)
            minibatch = plate_factor(self, site, block, base, plate)
            if minibatch is not None:
                return minibatch
            why = f"{kind_name} in subsampled plate {plate!r}: minibatch message (Bonnet/Price)"
            return Factor(site, label, GENERAL, why, plate=plate)
        if centred_logits(base) is not None:
            return softmax_factor(self, site, block, base)
        zs = [leaves[n] for n in block.names]
        if site in self.random_sites:  # a hidden draw: its messages are averaged over draws
            why = f"{kind_name} reads a draw the guide does not see: Monte Carlo message"
            return Factor(site, label, GENERAL, why, hidden_draw=True)
        if torch.is_tensor(obs := tr.nodes[site]["value"]) and obs.requires_grad:  # obs=f(z)
            why = f"{kind_name}'s observed value depends on {label}: Bonnet/Price message"
            return Factor(site, label, GENERAL, why)
        with torch.enable_grad():
            candidates = linear_candidates(base, zs)
        for name, link in candidates:
            value = linear_param(base, name, link)[1]
            read = linked_reader(name, link)  # (a link read back: the numeric probes decide)
            probed = self.probed_rows(site, block, value, read, structural=link is None)
            if probed is None or not rebuilds(tr.nodes[site], base, value, name, link):
                continue
            A, dynamic = probed
            R, D = A.shape
            if isinstance(base, torch.distributions.Normal) and name == "loc":
                why = f"Normal loc affine in {label} (probed, A: {R}x{D}), scale free of them"
                return Factor(site, label, CONJUGATE, why, name, A, dynamic)
            how = describe_link(base, name, link, "A z + c")
            why = f"{kind_name} {how} (probed, A: {R}x{D}); {R} sites"
            return Factor(site, label, LINEAR, why, name, A, dynamic, link=link)
        return Factor(site, label, GENERAL, no_link_reason(base, zs, candidates, label))

    def probed_rows(
        self, site, block: BlockSpec, value, read: Callable, row_constant=False, structural=True
    ):
        """The Jacobian ``A`` of ``value`` in the block's joint z (autograd), confirmed affine
        at the shared probe runs (``read(fn)`` takes the same quantity from a moved trace):
        ``(A, dynamic)``, or ``None`` when it is not affine."""
        tr, leaves = self.leaf_trace()
        zs = [leaves[n] for n in block.names]
        if structural and not probes.affine_graph(value, zs, row_constant):  # piecewise ops
            return None
        with torch.enable_grad():
            jac = {n: probes.detached(probes.jacobian(value, leaves[n])) for n in block.names}
            params = [s["value"] for s in tr.nodes.values() if s["type"] == "param"]
            dynamic = probes.depends_on_params(value, zs, params)
        for shrink in (1.0, 1e-2):  # smaller moves where exp(...) overflowed at the first
            runs = self._probes(block, shrink)
            moved = [(dz, read(unwrap(t.nodes[site]["fn"])[0])) for dz, t in runs]
            if moved and probes.affine_at(value.detach(), moved, jac):
                return probes.joined([jac[n] for n in block.names]), dynamic
            if all(bool(torch.isfinite(f).all()) for _, f in moved):
                return None

    def minibatch_plate(self, site: str) -> Optional[str]:
        """The subsampled plate (``subsample_size < size``) that factor ``site`` lies in."""
        for frame in self.structure.nodes[site]["cond_indep_stack"]:
            if frame.name in self.minibatch_plates:
                return frame.name
        return None

    def _probes(self, block: BlockSpec, shrink: float = 1.0):
        """Model runs at joint perturbations of the block's sites (``probes.perturbations``: random
        moves and a reflection; scaled by ``shrink``), shared by every factor of the block:
        ``[(perturbations, trace)]``."""
        key = block.index if shrink == 1.0 else (block.index, shrink)
        if key not in self.probe_cache:
            at = {n: self.ref[n] for n in block.names}
            moves = [{n: shrink * d for n, d in dz.items()} for dz in probes.perturbations(at)]
            with torch.no_grad():  # (a move the model refuses is halved, or left out)
                runs = probes.moved_runs(lambda v: self.run(**v), at, moves)
            self.probe_cache[key] = runs
        return self.probe_cache[key]

    def _shared_block_factor(self, spec: FactorSpec, block: BlockSpec) -> Factor:
        """A factor shared by a Gaussian block and natural-form latents: exact rows at the
        other latents' expectations when conjugate given them (eq. 20), else general."""
        label = block.label
        others = ", ".join(sorted(spec.latents - set(block.names)))
        if spec.site in block.scale_latent:  # a tree member's prior with a latent scale
            why = f"Normal prior of {spec.site}, scale at E_q of {others} (the mean field's)"
            return Factor(spec.site, label, PRIOR, why)
        loc = spec.roles.get("loc")
        if spec.exact and not spec.discrete and loc is not None and loc.kind == "affine":
            if set(loc.parents) - set(block.names):
                why = f"{spec.reason}: loc also affine in another Gaussian q"
                return Factor(spec.site, label, GENERAL, why)
            A = torch.cat([spec.dense_jacobian(n, k) for n, k in zip(block.names, block.sizes)], 1)
            why = f"{spec.reason}: rows with E_q[precision], given {others} (eq. 20)"
            return Factor(spec.site, label, CONJUGATE, why, "loc", A, spec.dynamic, True)
        enumerated = enumerated_factor(self, spec, block) or discrete_glm_factor(self, spec, block)
        if enumerated is not None:
            return enumerated
        why = f"{spec.reason or 'shared'}; given {others}: stochastic message (Bonnet/Price)"
        return Factor(spec.site, label, GENERAL, why)

    def _natural_factor(self, spec: FactorSpec, z: str) -> Factor:
        fam = self.families[z]
        if not spec.exact:
            how = "Monte Carlo gradient (implicit reparameterisation + Fisher solve, App. F)"
            return Factor(spec.site, z, GENERAL, f"{spec.reason}: non-conjugate; {how}")
        msg = f"exact {fam.name} message (eq. 20)"
        others = spec.latents - {z}
        if spec.site == z:
            if z in self.discrete:
                K = fam.num_values
                kind = PRIOR if not others else CONJUGATE
                return Factor(spec.site, z, kind, f"{spec.reason}: enumerated (K={K}), exact")
            if not others:
                return Factor(spec.site, z, PRIOR, f"{spec.reason} prior (same family as q): exact")
            why = f"{spec.reason} prior given {', '.join(sorted(others))}: {msg}"
            return Factor(spec.site, z, CONJUGATE, why)
        if z in self.discrete:
            K = fam.num_values
            return Factor(spec.site, z, CONJUGATE, f"{spec.reason} (K={K}): {msg}")
        return Factor(spec.site, z, CONJUGATE, f"{spec.reason}: {msg}")

    # ------------------------------------------------------------------ text
    def explain(self, blocks=None) -> str:
        """One line per (factor, latent or block): the kind CVI gives it, and why; with the
        engine's ``blocks``, the messages each block receives (``Block.incoming``)."""
        return explain(self, blocks)
