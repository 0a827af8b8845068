"""Monte Carlo expected messages to a Gamma noise precision beside the remainder (eq. 20).

A Normal likelihood with precision ``c * tau`` and a loc free of ``tau`` has, given the other
latents ``w``, ``log p = sum_n [1/2 log tau - tau c_n (y_n - loc_n(w))^2 / 2] + const``: linear
in the Gamma's sufficient statistics ``(log tau, tau)``. Its message (the gradient of
``E_q[log p]`` in the mean parameters ``(E log tau, E tau)``) is the expected natural parameter

    (sum_n 1/2,  -sum_n c_n E_q[(y_n - loc_n(w))^2] / 2),

exact but for the expectation over ``q(w)``, which is averaged over ``S`` joint draws of the
other blocks (no closed form when ``loc`` is a network). The ``S`` draws are one batched model
run: a particle plate left of the model's plates when the model broadcasts over it, else the
model mapped over the draws by ``torch.func.vmap`` (a ``PyroModule`` network whose layers take
one weight matrix), else one run per draw; the first way that agrees with the loop at the first
step is kept. Both coefficients are read by autograd at each draw
(``d/d log tau`` and ``d/d tau`` of the two terms), so the site's weights (``poutine.scale`` /
mask) and any broadcast of ``tau`` over the data are honoured.

The other way round, the factors' expectation over ``q(tau)`` is closed-form: the remainder
reads them at ``tau = E_q[tau]``, which gives ``E_q[log p]`` up to a constant of ``w``, so its
gradients in ``w`` carry no noise from ``tau``; the constant, ``a (E_q[log tau] - log E_q[tau])``
(:func:`jensen_gap`), is added to the bound by the Gamma's owner.
"""

from __future__ import annotations

import weakref
from typing import Callable, List, Optional, Tuple

import pyro
import torch
from pyro.distributions.util import sum_rightmost

from ..context import StepContext
from ..model.records import CONJUGATE_MC
from ..model.tracing import run_model, unwrap
from .expectations import particle_values, site_weight

__all__ = ["jensen_gap", "precision_sites", "precision_messages"]


def precision_sites(analysis, name: str) -> List[str]:
    """The factors that send latent ``name`` a Monte Carlo expected message."""
    info = analysis.latents.get(name)
    if info is None:
        return []
    return [f.site for f in info.factors if f.kind == CONJUGATE_MC]


def _broadcast(a: torch.Size, b: torch.Size) -> torch.Size:
    """NumPy's broadcast of two shapes (``torch.broadcast_shapes`` without its per-call cost)."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for i, j in zip(a, b):
        if i != j and i != 1 and j != 1:
            raise ValueError(f"shapes {a} and {b} do not broadcast")
        out.append(j if i == 1 else i)
    return torch.Size(out)


def _weighted(node, x: torch.Tensor) -> torch.Tensor:
    fn = node["fn"]
    x = x.expand(_broadcast(x.shape, fn.batch_shape + fn.event_shape))
    return site_weight(node, sum_rightmost(x, x.dim() - len(fn.batch_shape))).sum()


#: per analysis: the batched way its draws run (checked once against a loop; ``None``: none)
_VECTORISE: weakref.WeakKeyDictionary[object, Optional[Callable]] = weakref.WeakKeyDictionary()

_REFUSED = (RuntimeError, ValueError, IndexError, TypeError, NotImplementedError)


def precision_messages(
    ctx: StepContext, analysis, name: str, sites: List[str], num_samples: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(sum 1/2, -sum c E_q[(y - loc)^2] / 2)`` for Gamma latent ``name`` over ``sites``
    (shaped as its value), the expectation over ``num_samples`` joint draws of ``q``: one
    batched model run (a particle plate, else ``vmap`` over the draws; the first that agrees
    with one run per draw at the first call), else one run per draw."""
    draws = [ctx.sample_q() for _ in range(num_samples)]
    if analysis in _VECTORISE:
        way = _VECTORISE[analysis]
        if way is not None:
            try:
                return way(ctx, analysis, name, sites, draws)
            except _REFUSED:  # (a model whose path changed with the values)
                _VECTORISE[analysis] = None
        return _looped(ctx, analysis, name, sites, draws)
    looped = _looped(ctx, analysis, name, sites, draws)
    tol = 1e-4 if looped[1].dtype in (torch.float32, torch.float16) else 1e-9
    _VECTORISE[analysis] = None
    for way in (_batched, _vmapped):
        try:
            found = way(ctx, analysis, name, sites, draws)
        except _REFUSED:
            found = None
        if found is not None and all(
            bool(torch.allclose(x, y, rtol=tol, atol=tol)) for x, y in zip(found, looped)
        ):
            _VECTORISE[analysis] = way
            break
    return looped


