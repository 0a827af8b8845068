"""Dense linear algebra shared by the Pyro guide, the Gaussian family and ``contrib.gpytorch``.

This module is the one place where a Cholesky factorisation may be retried with jitter, and the
one implementation of the dual-form (Rasmussen & Williams, Alg. 3.2) Gaussian solve. Everything
is batched over leading dimensions and follows the dtype and device of its inputs.

:func:`cholesky` has four policies, chosen by what a failure means to the caller:

* ``jitter="none"`` (strict): for a *precision* built from CVI's natural parameters (and for
  ``B`` matrices, whose eigenvalues are >= 1 when the parameters are valid). A failure means
  the step was too long, so nothing is added to the matrix and :class:`NotPositiveDefinite` is
  raised for the caller to shrink the step. A non-finite factor also counts as a failure.
* ``jitter="float32"``: in reduced precision (float32, float16, bfloat16) the failing batch
  entries are retried with ``c * mean_i |M_ii|`` added to the diagonal, for
  ``c = 1e-6, 1e-5, 1e-4``; in float64 no jitter is added. Used by the full-covariance
  Gaussian family, whose parameters are validated elsewhere.
* ``jitter="grow"``: for a *covariance* (a posterior covariance for sampling, a GP prior
  covariance), which may be positive semi-definite. The failing entries are retried with
  ``c 10^k * mean_i |M_ii|`` (the mean clamped below at ``1e-30``) for ``k = 0, ..., 5``, with
  ``c = 1e-6`` in reduced precision and ``1e-10`` in float64.
* ``jitter="eps"``: for a covariance that is singular by construction (a Markov chain's step
  covariance with noise-free state components, for sampling): ``10 eps max(max_i |M_ii|, eps)``
  (``eps`` the dtype's machine epsilon) is always added to the diagonal, then strict.

:func:`dual_solve` computes ``q(f) ∝ N(f | mu_f, K) prod_n exp(b_n f_n - w_n f_n^2 / 2)``
without inverting ``K``; see its docstring.
"""

from __future__ import annotations

import functools
from typing import Iterator, Literal, Optional

import torch
from torch import Tensor

__all__ = ["NotPositiveDefinite", "cholesky", "dual_solve", "DualSolution", "JitterPolicy"]

JitterPolicy = Literal["none", "float32", "grow", "eps"]

_REDUCED = (torch.float32, torch.float16, torch.bfloat16)
_FLOAT32_JITTERS = (1e-6, 1e-5, 1e-4)
_GROW_STEPS = 6


class NotPositiveDefinite(RuntimeError, ValueError):
    """A matrix that must be positive definite is not (its Cholesky factorisation failed).

    For CVI this means the natural parameters do not define a valid Gaussian (the precision is
    not positive definite), so a caller can shrink the step. It is both a ``RuntimeError`` (as
    raised by the guide and ``contrib.gpytorch``) and a ``ValueError`` (as raised by the
    Gaussian family for invalid parameters).
    """


def _eye_like(M: Tensor) -> Tensor:
    return torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)


def _mean_abs_diag(M: Tensor) -> Tensor:
    """``mean_i |M_ii|`` per batch entry, shaped ``[..., 1, 1]`` to broadcast against ``M``."""
    return M.diagonal(dim1=-2, dim2=-1).abs().mean(-1)[..., None, None]


def _jitters(M: Tensor, jitter: JitterPolicy) -> Iterator[Tensor]:
    """The diagonal amounts (``[..., 1, 1]``) to retry with, smallest first."""
    if jitter == "float32":
        if M.dtype in _REDUCED:
            scale = _mean_abs_diag(M)
            for rel in _FLOAT32_JITTERS:
                yield rel * scale
    elif jitter == "grow":
        base = 1e-6 if M.dtype in _REDUCED else 1e-10
        scale = _mean_abs_diag(M).clamp_min(1e-30)
        for k in range(_GROW_STEPS):
            yield scale * base * 10**k


def _eps_jitter(M: Tensor) -> Tensor:
    """``10 eps max(max_i |M_ii|, eps) I`` per batch entry (the ``"eps"`` policy)."""
    eps = torch.finfo(M.dtype).eps
    scale = M.diagonal(dim1=-2, dim2=-1).abs().amax(-1).clamp(min=eps)
    return (10 * eps * scale)[..., None, None] * _eye_like(M)


