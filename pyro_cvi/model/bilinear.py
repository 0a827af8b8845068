"""Bilinear Normal factors (probabilistic PCA, factor analysis): detection.

A factor ``x_n ~ Normal(z_n W + c0_n, (c_n tau)^(-1/2))`` with

* ``z`` a plated Gaussian latent (``[N, K]``, one ``K``-vector per point) and ``W`` a global
  Gaussian latent (``[K, D]``, or ``[D, K]`` used as ``W^T``), both with Normal priors free of
  latents and of learnable parameters;
* ``tau`` a Gamma latent (one precision, or one per column: anything broadcasting to ``[N, D]``)
  with a Gamma prior free of latents;
* ``c0``, ``c`` free of every latent (data), confirmed by probing,

is conjugate to each of the three given the other two: given ``W`` and ``tau`` it is a Gaussian
linear regression for each ``z_n``; given ``z`` and ``tau`` one for each column ``w_d``; given
``z`` and ``W`` it is linear in ``(log tau, tau)``. Algorithm 2's message to each (eq. 20) needs
only ``E[z_n]``, ``E[z_n z_n^T]``, ``E[w_d]``, ``E[w_d w_d^T]``, ``E[tau]`` and ``E[log tau]``
under the others' ``q``, all closed-form: the exact expected natural parameters, i.e. mean-field
VMP / CAVI. When the three latents touch no other factor, they form one block
(:mod:`pyro_cvi.blocks.bilinear`) that owns the four factors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Set

import torch

from ..families.gamma import Gamma
from . import probes
from .records import CONJUGATE, PRIOR, Factor
from .tracing import is_random, unwrap

__all__ = ["BilinearSpec", "bilinear_factor", "bilinear_owner", "find_bilinear", "BILINEAR_FORM"]

#: the form of a latent held by a bilinear block
BILINEAR_FORM = "bilinear"


@dataclass
class BilinearSpec:
    """One bilinear Normal factor and its three latents (see the module docstring)."""

    obs: str
    z: str
    W: str
    tau: str
    #: whether ``loc = z @ W.T`` (``W`` stored ``[D, K]``)
    transposed: bool
    #: ``[N, D]`` constants: the loc offset ``c0`` and the precision multiplier ``c``
    offset: torch.Tensor
    weight: torch.Tensor

    @property
    def names(self) -> List[str]:
        return [self.W, self.tau, self.z]

    @property
    def label(self) -> str:
        return f"{self.z}, {self.W}, {self.tau}"


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


def _prior(an, name: str, cls) -> Optional[object]:
    """The site's base distribution when it is a ``cls`` with parameters free of latents and
    of learnable parameters, unweighted."""
    node = an.run().nodes[name]
    base = unwrap(node["fn"])[0]
    if not isinstance(base, cls) or an.deps.get(name) or not _plain(node):
        return None
    params = (
        (base.loc, base.scale)
        if cls is torch.distributions.Normal
        else (base.concentration, base.rate)
    )
    return base if _constant(*params) else None


def _roles(an, site: str):
    """``(z, W, tau)`` of factor ``site`` by their shapes and families, or ``None``."""
    lat = an.latents_of(site)
    if len(lat) != 3 or site in lat:
        return None
    gam = [n for n in lat if isinstance(an.latents[n].family, Gamma)]
    gau = [n for n in lat if an.latents[n].family is not None and an.latents[n].family.is_gaussian]
    if len(gam) != 1 or len(gau) != 2:
        return None
    plated = [n for n in gau if an.latents[n].frames]
    if len(plated) != 1:
        return None
    (z,) = plated
    (W,) = [n for n in gau if n != z]
    return z, W, gam[0]


def _check(an, site: str, z: str, W: str, tau: str) -> Optional[BilinearSpec]:
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
    if _prior(an, z, torch.distributions.Normal) is None:
        return None
    if _prior(an, W, torch.distributions.Normal) is None:
        return None
    if _prior(an, tau, torch.distributions.Gamma) is None:
        return None
    t0 = an.values[tau]
    try:
        torch.broadcast_shapes(t0.shape, (N, D))
    except RuntimeError:
        return None
    if torch.broadcast_shapes(t0.shape, (N, D)) != (N, D):
        return None
    rtol = probes.rtol(X.dtype)
    g = torch.Generator().manual_seed(4321)

    def rand(shape, positive=False):
        u = (
            torch.rand(shape, generator=g, dtype=torch.float64)
            if positive
            else torch.randn(shape, generator=g, dtype=torch.float64)
        )
        return (0.5 + u if positive else u).to(X)

    def read(**values):
        fn = unwrap(an.run(**values).nodes[site]["fn"])[0]
        if not isinstance(fn, torch.distributions.Normal) or not _constant(fn.loc, fn.scale):
            return None
        return fn.loc.expand(N, D), fn.scale.expand(N, D)

    Ws = an.values[W].shape
    z1, W1, t1, t2 = rand((N, K)), rand(Ws), rand(t0.shape, True), rand(t0.shape, True)
    reads = [
        read(**{z: torch.zeros_like(z1), W: W1, tau: t1}),
        read(**{z: z1, W: torch.zeros_like(W1), tau: t2}),
        read(**{z: z1, W: W1, tau: t1}),
    ]
    if any(r is None for r in reads):
        return None
    (c0, s1), (c0b, s2), (loc, s1b) = reads
    W1m = W1.transpose(-1, -2) if transposed else W1

    def close(a, b):
        return bool(torch.allclose(a, b, rtol=rtol, atol=rtol * (1 + float(b.abs().max()))))

    if not (close(c0, c0b) and close(loc - c0, z1 @ W1m) and close(s1, s1b)):
        return None
    c1 = s1.pow(-2) / t1.expand(N, D)
    c2 = s2.pow(-2) / t2.expand(N, D)
    if not close(c1, c2) or not bool((c1 > 0).all()):
        return None
    return BilinearSpec(site, z, W, tau, transposed, c0.detach(), c1.detach())


def find_bilinear(an, chosen: Set[str]) -> List[BilinearSpec]:
    """The bilinear Normal factors whose three latents touch nothing else (no other factor
    than their priors and it), no subsampled plate, no user-chosen family."""
    if an.minibatch_plates or an.discrete:
        return []
    out: List[BilinearSpec] = []
    taken: Set[str] = set()
    for site, node in an.structure.nodes.items():
        if not is_random(node) or site in an.leaves or site in an.latents:
            continue
        roles = _roles(an, site)
        if roles is None or set(roles) & (taken | chosen):
            continue
        others = [
            s
            for s, nd in an.structure.nodes.items()
            if is_random(nd) and s != site and s not in roles and an.latents_of(s) & set(roles)
        ]
        if others:
            continue
        spec = _check(an, site, *roles)
        if spec is not None:
            out.append(spec)
            taken |= set(roles)
    return out


def bilinear_owner(spec: BilinearSpec) -> str:
    """The owner of the four factors' ELBO terms (``analysis.owner``)."""
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
        else:
            fam = an.latents[site].family.name
            why = f"{fam} prior (same family as q): exact"
            an.latents[site].factors.append(Factor(site, site, PRIOR, why))
        return True
    return False