def _terms(tr, sites: List[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``sum 1/2 log prec`` and ``-sum sq prec / 2`` over ``sites`` (the weights applied)."""
    A: Optional[torch.Tensor] = None
    B: Optional[torch.Tensor] = None
    for s in sites:
        node = tr.nodes[s]
        base = unwrap(node["fn"])[0]
        prec = base.scale.pow(-2)
        sq = (node["value"] - base.loc).detach().pow(2)
        a, b = _weighted(node, 0.5 * prec.log()), _weighted(node, -0.5 * sq * prec)
        A, B = (a, b) if A is None or B is None else (A + a, B + b)
    assert A is not None and B is not None
    return A, B


def _grads(A: torch.Tensor, B: torch.Tensor, t: torch.Tensor):
    """``(t dA/dt, dB/dt)``: the two coefficients at ``t`` (zeros where unused)."""
    ga = gb = None
    if A.requires_grad:
        (ga,) = torch.autograd.grad(A, t, allow_unused=True, retain_graph=True)
    if B.requires_grad:
        (gb,) = torch.autograd.grad(B, t, allow_unused=True)
    a = torch.zeros_like(t) if ga is None else (ga * t).detach()
    b = torch.zeros_like(t) if gb is None else gb.detach()
    return a, b


def _coefficients(tr, t: torch.Tensor, sites: List[str]):
    """``(d/d tau, d/d tau)`` of ``sum 1/2 log prec`` and ``-sum sq prec / 2`` at ``tau = t``."""
    return _grads(*_terms(tr, sites), t)


def _looped(ctx, analysis, name, sites, draws):
    a_sum, b_sum = None, None
    for values in draws:
        values = dict(values)
        t = values[name].detach().clone().requires_grad_(True)
        values[name] = t
        with torch.enable_grad():
            tr = run_model(ctx.model, values, ctx.args, ctx.kwargs, analysis.enum_dims)
            a, b = _coefficients(tr, t, sites)
        a_sum = a if a_sum is None else a_sum + a
        b_sum = b if b_sum is None else b_sum + b
    assert a_sum is not None and b_sum is not None
    return a_sum / len(draws), b_sum / len(draws)


def _batched(ctx, analysis, name, sites, draws):
    """The draws as one model run in a particle plate (``None``: the model does not broadcast)."""
    S, P, values = len(draws), analysis.plate_dims, particle_values(analysis, draws)
    shape = draws[0][name].shape
    t = values[name].detach().clone().requires_grad_(True)
    values[name] = t

    def particles(*a, **k):
        with pyro.plate("_cvi_precision_particles", S, dim=-1 - P):
            return ctx.model(*a, **k)

    with torch.enable_grad():
        tr = run_model(particles, values, ctx.args, ctx.kwargs, analysis.enum_dims)
        for s in sites:
            bs = tr.nodes[s]["fn"].batch_shape
            if len(bs) < P + 1 or bs[len(bs) - 1 - P] != S:
                return None
        a, b = _coefficients(tr, t, sites)
    return a.reshape((S,) + shape).mean(0), b.reshape((S,) + shape).mean(0)


def _vmapped(ctx, analysis, name, sites, draws):
    """The draws as one model run mapped over them by ``torch.func.vmap`` (the model sees one
    draw's shapes; Pyro's argument checks, data-dependent branches, are off inside). The
    coefficients by autograd through the map: draw ``k``'s terms depend on its own ``t_k``."""
    S, shape = len(draws), draws[0][name].shape
    values = {n: torch.stack([d[n] for d in draws]) for n in draws[0]}
    t = values[name].detach().clone().requires_grad_(True)
    values[name] = t

    def one(v):
        with pyro.validation_enabled(False):
            tr = run_model(ctx.model, v, ctx.args, ctx.kwargs, analysis.enum_dims)
        return _terms(tr, sites)

    with torch.enable_grad():
        A, B = torch.func.vmap(one, randomness="error")(values)
        a, b = _grads(A.sum(), B.sum(), t)
    return a.reshape((S,) + shape).mean(0), b.reshape((S,) + shape).mean(0)


def jensen_gap(a: torch.Tensor, mean: torch.Tensor, geo: torch.Tensor) -> torch.Tensor:
    """``sum a (E_q[log tau] - log E_q[tau])``: what ``E_q[log p]`` of the factors adds to
    their value at ``tau = E_q[tau]`` (their ``log tau`` coefficient is ``a``, the first
    expected natural parameter; ``geo = exp(E_q[log tau])``)."""
    return (a.reshape(mean.shape) * (geo.log() - mean.log())).sum().detach()
