"""Probing a model: Jacobians by autograd, and numeric confirmation of affine structure.

Detection never trusts a pattern match alone (DESIGN.md): a parameter that autograd says is a
function of a latent ``z`` is confirmed to be *affine* in ``z`` by replaying the model at random
points and comparing with its Jacobian. All probes share one tolerance policy,
:func:`rtol`, and a local random generator (the user's RNG stream is not consumed).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..gaussian.selection import SelectionJacobian
from .kron_probes import kron_jacobian, kron_product, matvec, transposed

__all__ = [
    "jacobian",
    "rtol",
    "close",
    "perturbations",
    "affine_at",
    "check_affine",
    "depends_on_params",
]


def rtol(dtype: torch.dtype) -> float:
    """The one relative tolerance of every probe: 1e-3 in reduced precision, 1e-6 in float64."""
    return 1e-3 if dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-6


def detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its graph: ``t`` itself where it has none (its identity kept, and with it
    what is known of it, e.g. :func:`~pyro_cvi.model.kron_probes.kron_factors_of`)."""
    return t.detach() if t.requires_grad else t


def joined(parts: List[torch.Tensor]) -> torch.Tensor:
    """The Jacobians of a block's latents side by side (one: itself, not a copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """``|a - b| <= tol * (1 + max(|a|, |b|))`` elementwise, and both finite."""
    if a.shape != b.shape:
        a, b = torch.broadcast_tensors(a, b)
    scale = 1.0 + torch.maximum(a.abs(), b.abs())  # (not finite where either is not: NaN kept)
    if not bool(torch.isfinite(scale).all()):
        return False
    return bool(((a - b).abs() <= tol * scale).all())


def jacobian(
    out: torch.Tensor,
    z: torch.Tensor,
    chunk: int = 512,
    loop_below: int = 200,
    create_graph: bool = False,
    loop_columns: int = 1024,
) -> torch.Tensor:
    """Dense Jacobian ``d out / d z`` of shape ``(out.numel(), z.numel())``.

    Reverse mode with batched vector-Jacobian products when ``out`` is the smaller side,
    otherwise reverse-of-reverse (a batched Jacobian of the linear map ``v -> A^T v``). With
    ``create_graph`` the Jacobian keeps its graph to the other leaves of ``out`` (an affine
    coefficient ``A(theta)`` differentiable in learnable parameters ``theta``). Below
    ``loop_below`` rows or columns, and for a tall Jacobian of up to ``loop_columns`` columns
    (one backward pass of ``v -> A^T v`` per column: as fast as the batched passes, measured),
    plain backward passes: no vmap, and no explicit ``grad_outputs`` (with which torch
    imports sympy, 0.5-2 CPU s the first time in a process). An ``out`` without autograd
    record (a zero gradient of ``round``/``floor``, a detached value) has the zero Jacobian.
    """
    cg = create_graph
    R, D = out.numel(), z.numel()
    if not out.requires_grad:  # no record to z (e.g. round's gradient: zero, without graph)
        return out.new_zeros(R, D)
    direct = _matvec_jacobian(out, z)
    if direct is not None:
        return direct
    if not cg and D > loop_below and R > loop_below:
        kron = kron_jacobian(out, z, rtol(out.dtype))
        if kron is not None:
            return kron_product(*kron)
    flat = out.reshape(-1)
    rows = []
    if min(R, D) <= loop_below or D < R and D <= loop_columns:  # plain backward passes
        if R <= D:
            for i in range(R):
                (g,) = torch.autograd.grad(
                    flat[i], z, retain_graph=True, allow_unused=True, create_graph=cg
                )
                rows.append(torch.zeros_like(z).reshape(-1) if g is None else g.reshape(-1))
            return torch.stack(rows, 0) if rows else flat.new_zeros(0, D)
        v, atv = transposed(out, z)
        if atv is None:  # ``out`` does not depend on ``z``
            return flat.new_zeros(R, D)
        atv = atv.reshape(-1)
        for j in range(D):
            if not atv.requires_grad:
                rows.append(torch.zeros_like(v))
                continue
            (g,) = torch.autograd.grad(
                atv[j], v, retain_graph=True, allow_unused=True, create_graph=cg
            )
            rows.append(torch.zeros_like(v) if g is None else g)
        return torch.stack(rows, 1)
    if R <= D:
        eye = torch.eye(R, dtype=out.dtype, device=out.device)
        for i in range(0, R, chunk):
            (g,) = torch.autograd.grad(
                flat,
                z,
                eye[i : i + chunk],
                retain_graph=True,
                is_grads_batched=True,
                create_graph=cg,
            )
            rows.append(g.reshape(-1, D))
        return torch.cat(rows, 0)
    v = torch.zeros(R, dtype=out.dtype, device=out.device, requires_grad=True)
    (atv,) = torch.autograd.grad(
        flat, z, v, retain_graph=True, create_graph=True, allow_unused=True
    )
    if atv is None:
        return flat.new_zeros(R, D)
    atv = atv.reshape(-1)
    eye = torch.eye(D, dtype=out.dtype, device=out.device)
    for i in range(0, D, chunk):
        (g,) = torch.autograd.grad(
            atv,
            v,
            eye[i : i + chunk],
            retain_graph=True,
            is_grads_batched=True,
            create_graph=cg,
        )
        rows.append(g)
    return torch.cat(rows, 0).T.contiguous()


def _matvec_jacobian(out: torch.Tensor, z: torch.Tensor) -> Optional[torch.Tensor]:
    """``d (X z) / dz = X`` (a copy), read off autograd's record when ``out`` is exactly one
    matrix-vector product of a matrix that needs no gradient with the leaf ``z`` (the usual
    linear predictor ``X @ w``): no backward passes. ``None`` for anything else."""
    X = matvec_matrix(out, z)
    return None if X is None else X.detach().clone()


def matvec_matrix(
    out: torch.Tensor, z: torch.Tensor, views: bool = False
) -> Optional[torch.Tensor]:
    """The matrix ``X`` itself (not a copy: read it, do not keep it) where ``out`` is exactly
    ``X @ z`` (:func:`_matvec_jacobian`), else ``None``. With ``views``, also through a view
    of a vector as itself (``reshape(-1)`` of a vector)."""
    fn = out.grad_fn
    identity = ("ExpandBackward0", "ViewBackward0") if views else ("ExpandBackward0",)
    while type(fn).__name__ in identity and tuple(fn._saved_self_sym_sizes) == tuple(
        out.shape
    ):  # an expand to the same shape (a plate's broadcast), a vector as itself: the identity
        fn = fn.next_functions[0][0]
    if fn is None or type(fn).__name__ != "MvBackward0" or z.dim() != 1:
        return None
    (x_fn, _), (z_fn, _) = fn.next_functions
    if x_fn is not None or type(z_fn).__name__ != "AccumulateGrad" or z_fn.variable is not z:
        return None
    X = fn._saved_self
    if X.shape != (out.numel(), z.numel()):
        return None
    return X


#: what a model (or a density) raises on values it refuses; anything else (an interrupt, an
#: error of the caller's) propagates
MODEL_ERRORS = (
    ValueError,
    RuntimeError,
    AssertionError,
    TypeError,
    IndexError,
    ZeroDivisionError,
    OverflowError,
)

#: halvings of a probe move the model refuses (a rate sent negative) before it is left out
PROBE_HALVINGS = 4


def moved_runs(run: Callable, at: Dict[str, torch.Tensor], moves) -> list:
    """``[(dz, run(z0 + dz))]`` for the ``moves``; a move whose values the model refuses
    (:data:`MODEL_ERRORS`: a rate or scale sent out of its support) is halved up to
    :data:`PROBE_HALVINGS` times, then left out. With no move left the list is empty and no
    affinity is confirmed."""
    out = []
    for dz in moves:
        for _ in range(PROBE_HALVINGS + 1):
            try:
                out.append((dz, run({p: z + dz[p] for p, z in at.items()})))
                break
            except MODEL_ERRORS:
                dz = {p: 0.5 * d for p, d in dz.items()}
    return out


def perturbations(at: Dict[str, torch.Tensor], num_probes: int = 2, seed: int = 7):
    """Random joint perturbations of the values ``at``, of the size of the values (>= 1).

    With two probes or more, one more: the *reflection* ``z0 -> -z0 - s/2 sign(z0)``, which
    takes every element across zero. Random moves can all fall on one side of a branch on the
    latent's value (``3 z if z > 0 else -z``, ``z * (z > 0)``), where the map is affine with
    the Jacobian at ``z0``; the reflection crosses the most common one, at zero, in every
    element. (Any finite set of points can miss a branch elsewhere.)"""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(num_probes):
        dz = {}
        for p, z0 in at.items():
            s = z0.abs().mean().clamp_min(1.0) if z0.numel() else 1.0
            e = torch.randn(z0.shape, generator=g, dtype=torch.float64, device=g.device)
            dz[p] = ((s.to(g.device) if torch.is_tensor(s) else s) * e).to(z0)
        out.append(dz)
    if num_probes >= 2:
        dz = {}
        for p, z0 in at.items():
            s = z0.abs().mean().clamp_min(1.0) if z0.numel() else 1.0
            sign = torch.where(z0 >= 0, 1.0, -1.0).to(z0)
            dz[p] = -2 * z0 - 0.5 * s * sign
        out.append(dz)
    return out


def affine_at(
    f0: torch.Tensor,
    moved: Sequence[Tuple[Dict[str, torch.Tensor], torch.Tensor]],
    jacobians: Dict[str, Union[torch.Tensor, SelectionJacobian]],
) -> bool:
    """Confirm ``f(z0 + dz) = f(z0) + sum_p A_p dz_p`` for every probe ``(dz, f(z0 + dz))``."""
    f0 = f0.reshape(-1)
    tol = rtol(f0.dtype)
    with torch.no_grad():
        for dz, f in moved:
            pred = f0.clone()
            for p, A in jacobians.items():
                if p in dz:
                    d = dz[p].reshape(-1)
                    sel = isinstance(A, SelectionJacobian)
                    pred = pred + (A.matvec(d) if sel else matvec(A, d))
            if not close(f.reshape(-1), pred, tol):
                return False
    return True


def check_affine(
    fn: Callable[[Dict[str, torch.Tensor]], torch.Tensor],
    at: Dict[str, torch.Tensor],
    jacobians: Dict[str, Union[torch.Tensor, SelectionJacobian]],
    num_probes: int = 2,
    f0: Optional[torch.Tensor] = None,
) -> bool:
    """Confirm ``fn(z) = fn(z0) + sum_p A_p (z_p - z0_p)`` at random joint perturbations.

    ``at``: the reference values ``z0`` by latent name; ``jacobians``: ``A_p`` of shape
    ``(numel fn, numel z_p)``; ``f0``: ``fn(z0)`` if known (saves a model run).
    """
    with torch.no_grad():
        f0 = fn(dict(at)) if f0 is None else f0
        moved = moved_runs(fn, at, perturbations(at, num_probes))
    return bool(moved) and affine_at(f0, moved, jacobians)


def depends_on_params(value: torch.Tensor, leaves: Sequence[torch.Tensor], params) -> bool:
    """Whether ``d value / d z`` (for any ``z`` in ``leaves``) depends on learnable ``params``:
    then an affine coefficient moves with the hyperparameters and is recomputed every step."""
    params = [p for p in params if torch.is_tensor(p) and p.requires_grad]
    if not params:
        return False
    grads = torch.autograd.grad(
        (value * _probe_weights(value)).sum(),
        list(leaves),
        retain_graph=True,
        create_graph=True,
        allow_unused=True,
    )
    total = sum(g.sum() for g in grads if g is not None and g.requires_grad)
    if not torch.is_tensor(total):
        return False
    second = torch.autograd.grad(total, params, allow_unused=True, retain_graph=True)
    return any(x is not None for x in second)


def _probe_weights(value: torch.Tensor) -> torch.Tensor:
    """Random weights of the shape of ``value`` from the local generator (seeded: the user's
    RNG stream is not consumed, and the answer is the same every time)."""
    g = torch.Generator(device="cpu").manual_seed(11)
    return torch.randn(value.shape, generator=g, dtype=torch.float64, device=g.device).to(value)


#: autograd ops linear in each input (a sum, a copy, a selection, a reshaping): affine whatever
#: of their inputs depends on the latent
_LINEAR_OPS = frozenset(
    """Add Sub Rsub Neg Sum Mean Expand View UnsafeView Reshape ReshapeAlias Unsqueeze Squeeze
    Permute Transpose T Select Slice Index IndexSelect Gather Cat Stack Unbind Clone ToCopy
    Alias AsStrided Split SplitWithSizes Diagonal DiagEmbed Diag Flip Roll Repeat Cumsum Tril
    Triu IndexPut Narrow Movedim Unfold Sparse Conj Squeeze1 ExpandAs TakeAlongDim Trace
    UnbindBackward Chunk SumToSize Lift Identity""".split()
)
#: ops bilinear in two inputs: affine when at most one of them depends on the latent
_BILINEAR_OPS = frozenset(
    "Mul Mm Mv Bmm Dot Matmul Addmm Addmv Addbmm Baddbmm Einsum Linear Outer Kron".split()
)


#: ``(outer, inner)`` ops that cancel: a parameter read through its link's inverse
_INVERSE_PAIRS = frozenset({("Log", "Exp"), ("Exp", "Log")})


#: elementwise-commuting shape ops a link's inverse may be read through (log(expand(exp(x))))
_SHAPE_OPS = frozenset(
    "Expand View UnsafeView Reshape ReshapeAlias Unsqueeze Squeeze Permute Transpose T Select "
    "Slice Index Clone Alias AsStrided ToCopy".split()
)


def _through_inverse(fn, op: str):
    """The inverse op under ``fn`` (``exp`` under ``log``), through shape-only ops, or ``None``."""
    node = fn
    while True:
        nxt = [n for n, _ in node.next_functions if n is not None]
        if len(nxt) != 1:
            return None
        node = nxt[0]
        name = _op_name(node)
        if (op, name) in _INVERSE_PAIRS:
            return node
        if name not in _SHAPE_OPS:
            return None


def _op_name(fn) -> str:
    name = type(fn).__name__
    for suffix in ("Backward0", "Backward1", "Backward2", "Backward"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _below_clamp(node):
    """What ``node`` clamps (torch's ``clamp_probs`` guard keeps ``p`` off 0 and 1), through
    shape-only ops (a ``Bernoulli`` expanded to a plate)."""
    while node is not None and (_op_name(node) == "Clamp" or _op_name(node) in _SHAPE_OPS):
        nxt = [n for n, _ in node.next_functions if n is not None]
        if len(nxt) != 1:
            return node
        node = nxt[0]
    return node


def _skip_shape(node):
    while node is not None and _op_name(node) in _SHAPE_OPS:
        nxt = [n for n, _ in node.next_functions if n is not None]
        if len(nxt) != 1:
            return node
        node = nxt[0]
    return node


def _log_of_scaled_exp(fn, reaches):
    """The input of ``exp`` where ``fn`` is ``log(c * exp(y))`` with ``c`` free of the latents
    (``= y + log c``: a Poisson rate ``exp(f) * exposure`` read back as its log), else ``None``."""
    nxt = [n for n, _ in fn.next_functions if n is not None]
    if len(nxt) != 1:
        return None
    mul = _skip_shape(nxt[0])
    if mul is None or _op_name(mul) != "Mul":
        return None
    moving = [n for n, _ in mul.next_functions if n is not None and reaches(n)]
    if len(moving) != 1:
        return None
    exp = _skip_shape(moving[0])
    if exp is None or _op_name(exp) != "Exp":
        return None
    return exp.next_functions[0][0]


def _logit_of_sigmoid(inputs):
    """The input of ``sigmoid`` where a subtraction is ``log(p) - log1p(-p)`` of ``p =
    sigmoid(y)`` (the logits torch reads off ``probs``), else ``None``."""
    if len(inputs) != 2 or inputs[0] is None or inputs[1] is None:
        return None
    if _op_name(inputs[0]) != "Log" or _op_name(inputs[1]) != "Log1P":
        return None
    p = _below_clamp(inputs[0].next_functions[0][0])
    neg = inputs[1].next_functions[0][0]
    if neg is None or _op_name(neg) != "Neg" or _below_clamp(neg.next_functions[0][0]) is not p:
        return None
    if p is None or _op_name(p) != "Sigmoid":
        return None
    return p.next_functions[0][0]


def _normalises(inputs) -> bool:
    """Whether a subtraction's inputs are ``(x, logsumexp(x))`` (Categorical's normalisation)."""
    if len(inputs) != 2 or inputs[0] is None or inputs[1] is None:
        return False
    if _op_name(inputs[1]) != "Logsumexp":
        return False
    return any(nxt is inputs[0] for nxt, _ in inputs[1].next_functions)


def affine_graph(
    value: torch.Tensor, leaves: Sequence[torch.Tensor], row_constant: bool = False
) -> bool:
    """Whether autograd's record of ``value`` is affine in the ``leaves``: on every path from a
    leaf to ``value`` each operation is linear (a sum, a copy, a selection, a reshaping, a
    product with one factor free of the leaves, a quotient by something free of them). With
    ``row_constant`` (centred logits), a normalisation ``x - logsumexp(x)`` counts as ``x``: it
    shifts a row by one constant, which the centring removes.

    A numeric probe cannot tell ``clamp``, ``relu``, ``abs``, ``round``, ``where`` or ``max``
    from an affine map at a few points (each is affine almost everywhere); the record can. The
    record does not see a dependence that leaves autograd (a cast to an integer, ``detach``,
    ``.item()``): the numeric probes check that part (the value moves, the record says no)."""
    if not value.requires_grad or value.grad_fn is None:
        return True
    targets = {id(z) for z in leaves}
    reach: Dict[int, bool] = {}

    def reaches(fn) -> bool:
        if fn is None:
            return False
        key = id(fn)
        if key not in reach:
            reach[key] = False  # (a cycle cannot occur; guards the recursion)
            var = getattr(fn, "variable", None)
            if var is not None:
                reach[key] = id(var) in targets
            else:
                reach[key] = any(reaches(nxt) for nxt, _ in fn.next_functions)
        return reach[key]

    stack, seen = [value.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen or not reaches(fn):
            continue
        seen.add(id(fn))
        if getattr(fn, "variable", None) is not None:
            continue
        op = _op_name(fn)
        inputs = [nxt for nxt, _ in fn.next_functions]
        hits = [reaches(nxt) for nxt in inputs]
        if row_constant and op == "Sub" and _normalises(inputs):  # x - logsumexp(x)
            stack.append(inputs[0])
            continue
        if op == "Log" and (inner := _log_of_scaled_exp(fn, reaches)) is not None:
            stack.append(inner)  # log(c exp(y)) = y + log c
            continue
        if op == "Sub" and (inner := _logit_of_sigmoid(inputs)) is not None:
            stack.append(inner)  # logit(sigmoid(y)) = y: logits read off probs
            continue
        inverse = _through_inverse(fn, op)
        if inverse is not None:  # a link read back through its inverse: log(exp(.))
            stack.extend(nxt for nxt, _ in inverse.next_functions)
            continue
        if op in _LINEAR_OPS:
            pass
        elif op in _BILINEAR_OPS:
            if op.startswith("Add") and len(hits) == 3:  # bias + a @ b: one of a, b
                if hits[1] and hits[2]:
                    return False
            elif sum(hits) > 1:
                return False
        elif op == "Div":
            if len(hits) > 1 and hits[1]:  # divided by something that moves with z
                return False
        else:
            return False
        stack.extend(inputs)
    return True
