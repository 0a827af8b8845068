"""The first CVI step's M-step on the lengthscales (``lengthscale_search.py``): its bound against
the GP-regression evidence of the pseudo-data computed densely, its targets against the
strategy's own q, GPyTorch's tutorial loop leaving the long-lengthscale plateau (and staying on
it without the search), and the cases where it must not run."""

import copy
import math

import gpytorch
import pytest
import torch

from pyro_cvi.contrib.gpytorch import CVIOptimizer, CVIVariationalStrategy
from pyro_cvi.contrib.gpytorch.lengthscale_search import prior_blocks, site_bound

DTYPES = [torch.float32, torch.float64]


class TutorialGP(gpytorch.models.ApproximateGP):
    """GPyTorch's GP-classification tutorial model, with the strategy swapped in."""

    def __init__(self, Z, **kw):
        dist = gpytorch.variational.CholeskyVariationalDistribution(Z.shape[0])
        super().__init__(CVIVariationalStrategy(self, Z, dist, False, **kw))
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def tutorial_data(n=60, dtype=torch.float64):
    x = torch.linspace(0, 1, n, dtype=dtype)
    return x, torch.sign(torch.cos(x * (4 * math.pi))).add(1).div(2)


def tutorial_loop(model, x, y, steps, cvi=None):
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model.train()
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, y.numel())
    for _ in range(steps):
        if cvi is not None:
            cvi.step(x, y)
        adam.zero_grad()
        loss = -mll(model(x), y)
        loss.backward()
        adam.step()
    with torch.no_grad():
        neg_elbo = -float(mll(model(x), y)) * y.numel()
        model.eval()
        acc = float(((likelihood(model(x)).mean > 0.5).to(y) == y).double().mean())
    return neg_elbo, acc


