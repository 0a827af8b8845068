"""Plated Gaussian latents join their Gaussian parents' block where the model is
linear-Gaussian (Pyro's ``test_exact_tree`` shape: ``x`` global, ``y`` in a plate with mean
``x``): q is the exact joint posterior, so the -ELBO equals ``-log p(data)`` (a closed form)
after one conjugate step, in float32 and float64. Before, ``y`` was mean-field to ``x`` and
every variance was underestimated."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def tree(data):
    x = pyro.sample("x", dist.Normal(data.new_tensor(0.0), 1.0))
    with pyro.plate("data", len(data)):
        y = pyro.sample("y", dist.Normal(2.0 * x - 1.0, 0.5))
        pyro.sample("obs", dist.Normal(y, 1.0), obs=data)


def two_level_tree(data):
    """A deeper tree: ``mu -> x_g -> y_gi`` with groups in nested plates."""
    mu = pyro.sample("mu", dist.Normal(data.new_tensor(0.0), 3.0))
    with pyro.plate("groups", data.shape[0], dim=-2):
        x = pyro.sample("x", dist.Normal(mu, 1.0))
        with pyro.plate("items", data.shape[1], dim=-1):
            y = pyro.sample("y", dist.Normal(x, 0.7))
            pyro.sample("obs", dist.Normal(y, 0.5), obs=data)


def _exact_evidence(model, data):
    """-log p(data): the data are jointly Gaussian; mean and covariance by linearity."""
    d64 = data.double()
    if model is tree:
        n = len(d64)
        mean = torch.full((n,), -1.0, dtype=torch.float64)
        cov = 4.0 * torch.ones(n, n, dtype=torch.float64) + (0.25 + 1.0) * torch.eye(n)
    else:
        G, I = d64.shape
        g = torch.arange(G).repeat_interleave(I)
        same_group = (g[:, None] == g[None, :]).double()
        mean = torch.zeros(G * I, dtype=torch.float64)
        cov = 9.0 + 1.0 * same_group + (0.49 + 0.25) * torch.eye(G * I, dtype=torch.float64)
    d = dist.MultivariateNormal(mean, covariance_matrix=cov)
    return -float(d.log_prob(d64.reshape(-1)))


@DTYPES
@pytest.mark.parametrize("model", [tree, two_level_tree], ids=["tree", "two_level"])
def test_linear_gaussian_tree_is_exact(model, dtype):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    g = torch.Generator().manual_seed(3)
    shape = (5,) if model is tree else (3, 4)
    data = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    losses = [svi.step(data) for _ in range(3)]
    text = guide.explain()
    assert "natural form" not in text, text  # every latent in one joint Gaussian block
    exact = _exact_evidence(model, data)
    rtol = 2e-5 if dtype == torch.float32 else 1e-9
    assert math.isclose(svi.evaluate_loss(data), exact, rel_tol=rtol), (losses, exact)
    # the same q scored by Trace_ELBO: at the exact posterior every particle gives log p(data)
    mc = Trace_ELBO(num_particles=20).loss(model, guide, data)
    assert math.isclose(mc, exact, rel_tol=1e-4 if dtype == torch.float32 else 1e-7), (mc, exact)


def test_a_large_tree_stays_mean_field():
    """Beyond ``MAX_JOINT_DIM`` coordinates a dense joint block would cost O(D^3) per step:
    the plated latents stay in the mean field (exact means, q still a valid bound)."""
    from pyro_cvi.model.gaussian_tree import MAX_JOINT_DIM

    pyro.clear_param_store()
    data = torch.randn(MAX_JOINT_DIM + 1, dtype=torch.float64)
    guide = AutoCVI(tree)
    svi = SVI(tree, guide, CVI(), CVI_ELBO())
    svi.step(data)
    assert "# y: q = gaussian (natural form)" in guide.explain(), guide.explain()


@DTYPES
def test_a_large_tree_named_gaussian_forms_its_joint_block(dtype):
    """``families={site: "gaussian"}`` on a member keeps the dense joint block beyond
    ``MAX_JOINT_DIM`` (the user's choice of its O(D^3) step): exact after a few steps."""
    from pyro_cvi.model.gaussian_tree import MAX_JOINT_DIM

    g = torch.Generator().manual_seed(4)
    data = torch.randn(MAX_JOINT_DIM + 1, generator=g, dtype=torch.float64).to(dtype)
    guide = AutoCVI(tree, families={"y": "gaussian"})
    svi = SVI(tree, guide, CVI(), CVI_ELBO())
    losses = [svi.step(data) for _ in range(3)]
    text = guide.explain()
    assert "natural form" not in text and f"D={MAX_JOINT_DIM + 2}" in text, text
    exact = _exact_evidence(tree, data)
    rtol = 1e-4 if dtype == torch.float32 else 1e-9
    assert math.isclose(svi.evaluate_loss(data), exact, rel_tol=rtol), (losses, exact)
