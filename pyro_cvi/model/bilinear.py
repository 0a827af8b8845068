"""Bilinear Normal factors (probabilistic PCA, factor analysis): detection.

A factor ``x_n ~ Normal(z_n W + mu + c0_n, (c_n tau)^(-1/2))`` with

* ``z`` a plated Gaussian latent (``[N, K]``, one ``K``-vector per point) and ``W`` a global
  Gaussian latent (``[K, D]``, or ``[D, K]`` used as ``W^T``), both with Normal priors free of
  latents and of learnable parameters;
* optionally ``mu`` a global Gaussian latent of shape ``[D]`` (a mean; Normal prior as above);
* a noise latent ``v`` (one, or one per column: anything broadcasting to ``[N, D]``) with
  ``tau = v^k`` the precision: a precision (``k = 1``), a scale (``k = -2``) or a variance
  (``k = -1``), its prior free of latents on the positive reals;
* ``c0``, ``c`` free of every latent (data), confirmed by probing,

is conjugate to each of ``z``, ``(W, mu)`` given the others: given ``W``, ``mu``, ``tau`` a
Gaussian linear regression for each ``z_n``; given ``z`` and ``tau`` one for each column
``(w_d, mu_d)`` (``z_n`` augmented by a constant 1); given ``z``, ``W``, ``mu`` it is linear in
``(log tau, tau)``. Algorithm 2's message to each (eq. 20) needs only ``E[z_n]``,
``E[z_n z_n^T]``, ``E[(w_d, mu_d)]``, its second moment, ``E[tau]`` and ``E[log tau]`` under
the others' ``q``, all closed-form: the exact expected natural parameters, i.e. mean-field VMP /
CAVI. With a Gamma prior on a precision (``k = 1``) ``q(tau)`` is the exact Gamma conditional;
any other prior on ``v`` is one non-conjugate factor ``f(tau) = log p_v(tau^(1/k)) +
log|1/k| + (1/k - 1) log tau`` on ``q(tau)`` (a one-dimensional CVI site, eq. 12). When the
latents touch no other factor, they form one block (:mod:`pyro_cvi.blocks.bilinear`) that
owns the factors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Set, Tuple

import torch
from torch.distributions import constraints

from ..families.shapes import broadcast_shapes
from . import probes
from .records import CONJUGATE, GENERAL, PRIOR, Factor
from .tracing import is_random, unwrap

__all__ = ["BilinearSpec", "bilinear_factor", "bilinear_owner", "find_bilinear", "BILINEAR_FORM"]

#: the form of a latent held by a bilinear block
BILINEAR_FORM = "bilinear"

#: the links ``tau = v^k`` a noise latent may have: precision, scale, variance
_POWERS = (1.0, -2.0, -1.0)


@dataclass
class BilinearSpec:
    """One bilinear Normal factor and its latents (see the module docstring)."""

    obs: str
    z: str
    W: str
    #: the noise latent ``v`` (``tau = v^power`` the precision)
    tau: str
    #: whether ``loc = z @ W.T`` (``W`` stored ``[D, K]``)
    transposed: bool
    #: ``[N, D]`` constants: the loc offset ``c0`` and the precision multiplier ``c``
    offset: torch.Tensor
    weight: torch.Tensor
    #: the mean latent (``[D]``), if any
    mu: Optional[str] = None
    #: ``k`` of ``tau = v^k``: 1 precision, -2 scale, -1 variance
    power: float = 1.0
    #: whether ``v``'s prior is conjugate (a Gamma prior on a precision)
    conjugate: bool = True

    @property
    def names(self) -> List[str]:
        mid = [self.mu] if self.mu is not None else []
        return [self.W, *mid, self.tau, self.z]

    @property
    def label(self) -> str:
        return ", ".join([self.z, self.W, *([self.mu] if self.mu else []), self.tau])


def _plain(node) -> bool:
    """An unweighted site (no ``poutine.scale``, no mask)."""
    scale = node.get("scale", 1.0)
    if torch.is_tensor(scale):
        if scale.numel() != 1 or float(scale) != 1.0:
            return False
    elif scale != 1.0:
        return False
    return node.get("mask") is None and unwrap(node["fn"])[1] is None


def _constant(*ts) -> bool:
    return all(not (torch.is_tensor(t) and t.requires_grad) for t in ts)


def _free(an, name: str):
    """The site's base distribution when its parameters are free of latents and of learnable
    parameters and the site is unweighted; else ``None``."""
    node = an.run().nodes[name]
    base = unwrap(node["fn"])[0]
    if an.deps.get(name) or not _plain(node):
        return None
    params, inner = [], [base]
    while inner:  # (the parameters of a transformed or reinterpreted law are inside it)
        d = inner.pop()
        params += [v for v in vars(d).values() if torch.is_tensor(v)]
        inner += [v for v in vars(d).values() if isinstance(v, torch.distributions.Distribution)]
    return base if _constant(*params) else None


def _prior(an, name: str, cls) -> Optional[object]:
    """The site's base distribution when it is a ``cls`` free of latents and of learnable
    parameters, unweighted."""
    base = _free(an, name)
    return base if isinstance(base, cls) else None


def _positive_prior(an, name: str) -> bool:
    """Whether the site's prior is free (:func:`_free`) with support in the positive reals."""
    base = _free(an, name)
    if base is None:
        return False
    sup = base.support
    while isinstance(sup, constraints.independent):
        sup = sup.base_constraint
    if sup is constraints.positive or sup is constraints.nonnegative:
        return True
    return isinstance(sup, constraints.greater_than) and float(sup.lower_bound) >= 0


