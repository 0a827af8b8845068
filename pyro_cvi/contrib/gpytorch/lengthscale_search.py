"""The first CVI step's M-step on the lengthscales: a global search along one direction.

**Why it is needed.** With q fitted quickly (CVI), the hyperparameters follow the gradient of
the collapsed bound ``max_q ELBO(q, theta)`` (at a fitted q every parameterisation gives that
gradient). From a lengthscale much longer than the scale of the labels that bound is flat in the
lengthscale: the kernel gives the data's frequencies ``omega`` prior power
``~ exp(-l^2 omega^2 / 2)``, and its derivative is just as small. It also falls as the
outputscale shrinks (every label explained as noise), so gradient steps drift further onto the
plateau (GPyTorch's tutorial data: -ELBO 43.7 at ``l = 0.69`` against 16 at ``l = 0.09``).
GPyTorch's unwhitened strategy leaves it only through its initial ``q(u) = N(0, I)`` in function
space, whose KL to a smooth prior is huge and falls steeply with the lengthscale.

**The step.** The likelihood's Gaussian sites at the current marginals (eqs. 30-31 at each
point, ``lam1_n, lam2_n``, full-data scale) stand in for the data; with them in place of the
likelihood the bound at any ``theta`` is available in closed form (Khan & Lin 2017, eq. 14)::

    S(theta) = sum_n E_q[lam1_n f_n + lam2_n f_n^2] - KL[q_theta || p_theta]
             = log N(y~; m0(X), Q_XX + W^-1) - 1/2 sum_n W_n (k_nn - Q_nn) + const,

    q_theta(u) ∝ p_theta(u) prod_n exp(lam1_n f_n + lam2_n f_n^2),   f_n = a_n^T u,

the evidence of GP regression on the pseudo-data (targets ``y~ = lam1 / W``, noise ``1 / W``,
``W = -2 lam2``) less Titsias' trace term, O(N M^2 + M^3) per ``theta``
(:class:`~pyro_cvi.contrib.gpytorch.posterior.SparseSitePosterior`). Every learnable lengthscale
is multiplied by ``2^k`` (``k`` in ``EXPONENTS``) and the best ``S`` is taken if it beats
``k = 0``: a variational-EM M-step (sites fixed), global along the lengthscale scale, which is
where the bound's plateau lies. The kernel is evaluated at each candidate through
``torch.func.functional_call`` (the parameters are not touched until the choice is made).
Kernels whose lengthscale has a prior or a constraint the candidate violates are left alone.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from ...gaussian.price import site_natural_params
from ...linalg import NotPositiveDefinite
from .posterior import SparseSitePosterior, site_sums

__all__ = ["EXPONENTS", "LengthscaleMove", "data_sites", "search_lengthscales", "site_bound"]

#: candidate factors ``2^k`` for every lengthscale
EXPONENTS = tuple(range(-6, 7))


class _Prior(torch.nn.Module):
    """The prior blocks that :func:`site_bound` needs, from ``model.forward``, as a module for
    ``functional_call`` (evaluated inside the call: GPyTorch's kernel matrices are lazy)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, Z: Tensor, x: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        return prior_blocks(self.model.forward, Z, x)


def prior_blocks(forward: Callable, Z: Tensor, x: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``K_ZZ``, ``K_Zx``, ``diag k(x, x)`` and ``m0(x)`` of the prior ``forward(inputs)``."""
    M = Z.shape[-2]
    joint = forward(torch.cat([Z, x], dim=-2))
    cov = joint.lazy_covariance_matrix
    kxx = cov[..., M:, M:].diagonal(dim1=-2, dim2=-1)
    return cov[..., :M, :M].to_dense(), cov[..., :M, M:].to_dense(), kxx, joint.mean[..., M:]


def lengthscale_kernels(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """``(name, kernel)`` of every kernel in ``model`` with a learnable lengthscale and no prior
    on it."""
    out = []
    for name, mod in model.named_modules():
        raw = getattr(mod, "raw_lengthscale", None) if getattr(mod, "has_lengthscale", 0) else None
        if isinstance(raw, torch.nn.Parameter) and raw.requires_grad:
            if not any("lengthscale" in n for n, *_ in mod.named_priors()):
                out.append((name, mod))
    return out


def data_sites(mean: Tensor, grad_mean: Tensor, grad_var: Tensor) -> Tuple[Tensor, Tensor]:
    """Per-point sites ``(lam1, lam2)`` from ``dF/dm``, ``dF/dv`` at ``N(mean, var)`` (eqs. 30-31),
    the curvature of non-log-concave points clipped at 0 (as :class:`CVIOptimizer` does)."""
    return site_natural_params(mean, grad_mean, grad_var.clamp_max(0.0))


def site_bound(blocks, lam1: Tensor, lam2: Tensor, jitter: float) -> Tuple[Tensor, Tensor, Tensor]:
    """``S(theta)`` of the module docstring from the prior blocks of :func:`prior_blocks`, and
    the whitened targets ``(t1, t2) = (Phi r, Phi diag(lam2) Phi^T)`` that these sites give
    q(v) at this ``theta``."""
    K_ZZ, K_Zx, kxx, m0 = blocks
    eye = torch.eye(K_ZZ.shape[-1], dtype=K_ZZ.dtype, device=K_ZZ.device)
    post = SparseSitePosterior(K_ZZ + jitter * eye, K_Zx, m0, lam1, lam2)
    mean, var = post.marginals(post.Phi, kxx + jitter, m0)
    value = (lam1 * mean + lam2 * (var.clamp_min(0.0) + mean * mean)).sum(-1) - post.kl()
    S, s = site_sums(post.Phi, lam1, lam2, m0)
    return value, s, -0.5 * S


class LengthscaleMove:
    """The chosen factor, the bound before and after, and the whitened targets at the new
    lengthscales; :meth:`apply` writes the lengthscales into the kernels."""

    def __init__(self, factor: float, before: float, after: float, targets, kernels, values):
        self.factor, self.before, self.after = factor, before, after
        self.targets = targets
        self._kernels, self._values = kernels, values

    def apply(self) -> None:
        """Write the new lengthscales. Their gradients are left as they are (GPyTorch's
        contract: every parameter has a non-zero gradient after ``backward``), so in the
        tutorial's loop the optimizer's step right after the move (one step of its learning
        rate) starts from the new values."""
        with torch.no_grad():
            for (_, k), value in zip(self._kernels, self._values):
                k.raw_lengthscale.copy_(value)


def search_lengthscales(
    model: torch.nn.Module,
    Z: Tensor,
    x: Tensor,
    lam1: Tensor,
    lam2: Tensor,
    jitter: float,
    exponents=EXPONENTS,
) -> Optional[LengthscaleMove]:
    """The M-step of the module docstring; ``None`` when no factor beats the current
    lengthscales (or the model has none to learn)."""
    kernels = lengthscale_kernels(model)
    if not kernels:
        return None
    wrapper = _Prior(model)
    Z, x = Z.detach(), x.detach()
    if x.dim() == 1:
        x = x.unsqueeze(-1)
    best, base = None, None
    with torch.no_grad():
        for k in sorted(exponents, key=abs):  # k = 0 first: the reference
            raws = []
            for _, kern in kernels:
                value = kern.lengthscale * 2.0**k
                raw = kern.raw_lengthscale_constraint.inverse_transform(value)
                ok = bool(torch.isfinite(raw).all()) and kern.raw_lengthscale_constraint.check(
                    kern.raw_lengthscale_constraint.transform(raw)
                )
                raws.append(raw if ok else None)
            if any(r is None for r in raws):
                continue
            params = {f"model.{n}.raw_lengthscale": r for (n, _), r in zip(kernels, raws)}
            try:
                blocks = torch.func.functional_call(wrapper, params, (Z, x), strict=False)
                value, t1, t2 = site_bound(blocks, lam1, lam2, jitter)
            except NotPositiveDefinite:
                continue
            if not bool(torch.isfinite(value)):
                continue
            if k == 0:
                base = float(value)
            if best is None or float(value) > best[0]:
                best = (float(value), k, (t1, t2), raws)
    if best is None or base is None or best[1] == 0 or not best[0] > base:
        return None
    return LengthscaleMove(2.0 ** best[1], base, best[0], best[2], kernels, best[3])
