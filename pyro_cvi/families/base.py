"""Abstract exponential family and shared numerics.

A family describes the variational distribution of one latent site,

    q(z | lam) = h(z) exp(<lam, phi(z)> - A(lam)),

with natural parameters ``lam``, sufficient statistics ``phi(z)``, base measure ``h`` and
log-partition ``A`` (Appendix C of Khan & Lin 2017). The mean parameters are
``mu = E_q[phi(z)] = grad A(lam)`` and the Fisher information is ``F = d^2 A / d lam^2 =
d mu / d lam``; for a function ``f`` of ``mu``, ``df/dmu = F^{-1} df/dlam`` (Appendix F, eq. 72).

Conventions shared by every family
----------------------------------
* Parameters (natural or mean) are *tuples of tensors*. Parameter ``i`` has trailing shape
  ``family.param_shapes[i]``; any leading dimensions are batch dimensions. Natural and mean
  parameters of a family have the same shapes.
* ``log_partition``, ``entropy``, ``kl``, ``inner``, ``is_valid`` and ``base_log_measure``
  reduce over the parameter (event) dimensions and return batch-shaped tensors.
* Nothing here hard-codes a dtype or device: every result follows its input tensors.
* The per-family maths that mean-field CVI needs lives on the classes (generic defaults here,
  overrides per family): ``mean_grad`` (the Fisher solve of eq. 72), ``natural_at`` (a ``q``
  with a given mean), the plug-in values ``mean_value`` / ``geometric_mean``, ``probs`` of
  discrete families, ``variance_along`` / ``marginal_variance`` of Gaussians, and the
  attributes ``is_discrete``, ``is_gaussian``, ``num_values``, ``natural_bounds`` (box-shaped
  natural domains) and ``vector_valued``.
* The module also holds the special-function helpers (stable ``log x - digamma(x)``,
  ``digamma(x) - digamma(x + d)``, their inverses) that the Gamma/Beta/Dirichlet families share.
"""

from __future__ import annotations

import abc
from typing import Callable, Optional, Sequence, Tuple

import torch
from pyro.distributions.util import broadcast_shape
from torch import Tensor
from torch.distributions import Distribution

from .special import (  # noqa: F401  (re-exported: the families import them from here)
    digamma_diff,
    dirichlet_entropy,
    dirichlet_from_mean_log,
    exclusive_sum,
    inv_digamma,
    inv_log_minus_digamma,
    log_minus_digamma,
    max_concentration,
    stirling_remainder,
    x_trigamma_minus_one,
)

__all__ = [
    "ExponentialFamily",
    "Params",
    "Bounds",
    "fisher_solve_mean_grad",
    "mean_grad_via_autograd",
    "sum_rightmost",
    "log_minus_digamma",
    "inv_log_minus_digamma",
    "x_trigamma_minus_one",
    "digamma_diff",
    "inv_digamma",
    "dirichlet_from_mean_log",
    "exclusive_sum",
]

Params = Tuple[Tensor, ...]
#: ``(lower, upper)`` bound of each natural parameter of a box-shaped domain (``None``: unbounded)
Bounds = Tuple[Tuple[Optional[float], Optional[float]], ...]


def sum_rightmost(x: Tensor, dim: int) -> Tensor:
    """Sum out the ``dim`` rightmost dimensions of ``x`` (``dim = 0`` returns ``x``)."""
    return x.reshape(x.shape[: x.dim() - dim] + (-1,)).sum(-1) if dim > 0 else x


def _float_value(value: Tensor) -> Tensor:
    """``value`` detached, as a floating tensor (the default dtype for integer values)."""
    v = value.detach()
    return v.to(v.dtype if v.is_floating_point() else torch.get_default_dtype())


