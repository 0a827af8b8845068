"""Minibatch CVI steps with the SVI scaling of Khan & Lin 2017, eq. 14
(``CVIOptimizer(..., minibatch=SVIScaling(c))``): the update itself, the running sums it keeps,
exactness for a Gaussian likelihood, convergence, and the errors."""

from __future__ import annotations

import copy

import pytest
import torch

gpytorch = pytest.importorskip("gpytorch")

from pyro_cvi.contrib.gpytorch import (  # noqa: E402
    CVIOptimizer,
    CVIVariationalStrategy,
    SVIScaling,
)

DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: dict(rtol=2e-4, atol=2e-4), torch.float64: dict(rtol=1e-9, atol=1e-9)}


class GP(gpytorch.models.ApproximateGP):
    def __init__(self, strategy_fn):
        super().__init__(strategy_fn(self))
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        self.covar_module.outputscale = 2.0
        self.covar_module.base_kernel.lengthscale = 0.7
        self.mean_module.constant.data.fill_(0.1)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def sparse(X, M=12):
    Z = X[:M].clone()
    return GP(lambda s: CVIVariationalStrategy(s, Z, X.shape[0], train_inputs=X)).to(X.dtype)


def data(n=120, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 2, generator=g, dtype=torch.float64) * 4 - 2
    f = torch.sin(2 * X[:, 0]) + X[:, 1]
    y = (torch.rand(n, generator=g, dtype=torch.float64) < torch.sigmoid(3 * f)).double()
    return X.to(dtype), y.to(dtype), (f + 0.2 * torch.randn(n, generator=g).double()).to(dtype)


def q_u(model):
    with torch.no_grad():
        q = model.variational_strategy.variational_distribution
        return q.mean.clone(), q.covariance_matrix.clone()


