"""The remainder: one joint Gaussian, on the unconstrained space, for every latent without an
exact message (:mod:`pyro_cvi.model.remainder` decides which), stepped by natural gradients.

``q(u) = N(m, S)`` over the packed unconstrained values ``u`` of the remainder's sites
(``z_i = T_i(u_i)``, ``T_i = biject_to(support_i)``, as Pyro's ``AutoContinuous`` packs them).
Its part of the ELBO is::

    L_R = E_q[ sum_{f in R} log p_f(T(u)) + log |T'(u)| ] + H[N(m, S)]

(the factors it owns; finite discrete latents summed out by Pyro's TraceEnum contraction),
estimated at reparameterised draws ``u = m + L eps``. The step is CVI's mirror descent for a
Gaussian (Khan & Lin 2017, eqs. 10-13) in the positive-definite form of Lin, Schmidt & Khan
(2020), shared with ``CVI()`` on Pyro's Gaussian guides (:mod:`pyro_cvi.gaussian`), by one of
two rules (:meth:`Remainder.choose_step`): the one-draw :class:`~pyro_cvi.Horizon` step
(:mod:`pyro_cvi.natgrad.horizon`, :mod:`pyro_cvi.natgrad.joint`: curvature by Stein's lemma
from the gradient at one draw, known Gaussian priors exact, a decay over a horizon), or the
:class:`~pyro_cvi.SignalToNoise` one (gradients in the parameters from several draws, or
Price's dense Hessians, under :mod:`pyro_cvi.natgrad.control`). The form (full, low rank plus
diagonal, diagonal) is :meth:`Remainder.form`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions.util import sum_rightmost
from torch.distributions import biject_to, constraints
from torch.distributions.transforms import ReshapeTransform

from ..context import StepContext
from ..families.shapes import broadcast_shapes, sympy_free
from ..gaussian import diag_step, lowrank_step, tril_log_prob, tril_step
from ..model.records import REMAINDER_OWNER
from ..natgrad.control import NoiseControl
from ..natgrad.horizon import Horizon
from ..natgrad.joint import (
    hierarchical,
    known_priors,
    may_use_price,
    onedraw_direction,
    onedraw_messages,
    onedraw_step,
    price_by_default,
    price_messages,
    prior_split,
    use_price,
)
from ..natgrad.params import write
from ..strategies import Remainder
from ..update import StepCounts
from .base import Block, BlockInit, GuideDraw, StepReport
from .marginals import standard_posterior
from .registry import Found, register_kind
from .remainder_joint import remainder_log_joint
from .remainder_rules import (
    LOWRANK_ONEDRAW_MOVE,
    cheap_hessian,
    holds_every_latent,
    is_real_support,
    price_beside,
)

__all__ = ["Remainder", "RemainderBlock"]


@dataclass
class _Site:
    name: str
    transform: torch.distributions.Transform
    shape: torch.Size  # constrained value
    ushape: torch.Size  # unconstrained value
    event_dim: int  # of the site's distribution
    frames: list
    start: int
    size: int
    real: bool  # real support: the unconstrained value is the value


class RemainderBlock(Block):
    """The remainder's joint Gaussian (see the module docstring).

    :param analysis: the model's :class:`~pyro_cvi.model.analysis.Analysis`.
    :param prefix: the guide's param-store prefix.
    :param strategy: the guide's :class:`Remainder`.
    :param owned: the factor sites whose ELBO terms this block computes.
    """

    kind = "remainder"
    moves_trace = True
    sweeps = True
    setup_traces = ("median",)  # it starts, as Pyro's Gaussian autoguides, at medians

    def __init__(self, analysis, prefix: str, strategy: Remainder, owned: Sequence[str]):
        self.analysis, self.strategy = analysis, strategy
        self.names = tuple(analysis.remainder)
        self.owned = list(owned)
        self.sites: List[_Site] = []
        start = 0
        for n in self.names:
            node = analysis.structure.nodes[n]
            fn, value = node["fn"], analysis.values[n]
            t = biject_to(fn.support)
            ushape = t.inv(value).shape
            size = int(ushape.numel())
            frames = [f for f in node["cond_indep_stack"] if f.vectorized]
            real = is_real_support(fn.support)
            site = _Site(n, t, value.shape, ushape, fn.event_dim, frames, start, size, real)
            self.sites.append(site)
            start += size
        self.dim = start
        self._alone = holds_every_latent(analysis, self.names)
        #: the known Gaussian priors (mean, precision; 0 where unknown), added exactly
        self.prior_loc, self.prior_prec = known_priors(analysis, self.sites, self.dim)
        # a Gamma precision kept beside it scales its likelihood from outside: a hierarchy too;
        # so does a latent scale of members Gaussian given the others (a random walk's step)
        an = analysis
        scaled = bool(getattr(an, "precisions", {}) or getattr(an, "scaled_gaussians", ()))
        self.rule = strategy.choose_step(hierarchical(analysis, self.names) or scaled)
        self.form = strategy.form(self.dim, self.rule)
        self.rank = strategy.rank or max(1, math.ceil(math.sqrt(self.dim)))
        self.rank = min(self.rank, self.dim)
        self.loc_name = f"{prefix}.remainder.loc"
        self.role_names = {
            "full": (f"{prefix}.remainder.scale_tril",),
            "lowrank": (f"{prefix}.remainder.scale", f"{prefix}.remainder.cov_factor"),
            "diag": (f"{prefix}.remainder.scale",),
        }[self.form]
        # every parameter is stored as it is (constraint real, as every AutoCVI parameter: the
        # guide binds the store's tensors as its own): the steps keep L's diagonal and the
        # scales positive (the retraction, and s' = s exp(...))
        self.constraints = {n: constraints.real for n in self.param_names()}
        #: Price's theorem (dense Hessians) for the precision (see Remainder.hessian)
        # (by default only where the log joint is vectorised: remainder_rules.VectorisedLogJoint)
        self.hessian = self.form == "full" and (
            strategy.curvature == "hessian"
            or (
                (
                    strategy.hessian(self.dim, self.rule)
                    or (scaled and price_beside(strategy, self.dim))
                )
                and cheap_hessian(analysis, self.owned)
            )
        )
        #: the one-draw step of :mod:`pyro_cvi.natgrad.horizon` (else the reparameterised
        #: gradients in the parameters, or Price's Hessians, under the noise control)
        self.onedraw = isinstance(self.rule, Horizon) and not self.hessian
        if self.hessian:  # (Price's Hessian target: full steps from the start, no warm-up)
            self.control = NoiseControl(start=1.0)
        elif isinstance(self.rule, Horizon):  # (no default averaging where the model learns)
            learns = any(s["type"] == "param" for s in self.analysis.structure.nodes.values())
            self.control = self.rule.control(self.form, learns)
        else:
            self.control = self.rule.control()
        if not self.onedraw:
            self.prior_prec = torch.zeros_like(self.prior_prec)
        # the default on a small full form: Price's Hessians (natgrad/joint.price_by_default),
        # decided here, so that a resumed run keeps the restored step control
        if (
            may_use_price(self, strategy)
            and price_by_default(self)
            and cheap_hessian(analysis, self.owned)
        ):
            use_price(self)
        self._grads: Optional[Dict[str, torch.Tensor]] = None
        #: latents of other blocks that its factors hold (Algorithm 2 between blocks): drawn
        #: from their ``q`` for its messages, so its value and gradient are expectations under
        #: them (unbiased, one joint draw per step)
        inside = set(self.names) | set(analysis.remainder_discrete) | set(analysis.leaves)
        self.cross = sorted(
            {n for s in self.owned for n in analysis.latents_of(s)} - inside - analysis.collapsed
        )
        #: how the particles run as one batched model run (:mod:`.remainder_joint`; ``None``:
        #: not yet checked, ``False``: one run per draw)
        self.vectorise: Optional[object] = None

    @property
    def label(self) -> str:
        return "remainder(" + ", ".join(self.names) + ")"

    def state_objects(self) -> List:
        if isinstance(self.control, NoiseControl):
            return [self.control, self.control.prec, self.control.mean]
        return [self.control]

    # ------------------------------------------------------------------ parameters
    def param_names(self) -> List[str]:
        return [self.loc_name, *self.role_names]

    def setup(self, init: BlockInit) -> None:
        tr = init.median_trace if init.median_trace is not None else init.prototype_trace
        parts = []
        for s in self.sites:
            value = tr.nodes[s.name]["value"] if tr is not None and s.name in tr.nodes else None
            if value is None:
                value = self.analysis.values[s.name]
            parts.append(s.transform.inv(value.detach()).reshape(-1))
        loc = torch.cat(parts)
        loc = torch.where(torch.isfinite(loc), loc, torch.zeros_like(loc))
        scale = init.init_scale if init.init_scale is not None else self.strategy.init_scale
        pyro.param(self.loc_name, lambda: loc.clone())
        D = self.dim
        if self.form == "full":
            eye = torch.eye(D, dtype=loc.dtype, device=loc.device)
            pyro.param(self.role_names[0], lambda: scale * eye)
        elif self.form == "diag":
            pyro.param(self.role_names[0], lambda: torch.full_like(loc, scale))
        else:  # W ~ N(0, 1/r), as Pyro's AutoLowRankMultivariateNormal (its Fisher is singular
            # at W = 0); s so that every marginal sd is init_scale. A fixed local generator:
            # the user's random stream is not consumed
            g = torch.Generator().manual_seed(0)
            W = torch.randn(D, self.rank, generator=g, dtype=loc.dtype, device=g.device)
            W = W.to(loc.device) / math.sqrt(self.rank)
            s0 = scale / (1.0 + (W * W).sum(-1)).sqrt()
            pyro.param(self.role_names[0], lambda: s0)
            pyro.param(self.role_names[1], lambda: W)

    def _values(self) -> Dict[str, torch.Tensor]:
        return {n: pyro.param(n).detach() for n in self.param_names()}

    # ------------------------------------------------------------------ the Gaussian
    def _draw(self, params: Dict[str, torch.Tensor], K: int) -> torch.Tensor:
        """``K`` reparameterised draws ``u = m + L eps`` (graph to ``params``)."""
        m = params[self.loc_name]
        if self.form == "full":
            L = params[self.role_names[0]].tril()
            return m + torch.randn(K, self.dim, dtype=m.dtype, device=m.device) @ L.mT
        s = params[self.role_names[0]]
        eps = torch.randn(K, self.dim, dtype=m.dtype, device=m.device)
        if self.form == "diag":
            return m + s * eps
        W = params[self.role_names[1]]
        eps2 = torch.randn(K, W.shape[-1], dtype=m.dtype, device=m.device)
        return m + s * (eps + eps2 @ W.mT)

    def _log_q(self, u: torch.Tensor) -> torch.Tensor:
        """``log q(u)`` at draws ``u`` (with their graph; none to the parameters)."""
        if self.form == "full" and u.dim() == 2:  # (without building the distribution)
            p = self._values()
            return tril_log_prob(p[self.loc_name], p[self.role_names[0]], u)
        return self.joint_unconstrained().log_prob(u)

    def covariance(self) -> torch.Tensor:
        """``q(u)``'s covariance over the packed unconstrained values (any form)."""
        p = self._values()
        if self.form == "full":
            L = p[self.role_names[0]]
            return L @ L.mT
        s = p[self.role_names[0]]
        cov = torch.diag_embed(torch.ones_like(s))
        if self.form == "lowrank":
            W = p[self.role_names[1]]
            cov = cov + W @ W.mT
        return s[:, None] * cov * s[None, :]

    def unpack(self, u: torch.Tensor) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
        """Constrained site values of one packed ``u`` and ``sum log |T'(u)|``."""
        values, logdet = {}, u.new_zeros(())
        for s in self.sites:
            x = u[s.start : s.start + s.size].reshape(s.ushape)
            z = s.transform(x)
            ld = s.transform.log_abs_det_jacobian(x, z)
            logdet = logdet + ld.sum()
            values[s.name] = z
        return values, logdet

    # ------------------------------------------------------------------ messages and steps
    def messages(self, ctx: StepContext) -> torch.Tensor:
        # the trace's free sample sites (none when alone: the trace need not even be taken)
        others = {} if self._alone else {
            n: node["value"]
            for n, node in ctx.trace.nodes.items()
            if node["type"] == "sample"
            and not node["is_observed"]
            and n not in self.names
            and n not in self.analysis.remainder_discrete
        }  # fmt: skip
        if self.cross:
            drawn = ctx.sample_q(exclude=set(self.names))
            others.update({n: drawn[n] for n in self.cross if n in drawn})
        kept = [n for n in self.cross if n in self.analysis.precisions]
        if kept:  # a kept precision enters at E_q[tau] (messages/precision.py)
            means = ctx.sample_q(exclude=set(self.names), at_means=True)
            others.update({n: means[n] for n in kept})
        K = self.strategy.draws(self.rule)
        with torch.enable_grad():
            p, log_joint = self._values(), lambda u: self._log_joint(ctx, u, others)
            if self.hessian or (self.onedraw and self.form != "lowrank"):
                if self.hessian:
                    elbo, grads = price_messages(self, ctx, p, log_joint, self._log_q, K)
                elif ctx.grads and self._averaged():  # a step: the iterate's draw, q-bar's report
                    it = self.control.step_params(p)
                    elbo, grads = onedraw_messages(self, ctx, it, log_joint, K, shown=p)
                else:
                    elbo, grads = onedraw_messages(self, ctx, p, log_joint, K)
                self._grads = grads if grads is not None else self._grads
                return elbo
            leaves = {n: v.clone().requires_grad_(True) for n, v in self._values().items()}
            draws = self._draw(leaves, K)
            # log p - log q at each draw, q's parameters held fixed in log q ("sticking the
            # landing", Roeder et al. 2017): unbiased for the ELBO and its gradient, and
            # without variance where q is the posterior. The known Gaussian priors are taken
            # out of the draws and added by their expectation, exactly
            per_t = self._log_joint(ctx, draws, others) - self._log_q(draws)
            per_t = per_t + prior_split(self, leaves, draws)
            elbo = per_t.mean()
            ctx.add_mc_samples(per_t)
            if ctx.grads:
                names = list(leaves)
                gs = torch.autograd.grad(
                    -elbo, [leaves[n] for n in names], retain_graph=True, allow_unused=True
                )
                self._grads = {
                    n: (torch.zeros_like(leaves[n]) if g is None else g.detach())
                    for n, g in zip(names, gs)
                }
        return elbo

    def _averaged(self) -> bool:
        """Whether the guide holds the one-draw step's iterates' average (``Horizon.average``;
        diagonal and full forms), the control the iterate."""
        return self.onedraw and self.form != "lowrank" and self.control.averaging

    def _log_joint(self, ctx: StepContext, draws: torch.Tensor, others) -> torch.Tensor:
        """``log p(x, T(u_k)) + log |T'(u_k)|`` of each draw (:mod:`.remainder_joint`)."""
        return remainder_log_joint(self, ctx, draws, others)

    def step(self, beta: float, ctx: Optional[StepContext] = None) -> List[StepReport]:
        grads, self._grads = self._grads, None
        if grads is None:
            return []
        ceiling = ctx.max_beta if ctx is not None and ctx.max_beta is not None else beta
        self.control.ceiling = float(ceiling)
        b_prec, b_mean = self.control.step_sizes()
        averaged = self._averaged()
        p = self.control.step_params(self._values()) if averaged else self._values()
        m = p[self.loc_name]
        if self.onedraw:
            grads[self.loc_name] = onedraw_direction(self, p, grads[self.loc_name])
        if self.onedraw and self.form != "lowrank":
            new, d = onedraw_step(self, p, grads, b_prec, b_mean)
        elif self.form == "full":
            (Ln,) = self.role_names
            L, G = p[Ln], grads.get("G")
            gL = grads[Ln].tril() if G is None else None
            m2, L2, d = tril_step(m, L, grads[self.loc_name], gL, b_prec, True, 1.0, b_mean, G)
            new = {self.loc_name: m2, Ln: L2}
        elif self.form == "diag":
            (sn,) = self.role_names
            m2, s2, d = diag_step(
                m, p[sn], grads[self.loc_name], grads[sn], b_prec, True, 1.0, b_mean
            )
            new = {self.loc_name: m2, sn: s2}
        else:
            sn, Wn = self.role_names
            gs = (grads[self.loc_name], grads[sn], grads[Wn])
            m2, s2, W2, d = lowrank_step(
                m,
                p[sn],
                p[Wn],
                *gs,
                b_prec,
                # one draw: a tighter trust region (log s and W move by at most 0.2)
                max_rel=LOWRANK_ONEDRAW_MOVE if self.onedraw else 1.0,
                beta_mean=b_mean,
            )
            new = {self.loc_name: m2, sn: s2, Wn: W2}
        counts = StepCounts()
        if all(bool(torch.isfinite(v).all()) for v in new.values()):
            if averaged:  # the guide holds the average, the control the iterate
                new = self.control.average_in(new, batched=self.vectorise is not False)
            for n, v in new.items():
                write(n, v, self.constraints)
            if averaged:
                self.control.written(self._values())
            self.control.observe(d)
        else:
            counts.rejected += 1
        return [StepReport(self.label, "remainder", b_prec, counts)]

    # ------------------------------------------------------------------ the current q
    def _at(self, u: torch.Tensor, exclude: Sequence[str] = ()) -> Dict[str, torch.Tensor]:
        values, _ = self.unpack(u)
        return {n: v for n, v in values.items() if n not in exclude}

    def trace_values(self, subsample: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return self._at(pyro.param(self.loc_name).detach())

    def sample(
        self,
        subsample: Dict[str, torch.Tensor],
        exclude: Sequence[str] = (),
        at_means: bool = False,
    ) -> Dict[str, torch.Tensor]:
        if at_means:
            return self._at(pyro.param(self.loc_name).detach(), exclude)
        with torch.no_grad():
            return self._at(self._draw(self._values(), 1)[0], exclude)

    def joint_unconstrained(self) -> dist.MultivariateNormal:
        """``q(u)``: the Gaussian over the packed unconstrained values."""
        loc = pyro.param(self.loc_name).detach()
        if self.form == "full":
            L = pyro.param(self.role_names[0]).detach()
            return dist.MultivariateNormal(loc, scale_tril=L)
        return dist.MultivariateNormal(loc, covariance_matrix=self.covariance())

    def _site(self, name: str) -> _Site:
        for s in self.sites:
            if s.name == name:
                return s
        raise KeyError(f"{name!r} is not in the remainder")

    def marginal(self, name: str) -> torch.distributions.Distribution:
        """The site's marginal: its unconstrained coordinates' Gaussian marginals (independent,
        within the site) pushed through ``biject_to(support)``."""
        s = self._site(name)
        sl = slice(s.start, s.start + s.size)
        loc = pyro.param(self.loc_name).detach()[sl]
        cov = self.covariance()[sl, sl]
        if s.real:  # a real site: its Gaussian, as a Gaussian block's
            if len(s.shape) == 0:
                return dist.Normal(loc[0], cov[0, 0].sqrt())
            mvn = dist.MultivariateNormal(loc, covariance_matrix=cov)
            if len(s.shape) == 1:
                return mvn
            return dist.TransformedDistribution(mvn, ReshapeTransform(mvn.event_shape, s.shape))
        sd = cov.diagonal().sqrt()
        udim = s.event_dim + len(s.ushape) - len(s.shape)
        base = dist.Normal(loc.reshape(s.ushape), sd.reshape(s.ushape))
        if udim:
            base = base.to_event(udim)
        return standard_posterior(dist.TransformedDistribution(base, [sympy_free(s.transform)]))

    def guide_sample(self, name: str, draw: GuideDraw) -> Dict[str, torch.Tensor]:
        """One auxiliary joint draw of ``u``, then each site a ``Delta`` with the log-Jacobian
        of its map (as ``AutoContinuous.forward``); all at the block's first site."""
        u = pyro.sample(
            f"_{draw.prefix}_latent_remainder",
            draw.frozen(self.joint_unconstrained_with_graph()),
            infer={"is_auxiliary": True},
        )
        out = {}
        batch = u.shape[:-1]  # plates outside the model's (vectorised particles)
        for s in self.sites:
            # broadcast against the site's own plate dims, as AutoContinuous unpacks
            udim = s.event_dim + len(s.ushape) - len(s.shape)
            shape = broadcast_shapes(s.ushape, batch + (1,) * udim)
            x = u[..., s.start : s.start + s.size].reshape(shape)
            z = s.transform(x)
            ld = s.transform.inv.log_abs_det_jacobian(z, x)
            ld = sum_rightmost(ld, ld.dim() - z.dim() + s.event_dim)
            with draw.plates(s.name):
                out[s.name] = pyro.sample(
                    s.name, dist.Delta(z, log_density=ld, event_dim=s.event_dim)
                )
        return out

    def joint_unconstrained_with_graph(self) -> dist.MultivariateNormal:
        """``q(u)`` with its graph to the parameters (for Pyro ELBOs that differentiate the
        guide, and for ``torch.jit`` tracing)."""
        loc = pyro.param(self.loc_name)
        if self.form == "full":
            return dist.MultivariateNormal(loc, scale_tril=pyro.param(self.role_names[0]))
        s = pyro.param(self.role_names[0])
        if self.form == "diag":
            return dist.MultivariateNormal(loc, scale_tril=torch.diag_embed(s))
        W = pyro.param(self.role_names[1])
        return dist.LowRankMultivariateNormal(loc, s[:, None] * W, s * s)

    def median_values(self) -> Dict[str, torch.Tensor]:
        return self.trace_values({})

    def packed_factors(self):
        """``q(u)`` is already over the packed unconstrained values: one joint factor."""
        return [(self.names, [s.ushape for s in self.sites], self.joint_unconstrained(), True)]

    def extra_state(self) -> Dict:
        return {"control": self.control.state()}

    def load_extra_state(self, state: Dict) -> None:
        if "control" in state:
            self.control.load(state["control"])


def build_remainder(found: Found) -> List[Block]:
    """The remainder's joint Gaussian, when the analysis left latents without exact messages
    (and the guide's strategy allows one)."""
    an = found.analysis
    if not an.remainder:
        return []
    owned = found.owned_by(REMAINDER_OWNER)
    return [RemainderBlock(an, found.prefix, found.options.remainder, owned)]


register_kind("remainder", 30, build_remainder)
