"""Minibatch CVI steps that keep each point's latest target
(``CVIOptimizer(..., minibatch=SiteMemoryScaling())``): the running sums it keeps, the estimate's
expectation for a likelihood whose targets do not depend on q, exactness once every point is
kept, the fixed point (the full-batch optimum), and a restart when the sites are set elsewhere."""

from __future__ import annotations

import copy

import pytest
import torch

gpytorch = pytest.importorskip("gpytorch")

from pyro_cvi.contrib.gpytorch import (  # noqa: E402
    CVIOptimizer,
    CVIVariationalStrategy,
    SiteMemoryScaling,
)
from pyro_cvi.contrib.gpytorch.posterior import site_sums  # noqa: E402

DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: dict(rtol=5e-4, atol=5e-4), torch.float64: dict(rtol=1e-8, atol=1e-8)}


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


def natural_sums(model):
    """``sum_n phi_n W_n phi_n^T`` and ``sum_n phi_n r_n`` of the model's sites, with ``Phi``
    computed here from the kernel (independently of the strategy's running sums)."""
    s = model.variational_strategy
    with torch.no_grad():
        Z, X = s.inducing_points, s.site_inputs
        K_ZZ = model.covar_module(Z).to_dense() + s.jitter * torch.eye(Z.shape[0], dtype=Z.dtype)
        Phi = torch.linalg.solve_triangular(
            torch.linalg.cholesky(K_ZZ), model.covar_module(Z, X).to_dense(), upper=False
        )
        return site_sums(Phi, s.site_lam1, s.site_lam2, model.mean_module(X))


