"""Structured stochastic variational inference (SSVI; Hoffman & Blei, 2015).

For a model with global latents ``beta`` and local latents ``z_n`` (conditionally independent
given ``beta``), SSVI keeps the dependence of the locals on the globals (eq. 2)::

    q(beta, z) = prod_k q(beta_k) prod_n q(z_n | beta),   q(z_n | beta) = p(z_n | y_n, beta)

with ``q(beta_k)`` in the prior's exponential family (natural parameters ``lam``). The local
conditionals are exact: enumerated for discrete locals, and for a continuous local in a
conjugate family found by probing (``log p(z_n, y_n | beta) - log h(z_n)`` is affine in the
sufficient statistics ``t(z_n)``; its slope is the conditional's natural parameter and
``log p(y_n | beta) = c_n + A(eta_n)``). Each step (Algorithm 1, Option 1, eqs. 7-8, 21):

    beta ~ q(beta) by inversion/reparameterisation,  g = grad_lam sum_n log p(y_n | beta(lam, u))
    lam <- (1 - rho_t) lam + rho_t (eta + F(lam)^-1 g),      rho_t = s t^-kappa

``F^-1 g = V(beta, lam) sum_n eta^_n`` because ``grad_beta log p(y_n | beta) = E_{q(z_n|beta)}
[grad_beta log p(y_n, z_n | beta)] = (grad_beta t)^T E[eta_n(y_n, z_n)]`` (Fisher's identity,
the envelope argument of eqs. 18-19). ``eta`` is the prior's natural parameter; the Fisher solve
is the family's (Appendix F of Khan & Lin); the step is CVI's one update with its step policy.

A Gaussian global (a scalar or a few elements, elementwise ``q``) takes the same expected
target from Price's theorem instead (Khan & Lin eqs. 10-11 with Bonnet's and Price's
identities): with ``l(beta) = sum_n log p(y_n | beta)`` at the draw,

    lam_1 <- eta_1 + l'(beta) - l''(beta) m,    lam_2 <- eta_2 + l''(beta) / 2

(``lam = (m / v, -1 / (2v))``). The reparameterised estimate of ``lam_2`` carries
``l'(beta) (beta - m) / v``, whose spread grows with the distance of ``q`` from the data: one
draw of the wrong sign, damped into the valid set, leaves a near-zero precision and a mean far
off, from which the next draws are noisier still (a Robbins-Monro run of a hierarchical
Normal went to a mean of -279,031). The curvature at the draw has no such term: for a
likelihood quadratic in ``beta`` (conjugate-Gaussian locals) it is exact.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import pyro.poutine as poutine
import torch
from pyro.infer import TraceEnum_ELBO, config_enumerate
from pyro.poutine.util import site_is_subsample

from ..families import family_for_support
from ..families.base import ExponentialFamily, Params
from ..model.probes import rtol
from ..step_sizes import Schedule, as_schedule, robbins_monro
from ..update import StepCounts, damped_step

__all__ = ["StructuredSVI", "ssvi_target"]

#: ``rho_t = t^-0.75``, the step-size schedule of Hoffman & Blei's experiments.
PAPER_SCHEDULE = robbins_monro(1.0, 0.0, 0.75)


def ssvi_target(
    family: ExponentialFamily,
    lam: Params,
    prior_nat: Params,
    local_log_lik: Callable[[torch.Tensor], torch.Tensor],
) -> Tuple[Params, torch.Tensor, torch.Tensor]:
    """``(eta + V(beta, lam) sum_n eta^_n, value, beta)`` for one global site (eqs. 7, 8, 21).

    ``local_log_lik(beta)`` is ``sum_n log p(y_n | beta)`` (or any local bound maximised over
    the local parameters, whose ``beta``-gradient at fixed local parameters is the same); it is
    evaluated at ``beta = R(u, lam)``, a reparameterised draw from ``q(beta | lam)``.
    """
    if _price_applies(family, lam):
        return _price_target(family, lam, prior_nat, local_log_lik)
    leaves = tuple(p.detach().requires_grad_(True) for p in lam)
    with torch.enable_grad():
        beta = family.natural_to_dist(leaves).rsample()
        value = local_log_lik(beta)
        grads = torch.autograd.grad(value, leaves, allow_unused=True)
    grads = tuple(torch.zeros_like(p) if g is None else g for p, g in zip(leaves, grads))
    v_eta = family.mean_grad(tuple(p.detach() for p in lam), grads)  # F^-1 g (eq. 72)
    return tuple(e + v for e, v in zip(prior_nat, v_eta)), value.detach(), beta.detach()


#: the most elements of a Gaussian global whose curvature is taken element by element
PRICE_MAX_ELEMENTS = 16


def _price_applies(family: ExponentialFamily, lam: Params) -> bool:
    """An elementwise Gaussian global of at most :data:`PRICE_MAX_ELEMENTS` elements."""
    elementwise = family.name == "gaussian_diag" or (
        family.name == "gaussian" and getattr(family, "event_dim", None) == 0
    )
    return elementwise and lam[0].numel() <= PRICE_MAX_ELEMENTS


def _price_target(
    family: ExponentialFamily,
    lam: Params,
    prior_nat: Params,
    local_log_lik: Callable[[torch.Tensor], torch.Tensor],
) -> Tuple[Params, torch.Tensor, torch.Tensor]:
    """:func:`ssvi_target` of an elementwise Gaussian by Price's theorem (module docstring):
    ``(eta_1 + l' - l'' m, eta_2 + l'' / 2)`` at one draw, ``l''`` the Hessian's diagonal."""
    lam = tuple(p.detach() for p in lam)
    q = family.natural_to_dist(lam)
    m = q.mean
    with torch.enable_grad():
        beta = q.sample().requires_grad_(True)
        value = local_log_lik(beta)
        (g,) = torch.autograd.grad(value, beta, create_graph=True)
        flat = g.reshape(-1)
        h = torch.stack(
            [
                torch.autograd.grad(flat[i], beta, retain_graph=True)[0].reshape(-1)[i]
                for i in range(flat.numel())
            ]
        ).reshape(g.shape)
    g, h = g.detach(), h.detach()
    target = (prior_nat[0] + g - h * m, prior_nat[1] + h / 2)
    return target, value.detach(), beta.detach()


def _sum_to(x: torch.Tensor, shape: torch.Size, site: str, local: str) -> torch.Tensor:
    try:
        return x.sum_to_size(shape)
    except RuntimeError:
        raise ValueError(
            f"StructuredSVI: the log-density of site '{site}' (shape {tuple(x.shape)}) does not "
            f"reduce to the batch shape {tuple(shape)} of the local site '{local}'; put the "
            "observations of each local group inside the local site's plate"
        ) from None


class StructuredSVI:
    """SSVI (Hoffman & Blei 2015, Algorithm 1) for a Pyro model with global and local latents.

    Example::

        ssvi = StructuredSVI(model, step_size=step_sizes.robbins_monro(1.0, 0.0, 0.75))
        for _ in range(200):
            ssvi.step(data)                 # a sample of sum_n log p(y_n | beta)
        ssvi.posterior("mu")                # q(mu), a torch Distribution
        ssvi.local_conditional("z", beta, data)   # q(z | beta) = p(z | y, beta)

    :param model: a Pyro model. Latent sites in a plate that holds observations are local,
        the others global (or pass ``local``). Global priors must be fixed distributions of
        a conjugate exponential family (their natural parameters are ``eta``). Locals are
        either all discrete (enumerated in parallel) or one continuous site whose conditional
        given the globals is in the family of its support (checked by probing).
    :param step_size: ``rho_t``; default the paper's ``t^-0.75``.
    :param init_values: optional start of ``q(beta_k)`` per global site: a value (the mean,
        with the prior's spread) or a distribution of the site's family (e.g. a narrow one:
        a single-sample step from a broad ``q`` has a high variance).
    :param probe_rtol: the relative residual above which a local is not conditionally
        conjugate; default the probes' tolerance of the data's dtype (1e-6 in float64, 1e-3 in
        float32, whose rounding alone leaves residuals near 1e-4).
    """

    def __init__(
        self,
        model: Callable,
        *,
        local: Optional[Sequence[str]] = None,
        step_size: Union[float, Schedule] = PAPER_SCHEDULE,
        init_values: Optional[
            Dict[str, Union[torch.Tensor, torch.distributions.Distribution]]
        ] = None,
        probe_rtol: Optional[float] = None,
    ) -> None:
        self.model = model
        self.local_names = None if local is None else tuple(local)
        self.schedule = as_schedule(step_size)
        self.init_values = dict(init_values or {})
        self.probe_rtol = probe_rtol
        self.t = 0
        self.counts = StepCounts()
        self.families: Dict[str, ExponentialFamily] = {}
        self.prior_nat: Dict[str, Params] = {}
        self.lam: Dict[str, Params] = {}
        self.last_beta: Dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ set-up
    def _setup(self, args, kwargs) -> None:
        trace = poutine.trace(self.model).get_trace(*args, **kwargs)
        latent = {
            n: s
            for n, s in trace.nodes.items()
            if s["type"] == "sample" and not s["is_observed"] and not site_is_subsample(s)
        }
        data_plates = {
            f.name
            for s in trace.nodes.values()
            if s["type"] == "sample" and s["is_observed"]
            for f in s["cond_indep_stack"]
        }
        if self.local_names is None:
            self.local_names = tuple(
                n
                for n, s in latent.items()
                if {f.name for f in s["cond_indep_stack"]} & data_plates
            )
        self.global_names = tuple(n for n in latent if n not in self.local_names)
        discrete = [n for n in self.local_names if latent[n]["fn"].support.is_discrete]
        if discrete and len(discrete) < len(self.local_names):
            raise ValueError(
                f"StructuredSVI: locals {self.local_names} mix discrete and continuous sites; "
                "use all-discrete locals (enumerated) or one continuous conjugate local"
            )
        if not discrete and len(self.local_names) != 1:
            raise ValueError(
                f"StructuredSVI: found continuous locals {self.local_names}; exactly one "
                "continuous local site (or any number of discrete ones) is supported"
            )
        self.discrete = bool(discrete)
        self.max_plate_nesting = max(
            (
                -f.dim
                for s in trace.nodes.values()
                if s["type"] == "sample"
                for f in s["cond_indep_stack"]
                if f.dim is not None
            ),
            default=0,
        )
        for name in self.global_names:
            fn = latent[name]["fn"]
            fam = family_for_support(fn.support, fn.event_shape)
            try:
                eta = fam.dist_to_natural(fn)
            except Exception as e:  # noqa: BLE001 -- re-raised with the site's name
                raise ValueError(
                    f"StructuredSVI: the prior of global site '{name}' ({type(fn).__name__}) "
                    f"is not in the {fam.name} family with fixed parameters: {e}"
                ) from e
            batch = fn.batch_shape
            eta = tuple(p.expand(batch + s).detach().clone() for p, s in zip(eta, fam.param_shapes))
            self.families[name], self.prior_nat[name] = fam, eta
            init = self.init_values.get(name)
            if isinstance(init, torch.distributions.Distribution):
                nat = fam.dist_to_natural(init)
                self.lam[name] = tuple(
                    p.expand(batch + s).detach().clone() for p, s in zip(nat, fam.param_shapes)
                )
            elif init is not None:
                self.lam[name] = fam.natural_at(init.detach(), eta)
            else:
                self.lam[name] = tuple(p.clone() for p in eta)

    def setup(self, *args, **kwargs) -> None:
        """Find the globals and locals and start ``q(beta)`` (done by the first step)."""
        if not self.families:
            self._setup(args, kwargs)

    # ------------------------------------------------------------------ q
    def posterior(self, name: str) -> torch.distributions.Distribution:
        """The current ``q(beta_k)`` of global site ``name``."""
        return self.families[name].natural_to_dist(self.lam[name])

    def sample_globals(self) -> Dict[str, torch.Tensor]:
        return {n: self.posterior(n).sample() for n in self.global_names}

    # ------------------------------------------------------------------ locals
    def local_log_lik(self, globals_: Dict[str, torch.Tensor], *args, **kwargs) -> torch.Tensor:
        """``sum_n log p(y_n | beta)``: the locals integrated out exactly, differentiable in
        the global values (enumeration for discrete locals, probing for a conjugate one)."""
        if self.discrete:
            return self._enumerated_log_lik(globals_, args, kwargs)
        return self._probe(globals_, args, kwargs)[2]

    def _enumerated_log_lik(self, globals_, args, kwargs):
        # TraceEnum_ELBO.differentiable_loss refuses a value without a graph: give it one
        globals_ = {
            n: v if v.requires_grad else v.detach().requires_grad_() for n, v in globals_.items()
        }
        model = poutine.condition(config_enumerate(self.model, "parallel"), data=globals_)
        elbo = TraceEnum_ELBO(max_plate_nesting=self.max_plate_nesting)
        log_joint = -elbo.differentiable_loss(model, _empty_guide, *args, **kwargs)
        trace = poutine.trace(poutine.condition(self.model, data=globals_)).get_trace(
            *args, **kwargs
        )
        log_prior = sum(trace.nodes[n]["fn"].log_prob(globals_[n]).sum() for n in self.global_names)
        return log_joint - log_prior

    def _probe(self, globals_, args, kwargs):
        """Natural parameters ``eta_n`` of ``p(z_n | y_n, beta)`` and ``sum_n log p(y_n | beta)``.

        ``log p(z_n, y_n | beta) - log h(z_n) = <eta_n, t(z_n)> + c_n`` is fitted on
        ``P = dim(t) + 2`` draws of ``z`` from its prior (one more than needed: the residual
        must vanish, else the local is not conditionally conjugate); ``log p(y_n | beta) =
        c_n + A(eta_n)``.
        """
        (name,) = self.local_names
        cond = poutine.condition(self.model, data=globals_)
        proto = poutine.trace(cond).get_trace(*args, **kwargs).nodes[name]
        fn = proto["fn"]
        fam = family_for_support(fn.support, fn.event_shape, covariance="diag")
        batch = fn.batch_shape
        num = sum(math.prod(s) for s in fam.param_shapes) + 2
        rows, targets = [], []
        for _ in range(num):
            z = fn.sample().detach()
            tr = poutine.trace(poutine.condition(cond, data={name: z})).get_trace(*args, **kwargs)
            logf = 0.0
            for site, s in tr.nodes.items():
                if (
                    s["type"] == "sample"
                    and site not in self.global_names
                    and not site_is_subsample(s)
                ):
                    logf = logf + _sum_to(s["fn"].log_prob(s["value"]), batch, site, name)
            stats = fam.flatten(
                tuple(
                    t.expand(batch + sh) for t, sh in zip(fam.sufficient_stats(z), fam.param_shapes)
                )
            )
            rows.append(torch.cat([stats, torch.ones_like(stats[..., :1])], -1))
            targets.append(logf - fam.base_log_measure(z))
        b = torch.stack(targets, -1)  # [*batch, P]
        # the least-squares fit in float64 (its normal equations square the conditioning);
        # the residual test then sees only the rounding of the log-densities themselves
        A = torch.stack(rows, -2).double()  # [*batch, P, dim + 1]
        At = A.transpose(-1, -2)
        coef = torch.linalg.solve(At @ A, (At @ b.double().unsqueeze(-1))).squeeze(-1)
        resid = (A @ coef.unsqueeze(-1)).squeeze(-1) - b.double()
        coef = coef.to(b.dtype)
        scale = 1.0 + b.detach().abs().amax(-1)
        tol = self.probe_rtol if self.probe_rtol is not None else rtol(b.dtype)
        if bool((resid.detach().abs().amax(-1) > tol * scale).any()):
            raise ValueError(
                f"StructuredSVI: site '{name}' is not conditionally conjugate given the globals "
                f"(its log-density is not affine in the {fam.name} sufficient statistics; "
                f"probe residual {float(resid.detach().abs().max()):.3g}); SSVI needs exact local "
                "conditionals: make the local's likelihood conjugate or enumerate it"
            )
        eta = fam.unflatten(coef[..., :-1])
        return fam, eta, (coef[..., -1] + fam.log_partition(eta)).sum()

    def local_conditional(self, name: str, globals_: Dict[str, torch.Tensor], *args, **kwargs):
        """``q(z | beta) = p(z | y, beta)`` of local site ``name`` at global values ``beta``."""
        if not self.families:
            self._setup(args, kwargs)
        if not self.discrete:
            fam, eta, _ = self._probe(globals_, args, kwargs)
            return fam.natural_to_dist(tuple(p.detach() for p in eta))
        model = poutine.condition(config_enumerate(self.model, "parallel"), data=globals_)
        elbo = TraceEnum_ELBO(max_plate_nesting=self.max_plate_nesting)
        return elbo.compute_marginals(model, _empty_guide, *args, **kwargs)[name]

    # ------------------------------------------------------------------ step
    def step(self, *args, **kwargs) -> float:
        """One SSVI step (Algorithm 1, Option 1) on every global site; returns the sampled
        ``sum_n log p(y_n | beta)``."""
        if not self.families:
            self._setup(args, kwargs)
        self.t += 1
        rho = float(self.schedule(self.t))
        draws = {n: self.posterior(n).sample() for n in self.global_names}
        value = None
        new = {}
        for name in self.global_names:
            fam = self.families[name]

            def log_lik(beta, name=name):
                return self.local_log_lik({**draws, name: beta}, *args, **kwargs)

            target, value, self.last_beta[name] = ssvi_target(
                fam, self.lam[name], self.prior_nat[name], log_lik
            )
            new[name], counts = damped_step(self.lam[name], target, rho, fam.is_valid)
            self.counts += counts
        self.lam.update(new)
        return float(value)

    def predictive_log_lik(self, *args, num_samples: int = 64, posterior=None, **kwargs) -> float:
        """``log (1/S) sum_s p(y | beta_s)``, ``beta_s ~ q(beta)``: the held-out log-likelihood
        of new local groups ``y`` (``posterior``: optional ``{name: Distribution}``, e.g. a
        mean-field CVI guide's, to score another method's ``q(beta)`` the same way)."""
        if not self.families:
            self._setup(args, kwargs)
        post = posterior or {n: self.posterior(n) for n in self.global_names}
        draws = [{n: post[n].sample() for n in self.global_names} for _ in range(num_samples)]
        values = torch.stack([self.local_log_lik(d, *args, **kwargs).detach() for d in draws])
        return float(torch.logsumexp(values, 0) - math.log(num_samples))


def _empty_guide(*args, **kwargs) -> None:
    return None
