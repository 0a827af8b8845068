"""The Markov block of a chain whose Normal factors a discrete latent selects (Algorithm 2).

For a loop whose transitions ``x_t ~ N(A_t(s) x_{t-1} + b_t(s), diag q_t(s))`` (and ``x_0``'s
prior, and Normal observations ``y_r ~ N(h_r(s)' x_{t_r} + c_r(s), r_r(s))``) read a global
discrete ``s`` with a mean-field ``q(s)`` (:mod:`~pyro_cvi.model.regime_chain`), the factors'
expected message to ``q(x)`` is the Gaussian potential ``sum_k q(s = k) log p(x | s = k)``
(exact, eq. 20). With ``P_k = Q_k^-1`` its transition part is

    -x_t' P~ x_t / 2 + x_t' E[P A] x_{t-1} - x_{t-1}' E[A' P A] x_{t-1} / 2
    + x_t' E[P b] - x_{t-1}' E[A' P b]                                     (E = sum_k q_k)

which is the linear-Gaussian transition ``N(A~ x_{t-1} + b~, P~^-1)`` with
``P~ = E[P]``, ``A~ = P~^-1 E[P A]``, ``b~ = P~^-1 E[P b]``, times a unary potential on
``x_{t-1}``: precision ``E[A' P A] - A~' P~ A~`` (positive semi-definite: a covariance over
``k``) and information ``A~' P~ b~ - E[A' P b]``. ``x_0``'s prior becomes ``N(m~0, P~0^-1)``
likewise, and each observation adds ``sum_k q_k h_k w_k h_k'`` and ``sum_k q_k h_k w_k (y -
c_k)`` to its step. The expected prior and these unary rows (read off one model run with ``s``
enumerated, every step) go to the Kalman smoother with the block's CVI sites (observations
without ``s``), so at ``beta = 1`` ``q(x)`` is the exact VMP update given ``q(s)``.

The mean field owns the factors that read ``s`` (their expected log densities, and the
message to ``q(s)``); this block's ELBO is ``log Z - E_q[log sites] - sum E_q[log p~_t]`` over
those steps (its first two terms, ``-KL(q || p~)``, from the conditionals where they round
badly: :func:`~pyro_cvi.statespace.posterior.chain_neg_kl`): the entropy of ``q(x)`` plus
the factors it owns.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import torch

from ..context import Options, StepContext
from ..messages.gaussian import linear_predictor_message
from ..model.analysis import BlockSpec
from ..model.records import CONJUGATE_ENUM, LINEAR_ENUM
from ..model.tracing import run_model, unwrap
from ..statespace.kalman import LinearGaussianChain
from ..statespace.posterior import chain_neg_kl
from .markov import ExpectedPriorMarkovBlock
from .registry import register_block_kind

__all__ = ["RegimeMarkovBlock"]


def _per_value(t: torch.Tensor, shape, K: int, d: int) -> torch.Tensor:
    """``t`` broadcast to the site's enumerated shape, as ``(K, d)`` (one row per value)."""
    t = t.expand(shape).reshape(-1, d)
    return t.expand(K, d) if t.shape[0] == 1 else t


