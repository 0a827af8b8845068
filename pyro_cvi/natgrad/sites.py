"""The family of each guide site, and how its distribution parameters depend on the raw ones.

For a guide site seen by :mod:`.observe`, its distribution is unwrapped (``Independent``
from ``.to_event``, ``ExpandedDistribution`` from plates, ``MaskedDistribution``,
``TransformedDistribution`` with parameter-free transforms - ``LogNormal`` is a Normal under
``exp`` - since a fixed bijection leaves the family's Fisher unchanged) to one of the
exponential families CVI steps:

=====================  ===========================================  ==========
distribution           parameters ``theta``                         group
=====================  ===========================================  ==========
Normal                 loc, scale                                   ``diag``
MultivariateNormal     loc, scale_tril                              ``tril``
LowRankMultivariate-   loc, cov_factor ``W``, cov_diag ``d``        ``lowrank_cov``
Normal                 (``S = W W^T + diag(d)``)
Gamma                  concentration, rate                          ``gamma``
Beta                   concentration1, concentration0               ``beta``
Dirichlet              concentration                                ``dirichlet``
=====================  ===========================================  ==========

Each ``theta_k`` must be an element-wise map ``theta_k = T_k(u_k)`` of exactly one raw
parameter ``u_k`` (the unconstrained tensor of a ``pyro.param`` or ``PyroParam``, any name),
possibly broadcast (plates, particles): its autograd graph has one leaf, and ``T_k`` is the
first of identity, ``exp``, ``softplus`` and the parameter's own constraint transform (or a
composition of the latter with ``exp``/``softplus``) that reproduces ``theta_k`` and its
derivative. Then ``dl/dtheta = (dl/du) / T'(u)`` (summed over broadcast copies), the step is
taken in the family's own parameters, and ``u' = T^-1(theta')``: the natural gradient in the
site's family, mapped to the raw parameters through their (diagonal) Jacobian.

``theta_k`` may also be a selection of ``T(u)`` (``ab[0]``, ``ab[..., 1:]``, ``ab.unbind(-1)``,
torch's ``Beta`` stacking its two concentrations): the indexing operations on the autograd path
from ``theta_k`` to ``u`` (select, slice, unbind, a select of a stack) are replayed on the
element indices of ``u``, giving ``theta_k = broadcast(T(u)[idx_k])`` (:class:`Selected`);
several roles may share one ``u`` through disjoint ``idx_k``. Anything else (a network, a
parameter shared by two sites, a map not recognised) is left to the inner optimizer, and
:meth:`pyro_cvi.CVI.explain` says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Tuple

import pyro
import pyro.distributions as dist
import torch
from torch.distributions import Transform, transform_to, transforms

from .observe import GuideSite
from .params import Selected
from .roles import GaussianGroup

__all__ = ["Selected", "SiteGroups", "site_group", "unwrap"]

#: the largest autograd graph walked from a distribution parameter to its raw parameter
MAX_NODES = 64

_ROLES = {
    "Normal": ("diag", (("loc", "loc"), ("scale", "scale"))),
    "MultivariateNormal": ("tril", (("loc", "loc"), ("scale_tril", "_unbroadcasted_scale_tril"))),
    "LowRankMultivariateNormal": (
        "lowrank_cov",
        (("loc", "loc"), ("cov_factor", "cov_factor"), ("cov_diag", "cov_diag")),
    ),
    "Gamma": ("gamma", (("concentration", "concentration"), ("rate", "rate"))),
    "Beta": ("beta", (("concentration1", "concentration1"), ("concentration0", "concentration0"))),
    "Dirichlet": ("dirichlet", (("concentration", "concentration"),)),
}


def unwrap(fn: Any) -> Any:
    """The exponential-family distribution under the wrappers that keep its Fisher."""
    while True:
        if isinstance(fn, (torch.distributions.Independent, dist.MaskedDistribution)):
            fn = fn.base_dist
        elif isinstance(fn, dist.ExpandedDistribution):
            fn = fn.base_dist
        elif isinstance(fn, torch.distributions.TransformedDistribution):
            if any(_has_graph(t) for t in fn.transforms):
                return None
            fn = fn.base_dist
        else:
            return fn


#: autograd nodes that reshape without reordering (element order kept)
_RESHAPES = frozenset(
    {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "UnsqueezeBackward0"}
    | {"SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "SqueezeBackward3"}
)
#: parts of the names of autograd nodes that reorder, combine or reduce elements: a path
#: through one of them is no element-wise map
_REORDERS = (
    "Permute",
    "Transpose",
    "TBackward",
    "Flip",
    "Roll",
    "Index",
    "Gather",
    "Repeat",
    "Diag",
    "Strided",
    "Narrow",
    "Split",
    "Tril",
    "Triu",
    "Sort",
    "Scatter",
    "Cum",
    "Sum",
    "Mean",
    "Prod",
    "Max",
    "Min",
    "Norm",
    "Softmax",
    "Cat",
    "Mm",
    "Bmm",
    "Matmul",
    "Mv",
    "Dot",
    "Linear",
    "Conv",
)


def _signed(dim: int) -> int:
    # autograd saves a negative ``dim`` it did not normalise as an unsigned 64-bit integer
    return dim - (1 << 64) if dim >= (1 << 63) else dim


def _path(theta: torch.Tensor) -> Optional[Tuple[torch.Tensor, List[Tuple[Any, ...]]]]:
    """``(u, ops)`` when the autograd path from ``theta`` to one leaf ``u`` is a chain of
    one-input nodes, indexing nodes (select, slice, unbind) and selects of a stack; ``ops`` are
    the indexing operations from ``u`` up (``None``: any other graph)."""
    if theta.grad_fn is None:
        return (theta, []) if theta.requires_grad else None
    ops: List[Tuple[Any, ...]] = []  # from theta down
    node, nr = theta.grad_fn, theta.output_nr
    for _ in range(MAX_NODES):
        name = type(node).__name__
        if name == "AccumulateGrad":
            return node.variable, ops[::-1]
        nxt = [(n, i) for n, i in node.next_functions if n is not None]
        if name == "SelectBackward0":
            sizes = tuple(node._saved_self_sym_sizes)
            ops.append(("select", _signed(node._saved_dim) % len(sizes), node._saved_index, sizes))
        elif name == "SliceBackward0":
            sizes = tuple(node._saved_self_sym_sizes)
            dim = _signed(node._saved_dim) % len(sizes)
            start = 0 if node._saved_start is None else _signed(int(node._saved_start))
            end = sizes[dim] if node._saved_end is None else _signed(int(node._saved_end))
            ops.append(("slice", dim, start, end, int(node._saved_step), sizes))
        elif name in _RESHAPES:
            ops.append(("reshape",))
        elif any(k in name for k in _REORDERS):
            return None
        elif name == "UnbindBackward0":
            ops.append(("unbind", _signed(node._saved_dim), nr))
        elif name == "StackBackward0":
            # a select of a stack along the stacked dimension picks one of its inputs
            if not ops or ops[-1][0] != "select":
                return None
            _, dim, index, sizes = ops.pop()
            if (
                _signed(node._saved_dim) % len(sizes) != dim
                or len(node.next_functions) != sizes[dim]
            ):
                return None
            picked = node.next_functions[_signed(index) % sizes[dim]]
            if picked[0] is None:
                return None
            node, nr = picked
            continue
        if len(nxt) != 1:
            return None
        node, nr = nxt[0]
    return None


def _replay(
    u: torch.Tensor, ops: List[Tuple[Any, ...]], shape: torch.Size
) -> Optional[torch.Tensor]:
    """The flat indices of ``u`` that the indexing ``ops`` select, ``theta`` of ``shape``
    (``None``: a shape that does not fit, so an operation between them was not element-wise).
    A reshape keeps the order of the elements: the next operation's input shape (or ``shape``
    at the end) is its output's."""
    idx = torch.arange(u.numel(), device=u.device).reshape(u.shape)
    reshaped = False
    for op in ops:
        kind = op[0]
        if kind == "reshape":
            reshaped = True
            continue
        if reshaped and kind in ("select", "slice"):
            if idx.numel() != math.prod(op[-1]):
                return None
            idx, reshaped = idx.reshape(op[-1]), False
        elif reshaped:
            return None  # (unbind after a reshape: its input shape is not known)
        if kind == "select":
            _, dim, index, sizes = op
            if tuple(idx.shape) != sizes:
                return None
            idx = idx.select(dim, index)
        elif kind == "slice":
            _, dim, start, end, step, sizes = op
            if tuple(idx.shape) != sizes:
                return None
            sl = [slice(None)] * idx.dim()
            sl[dim] = slice(start, end, step)
            idx = idx[tuple(sl)]
        else:
            _, dim, nr = op
            if idx.dim() == 0:
                return None
            idx = idx.unbind(dim)[nr]
    if reshaped:
        if idx.numel() != math.prod(shape):
            return None
        idx = idx.reshape(shape)
    return idx


