"""Gaussian families: full covariance (``Gaussian``) and diagonal (``GaussianDiag``).

Full covariance, over the flattened event of size ``D = prod(event_shape)``:

* sufficient statistics  ``phi(z) = (z, z z^T)``
* natural parameters     ``eta1 = Lambda m``  ``[..., D]``,  ``eta2 = -Lambda / 2``  ``[..., D, D]``
* mean parameters        ``mu1 = m``,  ``mu2 = V + m m^T``  (``V = Lambda^{-1}``)
* log-partition          ``A = m^T Lambda m / 2 - log|Lambda| / 2``
  ``= |L^{-1} eta1|^2 / 2 - sum log diag L`` with ``Lambda = L L^T``;
  base measure ``log h(z) = -D/2 log(2 pi)``.

``eta2`` is treated as symmetric: every map uses ``sym(eta2) = (eta2 + eta2^T) / 2``, so the
autograd gradient of ``A`` w.r.t. ``eta2`` is the (symmetric) ``mu2``. For a scalar site
(``event_shape == ()``) the parameters are scalars (``eta1, eta2`` of shape ``[...]``) and the
distribution is a ``Normal``; for ``event_shape == (D,)`` it is a ``MultivariateNormal``; for a
multi-dimensional event it is a ``MultivariateNormal`` over the flattened event pushed through a
``ReshapeTransform``.

The maps themselves are :mod:`pyro_cvi.gaussian.conversions` (the covariance factor handed to
``MultivariateNormal`` is computed from the precision without forming ``V``). If a Cholesky
factorisation fails in reduced precision (float32/float16/bfloat16) the failing batch entries
are retried with a jitter of ``1e-6, 1e-5, 1e-4`` times the mean diagonal (the ``"float32"``
policy of :func:`pyro_cvi.linalg.cholesky`); in float64 (or if that also fails) a
``ValueError`` is raised.

Diagonal covariance, elementwise over ``event_shape``:

* ``phi(z) = (z, z^2)``; ``eta = (m / v, -1 / (2 v))``; ``mu = (m, v + m^2)``
* ``A = -eta1^2 / (4 eta2) - log(-2 eta2) / 2`` summed over the event; ``log h = -n/2 log(2 pi)``
* distribution ``Normal(m, sqrt(v)).to_event(len(event_shape))``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import pyro.distributions as dist
import torch
from torch import Tensor
from torch.distributions import Distribution, Independent
from torch.distributions import MultivariateNormal as _TorchMVN
from torch.distributions import Normal as _TorchNormal
from torch.distributions import TransformedDistribution as _TorchTransformed
from torch.distributions.transforms import ReshapeTransform

from ..gaussian.conversions import (
    diagonal_moments_from_natural,
    diagonal_natural_from_moments,
    log_partition,
    mean_params,
    moments_from_mean_params,
    moments_from_natural,
    natural_from_moments,
    scale_tril_from_precision,
    symmetrise,
)
from ..gaussian.selection import SelectionJacobian, square_matvec
from ..linalg import cholesky
from .base import ExponentialFamily, Params, _float_value, sum_rightmost

__all__ = ["Gaussian", "GaussianDiag"]

_LOG_2PI = math.log(2 * math.pi)


def _cholesky(m: Tensor, what: str = "precision matrix") -> Tensor:
    """Lower Cholesky factor of the SPD matrix ``m`` with float32-only fallback jitter."""
    return cholesky(
        m,
        jitter="float32",
        what=f"Gaussian family: {what}",
        hint="Check the parameters with family.is_valid / family.validate before converting them.",
    )


def _unwrap(d: Distribution) -> Distribution:
    while isinstance(d, Independent):
        d = d.base_dist
    return d


# elementwise (diagonal / scalar) maths shared by GaussianDiag and the scalar Gaussian
def _elementwise_mean_grad(nat: Params, grad_nat: Params) -> Params:
    """``F^{-1} g`` for ``F = d(m, v + m^2) / d(m / v, -1 / (2v)) = [[v, 2mv], [2mv, 4m^2 v +
    2v^2]]`` (``det = 2 v^3``): ``((2m^2 + v) g1 - m g2, g2 / 2 - m g1) / v^2``."""
    m, v = diagonal_moments_from_natural(*nat)
    g1, g2 = grad_nat
    return ((2 * m.square() + v) * g1 - m * g2) / v.square(), (g2 / 2 - m * g1) / v.square()


def _elementwise_natural_at(value: Tensor, prior_nat: Optional[Params]) -> Params:
    """``(m / v, -1 / (2v))`` with ``m = value`` and ``v`` the prior variance (else 1)."""
    v = _float_value(value)
    var = -0.5 / prior_nat[1] if prior_nat is not None else torch.ones_like(v)
    return v / var, -0.5 / var


def _plug_in_mean(family: ExponentialFamily, nat: Params, mean: Params) -> Tensor:
    """``mu1 = E z`` reshaped to ``batch + event_shape`` (batch taken from ``nat[0]``)."""
    n0 = nat[0]
    batch = n0.shape[: n0.dim() - len(family.param_shapes[0])]
    return mean[0].reshape(batch + family.event_shape)


class Gaussian(ExponentialFamily):
    """Full-covariance Gaussian over the flattened event (see module docstring)."""

    name = "gaussian"
    domain = "sym(eta2) negative definite"
    is_gaussian = True
    full_covariance = True

    def __init__(self, event_shape: Sequence[int] = ()) -> None:
        super().__init__(event_shape)
        self.dim = self.event_shape.numel()

    @property
    def vector_valued(self) -> bool:  # the flattened event is one draw (unless scalar)
        return self.event_dim > 0

    # shapes -----------------------------------------------------------------------------------
    @property
    def param_shapes(self) -> Tuple[torch.Size, ...]:
        if self.event_dim == 0:
            return (torch.Size(), torch.Size())
        d = self.dim
        return (torch.Size((d,)), torch.Size((d, d)))

    def _to_mat(self, params: Params) -> Tuple[Tensor, Tensor]:
        """(vector [..., D], symmetric matrix [..., D, D]) view of a parameter tuple."""
        p1, p2 = params
        if self.event_dim == 0:
            return p1.unsqueeze(-1), p2[..., None, None]
        return p1, symmetrise(p2)

    def _from_mat(self, v: Tensor, m: Tensor) -> Params:
        if self.event_dim == 0:
            return v.squeeze(-1), m[..., 0, 0]
        return v, m

    def _precision(self, nat: Params) -> Tuple[Tensor, Tensor]:
        eta1, eta2 = self._to_mat(nat)
        return eta1, -2 * eta2

    def _flat_value(self, x: Tensor) -> Tensor:
        if self.event_dim == 0:
            return x.unsqueeze(-1)
        return x.reshape(x.shape[: x.dim() - self.event_dim] + (self.dim,))

    # maps ---------------------------------------------------------------------------------------
    def natural_to_mean(self, nat: Params) -> Params:
        eta1, prec = self._precision(nat)
        return self._from_mat(*mean_params(*moments_from_natural(eta1, _cholesky(prec))))

    def mean_to_natural(self, mean: Params) -> Params:
        m, cov = moments_from_mean_params(*self._to_mat(mean))
        chol = _cholesky(cov, "covariance matrix mu2 - mu1 mu1^T")
        eta1, prec = natural_from_moments(m, chol)
        return self._from_mat(eta1, -0.5 * prec)

    def natural_to_dist(self, nat: Params) -> Distribution:
        eta1, prec = self._precision(nat)
        if self.event_dim == 0:
            var = prec[..., 0, 0].reciprocal()
            return dist.Normal(eta1[..., 0] * var, var.sqrt())
        scale_tril = scale_tril_from_precision(prec, _cholesky)
        loc = (scale_tril @ (scale_tril.mT @ eta1.unsqueeze(-1))).squeeze(-1)
        mvn = dist.MultivariateNormal(loc, scale_tril=scale_tril)
        if self.event_dim == 1:
            return mvn
        return dist.TransformedDistribution(
            mvn, [ReshapeTransform(torch.Size((self.dim,)), self.event_shape)]
        )

    def dist_to_natural(self, d: Distribution) -> Params:
        if isinstance(d, _TorchTransformed) and self.event_dim > 1:
            if len(d.transforms) == 1 and isinstance(d.transforms[0], ReshapeTransform):
                d = d.base_dist
        d = _unwrap(d)
        if isinstance(d, _TorchMVN):
            eta1, prec = natural_from_moments(d.loc, d.scale_tril)
        elif isinstance(d, _TorchNormal):
            prec_diag = d.scale.pow(-2)
            loc = d.loc
            if self.event_dim == 0:
                return loc * prec_diag, -0.5 * prec_diag
            shape = loc.shape[: loc.dim() - self.event_dim] + (self.dim,)
            eta1 = (loc * prec_diag).reshape(shape)
            prec = torch.diag_embed(prec_diag.reshape(shape))
        else:
            raise TypeError(f"{self!r}: cannot convert {type(d).__name__} to natural parameters")
        if eta1.shape[-1] != self.dim:
            raise ValueError(f"{self!r}: distribution has event size {eta1.shape[-1]}")
        return self._from_mat(eta1, -0.5 * prec)

    def log_partition(self, nat: Params) -> Tensor:
        eta1, prec = self._precision(nat)
        return log_partition(eta1, _cholesky(prec))

    def sufficient_stats(self, x: Tensor) -> Params:
        z = self._flat_value(x)
        return self._from_mat(z, z.unsqueeze(-1) * z.unsqueeze(-2))

    def base_log_measure(self, x: Tensor) -> Tensor:
        return super().base_log_measure(x) - 0.5 * self.dim * _LOG_2PI

    def _expected_base_log_measure(self, nat: Params) -> Tensor:
        return torch.full((), -0.5 * self.dim * _LOG_2PI, dtype=nat[0].dtype, device=nat[0].device)

    def _in_domain(self, nat: Params) -> Tensor:
        _, prec = self._precision(nat)
        chol, info = torch.linalg.cholesky_ex(prec)
        diag = chol.diagonal(dim1=-2, dim2=-1)
        return (info == 0) & (diag > 0).all(-1) & torch.isfinite(diag).all(-1)

    def entropy(self, nat: Params) -> Tensor:
        _, prec = self._precision(nat)
        chol = _cholesky(prec)
        logdet_half = chol.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        return 0.5 * self.dim * (1 + _LOG_2PI) - logdet_half

    def kl(self, nat_q: Params, nat_p: Params) -> Tensor:
        """``(tr(Lp Vq) + (mp - mq)^T Lp (mp - mq) - D + log|Lq| - log|Lp|) / 2``."""
        eta1_q, prec_q = self._precision(nat_q)
        eta1_p, prec_p = self._precision(nat_p)
        lq, lp = _cholesky(prec_q), _cholesky(prec_p)
        mq = torch.cholesky_solve(eta1_q.unsqueeze(-1), lq)
        mp = torch.cholesky_solve(eta1_p.unsqueeze(-1), lp)
        lq, lp = torch.broadcast_tensors(lq, lp)
        trace = torch.linalg.solve_triangular(lq, lp, upper=False).square().sum((-2, -1))
        maha = (lp.mT @ (mp - mq)).square().sum((-2, -1))
        logdet = lq.diagonal(dim1=-2, dim2=-1).log().sum(-1) - lp.diagonal(
            dim1=-2, dim2=-1
        ).log().sum(-1)
        return 0.5 * (trace + maha - self.dim) + logdet

    # Fisher-solve support -----------------------------------------------------------------------
    def symmetrize(self, params: Params) -> Params:
        if self.event_dim == 0:
            return params
        return params[0], symmetrise(params[1])

    # CVI helpers --------------------------------------------------------------------------------
    def mean_grad(self, nat: Params, grad_nat: Params) -> Params:
        """Closed-form 2x2 solve for a scalar site (see :class:`GaussianDiag`); otherwise the
        generic Fisher solve."""
        if self.event_dim == 0:
            return _elementwise_mean_grad(nat, grad_nat)
        return super().mean_grad(nat, grad_nat)

    def natural_at(self, value: Tensor, prior_nat: Optional[Params] = None) -> Params:
        """``(Lambda m, -Lambda / 2)`` with ``m = value`` and ``Lambda`` the prior precision
        ``-2 eta2`` (else the identity)."""
        if self.event_dim == 0:
            return _elementwise_natural_at(value, prior_nat)
        v = _float_value(value)
        D = self.dim
        vb = v.reshape(v.shape[: v.dim() - self.event_dim] + (D,))
        if prior_nat is not None:
            P = -2 * prior_nat[1]
        else:
            P = torch.eye(D, dtype=v.dtype, device=v.device).expand(vb.shape[:-1] + (D, D))
        return (P @ vb.unsqueeze(-1)).squeeze(-1), -0.5 * P

    def natural_with_spread(self, value: Tensor, scale: float) -> Params:
        """Mean ``value``, covariance ``scale^2 I``."""
        v = _float_value(value)
        if self.event_dim == 0:
            return _elementwise_natural_at(value, (None, torch.full_like(v, -0.5 / scale**2)))
        eye = torch.eye(self.dim, dtype=v.dtype, device=v.device)
        return self.natural_at(value, (None, -0.5 / scale**2 * eye))

    def mean_value(self, nat: Params, mean: Params) -> Optional[Tensor]:
        """``E z = mu1``, reshaped to ``batch + event_shape``."""
        return _plug_in_mean(self, nat, mean)

    def variance_along(self, mean: Params, A: Union[Tensor, SelectionJacobian]) -> Tensor:
        """``diag(A V A^T)`` with ``V = mu2 - mu1 mu1^T`` per batch element; ``A`` is
        ``(R, batch numel * D)`` (the flattened batched latent). A selection ``A`` (one
        non-zero ``c_r`` per row, at coordinate ``k_r``) reads ``c_r^2 V[k_r, k_r]``."""
        m, m2 = mean
        if self.event_dim == 0:
            return square_matvec(A, (m2 - m.square()).reshape(-1))
        D = self.dim
        cov = m2 - m.unsqueeze(-1) * m.unsqueeze(-2)
        if isinstance(A, SelectionJacobian):
            return A.square().matvec(cov.diagonal(dim1=-2, dim2=-1).reshape(-1))
        Ab = A.reshape(A.shape[0], -1, D)
        return torch.einsum("rbi,bij,rbj->r", Ab, cov.reshape(-1, D, D), Ab)

    def marginal_variance(self, mean: Params) -> Tensor:
        """``diag(mu2) - mu1^2`` (``mu2 - mu1^2`` for a scalar site)."""
        m, m2 = mean
        if self.event_dim == 0:
            return m2 - m.square()
        return m2.diagonal(dim1=-2, dim2=-1) - m.square()

    def fisher_null_projector(self, dtype: torch.dtype, device: torch.device) -> Optional[Tensor]:
        if self.event_dim == 0:
            return None
        d = self.dim
        idx = torch.arange(d * d, device=device)
        transpose = torch.zeros(d * d, d * d, dtype=dtype, device=device)
        transpose[idx, (idx % d) * d + idx // d] = 1
        anti = 0.5 * (torch.eye(d * d, dtype=dtype, device=device) - transpose)
        out = torch.zeros(d + d * d, d + d * d, dtype=dtype, device=device)
        out[d:, d:] = anti
        return out


class GaussianDiag(ExponentialFamily):
    """Diagonal Gaussian, elementwise over ``event_shape`` (see module docstring)."""

    name = "gaussian_diag"
    domain = "eta2 < 0"
    is_gaussian = True

    @property
    def param_shapes(self) -> Tuple[torch.Size, ...]:
        return (self.event_shape, self.event_shape)

    def natural_to_mean(self, nat: Params) -> Params:
        m, var = diagonal_moments_from_natural(*nat)
        return m, var + m.square()

    def mean_to_natural(self, mean: Params) -> Params:
        m, mu2 = mean
        return diagonal_natural_from_moments(m, mu2 - m.square())

    def natural_to_dist(self, nat: Params) -> Distribution:
        eta1, eta2 = nat
        var = -0.5 / eta2
        eta1, var = torch.broadcast_tensors(eta1, var)
        return dist.Normal(eta1 * var, var.sqrt()).to_event(self.event_dim)

    def dist_to_natural(self, d: Distribution) -> Params:
        d = _unwrap(d)
        if not isinstance(d, _TorchNormal):
            raise TypeError(f"{self!r}: cannot convert {type(d).__name__} to natural parameters")
        prec = d.scale.pow(-2)
        return d.loc * prec, -0.5 * prec

    def log_partition(self, nat: Params) -> Tensor:
        eta1, eta2 = nat
        a = -0.25 * eta1.square() / eta2 - 0.5 * torch.log(-2 * eta2)
        return sum_rightmost(a, self.event_dim)

    def sufficient_stats(self, x: Tensor) -> Params:
        return x, x.square()

    def base_log_measure(self, x: Tensor) -> Tensor:
        return super().base_log_measure(x) - 0.5 * self.event_shape.numel() * _LOG_2PI

    def _expected_base_log_measure(self, nat: Params) -> Tensor:
        c = -0.5 * self.event_shape.numel() * _LOG_2PI
        return torch.full((), c, dtype=nat[0].dtype, device=nat[0].device)

    def _in_domain(self, nat: Params) -> Tensor:
        eta1, eta2 = torch.broadcast_tensors(*nat)
        ok = eta2 < 0
        return ok.reshape(ok.shape[: ok.dim() - self.event_dim] + (-1,)).all(-1)

    def entropy(self, nat: Params) -> Tensor:
        log_var = -torch.log(-2 * nat[1])
        return sum_rightmost(0.5 * (1 + _LOG_2PI + log_var), self.event_dim)

    def kl(self, nat_q: Params, nat_p: Params) -> Tensor:
        """``sum (log(vp / vq) + (vq + (mq - mp)^2) / vp - 1) / 2``."""
        (e1q, e2q), (e1p, e2p) = nat_q, nat_p
        mq, vq = diagonal_moments_from_natural(e1q, e2q)
        mp, vp = diagonal_moments_from_natural(e1p, e2p)
        ratio = vq / vp
        terms = 0.5 * (ratio - 1 - torch.log(ratio) + (mq - mp).square() / vp)
        return sum_rightmost(terms, self.event_dim)

    # CVI helpers --------------------------------------------------------------------------------
    def mean_grad(self, nat: Params, grad_nat: Params) -> Params:
        """Elementwise closed form: ``F = [[v, 2mv], [2mv, 4m^2 v + 2v^2]]`` per entry, so
        ``F^{-1} g = ((2m^2 + v) g1 - m g2, g2 / 2 - m g1) / v^2``."""
        return _elementwise_mean_grad(nat, grad_nat)

    def natural_at(self, value: Tensor, prior_nat: Optional[Params] = None) -> Params:
        """``(m / v, -1 / (2v))`` with ``m = value`` and ``v`` the prior variance (else 1)."""
        return _elementwise_natural_at(value, prior_nat)

    def natural_with_spread(self, value: Tensor, scale: float) -> Params:
        """Mean ``value``, variance ``scale^2``."""
        v = _float_value(value)
        return _elementwise_natural_at(value, (None, torch.full_like(v, -0.5 / scale**2)))

    def mean_value(self, nat: Params, mean: Params) -> Optional[Tensor]:
        """``E z = mu1``."""
        return _plug_in_mean(self, nat, mean)

    def variance_along(self, mean: Params, A: Union[Tensor, SelectionJacobian]) -> Tensor:
        """``diag(A diag(v) A^T) = A^2 v`` with ``v = mu2 - mu1^2`` flattened (for a selection
        ``A``: ``c^2 * v[idx]``, the same numbers without the dense ``A^2``)."""
        m, m2 = mean
        return square_matvec(A, (m2 - m.square()).reshape(-1))

    def marginal_variance(self, mean: Params) -> Tensor:
        """``mu2 - mu1^2``."""
        m, m2 = mean
        return m2 - m.square()
