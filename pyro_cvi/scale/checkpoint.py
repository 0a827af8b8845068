"""Checkpoint and resume CVI training.

Everything a CVI run depends on is saved in one file: the Pyro param store (the guide's site
and natural parameters and the model's hyperparameters), the ``CVI`` optimizer's state (its
step counter ``t`` and the inner torch optimizer's state per parameter), the guide's step
counters, and the random number generators (torch, numpy, Python). Restoring it into a fresh
process and calling ``svi.step`` continues on exactly the trajectory of an uninterrupted run.

    save_checkpoint("run.pt", optim, guide)
    ...                                    # new process: build model, guide, optim, svi as before
    load_checkpoint("run.pt", optim, guide)
    svi.step(X, y)                         # identical to the uninterrupted run's next step

In a data-parallel run (``AutoCVI(..., process_group=...)``) every rank writes and reads its
own file, ``run.rank{r}-of-{R}.pt`` (its shard's sites; ``q`` and the hyperparameters are the
same on all ranks): call both functions on every rank with the same ``path`` and ``guide``.
"""

from __future__ import annotations

import os
import random
from typing import Optional, Union

import numpy as np
import pyro
import torch

from ..autoguide import AutoCVI
from ..optim import CVI
from .distributed import rank_path

__all__ = ["save_checkpoint", "load_checkpoint"]

_VERSION = 1


def save_checkpoint(
    path: Union[str, os.PathLike[str]], optim: CVI, guide: Optional[AutoCVI] = None
) -> None:
    """Write the param store, the optimizer, the guide's counters and the RNG states."""
    state = {
        "version": _VERSION,
        "param_store": pyro.get_param_store().get_state(),
        "optim": optim.get_state(),
        "rng": {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        },
    }
    if guide is not None:
        state["guide"] = {
            "name": guide.param_prefix,
            "num_shrunk": guide.num_shrunk,
            "num_rejected": guide.num_rejected,
        }
    torch.save(state, rank_path(path, guide.reducer if guide is not None else None))


def load_checkpoint(
    path: Union[str, os.PathLike[str]], optim: CVI, guide: Optional[AutoCVI] = None
) -> None:
    """Restore a checkpoint written by :func:`save_checkpoint` (before the next ``svi.step``)."""
    path = rank_path(path, guide.reducer if guide is not None else None)
    state = torch.load(path, weights_only=False)
    if state.get("version") != _VERSION:
        raise ValueError(f"{path}: not a pyro-cvi checkpoint of version {_VERSION}")
    store = pyro.get_param_store()
    store.clear()
    store.set_state(state["param_store"])
    optim.set_state(state["optim"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if guide is not None and "guide" in state:
        g = state["guide"]
        if g["name"] != guide.param_prefix:
            raise ValueError(
                f"checkpoint holds guide {g['name']!r} but got {guide.param_prefix!r}; build the "
                "guide the same way as in the saved run"
            )
        guide.num_shrunk, guide.num_rejected = g["num_shrunk"], g["num_rejected"]
