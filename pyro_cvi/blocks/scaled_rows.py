"""The set-up of a Kalman chain's factors whose scales read latents of the remainder.

:func:`setup_rows` reads, once, the log scales of the chain's shared factors (its transitions
and observations) as an affine map of the scales' unconstrained values, ``log s = L0 + H (u -
u0)`` (finite differences at the reference, confirmed at a random move; where it is not
affine, a batched reader for the Monte Carlo path), and the observations' rows ``(t, h, c)``:
:class:`~pyro_cvi.messages.chain_expected.ChainRows`.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
from torch.distributions import biject_to

from ..messages.chain_expected import ChainRows, batched_log_scales
from ..model import probes
from ..model.index_guard import checked_indexing
from ..model.tracing import unwrap

__all__ = ["log_scales", "probes_params", "reads", "setup_rows"]

#: the move of the unconstrained scale coordinates that finds ``H`` (exact: affine)
_STEP = 0.5


def reads(value, leaves: Dict[str, torch.Tensor]) -> set:
    """The latents of ``leaves`` whose values ``value`` reads (a nonzero gradient)."""
    if not (torch.is_tensor(value) and value.requires_grad):
        return set()
    with torch.enable_grad():
        gs = torch.autograd.grad(
            value.sum(), list(leaves.values()), allow_unused=True, retain_graph=True
        )
    return {n for n, g in zip(leaves, gs) if g is not None and bool(g.ne(0).any())}


def probes_params(value, zs, params) -> bool:
    """Whether ``value``'s coefficients in ``zs`` move with learnable ``params``."""
    return (
        torch.is_tensor(value)
        and value.requires_grad
        and probes.depends_on_params(value, zs, params)
    )


def log_scales(tr, sites: Sequence[str]) -> torch.Tensor:
    parts = []
    for s in sites:
        node = tr.nodes[s]
        base = unwrap(node["fn"])[0]
        shape = torch.broadcast_shapes(base.loc.shape, base.scale.shape, node["value"].shape)
        parts.append(torch.as_tensor(base.scale).detach().expand(shape).reshape(-1).log())
    return torch.cat(parts)


def setup_rows(an, names, obs: Dict[str, int], order, d: int, walk=None) -> Optional[ChainRows]:
    """The log scales of the shared factors, affine in the scales' unconstrained values
    (finite differences, confirmed at a random move), and the observations' rows (a walk's:
    read by :mod:`~pyro_cvi.blocks.scaled_walk`, its increments' scales time-major)."""
    tr, leaves = an.leaf_trace()
    steps = [n for n in names if reads(unwrap(tr.nodes[n]["fn"])[0].scale, leaves)]
    sites = steps + list(obs)
    ts = {z: biject_to(an.structure.nodes[z]["fn"].support) for z in order}
    u0 = {z: ts[z].inv(an.ref[z].detach()).reshape(-1) for z in order}
    flat0 = torch.cat([u0[z] for z in order])
    sizes = [u0[z].numel() for z in order]

    def read(flat):
        parts = dict(zip(order, flat.split(sizes)))
        vals = {z: ts[z](parts[z].reshape(an.ref[z].shape)) for z in order}
        with torch.no_grad():
            return log_scales(an.run(**vals), sites)

    L0 = read(flat0)
    cols = []
    for i in range(flat0.numel()):
        e = torch.zeros_like(flat0)
        e[i] = _STEP
        cols.append((read(flat0 + e) - L0) / _STEP)
    H = torch.stack(cols, 1)
    g = torch.Generator().manual_seed(11)
    cpu = dict(generator=g, dtype=torch.float64, device=g.device)  # (the generator's draws)
    dlt = 0.3 * torch.randn(flat0.shape, **cpu).to(flat0)
    batched = None
    if not probes.close(read(flat0 + dlt), L0 + H @ dlt, probes.rtol(flat0.dtype)):
        # log s not affine in the unconstrained scales: E[1/s^2] by Monte Carlo over q(u),
        # where one batched run reads the scales at many draws (else the joint takes it)
        batched = batched_log_scales(an, order, ts, u0, sites)
        moves = flat0 + 0.3 * torch.randn(3, flat0.numel(), **cpu).to(flat0)
        try:
            with checked_indexing(flat0.device):
                found = batched(moves)
            looped = torch.stack([read(v) for v in moves])
            ok = probes.close(found, looped, probes.rtol(flat0.dtype))
        except (RuntimeError, ValueError, IndexError, TypeError, NotImplementedError):
            ok = False
        if not ok:
            return None
    # observations: y_r ~ N(h_r x_t + c_r, s_r): h by autograd, c at the reference
    obs_t, obs_h, obs_c = [], [], []
    for site, t in obs.items() if walk is None else ():
        node = tr.nodes[site]
        base = unwrap(node["fn"])[0]
        shape = torch.broadcast_shapes(base.loc.shape, base.scale.shape, node["value"].shape)
        loc = base.loc.expand(shape).reshape(-1)
        x = leaves[names[t]]
        with torch.enable_grad():
            h = probes.jacobian(loc, x).detach().reshape(loc.numel(), d)
        xt = x.detach().reshape(d)
        obs_t.append(torch.full((loc.numel(),), t, dtype=torch.long, device=loc.device))
        obs_h.append(h)
        obs_c.append(loc.detach() - h @ xt)
    for t, h, c in walk[1].values() if walk is not None else ():
        obs_t.append(t)
        obs_h.append(h)
        obs_c.append(c)
    step_index = tuple(names.index(n) for n in steps)
    if walk is not None:  # (every step of the walk is one element of its increments)
        step_index = tuple(range(walk[0].length)) if steps else ()
    sizes_of = [int(log_scales(tr, [s]).numel()) for s in sites]
    return ChainRows(
        given=order,
        u0=flat0.detach(),
        L0=L0.detach(),
        H=H.detach(),
        steps=step_index,
        obs=tuple(obs),
        obs_t=torch.cat(obs_t) if obs_t else torch.zeros(0, dtype=torch.long),
        obs_h=torch.cat(obs_h) if obs_h else flat0.new_zeros(0, d),
        obs_c=torch.cat(obs_c) if obs_c else flat0.new_zeros(0),
        sizes=tuple(sizes_of),
        walk_sites=tuple(steps) if walk is not None else (),
        read=batched,
    )
