"""A zoo of models as Pyro users write them, from Pyro's tutorials and examples and textbooks.

Each entry is a :class:`ZooModel`: the model (written anew, keeping the structure of its
source), a builder of its data (synthetic with a fixed seed, or small published textbook
numbers), and metadata: whether it has discrete latents (then the baseline uses
``TraceEnum_ELBO``), a held-out metric where one exists, the number of CVI steps (with the
default adaptive ``CVI()``) of a converged benchmark row, and optional baseline guides
(e.g. the hand-written guide of Pyro's ``examples/sparse_gamma_def.py``).

Usage (tests put ``tests/`` on ``sys.path``; scripts put the repository root)::

    from zoo import ZOO                # or: from tests.zoo import ZOO
    entry = ZOO["eight_schools_noncentered"]
    data = entry.data()                # a ZooData: args, kwargs, test args
    guide = AutoCVI(entry.model, **entry.guide_kwargs)
    svi = SVI(entry.model, guide, CVI(), CVI_ELBO())   # the default adaptive step
    svi.step(*data.args, **data.kwargs)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch

from .heldout import log_predictive_density

__all__ = ["ZOO", "ZooData", "ZooModel", "log_predictive_density"]


@dataclass
class ZooData:
    """The arguments of one model: ``model(*args, **kwargs)``; ``test_args`` (if any) are the
    same arguments with held-out observations, for :attr:`ZooModel.heldout`."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    test_args: Optional[tuple] = None


@dataclass
class ZooModel:
    """One zoo entry.

    :param name: registry key.
    :param model: the Pyro model.
    :param data: ``dtype -> ZooData`` (fixed seed).
    :param source: where the model comes from.
    :param has_discrete: discrete latents (the baseline then uses ``TraceEnum_ELBO``).
    :param heldout: ``(model, guide, data) -> float``, higher is better (e.g. the mean log
        predictive density of held-out points), or ``None``.
    :param step_size: the CVI step size: ``"auto"`` (the default ``CVI()``) for every entry.
    :param steps: CVI steps that suffice for a converged benchmark row.
    :param guide_kwargs: extra ``AutoCVI`` options (and, for ``init_loc_fn``, the baselines').
    :param baselines: extra baseline guides by name: ``model -> guide``.
    :param subsampled: the model subsamples a plate (its loss is a minibatch estimate).
    :param for_dtype: ``dtype -> (model, guide_kwargs)`` for entries whose model or options
        hold tensors of a fixed dtype (a ``PyroModule``'s priors, ``init_to_value``); use
        :meth:`build`, which falls back to ``model`` and ``guide_kwargs``.
    """

    name: str
    model: Callable
    data: Callable[..., ZooData]
    source: str
    has_discrete: bool = False
    heldout: Optional[Callable] = None
    step_size: object = "auto"
    steps: int = 50
    guide_kwargs: Dict = field(default_factory=dict)
    baselines: Dict[str, Callable] = field(default_factory=dict)
    subsampled: bool = False
    for_dtype: Optional[Callable] = None

    def build(self, dtype=None) -> Tuple[Callable, Dict]:
        """``(model, guide_kwargs)`` for data of ``dtype`` (float64 when ``None``)."""
        if self.for_dtype is None:
            return self.model, self.guide_kwargs
        return self.for_dtype(dtype or torch.float64)


def _registry() -> OrderedDict[str, ZooModel]:
    from . import clients, hierarchical, latent, simple, users

    out: OrderedDict[str, ZooModel] = OrderedDict()
    for module in (simple, hierarchical, latent, users, clients):
        for entry in module.ENTRIES:
            if entry.name in out:
                raise ValueError(f"duplicate zoo name {entry.name!r}")
            out[entry.name] = entry
    return out


ZOO: OrderedDict[str, ZooModel] = _registry()


def names() -> Tuple[str, ...]:
    return tuple(ZOO)
