"""pyro-cvi: conjugate-computation variational inference for Pyro and GPyTorch.

from pyro_cvi import AutoCVI, CVI, CVI_ELBO
svi = pyro.infer.SVI(model, AutoCVI(model), CVI(step_size=0.5), loss=CVI_ELBO())
"""

from . import step_sizes
from .autoguide import AutoCVI
from .elbo import CVI_ELBO
from .optim import CVI
from .structured import StructuredSVI

__version__ = "0.1.0"
__all__ = ["AutoCVI", "CVI", "CVI_ELBO", "StructuredSVI", "step_sizes"]
