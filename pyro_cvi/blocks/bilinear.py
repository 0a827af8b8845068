"""The bilinear block: mean-field VMP for ``x_n ~ Normal(z_n W + c0_n, (c_n tau)^(-1/2))``.

``q = prod_n N(z_n) prod_d N(w_d) Gamma(tau)`` (``w_d``: the ``d``-th column of ``W``), each in
natural parameters ``(Lambda m, Lambda)`` / ``(a - 1, -b)`` in Pyro's param store
(:mod:`pyro_cvi.model.bilinear` detects the factor). With ``r_nd = c_nd E[tau_d]`` and
``y = x - c0``, Algorithm 2's exact expected messages (eq. 20) are

    z_n:  Lambda = P0_n + sum_d r_nd E[w_d w_d^T],  Lambda m = P0_n m0_n + sum_d r_nd y_nd E[w_d]
    w_d:  Lambda = P0_d + sum_n r_nd E[z_n z_n^T],  Lambda m = P0_d m0_d + sum_n r_nd y_nd E[z_n]
    tau:  a = a0 + 1/2 sum 1,  b = b0 + 1/2 sum c_nd E[(y_nd - z_n^T w_d)^2],

``E[(y - z^T w)^2] = y^2 - 2 y E[z]^T E[w] + tr(E[z z^T] E[w w^T])``, the sums over the
entries that share a ``tau``. A step (eq. 12, ``lambda <- lambda + beta (target - lambda)``)
visits ``z``, ``W``, ``tau`` in turn, each target from the others' current ``q``: at
``beta = 1`` one step is one sweep of coordinate-ascent VI (CAVI). Convex combinations of
valid natural parameters are valid, so no step shrinks. The ELBO is closed-form:
``E_q[log p(x | z, W, tau)] - KL(q(z) || p(z)) - KL(q(W) || p(W)) - KL(q(tau) || p(tau))``.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import pyro
import pyro.distributions as dist
import torch
from torch.distributions import constraints
from torch.distributions.transforms import Transform

from ..context import StepContext
from ..model.bilinear import BilinearSpec
from ..model.tracing import unwrap
from ..update import StepCounts
from .base import Block, BlockInit, StepReport
from .registry import Found, register_kind

__all__ = ["BilinearBlock"]


class _Transpose(Transform):
    """``[D, K] -> [K, D]`` (volume-preserving): ``q(W)`` from its independent columns."""

    domain = constraints.independent(constraints.real, 2)
    codomain = constraints.independent(constraints.real, 2)
    bijective = True

    def __eq__(self, other):
        return isinstance(other, _Transpose)

    def _call(self, x):
        return x.transpose(-1, -2)

    def _inverse(self, y):
        return y.transpose(-1, -2)

    def log_abs_det_jacobian(self, x, y):
        return x.new_zeros(x.shape[:-2])

    def forward_shape(self, shape):
        return torch.Size(shape[:-2]) + torch.Size((shape[-1], shape[-2]))

    def inverse_shape(self, shape):
        return self.forward_shape(shape)


class _Columns(dist.TransformedDistribution):
    """``q(W)`` from its independent Gaussian columns, transposed to ``W``'s shape."""

    def __init__(self, columns: dist.MultivariateNormal, validate_args=None):
        super().__init__(columns.to_event(1), [_Transpose()], validate_args=validate_args)
        self.columns = columns

    @property
    def mean(self):
        return self.columns.mean.transpose(-1, -2)

    @property
    def variance(self):
        return self.columns.variance.transpose(-1, -2)


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


