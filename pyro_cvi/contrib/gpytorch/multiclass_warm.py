"""A cheap start for the coupled multi-class sites: CVI in the family of tied-curvature sites.

From empty sites (q = the prior) the coupled step of
:class:`~pyro_cvi.contrib.gpytorch.multiclass_optim.MultiClassCVIOptimizer` sees the prior's
wide marginals and has to be damped. When the K classes share ``phi_n`` (one kernel, shared
inducing inputs), sites whose curvature is one matrix up to a scale per point::

    W_n = -2 lam2_n = w_n C,   C = I - 1 1^T / K   (w_n >= 0; the softmax's E[H] has C's null
                                                     vector 1),

keep the precision a Kronecker product, ``P = I + C (x) G_w``, ``G_w = sum_n w_n phi_n phi_n^T
= U diag(l) U^T`` (one ``M x M`` eigendecomposition), so q is in closed form without the
``K M x K M`` Gram and its factorisation::

    P^-1 = (1 1^T / K) (x) I + C (x) A,   A = (I + G_w)^-1 = U diag(d) U^T,  d = 1 / (1 + l),
    m_v = A (H - hbar 1^T) + hbar 1^T,    H = [h_1 .. h_K] = sum_n phi_n r_n^T,
    Cov f(x_n) = diag(k_nn - |phi_n|^2) + |phi_n|^2 1 1^T / K + (phi_n^T A phi_n) C,
    KL = (M + (K - 1) sum d + |m_v|^2 - K M + (K - 1) sum log(1 + l)) / 2,

``r_n = lam1_n - W_n m(x_n)``, ``hbar`` the mean of the columns of ``H``. Each iteration takes
the coupled targets ``(lam1*, lam2*)`` at this q and projects them onto the family (Frobenius):
``w*_n = tr(W*_n C) / (K - 1)``, ``lam1_n = lam1*_n - (W*_n - w*_n C) m_n`` (the linear part
of the same quadratic expansion at the mean). Cost ``O(N M^2 + M^3)`` plus the estimator, a
small part of one coupled step at ``K = 10``. Steps are guarded: one whose q has a larger
-ELBO than the last is undone and the phase ends.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["tied_posterior", "tied_start"]


def tied_posterior(
    Phi: Tensor, kxx: Tensor, mean_X: Tensor, lam1: Tensor, w: Tensor, jitter: float = 0.0
) -> Tuple[Tensor, Tensor, Tensor]:
    """q of the sites ``(lam1 [N, K], lam2_n = -w_n C / 2)`` for a shared ``Phi [M, N]``:
    the site marginals' mean ``[N, K]`` and covariance ``[N, K, K]`` (``jitter`` added to the
    diagonal) and ``KL[q(v) || N(0, I)]`` (module docstring). ``kxx``, ``mean_X``: ``[K, N]``."""
    M, K = Phi.shape[0], lam1.shape[-1]
    eye = torch.eye(K, dtype=Phi.dtype, device=Phi.device)
    J = torch.full((K, K), 1.0 / K, dtype=Phi.dtype, device=Phi.device)
    C = eye - J
    l, U = torch.linalg.eigh((Phi * w) @ Phi.mT)
    l = l.clamp_min(0)
    d = 1.0 / (1.0 + l)
    r = lam1 - w.unsqueeze(-1) * (mean_X.mT @ C)
    H = Phi @ r  # [M, K]
    hbar = H.mean(-1, keepdim=True)
    m_v = U @ (d.unsqueeze(-1) * (U.mT @ (H - hbar))) + hbar
    mean = mean_X.mT + Phi.mT @ m_v
    sq = Phi.pow(2).sum(0)
    s = (d.unsqueeze(-1) * (U.mT @ Phi).pow(2)).sum(0)  # phi_n^T A phi_n
    cov = torch.diag_embed((kxx - sq).clamp_min(0).mT + jitter)
    cov = cov + sq[:, None, None] * J + s[:, None, None] * C
    kl = 0.5 * (M + (K - 1) * d.sum() + m_v.pow(2).sum() - K * M + (K - 1) * l.log1p().sum())
    return mean, cov, kl


def project_targets(mean: Tensor, lam1: Tensor, lam2: Tensor) -> Tuple[Tensor, Tensor]:
    """Coupled targets ``(lam1*, lam2*)`` at the marginal means ``mean`` onto the tied family:
    ``(lam1, w)`` (module docstring)."""
    K = mean.shape[-1]
    W = -(lam2 + lam2.mT)  # -2 lam2, symmetrised
    C = torch.eye(K, dtype=mean.dtype, device=mean.device) - 1.0 / K
    w = (W * C).sum((-2, -1)).clamp_min(0) / (K - 1)
    Wm = (W @ mean.unsqueeze(-1)).squeeze(-1)
    return lam1 - Wm + w.unsqueeze(-1) * (mean @ C), w


def tied_start(
    Phi: Tensor,
    kxx: Tensor,
    mean_X: Tensor,
    targets: Callable[[Tensor, Tensor], Tuple[Tensor, Tensor, Tensor]],
    step_sizes: Sequence[float],
    jitter: float = 0.0,
) -> Tuple[Tensor, Tensor, Tensor]:
    """CVI on tied-curvature sites from empty ones, one step per ``step_sizes`` entry.

    ``targets(mean, cov) -> (F, lam1*, lam2*)``: the summed expected log-likelihood and the
    coupled targets at the site marginals. Returns the sites ``lam1 [N, K]``, ``lam2 [N, K, K]``
    and the -ELBO at the prior (the first evaluation). A step whose q has a larger -ELBO than
    the one before (or a non-finite one) is undone and ends the phase; the last step is not
    evaluated here (the caller's next step does)."""
    N, K = mean_X.shape[-1], mean_X.shape[0]
    lam1, w = Phi.new_zeros(N, K), Phi.new_zeros(N)
    first: Optional[Tensor] = None
    prev: Optional[Tensor] = None
    kept = (lam1, w)
    for beta in step_sizes:
        mean, cov, kl = tied_posterior(Phi, kxx, mean_X, lam1, w, jitter)
        F, t1, t2 = targets(mean, cov)
        loss = (kl - F).detach()
        first = loss if first is None else first
        if prev is not None and not bool(loss <= prev):
            lam1, w = kept
            break
        prev, kept = loss, (lam1, w)
        p1, pw = project_targets(mean, t1, t2)
        lam1, w = lam1 + beta * (p1 - lam1), w + beta * (pw - w)
    C = torch.eye(K, dtype=Phi.dtype, device=Phi.device) - 1.0 / K
    assert first is not None, "step_sizes must not be empty"
    return lam1, -0.5 * w[:, None, None] * C, first
