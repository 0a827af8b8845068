"""The bilinear block: mean-field VMP for ``x_n ~ Normal(z_n W + mu + c0_n, (c_n tau)^(-1/2))``.

``q = prod_n N(z_n) prod_d N(w_d, mu_d) Gamma(tau)`` (``w_d``: the ``d``-th column of ``W``;
``mu_d`` joins it when the factor has a mean latent, ``z_n`` then augmented to ``(z_n, 1)``),
each in natural parameters ``(Lambda m, Lambda)`` / ``(a - 1, -b)`` in Pyro's param store
(:mod:`pyro_cvi.model.bilinear` detects the factor). With ``r_nd = c_nd E[tau_d]``,
``y = x - c0`` and ``u_d = (w_d, mu_d)``, Algorithm 2's exact expected messages (eq. 20) are::

    z_n:  Lambda = P0_n + sum_d r_nd E[w_d w_d^T],
          Lambda m = P0_n m0_n + sum_d r_nd (y_nd E[w_d] - E[w_d mu_d])
    u_d:  Lambda = P0_d + sum_n r_nd E[(z_n, 1)(z_n, 1)^T],
          Lambda m = P0_d m0_d + sum_n r_nd y_nd E[(z_n, 1)]
    tau:  a - 1 = a0 - 1 + 1/2 sum 1,  -b = -b0 - 1/2 sum c_nd E[(y_nd - z_n^T w_d - mu_d)^2],

the sums over the entries that share a ``tau``. When the noise latent ``v`` (``tau = v^k``) has
a prior that is not a Gamma on a precision, ``(a0 - 1, -b0) = (0, 0)`` and its log-density in
``tau``, ``f``, adds the CVI message ``grad_m E_q[f]`` (eq. 12, ``m = (E[log tau], E[tau])``):
``Cov_q(T)^-1 Cov_q(T, f)`` with ``T = (log tau, tau)``, i.e. the least-squares fit of ``f``
by ``T`` under ``q``, by the trapezoid rule in ``log tau`` about the mode of ``q(log tau)``
(exact when ``f`` is linear in ``T``, e.g. an InverseGamma variance). A step (eq. 12,
``lambda <- lambda + beta (target - lambda)``) visits ``z``, ``u``, ``tau`` in turn, each
target from the others' current ``q``: at ``beta = 1`` one step is one sweep of
coordinate-ascent VI (CAVI). The ELBO is closed-form up to the quadrature of ``E_q[f]``:
``E_q[log p(x | z, W, mu, tau)] - KL(q(z) || p(z)) - KL(q(u) || p(u))`` minus
``KL(q(tau) || p(tau))``, or plus ``E_q[f] + H[q(tau)]``.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import pyro
import pyro.distributions as dist
import torch

from ..context import StepContext
from ..messages.noise_prior import NoisePrior
from ..model.bilinear import BilinearSpec
from ..model.tracing import unwrap
from ..update import StepCounts
from .base import Block, BlockInit, GuideDraw, StepReport
from .bilinear_laws import Columns, PowerOfGamma
from .marginals import marginal_median
from .registry import Found, register_kind

__all__ = ["BilinearBlock"]


def _gauss(eta: torch.Tensor, prec: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(mean, covariance)`` from natural parameters ``(Lambda m, Lambda)`` (batched)."""
    cov, info = torch.linalg.inv_ex(prec)
    if bool(info.any()):
        raise ValueError("bilinear block: a precision matrix is singular")
    cov = 0.5 * (cov + cov.transpose(-1, -2))
    return (cov @ eta.unsqueeze(-1)).squeeze(-1), cov


def _gauss_kl(mean, cov, m0, p0) -> torch.Tensor:
    """``sum KL(N(mean, cov) || N(m0, diag(1/p0)))`` over the batch (closed form)."""
    K = mean.shape[-1]
    d = mean - m0
    logdet = torch.linalg.cholesky(cov).diagonal(dim1=-2, dim2=-1).log().sum(-1) * 2
    tr = (p0 * cov.diagonal(dim1=-2, dim2=-1)).sum(-1)
    quad = (p0 * d * d).sum(-1)
    return 0.5 * (tr + quad - K - p0.log().sum(-1) - logdet).sum()


