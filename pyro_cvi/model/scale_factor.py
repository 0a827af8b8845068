"""A Normal factor conjugate to a Gaussian block given its scale (Algorithm 2, eq. 20).

``y ~ Normal(A z + c, s)`` with ``z`` a Gaussian block, ``A`` free of every other latent and
``s`` (and ``c``) depending only on latents of *other* blocks is, for every value of those,
quadratic in ``z``; under a ``q`` that factorises between blocks its expected log-density is

    E_q[log p] = -E[1/s^2] (A z)^2 / 2 + E[(y - c) / s^2] A z + const,

so the factor's message to the block is the linear-Gaussian row ``(A, w, b)`` with
``w = E_q[1/s^2]`` and ``b = E_q[(y - c) / s^2]`` per observation (weighted like the site's
log-density): exact in the block's natural parameters, no per-draw Hessian. The expectations
come

* in closed form (:data:`~pyro_cvi.model.records.CONJUGATE_SCALE`) where ``c`` is free of the
  other latents and ``log s`` is affine in the log of one remainder latent of positive support
  (``s = k sigma^beta``, ``sigma[group]`` included): ``q(log sigma)`` is Gaussian
  ``N(m, v)``, so ``E[1/s^2] = s(e^m)^-2 exp(2 beta^2 v)``;
* otherwise (:data:`~pyro_cvi.model.records.CONJUGATE_SCALE_MC`) as averages over many joint
  draws of the other blocks' ``q`` in one vectorised model run
  (:mod:`~pyro_cvi.messages.scale_expected`).

Where it does not apply (loc not affine in the block, ``A`` depending on other latents, a scale
depending on the block, subsampled plates, discrete parents) the factor keeps its Bonnet/Price
message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from pyro.distributions.util import broadcast_shape
from torch.distributions import biject_to
from torch.distributions.transforms import AffineTransform, ComposeTransform, ExpTransform

from . import probes
from .records import CONJUGATE_SCALE, CONJUGATE_SCALE_MC, Factor
from .tracing import linked_reader, unwrap

__all__ = ["ScaleInfo", "log_affine", "scale_factor"]


@dataclass
class ScaleInfo:
    """What the expected-scale message needs at run time."""

    #: the latents the factor reads besides the block's
    given: Tuple[str, ...]
    #: the model's plate nesting (the particle plate goes left of it)
    plate_dims: int
    #: the event dims of every latent (to stack draws)
    event_dims: Dict[str, int]
    #: closed form: ``(latent, index, beta)``: ``log s = log s(at) + beta (log sigma[index] -
    #: log sigma_at[index])`` per row (``None``: Monte Carlo)
    closed: Optional[Tuple[str, torch.Tensor, torch.Tensor]] = None
    #: whether the draws run as one batched model run (decided on the first message)
    vectorise: Optional[bool] = None
    #: whether the heavy-tails warning was given (once per factor and fit)
    warned: bool = False


def log_affine(t) -> bool:
    """Whether ``log t(u)`` is ``u`` plus a constant: ``exp``, then a positive scaling."""
    parts = list(t.parts) if isinstance(t, ComposeTransform) else [t]
    if not parts or not isinstance(parts[0], ExpTransform):
        return False
    for p in parts[1:]:
        if not isinstance(p, AffineTransform):
            return False
        loc, scale = torch.as_tensor(p.loc), torch.as_tensor(p.scale)
        if bool((loc != 0).any()) or not bool((scale > 0).all()):
            return False
    return True


def _grads(out: torch.Tensor, leaves: Dict[str, torch.Tensor]) -> Dict[str, bool]:
    """Which leaves ``out`` reaches (autograd, random weights so that nothing cancels)."""
    names = [n for n, v in leaves.items() if v.requires_grad]
    if not out.requires_grad or not names:
        return {n: False for n in leaves}
    g = torch.Generator().manual_seed(3)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64, device=g.device)
    gs = torch.autograd.grad(
        (out * w.to(out)).sum(), [leaves[n] for n in names], allow_unused=True, retain_graph=True
    )
    hit = {n: g is not None and bool((g != 0).any()) for n, g in zip(names, gs)}
    return {n: hit.get(n, False) for n in leaves}


def scale_factor(an, site: str, block) -> Optional[Factor]:
    """The expected-scale message of ``site`` to Gaussian ``block`` (see the module
    docstring), or ``None`` where it does not apply."""
    if block.chain is not None or an.minibatch_plate(site) is not None:
        return None
    tr, leaves = an.leaf_trace()
    node = tr.nodes[site]
    if not node["is_observed"] or site in an.latents or site in an.random_sites:
        return None
    base = unwrap(node["fn"])[0]
    if type(base).__name__ != "Normal" or not isinstance(base, torch.distributions.Normal):
        return None
    y = node["value"]
    if not torch.is_tensor(y) or y.requires_grad:
        return None
    names = set(block.names)
    others = an.latents_of(site) - names
    bad = an.collapsed | an.remainder_discrete | set(an.discrete)
    if not others or others & bad or not others <= set(leaves):
        return None
    loc, scale = base.loc, base.scale
    if loc.shape != broadcast_shape(loc.shape, scale.shape, y.shape):
        return None
    with torch.enable_grad():
        if any(_grads(scale, {n: leaves[n] for n in names}).values()):
            return None  # the scale depends on the block: not conjugate to it
        probed = an.probed_rows(site, block, loc, linked_reader("loc", None))
        if probed is None or probed[1]:
            return None
        A = probed[0]
        J = torch.cat([probes.jacobian(loc, leaves[n], create_graph=True) for n in block.names], 1)
        if any(_grads(J, {n: leaves[n] for n in others}).values()):
            return None  # A moves with another latent (bilinear): not rows of this kind
        loc_reads = _grads(loc, {n: leaves[n] for n in others})
        scale_reads = _grads(scale, {n: leaves[n] for n in others})
    closed = None
    if not any(loc_reads.values()):
        closed = _closed_form(an, site, scale, [n for n, r in scale_reads.items() if r])
    R, D = A.shape
    given = ", ".join(sorted(others))
    how = (
        f"in closed form (log-normal q of {closed[0]})"
        if closed is not None
        else "averaged over many draws of their q"
    )
    why = (
        f"Normal loc affine in {block.label} (probed, A: {R}x{D}), scale given {given}: rows "
        f"with E_q[1/scale^2] {how} (eq. 20)"
    )
    info = ScaleInfo(
        tuple(sorted(others)),
        an.plate_dims,
        {n: an.structure.nodes[n]["fn"].event_dim for n in an.values if n in leaves},
        closed,
        None if an.enum_dims is None else False,
    )
    kind = CONJUGATE_SCALE if closed is not None else CONJUGATE_SCALE_MC
    return Factor(site, block.label, kind, why, "loc", A, False, scale=info)


def _closed_form(an, site: str, scale: torch.Tensor, reads) -> Optional[tuple]:
    """``(latent, index, beta)`` where ``log s`` is affine in ``log sigma`` with one entry
    per row, ``sigma`` a remainder latent of positive support; else ``None``."""
    if len(reads) != 1:
        return None
    (z,) = reads
    if z not in an.remainder or not log_affine(biject_to(an.structure.nodes[z]["fn"].support)):
        return None
    _, leaves = an.leaf_trace()
    zv = leaves[z]
    with torch.enable_grad():
        J = probes.jacobian(scale.reshape(-1), zv)
    B = J * zv.detach().reshape(1, -1) / scale.detach().reshape(-1, 1)  # d log s / d log z
    nonzero = B != 0
    if not bool((nonzero.sum(1) == 1).all()):
        return None
    index = nonzero.to(torch.int64).argmax(1)
    beta = B.gather(1, index[:, None])[:, 0]
    # confirm: log s(z e^d) = log s(z) + beta d[index] at a random move
    g = torch.Generator().manual_seed(5)
    d = 0.3 * torch.randn(zv.shape, generator=g, dtype=zv.dtype, device=g.device).to(zv.device)
    with torch.no_grad():
        moved = unwrap(an.run(**{z: zv.detach() * d.exp()}).nodes[site]["fn"])[0]
        s1 = moved.scale.expand(scale.shape).reshape(-1)
    pred = scale.detach().reshape(-1).log() + beta * d.reshape(-1)[index]
    if not probes.close(s1.log(), pred, probes.rtol(zv.dtype)):
        return None
    return z, index.detach(), beta.detach()
