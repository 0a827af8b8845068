"""Exponential families used as CVI variational factors, and the support -> family map.

==========================  ===========================  ==================================
support                     family                       natural parameters
==========================  ===========================  ==================================
real / real_vector          :class:`Gaussian` (full),    ``(Lambda m, -Lambda / 2)``
                            :class:`GaussianDiag`        ``(m / v, -1 / (2 v))``
positive / nonnegative      :class:`Gamma`               ``(alpha - 1, -beta)``
unit_interval               :class:`Beta`                ``(alpha - 1, beta - 1)``
simplex                     :class:`Dirichlet`           ``(alpha - 1,)``
boolean                     :class:`Bernoulli`           ``(logit p,)``
integer_interval(0, K-1)    :class:`Categorical` (K)     ``(logits[:K-1] - logits[K-1],)``
==========================  ===========================  ==================================
"""

from __future__ import annotations

import numbers
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from pyro.distributions.constraints import sphere
from torch.distributions import constraints

from .base import ExponentialFamily, Params, fisher_solve_mean_grad, mean_grad_via_autograd
from .beta import Beta
from .dirichlet import Dirichlet
from .discrete import Bernoulli, Categorical
from .gamma import Gamma
from .gaussian import Gaussian, GaussianDiag
from .transformed import UnconstrainedGaussian

__all__ = [
    "ExponentialFamily",
    "Params",
    "Gaussian",
    "GaussianDiag",
    "UnconstrainedGaussian",
    "Gamma",
    "Beta",
    "Dirichlet",
    "Bernoulli",
    "Categorical",
    "family_for_support",
    "choose_family",
    "choose_families",
    "FAMILY_NAMES",
    "fisher_solve_mean_grad",
    "mean_grad_via_autograd",
]

_SUPPORTED = (
    "real/real_vector (Gaussian), positive/nonnegative (Gamma), unit_interval (Beta), "
    "simplex (Dirichlet), boolean (Bernoulli), integer_interval(0, K-1) (Categorical)"
)


def _is_number(bound: object, value: float) -> bool:
    """True if ``bound`` is the scalar ``value`` (python number or one-element tensor)."""
    if isinstance(bound, torch.Tensor):
        return bound.numel() == 1 and float(bound) == value
    return isinstance(bound, numbers.Number) and float(bound) == value


def _unsupported(support: constraints.Constraint, event_shape: torch.Size, why: str = ""):
    if support is sphere:  # Pyro's own hint for ProjectedNormal sites
        why += (
            "; for a ProjectedNormal site use "
            "poutine.reparam(model, {site: pyro.infer.reparam.ProjectedNormalReparam()})"
        )
    return ValueError(
        f"pyro_cvi has no conjugate exponential family for a site with support {support} "
        f"(event_shape={tuple(event_shape)}){why}. Supported: {_SUPPORTED}. To use CVI, "
        "reparameterize the site as a real (or positive/unit-interval/simplex) latent followed "
        "by a transform (e.g. sample a Normal latent and push it through a bijection via "
        "TransformedDistribution or pyro.deterministic), or use pyro's AutoNormal for that site "
        "(e.g. combine guides with AutoGuideList / block the site)."
    )


def family_for_support(
    support: constraints.Constraint,
    event_shape: Sequence[int] = (),
    covariance: str = "full",
) -> ExponentialFamily:
    """The exponential family matching a Pyro site's ``support`` and ``event_shape``.

    ``covariance`` (``"full"`` or ``"diag"``) selects the Gaussian family for real supports;
    ``"full"`` couples all entries of the (flattened) event. ``independent(...)`` wrappers
    are unwrapped. Raises ``ValueError`` naming the support for anything else.
    """
    if covariance not in ("full", "diag"):
        raise ValueError(f"covariance must be 'full' or 'diag', got {covariance!r}")
    event_shape = torch.Size(event_shape)
    base = support
    while isinstance(base, constraints.independent):
        base = base.base_constraint
    if support.event_dim > len(event_shape):
        raise _unsupported(
            support, event_shape, f": the support has {support.event_dim} event dims"
        )
    if isinstance(base, type(constraints.real)):
        return Gaussian(event_shape) if covariance == "full" else GaussianDiag(event_shape)
    positive = (constraints.greater_than, constraints.greater_than_eq)
    if isinstance(base, positive) and _is_number(base.lower_bound, 0.0):
        # torch's Gamma/Exponential/HalfNormal report ``nonnegative``; a Gamma q covers it
        return Gamma(event_shape)
    if (
        type(base) is constraints.interval
        and _is_number(base.lower_bound, 0.0)
        and _is_number(base.upper_bound, 1.0)
    ):
        return Beta(event_shape)
    if isinstance(base, type(constraints.simplex)):
        if len(event_shape) < 1 or event_shape[-1] < 2:
            raise _unsupported(support, event_shape, ": a simplex needs K >= 2 categories")
        return Dirichlet(event_shape)
    if isinstance(base, type(constraints.boolean)):
        return Bernoulli(event_shape)
    if isinstance(base, constraints.integer_interval) and _is_number(base.lower_bound, 0.0):
        upper = base.upper_bound
        if isinstance(upper, torch.Tensor) and upper.numel() == 1:
            upper = upper.item()
        if isinstance(upper, numbers.Number) and float(upper).is_integer() and upper >= 1:
            return Categorical(int(upper) + 1, event_shape)
    raise _unsupported(support, event_shape)


