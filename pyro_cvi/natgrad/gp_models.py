"""The ``pyro.contrib.gp`` variational GP a guide site belongs to, found by the module's class.

``VariationalSparseGP.guide`` samples ``u ~ N(u_loc, u_scale_tril u_scale_tril^T)``
(``VariationalGP.guide``: ``f ~ N(f_loc, f_scale_tril f_scale_tril^T)``); ``CVI()`` steps that
Gaussian by natural gradients like any guide site (:mod:`pyro_cvi.natgrad.sites`). Every other
parameter of the GP (the kernel's, the inducing inputs ``Xu``, the likelihood's) goes to the
inner optimizer, and there it sets the pace: after each natural-gradient step ``q(u)`` is close
to its optimum for the current hyperparameters, so the ELBO's gradient in them is nearly that of
the collapsed bound ``max_q ELBO(q, theta)`` and a larger Adam step than Pyro's usual 0.01 (a
default chosen for the noisy gradients of a guide trained jointly) is taken without jitter.
:data:`HYPER_LR` = 0.03 is the rate that reached Adam's 2,000-step bound fastest on every problem
of ``scripts/benchmark_pyro_gp.py`` (binary, Poisson and three-class GPs, sparse and full);
0.05 left a Poisson GP's kernel jittering above the optimum.

The module is found while its guide runs: :func:`owning_gp_model` walks up the Python frames of
the sample statement to the ``guide`` method of an instance of ``VariationalSparseGP`` or
``VariationalGP`` (a subclass too; a user's guide that calls the GP's guide as well), so names
play no part. Only modules whose classes ``pyro.contrib.gp`` defines are recognised, and only
when ``pyro.contrib.gp`` was imported by the user (it is never imported here).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Dict, Iterable, Optional

import torch

__all__ = ["HYPER_LR", "GPHyperparameters", "owning_gp_model"]

#: the inner Adam's learning rate for a recognised GP's hyperparameters (module docstring)
HYPER_LR = 0.03
#: frames searched above the sample statement (pyro.sample, the effect stack, decorators)
_MAX_DEPTH = 40


def owning_gp_model() -> Optional[torch.nn.Module]:
    """The ``VariationalSparseGP`` / ``VariationalGP`` whose ``guide`` is running the sample
    statement being processed, or ``None``."""
    models = sys.modules.get("pyro.contrib.gp.models")
    if models is None:
        return None
    kinds = (models.VariationalSparseGP, models.VariationalGP)
    frame = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        if frame.f_code.co_name == "guide":
            owner = frame.f_locals.get("self")
            if isinstance(owner, kinds):
                return owner
        frame = frame.f_back
    return None


class GPHyperparameters:
    """The raw parameters of the GPs whose guide sites ``CVI()`` has seen, held weakly."""

    def __init__(self) -> None:
        self._params: Dict[int, weakref.ref[torch.Tensor]] = {}

    def add(self, models: Iterable[Any]) -> None:
        """Record every parameter of each GP module (the natural-gradient ones never reach
        the inner optimizer, so recording them too is harmless)."""
        for model in models:
            for p in model.parameters():
                ref = self._params.get(id(p))
                if ref is None or ref() is not p:
                    self._params[id(p)] = weakref.ref(p)

    def __contains__(self, param: object) -> bool:
        ref = self._params.get(id(param))
        return ref is not None and ref() is param

    def __len__(self) -> int:
        return sum(1 for r in self._params.values() if r() is not None)
