"""The natural-parameter block (Algorithm 2): a mean-field factor ``q(z) = family(lambda)``.

One block per natural-form latent site. Its natural parameters ``lambda`` (batched over the
site's plates, at full plate sizes) live in Pyro's param store; a step moves them towards the
target ``lambda~ = sum_a [eta~_a + grad_mu E_q[log p~_nc^a]]`` (Algorithm 2, steps 4-5)::

    lambda <- (1 - beta) lambda + beta lambda~

with the step policy of :mod:`~pyro_cvi.update`. Inside ``pyro.plate(..., subsample_size=B)``
the block is *local*: a step touches only the minibatch's rows.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import pyro
import torch
from pyro.infer.autoguide.initialization import InitMessenger
from pyro.ops.tensor_utils import periodic_repeat

from ..analysis import LatentInfo
from ..tracing import unwrap
from ..update import StepCounts, damped_step, targets_from_grads

__all__ = ["NaturalBlock", "initial_natural", "init_messenger"]

Params = Tuple[torch.Tensor, ...]


class NaturalBlock:
    """Mean-field CVI for one latent site (see the module docstring)."""

    def __init__(self, info: LatentInfo, prefix: str):
        self.name = info.name
        self.family = info.family
        self.frames = info.frames
        self.event_shape = info.event_shape
        n = len(self.family.param_shapes)
        self.names = tuple(f"{prefix}.natural{i}.{info.name}" for i in range(n))

    def param_names(self):
        return list(self.names)

    def setup(self, init: Params) -> None:
        for n, t in zip(self.names, init):
            t = t.detach().clone()
            pyro.param(n, lambda t=t: t)

    def params(self) -> Tuple[torch.Tensor, ...]:
        return tuple(pyro.param(n) for n in self.names)

    # ------------------------------------------------------------------ minibatch views
    def _slices(self, subsample: Dict[str, torch.Tensor]):
        return [(f.dim, subsample[f.name]) for f in self.frames if f.name in subsample]

    def is_local(self, subsample: Dict[str, torch.Tensor]) -> bool:
        return any(f.name in subsample for f in self.frames)

    def local_scale(self, subsample: Dict[str, torch.Tensor]) -> float:
        """``N / B`` of the subsampled plates of this site (1 if none)."""
        s = 1.0
        for f in self.frames:
            if f.name in subsample:
                s *= (f.full_size or f.size) / len(subsample[f.name])
        return s

    def natural(self, subsample: Dict[str, torch.Tensor]) -> Params:
        """The natural parameters restricted to the minibatch (detached)."""
        params = tuple(p.detach() for p in self.params())
        sl = self._slices(subsample)
        if not sl:
            return params
        out = []
        for p, shape in zip(params, self.family.param_shapes):
            for dim, idx in sl:
                p = p.index_select(p.dim() + dim - len(shape), idx)
            out.append(p)
        return tuple(out)

    def value_shape(self, nat: Params) -> torch.Size:
        lam = nat[0]
        return lam.shape[: lam.dim() - len(self.family.param_shapes[0])] + self.event_shape

    def dist(self, subsample: Dict[str, torch.Tensor]) -> torch.distributions.Distribution:
        return self.family.natural_to_dist(self.natural(subsample))

    def mean_value(self, subsample: Dict[str, torch.Tensor]) -> torch.Tensor:
        """A representative value of q: its mean (discrete: its mode, a valid value)."""
        nat = self.natural(subsample)
        fam = self.family
        if fam.is_discrete:
            return fam.natural_to_dist(nat).mode.detach()
        value = fam.mean_value(nat, fam.natural_to_mean(nat))
        return value.reshape(self.value_shape(nat)).detach()

    # ------------------------------------------------------------------ the step
    def step_to(self, target: Sequence[torch.Tensor], beta: float, subsample) -> StepCounts:
        """Move the (minibatch rows of the) natural parameters towards ``target`` (eq. 12)."""
        fam = self.family
        old = self.natural(subsample)
        new, counts = damped_step(
            old, target, beta, fam.is_valid, fam.natural_bounds, fam.param_shapes
        )
        # float32: concentrations beyond the dtype's meaning are capped (mean kept)
        self._write(fam.limit_natural(new), subsample)
        return counts

    def step(self, beta: float) -> StepCounts:
        """The step of a global block with the target held in ``.grad`` (``target - lambda``,
        written by the loss over the full parameters)."""
        pair = targets_from_grads(self.params())
        if pair is None:
            return StepCounts()
        return self.step_to(pair[1], beta, {})

    def _write(self, values: Sequence[torch.Tensor], subsample) -> None:
        sl = self._slices(subsample)
        with torch.no_grad():
            for p, v, shape in zip(self.params(), values, self.family.param_shapes):
                if not sl:
                    p.copy_(v)
                    continue
                if len(sl) > 1:
                    raise NotImplementedError(
                        f"site {self.name!r} lies in two subsampled plates; subsample one of them"
                    )
                dim, idx = sl[0]
                p.index_copy_(p.dim() + dim - len(shape), idx, v.to(p.dtype))


def _prior_natural(fam, fn) -> Optional[Params]:
    batch = fn.batch_shape
    try:
        nat = fam.dist_to_natural(unwrap(fn)[0])
        nat = tuple(
            torch.broadcast_to(t, batch + s).detach() for t, s in zip(nat, fam.param_shapes)
        )
    except (TypeError, ValueError, RuntimeError, NotImplementedError):
        return None
    return nat if bool(fam.is_valid(nat).all()) else None


def init_messenger(init_loc_fn):
    """A ``pyro.poutine`` InitMessenger for ``init_loc_fn`` that leaves discrete sites to
    their prior (Pyro's init strategies cannot place a discrete value)."""

    def init_fn(site):
        if site["fn"].support.is_discrete:
            return site["fn"].sample().detach()
        return init_loc_fn(site)

    return InitMessenger(init_fn)


def initial_natural(fam, site, init_loc_fn=None, init_scale: Optional[float] = None) -> Params:
    """Initial natural parameters of a natural-form site, at full plate sizes.

    The prior's natural parameters when the prior is of ``q``'s family and no ``init_loc_fn``
    is given (Algorithm 2's ``lambda_0``); otherwise ``family.natural_at`` the init value (or
    the prototype draw) with the prior's spread, or with spread ``init_scale`` when given
    (``family.natural_with_spread``; continuous families only).
    """
    fn = site["fn"]
    prior = _prior_natural(fam, fn)
    if init_scale is not None and not fam.is_discrete:
        value = init_loc_fn(site) if init_loc_fn is not None else site["value"]
        nat = fam.natural_with_spread(value, init_scale)
    elif prior is not None and (init_loc_fn is None or fam.is_discrete):
        nat = prior  # discrete sites start at their prior (symmetry is broken by the others)
    else:
        value = init_loc_fn(site) if init_loc_fn is not None else site["value"]
        nat = fam.natural_at(value, prior)
    batch = fn.batch_shape
    out = []
    for t, s in zip(nat, fam.param_shapes):
        t = torch.broadcast_to(t, batch + s)
        for frame in site["cond_indep_stack"]:
            full = frame.full_size or frame.size
            if frame.vectorized and full != frame.size:
                dim = t.dim() + frame.dim - len(s)
                t = (
                    periodic_repeat(t, full, dim)
                    if t.shape[dim] > 1
                    else t.expand(t.shape[:dim] + (full,) + t.shape[dim + 1 :])
                )
        out.append(t.contiguous().clone())
    return tuple(out)
