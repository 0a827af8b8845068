"""Registry of conditionally conjugate (likelihood, parameter, q family) patterns.

Assumption 4 of Khan & Lin (2017) splits ``log p(x_a | x_pa_a)`` of a factor ``a`` into a part
that is linear in the sufficient statistics ``phi_i(z_i)`` of each latent parent ``z_i`` and a
non-conjugate rest (eq. 18). When the factor is *entirely* conjugate, i.e. ``log p_a`` is
multilinear in the statistics of all its latents, its expectation under a mean-field ``q`` is a
multilinear function of the mean parameters ``mu_j = E_q[phi_j(z_j)]``, and the VMP message to
``z_i`` is (eqs. 20 and 89)

    eta~_{a,i} = E_{q/i}[eta_{a,i}(x_{a/i})] = grad_{mu_i} E_q[log p_a].

This module says which factors are of that kind and gives ``E_q[log p_a]`` in closed form, as a
differentiable function of the mean parameters. Each distribution parameter plays a *role*:

==========  =====================================================  =========================
role        form (confirmed by probing the model)                  expectations used
==========  =====================================================  =========================
const       no continuous latent parent (discrete parents are      the value itself
            enumerated)
monomial    ``theta = c * z1[e1] * z2[e2] ...`` for Gamma latents  ``E[theta]``: model run at
            (affine *and* log-affine in each parent, probed)       ``E z``; ``E[log theta]``:
                                                                   run at ``exp(E log z)``
affine      ``theta = sum_g A_g z_g + b`` for Gaussian latents     ``E[theta]``: run at the
            (joint affinity probed; ``A`` by autograd)             means; ``Var = A Sigma A^T``
identity    ``theta = z[idx]`` for one Beta / Dirichlet latent     ``E[log theta]`` gathered
            (``idx`` found and confirmed by tagging)               from ``mu``
==========  =====================================================  =========================

``Normal`` is read as ``(loc, precision = scale^-2)``. The patterns (with the value of the
site, when it is latent, in the q family given):

* ``Normal(x | loc: affine, precision: monomial)``, x Gaussian
* ``Gamma(x | concentration: const, rate: monomial)``, x Gamma
* ``Exponential(x | rate: monomial)``, x Gamma; ``Poisson(y | rate: monomial)``
* ``Beta(x | const, const)``, x Beta; ``Dirichlet(x | const)``, x Dirichlet
* ``Bernoulli / Binomial / Geometric(y | probs: identity Beta)``
* ``Categorical / Multinomial(y | probs: identity Dirichlet)``

and any distribution whose parameters are all ``const`` with an observed or enumerated value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.distributions as tdist
import torch.nn.functional as F

from ..families import Bernoulli, Beta, Categorical, Dirichlet, Gamma, Gaussian, GaussianDiag
from .probes import close

__all__ = [
    "CONST",
    "MONOMIAL",
    "AFFINE",
    "IDENTITY",
    "Pattern",
    "Role",
    "lookup",
    "PATTERNS",
    "check_monomial",
    "find_identity_index",
]

CONST = "const"
MONOMIAL = "monomial"
AFFINE = "affine"
IDENTITY = "identity"

_LOG_2PI = math.log(2 * math.pi)


@dataclass
class Role:
    """How one distribution parameter depends on the latents (see the module docstring)."""

    kind: str
    parents: Tuple[str, ...] = ()
    idx: Optional[torch.Tensor] = None  # identity: index of the parent's batch row per entry
    text: str = ""


@dataclass(frozen=True)
class Pattern:
    """A conjugate pattern: the roles each parameter may take and ``E_q[log p]``."""

    name: str
    classes: Tuple[type, ...]
    #: parameter -> (role kinds allowed besides const, q family classes the parents must have)
    params: Dict[str, Tuple[Tuple[str, ...], Tuple[type, ...]]]
    #: q family classes allowed for a latent value of the site (discrete ones: enumerated)
    value_families: Tuple[type, ...]
    #: elementwise ``E_q[log p]`` (before masking/scaling) from a :class:`FactorMoments`
    elp: Callable = field(compare=False)

    def read(self, base, name: str) -> torch.Tensor:
        """The parameter ``name`` of a distribution object (``precision`` = ``scale^-2``)."""
        if name == "precision":
            return base.scale.pow(-2)
        v = getattr(base, name)
        return v if torch.is_tensor(v) else torch.as_tensor(v)


# -------------------------------------------------------------------------------------------------
# Expected log-densities. ``m`` is a FactorMoments (expectations.py) giving, per parameter,
# E(name), Elog(name), Elog1m(name), Var(name), Elogvec(name), and for the value x:
# m.x (observed / enumerated), or the moments m.Ex, m.Vx, m.Elogx, m.Elog1mx of a latent value.
# -------------------------------------------------------------------------------------------------
def _normal_elp(m):
    Ex, Vx = m.x_gauss()
    Eloc, Vloc = m.E("loc"), m.Var("loc")
    Etau, Elogtau = m.E("precision"), m.Elog("precision")
    return 0.5 * (Elogtau - _LOG_2PI) - 0.5 * Etau * ((Ex - Eloc).square() + Vx + Vloc)


def _gamma_elp(m):
    a = m.E("concentration")
    Elogx, Ex = m.x_gamma()
    return a * m.Elog("rate") - torch.lgamma(a) + (a - 1) * Elogx - m.E("rate") * Ex


def _exponential_elp(m):
    _, Ex = m.x_gamma()
    return m.Elog("rate") - m.E("rate") * Ex


def _poisson_elp(m):
    y = m.x_float()
    return y * m.Elog("rate") - m.E("rate") - torch.lgamma(y + 1)


def _beta_elp(m):
    c1, c0 = m.E("concentration1"), m.E("concentration0")
    Elogx, Elog1mx = m.x_beta()
    lbeta = torch.lgamma(c1) + torch.lgamma(c0) - torch.lgamma(c1 + c0)
    return (c1 - 1) * Elogx + (c0 - 1) * Elog1mx - lbeta


def _dirichlet_elp(m):
    c = m.E("concentration")
    Elogx = m.x_dirichlet()
    return ((c - 1) * Elogx).sum(-1) + torch.lgamma(c.sum(-1)) - torch.lgamma(c).sum(-1)


def _bernoulli_elp(m):
    y = m.x_float()
    return y * m.Elog("probs") + (1 - y) * m.Elog1m("probs")


def _binomial_elp(m):
    y, n = m.x_float(), m.E("total_count")
    log_comb = torch.lgamma(n + 1) - torch.lgamma(y + 1) - torch.lgamma(n - y + 1)
    return log_comb + y * m.Elog("probs") + (n - y) * m.Elog1m("probs")


def _geometric_elp(m):
    y = m.x_float()
    return m.Elog("probs") + y * m.Elog1m("probs")


def _categorical_elp(m):
    logp = m.Elogvec("probs")
    y = m.x
    return (F.one_hot(y.long(), logp.shape[-1]).to(logp.dtype) * logp).sum(-1)


def _multinomial_elp(m):
    y, logp = m.x_float(), m.Elogvec("probs")
    n = y.sum(-1)
    return torch.lgamma(n + 1) - torch.lgamma(y + 1).sum(-1) + (y * logp).sum(-1)


_GAUSS = (Gaussian, GaussianDiag)
_DISCRETE = (Bernoulli, Categorical)  # an enumerated value
PATTERNS: Tuple[Pattern, ...] = (
    Pattern(
        "Normal",
        (tdist.Normal,),
        {"loc": ((AFFINE,), _GAUSS), "precision": ((MONOMIAL,), (Gamma,))},
        _GAUSS,
        _normal_elp,
    ),
    Pattern(
        "Gamma",
        (tdist.Gamma,),
        {"concentration": ((), ()), "rate": ((MONOMIAL,), (Gamma,))},
        (Gamma,),
        _gamma_elp,
    ),
    Pattern(
        "Exponential",
        (tdist.Exponential,),
        {"rate": ((MONOMIAL,), (Gamma,))},
        (Gamma,),
        _exponential_elp,
    ),
    Pattern("Poisson", (tdist.Poisson,), {"rate": ((MONOMIAL,), (Gamma,))}, (), _poisson_elp),
    Pattern(
        "Beta",
        (tdist.Beta,),
        {"concentration1": ((), ()), "concentration0": ((), ())},
        (Beta,),
        _beta_elp,
    ),
    Pattern(
        "Dirichlet", (tdist.Dirichlet,), {"concentration": ((), ())}, (Dirichlet,), _dirichlet_elp
    ),
    Pattern(
        "Bernoulli",
        (tdist.Bernoulli,),
        {"probs": ((IDENTITY,), (Beta,))},
        _DISCRETE,
        _bernoulli_elp,
    ),
    Pattern(
        "Binomial",
        (tdist.Binomial,),
        {"probs": ((IDENTITY,), (Beta,)), "total_count": ((), ())},
        (),
        _binomial_elp,
    ),
    Pattern("Geometric", (tdist.Geometric,), {"probs": ((IDENTITY,), (Beta,))}, (), _geometric_elp),
    Pattern(
        "Categorical",
        (tdist.Categorical,),
        {"probs": ((IDENTITY,), (Dirichlet,))},
        _DISCRETE,
        _categorical_elp,
    ),
    Pattern(
        "Multinomial",
        (tdist.Multinomial,),
        {"probs": ((IDENTITY,), (Dirichlet,))},
        (),
        _multinomial_elp,
    ),
)


def lookup(base) -> Optional[Pattern]:
    """The pattern for a distribution object (by class, most specific first), or ``None``.

    ``OneHotCategorical`` and other subclasses with a different value space are excluded by
    the exact class check on the registered torch classes' subclasses below.
    """
    for cls in type(base).__mro__:
        for p in PATTERNS:
            if cls in p.classes:
                if isinstance(base, tdist.OneHotCategorical):
                    return None
                return p
    return None


# -------------------------------------------------------------------------------------------------
# Probes
# -------------------------------------------------------------------------------------------------
def check_monomial(
    theta_of: Callable[[torch.Tensor], torch.Tensor], z0: torch.Tensor, rtol: float
) -> Optional[str]:
    """Confirm ``theta(z) = c * z[e]`` per entry (or free of ``z``) for a positive latent ``z``.

    ``theta`` must be affine in ``z`` (``f(z+d1+d2) + f(z) = f(z+d1) + f(z+d2)``) and log-affine
    (``f(z r1 r2) f(z) = f(z r1) f(z r2)``) on random positive perturbations. A function that is
    both, on the positive orthant, is ``c * z_e`` for a single element ``e`` or a constant, so
    ``E[theta] = theta(E z)`` and ``E[log theta] = log theta(exp(E log z))``. Returns ``None``
    when confirmed, else the reason.
    """
    g = torch.Generator(device="cpu").manual_seed(1234)

    def rand(lo, hi):
        u = torch.rand(z0.shape, generator=g, dtype=torch.float64, device=g.device)
        return (lo + (hi - lo) * u).to(dtype=z0.dtype, device=z0.device)

    # probe around a well-conditioned point (entries of comparable size), not the prior draw:
    # a near-zero entry would make e.g. z1 + z2 look like a monomial in z2
    z0 = rand(0.5, 1.5)
    with torch.no_grad():
        f0 = theta_of(z0)
        if not bool((f0 > 0).all()):
            return "is not positive"
        r1, r2 = rand(0.5, 2.0), rand(0.5, 2.0)
        f1, f2, f12 = theta_of(z0 * r1), theta_of(z0 * r2), theta_of(z0 * r1 * r2)
        if not close(f12.log() + f0.log(), f1.log() + f2.log(), rtol):
            return "is not a monomial (log-affine) in it (probed)"
        d1, d2 = z0 * rand(0.1, 1.0), z0 * rand(0.1, 1.0)
        g1, g2, g12 = theta_of(z0 + d1), theta_of(z0 + d2), theta_of(z0 + d1 + d2)
        if not close(g12 + f0, g1 + g2, rtol):
            return "is not linear in it (probed)"
    return None


def find_identity_index(
    theta_of: Callable[[torch.Tensor], torch.Tensor],
    shape: torch.Size,
    vector: bool,
    dtype: torch.dtype,
    device,
    rtol: float,
) -> Tuple[Optional[torch.Tensor], str]:
    """Find ``idx`` with ``theta = z.reshape(-1[, K])[idx]`` by *tagging*, and confirm it.

    ``z`` is set to a value whose entries (Beta, ``vector=False``) or rows (Dirichlet,
    ``vector=True``: the last dim is the simplex) are all distinct; every entry / row of
    ``theta`` is matched to the tag it equals; a second, independent tag must give the same
    ``idx``. Returns ``(idx, "")`` or ``(None, reason)``.
    """
    idx = None
    for seed in (11, 12):
        g = torch.Generator(device="cpu").manual_seed(seed)
        if vector:
            K = shape[-1]
            rows = shape.numel() // K
            u = torch.rand(rows, K, generator=g, dtype=torch.float64, device=g.device)
            tag = -torch.log(u.clamp(min=1e-12))  # Dirichlet(1, ..., 1) rows: distinct a.s.
            tag = tag / tag.sum(-1, keepdim=True)
        else:
            n = shape.numel()
            perm = torch.randperm(n, generator=g, device=g.device)
            tag = (0.05 + 0.9 * (perm.to(torch.float64) + 0.5) / max(n, 1)).unsqueeze(-1)
        tag = tag.to(dtype=dtype, device=device)
        with torch.no_grad():
            theta = theta_of(tag.reshape(shape))
        th = theta.reshape(-1, tag.shape[-1]) if vector else theta.reshape(-1, 1)
        key, order = tag[:, 0].sort()
        pos = torch.searchsorted(key, th[:, 0].contiguous()).clamp(max=key.numel() - 1)
        lo = (pos - 1).clamp(min=0)
        pick = torch.where((key[lo] - th[:, 0]).abs() < (key[pos] - th[:, 0]).abs(), lo, pos)
        cand = order[pick]
        if not close(tag[cand], th, rtol):
            return None, "is not a copy of its entries (probed by tagging)"
        cand = cand.reshape(theta.shape[:-1] if vector else theta.shape)
        if idx is not None and not torch.equal(idx, cand):
            return None, "selects different entries for different values (probed)"
        idx = cand
    return idx, ""


def flat_rows(mu: torch.Tensor, vector: bool) -> torch.Tensor:
    """View mean parameters as rows matching :func:`find_identity_index`'s ``idx``."""
    return mu.reshape(-1, mu.shape[-1]) if vector else mu.reshape(-1)


def gather_rows(mu: torch.Tensor, idx: torch.Tensor, vector: bool) -> torch.Tensor:
    rows = flat_rows(mu, vector)
    return rows[idx]


def describe_role(pattern: Pattern, name: str, role: Role, families: Dict[str, str]) -> str:
    """Text for ``explain()``: how parameter ``name`` depends on its latents."""
    if role.kind == CONST:
        return ""
    ps = "*".join(role.parents)
    if role.kind == MONOMIAL:
        return f"{name} = c*{ps}"
    if role.kind == AFFINE:
        return f"{name} affine in {', '.join(role.parents)}"
    return f"{name} = {ps}[idx]"


def roles_text(pattern: Pattern, roles: Dict[str, Role], skip: Sequence[str] = ()) -> str:
    parts = [
        describe_role(pattern, n, r, {})
        for n, r in roles.items()
        if r.kind != CONST and n not in skip
    ]
    return ", ".join(p for p in parts if p)