class ExponentialFamily(abc.ABC):
    """Exponential family of one latent site with shape ``event_shape``.

    Subclasses implement the maps between natural parameters, mean parameters and
    ``torch.distributions`` objects. Generic defaults are provided for ``inner``,
    ``entropy`` (``A - <lam, mu> - E[log h]``) and ``kl`` (the Bregman divergence
    ``A(lam_p) - A(lam_q) - <lam_p - lam_q, mu_q>``).
    """

    name: str = ""
    #: human readable description of the natural-parameter domain, used in error messages
    domain: str = ""
    #: ``True`` for finite-valued families (CVI enumerates them instead of sampling)
    is_discrete: bool = False
    #: whether ``q`` starts, without ``init_loc_fn``, at ``natural_at`` the prior mean given
    #: the parents' prior means (:func:`~pyro_cvi.blocks.natural.initial_natural`)
    starts_at_mean: bool = False
    #: ``True`` for the Gaussian families (affine conjugacy, the site form, Bonnet/Price)
    is_gaussian: bool = False
    #: a full-covariance Gaussian (one joint Gaussian over the flattened event)
    full_covariance: bool = False
    #: number of values of one entry of a discrete family (``None`` for continuous families)
    num_values: Optional[int] = None
    #: ``((lo, hi), ...)`` per natural parameter when the natural domain is the open box
    #: ``lo < lam_i < hi`` (elementwise; ``None``: unbounded); ``None`` if it is not a box
    natural_bounds: Optional[Bounds] = None
    #: ``True`` when the last value dim holds one vector-valued draw (a Dirichlet's simplex),
    #: ``False`` when the value's entries are scalars
    vector_valued: bool = False

    def __init__(self, event_shape: Sequence[int] = ()) -> None:
        self.event_shape = torch.Size(event_shape)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(event_shape={tuple(self.event_shape)})"

    # ------------------------------------------------------------------ shapes
    @property
    def event_dim(self) -> int:
        """Number of event dimensions of a *value* of the site."""
        return len(self.event_shape)

    @property
    @abc.abstractmethod
    def param_shapes(self) -> Tuple[torch.Size, ...]:
        """Trailing shape of each natural/mean parameter tensor."""

    @property
    def num_params(self) -> int:
        """Total number of scalar entries of one (batch element's) parameter tuple."""
        return sum(s.numel() for s in self.param_shapes)

    def batch_shape(self, params: Params) -> torch.Size:
        """Broadcast batch shape of a parameter tuple."""
        shapes = [p.shape[: p.dim() - len(s)] for p, s in zip(params, self.param_shapes)]
        return torch.Size(broadcast_shape(*shapes))  # (torch's imports sympy on first use)

    def value_batch_shape(self, x: Tensor) -> torch.Size:
        """Batch shape of a value ``x`` of the site."""
        return x.shape[: x.dim() - self.event_dim]

    def flatten(self, params: Params) -> Tensor:
        """Concatenate a parameter tuple into one ``[*batch, num_params]`` tensor."""
        batch = self.batch_shape(params)
        parts = [
            p.expand(batch + s).reshape(batch + (-1,)) for p, s in zip(params, self.param_shapes)
        ]
        return torch.cat(parts, dim=-1)

    def unflatten(self, flat: Tensor) -> Params:
        """Inverse of :meth:`flatten`."""
        batch = flat.shape[:-1]
        sizes = [s.numel() for s in self.param_shapes]
        chunks = torch.split(flat, sizes, dim=-1)
        return tuple(c.reshape(batch + s) for c, s in zip(chunks, self.param_shapes))

    def zero_natural(
        self,
        batch_shape: Sequence[int] = (),
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
    ) -> Params:
        """All-zero natural parameters (e.g. to accumulate site messages ``lam~``)."""
        batch = torch.Size(batch_shape)
        return tuple(torch.zeros(batch + s, dtype=dtype, device=device) for s in self.param_shapes)

    def zeros_like_natural(self, nat: Params) -> Params:
        """Zeros with the shapes, dtypes and devices of ``nat``."""
        return tuple(torch.zeros_like(p) for p in nat)

    # ---------------------------------------------------------------- abstract
    @abc.abstractmethod
    def natural_to_mean(self, nat: Params) -> Params:
        """``mu = grad A(lam) = E_q[phi(z)]``."""

    @abc.abstractmethod
    def mean_to_natural(self, mean: Params) -> Params:
        """Inverse of :meth:`natural_to_mean`."""

    @abc.abstractmethod
    def natural_to_dist(self, nat: Params) -> Distribution:
        """A ``pyro.distributions`` object with ``event_shape == self.event_shape``."""

    @abc.abstractmethod
    def dist_to_natural(self, d: Distribution) -> Params:
        """Natural parameters of a matching (possibly ``Independent``-wrapped) distribution."""

    @abc.abstractmethod
    def log_partition(self, nat: Params) -> Tensor:
        """``A(lam)``, summed over the event dimensions (batch-shaped)."""

    @abc.abstractmethod
    def sufficient_stats(self, x: Tensor) -> Params:
        """``phi(x)`` as a parameter-shaped tuple (batch dims taken from ``x``)."""

    @abc.abstractmethod
    def _in_domain(self, nat: Params) -> Tensor:
        """Elementwise/batch check of the natural domain, assuming finite entries."""

    # ----------------------------------------------------------------- generic
    def base_log_measure(self, x: Tensor) -> Tensor:
        """``log h(x)`` summed over event dims; zero unless overridden."""
        dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
        return torch.zeros(self.value_batch_shape(x), dtype=dtype, device=x.device)

    def _expected_base_log_measure(self, nat: Params) -> Tensor:
        """``E_q[log h(z)]``; zero unless overridden."""
        return torch.zeros((), dtype=nat[0].dtype, device=nat[0].device)

    def inner(self, a: Params, b: Params) -> Tensor:
        """``<a, b> = sum_i sum(a_i * b_i)`` over each parameter's event dims (batch-shaped)."""
        total = None
        for ai, bi, s in zip(a, b, self.param_shapes):
            term = sum_rightmost(ai * bi, len(s))
            total = term if total is None else total + term
        return total

    def log_prob(self, nat: Params, x: Tensor) -> Tensor:
        """``log h(x) + <lam, phi(x)> - A(lam)``."""
        return (
            self.base_log_measure(x)
            + self.inner(nat, self.sufficient_stats(x))
            - self.log_partition(nat)
        )

    def entropy(self, nat: Params) -> Tensor:
        """``H[q] = A(lam) - <lam, mu> - E_q[log h(z)]``."""
        mean = self.natural_to_mean(nat)
        return (
            self.log_partition(nat) - self.inner(nat, mean) - self._expected_base_log_measure(nat)
        )

    def kl(self, nat_q: Params, nat_p: Params) -> Tensor:
        """``KL(q || p) = A(lam_p) - A(lam_q) - <lam_p - lam_q, mu_q>`` (Bregman divergence)."""
        mean_q = self.natural_to_mean(nat_q)
        diff = tuple(p - q for p, q in zip(nat_p, nat_q))
        return self.log_partition(nat_p) - self.log_partition(nat_q) - self.inner(diff, mean_q)

    def is_valid(self, nat: Params) -> Tensor:
        """Batch-shaped bool: all entries finite and inside the natural domain."""
        finite = None
        for p, s in zip(nat, self.param_shapes):
            ok = torch.isfinite(p)
            ok = ok.reshape(ok.shape[: ok.dim() - len(s)] + (-1,)).all(-1) if len(s) else ok
            finite = ok if finite is None else finite & ok
        safe = tuple(torch.where(torch.isfinite(p), p, torch.zeros_like(p)) for p in nat)
        return finite & self._in_domain(safe)

    def validate(self, nat: Params, site_name: str = "<unnamed>") -> None:
        """Raise ``ValueError`` naming the site and the first invalid batch entry, if any."""
        valid = self.is_valid(nat)
        if bool(valid.all()):
            return
        bad = (~valid).nonzero()[0].tolist()
        batch = self.batch_shape(nat)
        values = []
        for i, (p, s) in enumerate(zip(nat, self.param_shapes)):
            entry = p.expand(batch + s)[tuple(bad)].detach().flatten().cpu()
            text = ", ".join(f"{v:.6g}" for v in entry[:8].tolist())
            more = ", ..." if entry.numel() > 8 else ""
            values.append(f"nat[{i}]=[{text}{more}]")
        raise ValueError(
            f"site '{site_name}': invalid natural parameters for the {self.name} family "
            f"(event_shape={tuple(self.event_shape)}) at batch index {tuple(bad)}: "
            f"{'; '.join(values)}. Expected finite values with {self.domain}."
        )

    def limit_natural(self, nat: Params) -> Params:
        """Project ``nat`` onto the part of the domain the dtype can represent meaningfully
        (identity by default; the concentration families cap their concentrations at
        :func:`~pyro_cvi.families.special.max_concentration`, keeping the mean)."""
        return nat

    def symmetrize(self, params: Params) -> Params:
        """Project a parameter-shaped tuple onto the parameter space (identity by default)."""
        return params

    # ------------------------------------------------------------- CVI helpers
    def mean_grad(self, nat: Params, grad_nat: Params) -> Params:
        """``df/dmu = F(lam)^{-1} df/dlam`` (eq. 72) from the gradient w.r.t. ``lam``.

        Default: :func:`fisher_solve_mean_grad` (Fisher matrix by double autograd; detached).
        Families with a small Fisher matrix override this with a closed-form solve.
        """
        return fisher_solve_mean_grad(self, nat, grad_nat)

    def natural_at(self, value: Tensor, prior_nat: Optional[Params] = None) -> Params:
        """Natural parameters of a ``q`` with mean ``value`` and the spread of ``prior_nat``
        (natural parameters of a prior of this family, batch-shaped like ``value``; ``None``:
        a unit spread). Default (no mean-matching map): ``prior_nat`` itself, else zeros."""
        if prior_nat is not None:
            return prior_nat
        v = _float_value(value)
        return self.zero_natural(self.value_batch_shape(v), v.dtype, v.device)

    def natural_with_spread(self, value: Tensor, scale: float) -> Params:
        """Natural parameters of a ``q`` at ``value`` with spread ``scale`` (the standard
        deviation on the family's natural unconstrained scale, as AutoNormal's
        ``init_scale``). Default: :meth:`natural_at` with a unit spread."""
        return self.natural_at(value, None)

    def mean_value(self, nat: Params, mean: Params) -> Optional[Tensor]:
        """The plug-in value ``E_q[z]`` (shaped like a sample) at which conjugate factors are
        evaluated, differentiable w.r.t. ``mean`` where it is a function of it; ``None`` for
        families that are not plugged in (discrete families are enumerated)."""
        return None

    def geometric_mean(self, nat: Params, mean: Params) -> Optional[Tensor]:
        """``exp(E_q[log z])`` (shaped like a sample) for positive families whose monomial
        parameters enter through ``E[log theta]``; ``None`` otherwise."""
        return None

    def probs(self, mean: Params) -> Tensor:
        """``q`` probabilities of the ``num_values`` values on a new last dim (discrete only)."""
        raise NotImplementedError(f"{self.name} family is not discrete")

    def variance_along(self, mean: Params, A: Tensor) -> Tensor:
        """``diag(A Cov(z) A^T)`` for ``A`` of shape ``(R, numel z)`` (Gaussian only)."""
        raise NotImplementedError(f"{self.name} family is not Gaussian")

    def marginal_variance(self, mean: Params) -> Tensor:
        """``Var(z_i)`` of every entry, shaped like ``mean[0]`` (Gaussian only)."""
        raise NotImplementedError(f"{self.name} family is not Gaussian")

    def fisher_null_projector(self, dtype: torch.dtype, device: torch.device) -> Optional[Tensor]:
        """Projector onto directions where the flattened Fisher matrix is singular by design."""
        return None


