"""Linear-Gaussian trees in one Gaussian block (as ``AutoGaussian`` is exact for them).

A Gaussian latent whose Normal prior has a loc affine in other Gaussian latents and a scale free
of latents, ``y ~ Normal(A x + c, s)`` (plated or not), joins its parents' block instead of the
mean field: the joint prior of the block is then the product of the conditionals, in
information form (every conditional is the quadratic in the residual ``r = y - A x - c``):

    P = sum_roots P_r + sum_y B_y^T S_y^-1 B_y,     h = sum_roots P_r m_r + sum_y B_y^T S_y^-1 c_y

with ``B_y = E_y - A_y`` (``E_y`` selects ``y``'s coordinates of the joint ``z``). A conjugate
tree is then solved exactly in one step (Pyro's ``test_exact_tree``), where the mean field
underestimated every variance. Trees whose joint block would exceed ``MAX_JOINT_DIM``
coordinates stay mean-field (a dense block costs ``O(D^3)`` per step). The affine loc is read
off autograd and confirmed at the block's probe runs (:func:`group`).
"""

from __future__ import annotations

from typing import Callable, Dict, Set

import torch

from . import probes
from .tracing import unwrap

__all__ = ["MAX_JOINT_DIM", "may_join", "prunable", "group", "joint_prior_information"]

#: the largest joint block a tree forms (dense ``D x D``): beyond it its members stay mean-field
MAX_JOINT_DIM = 400


def may_join(an, name: str) -> bool:
    """``name``'s prior is a Normal whose scale is free of latents and whose loc depends on
    continuous latents only, outside subsampled plates (its loc's affinity is probed later)."""
    node = an.structure.nodes[name]
    base = unwrap(node["fn"])[0]
    if type(base) is not torch.distributions.Normal and not isinstance(
        base, torch.distributions.Normal
    ):
        return False
    if any(f.name in an.minibatch_plates for f in node["cond_indep_stack"]):
        return False
    deps = an.deps.get(name, set())
    if deps & an.discrete:
        return False
    tr, leaves = an.leaf_trace()
    scale = unwrap(tr.nodes[name]["fn"])[0].scale
    if torch.is_tensor(scale) and scale.requires_grad and leaves:
        with torch.enable_grad():
            gs = torch.autograd.grad(
                scale.sum(), list(leaves.values()), allow_unused=True, retain_graph=True
            )
        if any(g is not None for g in gs):
            return False
    return True


def prunable(an, cand: Set[str]) -> Set[str]:
    """Dependent candidates with a parent outside ``cand`` (to remove; repeat to a fixed
    point)."""
    return {n for n in cand if an.deps.get(n) and not an.deps[n] <= cand}


def joint_prior_information(spec, trace, roots: Dict[str, tuple]):
    """``(P, h)`` of a block's joint prior (module docstring). ``roots``: ``name -> (P_r, m_r)``
    of the members with a latent-free prior; ``spec.prior_rows``: ``name -> A_y`` (R x D)."""
    like = next(iter(roots.values()))[0] if roots else next(iter(spec.prior_rows.values()))
    D = spec.dim
    P = like.new_zeros(D, D)
    h = like.new_zeros(D)
    z = torch.cat([trace.nodes[n]["value"].detach().reshape(-1).to(like) for n in spec.names])
    offset = 0
    for n, k in zip(spec.names, spec.sizes):
        sl = slice(offset, offset + k)
        offset += k
        if n in roots:
            Pr, mr = roots[n]
            P[sl, sl] += Pr
            h[sl] += Pr @ mr
            continue
        A = spec.prior_rows[n].to(like)
        fn = trace.nodes[n]["fn"]
        base = unwrap(fn)[0]
        loc = base.loc.detach().expand(fn.shape()).reshape(-1).to(like)
        w = (base.scale.detach() ** -2).expand(fn.shape()).reshape(-1).to(like)
        c = loc - A @ z
        B = -A.clone()
        B[:, sl] += torch.eye(k, dtype=like.dtype, device=like.device)
        P += B.T @ (w[:, None] * B)
        h += B.T @ (w * c)
    return P, h


def group(an, cand, union: Callable, probe_runs: Callable, reset: Callable):
    """Blocks of the site-form candidates ``cand`` (``union(cand)``: union-find over shared
    factors), tree members confirmed: a member whose parent is not in a block, or whose loc is
    not affine (``probe_runs(block)``: the block's probe traces), goes back to the mean field
    and the rest is regrouped."""
    cand = list(cand)
    while True:
        drop = prunable(an, set(cand))
        while drop:
            cand = [n for n in cand if n not in drop]
            drop = prunable(an, set(cand))
        reset()
        blocks = union(cand)
        # a dense joint block costs O(D^3) per step: large trees stay mean-field (O(D))
        big = {
            n
            for b in blocks
            if b.chain is None and b.dim > MAX_JOINT_DIM
            for n in b.names
            if an.deps.get(n)
        }
        if big:
            cand = [n for n in cand if n not in big]
            continue
        bad = _tree_rows(an, blocks, probe_runs)
        if not bad:
            return blocks
        cand = [n for n in cand if n not in bad]


def _tree_rows(an, blocks, probe_runs) -> Set[str]:
    """Write ``block.prior_rows`` of every tree member; return those whose prior loc is not
    affine in the block (probed) or whose coefficients depend on learnable parameters."""
    bad: Set[str] = set()
    tr, leaves = an.leaf_trace()
    params = [s["value"] for s in tr.nodes.values() if s["type"] == "param"]
    for block in blocks:
        if block.chain is not None:
            continue
        for n in block.names:
            deps = an.deps.get(n)
            if not deps:
                continue
            fn = tr.nodes[n]["fn"]
            shape = fn.shape()
            loc = unwrap(fn)[0].loc.expand(shape)
            R = loc.numel()
            with torch.enable_grad():
                jac = {
                    m: probes.jacobian(loc, leaves[m]).detach()
                    if m in deps
                    else loc.new_zeros(R, k)
                    for m, k in zip(block.names, block.sizes)
                }
                dynamic = probes.depends_on_params(loc, [leaves[m] for m in deps], params)
            moved = [
                (dz, unwrap(t.nodes[n]["fn"])[0].loc.expand(shape)) for dz, t in probe_runs(block)
            ]
            if dynamic or not probes.affine_at(loc.detach(), moved, jac):
                bad.add(n)
            else:
                block.prior_rows[n] = torch.cat([jac[m] for m in block.names], 1)
    return bad
