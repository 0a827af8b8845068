"""The expected-precision message of a Normal factor to a Gaussian block (eq. 20).

For ``y ~ Normal(A z + c, s)`` with ``s`` and ``c`` free of the block ``z``
(:mod:`~pyro_cvi.model.scale_factor`), the message to ``z`` is the row ``(A, w, b)`` with

    w = weight * E_q[1/s^2],        b = weight * E_q[(y - c) / s^2]

per observation (``weight``: the site's masks and ``poutine.scale``), the expectations under
the other blocks' ``q``: in closed form for a log-normal scale (``E[s^-2] = s(e^m)^-2
exp(2 beta^2 v)``), else averaged over many joint draws of ``q`` in one model run with a
particle plate (checked once against one run per draw; a model that does not broadcast over
the plate runs one draw at a time, fewer of them). The draws come from a stream of their own,
so the rest of the fit sees the random numbers it would see without them.
"""

from __future__ import annotations

import warnings
from typing import Dict, Tuple

import pyro
import torch
from pyro.distributions.util import broadcast_shape
from torch.distributions import Independent, TransformedDistribution

from ..gaussian import centred_exp_mean
from ..model.index_guard import checked_indexing
from ..model.scale_factor import log_affine
from ..model.tracing import run_model, subsample_values, unwrap
from .expected_natural import MAX_RELATIVE_SE, batched_agrees, own_random_stream
from .gaussian import RowBlock, _flat_obs, _weight

__all__ = ["expected_scale_rows", "NUM_DRAWS", "LOOPED_DRAWS"]

#: joint draws of ``q`` per message (fewer where ``draws x rows`` exceeds :data:`MAX_ELEMENTS`)
NUM_DRAWS = 256
MAX_ELEMENTS = 2**22
#: draws per message where the model runs one draw at a time
LOOPED_DRAWS = 32
MIN_DRAWS = 16


def expected_scale_rows(ctx, factor, spec, z_at: torch.Tensor) -> RowBlock:
    """The rows of ``factor`` (``CONJUGATE_SCALE`` or ``CONJUGATE_SCALE_MC``) on the Gaussian
    block ``spec`` at its fixed point ``z_at`` under the current ``q`` of the other blocks."""
    info = factor.scale
    at = {n: v.detach() for n, v in spec.split(z_at).items()}
    if info.closed is not None:
        rows = _closed_rows(ctx, factor, at, z_at)
        if rows is not None:
            return rows
    return _monte_carlo_rows(ctx, factor, at, z_at)


def _read(node, A, z_at) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weight, y, loc, scale)`` of the site, broadcast to one shape."""
    base = unwrap(node["fn"])[0]
    y = node["value"]
    shape = broadcast_shape(base.loc.shape, base.scale.shape, y.shape)
    loc = base.loc.detach().expand(shape)
    weight = _weight(node, loc)
    return weight, _flat_obs(node, loc, weight), loc, base.scale.detach().expand(shape)


def _values(ctx, at: Dict[str, torch.Tensor], at_means: bool = False) -> Dict[str, torch.Tensor]:
    values = ctx.sample_q(exclude=set(at), at_means=at_means)
    values.update(at)
    if ctx.trace is not None:
        values.update(subsample_values(ctx.trace))
    return values


def _lognormal(marginal):
    """``(m, v)`` of ``log sigma`` (flattened) for a log-normal ``q(sigma)``, else ``None``."""
    if not isinstance(marginal, TransformedDistribution):
        return None
    ts = marginal.transforms
    if len(ts) != 1 or not log_affine(ts[0]):
        return None
    base = marginal.base_dist
    while isinstance(base, Independent):
        base = base.base_dist
    if not isinstance(base, torch.distributions.Normal):
        return None
    return base.loc.detach().reshape(-1), base.scale.detach().reshape(-1) ** 2


def _closed_rows(ctx, factor, at, z_at):
    z, index, beta = factor.scale.closed
    marginal = ctx.marginal(z)
    moments = _lognormal(marginal)
    if moments is None:  # (not the remainder's log-normal: the draws instead)
        return None
    _, v = moments
    tr, names = ctx.trace, list(at)
    with torch.no_grad():
        at_mean = marginal.transforms[0](marginal.base_dist.mean)
        if not (
            tr is not None
            and factor.site in tr.nodes
            and all(n in tr.nodes for n in names)
            and torch.equal(
                tr.nodes[z]["value"].detach(), at_mean.reshape(tr.nodes[z]["value"].shape)
            )
        ):  # (the step's trace is at the means: no model run)
            tr = run_model(ctx.model, _values(ctx, at, at_means=True), ctx.args, ctx.kwargs, None)
        z_tr = torch.cat([tr.nodes[n]["value"].detach().reshape(-1) for n in names])
        weight, y, loc, scale = _read(tr.nodes[factor.site], factor.jacobian, z_at)
    A = factor.jacobian
    e_prec = scale.reshape(-1).pow(-2) * centred_exp_mean(-2 * beta.to(v), v[index])
    prec = weight.reshape(-1) * e_prec
    c = loc.reshape(-1) - A @ z_tr.to(A)
    return RowBlock(A, prec, prec * (y.reshape(-1) - c), c)


def _per_draw(node, A, z_at, S: int, at_dim) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w, w (y - c), c)`` per draw (``S x R``); the draws along ``at_dim`` (``None``: one
    draw, ``S = 1``)."""
    weight, y, loc, scale = _read(node, A, z_at)
    w = weight / scale**2
    if at_dim is None:
        w, y, loc = w[None], y[None], loc[None]
    else:
        w, y, loc = (t.movedim(at_dim, 0) for t in (w, y, loc))
    w, y, loc = (t.reshape(S, -1) for t in (w, y, loc))
    c = loc - (A @ z_at.reshape(-1))[None]
    return w, w * (y - c), c