def _roles(an, site: str) -> Optional[Tuple[str, str, Optional[str], str]]:
    """``(z, W, mu or None, v)`` of factor ``site`` by their shapes and families, or ``None``."""
    lat = an.latents_of(site)
    if len(lat) not in (3, 4) or site in lat:
        return None
    fam = {n: an.latents[n].family for n in lat}
    gau = [n for n in lat if fam[n] is not None and fam[n].is_gaussian]
    rest = [n for n in lat if n not in gau]
    if len(rest) != 1 or len(gau) != len(lat) - 1 or fam[rest[0]] is None:
        return None
    plated = [n for n in gau if an.latents[n].frames]
    if len(plated) != 1:
        return None
    (z,) = plated
    glob = sorted((n for n in gau if n != z), key=lambda n: -an.values[n].dim())
    if len(glob) == 1:
        return z, glob[0], None, rest[0]
    W, mu = glob
    if an.values[W].dim() != 2 or an.values[mu].dim() != 1:
        return None
    return z, W, mu, rest[0]


def _check(an, site: str, z: str, W: str, mu: Optional[str], tau: str) -> Optional[BilinearSpec]:
    node = an.structure.nodes[site]
    X = node["value"]
    if not node["is_observed"] or not _plain(node) or X.dim() != 2 or X.requires_grad:
        return None
    N, D = X.shape
    zi, Wi = an.latents[z], an.latents[W]
    if tuple(an.values[z].shape) != (N, zi.event_shape[-1] if zi.event_shape else -1):
        return None
    if len(zi.frames) != 1 or zi.frames[0].dim != -1 or Wi.frames or an.latents[tau].frames:
        return None
    K = an.values[z].shape[1]
    if tuple(an.values[W].shape) == (K, D):
        transposed = False
    elif tuple(an.values[W].shape) == (D, K):
        transposed = True
    else:
        return None
    gaussians = [z, W] + ([mu] if mu is not None else [])
    if any(_prior(an, n, torch.distributions.Normal) is None for n in gaussians):
        return None
    if mu is not None and (an.latents[mu].frames or tuple(an.values[mu].shape) != (D,)):
        return None
    if not _positive_prior(an, tau):
        return None
    t0 = an.values[tau]
    try:
        if broadcast_shapes(t0.shape, (N, D)) != (N, D):
            return None
    except (RuntimeError, ValueError):
        return None
    rtol = probes.rtol(X.dtype)
    g = torch.Generator().manual_seed(4321)

    def rand(shape, positive=False):
        u = (
            torch.rand(shape, generator=g, dtype=torch.float64, device=g.device)
            if positive
            else torch.randn(shape, generator=g, dtype=torch.float64, device=g.device)
        )
        return (0.5 + u if positive else u).to(X)

    def read(**values):
        fn = unwrap(an.run(**values).nodes[site]["fn"])[0]
        if not isinstance(fn, torch.distributions.Normal) or not _constant(fn.loc, fn.scale):
            return None
        return fn.loc.expand(N, D), fn.scale.expand(N, D)

    Ws = an.values[W].shape
    z1, W1, t1, t2 = rand((N, K)), rand(Ws), rand(t0.shape, True), rand(t0.shape, True)
    m0 = {mu: torch.zeros(D, dtype=X.dtype, device=X.device)} if mu is not None else {}
    reads = [
        read(**{z: torch.zeros_like(z1), W: W1, tau: t1}, **m0),
        read(**{z: z1, W: torch.zeros_like(W1), tau: t2}, **m0),
        read(**{z: z1, W: W1, tau: t1}, **m0),
    ]
    m1 = rand((D,))
    if mu is not None:
        reads.append(read(**{z: z1, W: W1, tau: t1, mu: m1}))
    if any(r is None for r in reads):
        return None
    (c0, s1), (c0b, s2), (loc, s1b) = reads[:3]
    W1m = W1.transpose(-1, -2) if transposed else W1

    def close(a, b):
        return bool(torch.allclose(a, b, rtol=rtol, atol=rtol * (1 + float(b.abs().max()))))

    if not (close(c0, c0b) and close(loc - c0, z1 @ W1m) and close(s1, s1b)):
        return None
    if mu is not None:
        loc4, s4 = reads[3]
        if not (close(loc4 - loc, m1.expand(N, D)) and close(s4, s1)):
            return None
    for k in _POWERS:  # the precision is c v^k: which k makes c the same at two values of v
        c1 = s1.pow(-2) / t1.pow(k).expand(N, D)
        c2 = s2.pow(-2) / t2.pow(k).expand(N, D)
        if close(c1, c2) and bool((c1 > 0).all()):
            break
    else:
        return None
    conj = k == 1.0 and _prior(an, tau, torch.distributions.Gamma) is not None
    return BilinearSpec(
        site, z, W, tau, transposed, c0.detach(), c1.detach(), mu=mu, power=k, conjugate=conj
    )


