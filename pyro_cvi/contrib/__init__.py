"""Adapters that bring CVI to other libraries' models.

* :mod:`pyro_cvi.contrib.gpytorch`: a GPyTorch variational strategy whose ``q(u)`` is built in
  closed form from one Gaussian site per training point, and the optimizer that updates the
  sites (Khan & Lin 2017, eqs. 13-14); binary and multi-class classification, sparse and full
  GPs, minibatches and data-parallel training. Needs GPyTorch: ``pip install "pyro-cvi[gpytorch]"``.
* :mod:`pyro_cvi.contrib.pyro_gp`: drop-ins for ``pyro.contrib.gp``'s ``Binary``, ``Poisson`` and
  ``MultiClass`` likelihoods with exact expected log-likelihoods, so that ``CVI()`` on Pyro's own
  variational GPs differentiates the exact ELBO.

Importing :mod:`pyro_cvi.contrib` itself imports no optional dependency.
"""