def _device_of(stacked: Dict[str, torch.Tensor]) -> torch.device:
    return next(iter(stacked.values())).device if stacked else torch.device("cpu")


def _batched(ctx, factor, values: Dict[str, torch.Tensor], stacked, S: int, z_at):
    """The draws ``stacked`` (``{latent: S x value}``) as one model run in a particle plate
    (``None``: the model does not broadcast over it)."""
    P = factor.scale.plate_dims
    values = dict(values)
    for n, t in stacked.items():
        v = t[0]
        batch = v.dim() - factor.scale.event_dims[n]
        values[n] = t.reshape((S,) + (1,) * (P - batch) + v.shape)

    def particles(*a, **k):
        with pyro.plate("_cvi_scale_particles", S, dim=-1 - P):
            return ctx.model(*a, **k)

    with torch.no_grad():
        tr = run_model(particles, values, ctx.args, ctx.kwargs, None)
        node = tr.nodes[factor.site]
        base = unwrap(node["fn"])[0]
        shape = broadcast_shape(base.loc.shape, base.scale.shape, node["value"].shape)
        dim = len(shape) - 1 - P
        if dim < 0 or shape[dim] != S:
            return None
        out = _per_draw(node, factor.jacobian, z_at, S, dim)
    if out[0].shape[1] != factor.jacobian.shape[0]:
        return None
    return out


def _looped(ctx, factor, values, stacked, S: int, z_at):
    parts = []
    with torch.no_grad():
        for i in range(S):
            vals = {**values, **{n: t[i] for n, t in stacked.items()}}
            tr = run_model(ctx.model, vals, ctx.args, ctx.kwargs, None)
            parts.append(_per_draw(tr.nodes[factor.site], factor.jacobian, z_at, 1, None))
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))


def _draws(ctx, factor, at, S: int):
    """``(values, stacked)``: the model's values with the block at ``at`` and every latent at
    its mean, and ``S`` joint draws of the factor's other latents (``{latent: S x value}``)
    from ``q``: by their marginals where they are one latent (one batched draw), else one
    joint draw of ``q`` at a time. From a stream of their own, seeded by the global random
    state without advancing it (as :mod:`~pyro_cvi.messages.expected_natural`'s)."""
    given = factor.scale.given
    values = _values(ctx, at, at_means=True)
    with own_random_stream(), torch.no_grad():
        if len(given) == 1:
            (n,) = given
            return values, {n: ctx.marginal(n).sample((S,)).reshape((S,) + values[n].shape)}
        draws = [ctx.sample_q(exclude=set(at)) for _ in range(S)]
    return values, {n: torch.stack([d[n] for d in draws]) for n in given}


def _monte_carlo_rows(ctx, factor, at, z_at) -> RowBlock:
    info, R = factor.scale, factor.jacobian.shape[0]
    S = max(MIN_DRAWS, min(NUM_DRAWS, MAX_ELEMENTS // max(R, 1)))
    if info.vectorise is False or len(info.given) > 1:  # (one joint draw of q at a time)
        S = LOOPED_DRAWS
    values, stacked = _draws(ctx, factor, at, S)
    out = None
    if info.vectorise is not False:
        try:
            with checked_indexing(_device_of(stacked), trial=info.vectorise is None):
                out = _batched(ctx, factor, values, stacked, S, z_at)
        except (RuntimeError, ValueError, IndexError, TypeError):
            out = None
        if out is not None and info.vectorise is None:  # checked once against a loop
            if not batched_agrees(out, _looped(ctx, factor, values, stacked, 2, z_at)):
                out = None
        info.vectorise = out is not None
    if out is None:
        out = _looped(ctx, factor, values, stacked, min(S, LOOPED_DRAWS), z_at)
    w, wr, c = out
    n = w.shape[0]
    mean = w.mean(0)
    se = w.std(0) / n**0.5
    noisy = not bool(torch.isfinite(mean).all()) or bool((se > MAX_RELATIVE_SE * mean.abs()).any())
    if noisy and not info.warned:
        info.warned = True
        warnings.warn(
            f"factor {factor.site!r}: E_q[1/scale^2] averaged over {n} draws of q has a "
            f"relative standard error above {MAX_RELATIVE_SE} (heavy tails); the message is "
            "noisy. A scale prior with lighter tails near zero avoids it.",
            RuntimeWarning,
            stacklevel=2,
        )
    return RowBlock(factor.jacobian, mean, wr.mean(0), c.mean(0))