def _selected(
    theta: torch.Tensor, u: torch.Tensor, idx: torch.Tensor, constraint: Any
) -> Optional[Selected]:
    """``Selected(T, idx)`` with ``theta = broadcast(T(u).flatten()[idx])`` (values)."""
    if idx.numel() == 0 or idx.reshape(-1).unique().numel() != idx.numel():
        return None
    try:
        shape = torch.broadcast_shapes(idx.shape, theta.shape)
    except RuntimeError:
        return None
    if shape != theta.shape:
        return None
    tol = 1e-5 if theta.dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-10
    for t in _candidates(constraint):
        with torch.no_grad():
            try:
                c = t(u.detach())
            except (ValueError, RuntimeError):
                continue
            if c.shape != u.shape:
                continue
            c = c.reshape(-1)[idx].expand(theta.shape)
            if torch.allclose(c, theta.detach(), rtol=tol, atol=tol):
                return Selected(t, idx)
    return None


def _has_graph(t: Transform) -> bool:
    return any(torch.is_tensor(v) and v.requires_grad for v in vars(t).values())


def leaf_tensors(x: torch.Tensor) -> Optional[List[torch.Tensor]]:
    """The leaf tensors ``x`` depends on (``None``: graph too large to look at)."""
    if x.grad_fn is None:
        return [x] if x.requires_grad else []
    seen, stack, found = set(), [x.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if len(seen) > MAX_NODES:
            return None
        var = getattr(node, "variable", None)
        if var is not None:
            found[id(var)] = var
        stack.extend(n for n, _ in node.next_functions)
    return list(found.values())


def _candidates(constraint: Any) -> List[Transform]:
    own = transform_to(constraint) if constraint is not None else transforms.identity_transform
    out: List[Transform] = [
        transforms.identity_transform,
        transforms.ExpTransform(),
        transforms.SoftplusTransform(),
        own,
        transforms.ComposeTransform([own, transforms.ExpTransform()]),
        transforms.ComposeTransform([own, transforms.SoftplusTransform()]),
    ]
    return out


def _match(theta: torch.Tensor, u: torch.Tensor, constraint: Any) -> Optional[Transform]:
    """The element-wise ``T`` with ``theta = broadcast(T(u))`` (value and derivative)."""
    try:
        shape = torch.broadcast_shapes(u.shape, theta.shape)
    except RuntimeError:
        return None
    if shape != theta.shape:
        return None
    for t in _candidates(constraint):
        if reproduces(t, theta, u):
            return t
    return None


def _leaf_reproduces(
    theta: torch.Tensor, u: torch.Tensor, names: Mapping[int, str], constraints: Mapping[str, Any]
) -> bool:
    name = names.get(id(u))
    return name is not None and _match(theta, u, constraints.get(name)) is not None


def reproduces(t: Transform, theta: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether ``theta = broadcast(t(u))`` at the current values (the loss's backward has
    freed the graph: values are compared, every element; a map that agrees with one of the
    candidates at every element of the current ``u`` is taken for it)."""
    tol = 1e-5 if theta.dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-10
    with torch.no_grad():
        try:
            c = t(u.detach())
        except (ValueError, RuntimeError):
            return False
        if c.shape != u.shape:
            return False
        try:
            c = c.expand(theta.shape)
        except RuntimeError:
            return False
        return bool(torch.allclose(c, theta.detach(), rtol=tol, atol=tol))


@dataclass(frozen=True)
class SiteGroups:
    """The groups found in one analysis, and why each other site was left out."""

    groups: Tuple[GaussianGroup, ...]
    skipped: Tuple[Tuple[str, str], ...]  # (site, reason)


def site_group(
    site: GuideSite, names: Mapping[int, str], constraints: Mapping[str, Any]
) -> Tuple[Optional[GaussianGroup], str]:
    """The group of one guide site, or ``(None, why not)``.

    :param names: param-store name of each raw (unconstrained) tensor, by ``id``.
    :param constraints: constraint of each param-store name.
    """
    fn = unwrap(site.fn)
    kind = _ROLES.get(type(fn).__name__) if fn is not None else None
    if kind is None:
        what = type(site.fn).__name__ if fn is None else type(fn).__name__
        return None, f"{what} is not an exponential family CVI steps"
    family, roles = kind
    found: List[Tuple[str, str]] = []
    maps: List[Tuple[str, Any]] = []
    mult = 1
    for role, attr in roles:
        theta = getattr(fn, attr)
        if not theta.requires_grad:
            return None, f"its {role} has no parameter"
        sel = _selection(theta, family, names, constraints)
        if sel is not None:
            name, chosen = sel
            found.append((role, name))
            maps.append((role, chosen))
            mult = max(mult, theta.numel() // max(chosen.idx.numel(), 1))
            continue
        leaves = leaf_tensors(theta)
        if leaves is not None and len(leaves) == len(roles) and family == "beta":
            # torch's Beta stacks (c1, c0) into a Dirichlet: each is a slice of both; the
            # one leaf that reproduces it is its parameter, and the other role has the other
            leaves = [u for u in leaves if _leaf_reproduces(theta, u, names, constraints)]
        if leaves is None or len(leaves) != 1:
            return (
                None,
                f"its {role} depends on {'many' if leaves is None else len(leaves)} tensors",
            )
        (u,) = leaves
        name = names.get(id(u))
        if name is None:
            return None, f"its {role} is not a parameter of the param store"
        t = _match(theta, u, constraints.get(name))
        if t is None:
            return None, f"its {role} is not an element-wise map of {name!r}"
        if family in ("tril",) and role == "scale_tril" and theta.shape[-2:] != u.shape[-2:]:
            return None, "its scale_tril is broadcast"
        found.append((role, name))
        maps.append((role, t))
        mult = max(mult, theta.numel() // max(u.numel(), 1))
    if len({n for _, n in found}) != len(found) and not _disjoint(maps, found):
        return None, "one parameter feeds two of its parameters"
    chosen_maps = dict(maps)
    raw = {
        r: tuple(m.idx.shape) if isinstance(m, Selected) else _raw_shape(n, names)
        for (r, n), m in zip(found, (chosen_maps[r] for r, _ in found))
    }
    if family in ("diag", "gamma", "beta", "dirichlet") and len(set(raw.values())) != 1:
        return None, f"its parameters have different shapes {dict(raw)} (shared by broadcasting)"
    if family == "lowrank_cov" and not (
        len(raw["loc"]) == 1
        and raw["cov_diag"] == raw["loc"]
        and raw["cov_factor"][:1] == raw["loc"]
        and len(raw["cov_factor"]) == 2
    ):
        return None, f"its loc, cov_factor, cov_diag shapes {dict(raw)} are not [D], [D, r], [D]"
    if family == "tril" and raw["loc"] != raw["scale_tril"][:-1]:
        return None, f"its loc {raw['loc']} and scale_tril {raw['scale_tril']} do not match"
    weight = mult / max(site.particles, 1)
    if site.scale == site.scale and site.scale > 0:  # (not nan)
        weight *= site.scale
    group = GaussianGroup(
        family,
        tuple(sorted(found)),
        site=site.name,
        maps=tuple(sorted(maps, key=_first)),
        weight=float(weight),
    )
    return group, ""


#: the families whose parameters may be selections of a shared raw parameter
_SELECTABLE = ("diag", "gamma", "beta", "dirichlet")


def _selection(
    theta: torch.Tensor, family: str, names: Mapping[int, str], constraints: Mapping[str, Any]
) -> Optional[Tuple[str, Selected]]:
    """``(param name, Selected)`` when ``theta`` is a selection of an element-wise map of one
    param-store parameter (``None``: no indexing on the path, or not such a selection)."""
    if family not in _SELECTABLE:
        return None
    path = _path(theta)
    if path is None or not path[1]:
        return None
    u, ops = path
    name = names.get(id(u))
    if name is None:
        return None
    idx = _replay(u, ops, theta.shape)
    if idx is None:
        return None
    chosen = _selected(theta, u, idx, constraints.get(name))
    return None if chosen is None else (name, chosen)


def _disjoint(maps: List[Tuple[str, Any]], found: List[Tuple[str, str]]) -> bool:
    """Whether the roles that share a parameter are selections of disjoint elements of it."""
    by_name: dict = {}
    for (_, name), (_, m) in zip(found, maps):
        by_name.setdefault(name, []).append(m)
    for ms in by_name.values():
        if len(ms) == 1:
            continue
        if not all(isinstance(m, Selected) for m in ms):
            return False
        flat = torch.cat([m.idx.reshape(-1) for m in ms])
        if flat.unique().numel() != flat.numel():
            return False
    return True


def _first(x: Tuple[str, Any]) -> str:
    return x[0]


def _raw_shape(name: str, names: Mapping[int, str]) -> Tuple[int, ...]:
    return tuple(pyro.get_param_store()[name].unconstrained().shape)
