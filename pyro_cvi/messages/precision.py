"""Monte Carlo expected messages to a Gamma noise precision beside the remainder (eq. 20).

A Normal likelihood with precision ``c * tau`` and a loc free of ``tau`` has, given the other
latents ``w``, ``log p = sum_n [1/2 log tau - tau c_n (y_n - loc_n(w))^2 / 2] + const``: linear
in the Gamma's sufficient statistics ``(log tau, tau)``. Its message (the gradient of
``E_q[log p]`` in the mean parameters ``(E log tau, E tau)``) is the expected natural parameter

    (sum_n 1/2,  -sum_n c_n E_q[(y_n - loc_n(w))^2] / 2),

exact but for the expectation over ``q(w)``, which is averaged over ``S`` joint draws of the
other blocks (no closed form when ``loc`` is a network). Both coefficients are read by autograd
at each draw (``d/d log tau`` and ``d/d tau`` of the two terms), so the site's weights
(``poutine.scale`` / mask) and any broadcast of ``tau`` over the data are honoured.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from pyro.distributions.util import sum_rightmost

from ..context import StepContext
from ..model.records import CONJUGATE_MC
from ..model.tracing import run_model, unwrap
from .expectations import site_weight

__all__ = ["precision_sites", "precision_messages"]


def precision_sites(analysis, name: str) -> List[str]:
    """The factors that send latent ``name`` a Monte Carlo expected message."""
    info = analysis.latents.get(name)
    if info is None:
        return []
    return [f.site for f in info.factors if f.kind == CONJUGATE_MC]


def _weighted(node, x: torch.Tensor) -> torch.Tensor:
    fn = node["fn"]
    x = x.expand(torch.broadcast_shapes(x.shape, fn.batch_shape + fn.event_shape))
    return site_weight(node, sum_rightmost(x, x.dim() - len(fn.batch_shape))).sum()


def precision_messages(
    ctx: StepContext, analysis, name: str, sites: List[str], num_samples: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(sum 1/2, -sum c E_q[(y - loc)^2] / 2)`` for Gamma latent ``name`` over ``sites``
    (shaped as its value), the expectation over ``num_samples`` joint draws of ``q``."""
    a_sum, b_sum = None, None
    for _ in range(num_samples):
        values = ctx.sample_q()
        t = values[name].detach().clone().requires_grad_(True)
        values[name] = t
        with torch.enable_grad():
            tr = run_model(ctx.model, values, ctx.args, ctx.kwargs, analysis.enum_dims)
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
        a_sum = a if a_sum is None else a_sum + a
        b_sum = b if b_sum is None else b_sum + b
    assert a_sum is not None and b_sum is not None
    return a_sum / num_samples, b_sum / num_samples