#: the names ``AutoCVI(families={site: name})`` accepts
#: (``"gaussian_diag"``: a real site's own mean-field Gaussian, out of any joint Gaussian block)
FAMILY_NAMES = (
    "gaussian",
    "gaussian_diag",
    "gamma",
    "beta",
    "dirichlet",
    "bernoulli",
    "categorical",
)


def choose_family(
    support: constraints.Constraint,
    event_shape: Sequence[int] = (),
    covariance: str = "full",
    override: Optional[str] = None,
) -> Tuple[ExponentialFamily, Optional[str]]:
    """The family of a latent site's ``q`` and, when it is the unconstrained-Gaussian fallback,
    why (``None`` for a native family).

    ``override`` is the user's choice (``AutoCVI(families=...)``): ``"gaussian"`` puts a
    Gaussian on the unconstrained space of ``biject_to(support)`` (native for real supports);
    any other name must be the support's native family. Raises ``ValueError`` saying what
    applies otherwise.
    """
    if override is not None and override not in FAMILY_NAMES:
        raise ValueError(
            f"unknown family {override!r}; AutoCVI(families=...) takes one of {FAMILY_NAMES}"
        )
    try:
        native = family_for_support(support, event_shape, covariance)
    except ValueError:
        if override not in (None, "gaussian") or support.is_discrete:
            raise
        try:
            fallback = UnconstrainedGaussian(support, event_shape)
        except NotImplementedError:  # no bijection to the reals
            raise _unsupported(support, event_shape) from None
        return fallback, f"no native family for {support}"
    if override == "gaussian_diag" and native.is_gaussian:  # mean field for this site
        return GaussianDiag(event_shape), None
    if override is None or native.name.startswith(override):
        return native, None
    if override == "gaussian" and not support.is_discrete:
        return UnconstrainedGaussian(support, event_shape), "user override (families=...)"
    options = [native.name.split("_")[0]] + ([] if support.is_discrete else ["gaussian"])
    raise ValueError(
        f"family {override!r} does not apply to a site with support {support}; use one of {options}"
    )


def choose_families(
    trace,
    names: List[str],
    covariance: str = "full",
    overrides: Optional[Dict[str, str]] = None,
    sum_out_discrete: bool = False,
) -> Tuple[Dict[str, ExponentialFamily], Dict[str, str], Set[str], Dict[str, ValueError]]:
    """:func:`choose_family` for every latent site ``names`` of a model ``trace``.

    Returns the families, the fallback sites with why, the discrete sites (with
    ``sum_out_discrete``, also the enumerable ones no family covers: they are summed out) and
    the sites no family covers with the error (the caller raises it unless the site turns
    out to be a leaf). A user override (``AutoCVI(families=...)``) that cannot apply raises.
    """
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ValueError(
            f"AutoCVI(families=...) names {unknown}, which are not latent sites of the "
            f"model; latent sites: {names}"
        )
    families: Dict[str, ExponentialFamily] = {}
    fallback: Dict[str, str] = {}
    unsupported: Dict[str, ValueError] = {}
    for name in names:
        fn = trace.nodes[name]["fn"]
        try:
            fam, why = choose_family(fn.support, fn.event_shape, covariance, overrides.get(name))
        except ValueError as e:
            if name in overrides:
                raise ValueError(f"latent site {name!r}: {e}") from None
            unsupported[name] = e
            continue
        families[name] = fam
        if why is not None:
            fallback[name] = why
    discrete = {n for n, f in families.items() if f.is_discrete}
    for name in list(unsupported):
        fn = trace.nodes[name]["fn"]
        if sum_out_discrete and fn.support.is_discrete and fn.has_enumerate_support:
            discrete.add(name)  # summed out: no q family needed
            del unsupported[name]
    return families, fallback, discrete, unsupported
