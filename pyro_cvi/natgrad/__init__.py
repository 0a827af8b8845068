"""Natural gradients for Pyro's own Gaussian guides.

``CVI()`` steps ``AutoNormal``, ``AutoDiagonalNormal``, ``AutoMultivariateNormal``,
``AutoLowRankMultivariateNormal`` and hand-written ``Normal`` / ``MultivariateNormal`` guides of
``pyro.param`` loc and scale (or scale_tril) by CVI's mirror-descent step (Khan & Lin 2017,
eqs. 10-13), computed from the gradients any Pyro ELBO (``Trace_ELBO``, ``TraceMeanField_ELBO``,
``TraceEnum_ELBO``, ``TraceGraph_ELBO``) wrote into those parameters.

* :mod:`.roles`: which parameters form which Gaussian (param names and constraints);
* :mod:`.params`: constrained values and gradients of a parameter, and writing it back;
* :mod:`pyro_cvi.gaussian`: the per-family steps (diagonal, Cholesky, low rank), pure maths,
  shared with AutoCVI's blocks (:mod:`.steps` keeps their old import path);
* :mod:`.control`: the adaptive step size under Monte Carlo noise;
* :mod:`.stepper`: all of the above for the optimizer.
"""

from ..gaussian import chol_grad_to_cov_grad, diag_step, lowrank_fisher_mv, lowrank_step, tril_step
from .roles import GaussianGroup, find_gaussians
from .stepper import FORMS, GaussianStepper

__all__ = [
    "FORMS",
    "GaussianGroup",
    "GaussianStepper",
    "chol_grad_to_cov_grad",
    "diag_step",
    "find_gaussians",
    "lowrank_fisher_mv",
    "lowrank_step",
    "tril_step",
]