def _sum_to(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum ``x`` down to ``shape`` (the entries that share one element of a broadcast)."""
    lead = x.dim() - len(shape)
    x = x.sum(tuple(range(lead))) if lead else x
    dims = tuple(i for i, s in enumerate(shape) if s == 1 and x.shape[i] != 1)
    return x.sum(dims, keepdim=True) if dims else x


def _outer(m: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """``E[x x^T] = S + m m^T`` (batched)."""
    return S + m.unsqueeze(-1) * m.unsqueeze(-2)


class BilinearBlock(Block):
    """``q(z) q(W, mu) q(tau)`` of one bilinear Normal factor (see the module docstring)."""

    sweeps = False
    moves_trace = True
    #: coordinate-ascent sweeps in one step of size 1 (exact messages cost little beside a
    #: step's model trace)
    sweeps_per_step = 4

    def __init__(self, spec: BilinearSpec, prefix: str):
        self.spec = spec
        self.names = tuple(spec.names)
        base = f"{prefix}.bilinear.{spec.obs}"
        self.store = {
            "z": (f"{base}.z.eta", f"{base}.z.prec"),
            "W": (f"{base}.W.eta", f"{base}.W.prec"),
            "tau": (f"{base}.tau.shape_m1", f"{base}.tau.neg_rate"),
        }
        self._prior: Optional[Dict[str, torch.Tensor]] = None
        self._noise: Optional[NoisePrior] = None
        self.tau_event_dim = 0

    @property
    def label(self) -> str:
        return self.spec.label

    def param_names(self) -> List[str]:
        return [n for pair in self.store.values() for n in pair]

    # ------------------------------------------------------------------ set-up
    def _read_prior(self, trace) -> Dict[str, torch.Tensor]:
        s = self.spec
        out: Dict[str, torch.Tensor] = {}
        for key, name in (("z", s.z), ("W", s.W)):
            base = unwrap(trace.nodes[name]["fn"])[0]
            shape = trace.nodes[name]["value"].shape
            m0 = base.loc.detach().expand(shape)
            p0 = base.scale.detach().pow(-2).expand(shape)
            if key == "W" and not s.transposed:
                m0, p0 = m0.transpose(-1, -2), p0.transpose(-1, -2)
            out[key + "_m0"], out[key + "_p0"] = m0, p0  # [rows, K]
        if s.mu is not None:  # one more column: u_d = (w_d, mu_d)
            base = unwrap(trace.nodes[s.mu]["fn"])[0]
            shape = trace.nodes[s.mu]["value"].shape
            m0 = base.loc.detach().expand(shape).unsqueeze(-1)
            p0 = base.scale.detach().pow(-2).expand(shape).unsqueeze(-1)
            out["W_m0"] = torch.cat([out["W_m0"], m0.to(out["W_m0"])], -1)
            out["W_p0"] = torch.cat([out["W_p0"], p0.to(out["W_p0"])], -1)
        base = unwrap(trace.nodes[s.tau]["fn"])[0]
        shape = trace.nodes[s.tau]["value"].shape
        if s.conjugate:
            out["a0"] = base.concentration.detach().expand(shape)
            out["b0"] = base.rate.detach().expand(shape)
        else:  # (a0 - 1, -b0) = 0: the prior is the CVI site's factor f
            like = trace.nodes[s.tau]["value"].detach()
            out["a0"], out["b0"] = torch.ones_like(like), torch.zeros_like(like)
            self._noise = NoisePrior(base, s.power, like.dtype)
        return out

    def setup(self, init: BlockInit) -> None:
        s = self.spec
        trace = init.init_trace or init.prototype_trace
        prior = self._read_prior(trace)
        self.tau_event_dim = trace.nodes[s.tau]["fn"].event_dim
        start = {n: init.values[n] for n in self.names}
        if init.init_trace is not None:
            start = {n: init.init_trace.nodes[n]["value"].detach() for n in self.names}
        Wv = start[s.W] if s.transposed else start[s.W].transpose(-1, -2)
        if s.mu is not None:
            Wv = torch.cat([Wv, start[s.mu].unsqueeze(-1).to(Wv)], -1)
        for key, mean in (("z", start[s.z]), ("W", Wv)):
            p0 = prior[key + "_p0"]
            prec = torch.diag_embed(p0)
            eta = p0 * mean
            self._param(self.store[key][0], eta)
            self._param(self.store[key][1], prec)
        if s.conjugate:
            self._param(self.store["tau"][0], prior["a0"] - 1)
            self._param(self.store["tau"][1], -prior["b0"])
        else:  # Gamma(2, 2 / tau0) about the start's precision
            tau0 = start[s.tau].detach().pow(s.power)
            self._param(self.store["tau"][0], torch.ones_like(tau0))
            self._param(self.store["tau"][1], -2.0 / tau0)

    @staticmethod
    def _param(name: str, value: torch.Tensor) -> None:
        """Register ``name`` at ``value``; one already stored is kept unless new data changed
        its shape (another number of points)."""
        v = value.detach().clone()
        store = pyro.get_param_store()
        if name in store and store[name].shape != v.shape:
            del store[name]
        pyro.param(name, lambda v=v: v)

    # ------------------------------------------------------------------ the current q
    def _q(self, key: str) -> Tuple[torch.Tensor, torch.Tensor]:
        a, b = (pyro.param(n).detach() for n in self.store[key])
        if key == "tau":
            return a + 1, -b
        return _gauss(a, b)

    def _moments(self):
        mz, Sz = self._q("z")
        mw, Sw = self._q("W")
        a, b = self._q("tau")
        return mz, Sz, mw, Sw, a, b

    def _augment(self, mz: torch.Tensor, Sz: torch.Tensor):
        """``(E[(z_n, 1)], E[(z_n, 1)(z_n, 1)^T])`` (``z_n`` itself without a mean latent)."""
        if self.spec.mu is None:
            return mz, _outer(mz, Sz)
        za = torch.cat([mz, torch.ones_like(mz[..., :1])], -1)
        Sa = torch.nn.functional.pad(Sz, (0, 1, 0, 1))
        return za, _outer(za, Sa)

    def _data(self, ctx: StepContext) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(y = x - c0, c)`` of the step's trace."""
        x = ctx.trace.nodes[self.spec.obs]["value"].detach()
        return x - self.spec.offset.to(x), self.spec.weight.to(x)

    def _sq(self, y, mz, Sz, mw, Sw) -> torch.Tensor:
        """``E[(y_nd - z_n^T w_d - mu_d)^2]``."""
        za, Ezz = self._augment(mz, Sz)
        return y * y - 2 * y * (za @ mw.T) + torch.einsum("nkl,dkl->nd", Ezz, _outer(mw, Sw))

    def _targets(self, key, y, c, prior, mz, Sz, mw, Sw, a, b):
        N, D = y.shape
        if key == "tau":
            shape = prior["a0"].shape
            a1 = prior["a0"] - 1 + 0.5 * _sum_to(torch.ones_like(y), shape)
            b1 = -prior["b0"] - 0.5 * _sum_to(c * self._sq(y, mz, Sz, mw, Sw), shape)
            if self._noise is not None:
                g_log, g_tau = self._noise.message(a, b)
                a1, b1 = a1 + g_log, b1 + g_tau
            return a1, b1
        r = c * (a / b).expand(N, D)
        K = mz.shape[-1]
        if key == "z":
            Eww = _outer(mw, Sw)
            prec = torch.diag_embed(prior["z_p0"]) + torch.einsum("nd,dkl->nkl", r, Eww[:, :K, :K])
            eta = prior["z_p0"] * prior["z_m0"] + (r * y) @ mw[:, :K]
            if self.spec.mu is not None:
                eta = eta - r @ Eww[:, :K, K]
            return eta, prec
        za, Ezz = self._augment(mz, Sz)
        prec = torch.diag_embed(prior["W_p0"]) + torch.einsum("nd,nkl->dkl", r, Ezz)
        eta = prior["W_p0"] * prior["W_m0"] + (r * y).T @ za
        return eta, prec

    def _noise_elbo(self, a, b, prior) -> torch.Tensor:
        """``-KL(q(tau) || p(tau))``, or ``E_q[f] + H[q(tau)]`` for a non-conjugate prior."""
        q = torch.distributions.Gamma(a, b)
        if self._noise is None:
            p = torch.distributions.Gamma(prior["a0"], prior["b0"])
            return -torch.distributions.kl_divergence(q, p).sum()
        return (self._noise.expected(a, b) + q.entropy()).sum()

    # ------------------------------------------------------------------ messages and steps
    def messages(self, ctx: StepContext) -> torch.Tensor:
        """The closed-form ELBO of the block's factors; with ``ctx.grads`` the targets of its
        latents from the current ``q`` (eq. 20) as ``.grad = target - lambda``."""
        prior = self._prior = self._read_prior(ctx.trace)
        y, c = self._data(ctx)
        mz, Sz, mw, Sw, a, b = m = self._moments()
        N, D = y.shape
        sq = self._sq(y, mz, Sz, mw, Sw)
        e_tau = (a / b).expand(N, D)
        e_log = (torch.digamma(a) - b.log()).expand(N, D)
        loglik = 0.5 * (c.log() + e_log - math.log(2 * math.pi) - c * e_tau * sq).sum()
        elbo = (
            loglik
            - _gauss_kl(mz, Sz, prior["z_m0"], prior["z_p0"])
            - _gauss_kl(mw, Sw, prior["W_m0"], prior["W_p0"])
            + self._noise_elbo(a, b, prior)
        )
        if ctx.grads:
            for key in ("z", "W", "tau"):
                target = self._targets(key, y, c, prior, *m)
                for name, t in zip(self.store[key], target):
                    p = pyro.param(name).unconstrained()
                    p.grad = (t - p.detach()).to(p)
            self._y = (y, c)
        return elbo

    def step(self, beta: float, ctx: Optional[StepContext] = None) -> List[StepReport]:
        """Eq. 12 for ``z``, ``(W, mu)``, ``tau`` in turn, each target from the others'
        current ``q``; at ``beta = 1`` :attr:`sweeps_per_step` such sweeps (coordinate ascent:
        each sweep raises the ELBO), else one damped sweep. A step that would leave ``q(tau)``
        invalid (a non-conjugate prior's message) is halved until it does not."""
        if self._prior is None or not hasattr(self, "_y"):
            return []
        y, c = self._y
        reports = []
        m = list(self._moments())
        at = {"z": slice(0, 2), "W": slice(2, 4), "tau": slice(4, 6)}
        sweeps = self.sweeps_per_step if beta >= 1.0 else 1
        with torch.no_grad():
            for _ in range(sweeps):
                for key in ("z", "W", "tau"):
                    target = self._targets(key, y, c, self._prior, *m)
                    params = [pyro.param(name).unconstrained() for name in self.store[key]]
                    new = [p + beta * (t.to(p) - p) for p, t in zip(params, target)]
                    if key == "tau":
                        new = self._valid_gamma(params, new)
                    for p, v in zip(params, new):
                        p.copy_(v)
                        p.grad = None
                    m[at[key]] = self._q(key)
        for key, name in (("z", self.spec.z), ("W", self.spec.W), ("tau", self.spec.tau)):
            kind = "gamma" if key == "tau" else "gaussian"
            reports.append(StepReport(name, kind, beta, StepCounts(0, 0)))
        del self._y
        return reports

    @staticmethod
    def _valid_gamma(old: List[torch.Tensor], new: List[torch.Tensor]) -> List[torch.Tensor]:
        """``new`` natural parameters of ``q(tau)``, halved towards ``old`` until ``a, b > 0``."""
        for _ in range(30):
            if bool((new[0] > -1).all() and (new[1] < 0).all()):
                return new
            new = [o + 0.5 * (n - o) for o, n in zip(old, new)]
        return [o.clone() for o in old]

    def valid(self) -> bool:
        try:
            mz, Sz, mw, Sw, a, b = self._moments()
        except (RuntimeError, ValueError):
            return False
        return bool(
            torch.isfinite(mz).all()
            and torch.isfinite(mw).all()
            and (a > 0).all()
            and (b > 0).all()
        )

    # ------------------------------------------------------------------ the current q
    def _columns(self) -> dist.MultivariateNormal:
        """``q(u_d)``, one ``(K [+ 1])``-dimensional Gaussian per column."""
        mean, cov = self._q("W")
        return dist.MultivariateNormal(mean, scale_tril=torch.linalg.cholesky(cov))

    def _split(self, u: torch.Tensor) -> Dict[str, torch.Tensor]:
        """``W`` (its stored layout) and ``mu`` from values ``u`` of the columns ``[..., D, P]``."""
        s = self.spec
        K = self._prior_K()
        w = u[..., :K]
        out = {s.W: w if s.transposed else w.transpose(-1, -2)}
        if s.mu is not None:
            out[s.mu] = u[..., K]
        return out

    def _prior_K(self) -> int:
        eta = pyro.param(self.store["z"][0])
        return int(eta.shape[-1])

    def marginal(self, name: str) -> torch.distributions.Distribution:
        s = self.spec
        if name == s.tau:
            a, b = self._q("tau")
            q: torch.distributions.Distribution = dist.Gamma(a, b)
            if s.power != 1.0:
                q = PowerOfGamma(a, b, 1 / s.power)
            return q.to_event(self.tau_event_dim) if self.tau_event_dim else q
        if name == s.z:
            mean, cov = self._q("z")
            return dist.MultivariateNormal(mean, scale_tril=torch.linalg.cholesky(cov))
        mean, cov = self._q("W")
        K = self._prior_K()
        if name == s.mu:
            return dist.Normal(mean[:, K], cov[:, K, K].sqrt()).to_event(1)
        mvn = dist.MultivariateNormal(mean[:, :K], scale_tril=torch.linalg.cholesky(cov[:, :K, :K]))
        return mvn.to_event(1) if s.transposed else Columns(mvn)

    def mean_values(self) -> Dict[str, torch.Tensor]:
        s = self.spec
        mz, _, mw, _, a, b = self._moments()
        e_v = a / b if s.power == 1.0 else PowerOfGamma(a, b, 1 / s.power).mean
        out = {s.z: mz, s.tau: e_v}
        out.update(self._split(mw))
        return {n: v.contiguous() for n, v in out.items()}

    def median_values(self) -> Dict[str, torch.Tensor]:
        """Gaussians: their means; ``v``: the median of ``q(tau)`` through ``v = tau^(1/k)``
        (monotone, so it maps medians)."""
        s = self.spec
        out = self.mean_values()
        a, b = self._q("tau")
        out[s.tau] = marginal_median(dist.Gamma(a, b)).detach().pow(1 / s.power)
        return out

    def trace_values(self, subsample: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return self.mean_values()

    def sample(
        self,
        subsample: Dict[str, torch.Tensor],
        exclude: Sequence[str] = (),
        at_means: bool = False,
    ) -> Dict[str, torch.Tensor]:
        if at_means:
            return {n: v for n, v in self.mean_values().items() if n not in exclude}
        s = self.spec
        out = {n: self.marginal(n).sample() for n in (s.z, s.tau) if n not in exclude}
        if s.W not in exclude:
            out.update(self._split(self._columns().sample()))
        return out

    def guide_sample(self, name: str, draw: GuideDraw) -> Dict[str, torch.Tensor]:
        """``W`` alone: its marginal; with a mean latent, one auxiliary draw of the columns
        ``(w_d, mu_d)`` and ``W``, ``mu`` as ``Delta`` sites."""
        s = self.spec
        if s.mu is None or name not in (s.W, s.mu):
            return super().guide_sample(name, draw)
        u = pyro.sample(
            f"_{draw.prefix}_bilinear_{s.obs}_columns",
            draw.frozen(self._columns().to_event(1)),
            infer={"is_auxiliary": True},
        )
        out = {}
        for n, v in self._split(u).items():
            with draw.plates(n):
                out[n] = pyro.sample(n, dist.Delta(v, event_dim=draw.event_dim(n)))
        return out


def _build(found: Found) -> List[Block]:
    an = found.analysis
    return [BilinearBlock(spec, found.prefix) for spec in getattr(an, "bilinear", [])]


register_kind("bilinear", 40, _build)
