"""The Gaussian's mathematics, once, for every part of the package.

A bottom layer: it imports only torch, numpy (for Gauss-Hermite nodes), :mod:`pyro_cvi.linalg`
and itself. Everything that steps, solves or scores a Gaussian ``q = N(m, S)`` by CVI (Khan &
Lin 2017) uses it: AutoCVI's Gaussian, Markov and remainder blocks, ``CVI()`` on Pyro's own
Gaussian guides (:mod:`pyro_cvi.natgrad` maps a guide's parameters to these steps), streaming,
and the GPyTorch optimizers.

* :mod:`.sites`: a Gaussian site ``exp(lam1 eta + lam2 eta^2)`` as a regression row
  ``(w, b) = (-2 lam2, lam1 + 2 lam2 c)`` and back (eq. 13, Appendix E.1);
* :mod:`.conversions`: natural, mean and moment parameters through Cholesky factors;
* :mod:`.price`: Bonnet's and Price's theorems and the chain rule to the mean parameters
  (eqs. 29-31), Stein's lemma for the Hessian from gradients;
* :mod:`.quadrature`: Gauss-Hermite nodes and expectations under a scalar Gaussian;
* :mod:`.retraction`: the positive-definite step of Lin, Schmidt & Khan (2020);
* :mod:`.halving`: the one step-halving policy (also the plain CVI update's, eq. 12);
* :mod:`.steps`, :mod:`.lowrank`: the natural-gradient steps of a full, diagonal and
  low-rank-plus-diagonal Gaussian from the loss gradients (eqs. 10-13).
"""

from .conversions import (
    centred_exp_mean,
    diagonal_moments_from_natural,
    diagonal_natural_from_moments,
    loc_from_natural,
    log_partition,
    mean_params,
    moments_from_mean_params,
    moments_from_natural,
    mvn_draw,
    natural_from_moments,
    precision_from_scale_tril,
    scale_tril_from_precision,
    symmetrise,
    tril_log_prob,
)
from .halving import MAX_HALVINGS, MAX_HALVINGS_SOLVE, halve_until_valid
from .lowrank import lowrank_fisher_mv, lowrank_step
from .price import (
    bonnet_mean_gradient,
    expected_hessian,
    mean_param_gradients,
    price_precision_gradient,
    price_target,
    site_natural_params,
    site_natural_params_multivariate,
    stein_hessian,
)
from .quadrature import expected_log_prob, gauss_hermite
from .retraction import retract, retract_diagonal, retraction_target
from .sites import pseudo_observations, row_to_site, site_to_row, site_to_row_multivariate
from .steps import MEAN_MAX_MOVE, chol_grad_to_cov_grad, diag_step, tril_step

__all__ = [
    "MAX_HALVINGS",
    "MAX_HALVINGS_SOLVE",
    "MEAN_MAX_MOVE",
    "bonnet_mean_gradient",
    "chol_grad_to_cov_grad",
    "diag_step",
    "diagonal_moments_from_natural",
    "diagonal_natural_from_moments",
    "expected_hessian",
    "expected_log_prob",
    "gauss_hermite",
    "halve_until_valid",
    "loc_from_natural",
    "log_partition",
    "lowrank_fisher_mv",
    "lowrank_step",
    "mean_param_gradients",
    "mean_params",
    "moments_from_mean_params",
    "moments_from_natural",
    "natural_from_moments",
    "precision_from_scale_tril",
    "price_precision_gradient",
    "price_target",
    "pseudo_observations",
    "retract",
    "retract_diagonal",
    "retraction_target",
    "row_to_site",
    "scale_tril_from_precision",
    "site_natural_params",
    "site_natural_params_multivariate",
    "site_to_row",
    "site_to_row_multivariate",
    "stein_hessian",
    "symmetrise",
    "tril_log_prob",
    "centred_exp_mean",
    "mvn_draw",
    "tril_step",
]
