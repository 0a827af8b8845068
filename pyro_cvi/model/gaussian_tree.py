"""Linear-Gaussian trees in one Gaussian block (as ``AutoGaussian`` is exact for them).

A Gaussian latent whose Normal prior has a loc affine in other Gaussian latents and a scale free
of latents, ``y ~ Normal(A x + c, s)`` (plated or not), joins its parents' block instead of the
mean field: the joint prior of the block is then the product of the conditionals, in
information form (every conditional is the quadratic in the residual ``r = y - A x - c``):

    P = sum_roots P_r + sum_y B_y^T S_y^-1 B_y,     h = sum_roots P_r m_r + sum_y B_y^T S_y^-1 c_y

with ``B_y = E_y - A_y`` (``E_y`` selects ``y``'s coordinates of the joint ``z``). A conjugate
tree is then solved exactly in one step (Pyro's ``test_exact_tree``), where the mean field
underestimated every variance. Trees whose joint block would exceed ``MAX_JOINT_DIM``
coordinates stay mean-field (a dense block costs ``O(D^3)`` per step), unless a member is named
``AutoCVI(families={site: "gaussian"})``. The affine loc is read
off autograd and confirmed at the block's probe runs (:func:`group`).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Set

import torch

from ..linear_gaussian import GaussianPrior
from . import probes
from .tracing import latent_weight, unwrap

__all__ = [
    "MAX_JOINT_DIM",
    "may_join",
    "prunable",
    "group",
    "joint_prior_information",
    "plugin_expected_log_prob",
    "tree_prior",
]

#: the largest joint block a tree forms (dense ``D x D``): beyond it its members stay mean-field
MAX_JOINT_DIM = 400


def _grad_deps(value, leaves) -> Set[str]:
    if not (torch.is_tensor(value) and value.requires_grad and leaves):
        return set()
    with torch.enable_grad():
        gs = torch.autograd.grad(
            value.sum(), list(leaves.values()), allow_unused=True, retain_graph=True
        )
    return {n for n, g in zip(leaves, gs) if g is not None}


def may_join(an, name: str) -> bool:
    """``name``'s prior is a Normal outside subsampled plates whose loc and scale depend on
    continuous latents only; its loc's parents must join the same block and its scale's must
    not (:func:`prunable`; the loc's affinity is probed later). ``an.tree_deps[name]`` keeps
    ``(loc parents, scale parents)``."""
    node = an.structure.nodes[name]
    base = unwrap(node["fn"])[0]
    if not isinstance(base, torch.distributions.Normal):
        return False
    if any(f.name in an.minibatch_plates for f in node["cond_indep_stack"]):
        return False
    if an.deps.get(name, set()) & an.discrete:
        return False
    tr, leaves = an.leaf_trace()
    fn = unwrap(tr.nodes[name]["fn"])[0]
    if not hasattr(an, "tree_deps"):
        an.tree_deps = {}
    an.tree_deps[name] = (_grad_deps(fn.loc, leaves), _grad_deps(fn.scale, leaves))
    return True


def prunable(an, cand: Set[str]) -> Set[str]:
    """Tree candidates with a loc parent outside ``cand`` or a scale parent inside it (to
    remove; repeat to a fixed point)."""
    out = set()
    for n in cand:
        if not an.deps.get(n):
            continue
        loc_deps, scale_deps = an.tree_deps[n]
        if not loc_deps <= cand or scale_deps & cand:
            out.add(n)
    return out


def joint_prior_information(spec, trace, roots: Dict[str, tuple], expected=None):
    """``(P, h, plugin, (log_norm, weighted))`` of a block's joint prior (module docstring).
    ``roots``:
    ``name -> (P_r, m_r)`` of the members with a latent-free prior; ``spec.prior_rows``:
    ``name -> A_y`` (R x D). Members whose scale depends on mean-field latents use the scale at
    the trace's values of those (their means): ``plugin`` holds their ``(B, c, w, n)``, for the
    block to swap this plug-in conditional's expectation for the factor's own (which the mean
    field estimates, and whose Monte Carlo messages the scale's latents get). A member with a
    weight ``k`` (``poutine.scale`` / ``mask``: :func:`~pyro_cvi.model.tracing.latent_weight`)
    contributes ``k`` times its conditional: ``w -> k w`` and ``n = k log(w / 2 pi) / 2``;
    the last item is ``(sum n, whether any member is weighted)``. ``expected``:
    ``name -> (w, c)`` of members whose conditional is read at its expected natural
    parameters instead (:mod:`~pyro_cvi.messages.prior_expected`)."""
    like = next(iter(roots.values()))[0] if roots else next(iter(spec.prior_rows.values()))
    D = spec.dim
    P = like.new_zeros(D, D)
    h = like.new_zeros(D)
    z = torch.cat([trace.nodes[n]["value"].detach().reshape(-1).to(like) for n in spec.names])
    plugin = []
    log_norm = like.new_zeros(())
    weighted = False
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
        if expected and n in expected:  # (E_q[1/s^2], E_q[c/s^2] / E_q[1/s^2]): loc = A z + c
            w, c_at = (t.to(like) for t in expected[n])
            loc = c_at + A @ z
        weight = latent_weight(trace.nodes[n])
        kw = like.new_ones(()) if weight is None else weight.to(like).reshape(-1)
        weighted = weighted or weight is not None
        norm = 0.5 * kw * torch.log(w / (2 * math.pi))
        log_norm = log_norm + norm.sum()
        w = kw * w
        c = loc - A @ z
        B = -A.clone()
        B[:, sl] += torch.eye(k, dtype=like.dtype, device=like.device)
        P += B.T @ (w[:, None] * B)
        h += B.T @ (w * c)
        if n in spec.scale_latent:
            plugin.append((B, c, w, norm.expand(w.shape)))
    return P, h, plugin, (log_norm, weighted)


def tree_prior(spec, trace, root_prior: Callable, expected: Optional[Dict] = None):
    """The block's joint prior (a ``GaussianPrior`` in precision form) from
    :func:`joint_prior_information`; ``root_prior(fn, k, weight)`` reads a latent-free member's
    prior. Its plug-in conditionals ride along as ``prior.plugin``; ``expected``: see
    :func:`joint_prior_information`."""
    roots, parts = {}, []
    for n, k in zip(spec.names, spec.sizes):
        if n not in spec.prior_rows:
            node = trace.nodes[n]
            p = root_prior(node["fn"], k, latent_weight(node))
            roots[n] = (p.precision_matrix(), p.loc)
            parts.append(p)
    P, h, plugin, (rows, weighted) = joint_prior_information(spec, trace, roots, expected)
    log_norm = None
    if weighted or any(p.log_norm is not None for p in parts):
        log_norm = rows + sum(p.normaliser() for p in parts)
    if log_norm is None:
        loc = torch.linalg.solve(P, h)
    else:  # a masked conditional can leave the prior flat along some direction: P singular,
        # but h = B^T W c lies in its range (the rows B are independent), so any solution fits
        loc = torch.linalg.lstsq(P, h.unsqueeze(-1)).solution.squeeze(-1)
    prior = GaussianPrior(loc, precision=P, log_norm=log_norm)
    prior.plugin = plugin  # (plug-in conditionals: the mean field owns their factors)
    return prior


def plugin_expected_log_prob(prior, post) -> torch.Tensor:
    """``sum E_q[n - w (B z - c)^2 / 2]`` of ``prior.plugin`` under ``q = post`` (a Gaussian
    with ``loc`` and ``scale_tril()``; closed form): the plug-in conditionals' part of the prior's
    log-density; zero without plug-in conditionals."""
    plugin = getattr(prior, "plugin", None)
    if not plugin:
        return torch.zeros((), dtype=post.loc.dtype, device=post.loc.device)
    loc, scale_tril = post.loc, post.scale_tril()
    total = loc.new_zeros(())
    for B, c, w, norm in plugin:
        r = B @ loc - c
        var = (B @ scale_tril).square().sum(-1)
        total = total + (norm - 0.5 * w * (r.square() + var)).sum()
    return total


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
        # (a block with a member the user named families={site: "gaussian"} stays, at any size)
        families = getattr(an, "placed", (None, None))[0] or {}
        named = {n for n, f in families.items() if f == "gaussian"}
        big = {
            n
            for b in blocks
            if b.chain is None and b.dim > MAX_JOINT_DIM and not set(b.names) & named
            for n in b.names
            if an.deps.get(n)
        }
        if big:
            # (remembered with the tree's size: such members keep an exact mean-field block
            # beside the remainder, model/remainder.remainder_sets)
            sizes = an.__dict__.setdefault("dropped_trees", {})
            for b in blocks:
                for n in set(b.names) & big:
                    sizes[n] = (b.dim, tuple(b.names))
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
            if not an.deps.get(n):
                continue
            deps, scale_deps = an.tree_deps[n]
            if scale_deps:
                # never where the mean field is exact for it (a Normal-Gamma prior: VMP)
                if an.spec(n).exact:
                    bad.add(n)
                    continue
                block.scale_latent.add(n)
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
                dynamic = bool(deps) and probes.depends_on_params(
                    loc, [leaves[m] for m in deps], params
                )
            moved = [
                (dz, unwrap(t.nodes[n]["fn"])[0].loc.expand(shape)) for dz, t in probe_runs(block)
            ]
            structural = probes.affine_graph(loc, [leaves[m] for m in deps])
            if dynamic or not structural or not probes.affine_at(loc.detach(), moved, jac):
                bad.add(n)
            else:
                block.prior_rows[n] = torch.cat([jac[m] for m in block.names], 1)
    return bad
