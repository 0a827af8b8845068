"""Monte Carlo expected messages to a Gamma noise precision beside the remainder (eq. 20).

A Normal likelihood with precision ``c * tau`` and a loc free of ``tau`` has, given the other
latents ``w``, ``log p = sum_n [1/2 log tau - tau c_n (y_n - loc_n(w))^2 / 2] + const``: linear
in the Gamma's sufficient statistics ``(log tau, tau)``. Its message (the gradient of
``E_q[log p]`` in the mean parameters ``(E log tau, E tau)``) is the expected natural parameter

    (sum_n 1/2,  -sum_n c_n E_q[(y_n - loc_n(w))^2] / 2),

exact but for the expectation over ``q(w)``, which is averaged over ``S`` joint draws of the
other blocks (no closed form when ``loc`` is a network; one batched model run when the model
broadcasts over a particle plate). Both coefficients are read by autograd at each draw
(``d/d log tau`` and ``d/d tau`` of the two terms), so the site's weights (``poutine.scale`` /
mask) and any broadcast of ``tau`` over the data are honoured.

The other way round, the factors' expectation over ``q(tau)`` is closed-form: the remainder
reads them at ``tau = E_q[tau]``, which gives ``E_q[log p]`` up to a constant of ``w``, so its
gradients in ``w`` carry no noise from ``tau``; the constant, ``a (E_q[log tau] - log E_q[tau])``
(:func:`jensen_gap`), is added to the bound by the Gamma's owner.
"""

from __future__ import annotations

import weakref
from typing import List, Tuple

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


#: per analysis: whether the draws run as one batched model run (checked once against a loop)
_VECTORISE: weakref.WeakKeyDictionary[object, bool] = weakref.WeakKeyDictionary()


def precision_messages(
    ctx: StepContext, analysis, name: str, sites: List[str], num_samples: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(sum 1/2, -sum c E_q[(y - loc)^2] / 2)`` for Gamma latent ``name`` over ``sites``
    (shaped as its value), the expectation over ``num_samples`` joint draws of ``q``: one model
    run with a particle plate left of the model's plates when the model broadcasts over it
    (checked once against one run per draw), else one run per draw."""
    draws = [ctx.sample_q() for _ in range(num_samples)]
    flag = _VECTORISE.get(analysis)
    batched = None
    if flag is not False:
        try:
            batched = _batched(ctx, analysis, name, sites, draws)
        except (RuntimeError, ValueError, IndexError, TypeError):
            batched = None
        if batched is None:
            _VECTORISE[analysis] = False
        elif flag:
            return batched
    looped = _looped(ctx, analysis, name, sites, draws)
    if flag is None and batched is not None:
        tol = 1e-4 if looped[1].dtype in (torch.float32, torch.float16) else 1e-9
        _VECTORISE[analysis] = all(
            bool(torch.allclose(x, y, rtol=tol, atol=tol)) for x, y in zip(batched, looped)
        )
    return looped


def _coefficients(tr, t: torch.Tensor, sites: List[str]):
    """``(d/d tau, d/d tau)`` of ``sum 1/2 log prec`` and ``-sum sq prec / 2`` at ``tau = t``."""
    A, B = t.new_zeros(()), t.new_zeros(())
    for s in sites:
        node = tr.nodes[s]
        base = unwrap(node["fn"])[0]
        prec = base.scale.pow(-2)
        sq = (node["value"] - base.loc).detach().pow(2)
        A = A + _weighted(node, 0.5 * prec.log())
        B = B + _weighted(node, -0.5 * sq * prec)
    (ga,) = torch.autograd.grad(A, t, allow_unused=True, retain_graph=True)
    (gb,) = torch.autograd.grad(B, t, allow_unused=True)
    a = torch.zeros_like(t) if ga is None else (ga * t).detach()
    b = torch.zeros_like(t) if gb is None else gb.detach()
    return a, b


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


def jensen_gap(a: torch.Tensor, mean: torch.Tensor, geo: torch.Tensor) -> torch.Tensor:
    """``sum a (E_q[log tau] - log E_q[tau])``: what ``E_q[log p]`` of the factors adds to
    their value at ``tau = E_q[tau]`` (their ``log tau`` coefficient is ``a``, the first
    expected natural parameter; ``geo = exp(E_q[log tau])``)."""
    return (a.reshape(mean.shape) * (geo.log() - mean.log())).sum().detach()
