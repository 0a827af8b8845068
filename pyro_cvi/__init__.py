"""pyro-cvi: conjugate-computation variational inference for Pyro and GPyTorch.

from pyro_cvi import AutoCVI, CVI, CVI_ELBO
svi = pyro.infer.SVI(model, AutoCVI(model), CVI(step_size=0.5), loss=CVI_ELBO())

The package is laid out by pipeline stage (docs/architecture.md): ``model/`` (tracing,
probing, analysis), ``messages/``, ``blocks/``, ``families/``, ``statespace/``, ``scale/``
(distributed, streaming), ``checkpoints/`` (save and exact resume), ``methods/``
(structured SVI, the bound and convergence checks) and ``contrib/``.
"""

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Optional

from . import step_sizes
from .autoguide import AutoCVI
from .checkpoints.checkpoint import CheckpointError
from .divergence import DivergenceError
from .elbo import CVI_ELBO
from .methods.convergence import converged
from .methods.structured import StructuredSVI
from .methods.structured_guide import AutoStructuredCVI
from .model.weights import UnboundedELBOError
from .optim import CVI
from .strategies import Horizon, Remainder, SignalToNoise

__version__ = "0.1.0"
__all__ = [
    "AutoCVI",
    "AutoStructuredCVI",
    "CVI",
    "CVI_ELBO",
    "CheckpointError",
    "DivergenceError",
    "Horizon",
    "Remainder",
    "SignalToNoise",
    "StructuredSVI",
    "UnboundedELBOError",
    "converged",
    "step_sizes",
]

#: public modules that moved into sub-packages: the old import paths keep working
#: (``import pyro_cvi.checkpoint`` is the module ``pyro_cvi.checkpoints.checkpoint``).
MOVED_MODULES = {
    "pyro_cvi.checkpoint": "pyro_cvi.checkpoints.checkpoint",
    "pyro_cvi.scale.checkpoint": "pyro_cvi.checkpoints.checkpoint",
    "pyro_cvi.distributed": "pyro_cvi.scale.distributed",
    "pyro_cvi.streaming": "pyro_cvi.scale.streaming",
    "pyro_cvi.structured": "pyro_cvi.methods.structured",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old public module path to the module at its new place (lazily)."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> Optional[ModuleSpec]:
        if fullname in MOVED_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED_MODULES[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was imported (and executed) at its new place."""


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