class BilinearBlock(Block):
    """``q(z) q(W) q(tau)`` of one bilinear Normal factor (see the module docstring)."""

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
        base = unwrap(trace.nodes[s.tau]["fn"])[0]
        shape = trace.nodes[s.tau]["value"].shape
        out["a0"] = base.concentration.detach().expand(shape)
        out["b0"] = base.rate.detach().expand(shape)
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
        for key, mean in (("z", start[s.z]), ("W", Wv)):
            p0 = prior[key + "_p0"]
            prec = torch.diag_embed(p0)
            eta = p0 * mean
            self._param(self.store[key][0], eta)
            self._param(self.store[key][1], prec)
        self._param(self.store["tau"][0], prior["a0"] - 1)
        self._param(self.store["tau"][1], -prior["b0"])

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

    def _data(self, ctx: StepContext) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(y = x - c0, c)`` of the step's trace."""
        x = ctx.trace.nodes[self.spec.obs]["value"].detach()
        return x - self.spec.offset.to(x), self.spec.weight.to(x)

    def _targets(self, key, y, c, prior, mz, Sz, mw, Sw, a, b):
        N, D = y.shape
        if key == "tau":
            Ezz = Sz + mz.unsqueeze(-1) * mz.unsqueeze(-2)
            Eww = Sw + mw.unsqueeze(-1) * mw.unsqueeze(-2)
            sq = y * y - 2 * y * (mz @ mw.T) + torch.einsum("nkl,dkl->nd", Ezz, Eww)
            shape = prior["a0"].shape
            return (
                prior["a0"] - 1 + 0.5 * _sum_to(torch.ones_like(y), shape),
                -prior["b0"] - 0.5 * _sum_to(c * sq, shape),
            )
        r = c * (a / b).expand(N, D)
        if key == "z":
            Eww = Sw + mw.unsqueeze(-1) * mw.unsqueeze(-2)
            prec = torch.diag_embed(prior["z_p0"]) + torch.einsum("nd,dkl->nkl", r, Eww)
            eta = prior["z_p0"] * prior["z_m0"] + (r * y) @ mw
            return eta, prec
        Ezz = Sz + mz.unsqueeze(-1) * mz.unsqueeze(-2)
        prec = torch.diag_embed(prior["W_p0"]) + torch.einsum("nd,nkl->dkl", r, Ezz)
        eta = prior["W_p0"] * prior["W_m0"] + (r * y).T @ mz
        return eta, prec

    # ------------------------------------------------------------------ messages and steps
    def messages(self, ctx: StepContext) -> torch.Tensor:
        """The closed-form ELBO of the four factors; with ``ctx.grads`` the targets of the
        three latents from the current ``q`` (eq. 20) as ``.grad = target - lambda``."""
        prior = self._prior = self._read_prior(ctx.trace)
        y, c = self._data(ctx)
        mz, Sz, mw, Sw, a, b = m = self._moments()
        N, D = y.shape
        Ezz = Sz + mz.unsqueeze(-1) * mz.unsqueeze(-2)
        Eww = Sw + mw.unsqueeze(-1) * mw.unsqueeze(-2)
        sq = y * y - 2 * y * (mz @ mw.T) + torch.einsum("nkl,dkl->nd", Ezz, Eww)
        e_tau = (a / b).expand(N, D)
        e_log = (torch.digamma(a) - b.log()).expand(N, D)
        loglik = 0.5 * (c.log() + e_log - math.log(2 * math.pi) - c * e_tau * sq).sum()
        kl_tau = torch.distributions.kl_divergence(
            torch.distributions.Gamma(a, b), torch.distributions.Gamma(prior["a0"], prior["b0"])
        ).sum()
        elbo = (
            loglik
            - _gauss_kl(mz, Sz, prior["z_m0"], prior["z_p0"])
            - _gauss_kl(mw, Sw, prior["W_m0"], prior["W_p0"])
            - kl_tau
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
        """Eq. 12 for ``z``, ``W``, ``tau`` in turn, each target from the others' current
        ``q``; at ``beta = 1`` :attr:`sweeps_per_step` such sweeps (coordinate ascent: each
        sweep raises the ELBO), else one damped sweep."""
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
                    for name, t in zip(self.store[key], target):
                        p = pyro.param(name).unconstrained()
                        p.copy_(p + beta * (t.to(p) - p))
                        p.grad = None
                    m[at[key]] = self._q(key)
        for key in ("z", "W", "tau"):
            kind = "gamma" if key == "tau" else "gaussian"
            reports.append(StepReport(getattr(self.spec, key), kind, beta, StepCounts(0, 0)))
        del self._y
        return reports

    def valid(self) -> bool:
        try:
            mz, Sz, mw, Sw, a, b = self._moments()
        except RuntimeError:
            return False
        return bool(
            torch.isfinite(mz).all()
            and torch.isfinite(mw).all()
            and (a > 0).all()
            and (b > 0).all()
        )

    # ------------------------------------------------------------------ the current q
    def marginal(self, name: str) -> torch.distributions.Distribution:
        s = self.spec
        if name == s.tau:
            a, b = self._q("tau")
            q = dist.Gamma(a, b)
            return q.to_event(self.tau_event_dim) if self.tau_event_dim else q
        key = "z" if name == s.z else "W"
        mean, cov = self._q(key)
        mvn = dist.MultivariateNormal(mean, scale_tril=torch.linalg.cholesky(cov))
        if key == "z" or s.transposed:
            return mvn if key == "z" else mvn.to_event(1)
        return _Columns(mvn)

    def mean_values(self) -> Dict[str, torch.Tensor]:
        s = self.spec
        mz, _, mw, _, a, b = self._moments()
        return {s.z: mz, s.W: mw if s.transposed else mw.T.contiguous(), s.tau: a / b}

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
        return {n: self.marginal(n).sample() for n in self.names if n not in exclude}


def _build(found: Found) -> List[Block]:
    an = found.analysis
    return [BilinearBlock(spec, found.prefix) for spec in getattr(an, "bilinear", [])]


register_kind("bilinear", 40, _build)