def _max_jitter(M: Tensor, jitter: JitterPolicy) -> Optional[float]:
    if jitter == "float32" and M.dtype in _REDUCED:
        return _FLOAT32_JITTERS[-1]
    if jitter == "grow":
        return (1e-6 if M.dtype in _REDUCED else 1e-10) * 10 ** (_GROW_STEPS - 1)
    return None


def cholesky(
    M: Tensor, *, jitter: JitterPolicy = "none", what: str = "matrix", hint: str = ""
) -> Tensor:
    """Lower Cholesky factor ``L`` of the symmetric matrix ``M = L L^T`` (batched over ``[...]``).

    :param M: ``[..., n, n]``; only its lower triangle is read.
    :param jitter: ``"none"`` (strict), ``"float32"``, ``"grow"`` or ``"eps"``; see the module
        docstring.
        Jitter ``J`` is added as ``M + J I`` and only to the batch entries that failed, so the
        entries that factorise as they are keep their exact factor.
    :param what: names the matrix in the error message.
    :param hint: appended to the error message (advice to the user).
    :raises NotPositiveDefinite: when some batch entry fails (after all retries).
    """
    if jitter not in ("none", "float32", "grow", "eps"):
        raise ValueError(
            f"cholesky: jitter must be 'none', 'float32', 'grow' or 'eps', not {jitter!r}"
        )
    if jitter == "eps":
        M = M + _eps_jitter(M)
    L, info = torch.linalg.cholesky_ex(M)
    failed = info != 0
    if jitter in ("none", "eps"):
        # L_jj = sqrt(M_jj - sum_k L_jk^2): a non-finite entry of row j reaches L_jj, so the
        # diagonal is the whole check
        failed = failed | ~torch.isfinite(L.diagonal(dim1=-2, dim2=-1)).all(-1)
    if not bool(failed.any()):
        return L
    eye = _eye_like(M)
    for amount in _jitters(M, jitter):
        L2, info2 = torch.linalg.cholesky_ex(M + eye * amount)
        fix = failed & (info2 == 0)
        L = torch.where(fix[..., None, None], L2, L)
        failed = failed & ~fix
        if not bool(failed.any()):
            return L
    where = ""
    if M.dim() > 2:
        where = f" for {int(failed.sum())} of {failed.numel()} batch entries"
    top = _max_jitter(M, jitter)
    tried = "" if top is None else f", also with jitter up to {top:g} x mean|diag|"
    dtype = str(M.dtype).replace("torch.", "")
    msg = f"{what} is not positive definite in {dtype} (Cholesky failed{where}{tried})"
    raise NotPositiveDefinite(f"{msg}. {hint}" if hint else msg)


def _mv(M: Tensor, v: Tensor) -> Tensor:
    """``M v`` for ``M [..., n, m]`` and ``v [..., m]`` (a plain matrix-vector product if 1-D)."""
    return M @ v if v.dim() == 1 else (M @ v.unsqueeze(-1)).squeeze(-1)


class DualSolution:
    """The result of :func:`dual_solve` (all attributes batched over ``[...]``).

    :ivar K: the prior covariance ``[..., n, n]``.
    :ivar sqrt_w: ``W^1/2 = sqrt(max(w, 0))``, ``[..., n]``.
    :ivar L: lower Cholesky factor of ``B = I + W^1/2 K W^1/2``, ``[..., n, n]``.
    :ivar alpha: ``K^-1 (m - mu_f)``, ``[..., n]``.
    :ivar mean: posterior means ``m = mu_f + K alpha`` at the sites (``K alpha`` without ``mu_f``).
    """

    def __init__(self, K: Tensor, sqrt_w: Tensor, L: Tensor, alpha: Tensor, mean: Tensor):
        self.K = K
        self.sqrt_w = sqrt_w
        self.L = L
        self.alpha = alpha
        self.mean = mean

    def whiten(self, X: Tensor) -> Tensor:
        """``L^-1 W^1/2 X`` for ``X [..., n, k]``.

        With ``X = k(X_sites, x)`` this gives the predictive covariance
        ``k(x, x') - (L^-1 W^1/2 k(X_sites, x))^T (L^-1 W^1/2 k(X_sites, x'))``.
        """
        return torch.linalg.solve_triangular(self.L, self.sqrt_w.unsqueeze(-1) * X, upper=False)

    @functools.cached_property
    def V(self) -> Tensor:
        """``V = L^-1 W^1/2 K`` (computed on first use): ``Sigma = K - V^T V``."""
        return self.whiten(self.K)

    @functools.cached_property
    def var(self) -> Tensor:
        """Posterior marginal variances at the sites, ``diag(Sigma)_n = K_nn - sum_i V_in^2``."""
        return self.K.diagonal(dim1=-2, dim2=-1) - self.V.square().sum(-2)

    @functools.cached_property
    def logdet_B(self) -> Tensor:
        """``log |B| = 2 sum_i log L_ii = log |K| - log |Sigma|``."""
        return 2 * self.L.diagonal(dim1=-2, dim2=-1).log().sum(-1)


