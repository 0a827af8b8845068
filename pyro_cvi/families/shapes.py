"""Shape arithmetic without sympy.

``torch.broadcast_shapes`` imports sympy (through ``torch.fx``'s symbolic shapes) the first time
it runs in a process: 0.4-4 CPU s, most of a small model's first step. Torch calls it inside
``AffineTransform`` / ``PowerTransform``'s ``forward_shape`` and ``inverse_shape`` (so in
``TransformedDistribution(base, [biject_to(interval)])``). The same results here from Pyro's
pure-Python ``broadcast_shape``, and the same transforms with that arithmetic.
"""

from __future__ import annotations

from typing import Sequence

import torch
from pyro.distributions.util import broadcast_shape
from torch.distributions import transforms as T

__all__ = ["broadcast_shapes", "sympy_free"]


def broadcast_shapes(*shapes: Sequence[int]) -> torch.Size:
    """``torch.broadcast_shapes(*shapes)``; shapes that do not broadcast raise ``ValueError``
    (torch: ``RuntimeError``)."""
    return torch.Size(broadcast_shape(*(tuple(s) for s in shapes)))


def _param_shape(x) -> tuple:
    return tuple(getattr(x, "shape", ()))


class _Affine(T.AffineTransform):
    """``AffineTransform`` whose shape maps broadcast without sympy (equal to it: ``==``)."""

    def forward_shape(self, shape):
        return broadcast_shapes(shape, _param_shape(self.loc), _param_shape(self.scale))

    def inverse_shape(self, shape):
        return broadcast_shapes(shape, _param_shape(self.loc), _param_shape(self.scale))

    def with_cache(self, cache_size=1):
        if self._cache_size == cache_size:
            return self
        return _Affine(self.loc, self.scale, self.event_dim, cache_size=cache_size)


class _Power(T.PowerTransform):
    """``PowerTransform`` whose shape maps broadcast without sympy (equal to it: ``==``)."""

    def forward_shape(self, shape):
        return broadcast_shapes(shape, _param_shape(self.exponent))

    def inverse_shape(self, shape):
        return broadcast_shapes(shape, _param_shape(self.exponent))

    def with_cache(self, cache_size=1):
        if self._cache_size == cache_size:
            return self
        return _Power(self.exponent, cache_size=cache_size)


def sympy_free(t: T.Transform) -> T.Transform:
    """The same map as ``t`` (equal to it), its affine and power parts, at any depth of
    composition or independence, computing shapes without ``torch.broadcast_shapes``; ``t``
    itself where it has none."""
    if type(t) is T.AffineTransform:
        return _Affine(t.loc, t.scale, t.event_dim, cache_size=t._cache_size)
    if type(t) is T.PowerTransform:
        return _Power(t.exponent, cache_size=t._cache_size)
    if type(t) is T.ComposeTransform:
        parts = [sympy_free(p) for p in t.parts]
        if all(a is b for a, b in zip(parts, t.parts)):
            return t
        return T.ComposeTransform(parts, cache_size=t._cache_size)
    if type(t) is T.IndependentTransform:
        base = sympy_free(t.base_transform)
        if base is t.base_transform:
            return t
        return T.IndependentTransform(base, t.reinterpreted_batch_ndims, cache_size=t._cache_size)
    return t
