"""Expectations of 1-D functions under Gaussians, and their mean-parameter gradients.

For a factor that touches a Gaussian latent only through a scalar ``eta ~ N(m, v)`` per data
point, CVI needs ``f = E_q[log p(y | eta)]`` and its gradient with respect to the mean
parameters ``mu1 = m``, ``mu2 = v + m^2`` (Appendix B.1 of Khan & Lin 2017, eqs. 29-31). The
maths lives in :mod:`pyro_cvi.gaussian` (Gauss-Hermite nodes and expectations in
:mod:`pyro_cvi.gaussian.quadrature`, Bonnet/Price and eqs. 30-31 in
:mod:`pyro_cvi.gaussian.price`); this module gives the messages their names.
"""

from __future__ import annotations

from ..gaussian.price import mean_param_gradients, site_natural_params
from ..gaussian.quadrature import expected_log_prob, gauss_hermite

__all__ = [
    "gauss_hermite",
    "expected_log_prob",
    "mean_param_gradients",
    "site_natural_params",
]