# ---------------------------------------------------------------------------------------------
# Fisher solve (Appendix F)
# ---------------------------------------------------------------------------------------------
def _fisher_matrix(family: ExponentialFamily, nat: Params) -> Tensor:
    """Hessian of ``A`` w.r.t. the flattened natural parameters, ``[*batch, P, P]``."""
    flat = family.flatten(tuple(p.detach() for p in nat)).requires_grad_(True)
    with torch.enable_grad():
        total = family.log_partition(family.unflatten(flat)).sum()
        (mu,) = torch.autograd.grad(total, flat, create_graph=True)
        rows = [
            torch.autograd.grad(mu[..., i].sum(), flat, retain_graph=True)[0]
            for i in range(mu.shape[-1])
        ]
    return torch.stack(rows, dim=-2)


def fisher_solve_mean_grad(family: ExponentialFamily, nat: Params, grad_nat: Params) -> Params:
    """Return ``df/dmu = F(lam)^{-1} df/dlam`` (eq. 72), batched over leading dims.

    ``F = d^2 A / d lam^2`` is formed by double autograd through ``family.log_partition``
    (so this is meant for the small parameter vectors of Gamma/Beta/Dirichlet/small
    Gaussians). Directions in which the flattened Fisher is singular by construction (the
    antisymmetric part of a full Gaussian's ``eta2``) are handled by symmetrising the
    gradient and regularising only that null space. The result is detached.
    """
    fisher = _fisher_matrix(family, nat)
    null = family.fisher_null_projector(fisher.dtype, fisher.device)
    if null is not None:
        fisher = fisher + null
    batch = fisher.shape[:-2]
    grad = family.flatten(family.symmetrize(tuple(g.detach() for g in grad_nat)))
    grad = grad.expand(batch + grad.shape[-1:])
    sol = torch.linalg.solve(fisher, grad.unsqueeze(-1)).squeeze(-1)
    return family.unflatten(sol)


