"""Multi-class GP classification by CVI: K latent GPs with coupled K x K sites per point.

:class:`MultiClassCVIStrategy` holds one site ``(lam1_n [K], lam2_n [K, K])`` per training point
(buffers: ``O(N K^2)``) and builds q(u) of the K GPs in closed form
(:class:`~pyro_cvi.contrib.gpytorch.multiclass_posterior.MultiClassSitePosterior`). Unlike
GPflow / GPyTorch natural gradients, which step each latent function on its own, the sites
carry the cross-class curvature ``E[diag(p) - p p^T]`` of the softmax.
:class:`~pyro_cvi.contrib.gpytorch.multiclass_optim.MultiClassCVIOptimizer` updates the sites
with the expectations of :mod:`pyro_cvi.messages.softmax` (eq. 13 in K dimensions). ``model(x)``
returns a
``MultitaskMultivariateNormal`` (``n x K``, interleaved) whose covariance is block diagonal:
the K x K class covariance of each point; ``likelihood(model(x))`` predicts class
probabilities with ``gpytorch.likelihoods.SoftmaxLikelihood(num_classes=K,
mixing_weights=False)`` (Monte Carlo) or :class:`CategoricalLogitsLikelihood` (cubature).

The GP prior of the model must be a batch of K GPs: ``forward(x)`` is called with ``x`` of shape
``[K, n, D]`` and must return a ``MultivariateNormal`` of batch shape ``[K]`` (a kernel and mean
with ``batch_shape=torch.Size([K])``, or shared ones, which broadcast). Inducing points are
``[M, D]`` (shared) or ``[K, M, D]`` (one set per class); with ``M = N`` and no
``train_inputs`` they are the training inputs (the full GP). Hyperparameters are learned by
any torch optimizer on ``gpytorch.mlls.VariationalELBO`` after each CVI step, as in the binary
adapter.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from gpytorch.distributions import MultitaskMultivariateNormal
from gpytorch.likelihoods import Likelihood
from gpytorch.models import ApproximateGP
from gpytorch.variational import _VariationalDistribution
from gpytorch.variational._variational_strategy import _VariationalStrategy
from linear_operator.operators import BlockDiagLinearOperator
from torch import Tensor

from pyro_cvi.messages.softmax import lse_expectations

from .multiclass_posterior import MultiClassSitePosterior, shared_products
from .site_store import keys_equal, write_sites

__all__ = [
    "CategoricalLogitsLikelihood",
    "MultiClassCVISites",
    "MultiClassCVIStrategy",
]


class MultiClassCVISites(_VariationalDistribution):
    """Site buffers ``lam1 [N, K]``, ``lam2 [N, K, K]`` (negative semidefinite); zero: q = prior."""

    def __init__(self, num_sites: int, num_classes: int, dtype=None, device=None):
        super().__init__(num_inducing_points=num_sites)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        K = num_classes
        self.register_buffer("lam1", torch.zeros(num_sites, K, dtype=dtype, device=device))
        self.register_buffer("lam2", torch.zeros(num_sites, K, K, dtype=dtype, device=device))

    def initialize_variational_distribution(self, prior_dist) -> None:
        self.lam1.zero_()
        self.lam2.zero_()

    def forward(self):
        raise RuntimeError("MultiClassCVISites hold site parameters, not q(u).")


class MultiClassCVIStrategy(_VariationalStrategy):
    """K latent GPs with coupled CVI sites (module docstring).

    :param model: the ``ApproximateGP`` (its ``forward`` is the batch-``[K]`` prior).
    :param inducing_points: ``[M, D]`` shared or ``[K, M, D]`` per class.
    :param num_data: ``N``, one site per training point.
    :param num_classes: ``K``.
    :param learn_inducing_locations: let the hyperparameter optimizer move them (sparse only).
    :param train_inputs: ``[N, D]`` training inputs (the sparse form); omitted with ``M = N``
        shared inducing points: the full GP on those inputs.
    :param jitter_val: added to ``K_ZZ`` and to the predictive covariances.
    """

    def __init__(
        self,
        model: ApproximateGP,
        inducing_points: Tensor,
        num_data: int,
        num_classes: int,
        learn_inducing_locations: bool = False,
        *,
        train_inputs: Optional[Tensor] = None,
        jitter_val: Optional[float] = None,
    ):
        if inducing_points.dim() == 1:
            inducing_points = inducing_points.unsqueeze(-1)
        if inducing_points.dim() == 3 and inducing_points.shape[0] != num_classes:
            raise ValueError(
                f"per-class inducing points must be [K={num_classes}, M, D]; "
                f"got {tuple(inducing_points.shape)}"
            )
        self.is_full = (
            train_inputs is None
            and inducing_points.dim() == 2
            and inducing_points.shape[-2] == num_data
        )
        if self.is_full and learn_inducing_locations:
            raise ValueError("the full form's inducing points are the training inputs: not learned")
        if train_inputs is None and not self.is_full:
            raise ValueError("the sparse form needs train_inputs=X_train ([N, D]).")
        sites = MultiClassCVISites(
            num_data, num_classes, inducing_points.dtype, inducing_points.device
        )
        super().__init__(
            model, inducing_points, sites, learn_inducing_locations, jitter_val=jitter_val
        )
        self.num_data, self.num_classes = int(num_data), int(num_classes)
        x = None if train_inputs is None else train_inputs.detach().clone()
        if x is not None and x.dim() == 1:
            x = x.unsqueeze(-1)
        self.register_buffer("site_inputs", x)
        self._site_version = 0
        self._cache = None
        #: the kernel's part of q (blocks, ``L_Z``, ``Phi``), kept while the hyperparameters are
        #: unchanged: a CVI step moves the sites only
        self._kernel_cache = None

    # ------------------------------------------------------------------ sites
    @property
    def site_lam1(self) -> Tensor:
        return self._variational_distribution.lam1

    @property
    def site_lam2(self) -> Tensor:
        return self._variational_distribution.lam2

    def set_sites(self, lam1: Tensor, lam2: Tensor, indices: Optional[Tensor] = None) -> None:
        """Overwrite the sites (all, or those at ``indices``); ``lam2`` must be NSD and finite."""

        def nsd(lam2: Tensor) -> None:
            # no eigenvalue of lam2 above tol  <=>  -lam2 + tol I is positive definite; tol covers
            # the round-off that the targets' NSD projection leaves (K eps relative)
            K = lam2.shape[-1]
            rel = max(1e-8, 2 * K * torch.finfo(lam2.dtype).eps)
            tol = rel * (1 + float(lam2.abs().amax()))
            eye = torch.eye(K, dtype=lam2.dtype, device=lam2.device)
            info = torch.linalg.cholesky_ex(tol * eye - 0.5 * (lam2 + lam2.mT)).info
            if bool((info != 0).any()):
                raise ValueError("site lam2 must be negative semidefinite (W = -2 lam2 >= 0).")

        write_sites((self.site_lam1, self.site_lam2), lam1, lam2, indices, check=nsd)
        self._site_version += 1
        self._cache = None

    def site_bytes(self) -> int:
        """Memory of the site parameters in bytes (``N (K + K^2)`` numbers)."""
        return sum(t.numel() * t.element_size() for t in (self.site_lam1, self.site_lam2))

    # ------------------------------------------------------------------ q
    @property
    def jitter(self) -> float:
        return self.jitter_val

    def _Z(self) -> Tensor:
        Z, K = self.inducing_points, self.num_classes
        return Z.expand(K, *Z.shape) if Z.dim() == 2 else Z

    def _batch(self, x: Tensor) -> Tensor:
        return x.expand(self.num_classes, *x.shape)

    def _blocks(self) -> dict:
        Z = self._Z()
        M = Z.shape[-2]
        eye = torch.eye(M, dtype=Z.dtype, device=Z.device)
        if self.is_full:
            prior = self.model.forward(Z)
            K_XX = prior.lazy_covariance_matrix.to_dense()
            mean = prior.mean.expand(self.num_classes, M)
            return {"K_ZZ": K_XX + self.jitter * eye, "K_ZX": K_XX, "mean_Z": mean, "mean_X": mean,
                    "kxx": K_XX.diagonal(dim1=-2, dim2=-1)}  # fmt: skip
        joint = self.model.forward(torch.cat([Z, self._batch(self.site_inputs)], -2))
        cov = joint.lazy_covariance_matrix
        mean = joint.mean.expand(self.num_classes, joint.mean.shape[-1])
        return {
            "K_ZZ": cov[..., :M, :M].to_dense() + self.jitter * eye,
            "K_ZX": cov[..., :M, M:].to_dense(),
            "kxx": cov[..., M:, M:].diagonal(dim1=-2, dim2=-1),
            "mean_Z": mean[..., :M],
            "mean_X": mean[..., M:],
        }

    def _key(self):
        return [self._site_version] + self.hyper_key()

    def hyper_key(self) -> list:
        """Copies of the hyperparameters and inducing points (and the site inputs): steps are
        comparable (and backtracking applies) only while these are unchanged."""
        key = [p.detach().clone() for p in self.model.parameters()]
        if not isinstance(self.inducing_points, torch.nn.Parameter):  # a buffer, not above
            key.append(self.inducing_points.detach().clone())
        if self.site_inputs is not None:
            key.append(self.site_inputs.clone())
        return key

    @staticmethod
    def hyper_keys_equal(a: list, b: list) -> bool:
        return keys_equal([0] + a, [0] + b)

    def posterior(self, force: bool = False) -> Tuple[MultiClassSitePosterior, dict]:
        """q from the current sites, cached while the sites and hyperparameters are unchanged
        (a cached q with a graph serves the KL term of the same ELBO evaluation)."""
        key, c = self._key(), self._cache
        grad = torch.is_grad_enabled()
        if not force and c is not None and (c[3] or not grad) and keys_equal(c[0], key):
            return c[1], c[2]
        hyper, kc = [0] + key[1:], self._kernel_cache
        # reused without a graph only: a graph kept across site steps may have been freed
        if not (force or grad) and kc is not None and keys_equal(kc[0], hyper):
            b, whitened, products = kc[1], kc[2], kc[3]
        else:
            b = self._blocks()
            whitened = MultiClassSitePosterior.whitening(b["K_ZZ"], b["K_ZX"])
            products = shared_products(whitened[1])  # None with a graph or per-class phi
            self._kernel_cache = (hyper, b, whitened, products)
        post = MultiClassSitePosterior(
            b["K_ZZ"], b["K_ZX"], b["mean_X"], self.site_lam1, self.site_lam2,
            whitened=whitened, products=products,
        )  # fmt: skip
        self._cache = (key, post, b, grad)
        return post, b

    def site_marginals(self, indices: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """Mean ``[n, K]`` and covariance ``[n, K, K]`` of q(f(x_n)) at the sites (no graph)."""
        with torch.no_grad():
            post, b = self.posterior()
            Phi, mean, kxx, Psi = post.Phi, b["mean_X"], b["kxx"], post.Psi
            if indices is not None:
                Phi, mean, kxx = Phi[..., indices], mean[..., indices], kxx[..., indices]
                Psi = None if Psi is None else Psi[:, indices]
            m, S = post.predict(Phi, mean, kxx, products=Psi)
            eye = torch.eye(self.num_classes, dtype=S.dtype, device=S.device)
        return m, S + self.jitter * eye

    @property
    def prior_distribution(self):
        return self.model.forward(self._Z())

    @property
    def variational_distribution(self) -> MultitaskMultivariateNormal:
        """q(u) of the ``K x M`` inducing values, classes coupled: a ``MultitaskMultivariateNormal``
        with mean ``[M, K]`` (one task per class) and the joint ``[K M, K M]`` covariance in
        class-major order (``interleaved=False``), jitter added."""
        post, b = self.posterior()
        mean, cov = post.q_u(b["mean_Z"])
        eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
        cov = 0.5 * (cov + cov.mT) + self.jitter * eye
        return MultitaskMultivariateNormal(mean.mT, cov, interleaved=False)

    def kl_divergence(self) -> Tensor:
        return self.posterior()[0].kl()

    def forward(self, x: Tensor, **kwargs) -> MultitaskMultivariateNormal:
        post, b = self.posterior(force=self.training and torch.is_grad_enabled())
        sites = self.inducing_points if self.is_full else self.site_inputs
        Psi = None
        if sites is not None and x.shape == sites.shape and torch.equal(x, sites):
            Phi, mean_x, kxx, Psi = post.Phi, b["mean_X"], b["kxx"], post.Psi
        else:
            Z = self._Z()
            M = Z.shape[-2]
            joint = self.model.forward(torch.cat([Z, self._batch(x)], -2))
            cov = joint.lazy_covariance_matrix
            Phi = post.whiten(cov[..., :M, M:].to_dense())
            mean_x = joint.mean.expand(self.num_classes, joint.mean.shape[-1])[..., M:]
            kxx = cov[..., M:, M:].diagonal(dim1=-2, dim2=-1)
        mean, S = post.predict(Phi, mean_x, kxx, products=Psi)
        eye = torch.eye(self.num_classes, dtype=S.dtype, device=S.device)
        return MultitaskMultivariateNormal(
            mean, BlockDiagLinearOperator(S + self.jitter * eye), interleaved=True
        )

    def __call__(self, x: Tensor, prior: bool = False, **kwargs) -> MultitaskMultivariateNormal:
        if prior:
            return self.model.forward(x, **kwargs)
        self.variational_params_initialized.fill_(1)  # sites start at zero (q = prior)
        if x.dim() != 2:
            raise NotImplementedError(f"expected inputs of shape n x D; got {tuple(x.shape)}")
        return self.forward(x, **kwargs)


def class_blocks(f: MultitaskMultivariateNormal) -> Tuple[Tensor, Tensor]:
    """Mean ``[n, K]`` and per-point class covariances ``[n, K, K]`` of an interleaved
    multitask normal (block diagonal, as the strategy returns, or dense)."""
    mean = f.mean
    n, K = mean.shape[-2:]
    cov = f.lazy_covariance_matrix
    if isinstance(cov, BlockDiagLinearOperator) and cov.base_linear_op.shape[-1] == K:
        return mean, cov.base_linear_op.to_dense()
    dense = cov.to_dense().reshape(n, K, n, K)
    idx = torch.arange(n, device=mean.device)
    return mean, dense[idx, :, idx, :]


class CategoricalLogitsLikelihood(Likelihood):
    """``y ~ Categorical(logits = f)`` with deterministic expectations
    (:mod:`pyro_cvi.messages.softmax`).

    ``expected_log_prob`` is the cubature (``method``: ``"cubature"``, ``"mc"``, ``"bound"``)
    estimate of ``E[log softmax(f)_y]`` per point, differentiable in the hyperparameters;
    ``likelihood(f_dist)`` is ``Categorical(probs = E[softmax(f)])`` by the same rule.
    """

    def __init__(self, num_classes: int, method: str = "cubature"):
        super().__init__()
        self.num_classes, self.method = int(num_classes), method

    def forward(self, function_samples: Tensor, *args: Any, **kwargs: Any):
        return torch.distributions.Categorical(logits=function_samples)

    def expected_log_prob(self, observations: Tensor, function_dist, *args: Any, **kwargs: Any):
        mean, cov = class_blocks(function_dist)
        mom = lse_expectations(mean, cov, self.method)
        own = mean.gather(-1, observations.long().unsqueeze(-1)).squeeze(-1)
        return own - mom.value

    def marginal(self, function_dist, *args: Any, **kwargs: Any):
        mean, cov = class_blocks(function_dist)
        probs = lse_expectations(mean.detach(), cov.detach(), self.method).grad
        return torch.distributions.Categorical(probs=probs)
