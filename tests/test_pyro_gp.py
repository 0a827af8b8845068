"""GP models written as plain Pyro models (with pyro.contrib.gp kernels) fitted by AutoCVI."""

import pyro
import pyro.contrib.gp as gp
import pyro.distributions as dist
import pytest
import torch
from bench.baselines import logreg_neg_elbo, plain_cvi_logreg
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI


def _toy(N=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(N, 2, generator=g, dtype=torch.float64) * 4 - 2
    f = torch.sin(2 * X[:, 0]) + X[:, 1]
    y = torch.bernoulli(torch.sigmoid(3 * f), generator=g)
    return X, f, y


def _gp_model(kernel, likelihood):
    def model(X, y=None):
        N = X.shape[0]
        K = kernel(X) + 1e-6 * torch.eye(N, dtype=X.dtype)
        f = pyro.sample("f", dist.MultivariateNormal(X.new_zeros(N), covariance_matrix=K))
        with pyro.plate("data", N):
            if likelihood == "gaussian":
                pyro.sample("y", dist.Normal(f, 0.2), obs=y)
            else:
                pyro.sample("y", dist.Bernoulli(logits=f), obs=y)

    return model


def test_gp_regression_is_exact_in_one_step():
    X, f, _ = _toy()
    y = f + 0.2 * torch.randn(len(f), dtype=f.dtype)
    kernel = gp.kernels.RBF(2, variance=torch.tensor(1.5), lengthscale=torch.tensor(0.7))
    kernel = kernel.double()
    model = _gp_model(kernel, "gaussian")
    guide = AutoCVI(model)
    with torch.no_grad():  # the kernel is a PyroModule: the step also moves its parameters
        K = kernel(X) + 1e-6 * torch.eye(len(y), dtype=X.dtype)
        S = K + 0.04 * torch.eye(len(y), dtype=X.dtype)
        mean = K @ torch.linalg.solve(S, y)
        cov = K - K @ torch.linalg.solve(S, K)
    SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO()).step(X, y)
    q = guide.posterior("f")
    assert torch.allclose(q.loc, mean, atol=1e-8)
    assert torch.allclose(q.covariance_matrix, cov, atol=1e-8)
    assert "y -> f" in guide.explain().replace("  ", " ").replace("  ", " ")
    assert guide.engine.block_of("f").post.form == "dual"  # the B = I + W^1/2 K W^1/2 form


def test_gp_classification_matches_whitened_logistic_regression():
    """With K = L L^T, f = L v and v ~ N(0, I) is logistic regression on design L."""
    X, _, y = _toy()

    def kernel(X):  # fixed hyperparameters: a plain function, not a PyroModule
        return 4.0 * torch.exp(-0.5 * torch.cdist(X, X) ** 2 / 0.8**2)

    model = _gp_model(kernel, "bernoulli")
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    losses = [svi.step(X, y) for _ in range(20)]
    assert "linear-predictor" in guide.explain()
    with torch.no_grad():
        L = torch.linalg.cholesky(kernel(X) + 1e-6 * torch.eye(len(y), dtype=X.dtype))
    ref = plain_cvi_logreg(L, y, 1.0, step_size=1.0, num_iters=60, form="primal")
    ref_neg_elbo = float(logreg_neg_elbo(L, y, ref.loc, ref.covariance, 1.0))
    assert losses[-1] == pytest.approx(ref_neg_elbo, abs=1e-4)
    q = guide.posterior("f")
    assert torch.allclose(q.loc, L @ ref.loc, atol=1e-4)


def test_gp_hyperparameters_are_learned_by_the_hybrid_step():
    X, _, y = _toy(60)
    kernel = gp.kernels.RBF(2, variance=torch.tensor(0.2), lengthscale=torch.tensor(3.0))
    kernel = kernel.double()
    model = _gp_model(kernel, "bernoulli")
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0, optim_args={"lr": 0.05}), loss=CVI_ELBO())
    losses = [svi.step(X, y) for _ in range(150)]
    assert losses[-1] < losses[0] - 3.0  # the ELBO improves over the initial hyperparameters
    assert kernel.variance.item() > 0.5  # and the kernel moved towards the data
