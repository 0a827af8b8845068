"""CVI sites on the inducing values: the form of :class:`CVIVariationalStrategy` built the GPyTorch
way, ``CVIVariationalStrategy(model, inducing_points, variational_distribution)``.

In whitened coordinates ``u = m0(Z) + L_Z v`` (``L_Z L_Z^T = K_ZZ``) the sites are one Gaussian
factor ``exp(lam1^T v + v^T lam2 v)`` on ``v`` per GP (``lam2`` negative semidefinite, ``M x M``),
so that (Khan & Lin 2017, eq. 14 with the prior ``N(0, I)``)::

    q(v) = N(m_v, S_v),   S_v = B^-1,   B = I - 2 lam2 = L_B L_B^T,   m_v = B^-1 lam1,
    KL[q(v) || N(0, I)] = 1/2 (tr S_v + |m_v|^2 - M + log |B|),
    q(f(x)) = N(m0(x) + Phi_x^T m_v,  k(x, x) - Phi_x^T Phi_x + Phi_x^T S_v Phi_x),
    Phi_x = L_Z^-1 k(Z, x).

The CVI target of the sites (eq. 13) is the gradient of the data term ``F`` (scaled to the full
data) with respect to the mean parameters ``(m_v, S_v + m_v m_v^T)`` of q(v) (eqs. 30-31)::

    lam2* = dF/dS_v (symmetrised),     lam1* = dF/dm_v - 2 lam2* m_v,

and the step is ``lam <- (1 - beta) lam + beta lam*`` (eq. 12, :func:`pyro_cvi.update.cvi_update`):
the natural-gradient step of Hensman et al. (2013) with step ``beta``.

**The step from the ELBO's backward pass.** In training mode with autograd on, q(f) is built from
leaf tensors ``m_v``, ``S_v`` and the KL term carries a scalar probe whose gradient is the weight
``c`` of the KL in the loss (``beta_elbo / N`` for ``-VariationalELBO``). One hook receives
``dL/dm_v``, ``dL/dS_v`` and ``c`` together and takes the CVI step with ``dF = -dL / c``, so a plain
``loss = -mll(model(x), y); loss.backward(); adam.step()`` loop trains q (Adam only sees the
hyperparameters: the sites are buffers). A :class:`CVIOptimizer` turns this off and takes its own
steps (with backtracking) instead.

**The first step** (sites at their start, one GP, ``lengthscale_search``) also keeps the batch's
marginals and their gradients (per-point sites, eqs. 30-31) and runs the lengthscale M-step of
:mod:`~pyro_cvi.contrib.gpytorch.lengthscale_search`; a move is written into the kernels once the
backward pass has finished (the graph still holds the old values).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Tuple

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.variational import _VariationalDistribution
from linear_operator.operators import (
    DenseLinearOperator,
    DiagLinearOperator,
    MatmulLinearOperator,
)
from torch import Tensor

from pyro_cvi.update import cvi_update

from .lengthscale_search import LengthscaleMove, data_sites, search_lengthscales
from .posterior import safe_cholesky
from .site_distribution import SiteMultivariateNormal
from .step_guard import SecantBacktracking

__all__ = [
    "InducingSites",
    "SiteMultivariateNormal",
    "WhitenedQ",
    "mean_param_targets",
    "nsd_projection",
]


class InducingSites(_VariationalDistribution):
    """Site buffers ``lam1 [*batch, M]`` and ``lam2 [*batch, M, M]`` (NSD) on whitened ``v``.

    :meth:`initialize_variational_distribution` sets ``lam2 = 0`` and draws ``lam1`` with standard
    deviation ``mean_init_std`` (as GPyTorch initialises its variational means), so that the
    gradients for the inducing points and the kernel are not zero at the first step.
    """

    def __init__(
        self,
        num_inducing_points: int,
        batch_shape: Optional[torch.Size] = None,
        mean_init_std: float = 1e-3,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
    ):
        batch_shape = torch.Size([]) if batch_shape is None else torch.Size(batch_shape)
        super().__init__(num_inducing_points, batch_shape, mean_init_std)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        m, b = num_inducing_points, torch.Size(batch_shape)
        self.register_buffer("lam1", torch.zeros(*b, m, dtype=dtype, device=device))
        self.register_buffer("lam2", torch.zeros(*b, m, m, dtype=dtype, device=device))

    def initialize_variational_distribution(self, prior_dist: MultivariateNormal) -> None:
        with torch.no_grad():
            self.lam1.copy_(torch.randn_like(self.lam1) * self.mean_init_std)
            self.lam2.zero_()

    def forward(self):
        raise RuntimeError(
            "InducingSites hold CVI site parameters; use strategy.variational_distribution "
            "for q(u)."
        )


class WhitenedQ:
    """q(v) from the sites (module docstring): ``m_v``, ``S_v``, ``L_B`` and the KL, no graph."""

    def __init__(self, lam1: Tensor, lam2: Tensor):
        lam1, lam2 = lam1.detach(), lam2.detach()
        m = lam1.shape[-1]
        eye = torch.eye(m, dtype=lam1.dtype, device=lam1.device)
        B = eye - (lam2 + lam2.mT)
        self.L_B = safe_cholesky(B, "B = I - 2 lam2 (the whitened site precision plus I)")
        self.m_v = torch.cholesky_solve(lam1.unsqueeze(-1), self.L_B).squeeze(-1)
        self.S_v = torch.cholesky_solve(eye.expand_as(B), self.L_B)
        logdet = 2.0 * self.L_B.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        trace = self.S_v.diagonal(dim1=-2, dim2=-1).sum(-1)
        self.kl = 0.5 * (trace + self.m_v.pow(2).sum(-1) - m + logdet)


def predictive(
    Phi: Tensor, prior_mean_x: Tensor, m_v: Tensor, S_v: Tensor
) -> Tuple[Tensor, Tensor, Tensor]:
    """q(f(x)) from q(v) (module docstring): the mean, ``A = S_v Phi_x`` and ``Phi_x`` broadcast to
    their common batch shape, so that ``cov = k(x, x) + Phi_x^T (A - Phi_x)``."""
    mean = prior_mean_x + (Phi.mT @ m_v.unsqueeze(-1)).squeeze(-1)
    A = S_v @ Phi
    return mean, A, Phi.expand_as(A)


def nsd_projection(lam2: Tensor) -> Tuple[Tensor, int]:
    """The nearest negative semidefinite matrix (eigenvalues clipped at 0) and how many batch
    elements needed it (non-log-concave likelihoods, PredictiveLogLikelihood)."""
    lam2 = 0.5 * (lam2 + lam2.mT)
    evals, evecs = torch.linalg.eigh(lam2)
    tol = 1e-12 * evals.abs().amax(-1, keepdim=True).clamp_min(1.0)
    bad = (evals > tol).any(-1)
    if not bool(bad.any()):
        return lam2, 0
    clipped = (evecs * evals.clamp_max(0.0).unsqueeze(-2)) @ evecs.mT
    return torch.where(bad[..., None, None], clipped, lam2), int(bad.sum())


def mean_param_targets(m_v: Tensor, gm: Tensor, gS: Tensor) -> Tuple[Tensor, Tensor, int]:
    """CVI targets from ``dF/dm_v`` and ``dF/dS_v`` (eqs. 30-31 in M dimensions), and how many
    batch elements had their curvature clipped.

    ``t2 = dF/dS_v`` is projected to the negative semidefinite cone (:func:`nsd_projection`)
    *before* ``t1 = dF/dm_v - 2 t2 m_v`` is formed, so that the site still matches the gradient in
    the mean: at a fixed point ``lam = t``, ``m_v = B^-1 t1`` gives ``m_v = dF/dm_v`` (the
    stationarity condition of ``F - KL``) whatever was clipped. Forming ``t1`` from the unclipped
    ``t2`` instead multiplies ``m_v`` by ``-2 t2`` in every clipped direction at every step, which
    diverges where ``t2`` is large (``PredictiveLogLikelihood``, non-log-concave likelihoods).
    """
    t2, clipped = nsd_projection(gS)
    t1 = gm - 2.0 * (t2 @ m_v.unsqueeze(-1)).squeeze(-1)
    return t1, t2, clipped


class BackwardStep:
    """Leaves ``m_v``, ``S_v`` and the KL probe of one value of the sites, and the hook that
    turns their gradients into one CVI step (module docstring).

    :param q: q(v) at the current sites.
    :param apply: called with ``(step, t1, t2, c, clipped)``: this object, the CVI targets
        (full-data scale), the KL's weight in the loss and the number of clipped curvatures,
        once per backward.
    """

    _warned = False

    def __init__(self, q: WhitenedQ, apply: Callable[..., None]):
        #: the inputs of the forward passes that used these leaves (see :mod:`.step_guard`)
        self.inputs: list = []
        self.m_v = q.m_v.detach().clone().requires_grad_(True)
        self.S_v = q.S_v.detach().clone().requires_grad_(True)
        self.probe = torch.zeros_like(q.kl).requires_grad_(True)
        self.apply = apply
        self.active = True
        torch.autograd.graph.register_multi_grad_hook((self.m_v, self.S_v, self.probe), self._hook)

    def kl(self, kl: Tensor) -> Tensor:
        """The KL value whose gradient with respect to the probe is its weight in the loss."""
        return kl.detach() + (self.probe - self.probe.detach())

    def _hook(self, grads) -> None:
        gm, gS, c = grads
        if not self.active or (gm is None and gS is None):
            return
        if c is None or not bool((c != 0).all()):
            if not BackwardStep._warned:
                BackwardStep._warned = True
                warnings.warn(
                    "CVIVariationalStrategy: the loss that was differentiated has no KL term "
                    "(or a zero weight on it), so the CVI step from the backward pass cannot be "
                    "scaled and q was not updated. Use -gpytorch.mlls.VariationalELBO (or "
                    "PredictiveLogLikelihood, GammaRobustVariationalELBO), or take the steps "
                    "with CVIOptimizer.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        self.active = False  # one step per value of the sites
        gm = torch.zeros_like(self.m_v) if gm is None else gm
        gS = torch.zeros_like(self.S_v) if gS is None else gS
        t1, t2, clipped = mean_param_targets(
            self.m_v.detach(), -gm / c[..., None], -gS / c[..., None, None]
        )
        self.apply(self, t1, t2, c, clipped)


class InducingForm:
    """The inducing-site form of :class:`CVIVariationalStrategy` (mixed into it; module
    docstring). Uses the strategy's ``model``, ``inducing_points``, ``jitter``, ``training`` and
    its site buffers ``lam1``, ``lam2``; ``step_size`` is the ``beta`` of the backward step."""

    def _init_inducing(self, model, inducing_points, dist, learn, jitter_val) -> None:
        """The GPyTorch-style constructor: sites on the inducing values (``inducing.py``)."""
        if dist is not None and not isinstance(dist, _VariationalDistribution):
            raise TypeError(
                "variational_distribution must be a gpytorch _VariationalDistribution (used for "
                f"its batch_shape and mean_init_std) or None; got {type(dist).__name__}. For the "
                "data-site form pass num_data= (and train_inputs= for the sparse form)."
            )
        M = inducing_points.shape[-2]
        batch = inducing_points.shape[:-2] if dist is None else dist.batch_shape
        std = 1e-3 if dist is None else dist.mean_init_std
        if dist is not None and dist.num_inducing_points != M:
            raise ValueError(
                f"variational_distribution has {dist.num_inducing_points} inducing points but "
                f"inducing_points has {M} rows."
            )
        sites = InducingSites(
            M, batch, std, dtype=inducing_points.dtype, device=inducing_points.device
        )
        learn = True if learn is None else bool(learn)
        super().__init__(model, inducing_points, sites, learn, jitter_val=jitter_val)
        self.num_data, self.is_full = None, False
        self.register_buffer("site_inputs", None)
        self._site_version = 0
        self.site_inputs_version = 0
        self._cache = self._prior_cache = None
        self.reducer = None

    def _inducing_init(self, step_size: float, lengthscale_search: bool = True) -> None:
        if not 0.0 < float(step_size) <= 1.0:
            raise ValueError(f"step_size must be in (0, 1], got {step_size}")
        self.step_size = float(step_size)
        #: the first step's M-step on the lengthscales (:mod:`.lengthscale_search`)
        self.lengthscale_search = bool(lengthscale_search)
        self.lengthscale_move: Optional[LengthscaleMove] = None
        self._searched = False
        self._capture: Optional[dict] = None
        self.backward_step = True
        #: the policy of the step from the backward pass (:mod:`.step_guard`)
        self.step_guard = SecantBacktracking(self.step_size)
        self.num_clipped = 0
        self._q_cache = None
        self._step_cache = None
        self._tracked = None

    # ---------------------------------------------------------------- q(v)
    def _q_key(self) -> tuple:
        lam1 = self._variational_distribution.lam1
        return (self._site_version, lam1.dtype, lam1.device)

    def whitened_q(self) -> WhitenedQ:
        """q(v) at the current sites (cached while they do not change)."""
        if getattr(self, "_pending_unwhitened", None) is not None:  # a loaded GPyTorch q(u)
            self._convert_pending()
        key = self._q_key()
        if self._q_cache is None or self._q_cache[0] != key:
            d = self._variational_distribution
            self._q_cache = (key, WhitenedQ(d.lam1, d.lam2))
        return self._q_cache[1]

    def _q_tensors(self) -> Tuple[Tensor, Tensor, Tensor]:
        """``m_v``, ``S_v`` and the KL; in training mode with autograd on and the backward step
        enabled, the leaves and probe of :class:`BackwardStep`."""
        q = self.whitened_q()
        if self._tracked is not None:
            return self._tracked[0], self._tracked[1], q.kl
        if not (self.backward_step and self.training and torch.is_grad_enabled()):
            return q.m_v, q.S_v, q.kl
        key = self._q_key()
        if self._step_cache is None or self._step_cache[0] != key:
            self._step_cache = (key, BackwardStep(q, self._backward_update))
        step = self._step_cache[1]
        return step.m_v, step.S_v, step.kl(q.kl)

    @contextmanager
    def tracked_q(self) -> Iterator[Tuple[Tensor, Tensor]]:
        """Inside the block q(f) is built from the yielded leaves ``m_v``, ``S_v`` (no hook): the
        gradient of a data term with respect to them gives the CVI targets
        (:func:`mean_param_targets`); used by :class:`CVIOptimizer`."""
        q = self.whitened_q()
        self._tracked = (
            q.m_v.detach().clone().requires_grad_(True),
            q.S_v.detach().clone().requires_grad_(True),
        )
        try:
            yield self._tracked
        finally:
            self._tracked = None

    def _backward_update(
        self, step: BackwardStep, t1: Tensor, t2: Tensor, c: Tensor, clipped: int = 0
    ) -> None:
        """The step from the backward pass, through :class:`.step_guard.SecantBacktracking`
        (undone and shrunk if the objective got worse, retracted to valid sites)."""
        d = self._variational_distribution
        self.num_clipped += clipped
        guard = self.step_guard
        guard.step_size = self.step_size
        cap = self.pop_captured()
        if cap is not None and cap.get("gm") is not None and cap.get("gv") is not None:
            moved = self.search_step(cap["x"], cap["mean"], -cap["gm"] / c, -cap["gv"] / c)
            if moved is not None:  # the new lengthscales once this backward pass has finished
                torch.autograd.Variable._execution_engine.queue_callback(moved.apply)
                t1, t2 = moved.targets
                t2, n = nsd_projection(t2)
                self.num_clipped += n
                guard.reset()  # a different objective from here on
        checked = {}

        def check(lam1: Tensor, lam2: Tensor) -> None:
            checked["q"] = WhitenedQ(lam1, lam2)

        lam = (d.lam1.detach().clone(), d.lam2.detach().clone())
        mu_v = (step.m_v.detach(), step.S_v.detach())
        new = guard.step(lam, mu_v, (t1, t2), step.inputs, c, self._site_version, check)
        if new is None:
            warnings.warn(
                "CVIVariationalStrategy: no step from the backward pass gives valid sites "
                f"(B = I - 2 lam2 positive definite in {d.lam1.dtype}); q was left as it was. "
                "Use float64 (model.double(), likelihood.double()) or a smaller step_size.",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        self.set_sites(*new)
        guard.version = self._site_version
        if "q" in checked:
            self._q_cache = (self._q_key(), checked["q"])

    # ------------------------------------------------- the lengthscale search
    def search_pending(self) -> bool:
        """Whether the next step is the first from the initial sites (``lam2 = 0``) of a single
        GP with the search enabled: the step that runs :mod:`.lengthscale_search`."""
        d = self._variational_distribution
        return (
            self.lengthscale_search
            and not self._searched
            and d.lam1.dim() == 1
            and not bool(d.lam2.any())
        )

    def _capture_marginals(self, x: Tensor, mean: Tensor, var: Tensor, hooks: bool) -> None:
        """Keep the batch's marginals of the first step; with ``hooks``, their gradients too."""
        cap = self._capture = {"x": x.detach(), "mean": mean.detach(), "graph": (mean, var)}
        if hooks:
            mean.register_hook(lambda g: cap.__setitem__("gm", g.detach()))
            var.register_hook(lambda g: cap.__setitem__("gv", g.detach()))

    def pop_captured(self) -> Optional[dict]:
        """The first step's captured marginals (``x``, ``mean``, and ``graph``: the tensors of
        the batch's mean and variance), cleared here; ``None`` if none were captured."""
        cap, self._capture = self._capture, None
        return cap

    def search_step(self, x: Tensor, mean: Tensor, gm: Tensor, gv: Tensor):
        """Run the lengthscale search from the data sites at the marginals ``N(mean, .)`` with
        ``dF/dm = gm``, ``dF/dv = gv`` (full-data scale); the move (not yet applied) or None."""
        self._searched = True
        lam1, lam2 = data_sites(mean, gm, gv)
        if not bool(torch.isfinite(lam1).all() and torch.isfinite(lam2).all()):
            return None
        move = search_lengthscales(self.model, self.inducing_points, x, lam1, lam2, self.jitter)
        self.lengthscale_move = move
        return move

    def blend_sites(self, old, target, beta: float) -> None:
        """Eq. 12 towards ``target`` (``lam2`` projected to NSD first; counted in
        ``num_clipped``): ``lam <- (1 - beta) lam + beta target``."""
        t2, clipped = nsd_projection(target[1])
        self.num_clipped += clipped
        lam1, lam2 = cvi_update(old, (target[0], t2), beta)
        self.set_sites(lam1, 0.5 * (lam2 + lam2.mT))

    # ------------------------------------------------------------ q(u), q(f)
    def _inducing_variational_distribution(self) -> MultivariateNormal:
        """q(u) (``u = m0(Z) + L_Z v``) with the sites' KL. Its mean and covariance carry no
        gradient to q(v): the step's gradients must come from the data term alone, and a
        Monte Carlo KL (``log q(u) - log p(u)`` at a draw, Pyro's ``Trace_ELBO``) would add its
        own; the KL's part of the step is the sites themselves (eq. 13). Its weight in the loss
        reaches the step through the probe in the KL and in ``log_prob``."""
        m_v, S_v, kl = self._q_tensors()
        probe = kl - kl.detach()  # zero; its gradient is the KL's weight in the loss
        m_v, S_v = m_v.detach(), S_v.detach()
        prior = self.model.forward(self.inducing_points)
        L_Z = safe_cholesky(self._kzz(prior.lazy_covariance_matrix.to_dense()), "K_ZZ")
        mean = prior.mean + (L_Z @ m_v.unsqueeze(-1)).squeeze(-1)
        cov = L_Z @ S_v @ L_Z.mT
        eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
        return SiteMultivariateNormal(mean, 0.5 * (cov + cov.mT) + self.jitter * eye, kl, probe)

    @property
    def prior_distribution(self) -> MultivariateNormal:
        """p(u) = N(m0(Z), k(Z, Z)) (unwhitened); in the inducing form with q(u)'s batch shape
        (as GPyTorch's strategies give it)."""
        prior = self.model.forward(self.inducing_points)
        return self.with_q_batch(prior) if self.inducing_form else prior

    def with_q_batch(self, prior: MultivariateNormal) -> MultivariateNormal:
        """``prior`` broadcast to q(u)'s batch shape (dense ``M x M``, with the jitter that q's
        ``K_ZZ`` has, as a linear operator so that GPyTorch factorises it): Pyro's ``pyro_model``
        samples p(u) at the site of q(u) in ``pyro_guide``, so their shapes must agree."""
        batch = self._variational_distribution.batch_shape
        shape = torch.broadcast_shapes(prior.batch_shape, batch)
        if shape == prior.batch_shape:
            return prior
        M = prior.mean.shape[-1]
        cov = self._kzz(prior.lazy_covariance_matrix.to_dense()).expand(*shape, M, M)
        return MultivariateNormal(prior.mean.expand(*shape, M), DenseLinearOperator(cov))

    def _kzz(self, K_ZZ: Tensor) -> Tensor:
        eye = torch.eye(K_ZZ.shape[-1], dtype=K_ZZ.dtype, device=K_ZZ.device)
        return K_ZZ + self.jitter * eye

    def _inducing_forward(self, x: Tensor, diag: bool) -> MultivariateNormal:
        Z = self.inducing_points
        M = Z.shape[-2]
        batch = torch.broadcast_shapes(Z.shape[:-2], x.shape[:-2])
        Z = Z.expand(*batch, *Z.shape[-2:])
        x = x.expand(*batch, *x.shape[-2:])
        joint = self.model.forward(torch.cat([Z, x], dim=-2))
        cov = joint.lazy_covariance_matrix
        L_Z = safe_cholesky(self._kzz(cov[..., :M, :M].to_dense()), "K_ZZ")
        Phi = torch.linalg.solve_triangular(L_Z, cov[..., :M, M:].to_dense(), upper=False)
        m_v, S_v, _ = self._q_tensors()
        step = None if self._tracked is not None else self._step_cache
        if step is not None and m_v is step[1].m_v:  # the inputs of the backward step's loss
            step[1].inputs.append(x.detach())
        mean, A, Phi = predictive(Phi, joint.mean[..., M:], m_v, S_v)
        K_xx = cov[..., M:, M:]
        if diag and self.training:
            var = K_xx.diagonal(dim1=-2, dim2=-1) + (Phi * (A - Phi)).sum(-2)
            var = var.clamp_min(0.0) + self.jitter
            stepping = self._tracked is not None or self.backward_step
            if stepping and torch.is_grad_enabled() and mean.dim() == 1 and self.search_pending():
                self._capture_marginals(x, mean, var, hooks=self._tracked is None)
            return MultivariateNormal(mean, DiagLinearOperator(var))
        out_batch = A.shape[:-2]
        K_xx = K_xx.add_jitter(self.jitter)
        if K_xx.shape[:-2] != out_batch:
            K_xx = K_xx.expand(*out_batch, *K_xx.shape[-2:])
        covar = K_xx + MatmulLinearOperator(Phi.mT, A - Phi)
        return MultivariateNormal(mean, covar)
