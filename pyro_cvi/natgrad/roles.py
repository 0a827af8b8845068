"""Which parameters of a guide form a Gaussian, read off Pyro's param store.

:class:`~pyro_cvi.CVI` is handed the unconstrained parameters that got gradients (Pyro's ``SVI``
does not pass the guide). Their names and constraints in the param store say which of them are
the ``loc`` and ``scale`` (or ``scale_tril``, ``cov_factor``) of one Gaussian. A name is split
into tokens at ``.`` and ``_``; exactly one token names the role, the rest is the *stem* that
pairs the roles of one Gaussian:

============================  =====================================  =======================
role                          tokens                                 constraint
============================  =====================================  =======================
``loc``                       loc, locs, mean, means, mu             real
``scale``                     scale, scales, sigma, std, stddev, sd  positive (any bijection)
``scale_tril``                scale_tril, tril, cholesky, chol       lower_cholesky
``unit_tril`` (AutoMVN)       scale_tril                             unit_lower_cholesky
``cov_factor`` (low rank)     cov_factor                             real
============================  =====================================  =======================

Families, by the roles present under one stem (shapes checked):

* ``diag``: loc + scale of the same shape: ``AutoNormal.locs.x`` / ``AutoNormal.scales.x``,
  ``AutoDiagonalNormal.loc`` / ``.scale``, a hand-written ``Normal(pyro.param("w_loc"),
  pyro.param("w_scale", constraint=positive))``;
* ``tril``: loc [..., D] + scale_tril [..., D, D] (a hand-written ``MultivariateNormal``);
* ``scaled_tril``: loc + scale + unit_tril, ``L = diag(scale) @ unit_tril``
  (``AutoMultivariateNormal``);
* ``lowrank``: loc + scale + cov_factor, ``Sigma = diag(s) (I + W W^T) diag(s)``
  (``AutoLowRankMultivariateNormal``).

Anything else (``AutoDelta`` values, flows, encoders, model hyperparameters, a loc without its
scale) is not a Gaussian here and goes to the inner torch optimizer. Names that do not follow
these conventions can be declared: ``CVI(gaussians={"w": ("my_mean", "my_sd")})``.

If a positive ``loc``/``scale`` pair is used by another location-scale family (a LogNormal, a
StudentT) the step is still a positive-definite preconditioning of the gradient, a descent
direction, and for LogNormal exactly the natural gradient (same Fisher metric).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.distributions import constraints

__all__ = ["GaussianGroup", "find_gaussians", "is_positive"]

_ROLE_TOKENS = {
    "loc": ("loc", "locs", "mean", "means", "mu"),
    "scale": ("scale", "scales", "sigma", "std", "stddev", "sd"),
    "scale_tril": ("scale_tril", "tril", "cholesky", "chol"),
    "cov_factor": ("cov_factor",),
}
_TOKEN_ROLE = {t: r for r, ts in _ROLE_TOKENS.items() for t in ts}
_SPLIT = re.compile(r"(scale_tril|cov_factor|[^._]+)")


@dataclass(frozen=True)
class GaussianGroup:
    """One Gaussian of the guide: its family and the param-store name of each role."""

    family: str  # "diag" | "tril" | "scaled_tril" | "lowrank" | "gamma" | "beta" | "dirichlet"
    names: Tuple[Tuple[str, str], ...]  # (role, param name)
    #: the guide site it was found at (:mod:`pyro_cvi.natgrad.sites`; "" when found by names)
    site: str = ""
    #: element-wise map of each role's raw parameter to the distribution parameter
    #: (empty: the param's own constraint transform)
    maps: Tuple[Tuple[str, Any], ...] = ()
    #: the loss gradients are divided by it: broadcast copies of the parameters (plates)
    #: over vectorised particles, times the site's ``poutine.scale``
    weight: float = 1.0

    @property
    def roles(self) -> Dict[str, str]:
        return dict(self.names)

    @property
    def transforms(self) -> Dict[str, Any]:
        return dict(self.maps)

    @property
    def label(self) -> str:
        roles = self.roles
        return roles["loc"] if "loc" in roles else self.names[0][1]


def _base(c):
    while isinstance(c, constraints.independent):
        c = c.base_constraint
    return c


def is_positive(c) -> bool:
    c = _base(c)
    if c is constraints.positive or type(c).__name__ == "_SoftplusPositive":
        return True
    return isinstance(c, constraints.greater_than) and float(c.lower_bound) == 0.0


def _is_real(c) -> bool:
    return _base(c) is constraints.real or _base(c) is constraints.real_vector


def _is_lower_cholesky(c) -> bool:
    return type(_base(c)).__name__ in ("_LowerCholesky", "_SoftplusLowerCholesky")


def _is_unit_lower_cholesky(c) -> bool:
    return type(_base(c)).__name__ == "_UnitLowerCholesky"


_AUTO_SITE = re.compile(r"^(.*)\.(locs|scales)\.(.+)$")
_AUTO_JOINT = re.compile(r"^(.*)\.(loc|scale|scale_tril|cov_factor)$")
_AUTO_ROLE = {"locs": "loc", "scales": "scale"}


def _role_and_stem(name: str) -> Optional[Tuple[str, str, bool]]:
    """``(role, stem, autoguide)``: Pyro's autoguide names (a first component ``Auto...``:
    ``<prefix>.locs.<site>``, ``<prefix>.loc`` ...), else a hand-written name in which exactly
    one token names a role."""
    if name.split(".")[0].startswith("Auto"):
        m = _AUTO_SITE.match(name)
        if m:
            return _AUTO_ROLE[m.group(2)], f"{m.group(1)}\0{m.group(3)}", True
        m = _AUTO_JOINT.match(name)
        if m:
            return m.group(2), f"{m.group(1)}\0", True
        return None
    tokens = _SPLIT.findall(name)
    hits = [i for i, t in enumerate(tokens) if t in _TOKEN_ROLE]
    if len(hits) != 1 or tokens.count(tokens[hits[0]]) != 1:
        return None
    token = tokens[hits[0]]
    return _TOKEN_ROLE[token], name.replace(token, "\0", 1), False


def _family(roles: Dict[str, str], values, cons, auto: bool = False) -> Optional[str]:
    """The family of one stem's roles, or ``None`` where they do not form a Gaussian. Pyro's
    autoguides constrain every scale by ``softplus_positive`` (``auto``): an ``AutoDelta`` of
    sites named ``loc`` and ``scale`` (support ``positive``) is not taken for a Gaussian."""
    if "loc" not in roles or not _is_real(cons[roles["loc"]]):
        return None
    loc = values[roles["loc"]]
    scale = roles.get("scale")
    tril = roles.get("scale_tril")
    if scale is not None and not is_positive(cons[scale]):
        return None
    if auto and (scale is None or type(_base(cons[scale])).__name__ != "_SoftplusPositive"):
        return None
    if tril is not None:
        t, c = values[tril], cons[tril]
        if t.dim() < 2 or t.shape[-2:] != (t.shape[-1], t.shape[-1]):
            return None
        if loc.shape != t.shape[:-1]:
            return None
        if scale is None and "cov_factor" not in roles and _is_lower_cholesky(c):
            return "tril"
        if scale is not None and _is_unit_lower_cholesky(c) and values[scale].shape == loc.shape:
            return "scaled_tril" if "cov_factor" not in roles else None
        return None
    if scale is None or values[scale].shape != loc.shape:
        return None
    if "cov_factor" in roles:
        w = values[roles["cov_factor"]]
        ok = loc.dim() == 1 and w.dim() == 2 and w.shape[0] == loc.shape[0]
        return "lowrank" if ok and _is_real(cons[roles["cov_factor"]]) else None
    return "diag"


def find_gaussians(
    names: Iterable[str],
    values: Mapping[str, torch.Tensor],
    cons: Mapping[str, object],
    declared: Optional[Mapping[str, Sequence[str]]] = None,
) -> List[GaussianGroup]:
    """The Gaussians whose roles are all among the param store's ``names`` and of which at
    least one member is in ``names`` (the parameters handed to the optimizer).

    :param names: the names of the parameters handed to the optimizer this step.
    :param values: constrained values of every param in the store, by name.
    :param cons: constraints of every param in the store, by name.
    :param declared: explicit groups, ``label -> (loc name, scale or scale_tril name)``.
    """
    names = set(names)
    by_stem: Dict[str, Dict[str, str]] = {}
    taken = set()
    groups = []
    for label, pair in (declared or {}).items():
        if len(pair) != 2 or any(n not in values for n in pair):
            raise ValueError(
                f"CVI(gaussians={{{label!r}: {tuple(pair)!r}}}): give the param-store names "
                "of (loc, scale) or (loc, scale_tril), both in the param store"
            )
        loc, other = pair
        role = "scale_tril" if values[other].dim() == values[loc].dim() + 1 else "scale"
        roles = {"loc": loc, role: other}
        fam = _family(roles, values, cons)
        if fam is None:
            raise ValueError(
                f"CVI(gaussians=...): {loc!r} and {other!r} are not the loc (real) and scale "
                "(positive, same shape) or scale_tril (lower_cholesky, [..., D, D]) of a Gaussian"
            )
        taken.update(pair)
        if names & set(pair):
            groups.append(GaussianGroup(fam, tuple(sorted(roles.items()))))
    auto_stems = set()
    for name in values:
        if name in taken:
            continue
        rs = _role_and_stem(name)
        if rs is None:
            continue
        role, stem, auto = rs
        if auto:
            auto_stems.add(stem)
        roles = by_stem.setdefault(stem, {})
        roles[role] = "" if role in roles else name  # "": two params of one role, ambiguous
    for stem, roles in by_stem.items():
        if "" in roles.values() or not names & set(roles.values()):
            continue
        fam = _family(roles, values, cons, stem in auto_stems)
        if fam is not None:
            groups.append(GaussianGroup(fam, tuple(sorted(roles.items()))))
    return groups
