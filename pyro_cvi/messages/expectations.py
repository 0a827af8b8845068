"""Closed-form ``E_q[log p_a]`` of exact (conditionally conjugate) factors, as a differentiable
function of the mean parameters (Algorithm 2, eqs. 20 and 89).

:class:`QState` is the current ``q`` for one step: the mean parameters ``mu_i`` of the
natural-form latents as autograd leaves (restricted to the minibatch), the Gaussian blocks'
posteriors, and the values at which the model is run to read expectations off it ("mean"
values ``E z``, and for Gamma latents the "geometric" values ``exp(E log z)``).
:func:`expected_log_prob` builds ``E_q[log p_a]`` from a pattern of
:mod:`~pyro_cvi.model.conjugate_pairs`; autograd of it with respect to ``mu_i`` *is* the VMP
message,
because it is multilinear in the ``mu``'s.
"""

from __future__ import annotations

from typing import Dict, List, Set, Tuple, Union

import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.distributions.util import broadcast_shape, scale_and_mask

from ..families.base import sum_rightmost
from ..gaussian.selection import SelectionJacobian, dense
from ..model import conjugate_pairs as cp
from ..model.factor_roles import FactorSpec
from ..model.probes import jacobian
from ..model.selection_probes import selection_jacobian
from ..model.tracing import unwrap

#: a dense ``(R, D)`` Jacobian or a selection of one non-zero per row
Jacobian = Union[torch.Tensor, SelectionJacobian]

__all__ = [
    "QState",
    "FactorMoments",
    "expected_log_prob",
    "site_weight",
    "discrete_weight",
    "particle_values",
]


class QState:
    """The current ``q`` for one step (see the module docstring).

    :param natural: natural-form blocks by latent name; :param gaussian: the Gaussian blocks;
    :param grad_names: latents whose mean parameters are autograd leaves;
    :param fixed: values held fixed (leaf latents, subsample indices).
    """

    def __init__(self, natural, gaussian, subsample, grad_names: Set[str], fixed):
        self.lam: Dict[str, Tuple[torch.Tensor, ...]] = {}
        self.mu: Dict[str, Tuple[torch.Tensor, ...]] = {}
        self.fam = {}
        self.cond: Dict[str, torch.Tensor] = {}
        self.geo: Dict[str, torch.Tensor] = {}
        self.block_of: Dict[str, object] = {}
        self.fixed = dict(fixed)
        for name, nb in natural.items():
            fam = nb.family
            lam = nb.natural(subsample)
            mu = tuple(t.detach() for t in fam.natural_to_mean(lam))
            if name in grad_names:
                mu = tuple(t.requires_grad_(True) for t in mu)
            self.lam[name], self.mu[name], self.fam[name] = lam, mu, fam
            cond = fam.mean_value(lam, mu)
            if cond is None:  # discrete: enumerated, never conditioned
                continue
            if fam.is_gaussian and not cond.requires_grad:  # a leaf for affine Jacobians
                cond = cond.detach().requires_grad_(True)
            self.cond[name] = cond.reshape(nb.value_shape(lam))
            geo = fam.geometric_mean(lam, mu)
            if geo is not None:
                self.geo[name] = geo
        for block in gaussian:
            for n, v in block.mean_values().items():
                self.cond[n] = v.detach().clone().requires_grad_(True)
                self.block_of[n] = block
        self.fixed.update(subsample)

    def values(self, mode: str) -> Dict[str, torch.Tensor]:
        vals = {**self.fixed, **self.cond}
        if mode == "geo":
            vals.update(self.geo)
        return vals

    def probs(self, name: str) -> torch.Tensor:
        """q probabilities of a discrete latent over its values (last dim), differentiable."""
        return self.fam[name].probs(self.mu[name])

    def variance(self, jacobians: Dict[str, Jacobian]) -> torch.Tensor:
        """``Var(sum_p A_p z_p)`` under q: blocks joint, natural-form latents independent
        (a selection ``A_p`` of a natural-form latent is never formed densely)."""
        total, per_block = 0.0, {}
        for p, A in jacobians.items():
            block = self.block_of.get(p)
            if block is None:
                total = total + self.fam[p].variance_along(self.mu[p], A)
            else:
                per_block.setdefault(id(block), (block, {}))[1][p] = dense(A)
        for block, parts in per_block.values():
            total = total + block.variance_along(parts)
        return total