def find_bilinear(an, chosen: Set[str]) -> List[BilinearSpec]:
    """The bilinear Normal factors whose latents touch nothing else (no other factor than
    their priors and it), no subsampled plate, no user-chosen family."""
    if an.minibatch_plates or an.discrete:
        return []
    out: List[BilinearSpec] = []
    taken: Set[str] = set()
    for site, node in an.structure.nodes.items():
        if not is_random(node) or site in an.leaves or site in an.latents:
            continue
        roles = _roles(an, site)
        if roles is None:
            continue
        names = {n for n in roles if n is not None}
        if names & (taken | chosen):
            continue
        others = [
            s
            for s, nd in an.structure.nodes.items()
            if is_random(nd) and s != site and s not in names and an.latents_of(s) & names
        ]
        if others:
            continue
        spec = _check(an, site, *roles)
        if spec is not None:
            out.append(spec)
            taken |= names
    return out


def bilinear_owner(spec: BilinearSpec) -> str:
    """The owner of the factors' ELBO terms (``analysis.owner``)."""
    return f"bilinear {spec.obs}"


def bilinear_factor(an, site: str) -> bool:
    """Record factor ``site`` when it belongs to a bilinear block (its owner and its
    (factor, latent) records); ``False`` otherwise."""
    for spec in an.bilinear:
        if site != spec.obs and site not in spec.names:
            continue
        an.owner[site] = bilinear_owner(spec)
        if site == spec.obs:
            for n in spec.names:
                others = ", ".join(m for m in spec.names if m != n)
                why = (
                    f"bilinear Normal given {others}: exact expected natural parameter "
                    "(E[z z^T], E[W W^T], E[tau], E[log tau]; VMP, eq. 20)"
                )
                an.latents[n].factors.append(Factor(site, n, CONJUGATE, why))
        elif site == spec.tau and not spec.conjugate:
            why = (
                "prior on the noise, not conjugate to the Gamma q of its precision: "
                "a CVI site on q(tau) (quadrature, eq. 12)"
            )
            an.latents[site].factors.append(Factor(site, site, GENERAL, why))
        else:
            fam = an.latents[site].family.name
            why = f"{fam} prior (same family as q): exact"
            an.latents[site].factors.append(Factor(site, site, PRIOR, why))
        return True
    return False
