"""Expected natural parameters: the VMP message of a factor to the latent it draws (eq. 20).

A factor ``p(z | theta)`` whose distribution is in the family of ``q(z)`` is conjugate to
``z`` given its parents ``theta`` (other blocks' latents), whatever ``theta`` does elsewhere:
``log p = <eta(theta), phi(z)> - A(eta(theta))`` with base measure ``h = 1``, so its message to
``z`` (the gradient of ``E_q[log p]`` in the mean parameters ``E_q phi(z)``) is the expected
natural parameter

    lambda~_{a,z} = E_{q(theta)}[eta(theta)]                                     (eq. 20)

(a Dirichlet's ``concentration - 1``, a Gamma's ``(shape - 1, -rate)``), however the factor's
other messages (to ``theta``, through ``A``) are computed. Two rules:

* :data:`EXACT`: ``eta`` is affine in the parents (probed at set-up), so
  ``E[eta(theta)] = eta(E theta)``: one read at the mean values (LDA's document topics,
  ``Dirichlet(topic_weights)``);
* :data:`MONTE_CARLO`: no closed form (a Gamma rate ``b / (u1 + u2)``): the average of
  ``eta(theta)`` over ``S`` joint draws of ``q`` in one model run with a particle plate
  (checked once against one run per draw). An average of natural parameters, so cheap and of
  low variance; used where it is reliable (finite, small standard error: ``E[1/x]`` under a
  Gamma of shape below 1 is infinite), and only where the model broadcasts over the particle
  plate; elsewhere the factor's Monte Carlo gradient serves as before.

The message is weighted like the site's log-density (``poutine.scale``, masks).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import pyro
import pyro.distributions as dist
import torch
from torch.distributions import biject_to

from ..model import probes
from ..model.explain import EXACT, MONTE_CARLO
from ..model.factor_roles import FactorSpec
from ..model.index_guard import checked_indexing
from ..model.tracing import run_model, unwrap
from .expectations import particle_values

__all__ = [
    "EXACT",
    "MONTE_CARLO",
    "expected_natural",
    "expected_natural_rule",
    "monte_carlo_messages_used",
]


Params = Tuple[torch.Tensor, ...]

#: per analysis: ``{site: rule or None}`` (probed once)
_RULES: weakref.WeakKeyDictionary[object, Dict[str, Optional[str]]] = weakref.WeakKeyDictionary()
#: per analysis: whether the draws run as one batched model run (checked once against a loop)
_VECTORISE: weakref.WeakKeyDictionary[object, bool] = weakref.WeakKeyDictionary()


def _natural_of(fam, fn) -> Optional[Params]:
    try:
        nat = fam.dist_to_natural(unwrap(fn)[0])
    except (TypeError, ValueError, RuntimeError, NotImplementedError, AttributeError):
        return None
    return tuple(nat)


def _flat(nat: Params) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in nat])


def expected_natural_rule(an, spec: FactorSpec, fam) -> Optional[str]:
    """How factor ``spec`` sends the latent it draws its expected natural parameter:
    :data:`EXACT`, :data:`MONTE_CARLO`, or ``None`` (not a non-conjugate factor of a
    continuous natural-form latent whose family holds the factor's distribution)."""
    cache = _RULES.setdefault(an, {})
    if spec.site not in cache:
        cache[spec.site] = _probe_rule(an, spec, fam)
    return cache[spec.site]


def _probe_rule(an, spec: FactorSpec, fam) -> Optional[str]:
    if spec.exact or spec.collapsed or spec.value_kind != "latent" or spec.discrete:
        return None
    if fam is None or fam.is_discrete or hasattr(fam, "sample_with_log_det"):
        return None
    parents = sorted(spec.continuous - {spec.site})
    if not parents:
        return None

    def eta(values: Dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        with torch.no_grad():
            nat = _natural_of(fam, an.run(**values).nodes[spec.site]["fn"])
        return None if nat is None else _flat(nat)

    ref = {p: an.ref[p] for p in parents if p in an.ref}
    if len(ref) != len(parents):
        return None
    e0 = eta(ref)
    if e0 is None or not bool(torch.isfinite(e0).all()):
        return None
    # affine along random chords of the parents' supports (convex: midpoints stay valid)
    tol = probes.rtol(e0.dtype)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        other = {}
        for p, z in ref.items():
            t = biject_to(an.structure.nodes[p]["fn"].support)
            u = t.inv(z)
            noise = torch.randn(u.shape, generator=gen, dtype=torch.float64, device=gen.device).to(
                u
            )
            other[p] = t(u + 0.7 * noise)
        e1 = eta(other)
        mid = eta({p: 0.5 * (ref[p] + other[p]) for p in ref})
        if e1 is None or mid is None or not probes.close(mid, 0.5 * (e0 + e1), tol):
            return MONTE_CARLO
    return EXACT


def monte_carlo_messages_used(an) -> bool:
    """Whether :data:`MONTE_CARLO` messages are used for this model: it broadcasts over a
    particle plate (unknown before the first step: assumed)."""
    return _VECTORISE.get(an) is not False


# ---------------------------------------------------------------------- the message
def _weight(node, full: torch.Size) -> torch.Tensor:
    """The site's scale and masks over the base distribution's batch shape ``full``."""
    fn = node["fn"]
    w = torch.ones(full, dtype=torch.get_default_dtype(), device=node["value"].device)
    d = fn
    while True:
        if isinstance(d, dist.MaskedDistribution):
            m = d._mask
            if m is False:
                return torch.zeros(full, device=node["value"].device)
            if m is not True:
                m = m.reshape(m.shape + (1,) * (len(full) - len(d.batch_shape)))
                w = w * m
            d = d.base_dist
        elif isinstance(d, (torch.distributions.Independent, dist.ExpandedDistribution)):
            d = d.base_dist
        else:
            break
    k = len(full) - len(fn.batch_shape)
    for extra in (node["mask"], node["scale"]):
        if extra is None:
            continue
        if torch.is_tensor(extra):
            extra = extra.reshape(extra.shape + (1,) * k)
        w = w * extra
    return w


def _read(node, fam) -> Params:
    """The site's natural parameters, weighted, broadcast over its full batch shape
    (``fn.batch_shape`` and the reinterpreted event dims) and the family's parameter dims."""
    fn = node["fn"]
    base = unwrap(fn)[0]
    nat = fam.dist_to_natural(base)
    full = fn.batch_shape + fn.event_shape[: fn.event_dim - base.event_dim]
    w = None
    out = []
    for t in nat:
        t = t.detach()
        tail = t.shape[len(base.batch_shape) :]
        t = torch.broadcast_to(t, full + tail)
        if w is None:
            w = _weight(node, full).to(t)
        out.append(t * w.reshape(w.shape + (1,) * len(tail)))
    return tuple(out)


#: the largest relative standard error of a Monte Carlo expected natural parameter that is
#: used as the message (heavier tails, e.g. ``E[1/x]`` under a Gamma of shape < 1, which may
#: be infinite: the factor's Monte Carlo gradient instead)
MAX_RELATIVE_SE = 0.1


def expected_natural(
    ctx,
    an,
    site: str,
    fam,
    rule: str,
    shapes: Sequence[torch.Size],
    mean_trace: Callable[[], object],
    num_samples: int,
) -> Optional[Tuple[Params, torch.Tensor]]:
    """``(E_q[eta(theta)], reliable)`` of factor ``site`` (weighted), shaped like the natural
    parameters ``shapes`` of its latent: at the mean values (:data:`EXACT`, ``mean_trace()``;
    every element reliable), or averaged over ``num_samples`` joint draws of ``q``
    (:data:`MONTE_CARLO`; ``reliable`` marks the elements of the family's batch whose average
    is finite with a relative standard error below :data:`MAX_RELATIVE_SE`). ``None`` where
    the model does not broadcast over a particle plate: the draws would cost one model run
    each, and the factor's Monte Carlo gradient (whose draws are paid for) serves instead."""
    batch = shapes[0][: len(shapes[0]) - len(fam.param_shapes[0])]
    if rule == EXACT:
        nat = _read(mean_trace().nodes[site], fam)
        out = tuple(t.reshape(s) for t, s in zip(nat, shapes))
        return out, torch.ones(batch, dtype=torch.bool, device=out[0].device)
    if _VECTORISE.get(an) is False:
        return None
    draws = _draws(ctx, num_samples)
    try:
        with checked_indexing(_device_of(draws), trial=an not in _VECTORISE):
            batched = _batched(ctx, an, site, fam, draws, shapes)
    except (RuntimeError, ValueError, IndexError, TypeError):
        batched = None
    if batched is not None and an not in _VECTORISE:  # checked once against one run per draw
        looped = _looped(ctx, an, site, fam, draws[:2], shapes)
        if not batched_agrees(batched, looped):
            batched = None
    _VECTORISE[an] = batched is not None
    return None if batched is None else _summary(batched, fam, batch)


@contextlib.contextmanager
def own_random_stream() -> Iterator[None]:
    """A random stream of its own for the draws inside, seeded by the global random state
    without advancing it: the other messages see the draws they would see without these (a
    fit is reproducible, and unchanged where no message is used)."""
    state = torch.random.get_rng_state()
    w = torch.arange(1, state.numel() + 1, dtype=torch.int64, device=state.device)
    seed = int((state.to(torch.int64) * w).sum()) % (2**63 - 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def batched_agrees(batched: Sequence[torch.Tensor], looped: Sequence[torch.Tensor]) -> bool:
    """Whether the first draws of a batched model run equal the same draws run one at a time
    (the once-per-factor check that the model broadcasts over a particle plate)."""
    tol = 1e-4 if looped[0].dtype in (torch.float32, torch.float16) else 1e-9
    return all(
        bool(torch.allclose(x[: len(y)], y, rtol=tol, atol=tol)) for x, y in zip(batched, looped)
    )


def _device_of(draws: List[Dict[str, torch.Tensor]]) -> torch.device:
    return next((v.device for d in draws for v in d.values()), torch.device("cpu"))


def _draws(ctx, num_samples: int) -> List[Dict[str, torch.Tensor]]:
    """``num_samples`` joint draws of ``q`` (:func:`own_random_stream`)."""
    with own_random_stream():
        return [ctx.sample_q() for _ in range(num_samples)]


def _summary(per_draw: Params, fam, batch: torch.Size) -> Tuple[Params, torch.Tensor]:
    """The average over the leading draw dim, and where it is reliable (see above)."""
    S = per_draw[0].shape[0]
    means = tuple(t.mean(0) for t in per_draw)
    ok = torch.ones(batch, dtype=torch.bool, device=means[0].device)
    h = S // 2
    for t, m in zip(per_draw, means):
        se = t.std(0) / S**0.5 if S > 1 else torch.zeros_like(m)
        good = torch.isfinite(m) & torch.isfinite(se) & (se <= MAX_RELATIVE_SE * m.abs())
        if h > 0:  # heavy tails: the two halves' averages disagree (or one draw dominates)
            a, b = t[:h].mean(0), t[h:].mean(0)
            good = good & ((a - b).abs() <= MAX_RELATIVE_SE * m.abs())
            good = good & (t.abs().amax(0) <= 0.5 * t.abs().sum(0))
        good = good | (se == 0) & torch.isfinite(m)
        ok = ok & good.reshape(batch + (-1,)).all(-1)
    return means, ok


def _looped(ctx, an, site, fam, draws, shapes) -> Params:
    per: List[List[torch.Tensor]] = [[] for _ in shapes]
    with torch.no_grad():
        for values in draws:
            tr = run_model(ctx.model, dict(values), ctx.args, ctx.kwargs, an.enum_dims)
            for i, (t, s) in enumerate(zip(_read(tr.nodes[site], fam), shapes)):
                per[i].append(t.reshape(s))
    return tuple(torch.stack(ts) for ts in per)


def _batched(ctx, an, site, fam, draws, shapes) -> Optional[Params]:
    """The draws as one model run in a particle plate (``None``: the model does not
    broadcast over it); per draw, with the draws leading."""
    S, P, values = len(draws), an.plate_dims, particle_values(an, draws)

    def particles(*a, **k):
        with pyro.plate("_cvi_expected_particles", S, dim=-1 - P):
            return ctx.model(*a, **k)

    with torch.no_grad():
        tr = run_model(particles, values, ctx.args, ctx.kwargs, an.enum_dims)
        node = tr.nodes[site]
        bs = node["fn"].batch_shape
        if len(bs) < P + 1 or bs[len(bs) - 1 - P] != S:
            return None
        at = len(bs) - 1 - P
        nat = _read(node, fam)
    return tuple(t.movedim(at, 0).reshape((S,) + tuple(s)) for t, s in zip(nat, shapes))
