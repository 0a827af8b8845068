"""The per-family natural-gradient steps of a Gaussian (diagonal, Cholesky, low rank).

They live in :mod:`pyro_cvi.gaussian.steps` and :mod:`pyro_cvi.gaussian.lowrank` (one Gaussian
natural-gradient implementation for the whole package); this module keeps their old import
path.
"""

from ..gaussian.lowrank import lowrank_fisher_mv, lowrank_step
from ..gaussian.steps import MEAN_MAX_MOVE, chol_grad_to_cov_grad, diag_step, tril_step

__all__ = [
    "MEAN_MAX_MOVE",
    "chol_grad_to_cov_grad",
    "diag_step",
    "tril_step",
    "lowrank_fisher_mv",
    "lowrank_step",
]
