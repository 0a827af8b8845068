"""pyro-cvi: conjugate-computation variational inference for Pyro and GPyTorch."""

__version__ = "0.1.0"
