"""The prior of a Gaussian block latent whose loc and scale live in the remainder (eq. 20).

``theta ~ Normal(loc, s)`` with ``loc`` and ``s`` free of the block and read from other latents
``x`` (a hierarchical ``theta_j ~ Normal(mu, tau)``, a random walk's increments under a latent
step scale) is, for every value of ``x``, Gaussian in ``theta``; under a ``q`` that factorises
between the block and the remainder its expected log-density is

    E_q[log p] = -E[1/s^2] theta^2 / 2 + E[loc / s^2] theta + const,

so the block's prior becomes ``N(E[loc/s^2] / E[1/s^2], 1 / E[1/s^2])`` per coordinate (the
exact expected natural parameter, VMP). The expectations are in closed form where ``loc`` is
affine and ``log s`` is affine in the remainder's unconstrained coordinates ``u`` (``mu`` real,
``tau`` positive through ``exp``): with ``q(u) = N(m, S)``, ``loc = c + G u`` and
``log s = d + H u`` per row,

    E[1/s^2] = exp(-2 (d + H m) + 2 h' S h),   E[loc/s^2] = (c + G m - 2 g' S h) E[1/s^2]

(``g, h``: the row's coefficients). :func:`prior_info` finds ``G`` and ``H`` by autograd at the
reference values and confirms them at a random move (probing);
:mod:`~pyro_cvi.messages.prior_expected` evaluates the message. Applied by default where the
remainder's joint Gaussian would otherwise hold more than :data:`JOINT_MAX_DIM` coordinates,
and where the user names the latent in ``AutoCVI(families={name: "gaussian"})``; elsewhere (or
named ``"joint"``) such latents share the remainder's joint Gaussian, which keeps the funnel's
correlation between ``theta`` and ``log tau`` (docs/architecture.md, "Mean field or a joint
Gaussian"; :func:`~pyro_cvi.model.remainder.remainder_sets`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch
from pyro.distributions.util import broadcast_shape
from torch.distributions import biject_to

from . import gaussian_tree, probes
from .records import CONJUGATE_PRIOR, CONJUGATE_SCALE, CONJUGATE_SCALE_MC, Factor
from .tracing import latent_weight, unwrap

__all__ = [
    "JOINT_MAX_DIM",
    "PriorInfo",
    "beside_factor",
    "beside_factors",
    "chain_expected_factor",
    "observation_info",
    "prior_applies",
    "prior_factor",
    "prior_info",
]

#: the most unconstrained coordinates the remainder's joint Gaussian holds while a block latent
#: whose Normal prior reads it (``theta_j ~ Normal(mu, tau)``, :func:`prior_applies`) stays in
#: it by default: Price's dense Hessians of a remainder whose scales set its members' curvature
#: (``blocks.remainder_rules.SCALED_HESSIAN_MAX_DIM``); beyond it the joint is stepped on one
#: draw's gradient and such latents keep their exact block beside it (mean field)
JOINT_MAX_DIM = 64


@dataclass
class PriorInfo:
    """What the expected-prior message needs at run time: ``loc = A z + c0 + G (u - u0)`` and
    ``log s = log_scale0 + H (u - u0)`` over the given latents' unconstrained values ``u``
    (``A z``: the block's own part of the loc, a linear-Gaussian tree's, read by the block)."""

    #: the latents the prior reads (model order)
    given: Tuple[str, ...]
    #: their flattened unconstrained values at the reference point
    u0: Dict[str, torch.Tensor]
    #: the loc's offset at ``u0`` without its block part, and the log scale at ``u0``
    loc0: torch.Tensor
    log_scale0: torch.Tensor
    #: ``{latent: (R, size)}`` coefficients of the loc and of the log scale
    G: Dict[str, torch.Tensor]
    H: Dict[str, torch.Tensor]
    #: whether the loc reads the block (a tree member)
    reads_block: bool = False
    #: the block's other latents the loc reads and its coefficients ``A`` on their stacked
    #: flattened values (``(R, size)``; the remainder's Rao-Blackwellised side reads them)
    inside: Tuple[str, ...] = ()
    A: Optional[torch.Tensor] = None
    #: an observation's rows (:func:`observation_info`): ``(A, A', A*A, (A*A)')``, sparse
    rows: Optional[Tuple[torch.Tensor, ...]] = None
    #: an observation's flattened value at the analysis (its data)
    y0: Optional[torch.Tensor] = None


def prior_info(an, name: str, names: Sequence[str]) -> Optional[PriorInfo]:
    """The affine set-up of latent ``name``'s Normal prior in the unconstrained values of the
    latents outside the block ``names`` it reads, or ``None`` where it does not apply (not a
    Normal, a weighted or subsampled site, a scale reaching the block, discrete or summed-out
    parents, loc and log scale not jointly affine in those values and the block's)."""
    cache = an.__dict__.setdefault("_prior_infos", {})
    key = (name, tuple(names))
    if key not in cache:
        cache[key] = _prior_info(an, name, names)
    return cache[key]


def _prior_info(an, name: str, names: Sequence[str]) -> Optional[PriorInfo]:
    tr, leaves = an.leaf_trace()
    if name not in leaves or name in an.random_sites or an.minibatch_plate(name) is not None:
        return None
    node = tr.nodes[name]
    if latent_weight(node) is not None:
        return None
    base = unwrap(node["fn"])[0]
    if type(base).__name__ != "Normal" or not isinstance(base, torch.distributions.Normal):
        return None
    given = an.latents_of(name) - set(names)
    bad = an.collapsed | an.remainder_discrete | set(an.discrete)
    if not given or given & bad or not given <= set(leaves):
        return None
    order = tuple(n for n in an.values if n in given)
    inside = tuple(n for n in names if n != name and n in leaves)
    ts = {x: biject_to(an.structure.nodes[x]["fn"].support) for x in order}
    u0 = {x: ts[x].inv(an.ref[x].detach()).reshape(-1) for x in order}
    z0 = [an.ref[n].detach().reshape(-1) for n in inside]
    sizes = [u0[x].numel() for x in order]
    zsizes = [t.numel() for t in z0]
    shape = node["fn"].shape()
    U = sum(sizes)

    def read(flat: torch.Tensor) -> torch.Tensor:
        parts = dict(zip(order + inside, flat.split(sizes + zsizes)))
        values = {x: ts[x](parts[x].reshape(an.ref[x].shape)) for x in order}
        values.update({n: parts[n].reshape(an.ref[n].shape) for n in inside})
        b = unwrap(an.run(**values).nodes[name]["fn"])[0]
        loc = torch.as_tensor(b.loc).expand(shape).reshape(-1)
        log_scale = torch.as_tensor(b.scale).expand(shape).log().reshape(-1)
        return torch.cat([loc, log_scale])

    flat0 = torch.cat([u0[x] for x in order] + z0)
    with torch.enable_grad():
        if inside:
            J = torch.autograd.functional.jacobian(read, flat0.clone())
        else:  # (a latent alone, R rows on a few coordinates: one backward pass per column)
            flat = flat0.clone().requires_grad_(True)
            J = probes.jacobian(read(flat), flat).detach()
    with torch.no_grad():
        out0 = read(flat0)
        g = torch.Generator().manual_seed(7)
        d = 0.3 * torch.randn(flat0.shape, generator=g, dtype=torch.float64, device=g.device).to(
            flat0
        )
        out1 = read(flat0 + d)
    R = out0.numel() // 2
    if R != int(shape.numel()) or not bool(torch.isfinite(J).all()):
        return None
    if not probes.close(out1, out0 + J @ d, probes.rtol(flat0.dtype)):
        return None  # not jointly affine (a coefficient moving with another latent)
    Jz = J[:, U:]
    if bool((Jz[R:] != 0).any()):
        return None  # the scale reads the block: not conjugate to it
    loc0 = out0[:R] - (Jz[:R] @ flat0[U:] if inside else 0)
    G = dict(zip(order, J[:R, :U].detach().split(sizes, dim=1)))
    H = dict(zip(order, J[R:, :U].detach().split(sizes, dim=1)))
    reads_block = bool((Jz[:R] != 0).any()) if inside else False
    A, read = None, ()
    if reads_block:  # (only the block latents the loc reads: their coefficients)
        parts = Jz[:R].detach().split(zsizes, dim=1)
        keep = [i for i, a in enumerate(parts) if bool((a != 0).any())]
        read, A = tuple(inside[i] for i in keep), torch.cat([parts[i] for i in keep], 1)
    return PriorInfo(order, u0, loc0.detach(), out0[R:].detach(), G, H, reads_block, read, A)


def observation_info(an, site: str, name: str) -> Optional[PriorInfo]:
    """The affine set-up of observed Normal ``site`` beside natural-form latent ``name``:
    ``loc = A z + c0 + G (u - u0)``, ``log s = log_scale0 + H (u - u0)`` (``z``: ``name``'s
    flattened value, ``A`` free of every latent, ``u``: the other latents' unconstrained
    values), or ``None`` (a weighted, subsampled or hidden-draw site, an observed value with a
    gradient, a scale reading ``name``, not jointly affine: probed at a random move). Given
    ``u`` its log-density is Gaussian in ``z``, so its message to ``name`` is the expected
    natural parameter ``(A' E[(y - c)/s^2], -(A*A)' E[1/s^2] / 2)`` (eq. 20)."""
    cache = an.__dict__.setdefault("_prior_infos", {})
    key = ("observed", site, name)
    if key not in cache:
        cache[key] = _observation_info(an, site, name)
    return cache[key]


def _observation_info(an, site: str, name: str) -> Optional[PriorInfo]:
    tr, leaves = an.leaf_trace()
    node = tr.nodes[site]
    if not node["is_observed"] or site in an.random_sites or name not in leaves:
        return None
    if an.minibatch_plate(site) is not None or latent_weight(node) is not None:
        return None
    base, y = unwrap(node["fn"])[0], node["value"]
    if type(base).__name__ != "Normal" or not isinstance(base, torch.distributions.Normal):
        return None
    if not torch.is_tensor(y) or y.requires_grad:
        return None
    given = an.latents_of(site) - {name}
    bad = an.collapsed | an.remainder_discrete | set(an.discrete)
    if not given or given & bad or not given <= set(leaves):
        return None
    order = tuple(n for n in an.values if n in given)
    ts = {x: biject_to(an.structure.nodes[x]["fn"].support) for x in order}
    u0 = {x: ts[x].inv(an.ref[x].detach()).reshape(-1) for x in order}
    sizes = [u0[x].numel() for x in order]
    shape = torch.Size(broadcast_shape(base.loc.shape, base.scale.shape, y.shape))
    if shape != y.shape:
        return None  # (an observation broadcast over its parameters' dims)
    z0 = an.ref[name].detach()

    def read(flat: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        parts = dict(zip(order, flat.split(sizes)))
        values = {x: ts[x](parts[x].reshape(an.ref[x].shape)) for x in order}
        b = unwrap(an.run(**values, **{name: z}).nodes[site]["fn"])[0]
        loc = torch.as_tensor(b.loc).expand(shape).reshape(-1)
        return torch.cat([loc, torch.as_tensor(b.scale).expand(shape).log().reshape(-1)])

    flat0 = torch.cat([u0[x] for x in order])
    R = int(shape.numel())
    with torch.enable_grad():
        flat, z = flat0.clone().requires_grad_(True), z0.clone().requires_grad_(True)
        out = read(flat, z)
        if out.numel() != 2 * R:
            return None
        Ju = probes.jacobian(out, flat).detach()
        (gs,) = torch.autograd.grad(
            (out[R:] * torch.randn_like(out[R:])).sum(), z, allow_unused=True, retain_graph=True
        )
        if gs is not None and bool(gs.ne(0).any()):
            return None  # the scale reads the latent: not conjugate to it
        A = probes.jacobian(out[:R], z).detach()
    with torch.no_grad():
        out0 = out.detach()
        g = torch.Generator().manual_seed(7)
        d = 0.3 * torch.randn(flat0.shape, generator=g, dtype=torch.float64).to(flat0)
        dz = 0.3 * torch.randn(z0.shape, generator=g, dtype=torch.float64).to(z0)
        out1 = read(flat0 + d, z0 + dz)
    if not bool(torch.isfinite(Ju).all() & torch.isfinite(A).all()):
        return None
    if bool((A.ne(0).sum(1) > 1).any()):
        return None  # a row reads two members (a chain's cumsum): they are not independent
    moved = out0 + Ju @ d + torch.cat([A @ dz.reshape(-1), A.new_zeros(R)])
    if not probes.close(out1, moved, probes.rtol(flat0.dtype)):
        return None  # not jointly affine (a coefficient moving with another latent)
    loc0 = out0[:R] - A @ z0.reshape(-1)
    G = dict(zip(order, Ju[:R].split(sizes, dim=1)))
    H = dict(zip(order, Ju[R:].split(sizes, dim=1)))
    rows = tuple(
        a.to_sparse().coalesce() for a in (A, A.T.contiguous(), A * A, (A * A).T.contiguous())
    )
    return PriorInfo(order, u0, loc0, out0[R:], G, H, True, (name,), A, rows, y.reshape(-1))


def prior_applies(an, name: str, block) -> Optional[PriorInfo]:
    """:func:`prior_info` where the block can take it: a member of its linear-Gaussian tree
    with a latent scale (the block reads its conditional, and the plug-in's part of the
    block's ELBO is taken out, :func:`~pyro_cvi.model.gaussian_tree.tree_prior`)."""
    if block.chain is not None:
        return None
    info = prior_info(an, name, block.names)
    if info is None or name not in block.prior_rows or name not in block.scale_latent:
        return None  # (a tree member with a latent scale: the block reads its conditional)
    return info


def prior_factor(an, site: str, block) -> Optional[Factor]:
    """The expected-prior message of block latent ``site``'s own prior (see the module
    docstring), or ``None`` where it does not apply."""
    if block.chain is not None:
        return chain_expected_factor(site, block)
    if site not in block.names:
        return None
    info = prior_applies(an, site, block)
    if info is None:
        return None
    given = ", ".join(info.given)
    size = getattr(an, "prior_rule", {}).get(site, "named")
    if size == "named":
        rule = f"named families={{{site!r}: 'gaussian'}}: mean field"
    else:  # (the structural default, model/remainder.remainder_sets)
        rule = (
            f"mean field by default: the joint would hold {size} coordinates, more than "
            f"{JOINT_MAX_DIM}; families={{{site!r}: 'joint'}} keeps the joint"
        )
    why = (
        f"Normal prior of {site}, log scale affine in the unconstrained {given}: precision "
        f"E[1/s^2], offset E[c/s^2] / E[1/s^2] in closed form under the remainder's q (eq. 20; "
        f"{rule})"
    )
    return Factor(site, block.label, CONJUGATE_PRIOR, why, scale=info)


def beside_factor(an, site: str) -> Optional[Factor]:
    """The expected-prior message of a natural-form Gaussian latent kept beside the remainder
    (:func:`~pyro_cvi.model.remainder.beside_candidates`: a member of a linear-Gaussian tree
    too large for one joint block): the natural parameters ``(E[loc/s^2], -E[1/s^2]/2)`` of
    its own prior, in closed form under the remainder's ``q``; ``None`` for any other site."""
    dropped = getattr(an, "prior_beside", {}).get(site)
    if dropped is None:
        return None
    info = prior_info(an, site, (site,))
    if info is None:
        return None
    size, tree = dropped
    given = ", ".join(info.given)
    why = (
        f"Normal prior of {site}, loc and log scale affine in the unconstrained {given}: "
        f"natural parameters (E[loc/s^2], -E[1/s^2]/2) in closed form under the remainder's q "
        f"(eq. 20; mean field by default: the tree ({', '.join(tree)}) would hold {size} "
        f"coordinates, more than {gaussian_tree.MAX_JOINT_DIM} in one joint block; "
        f"families={{{site!r}: 'gaussian'}} keeps the tree, {{{site!r}: 'joint'}} the "
        f"remainder's joint)"
    )
    return Factor(site, site, CONJUGATE_PRIOR, why, scale=info)


def beside_factors(an, site: str):
    """``[(latent, factor record)]`` that factor ``site``, owned by the remainder, sends to
    natural-form latents kept beside it: a latent's own prior (:func:`beside_factor`) and an
    observation whose loc is affine in it (:func:`observation_info`, ``an.observed_beside``)."""
    out = []
    if (prior := beside_factor(an, site)) is not None:
        out.append((site, prior))
    name = getattr(an, "observed_beside", {}).get(site)
    info = observation_info(an, site, name) if name is not None else None
    if info is not None:
        given = ", ".join(info.given)
        why = (
            f"Normal loc affine in {name} (A: {tuple(info.A.shape)}), loc's offset and log "
            f"scale affine in the unconstrained {given}: natural parameters (A' E[(y - c)/s^2], "
            f"-(A*A)' E[1/s^2]/2) in closed form under the remainder's q (eq. 20)"
        )
        out.append((name, Factor(site, name, CONJUGATE_SCALE, why, "loc", scale=info)))
    return out


def chain_expected_factor(site: str, block) -> Optional[Factor]:
    """The record of a factor of a Kalman chain whose scale reads the remainder (a transition
    or an observation, :mod:`~pyro_cvi.blocks.scaled_markov`): the chain reads it at its
    expected precision ``E[1/s^2]`` in closed form, the remainder Rao-Blackwellised over the
    smoother's marginals; ``None`` for any other chain factor."""
    chain = block.chain
    shared = getattr(chain, "shared", {})
    if site not in shared:
        return None
    given = ", ".join(chain.scales)
    rule = f"; {chain.rule}" if site == block.names[0] or site == next(iter(shared)) else ""
    mc = getattr(chain.rows, "read", None) is not None  # (log s not affine: Monte Carlo)
    how = "by Monte Carlo over" if mc else "in closed form under"
    if site in block.names:
        what = "x_0's prior" if shared[site] == 0 else "transition"
        why = (
            f"{what} into {site} given {given}: N(a x_(t-1) + b, 1 / E[1/s^2]) in the Kalman "
            f"prior, E[1/s^2] {how} the remainder's q (eq. 20){rule}"
        )
        return Factor(site, block.label, CONJUGATE_PRIOR, why)
    why = (
        f"Normal observation of {block.names[shared[site]]} given {given}: the expected row "
        f"(h, E[1/s^2], E[1/s^2] (y - c)) in the smoother's information, E[1/s^2] {how} the "
        f"remainder's q (eq. 20){rule}"
    )
    return Factor(site, block.label, CONJUGATE_SCALE_MC if mc else CONJUGATE_SCALE, why, "loc")
