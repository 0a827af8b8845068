"""A GPyTorch variational strategy whose q(u) is built in closed form from O(N) CVI sites.

The strategy stores one pair ``(lam1_n, lam2_n)`` per training point (buffers, not parameters,
so ``torch.optim.Adam(model.parameters())`` only sees hyperparameters and, if learned, the
inducing locations). Every call builds q from the sites by a conjugate computation: GP
regression with pseudo-observations (Khan & Lin 2017, eq. 14; see
:mod:`pyro_cvi.contrib.gpytorch.posterior`). The sites themselves are updated by
:class:`~pyro_cvi.contrib.gpytorch.CVIOptimizer` (eq. 13).

Because q is a function of the kernel hyperparameters at fixed sites, the standard
``gpytorch.mlls.VariationalELBO`` differentiates through it. At a site fixed point the partial
gradient of the ELBO with respect to the hyperparameters is the total gradient (the ELBO is
stationary in the sites), so the hybrid loop converges to the same stationary points as
optimising q and the hyperparameters jointly.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
from gpytorch import settings
from gpytorch.distributions import MultivariateNormal
from gpytorch.models import ApproximateGP
from gpytorch.variational import _VariationalDistribution
from gpytorch.variational._variational_strategy import _VariationalStrategy
from linear_operator.operators import DiagLinearOperator, MatmulLinearOperator, SumLinearOperator
from torch import Tensor

from pyro_cvi.scale.distributed import Reducer, as_reducer

from .posterior import FullSitePosterior, SparseSitePosterior
from .site_store import keys_equal, write_sites

__all__ = ["CVISites", "CVIVariationalStrategy"]

Posterior = Union[FullSitePosterior, SparseSitePosterior]


class CVISites(_VariationalDistribution):
    """Container for the CVI site natural parameters: ``lam1`` and ``lam2`` (length ``N``).

    The site of data point ``n`` is ``exp(lam1_n f_n + lam2_n f_n^2)`` with ``lam2_n <= 0``.
    All-zero sites (the initial value) mean q = prior. This is not a distribution over ``u`` on
    its own: q(u) depends on the kernel, so use ``strategy.variational_distribution``.
    """

    def __init__(
        self,
        num_sites: int,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
    ):
        super().__init__(num_inducing_points=num_sites)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        self.register_buffer("lam1", torch.zeros(num_sites, dtype=dtype, device=device))
        self.register_buffer("lam2", torch.zeros(num_sites, dtype=dtype, device=device))

    @property
    def device(self) -> torch.device:
        return self.lam1.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lam1.dtype

    def initialize_variational_distribution(self, prior_dist: MultivariateNormal) -> None:
        self.lam1.zero_()
        self.lam2.zero_()

    def forward(self):
        raise RuntimeError(
            "CVISites hold site parameters, not q(u); q(u) depends on the kernel. "
            "Use model.variational_strategy.variational_distribution instead."
        )


class _Cache:
    __slots__ = ("key", "post", "has_graph", "extras")

    def __init__(self, key, post, has_graph, extras):
        self.key, self.post, self.has_graph, self.extras = key, post, has_graph, extras


class CVIVariationalStrategy(_VariationalStrategy):
    r"""Variational strategy with O(N) CVI site parameters, full or sparse.

    **Full form** (``inducing_points`` are the ``num_data`` training inputs, ``train_inputs``
    not given): sites live on ``u = f(X)`` and q(u) is computed with
    ``B = I + W^1/2 K W^1/2`` (Rasmussen & Williams Alg. 3.2), which needs no inverse of ``K``
    and stays stable when ``K`` is badly conditioned. O(N^3) per iteration.

    **Sparse form** (``M << N`` inducing points; pass ``train_inputs``, or let the first
    full-batch :meth:`CVIOptimizer.step` register them): sites live on the training inputs,
    q(u) is the dual parameterisation of Adam et al. (2021),
    ``q(u) ∝ p(u) prod_n exp(lam1_n a_n^T u + lam2_n (a_n^T u)^2)`` with
    ``a_n = K_ZZ^-1 k(Z, x_n)``. O(N M^2) per iteration, O(N M) memory; the sites of a
    minibatch can be updated alone. Inducing locations may be learned
    (``learn_inducing_locations=True``): the sites stay attached to the data.

    Use it like any GPyTorch strategy: ``model(x)`` returns q(f(x)) and
    ``gpytorch.mlls.VariationalELBO`` computes the ELBO (its KL term is the closed form of
    :meth:`kl_divergence`). Jitter (``jitter_val``, default
    ``gpytorch.settings.variational_cholesky_jitter``: 1e-6 in float64, 1e-4 in float32) is added
    to the predictive variances and, in the sparse form, to ``K_ZZ``; the full form needs none.

    :param model: the ``ApproximateGP`` that owns this strategy (its ``forward`` is the prior).
    :param inducing_points: ``M x D`` inducing inputs (the training inputs for the full form).
    :param num_data: number of training points ``N`` (one site each).
    :param learn_inducing_locations: register ``inducing_points`` as a parameter (sparse only).
    :param train_inputs: ``N x D`` training inputs; selects the sparse form.
    :param jitter_val: diagonal jitter, see above.
    :param process_group: data-parallel CVI (sparse form only): ``WORLD``
        (:data:`pyro_cvi.scale.distributed.WORLD`) or a ``torch.distributed`` group. ``num_data``
        and
        ``train_inputs`` are then this rank's shard; the sums over data points that build q(u)
        are all-reduced, so every rank holds the full-data q(u). See :class:`CVIOptimizer`.
    """

    def __init__(
        self,
        model: ApproximateGP,
        inducing_points: Tensor,
        num_data: int,
        learn_inducing_locations: bool = False,
        *,
        train_inputs: Optional[Tensor] = None,
        jitter_val: Optional[float] = None,
        process_group=None,
    ):
        if inducing_points.dim() == 1:
            inducing_points = inducing_points.unsqueeze(-1)
        if inducing_points.dim() != 2:
            raise NotImplementedError(
                "CVIVariationalStrategy supports a single GP (inducing_points of shape M x D); "
                f"got shape {tuple(inducing_points.shape)}."
            )
        num_data = int(num_data)
        is_full = train_inputs is None and inducing_points.shape[-2] == num_data
        if is_full and learn_inducing_locations:
            raise ValueError(
                "In the full form the inducing points are the training inputs and cannot be "
                "learned. For learned inducing locations use the sparse form: pass "
                "train_inputs=X_train and M < N inducing points."
            )
        if train_inputs is not None:
            if train_inputs.dim() == 1:
                train_inputs = train_inputs.unsqueeze(-1)
            if train_inputs.shape[-2] != num_data:
                raise ValueError(
                    f"train_inputs has {train_inputs.shape[-2]} rows but num_data={num_data}."
                )
        sites = CVISites(num_data, dtype=inducing_points.dtype, device=inducing_points.device)
        super().__init__(
            model, inducing_points, sites, learn_inducing_locations, jitter_val=jitter_val
        )
        self.num_data = num_data
        self.is_full = is_full
        site_inputs = None if train_inputs is None else train_inputs.detach().clone()
        self.register_buffer("site_inputs", site_inputs)
        self._site_version = 0
        self._site_inputs_version = 0
        self._cache: Optional[_Cache] = None
        self._prior_cache = None
        self.reducer: Optional[Reducer] = None
        self.set_process_group(process_group)

    def set_process_group(self, process_group) -> None:
        """Data-parallel q(u) over ``process_group`` (``None``: one process); sparse form only.

        The full form's sites are coupled through ``k(X, X)`` over all N points (its q needs
        ``B = I + W^1/2 K W^1/2``, N x N), so they cannot be split over ranks.
        """
        if process_group is not None and self.is_full:
            raise ValueError(
                "data-parallel CVI (process_group) needs the sparse form of "
                "CVIVariationalStrategy: the full GP's sites are coupled through k(X, X) over all "
                "N training points, so they cannot be split over ranks. Pass M < N inducing "
                "points and train_inputs=X_shard (this rank's rows, num_data=len(X_shard)), or "
                "run the full GP in one process (process_group=None)."
            )
        self.reducer = as_reducer(process_group)
        self._clear_cache()

    # ------------------------------------------------------------------ sites
    @property
    def site_lam1(self) -> Tensor:
        """``lam1`` of every site (length ``num_data``)."""
        return self._variational_distribution.lam1

    @property
    def site_lam2(self) -> Tensor:
        """``lam2 <= 0`` of every site (length ``num_data``)."""
        return self._variational_distribution.lam2

    def set_sites(self, lam1: Tensor, lam2: Tensor, indices: Optional[Tensor] = None) -> None:
        """Overwrite the sites (all of them, or those at ``indices``); ``lam2`` must be <= 0."""
        if torch.any(lam2 > 0):
            raise ValueError("site lam2 must be <= 0 (site precision W = -2 lam2 >= 0).")
        write_sites((self.site_lam1, self.site_lam2), lam1, lam2, indices)
        self._site_version += 1
        self._cache = None

    def reset_sites(self) -> None:
        """Set every site to zero, so that q = prior."""
        self.set_sites(torch.zeros_like(self.site_lam1), torch.zeros_like(self.site_lam2))

    def set_site_inputs(self, train_inputs: Tensor) -> None:
        """Register the ``N x D`` training inputs that carry the sites (sparse form only)."""
        if self.is_full:
            raise ValueError("the full form's sites live on the inducing points already.")
        if train_inputs.dim() == 1:
            train_inputs = train_inputs.unsqueeze(-1)
        if train_inputs.shape[-2] != self.num_data:
            raise ValueError(
                f"expected {self.num_data} training inputs, got {train_inputs.shape[-2]}"
            )
        self.site_inputs = train_inputs.detach().clone().to(self.inducing_points)
        self._site_version += 1
        self._site_inputs_version += 1
        self._clear_cache()

    def pseudo_observations(self) -> Tuple[Tensor, Tensor]:
        """The GP-regression view of the sites: pseudo-targets ``lam1 / W`` and noise ``1 / W``.

        Sites with ``W = -2 lam2 = 0`` carry no information: their noise is ``inf`` and their
        target is returned as 0.
        """
        w = -2.0 * self.site_lam2
        noise = torch.where(w > 0, 1.0 / w, torch.full_like(w, float("inf")))
        target = torch.where(w > 0, self.site_lam1 / w.clamp_min(1e-300), torch.zeros_like(w))
        return target, noise

    @property
    def sites_inputs(self) -> Optional[Tensor]:
        """Inputs carrying the sites: the inducing points (full form) or ``site_inputs``."""
        return self.inducing_points if self.is_full else self.site_inputs

    # -------------------------------------------------------------- caching
    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        state = dict(state)
        state["_cache"] = None  # may hold autograd graphs; cannot be copied or pickled
        state["_prior_cache"] = None
        return state

    def _clear_cache(self) -> None:
        self._cache = None
        self._prior_cache = None
        super()._clear_cache()

    def state_key(self) -> List:
        key: List = [self._site_version]
        for p in self.model.parameters():
            key.append(p.detach().clone())
        key.append(self.inducing_points.detach().clone())
        return key

    keys_equal = staticmethod(keys_equal)

    @property
    def jitter(self) -> float:
        return self.jitter_val

    def _blocks(self) -> dict:
        """Prior blocks that q needs: full ``K, m0`` at Z; sparse ``K_ZZ, K_ZX, diag K_XX, m0``."""
        Z = self.inducing_points
        if self.is_full:
            prior = self.model.forward(Z)
            return {"K": prior.lazy_covariance_matrix.to_dense(), "mean": prior.mean}
        M = Z.shape[-2]
        X = self.site_inputs
        if X is None:
            X = Z[:0]
        joint = self.model.forward(torch.cat([Z, X], dim=-2))
        cov = joint.lazy_covariance_matrix
        K_ZZ = cov[..., :M, :M].to_dense()
        K_ZZ = K_ZZ + self.jitter * torch.eye(M, dtype=K_ZZ.dtype, device=K_ZZ.device)
        has_x = X.shape[-2] > 0
        mean = joint.mean
        return {
            "K_ZZ": K_ZZ,
            "K_ZX": cov[..., :M, M:].to_dense(),
            "kxx_diag": cov[..., M:, M:].diagonal(dim1=-2, dim2=-1) if has_x else mean[..., M:],
            "prior_mean_Z": mean[..., :M],
            "prior_mean_X": mean[..., M:],
        }

    def _prior_blocks(self) -> dict:
        """:meth:`_blocks`, reused across CVI steps while the hyperparameters are unchanged.

        Reused only where autograd is off (CVI steps, monitoring), so no freed graph is ever
        touched; with autograd on (hyperparameter learning) the blocks are always recomputed.
        """
        if torch.is_grad_enabled():
            self._prior_cache = None
            return self._blocks()
        key = [self._site_inputs_version] + self.state_key()[1:]
        c = self._prior_cache
        if c is not None and self.keys_equal(c[0], key):
            return c[1]
        blocks = self._blocks()
        self._prior_cache = (key, blocks)
        return blocks

    def _compute_posterior(self) -> Tuple[Posterior, dict]:
        lam1, lam2 = self.site_lam1, self.site_lam2
        b = self._prior_blocks()
        if self.is_full:
            return FullSitePosterior(b["K"], b["mean"], lam1, lam2), b
        if self.site_inputs is None:
            if torch.any(lam1 != 0) or torch.any(lam2 != 0):
                raise RuntimeError("sparse CVI sites are set but their inputs are unknown.")
            lam1, lam2 = lam1[:0], lam2[:0]
        post = SparseSitePosterior(
            b["K_ZZ"], b["K_ZX"], b["prior_mean_X"], lam1, lam2, reduce=self.reducer
        )
        return post, b

    def _posterior(self, force: bool = False) -> Tuple[Posterior, dict]:
        key = self.state_key()
        c = self._cache
        grad = torch.is_grad_enabled()
        if (
            not force
            and c is not None
            and self.keys_equal(c.key, key)
            and (c.has_graph or not grad)
        ):
            return c.post, c.extras
        post, extras = self._compute_posterior()
        self._cache = _Cache(key, post, grad, extras)
        return post, extras

    # ------------------------------------------------------------- q and p
    @property
    def prior_distribution(self) -> MultivariateNormal:
        """p(u) = N(m0(Z), k(Z, Z)) (unwhitened)."""
        return self.model.forward(self.inducing_points)

    @property
    def variational_distribution(self) -> MultivariateNormal:
        """q(u), dense (``M x M``, or ``N x N`` for the full form); built from the sites."""
        post, extras = self._posterior()
        if self.is_full:
            mean, cov = post.q_u()
        else:
            mean, cov = post.q_u(extras["prior_mean_Z"])
        cov = 0.5 * (cov + cov.mT)
        eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
        return MultivariateNormal(mean, cov + self.jitter * eye)

    def kl_divergence(self) -> Tensor:
        """``KL[q(u) || p(u)]`` in closed form from the sites (see ``posterior.py``)."""
        post, _ = self._posterior()
        return post.kl()

    def site_marginals(self, indices: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """Mean and variance of q(f_n) at the sites' inputs (all, or ``indices``), no graph.

        The variance includes the jitter, as in :meth:`__call__`, so the CVI gradients are
        taken at the same marginals as the ELBO that ``VariationalELBO`` reports.
        """
        with torch.no_grad():
            post, extras = self._posterior()
            if self.is_full:
                mean, var = post.mean, post.var
            else:
                if self.site_inputs is None:
                    raise RuntimeError(
                        "the sparse form needs the training inputs that carry the sites: pass "
                        "train_inputs= to CVIVariationalStrategy, call set_site_inputs(X), or make "
                        "the first CVIOptimizer.step a full batch."
                    )
                mean, var = post.marginals(post.Phi, extras["kxx_diag"], extras["prior_mean_X"])
            var = var.clamp_min(0.0) + self.jitter
            if indices is not None:
                mean, var = mean[..., indices], var[..., indices]
        return mean.detach(), var.detach()

    # -------------------------------------------------------------- predict
    def _same_inputs(self, x: Tensor, ref: Optional[Tensor]) -> bool:
        return ref is not None and x.shape == ref.shape and torch.equal(x, ref)

    def forward(self, x: Tensor, diag: bool = True, **kwargs) -> MultivariateNormal:
        post, extras = self._posterior(force=self.training)
        Z = self.inducing_points
        M = Z.shape[-2]
        want_diag = diag and self.training
        jitter = self.jitter
        K_xx = None

        if self.is_full:
            if self._same_inputs(x, Z):
                mean = post.mean
                R = post.Vh
                kxx_diag = post.K.diagonal(dim1=-2, dim2=-1)
                if not want_diag:
                    K_xx = self.model.forward(x).lazy_covariance_matrix
            else:
                joint = self.model.forward(torch.cat([Z, x], dim=-2))
                cov = joint.lazy_covariance_matrix
                mean, R = post.predict(cov[..., :M, M:].to_dense(), joint.mean[..., M:])
                K_xx = cov[..., M:, M:]
                kxx_diag = K_xx.diagonal(dim1=-2, dim2=-1) if want_diag else None
            if want_diag:
                var = kxx_diag - R.pow(2).sum(-2)
                return MultivariateNormal(mean, DiagLinearOperator(var.clamp_min(0.0) + jitter))
            update = MatmulLinearOperator(-R.mT, R)
        else:
            if self._same_inputs(x, self.site_inputs):
                Phi_x = post.Phi
                prior_mean_x = extras["prior_mean_X"]
                kxx_diag = extras["kxx_diag"]
                if not want_diag:
                    K_xx = self.model.forward(x).lazy_covariance_matrix
            else:
                joint = self.model.forward(torch.cat([Z, x], dim=-2))
                cov = joint.lazy_covariance_matrix
                Phi_x = post.whiten(cov[..., :M, M:].to_dense())
                prior_mean_x = joint.mean[..., M:]
                K_xx = cov[..., M:, M:]
                kxx_diag = K_xx.diagonal(dim1=-2, dim2=-1) if want_diag else None
            mean, Psi = post.predict(Phi_x, prior_mean_x)
            if want_diag:
                var = kxx_diag - Phi_x.pow(2).sum(-2) + Psi.pow(2).sum(-2)
                return MultivariateNormal(mean, DiagLinearOperator(var.clamp_min(0.0) + jitter))
            left = torch.cat([-Phi_x, Psi], dim=-2)
            right = torch.cat([Phi_x, Psi], dim=-2)
            update = MatmulLinearOperator(left.mT, right)
        covar = SumLinearOperator(K_xx.add_jitter(jitter), update)
        if settings.trace_mode.on():
            covar = covar.to_dense()
        return MultivariateNormal(mean, covar)

    def __call__(
        self, x: Tensor, prior: bool = False, diag: bool = True, **kwargs
    ) -> MultivariateNormal:
        if prior:
            return self.model.forward(x, **kwargs)
        if x.dim() != 2:
            raise NotImplementedError(
                f"CVIVariationalStrategy expects inputs of shape n x D; got {tuple(x.shape)}."
            )
        return self.forward(x, diag=diag, **kwargs)