def gaussian(dtype):
    lik = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
    lik.noise = 0.05
    return lik


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_running_sums_are_those_of_the_sites(dtype):
    """After minibatch steps (and after a kernel change between them, which recomputes the
    sums once), q(u) equals that of a new model given the same sites (sums from scratch)."""
    X, y, _ = data(dtype=dtype)
    lik = gpytorch.likelihoods.BernoulliLikelihood()
    model = sparse(X)
    opt = CVIOptimizer(model, lik, minibatch=SiteMemoryScaling(warmup=2))
    g = torch.Generator().manual_seed(1)
    for t in range(9):
        if t == 6:
            model.covar_module.base_kernel.lengthscale = 0.5
        idx = torch.randperm(X.shape[0], generator=g)[:30]
        opt.step(X[idx], y[idx], indices=idx)
        fresh = sparse(X)
        fresh.load_state_dict(model.state_dict())
        for a, b in zip(q_u(model), q_u(fresh)):
            torch.testing.assert_close(a, b, **TOL[dtype])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_estimate_is_unbiased_when_the_targets_do_not_depend_on_q(dtype):
    """A Gaussian likelihood's targets g_n do not depend on q, so the natural parameter of q(u)
    after 3 steps of random batches (one kept step after a warm-up of 2) has expectation
    sum_n g_n: the mean of the site sums over 200 sequences is within 5 standard errors of
    the full-batch sums, and a rule that drops the fill (sites = kept targets only) is not."""
    X, _, yr = data(n=40, dtype=dtype)
    lik = gaussian(dtype)
    exact = sparse(X, M=6)
    CVIOptimizer(exact, lik, step_size=1.0).step(X, yr)
    S_ref, s_ref = natural_sums(exact)
    g = torch.Generator().manual_seed(0)
    draws, kept_only = [], []
    for _ in range(200):
        model = sparse(X, M=6)
        rule = SiteMemoryScaling(warmup=2)
        opt = CVIOptimizer(model, lik, minibatch=rule)
        for idx in torch.randperm(40, generator=g)[:24].split(8):
            opt.step(X[idx], yr[idx], indices=idx)
        S, s = natural_sums(model)
        draws.append(torch.cat([S.flatten(), s]).double())
        kept = rule._state["kept"].to(dtype)
        model.variational_strategy.set_sites(
            kept * rule._state["mem"][0], kept * rule._state["mem"][1]
        )
        S, s = natural_sums(model)
        kept_only.append(torch.cat([S.flatten(), s]).double())
    ref = torch.cat([S_ref.flatten(), s_ref]).double()
    for sample, unbiased in ((torch.stack(draws), True), (torch.stack(kept_only), False)):
        se = sample.std(0) / sample.shape[0] ** 0.5 + 1e-6 * ref.abs().amax()
        z = ((sample.mean(0) - ref) / se).abs().amax()
        assert (z < 5.0) == unbiased, float(z)


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_once_every_point_is_kept(dtype):
    """Gaussian likelihood, warm-up 1: the first epoch (5 batches) keeps the targets of batches
    2-5; after the second epoch every point is kept and q(u) is Titsias' q(u), exactly (the
    fill weight 1 - |K| / N is 0), and stays so."""
    X, _, yr = data(n=100, dtype=dtype)
    lik = gaussian(dtype)
    exact = sparse(X)
    CVIOptimizer(exact, lik, step_size=1.0).step(X, yr)
    model = sparse(X)
    opt = CVIOptimizer(model, lik, minibatch=SiteMemoryScaling(warmup=1))
    g = torch.Generator().manual_seed(2)
    for epoch in range(3):
        for idx in torch.randperm(100, generator=g).split(20):
            opt.step(X[idx], yr[idx], indices=idx)
        if epoch >= 1:
            assert bool(opt.minibatch._state["kept"].all())
            for a, b in zip(q_u(model), q_u(exact)):
                torch.testing.assert_close(a, b, **TOL[dtype])
        else:
            mean, _ = q_u(model)
            assert not torch.allclose(mean, q_u(exact)[0], atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fixed_point_is_the_full_batch_optimum(dtype):
    """Bernoulli likelihood: 40 epochs of random batches of 20 end at the full-batch optimum's
    q(u) (every site equal to its target at q)."""
    X, y, _ = data(n=120, dtype=dtype, seed=3)
    lik = gpytorch.likelihoods.BernoulliLikelihood()
    full = sparse(X)
    o = CVIOptimizer(full, lik, step_size=1.0)
    for _ in range(40):
        o.step(X, y)
    model = sparse(X)
    opt = CVIOptimizer(model, lik, minibatch=SiteMemoryScaling())
    g = torch.Generator().manual_seed(0)
    for _epoch in range(40):
        for idx in torch.randperm(120, generator=g).split(20):
            opt.step(X[idx], y[idx], indices=idx)
    tol = {torch.float32: dict(rtol=2e-3, atol=2e-3), torch.float64: dict(rtol=1e-7, atol=1e-7)}
    for a, b in zip(q_u(model), q_u(full)):
        torch.testing.assert_close(a, b, **tol[dtype])


def test_sites_set_elsewhere_restart_the_rule_without_moving_q():
    """A full-batch step between minibatch steps: the next minibatch step starts from the
    sites as they are (all of them the eq. 14 part), so a batch with beta = 1 during the
    warm-up gives the same q as the eq. 14 rule from those sites."""
    from pyro_cvi.contrib.gpytorch import SVIScaling

    X, y, _ = data()
    lik = gpytorch.likelihoods.BernoulliLikelihood()
    model = sparse(X)
    opt = CVIOptimizer(model, lik, minibatch=SiteMemoryScaling(warmup=3))
    idx = torch.arange(30)
    opt.step(X[idx], y[idx], indices=idx)
    CVIOptimizer(model, lik, step_size=0.5).step(X, y)  # the sites set by another optimizer
    other = copy.deepcopy(model)
    rule = SVIScaling(warmup=3)
    rule.num_steps = 1
    CVIOptimizer(other, lik, minibatch=rule).step(X[idx + 30], y[idx + 30], indices=idx + 30)
    opt.step(X[idx + 30], y[idx + 30], indices=idx + 30)
    for a, b in zip(q_u(model), q_u(other)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_reload_resumes_the_memory_exactly(dtype):
    """The optimizer's ``state_dict`` carries the rule's memory (the running average ``e``, the
    kept targets, which points are kept): a fresh model and optimizer loaded from the two
    state dicts take the same next steps as the uninterrupted run; loading the step count alone
    (the memory lost) gives another q."""
    X, y, _ = data(dtype=dtype)
    lik = gpytorch.likelihoods.BernoulliLikelihood()
    model = sparse(X)
    opt = CVIOptimizer(model, lik, minibatch=SiteMemoryScaling(warmup=2))
    g = torch.Generator().manual_seed(4)
    batches = [torch.randperm(X.shape[0], generator=g)[:30] for _ in range(9)]
    for idx in batches[:5]:
        opt.step(X[idx], y[idx], indices=idx)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert int(saved_opt["minibatch"]["kept"].sum()) > 0
    for idx in batches[5:]:
        opt.step(X[idx], y[idx], indices=idx)
    reference = q_u(model)

    def resumed(state):
        fresh = sparse(X)
        fresh.load_state_dict(saved_model)
        again = CVIOptimizer(fresh, lik, minibatch=SiteMemoryScaling(warmup=2))
        again.load_state_dict(state)
        for idx in batches[5:]:
            again.step(X[idx], y[idx], indices=idx)
        return q_u(fresh)

    for a, b in zip(resumed(saved_opt), reference):
        torch.testing.assert_close(a, b, **TOL[dtype])
    lost = dict(saved_opt, minibatch=None)
    assert (resumed(lost)[0] - reference[0]).abs().max() > 1e-3


def test_a_memory_of_another_training_set_is_refused():
    X, y, _ = data()
    lik = gpytorch.likelihoods.BernoulliLikelihood()
    opt = CVIOptimizer(sparse(X), lik, minibatch=SiteMemoryScaling(warmup=0))
    idx = torch.arange(30)
    opt.step(X[idx], y[idx], indices=idx)
    state = opt.state_dict()
    X2, y2, _ = data(n=60)
    other = CVIOptimizer(sparse(X2), lik, minibatch=SiteMemoryScaling(warmup=0))
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="loaded memory has"):
        other.step(X2[idx], y2[idx], indices=idx)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_default_rule_is_the_memory_on_the_data_site_form(dtype):
    """``minibatch="auto"`` (the default): ``SiteMemoryScaling()`` on the data-site form, whose
    steps equal those of an explicit ``SiteMemoryScaling()``; ``None`` keeps the rule that moves
    the batch's sites alone (another q); an unknown name is refused."""
    X, y, _ = data(dtype=dtype)
    lik = gpytorch.likelihoods.BernoulliLikelihood()
    g = torch.Generator().manual_seed(6)
    batches = [torch.randperm(X.shape[0], generator=g)[:30] for _ in range(6)]
    qs = []
    for rule in ("auto", SiteMemoryScaling(), None):
        model = sparse(X)
        opt = CVIOptimizer(model, lik, minibatch=rule)
        if rule == "auto":
            assert isinstance(opt.minibatch, SiteMemoryScaling)
            assert (opt.minibatch.c, opt.minibatch.warmup, opt.minibatch.refresh) == (5.0, 2, True)
        for idx in batches:
            opt.step(X[idx], y[idx], indices=idx)
        qs.append(q_u(model))
    for a, b in zip(qs[0], qs[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (qs[2][0] - qs[0][0]).abs().max() > 1e-2
    with pytest.raises(ValueError, match="minibatch='memory'"):
        CVIOptimizer(sparse(X), lik, minibatch="memory")
