"""Loading a state dict saved with GPyTorch's own strategies into a :class:`CVIVariationalStrategy`.

GPyTorch stores q(u) as ``variational_mean`` and ``chol_variational_covar``
(``CholeskyVariationalDistribution``) or ``variational_stddev`` (mean-field):

* ``VariationalStrategy`` (with its ``updated_strategy`` flag set): whitened, ``q(v) = N(m, S)``;
* ``UnwhitenedVariationalStrategy``, or a ``VariationalStrategy`` saved by GPyTorch < 1.0 (no
  flag): ``q(u) = N(m_u, S_u)``, whitened here with the model's prior once its hyperparameters
  are loaded (at the first use of q), ``m = L_Z^-1 (m_u - m0(Z))``, ``S = L_Z^-1 S_u L_Z^-T``.

The sites with that q(v) are (Khan & Lin 2017, eq. 14, prior ``N(0, I)``)::

    B = S^-1 = I - 2 lam2,      lam1 = B m.

Sites have ``lam2`` negative semidefinite, i.e. ``S <= I``. A q(v) wider than the prior in some
direction (possible for a q fitted by gradients) has no such sites: those eigenvalues of ``lam2``
are clipped at 0 (S's at 1) and ``lam1 = B m`` keeps the mean, with a warning.
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch
from gpytorch.utils.warnings import OldVersionWarning
from torch import Tensor

from .inducing import nsd_projection
from .posterior import safe_cholesky

__all__ = [
    "SavedStateForm",
    "gpytorch_state_to_sites",
    "sites_from_unwhitened",
    "sites_from_whitened",
]

_MEAN = "_variational_distribution.variational_mean"
_CHOL = "_variational_distribution.chol_variational_covar"
_STD = "_variational_distribution.variational_stddev"
_FLAG = "updated_strategy"


def sites_from_whitened(m: Tensor, S: Tensor) -> Tuple[Tensor, Tensor, int]:
    """``(lam1, lam2)`` of q(v) = N(m, S) (module docstring) and how many batch elements had
    ``S`` wider than the prior (clipped)."""
    M = m.shape[-1]
    eye = torch.eye(M, dtype=m.dtype, device=m.device)
    L = safe_cholesky(0.5 * (S + S.mT), "the saved variational covariance S")
    prec = torch.cholesky_solve(eye.expand_as(S), L)
    lam2, clipped = nsd_projection(0.5 * (eye - prec))
    lam1 = ((eye - 2.0 * lam2) @ m.unsqueeze(-1)).squeeze(-1)
    return lam1, lam2, clipped


def _saved_q(state_dict: dict, prefix: str) -> Optional[Tuple[Tensor, Tensor]]:
    """The saved ``(mean, covariance)``, popped from ``state_dict``; None if not GPyTorch's."""
    if prefix + _MEAN not in state_dict:
        return None
    mean = state_dict.pop(prefix + _MEAN)
    if prefix + _CHOL in state_dict:
        chol = state_dict.pop(prefix + _CHOL).tril()
        return mean, chol @ chol.mT
    if prefix + _STD in state_dict:
        return mean, torch.diag_embed(state_dict.pop(prefix + _STD).pow(2))
    raise ValueError(
        f"state dict entry {prefix + _MEAN!r} comes from a GPyTorch variational distribution "
        "without a covariance (DeltaVariationalDistribution?): a point estimate has no CVI "
        "sites. Refit the model with CVIVariationalStrategy (or load it into GPyTorch's "
        "strategy)."
    )


