"""Discrete families: ``Bernoulli`` and ``Categorical`` (minimal representations).

Bernoulli, elementwise over ``event_shape``:

* ``phi(z) = z``; natural ``eta = logit p``; mean ``mu = p = sigmoid(eta)``
* ``A = softplus(eta)``; ``h = 1``; distribution ``Bernoulli(logits=eta).to_event(...)``
* ``mean_to_natural`` clamps ``p`` to ``[tiny, 1 - eps/2]`` (``finfo(dtype)``): every
  representable ``p`` in (0, 1) keeps its exact logit, while ``p = 0`` / ``p = 1`` map to the
  finite logits of those bounds (about -87 / 16.6 in float32, -708 / 36.7 in float64).

Categorical with ``K`` classes (value shape ``event_shape``, usually ``()``):

* ``phi(z) = onehot(z)[:K-1]``; natural ``eta_k = logits_k - logits_{K-1}``  ``[..., K-1]``
* mean ``mu = probs[:K-1]``; ``A = log(1 + sum_k exp eta_k)``; ``h = 1``
* distribution ``Categorical(logits=cat(eta, 0)).to_event(len(event_shape))``
* ``mean_to_natural``: ``eta_k = log p_k - log p_K`` with ``p_K = 1 - sum_k p_k``; ``p_k`` is
  clamped below at ``finfo(dtype).tiny`` and ``p_K`` (which carries an absolute rounding
  error of order ``K eps`` from the subtraction) at ``eps / 2``, as for the Bernoulli.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import pyro.distributions as dist
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributions import Bernoulli as _TorchBernoulli
from torch.distributions import Categorical as _TorchCategorical
from torch.distributions import Distribution, Independent

from .base import ExponentialFamily, Params, sum_rightmost

__all__ = ["Bernoulli", "Categorical"]


def _unwrap(d: Distribution) -> Distribution:
    while isinstance(d, Independent):
        d = d.base_dist
    return d


def _float_dtype(x: Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.get_default_dtype()


class Bernoulli(ExponentialFamily):
    """Bernoulli with natural parameter ``logit p`` (see module docstring)."""

    name = "bernoulli"
    domain = "any finite logit"
    is_discrete = True
    num_values = 2

    @property
    def param_shapes(self) -> Tuple[torch.Size, ...]:
        return (self.event_shape,)

    def natural_to_mean(self, nat: Params) -> Params:
        return (torch.sigmoid(nat[0]),)

    def mean_to_natural(self, mean: Params) -> Params:
        info = torch.finfo(mean[0].dtype)
        p = mean[0].clamp(info.tiny, 1 - info.eps / 2)
        return (torch.log(p) - torch.log1p(-p),)

    def natural_to_dist(self, nat: Params) -> Distribution:
        return dist.Bernoulli(logits=nat[0]).to_event(self.event_dim)

    def dist_to_natural(self, d: Distribution) -> Params:
        d = _unwrap(d)
        if not isinstance(d, _TorchBernoulli):
            raise TypeError(f"{self!r}: cannot convert {type(d).__name__} to natural parameters")
        return (d.logits,)

    def log_partition(self, nat: Params) -> Tensor:
        return sum_rightmost(F.softplus(nat[0]), self.event_dim)

    def sufficient_stats(self, x: Tensor) -> Params:
        return (x.to(_float_dtype(x)),)

    def _in_domain(self, nat: Params) -> Tensor:
        ok = torch.ones_like(nat[0], dtype=torch.bool)
        return ok.reshape(ok.shape[: ok.dim() - self.event_dim] + (-1,)).all(-1)

    def probs(self, mean: Params) -> Tensor:
        """``(1 - p, p)`` on a new last dim (values 0 and 1), differentiable in ``p = mu``."""
        mu = mean[0]
        return torch.stack([1 - mu, mu], -1)


class Categorical(ExponentialFamily):
    """Categorical over ``num_categories`` classes, minimal parameterisation (module docstring)."""

    name = "categorical"
    domain = "any finite logits"
    is_discrete = True

    def __init__(self, num_categories: int, event_shape: Sequence[int] = ()) -> None:
        super().__init__(event_shape)
        if int(num_categories) < 2:
            raise ValueError(f"Categorical family needs num_categories >= 2, got {num_categories}")
        self.num_categories = int(num_categories)

    def __repr__(self) -> str:
        return (
            f"Categorical(num_categories={self.num_categories}, "
            f"event_shape={tuple(self.event_shape)})"
        )

    @property
    def num_values(self) -> int:  # type: ignore[override]
        return self.num_categories

    @property
    def param_shapes(self) -> Tuple[torch.Size, ...]:
        return (self.event_shape + (self.num_categories - 1,),)

    def _logits(self, nat: Params) -> Tensor:
        eta = nat[0]
        return torch.cat([eta, torch.zeros_like(eta[..., :1])], dim=-1)

    def natural_to_mean(self, nat: Params) -> Params:
        return (torch.softmax(self._logits(nat), dim=-1)[..., :-1],)

    def mean_to_natural(self, mean: Params) -> Params:
        p = mean[0]
        info = torch.finfo(p.dtype)
        last = (1 - p.sum(-1, keepdim=True)).clamp(min=info.eps / 2)
        return (torch.log(p.clamp(min=info.tiny)) - torch.log(last),)

    def natural_to_dist(self, nat: Params) -> Distribution:
        return dist.Categorical(logits=self._logits(nat)).to_event(self.event_dim)

    def dist_to_natural(self, d: Distribution) -> Params:
        d = _unwrap(d)
        if not isinstance(d, _TorchCategorical):
            raise TypeError(f"{self!r}: cannot convert {type(d).__name__} to natural parameters")
        if d.logits.shape[-1] != self.num_categories:
            raise ValueError(f"{self!r}: distribution has {d.logits.shape[-1]} categories")
        logits = d.logits
        return (logits[..., :-1] - logits[..., -1:],)

    def log_partition(self, nat: Params) -> Tensor:
        return sum_rightmost(torch.logsumexp(self._logits(nat), dim=-1), self.event_dim)

    def sufficient_stats(self, x: Tensor) -> Params:
        onehot = F.one_hot(x.long(), self.num_categories)[..., :-1]
        return (onehot.to(_float_dtype(x)),)

    def _in_domain(self, nat: Params) -> Tensor:
        ok = torch.ones_like(nat[0], dtype=torch.bool)
        return ok.reshape(ok.shape[: ok.dim() - self.event_dim - 1] + (-1,)).all(-1)

    def probs(self, mean: Params) -> Tensor:
        """``(p_1, ..., p_{K-1}, 1 - sum_k p_k)`` on the last dim, differentiable in ``mu``."""
        mu = mean[0]
        return torch.cat([mu, 1 - mu.sum(-1, keepdim=True)], -1)