@pytest.mark.parametrize("dtype", DTYPES)
def test_site_bound_is_the_pseudo_data_evidence_less_the_trace_term(dtype):
    """S = log N(y~; m0, Q + W^-1) + sum_n (W y~^2 / 2 + log(2 pi / W) / 2) - sum W (k - Q) / 2,
    computed densely (N x N), for sparse inducing points and random sites."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(25, 2, generator=g, dtype=torch.float64)
    Z = X[:7].clone() + 0.01
    lam2 = -torch.rand(25, generator=g, dtype=torch.float64) - 0.1
    lam1 = torch.randn(25, generator=g, dtype=torch.float64)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kernel.base_kernel.lengthscale, kernel.outputscale = 0.3, 1.7
    jitter = 1e-6
    with torch.no_grad():
        K_ZZ = kernel(Z).to_dense() + jitter * torch.eye(7, dtype=torch.float64)
        K_ZX = kernel(Z, X).to_dense()
        Q = K_ZX.T @ torch.linalg.solve(K_ZZ, K_ZX)
        k = kernel(X, diag=True) + jitter
        W = -2 * lam2
        yt = lam1 / W
        m0 = torch.full((25,), 0.2, dtype=torch.float64)
        evidence = torch.distributions.MultivariateNormal(m0, Q + torch.diag(1 / W)).log_prob(yt)
        const = (0.5 * W * yt**2 + 0.5 * torch.log(2 * math.pi / W)).sum()
        expected = float(evidence + const - 0.5 * (W * (k - Q.diagonal())).sum())

    kern = copy.deepcopy(kernel).to(dtype)

    def prior(x):
        return gpytorch.distributions.MultivariateNormal(
            torch.full(x.shape[:1], 0.2, dtype=x.dtype), kern(x)
        )

    with torch.no_grad():
        blocks = prior_blocks(prior, Z.to(dtype), X.to(dtype))
        value, _, _ = site_bound(blocks, lam1.to(dtype), lam2.to(dtype), jitter)
    tol = 1e-8 if dtype == torch.float64 else 2e-3
    assert float(value) == pytest.approx(expected, rel=tol, abs=tol)


def test_targets_give_the_q_whose_site_elbo_is_the_bound():
    """With the strategy's sites set to the returned targets (a step of size 1), the strategy's
    own q has ``sum_n E_q[lam1 f + lam2 f^2] - KL`` equal to the bound (so the targets and the
    value describe the same q)."""
    x, y = tutorial_data(30)
    model = TutorialGP(x.unsqueeze(-1), lengthscale_search=False).double()
    model.covar_module.base_kernel.lengthscale = 0.15
    g = torch.Generator().manual_seed(1)
    lam1 = torch.randn(30, generator=g, dtype=torch.float64)
    lam2 = -torch.rand(30, generator=g, dtype=torch.float64)
    s = model.variational_strategy
    with torch.no_grad():
        model(x)  # the first call initialises the sites: set them after it
        blocks = prior_blocks(model.forward, s.inducing_points, x.unsqueeze(-1))
        value, t1, t2 = site_bound(blocks, lam1, lam2, s.jitter)
        s.set_sites(t1, t2)
        model.eval()
        q = model(x)
        m, v = q.mean, q.variance
        site_elbo = (lam1 * m + lam2 * (v + m * m)).sum() - s.kl_divergence()
    assert float(site_elbo) == pytest.approx(float(value), rel=1e-7, abs=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tutorial_loop_leaves_the_plateau(dtype):
    """GPyTorch's tutorial (lengthscale 0.69 at the start, labels with period 0.5): 50 steps of
    the unchanged loop reach training accuracy 1 and -ELBO < 25 nats (GPyTorch's own strategy:
    62 nats, the plateau 42); without the search the same loop stays on the plateau."""
    x, y = tutorial_data(60, dtype)
    torch.manual_seed(0)
    model = TutorialGP(x.unsqueeze(-1)).to(dtype)
    neg_elbo, acc = tutorial_loop(model, x, y, 50)
    move = model.variational_strategy.lengthscale_move
    assert move is not None and move.factor == 2.0**-3 and move.after > move.before
    assert acc == 1.0
    assert neg_elbo < 25.0
    torch.manual_seed(0)
    plain = TutorialGP(x.unsqueeze(-1), lengthscale_search=False).to(dtype)
    neg_elbo_plain, acc_plain = tutorial_loop(plain, x, y, 50)
    assert plain.variational_strategy.lengthscale_move is None
    assert neg_elbo_plain > 40.0 and acc_plain < 0.8


def test_cvi_optimizer_loop_takes_the_move_and_keeps_backtracking_sound():
    x, y = tutorial_data(60)
    torch.manual_seed(0)
    model = TutorialGP(x.unsqueeze(-1)).double()
    cvi = CVIOptimizer(model, gpytorch.likelihoods.BernoulliLikelihood())
    neg_elbo, acc = tutorial_loop(model, x, y, 30, cvi=cvi)
    assert model.variational_strategy.lengthscale_move.factor == 2.0**-3
    assert acc == 1.0 and neg_elbo < 25.0
    # at fixed hyperparameters the steps after the move never raise the -ELBO
    for p in model.parameters():
        p.requires_grad_(False)
    model.train()
    losses = [float(cvi.step(x, y)) for _ in range(10)]
    assert all(b <= a + 1e-9 * abs(a) for a, b in zip(losses, losses[1:]))
    assert losses[-1] < losses[0]


def test_search_runs_once_and_only_from_the_initial_sites():
    x, y = tutorial_data(40)
    torch.manual_seed(0)
    model = TutorialGP(x.unsqueeze(-1)).double()
    s = model.variational_strategy
    assert s.search_pending()
    tutorial_loop(model, x, y, 1)
    raw = float(model.covar_module.base_kernel.raw_lengthscale.detach())
    # applied after the backward pass; Adam's first step (lr 0.1 on the raw value) follows it
    moved = math.log(math.expm1(math.log(2) / 8))
    assert 0.09 < abs(raw - moved) <= 0.1 + 1e-9
    assert not s.search_pending()
    # a trained model loaded into a fresh one (sites not at their start) is left alone
    fresh = TutorialGP(x.unsqueeze(-1)).double()
    fresh.load_state_dict(model.state_dict())
    assert not fresh.variational_strategy.search_pending()


@pytest.mark.parametrize("how", ["fixed", "prior"])
def test_a_fixed_or_prior_governed_lengthscale_is_left_alone(how):
    x, y = tutorial_data(40)
    torch.manual_seed(0)
    model = TutorialGP(x.unsqueeze(-1)).double()
    rbf = model.covar_module.base_kernel
    if how == "fixed":
        rbf.raw_lengthscale.requires_grad_(False)
    else:
        rbf.register_prior("lengthscale_prior", gpytorch.priors.GammaPrior(3.0, 6.0), "lengthscale")
    before = float(rbf.lengthscale)
    tutorial_loop(model, x, y, 1)
    assert model.variational_strategy.lengthscale_move is None
    if how == "fixed":
        assert float(rbf.lengthscale) == before


def test_no_move_where_the_current_lengthscale_is_best():
    """Started at a good lengthscale the search keeps it (k = 0 wins)."""
    x, y = tutorial_data(60)
    torch.manual_seed(0)
    model = TutorialGP(x.unsqueeze(-1)).double()
    model.covar_module.base_kernel.lengthscale = 0.09
    model.covar_module.outputscale = 4.0
    tutorial_loop(model, x, y, 1)
    assert model.variational_strategy.lengthscale_move is None