def mean_grad_via_autograd(
    family: ExponentialFamily,
    nat: Params,
    f: Callable[[Params], Tensor],
    wrt: str = "mean",
) -> Params:
    """``df/dmu`` by autograd w.r.t. ``lam`` followed by a Fisher solve (Appendix F).

    ``wrt="mean"``: ``f`` takes the mean parameters (it is composed with
    :meth:`natural_to_mean`); ``wrt="natural"``: ``f`` takes the natural parameters directly,
    e.g. a reparameterised Monte Carlo estimate of ``E_q[h(z)]`` built on
    ``family.natural_to_dist(nat).rsample()``. The output of ``f`` is summed, so batched
    ``f`` gives per-batch-element gradients.
    """
    if wrt not in ("mean", "natural"):
        raise ValueError(f"wrt must be 'mean' or 'natural', got {wrt!r}")
    leaves = tuple(p.detach().requires_grad_(True) for p in nat)
    with torch.enable_grad():
        arg = family.natural_to_mean(leaves) if wrt == "mean" else leaves
        value = f(arg).sum()
        grads = torch.autograd.grad(value, leaves, allow_unused=True)
    grads = tuple(torch.zeros_like(p) if g is None else g for p, g in zip(leaves, grads))
    return fisher_solve_mean_grad(family, nat, grads)