def dual_solve(
    K: Tensor, w: Tensor, b: Tensor, mu_f: Optional[Tensor] = None, *, hint: str = ""
) -> DualSolution:
    """Gaussian posterior ``q(f) ∝ N(f | mu_f, K) prod_n exp(b_n f_n - w_n f_n^2 / 2)``.

    This is ``N(m, Sigma)`` with ``Sigma = (K^-1 + W)^-1``, ``m = Sigma (K^-1 mu_f + b)``,
    ``W = diag(w)``, computed in the stable form of Rasmussen & Williams (2006), Alg. 3.2,
    which never inverts ``K``::

        B = I + W^1/2 K W^1/2 = L L^T,
        alpha = b - W^1/2 B^-1 W^1/2 (mu_f + K b)      (= K^-1 (m - mu_f)),
        m = mu_f + K alpha,
        Sigma = K - V^T V,      V = L^-1 W^1/2 K,
        log |Sigma| = log |K| - log |B|.

    ``B`` has eigenvalues >= 1 for any positive semi-definite ``K`` (even a numerically singular
    one) and ``w >= 0``; entries with ``w_n = 0`` (empty sites) need no special case. Negative
    ``w`` are clamped to 0 in ``W^1/2`` (callers use this form only when ``w >= 0``).

    Centred sites: shifting ``f`` by the prior mean, the same posterior is ``mu_f + f'`` with
    ``q(f') ∝ N(f' | 0, K) prod_n exp(r_n f'_n - w_n f'_n^2 / 2)``, ``r = b - W mu_f``. Pass
    ``b = r`` and ``mu_f=None`` for that form (``alpha = r - W^1/2 B^-1 W^1/2 K r``, and
    ``mean`` is then ``K alpha``, the posterior mean of ``f - mu_f``).

    Cost ``O(n^3)`` for the Cholesky of ``B``; the ``O(n^3)`` triangular solve ``V`` behind
    :attr:`DualSolution.var` is computed on first use.

    :param K: prior covariance ``[..., n, n]``.
    :param w: site precisions ``[..., n]``.
    :param b: site linear coefficients ``[..., n]``.
    :param mu_f: prior mean ``[..., n]``, or ``None`` for zero.
    :param hint: advice appended to the error message if ``B`` cannot be factorised.
    :raises NotPositiveDefinite: if ``B`` cannot be factorised (no jitter is added: ``B`` of a
        valid problem is well conditioned, so a failure means invalid input).
    """
    sqrt_w = w.clamp_min(0).sqrt()
    B = _eye_like(K) + sqrt_w.unsqueeze(-1) * K * sqrt_w.unsqueeze(-2)
    L = cholesky(B, what="B = I + W^1/2 K W^1/2", hint=hint)
    Kb = _mv(K, b)
    rhs = sqrt_w * (Kb if mu_f is None else mu_f + Kb)
    alpha = b - sqrt_w * torch.cholesky_solve(rhs.unsqueeze(-1), L).squeeze(-1)
    Ka = _mv(K, alpha)
    mean = Ka if mu_f is None else mu_f + Ka
    return DualSolution(K, sqrt_w, L, alpha, mean)
