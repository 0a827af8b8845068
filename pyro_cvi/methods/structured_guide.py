"""Structured SVI as a Pyro guide: ``AutoStructuredCVI`` inside ``pyro.infer.SVI``.

The guide is Hoffman & Blei's structured ``q`` (:mod:`pyro_cvi.methods.structured`)::

    q(beta, z) = prod_k q(beta_k | lam_k) prod_n p(z_n | y_n, beta)

trained by the usual ``SVI(model, guide, CVI(), CVI_ELBO())`` loop. Each ``svi.step``:

1. ``CVI_ELBO`` asks the guide for its bound at one draw ``beta~ ~ q(beta)`` (Algorithm 1,
   Option 1): the local conditionals are exact, so their KL vanishes and
   ``ELBO ~= log p(beta~) - log q(beta~) + sum_n log p(y_n | beta~)`` (an unbiased single-draw
   estimate, the value reported); the SSVI target ``eta + F^-1 grad_lam sum_n log p(y_n |
   beta(lam, u))`` (eqs. 7-8, 21) goes into each ``lam_k``'s ``.grad`` as ``target - lam``;
2. ``CVI`` steps ``lam <- lam + rho (target - lam)`` with the step policy of
   :mod:`~pyro_cvi.update`: ``rho`` is ``CVI``'s fixed schedule when one is given, and the
   guide's own Robbins-Monro schedule (``t^-0.75``, the paper's) under ``CVI()`` (a
   single-draw target is too noisy for the backtracking control of the other guides).

The guide samples ``beta`` from ``q(beta)`` and each local from its exact conditional given
that ``beta`` (a continuous conjugate local, or discrete locals from their enumerated
marginals). Its natural parameters are module parameters (``named_parameters()``) and live in
the param store under ``"<guide name>.ssvi<i>.<site>"``.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Callable, Dict, Optional, Sequence, Union

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer.autoguide import AutoGuide

from ..guide_state import bind_parameters, rng_preserved, sync_parameters
from ..step_sizes import Schedule, as_schedule
from ..update import StepCounts, damped_step, register_owner
from .bound_check import BoundChecked
from .structured import PAPER_SCHEDULE, StructuredSVI, ssvi_target

__all__ = ["AutoStructuredCVI"]


class AutoStructuredCVI(BoundChecked, AutoGuide):
    """Structured SVI (Hoffman & Blei 2015) as a guide for ``pyro.infer.SVI``.

    Example::

        guide = AutoStructuredCVI(model)
        svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
        for _ in range(300):
            svi.step(data)
        guide.posterior("mu")               # q(mu)

    :param model: a Pyro model with global latents in conjugate-exponential families and
        conditionally conjugate (or discrete) locals, as :class:`~pyro_cvi.StructuredSVI`.
    :param local: the local site names (default: latents in a plate with observations).
    :param step_size: the schedule ``rho_t`` used under ``CVI()`` (default ``t^-0.75``).
    :param init_values: optional start of ``q(beta_k)`` per global site.
    """

    def __init__(
        self,
        model: Callable,
        *,
        local: Optional[Sequence[str]] = None,
        step_size: Union[float, Schedule] = PAPER_SCHEDULE,
        init_values: Optional[Dict] = None,
        create_plates: Optional[Callable] = None,
    ) -> None:
        super().__init__(model, create_plates=create_plates)
        self.ssvi = StructuredSVI(model, local=local, init_values=init_values)
        self.schedule = as_schedule(step_size)
        self.counts = StepCounts()
        self.t = 0
        # the owner protocol of the CVI optimizer (no adaptive control, one process)
        self.pending: Optional[Dict[str, tuple]] = None
        self.control = None

    @property
    def prefix(self) -> str:
        return self._pyro_name

    @property
    def param_prefix(self) -> str:
        """The prefix of this guide's names in Pyro's param store."""
        return self._pyro_name

    @property
    def engine(self) -> AutoStructuredCVI:
        """The owner of the natural parameters (``CVI_ELBO`` and ``CVI`` ask a guide for its
        engine): the guide itself."""
        return self

    def _names(self, site: str):
        n = len(self.ssvi.families[site].param_shapes)
        return [f"{self._pyro_name}.ssvi{i}.{site}" for i in range(n)]

    def _ready(self, args, kwargs) -> StructuredSVI:
        ssvi = self.ssvi
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        if not ssvi.families:
            with poutine.block():  # its model runs are not the guide's sites
                ssvi.setup(*args, **kwargs)
            for site in ssvi.global_names:
                for name, value in zip(self._names(site), ssvi.lam[site]):
                    pyro.param(name, value.detach().clone())
            bind_parameters(self, [n for s in ssvi.global_names for n in self._names(s)])
        sync_parameters(self)
        for site in ssvi.global_names:  # q(beta) reads the parameters
            ssvi.lam[site] = tuple(pyro.param(n).detach() for n in self._names(site))
        return ssvi

    # ------------------------------------------------------------------ the loss (CVI_ELBO)
    def elbo(self, args, kwargs, grads: bool = False, graph: bool = False) -> torch.Tensor:
        """A single-draw estimate of the ELBO of the structured ``q`` (module docstring); with
        ``grads`` the SSVI targets go into the parameters' ``.grad`` as ``target - lam``."""
        ssvi = self._ready(args, kwargs)
        draws = {n: ssvi.posterior(n).sample() for n in ssvi.global_names}
        targets = {}
        for site in ssvi.global_names:  # as StructuredSVI.step: each target at its own draw

            def log_lik(beta, site=site):
                with poutine.block():
                    return ssvi.local_log_lik({**draws, site: beta}, *args, **kwargs)

            targets[site] = ssvi_target(
                ssvi.families[site], ssvi.lam[site], ssvi.prior_nat[site], log_lik
            )[0]
        with rng_preserved(), poutine.block():  # (the probe's draws do not change the
            # exact local integral)
            elbo = ssvi.local_log_lik(draws, *args, **kwargs).detach()
        for site in ssvi.global_names:
            prior = ssvi.families[site].natural_to_dist(ssvi.prior_nat[site])
            beta = draws[site]
            elbo = elbo + (prior.log_prob(beta) - ssvi.posterior(site).log_prob(beta)).sum()
        if grads:
            for site, target in targets.items():
                for name, t in zip(self._names(site), target):
                    p = pyro.param(name).unconstrained()
                    p.grad = (t - p.detach()).detach()
                    register_owner(p, self)
            self.pending = targets
        return elbo.detach()

    # ------------------------------------------------------------------ the step (CVI)
    # (the owner protocol of the CVI optimizer: pyro_cvi.update.NaturalGradientOwner)
    @property
    def reducer(self):
        return None

    def has_pending_step(self) -> bool:
        return self.pending is not None

    def pending_loss(self):
        """``None``: a single-draw estimate; the fixed step's monitor does not watch it."""
        return None

    def step_labels(self):
        return list(self.ssvi.global_names)

    def enable_control(self, max_beta: float, state=None):
        """``CVI()`` (adaptive): this guide keeps its own Robbins-Monro schedule."""
        return None

    def step(self, beta: Optional[float]) -> None:
        """``lam <- lam + rho (target - lam)`` with the step policy (``beta``: ``CVI``'s
        fixed step; ``None``: the guide's schedule)."""
        targets, self.pending = self.pending, None
        if targets is None:
            return
        self.t += 1
        rho = float(self.schedule(self.t)) if beta is None else float(beta)
        for site, target in targets.items():
            fam = self.ssvi.families[site]
            params = [pyro.param(n).unconstrained() for n in self._names(site)]
            new, counts = damped_step(tuple(p.detach() for p in params), target, rho, fam.is_valid)
            self.counts += counts
            with torch.no_grad():
                for p, v in zip(params, new):
                    p.copy_(v)
            self.ssvi.lam[site] = tuple(p.detach() for p in params)

    # ------------------------------------------------------------------ the guide
    def forward(self, *args, **kwargs) -> Dict[str, torch.Tensor]:
        ssvi = self._ready(args, kwargs)
        plates = self._create_plates(*args, **kwargs)
        out = {}
        for site in ssvi.global_names:
            with _plates(self.prototype_trace.nodes[site], plates):
                out[site] = pyro.sample(site, ssvi.posterior(site))
        globals_ = {k: v.detach() for k, v in out.items()}
        for site in ssvi.local_names:
            with poutine.block():
                q = ssvi.local_conditional(site, globals_, *args, **kwargs)
            node = self.prototype_trace.nodes[site]
            q = (
                q.to_event(len(q.batch_shape) - len(node["fn"].batch_shape))
                if len(q.batch_shape) > len(node["fn"].batch_shape)
                else q
            )
            with _plates(node, plates):
                out[site] = pyro.sample(site, q)
        return out

    def posterior(self, name: str) -> torch.distributions.Distribution:
        """The current ``q(beta_k)`` of global site ``name``."""
        if name not in self.ssvi.families:
            raise KeyError(f"{name!r} is not a global site; globals: {list(self.ssvi.families)}")
        sync_parameters(self)
        lam = tuple(pyro.param(n).detach() for n in self._names(name))
        return self.ssvi.families[name].natural_to_dist(lam)

    @torch.no_grad()
    def median(self, *args, **kwargs) -> Dict[str, torch.Tensor]:
        """The means of ``q(beta_k)`` (the globals)."""
        self._ready(args, kwargs)
        return {n: self.posterior(n).mean for n in self.ssvi.global_names}


def _plates(site, plates) -> ExitStack:
    stack = ExitStack()
    for frame in site["cond_indep_stack"]:
        if frame.vectorized and frame.name in plates:
            stack.enter_context(plates[frame.name])
    return stack
