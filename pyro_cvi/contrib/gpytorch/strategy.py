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

from . import site_store as store
from .batch_inputs import BatchInputForm
from .fantasy import FantasyForm
from .inducing import InducingForm
from .minibatch import SiteScalingForm
from .posterior import FullSitePosterior, SiteSums, SparseSitePosterior
from .site_store import CVISites, check_data_site_args, keys_equal, write_sites
from .state_convert import SavedStateForm

__all__ = ["CVISites", "CVIVariationalStrategy"]

Posterior = Union[FullSitePosterior, SparseSitePosterior]


class _Cache:
    __slots__ = ("key", "post", "has_graph", "extras")

    def __init__(self, key, post, has_graph, extras):
        self.key, self.post, self.has_graph, self.extras = key, post, has_graph, extras


class CVIVariationalStrategy(
    BatchInputForm, FantasyForm, SavedStateForm, SiteScalingForm, InducingForm, _VariationalStrategy
):
    r"""Variational strategy whose q(u) is built in closed form from CVI sites.

    **Built the GPyTorch way** (``CVIVariationalStrategy(model, inducing_points,
    variational_distribution, learn_inducing_locations=True)``, a drop-in for GPyTorch's
    strategies): one whitened Gaussian site per GP on the inducing values
    (:mod:`~pyro_cvi.contrib.gpytorch.inducing`), any batch shape (batched inducing points,
    kernels and inputs; inside ``IndependentMultitaskVariationalStrategy`` and
    ``LMCVariationalStrategy``). The ``variational_distribution`` argument only gives the batch
    shape and ``mean_init_std``. In training mode ``loss.backward()`` of ``-VariationalELBO``
    (or ``PredictiveLogLikelihood``, ``GammaRobustVariationalELBO``) takes one CVI step of size
    ``step_size`` (eq. 13: the natural-gradient step, GPyTorch's NGD on whitened natural
    parameters), so GPyTorch's training loop trains q; :class:`CVIOptimizer` takes the steps
    instead (with backtracking). Cost O(B M^2 + M^3) per batch of B points.

    **Data-site forms** (selected by ``num_data``, given by keyword or as the third positional
    argument, or by ``train_inputs``; the signature of earlier versions): one site per training
    point, updated only by :class:`CVIOptimizer` (a training forward pass without one warns).

    * Full (``inducing_points`` are the ``num_data`` training inputs): q(u) through
      ``B = I + W^1/2 K W^1/2`` (Rasmussen & Williams Alg. 3.2), stable when ``K`` is badly
      conditioned. O(N^3) per iteration.
    * Sparse (``M << N`` inducing points, ``train_inputs``, or the first full-batch
      :meth:`CVIOptimizer.step` registers them): the dual parameterisation of Adam et al.
      (2021), ``q(u) ∝ p(u) prod_n exp(lam1_n a_n^T u + lam2_n (a_n^T u)^2)``,
      ``a_n = K_ZZ^-1 k(Z, x_n)``; O(N M^2) per iteration, minibatchable sites,
      data-parallel (``process_group``).

    ``model(x)`` returns q(f(x)); the KL term of GPyTorch's mlls is the closed form of
    :meth:`kl_divergence`. Jitter (``jitter_val``, default
    ``gpytorch.settings.variational_cholesky_jitter``: 1e-6 in float64, 1e-4 in float32) is added
    to the predictive variances and to ``K_ZZ`` (not in the full form).

    :param model: the ``ApproximateGP`` that owns this strategy (its ``forward`` is the prior).
    :param inducing_points: ``[*batch, M, D]`` inducing inputs (data-site forms: ``M x D``; the
        training inputs for the full form).
    :param variational_distribution: a GPyTorch ``_VariationalDistribution`` (its batch shape
        and ``mean_init_std`` are used) or ``None``; an ``int`` here is ``num_data``.
    :param learn_inducing_locations: register ``inducing_points`` as a parameter (default
        ``True`` built the GPyTorch way, ``False`` for the data-site forms; not in the full form).
    :param num_data: data-site forms: number of training points ``N`` (one site each).
    :param train_inputs: ``N x D`` training inputs; selects the sparse data-site form.
    :param jitter_val: diagonal jitter, see above.
    :param process_group: data-parallel CVI (sparse data-site form only): ``WORLD``
        (:data:`pyro_cvi.scale.distributed.WORLD`) or a ``torch.distributed`` group;
        ``num_data`` and ``train_inputs`` are then this rank's shard. See :class:`CVIOptimizer`.
    :param step_size: ``beta`` of the step taken in ``loss.backward()`` (GPyTorch-way only).
    :param lengthscale_search: GPyTorch-way, one GP: the first CVI step also moves every learnable
        lengthscale by the factor ``2^k`` that maximises the bound with the likelihood's sites
        held fixed (:mod:`~pyro_cvi.contrib.gpytorch.lengthscale_search`; the move is in
        ``lengthscale_move``), so that training does not stall on the long-lengthscale plateau.
    """

    def __init__(
        self,
        model: ApproximateGP,
        inducing_points: Tensor,
        variational_distribution: Union[_VariationalDistribution, int, None] = None,
        learn_inducing_locations: Optional[bool] = None,
        *,
        num_data: Optional[int] = None,
        train_inputs: Optional[Tensor] = None,
        jitter_val: Optional[float] = None,
        process_group=None,
        step_size: float = 0.5,
        lengthscale_search: bool = True,
    ):
        if isinstance(variational_distribution, (int, float)) or torch.is_tensor(
            variational_distribution
        ):
            if num_data is not None:
                raise TypeError("num_data given twice (positionally and by keyword).")
            num_data, variational_distribution = variational_distribution, None
        if num_data is None and train_inputs is not None:
            num_data = train_inputs.shape[-2] if train_inputs.dim() > 1 else train_inputs.shape[0]
        if inducing_points.dim() == 1:
            inducing_points = inducing_points.unsqueeze(-1)
        self.inducing_form = num_data is None
        if self.inducing_form:
            dist, learn = variational_distribution, learn_inducing_locations
            self._init_inducing(model, inducing_points, dist, learn, jitter_val)
            if process_group is not None:
                raise ValueError(
                    "data-parallel CVI (process_group) needs the data-site sparse form: pass "
                    "num_data= and train_inputs= (this rank's rows)."
                )
            self._inducing_init(step_size, lengthscale_search)
            return
        learn = bool(learn_inducing_locations)
        self._init_data_sites(model, inducing_points, int(num_data), learn, train_inputs)
        if jitter_val is not None:
            self.jitter_val = jitter_val
        self.set_process_group(process_group)

    def _init_data_sites(self, model, inducing_points, num_data, learn, train_inputs) -> None:
        is_full, train_inputs = check_data_site_args(inducing_points, num_data, learn, train_inputs)
        sites = CVISites(num_data, dtype=inducing_points.dtype, device=inducing_points.device)
        super().__init__(model, inducing_points, sites, learn)
        self.num_data = num_data
        self.is_full = is_full
        site_inputs = None if train_inputs is None else train_inputs.detach().clone()
        self.register_buffer("site_inputs", site_inputs)
        self._site_version = 0
        self.site_inputs_version = 0  # bumped by set_site_inputs (read by the optimizer)
        self._cache: Optional[_Cache] = None
        self._prior_cache = None
        self.reducer: Optional[Reducer] = None
        #: set by :class:`CVIOptimizer`; the data-site form has no other way to update q
        self.stepped_by_optimizer = False
        self._warned = False

    def _warn_untrained(self) -> None:
        if not (self._warned or bool(self.site_lam2.any()) or bool(self.site_lam1.any())):
            self._warned = True
            store.warn_untrained()

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
        if self.inducing_form:
            if indices is not None:
                raise ValueError("the inducing-site form has no per-point sites (indices=None).")
            top = torch.linalg.eigvalsh(0.5 * (lam2 + lam2.mT)).amax(-1)
            tol = 100 * lam2.shape[-1] * torch.finfo(lam2.dtype).eps
            if bool((top > tol * lam2.abs().amax().clamp_min(1.0)).any()):
                raise ValueError("site lam2 must be negative semidefinite.")
        elif torch.any(lam2 > 0):
            raise ValueError("site lam2 must be <= 0 (site precision W = -2 lam2 >= 0).")
        sums = self._current_sums(indices)
        old = None if sums is None else (self.site_lam1[indices], self.site_lam2[indices])
        write_sites((self.site_lam1, self.site_lam2), lam1, lam2, indices)
        self._site_version += 1
        self._cache = None
        if sums is not None:  # O(B M^2) instead of O(N M^2) at the next step
            with torch.no_grad():
                sums.update(indices, old, (self.site_lam1[indices], self.site_lam2[indices]))
            sums.version = self._site_version

    def _current_sums(self, indices) -> Optional[SiteSums]:
        """The sparse form's running sums, if up to date and ``indices`` can update them."""
        c = self._prior_cache
        if c is None or self.is_full:
            return None
        return SiteSums.updatable(c[1].get("sums"), self._site_version, indices)

    def reset_sites(self) -> None:
        """Set every site to zero, so that q = prior."""
        self.set_sites(torch.zeros_like(self.site_lam1), torch.zeros_like(self.site_lam2))

    def set_site_inputs(self, train_inputs: Tensor) -> None:
        """Register the ``N x D`` training inputs that carry the sites (sparse form only)."""
        if self.inducing_form:
            raise ValueError("the inducing-site form's sites live on the inducing values.")
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
        self.site_inputs_version += 1
        self._clear_cache()

    def pseudo_observations(self) -> Tuple[Tensor, Tensor]:
        """The GP-regression view of the data sites: targets ``lam1 / W``, noise ``1 / W``
        (``W = -2 lam2``; an empty site has noise ``inf`` and target 0)."""
        return store.pseudo_observations(self.site_lam1, self.site_lam2)

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
        state["_step_cache"] = None  # leaves with a backward hook
        return state

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a model built without train_inputs has no site_inputs buffer yet: make room for it
        self.load_gpytorch_q(state_dict, prefix)  # a state dict saved by GPyTorch's strategies
        key = prefix + "site_inputs"
        if key in state_dict and self.site_inputs is None and not self.inducing_form:
            self.site_inputs = torch.empty_like(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._site_version += 1
        self.site_inputs_version += 1
        self._clear_cache()

    def _clear_cache(self) -> None:
        self._cache = None
        self._prior_cache = None
        self._step_cache = None
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
        key = [self.site_inputs_version] + self.state_key()[1:]
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
        sums = None
        if not torch.is_grad_enabled() and lam1.shape[-1] > 0:  # cached blocks: reuse Phi
            sums = b.get("sums")
            if sums is None:
                sums = b["sums"] = SiteSums(
                    b["K_ZZ"], b["K_ZX"], b["prior_mean_X"], lam1, lam2, self._site_version
                )
            elif sums.version != self._site_version or sums.updates >= sums.REFRESH:
                sums.refresh(lam1, lam2, self._site_version)
        post = SparseSitePosterior(
            b["K_ZZ"], b["K_ZX"], b["prior_mean_X"], lam1, lam2, reduce=self.reducer, sums=sums
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
    def variational_distribution(self) -> MultivariateNormal:
        """q(u), dense (``M x M``, or ``N x N`` for the full form); built from the sites."""
        if self.inducing_form:
            return self._inducing_variational_distribution()
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
        if self.inducing_form:
            return self._q_tensors()[2]
        post, _ = self._posterior()
        return post.kl()

    def site_marginals(self, indices: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """Mean and variance of q(f_n) at the sites' inputs (all, or ``indices``), no graph.

        The variance includes the jitter, as in :meth:`__call__`, so the CVI gradients are
        taken at the same marginals as the ELBO that ``VariationalELBO`` reports.
        """
        if self.inducing_form:
            raise ValueError("the inducing-site form has no per-point sites.")
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
                idx = slice(None) if indices is None else indices  # the batch's marginals only
                kxx, m0 = extras["kxx_diag"][..., idx], extras["prior_mean_X"][..., idx]
                mean, var = post.marginals(post.Phi[..., idx], kxx, m0)
            if indices is not None and self.is_full:
                mean, var = mean[..., indices], var[..., indices]
            var = var.clamp_min(0.0) + self.jitter
        return mean.detach(), var.detach()

    # -------------------------------------------------------------- predict
    def _same_inputs(self, x: Tensor, ref: Optional[Tensor]) -> bool:
        return ref is not None and x.shape == ref.shape and torch.equal(x, ref)

    def forward(self, x: Tensor, diag: bool = True, **kwargs) -> MultivariateNormal:
        if self.inducing_form:
            return self._inducing_forward(x, diag)
        if self.training and torch.is_grad_enabled() and not self.stepped_by_optimizer:
            self._warn_untrained()
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
        if not self.variational_params_initialized.item():
            if self.inducing_form:  # data sites start at zero (q = prior)
                self._variational_distribution.initialize_variational_distribution(None)
                self._site_version += 1
            self.variational_params_initialized.fill_(1)
        if x.dim() == 1:
            x = x.unsqueeze(-1)
        self._check_input_shape(x)
        if self.inducing_form or x.dim() == 2:
            return self.forward(x, diag=diag, **kwargs)
        return self._batched_forward(x, diag, **kwargs)