def sites(model):
    s = model.variational_strategy
    return s.site_lam1.clone(), s.site_lam2.clone()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_step_is_eq_14_and_keeps_the_running_sums(dtype):
    """lam <- (1 - beta_t) lam everywhere, + beta_t (N / B) g on the batch (g: the targets, read
    off a copy stepped with beta = 1 and the other sites kept); q(u) equals that of a new model
    given the same sites (sums recomputed from scratch)."""
    X, y, _ = data(dtype=dtype)
    lik = gpytorch.likelihoods.BernoulliLikelihood()
    model = sparse(X)
    CVIOptimizer(model, lik, step_size=0.8).step(X, y)  # every site non-zero
    opt = CVIOptimizer(model, lik, minibatch=SVIScaling(c=2.0, warmup=1))
    g = torch.Generator().manual_seed(1)
    N, B = X.shape[0], 30
    for t, beta in enumerate([1.0, 2 / 3, 0.5]):
        idx = torch.randperm(N, generator=g)[:B]
        ref = copy.deepcopy(model)
        CVIOptimizer(ref, lik, step_size=1.0, minibatch=None).step(X[idx], y[idx], indices=idx)
        g1, g2 = (v[idx] for v in sites(ref))
        l1, l2 = sites(model)
        opt.step(X[idx], y[idx], indices=idx)
        e1, e2 = (1 - beta) * l1, (1 - beta) * l2
        e1[idx] += beta * (N / B) * g1
        e2[idx] += beta * (N / B) * g2
        n1, n2 = sites(model)
        torch.testing.assert_close(n1, e1, **TOL[dtype])
        torch.testing.assert_close(n2, e2, **TOL[dtype])
        assert opt.minibatch.num_steps == t + 1
    fresh = sparse(X)
    fresh.variational_strategy.set_sites(*sites(model))
    for a, b in zip(q_u(model), q_u(fresh)):
        torch.testing.assert_close(a, b, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gaussian_likelihood_every_point_in_the_batch_is_exact(dtype):
    """A Gaussian likelihood's targets do not depend on q: with every point in the batch
    (shuffled), beta_0 = 1 gives Titsias' q(u) at once (the full-batch step with beta = 1), and
    every later step keeps it ((1 - beta) q* + beta q*)."""
    X, _, yr = data(dtype=dtype)
    lik = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
    lik.noise = 0.05
    exact = sparse(X)
    CVIOptimizer(exact, lik, step_size=1.0).step(X, yr)
    model = sparse(X)
    opt = CVIOptimizer(model, lik, minibatch=SVIScaling())
    perm = torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        opt.step(X[perm], yr[perm], indices=perm)
        for a, b in zip(q_u(model), q_u(exact)):
            torch.testing.assert_close(a, b, **TOL[dtype])


def test_converges_to_the_full_batch_optimum():
    """Robbins-Monro steps (beta_t -> 0): 40 epochs of 6 batches of 50 end within 0.01 nat of
    the full-batch optimum (300 points, -ELBO ~ 120)."""
    X, y, _ = data(n=300, seed=2)
    lik = gpytorch.likelihoods.BernoulliLikelihood()
    full = sparse(X, M=20)
    o = CVIOptimizer(full, lik, step_size=1.0)
    best = min(float(o.step(X, y)) for _ in range(30))
    model = sparse(X, M=20)
    opt = CVIOptimizer(model, lik, minibatch=SVIScaling())
    g = torch.Generator().manual_seed(0)
    for _epoch in range(40):
        for idx in torch.randperm(300, generator=g).split(50):
            opt.step(X[idx], y[idx], indices=idx)
    with torch.no_grad():
        end = float(opt.loss(X, y)) * 300
    assert best - 1e-6 <= end < best + 0.01, (best, end)


def test_a_resumed_optimizer_goes_on_with_beta_t():
    """``state_dict`` carries t: a new optimizer that loads it takes beta_t, not beta_0 = 1
    (which would drop every site's history)."""
    X, y, _ = data()
    lik = gpytorch.likelihoods.BernoulliLikelihood()
    opt = CVIOptimizer(sparse(X), lik, minibatch=SVIScaling(c=2.0, warmup=1))
    idx = torch.arange(20)
    for _ in range(3):
        opt.step(X[idx], y[idx], indices=idx)
    again = CVIOptimizer(opt.model, lik, minibatch=SVIScaling(c=2.0, warmup=1))
    again.load_state_dict(opt.state_dict())
    assert again.minibatch.next_beta() == opt.minibatch.next_beta() == 2.0 / 5.0


def test_the_step_sizes_warm_up_then_average():
    """beta_t = 1 for t < w, then c / (t - w + 1 + c): the defaults (c = 1.5, w = 4) and
    ``warmup=0`` / ``warmup=1`` (the latter is the rule c / (t + c))."""
    d = SVIScaling()
    assert [d.next_beta() for _ in range(7)] == pytest.approx(
        [1.0, 1.0, 1.0, 1.0, 1.5 / 2.5, 1.5 / 3.5, 1.5 / 4.5], rel=1e-15
    )
    assert d.num_steps == 7
    one = SVIScaling(c=3.0, warmup=1)
    assert [one.beta(t) for t in range(4)] == pytest.approx([1.0, 0.75, 0.6, 0.5], rel=1e-15)
    zero = SVIScaling(c=0.5, warmup=0)
    assert [zero.beta(t) for t in range(3)] == pytest.approx([1 / 3, 0.2, 0.5 / 3.5], rel=1e-15)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_minibatch_estimate_is_unbiased(dtype):
    """At a fixed q, a step with beta = 1 sets the sites to (N / B) g on the batch and 0
    elsewhere. Averaged over the K = N / B blocks of a random partition (a uniformly chosen
    batch), the sites are the full-batch targets g (a full step with beta = 1 from the same q),
    and so is q(u) built from them (its natural parameters are linear in the sites)."""
    X, y, _ = data(dtype=dtype)
    lik = gpytorch.likelihoods.BernoulliLikelihood()
    model = sparse(X)
    CVIOptimizer(model, lik, step_size=0.8).step(X, y)  # a q other than the prior
    full = copy.deepcopy(model)
    CVIOptimizer(full, lik, step_size=1.0).step(X, y)
    blocks = torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(3)).split(30)
    total1, total2 = torch.zeros_like(sites(model)[0]), torch.zeros_like(sites(model)[1])
    for idx in blocks:
        one = copy.deepcopy(model)
        CVIOptimizer(one, lik, minibatch=SVIScaling()).step(X[idx], y[idx], indices=idx)
        l1, l2 = sites(one)
        outside = torch.ones_like(l1, dtype=torch.bool)
        outside[idx] = False
        assert (l1[outside] == 0).all() and (l2[outside] == 0).all()
        total1, total2 = total1 + l1, total2 + l2
    mean1, mean2 = total1 / len(blocks), total2 / len(blocks)
    torch.testing.assert_close(mean1, sites(full)[0], **TOL[dtype])
    torch.testing.assert_close(mean2, sites(full)[1], **TOL[dtype])
    fresh = sparse(X)
    fresh.variational_strategy.set_sites(mean1, mean2)
    for a, b in zip(q_u(fresh), q_u(full)):
        torch.testing.assert_close(a, b, **TOL[dtype])


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="SVIScaling: c must be > 0"):
        SVIScaling(c=0.0)
    with pytest.raises(ValueError, match="SVIScaling: warmup must be an integer >= 0"):
        SVIScaling(warmup=-1)
    with pytest.raises(ValueError, match="SVIScaling: warmup must be an integer >= 0"):
        SVIScaling(warmup=1.5)
    X, y, _ = data()
    model = sparse(X)
    with pytest.raises(ValueError, match=r"scale_sites: factor must be in \[0, 1\]"):
        model.variational_strategy.scale_sites(1.5)
    Z = X[:10].clone()

    class Inducing(gpytorch.models.ApproximateGP):
        def __init__(self):
            dist = gpytorch.variational.CholeskyVariationalDistribution(10)
            super().__init__(CVIVariationalStrategy(self, Z, dist))
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.RBFKernel()

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(x), self.covar_module(x)
            )

    lik = gpytorch.likelihoods.BernoulliLikelihood()
    with pytest.raises(ValueError, match="minibatch=SVIScaling.*needs the data-site form"):
        CVIOptimizer(Inducing().double(), lik, minibatch=SVIScaling())