class FactorMoments:
    """The expectations a pattern's ``elp`` asks for, for one factor at one step."""

    def __init__(self, spec: FactorSpec, traces, q: QState, cache: Dict, key):
        self.spec, self.q, self.cache, self.key = spec, q, cache, key
        site = traces["mean"].nodes[spec.site]
        self.site = site
        self.base = unwrap(site["fn"])[0]
        geo = traces.get("geo")
        self.base_geo = unwrap(geo.nodes[spec.site]["fn"])[0] if geo is not None else self.base
        self.x = site["value"]
        self.pattern = spec.pattern

    def _read(self, base, name):
        return self.pattern.read(base, name)

    def E(self, name):
        if self.spec.roles[name].kind == cp.IDENTITY:
            raise NotImplementedError
        return self._read(self.base, name)

    def Elog(self, name):
        role = self.spec.roles[name]
        if role.kind == cp.CONST:
            if name == "probs":
                return -F.softplus(-self.base.logits)
            return torch.log(self._read(self.base, name))
        if role.kind == cp.MONOMIAL:
            return torch.log(self._read(self.base_geo, name))
        if role.kind == cp.IDENTITY:
            (p,) = role.parents
            return cp.gather_rows(self.q.mu[p][0], role.idx, False)
        raise NotImplementedError(role.kind)

    def Elog1m(self, name):
        role = self.spec.roles[name]
        if role.kind == cp.CONST:
            return -F.softplus(self.base.logits)
        (p,) = role.parents
        return cp.gather_rows(self.q.mu[p][1], role.idx, False)

    def Elogvec(self, name):
        role = self.spec.roles[name]
        if role.kind == cp.CONST:
            return self.base.logits
        (p,) = role.parents
        return cp.gather_rows(self.q.mu[p][0], role.idx, True)

    def Var(self, name):
        role = self.spec.roles[name]
        t = self._read(self.base, name)
        if role.kind == cp.CONST:
            return torch.zeros((), dtype=t.dtype, device=t.device)
        jac = {p: self._jacobian(name, p, t) for p in role.parents}
        return self.q.variance(jac).reshape(t.shape)

    def jacobian(self, name, p, t):
        """``d t / d z_p`` of a quantity ``t`` affine in latent ``p`` (cached under ``name``)."""
        return self._jacobian(name, p, t)

    def _jacobian(self, name, p, t):
        """``d theta / d z_p`` (affine, so constant): cached per data and minibatch unless it
        depends on learnable parameters. A large one with one non-zero per row is kept as a
        selection (:mod:`~pyro_cvi.model.selection_probes`), never formed densely."""
        hit = self.cache.get((self.spec.site, name, p))
        if hit is not None and hit[0] == self.key and not self.spec.dynamic:
            return hit[1]
        A = selection_jacobian(t, self.q.cond[p])
        if A is None:
            A = jacobian(t, self.q.cond[p]).detach()
        self.cache[(self.spec.site, name, p)] = (self.key, A)
        return A

    # value moments
    def x_float(self):
        x = self.x
        return x if x.is_floating_point() else x.to(self.base.mean.dtype)

    def _mu(self):
        return self.q.mu[self.spec.site]

    def x_gauss(self):
        if self.spec.value_kind != "latent":
            return self.x, 0.0
        fam = self.q.fam[self.spec.site]
        m = self._mu()[0]
        shape = self.x.shape
        return m.reshape(shape), fam.marginal_variance(self._mu()).reshape(shape)

    def x_gamma(self):
        if self.spec.value_kind != "latent":
            return torch.log(self.x), self.x
        return self._mu()

    def x_beta(self):
        if self.spec.value_kind != "latent":
            return torch.log(self.x), torch.log1p(-self.x)
        return self._mu()

    def x_dirichlet(self):
        if self.spec.value_kind != "latent":
            return torch.log(self.x)
        return self._mu()[0]


def reduce_like(fn, lp: torch.Tensor) -> torch.Tensor:
    """Reduce an elementwise log-density of ``fn``'s base distribution like ``fn.log_prob``
    does: the ``.mask()`` and ``to_event`` wrappers are applied innermost first."""
    layers = []
    d = fn
    while True:
        if isinstance(d, dist.MaskedDistribution):
            layers.append(("mask", d._mask))
            d = d.base_dist
        elif isinstance(d, torch.distributions.Independent):
            layers.append(("sum", d.reinterpreted_batch_ndims))
            d = d.base_dist
        elif isinstance(d, dist.ExpandedDistribution):
            d = d.base_dist
        else:
            break
    for kind, v in reversed(layers):
        if kind == "sum":
            lp = sum_rightmost(lp, v)
        elif v is not True:
            lp = torch.where(v, lp, torch.zeros_like(lp)) if v is not False else lp * 0
    return lp


def site_weight(site, lp: torch.Tensor) -> torch.Tensor:
    """Apply the site's ``poutine.mask`` / ``obs_mask`` and ``poutine.scale`` (plates)."""
    return scale_and_mask(lp, site["scale"], site["mask"])


def discrete_weight(spec: FactorSpec, trace, q: QState):
    """``prod_c q(c = value)`` over the enumerated discrete latents of the factor."""
    w = None
    for c in sorted(spec.discrete):
        value = trace.nodes[c]["value"]
        probs = q.probs(c)
        oh = F.one_hot(value.long(), probs.shape[-1]).to(probs.dtype)
        pc = (oh * probs).sum(-1)
        w = pc if w is None else w * pc
    return w


def expected_log_prob(spec: FactorSpec, traces, q: QState, cache: Dict, key) -> torch.Tensor:
    """``E_q[log p_a]`` in closed form (summed; scaled and masked like the site's log-prob)."""
    site = traces["mean"].nodes[spec.site]
    fn = site["fn"]
    base = unwrap(fn)[0]
    if spec.pattern is None:
        lp = base.log_prob(site["value"])
    else:
        lp = spec.pattern.elp(FactorMoments(spec, traces, q, cache, key))
    extra = fn.event_dim - base.event_dim
    shape = fn.batch_shape + fn.event_shape[:extra]
    lp = lp.expand(broadcast_shape(lp.shape, shape))  # (torch's imports sympy on first use)
    lp = reduce_like(fn, lp)
    w = discrete_weight(spec, traces["mean"], q)
    if w is not None:
        lp = lp * w
    return site_weight(site, lp).sum()


def particle_values(analysis, draws: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """``S`` joint draws of the latents as one set of values for a model run in a particle plate
    (the draws leading, left of the model's ``analysis.plate_dims`` plates); other values (the
    subsample indices) as the first draw has them."""
    S, P = len(draws), analysis.plate_dims
    values = {}
    for n, v in draws[0].items():
        if n not in analysis.values:  # (subsample indices)
            values[n] = v
            continue
        batch = v.dim() - analysis.structure.nodes[n]["fn"].event_dim
        stacked = torch.stack([d[n] for d in draws])
        values[n] = stacked.reshape((S,) + (1,) * (P - batch) + v.shape)
    return values
