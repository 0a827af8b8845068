"""Fantasy models (``model.get_fantasy_model(x, y)``) from the CVI sites.

GPyTorch conditions a variational GP on new observations by the online variational conditioning
of Maddox, Stanton & Wilson (2021): q(u) is written as the exact posterior of the prior ``p(u)``
under Gaussian *pseudo-observations* ``u~ ~ N(u, Sigma~)`` of the inducing values, and the new
points are added to that exact GP. For GPyTorch's own strategies the pseudo-observations are
recovered from q's mean and covariance by a regularised inversion. The CVI sites *are* these
pseudo-observations (Khan & Lin 2017, eq. 14): the site ``exp(lam1^T v + v^T lam2 v)`` on the
whitened ``v`` (``u = m0(Z) + L_Z v``) is a Gaussian observation of ``v`` with precision
``W = -2 lam2`` and value ``W^-1 lam1``, so, in ``u``::

    Sigma~ = L_Z W^-1 L_Z^T,        u~ - m0(Z) = L_Z W^-1 lam1.

The exact GP on ``Z`` with these observations has posterior precision ``I + W = B`` and mean
``B^-1 lam1`` in ``v``: q(u) exactly. ``W`` may be singular (an uninformative site direction, e.g.
before the first step); ``W + jitter I`` is inverted instead, which gives those directions a
pseudo-variance of ``1 / jitter`` (no information).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from gpytorch.likelihoods import GaussianLikelihood
from gpytorch.models import ExactGP
from gpytorch.utils.memoize import add_to_cache, clear_cache_hook
from torch import Tensor
from torch.nn import Module

from .posterior import safe_cholesky

__all__ = ["FantasyForm"]


class FantasyForm:
    """``pseudo_points`` and ``get_fantasy_model`` for :class:`CVIVariationalStrategy` (mixed into
    it; module docstring). Inducing-site form only."""

    @property
    def pseudo_points(self) -> Tuple[Tensor, Tensor]:
        """``(Sigma~, u~ - m0(Z))``: the sites as Gaussian pseudo-observations of ``u`` (module
        docstring), shapes ``[*batch, M, M]`` and ``[*batch, M, 1]``, as GPyTorch's strategies
        give them to ``amortized_exact_gp``."""
        if not self.inducing_form:
            raise NotImplementedError(self._no_fantasy_message())
        self.whitened_q()  # (converts a loaded GPyTorch q(u) first)
        with torch.no_grad():
            d = self._variational_distribution
            lam1, lam2 = d.lam1, d.lam2
            M = lam1.shape[-1]
            eye = torch.eye(M, dtype=lam1.dtype, device=lam1.device)
            W = -(lam2 + lam2.mT) + self.jitter * eye
            L_W = safe_cholesky(W, "the site precision W = -2 lam2 (plus jitter)")
            D = torch.cholesky_solve(eye.expand_as(W), L_W)
            target = torch.cholesky_solve(lam1.unsqueeze(-1), L_W)
            prior = self.model.forward(self.inducing_points)
            L_Z = safe_cholesky(self._kzz(prior.lazy_covariance_matrix.to_dense()), "K_ZZ")
            covar = L_Z @ D @ L_Z.mT
            return 0.5 * (covar + covar.mT), L_Z @ target

    def _no_fantasy_message(self) -> str:
        return (
            "CVIVariationalStrategy: get_fantasy_model needs the strategy built the GPyTorch way, "
            "CVIVariationalStrategy(model, inducing_points, variational_distribution) (sites on "
            "the inducing values); the data-site form (num_data=...) keeps one site per training "
            "point. Build the model that way, or refit an ExactGP on the old and new data."
        )

    def get_fantasy_model(
        self,
        inputs: Tensor,
        targets: Tensor,
        mean_module: Optional[Module] = None,
        covar_module: Optional[Module] = None,
        **kwargs,
    ) -> ExactGP:
        """An ``ExactGP`` conditioned on the pseudo-observations of the sites and on
        ``(inputs, targets)`` (GPyTorch's online variational conditioning; module docstring).

        Needs a Gaussian ``model.likelihood`` (as GPyTorch's strategies do), and ``mean_module``
        and ``covar_module`` given here or as attributes of the model.
        """
        if not self.inducing_form:
            raise NotImplementedError(self._no_fantasy_message())
        likelihood = getattr(self.model, "likelihood", None)
        if not isinstance(likelihood, GaussianLikelihood):
            raise NotImplementedError(
                "get_fantasy_model conditions on Gaussian observations: set model.likelihood to "
                f"the model's GaussianLikelihood first (got {type(likelihood).__name__}), as "
                "GPyTorch's strategies require."
            )
        for name, module in (("mean_module", mean_module), ("covar_module", covar_module)):
            if module is None and getattr(self.model, name, None) is None:
                raise ModuleNotFoundError(  # (GPyTorch's strategies raise this type too)
                    f"get_fantasy_model needs the prior's {name}: pass {name}= or give the "
                    f"model a {name} attribute."
                )
        clear_cache_hook(self)  # the sites may have changed since the last call
        exact = self.amortized_exact_gp(mean_module=mean_module, covar_module=covar_module)
        fantasy = exact.get_fantasy_model(inputs, targets, **kwargs)
        strategy = fantasy.prediction_strategy
        with torch.no_grad():  # the pseudo-observations have no noise: redo the mean cache
            offset = strategy.train_labels - fantasy.mean_module(*fantasy.train_inputs)
            mean_cache = strategy.lik_train_train_covar.solve(offset.unsqueeze(-1)).squeeze(-1)
        add_to_cache(strategy, "mean_cache", mean_cache)
        return fantasy