def _jacobian_rows(loc: torch.Tensor, leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """``d loc[..., k, j] / d leaves[i]`` for ``loc (I, K, d)`` whose ``i``-th entries depend on
    ``leaves[i]`` only: ``(I, K, d, d_leaf)``, one backward pass per ``(k, j)``."""
    I, K, d = loc.shape
    out = loc.new_zeros(I, K, d, leaves[0].numel())
    for k in range(K):
        for j in range(d):
            gs = torch.autograd.grad(
                loc[:, k, j].sum(), list(leaves), retain_graph=True, allow_unused=True
            )
            for i, g in enumerate(gs):
                if g is not None:
                    out[i, k, j] = g.reshape(-1)
    return out


class RegimeMarkovBlock(ExpectedPriorMarkovBlock):
    """Kalman-smoother CVI of a chain with regime latents (see the module docstring)."""

    def __init__(self, spec: BlockSpec, prefix: str, owned: Sequence[str], options: Options):
        super().__init__(spec, prefix, owned, options)
        self.regimes = tuple(spec.chain.regimes)
        enum = [f for f in spec.factors if f.kind == CONJUGATE_ENUM]
        read = [f for f in spec.factors if f.kind in (CONJUGATE_ENUM, LINEAR_ENUM)]
        self.enum_dims = read[0].enum_dims
        self.regime_steps = [self.names.index(f.site) for f in enum if f.site in self.names]
        self.regime_obs = [f.site for f in enum if f.site not in self.names]
        self._obs_step: Dict[str, int] = {}
        self._extra: Optional[tuple] = None  # unary rows (t, H, w, b) of the expected message
        # observations through a link that read s: one site per value and element, their
        # nodes from the enumerated run, ``scale`` times q(s = k) (eqs. 13, 20, 30-31)
        enum_sites = [f for f in spec.factors if f.kind == LINEAR_ENUM]
        self.linear = self.linear + enum_sites
        self.site_names.update({f.site: f"{prefix}.sites.{f.site}" for f in enum_sites})
        self._nodes: Dict[str, dict] = {}
        self._checked = False  # (learnable parameters in a step without s: _check_parameters)

    def init_sites_at_prior_mean(self, trace, num_quad_points: int) -> None:
        """The sites start at zero (``q`` = the expected prior and the exact rows)."""

    # ------------------------------------------------------------------ the expected prior
    def _expected_prior(self, ctx: StepContext) -> LinearGaussianChain:
        """The expected prior and (:attr:`_extra`) the unary rows at the current ``q(s)``."""
        T, d = self.chain.length, self.chain.state_dim
        at = self.spec.split(self.z_at)
        values = ctx.sample_q(exclude=set(self.names) | set(self.regimes), at_means=True)
        for c in self.regimes:
            values.pop(c, None)
        leaves = {n: at[n].detach().clone().requires_grad_(True) for n in self.names}
        values.update(leaves)
        with torch.enable_grad():
            tr = run_model(ctx.model, values, ctx.args, ctx.kwargs, self.enum_dims)
            (c,) = self.regimes
            q_full = ctx.marginal(c).log_prob(tr.nodes[c]["value"]).exp().detach()
            q = q_full.reshape(-1)
            K = q.shape[0]
            for f in self.linear:
                if f.kind == LINEAR_ENUM:
                    node = tr.nodes[f.site]
                    prob = q_full.reshape(q_full.shape + (1,) * node["fn"].event_dim)
                    self._nodes[f.site] = {**node, "scale": node["scale"] * prob}
            locs, vars_ = [], []
            for n in self.names:
                fn = tr.nodes[n]["fn"]
                base = unwrap(fn)[0]
                shape = torch.broadcast_shapes(base.loc.shape, base.scale.shape)
                locs.append(_per_value(base.loc, shape, K, d))
                vars_.append(_per_value(base.scale**2, shape, K, d))
            if not self._checked:
                self._check_parameters(tr, locs, vars_)
            loc = torch.stack(locs[1:])  # (T-1, K, d)
            A = _jacobian_rows(loc, [leaves[n] for n in self.names[:-1]]).detach()
            eta_u, J_u = self._observations(tr, leaves, q, K)
        x = torch.stack([leaves[n].detach().reshape(d) for n in self.names])
        var = torch.stack(vars_).detach()  # (T, K, d)
        qk = q[:, None].to(x)
        P0 = (qk / var[0]).sum(0)
        m0 = (qk * locs[0].detach() / var[0]).sum(0) / P0
        b = loc.detach() - (A @ x[:-1, None, :, None]).squeeze(-1)  # (T-1, K, d)
        P = q[None, :, None].to(x) / var[1:]  # q_k P_k, diagonal (T-1, K, d)
        Pt = P.sum(1)
        PA = (P[..., None] * A).sum(1)
        Pb = (P * b).sum(1)
        APA = (A.transpose(-1, -2) @ (P[..., None] * A)).sum(1)
        APb = (A.transpose(-1, -2) @ (P * b)[..., None]).squeeze(-1).sum(1)
        At, bt = PA / Pt[..., None], Pb / Pt
        J_u[:-1] += APA - PA.transpose(-1, -2) @ At
        eta_u[:-1] += (PA.transpose(-1, -2) @ bt[..., None]).squeeze(-1) - APb
        lam, V = torch.linalg.eigh(0.5 * (J_u + J_u.transpose(-1, -2)))
        t = torch.arange(T, device=x.device).repeat_interleave(d)
        H = V.transpose(-1, -2).reshape(T * d, d)
        w = lam.clamp(min=0.0).reshape(-1)
        bb = (V.transpose(-1, -2) @ eta_u[..., None]).reshape(-1)
        self._extra = (t, H, w, bb)
        return LinearGaussianChain(m0, torch.diag(1.0 / P0), At, bt, torch.diag_embed(1.0 / Pt))

    def _check_parameters(self, tr, locs, vars_) -> None:
        """Refuse a prior step that reads no regime but learnable parameters: its term is in
        this block's ``log Z``, which carries no graph here (the steps that read ``s`` are the
        mean field's, with their graph)."""
        self._checked = True
        params = [
            n["value"]
            for n in tr.nodes.values()
            if n["type"] == "param" and n["value"].requires_grad
        ]
        if not params:
            return
        for t, n in enumerate(self.names):
            if t in self.regime_steps:
                continue
            total = locs[t].sum() + vars_[t].sum()
            if total.requires_grad:
                grads = torch.autograd.grad(total, params, retain_graph=True, allow_unused=True)
                if any(g is not None for g in grads):
                    raise ValueError(
                        f"site {n!r}: the chain {self.label} reads the discrete "
                        f"{', '.join(self.regimes)}, and this step's prior learnable parameters "
                        "without it: their gradient is not taken on this route; mark the discrete "
                        "site infer={'enumerate': 'parallel'} (or AutoCVI(discrete='collapse')), "
                        "or make the parameters fixed tensors"
                    )

    def _observations(self, tr, leaves, q: torch.Tensor, K: int):
        """The unary information ``(eta (T, d), J (T, d, d))`` of the Normal observations that
        read the regimes: ``sum_k q_k h_k w_k (y - c_k)`` and ``sum_k q_k h_k w_k h_k'``."""
        T, d = self.chain.length, self.chain.state_dim
        x0 = next(iter(leaves.values()))
        eta = x0.new_zeros(T, d).detach()
        J = x0.new_zeros(T, d, d).detach()
        for site in self.regime_obs:
            node = tr.nodes[site]
            base = unwrap(node["fn"])[0]
            y = node["value"]
            shape = torch.broadcast_shapes(base.loc.shape, base.scale.shape, y.shape)
            R = max(shape.numel() // K, 1)
            loc = _per_value(base.loc, shape, K, R)  # (K, R)
            if site not in self._obs_step:
                hit = [i for i, n in enumerate(self.names) if _reads(loc, leaves[n])]
                self._obs_step[site] = hit[0]
            t = self._obs_step[site]
            H = _jacobian_rows(loc[None], [leaves[self.names[t]]])[0].detach()  # (K, R, d)
            yv = _per_value(y.detach(), shape, K, R)
            var = _per_value(base.scale.detach() ** 2, shape, K, R)
            scale = node["scale"]
            w = q[:, None].to(var) * scale / var  # (K, R)
            xt = leaves[self.names[t]].detach().reshape(d)
            c = loc.detach() - H @ xt
            J[t] += (H.transpose(-1, -2) @ (w[..., None] * H)).sum(0)
            eta[t] += (H.transpose(-1, -2) @ (w * (yv - c))[..., None]).squeeze(-1).sum(0)
        return eta, J

    # ------------------------------------------------------------------ the smoother
    def refresh(self, ctx: StepContext) -> LinearGaussianChain:
        """The expected prior at the current ``q(s)``, the sites' rows, and the smoother."""
        self.prior = self._expected_prior(ctx)
        sites = self._sites()
        self.rows = [self._rows(self._node(ctx, f), f, sites[f.site].detach()) for f in self.linear]
        self._graph = None
        self.post = self._solve(self.rows)
        self._solved_for = None
        return self.prior

    def _node(self, ctx: StepContext, f) -> dict:
        """The trace node of linear-predictor factor ``f`` (enumerated, weighted by ``q(s)``)."""
        return self._nodes[f.site] if f.kind == LINEAR_ENUM else ctx.trace.nodes[f.site]

    def elbo(self, ctx: StepContext, prior: LinearGaussianChain) -> torch.Tensor:
        """``log Z - E_q[log sites]`` plus the owned observations' expected log densities,
        less ``E_q[log p~_t]`` of the steps whose factors the mean field owns (module
        docstring); with ``ctx.grads``, ``target - lambda_tilde`` goes into the sites' ``.grad``."""
        post = self.post
        sr = self._site_rows(self.rows)
        f_mean, f_var = sr.moments(post.mean, post.cov)
        elbo = chain_neg_kl(post.log_z, sr.expected_log_sites(f_mean, f_var), self.prior, post, sr)
        sites, i = self._sites(), 0
        for f, r in zip(self.linear, self.rows):
            sl = slice(i, i + r.c.shape[0])
            i = sl.stop
            value, target = linear_predictor_message(
                self._node(ctx, f),
                r,
                f_mean[sl],
                f_var[sl],
                self.options.num_quad_points,
                self.options.num_samples,
            )
            if f.site in self.owned:
                elbo = elbo + value
            if ctx.grads:
                p = sites[f.site]
                p.grad = target - p.detach()
        h0 = self._init_h()
        if h0 is not None and ctx.grads:
            h0.grad = -h0.detach()
        return elbo - self._expected_log_prior(self.regime_steps)

    def _expected_log_prior(self, steps: Sequence[int]) -> torch.Tensor:
        """``sum_t E_q[log p~_t(x_t | x_{t-1})]`` over ``steps`` (diagonal ``Q~``)."""
        post, p = self.post, self.prior.detach()
        m, S = post.mean, post.cov
        total = m.new_zeros(())
        for t in steps:
            if t == 0:
                prec = 1.0 / torch.diagonal(p.P0)
                r = m[0] - p.m0
                second = r * r + torch.diagonal(S[0])
            else:
                A, prec = p.A[t - 1], 1.0 / torch.diagonal(p.Q[t - 1])
                r = m[t] - A @ m[t - 1] - p.b[t - 1]
                X = post.cross[t - 1]
                C = S[t] - A @ X.transpose(-1, -2) - X @ A.transpose(-1, -2)
                C = C + A @ S[t - 1] @ A.transpose(-1, -2)
                second = r * r + torch.diagonal(C)
            total = total + (-0.5 * torch.log(2 * math.pi / prec) - 0.5 * prec * second).sum()
        return total

    def variance_along(self, parts: Dict[str, torch.Tensor]) -> torch.Tensor:
        """``Var_q(sum_n A_n x_n)`` over one step or two adjacent ones (lag-one covariance)."""
        post = self.post
        items = sorted(parts.items(), key=lambda kv: -self.names.index(kv[0]))
        total = 0.0
        for n, A in items:
            t = self.names.index(n)
            A = A.to(post.cov)
            total = total + ((A @ post.cov[t]) * A).sum(-1)
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                (n1, A1), (n2, A2) = items[i], items[j]
                t1, t2 = self.names.index(n1), self.names.index(n2)
                if t1 - t2 != 1:
                    raise ValueError(
                        f"a factor reads {n1} and {n2} of the chain {self.label}: only one "
                        "step, or two adjacent ones, have their covariance here"
                    )
                X = post.cross[t1 - 1].to(A1)
                total = total + 2.0 * ((A1 @ X) * A2).sum(-1)
        return total


def _reads(value: torch.Tensor, leaf: torch.Tensor) -> bool:
    (g,) = torch.autograd.grad(value.sum(), leaf, retain_graph=True, allow_unused=True)
    return g is not None


register_block_kind(
    lambda spec: spec.chain is not None and bool(spec.chain.regimes), RegimeMarkovBlock
)