def gpytorch_state_to_sites(strategy, state_dict: dict, prefix: str):
    """Rewrite a GPyTorch strategy's entries of ``state_dict`` (in place) as the sites of
    ``strategy`` (module docstring); a no-op for a state dict saved by the CVI strategy.

    :return: for an unwhitened q(u), ``(mean, covariance)`` to whiten once the hyperparameters
        are loaded (:func:`sites_from_unwhitened`); otherwise ``None``.
    """
    saved = _saved_q(state_dict, prefix)
    if saved is None:
        return None
    if not strategy.inducing_form:
        raise ValueError(
            "this state dict was saved with a GPyTorch strategy (variational_mean, "
            "chol_variational_covar): load it into CVIVariationalStrategy(model, inducing_points, "
            "variational_distribution) (sites on the inducing values), not the data-site form."
        )
    flag = state_dict.pop(prefix + _FLAG, None)
    lam1_key = prefix + "_variational_distribution.lam1"
    lam2_key = prefix + "_variational_distribution.lam2"
    like1, like2 = strategy.site_lam1, strategy.site_lam2
    mean, cov = (t.to(like1) for t in saved)
    if mean.shape != like1.shape or cov.shape != like2.shape:
        raise ValueError(
            f"the saved q(u) has mean shape {tuple(mean.shape)} but this strategy's sites have "
            f"{tuple(like1.shape)} (inducing points and batch shape must match)."
        )
    if flag is not None and bool(flag):  # whitened already
        lam1, lam2, clipped = sites_from_whitened(mean, cov)
        state_dict[lam1_key], state_dict[lam2_key] = lam1, lam2
        _warn_clipped(clipped)
        return None
    state_dict[lam1_key], state_dict[lam2_key] = torch.zeros_like(like1), torch.zeros_like(like2)
    warnings.warn(
        "CVIVariationalStrategy: loaded an unwhitened q(u) (saved by UnwhitenedVariationalStrategy "
        "or by a VariationalStrategy of an old GPyTorch version); it is converted to CVI sites at "
        "the first use, with the loaded hyperparameters. Re-save the model to store the sites.",
        OldVersionWarning,
        stacklevel=4,
    )
    return mean.clone(), cov.clone()


def sites_from_unwhitened(strategy, mean_u: Tensor, cov_u: Tensor) -> Tuple[Tensor, Tensor]:
    """The sites of q(u) = N(mean_u, cov_u), whitened with ``strategy``'s current prior."""
    with torch.no_grad():
        prior = strategy.model.forward(strategy.inducing_points)
        K = prior.lazy_covariance_matrix.to_dense()
        eye = torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
        L_Z = safe_cholesky(K + strategy.jitter * eye, "K_ZZ")
        m = torch.linalg.solve_triangular(L_Z, (mean_u - prior.mean).unsqueeze(-1), upper=False)
        half = torch.linalg.solve_triangular(L_Z, cov_u, upper=False)
        S = torch.linalg.solve_triangular(L_Z, half.mT, upper=False)
        lam1, lam2, clipped = sites_from_whitened(m.squeeze(-1), S)
    _warn_clipped(clipped)
    return lam1, lam2


def _warn_clipped(clipped: int) -> None:
    if clipped:
        warnings.warn(
            f"CVIVariationalStrategy: the loaded q(u) is wider than the prior in {clipped} batch "
            "element(s), which no CVI sites represent; those directions were set to the prior's "
            "variance (the mean is kept). A few CVI steps refit them.",
            RuntimeWarning,
            stacklevel=4,
        )


class SavedStateForm:
    """Loading GPyTorch's state dicts into :class:`CVIVariationalStrategy` (mixed into it)."""

    _pending_unwhitened: Optional[Tuple[Tensor, Tensor]] = None

    def load_gpytorch_q(self, state_dict: dict, prefix: str) -> None:
        """Convert GPyTorch's q(u) entries of ``state_dict`` (in place) to sites; an unwhitened
        q(u) is kept until the first use of q, when the hyperparameters are loaded."""
        pending = gpytorch_state_to_sites(self, state_dict, prefix)
        if pending is not None:
            self._pending_unwhitened = pending

    def _convert_pending(self) -> None:
        q_u, self._pending_unwhitened = self._pending_unwhitened, None
        self.set_sites(*sites_from_unwhitened(self, *q_u))
