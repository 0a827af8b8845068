"""Conditionally conjugate priors with a latent scale, in the mean-field mode
(``AutoCVI(remainder="off")``; by default such a model is the natural-gradient remainder's,
``tests/test_remainder.py``): a Gaussian
latent ``beta ~ Normal(loc, s(theta))`` whose scale depends on mean-field latents keeps its
site form in a joint Gaussian block, with its prior at the scale's current ``q`` (a plug-in);
the factor itself is owned by the mean field (Monte Carlo messages to ``theta``), and the block
swaps the plug-in conditional's expectation out of its KL, so the reported loss is the bound.
A likelihood of ``beta`` then keeps its exact rows or its quadrature (linear predictor)."""

import sys

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from test_loss_is_bound import assert_loss_is_bound

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

sys.path.insert(0, "tests")
from zoo import ZOO  # noqa: E402

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def shrinkage_regression(X, y):
    s = pyro.sample("s", dist.LogNormal(X.new_tensor(0.0), 0.5))
    with pyro.plate("features", X.shape[1]):
        beta = pyro.sample("beta", dist.Normal(X.new_tensor(0.0), s))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("obs", dist.Normal(X @ beta, 0.5), obs=y)


@DTYPES
def test_latent_scale_prior_keeps_the_site_form_and_the_bound(dtype):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(30, 3, generator=g, dtype=torch.float64)
    y = X @ torch.tensor([1.0, -0.5, 0.0], dtype=torch.float64) + 0.5 * torch.randn(
        30, generator=g, dtype=torch.float64
    )
    X, y = X.to(dtype), y.to(dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(shrinkage_regression, remainder="off")
    svi = SVI(shrinkage_regression, guide, CVI(), CVI_ELBO())
    for _ in range(10):
        svi.step(X, y)
    text = guide.explain()
    assert "# beta: q = gaussian (site form)" in text, text
    assert "obs -> beta         conjugate" in text, text
    assert "beta -> s            general" in text, text  # the scale: Monte Carlo messages
    assert_loss_is_bound(shrinkage_regression, guide, svi, (X, y), M=40, P=20, z=3.0)


@DTYPES
def test_varying_intercepts_keep_their_quadrature(dtype):
    """``a_j ~ Normal(mu_a, sigma_a)`` with a latent ``sigma_a``: ``a`` joins ``mu_a`` and ``b``
    in one block, the Poisson likelihood is a linear predictor (quadrature), and the loss is
    the bound."""
    entry = ZOO["varying_intercept_poisson"]
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    data = entry.data(dtype)
    guide = AutoCVI(entry.model, remainder="off")
    svi = SVI(entry.model, guide, CVI(), CVI_ELBO())
    for _ in range(30):
        svi.step(*data.args, **data.kwargs)
    text = guide.explain()
    assert "linear-predictor" in text and "a: q = gaussian (natural form)" not in text, text
    assert_loss_is_bound(entry.model, guide, svi, data.args, M=60, P=10, z=4.0)
