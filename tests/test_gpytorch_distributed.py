"""contrib.gpytorch in data-parallel mode, in one process (2 ranks: tests/test_distributed.py).

``CVIOptimizer(..., process_group=WORLD)`` on a 1-process gloo group runs every collective for
real (R = 1) and must give the iterates of ``process_group=None``; ``CVIOptimizer.loss`` is
gpytorch's ``-VariationalELBO``; the full form is refused.
"""

import sys
from pathlib import Path

import pytest
import torch

gpytorch = pytest.importorskip("gpytorch")

from pyro_cvi.contrib.gpytorch import (  # noqa: E402
    CVIOptimizer,
    CVIVariationalStrategy,
    LogisticBernoulliLikelihood,
)
from pyro_cvi.scale.distributed import WORLD  # noqa: E402

HERE = Path(__file__).resolve().parent


class GP(gpytorch.models.ApproximateGP):
    def __init__(self, X, M=None, **kw):
        Z = X if M is None else X[:M]
        train = None if M is None else X
        super().__init__(CVIVariationalStrategy(self, Z, len(X), train_inputs=train, **kw))
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def data(n=80):
    g = torch.Generator().manual_seed(3)
    X = torch.rand(n, 2, generator=g, dtype=torch.float64) * 4 - 2
    y = (torch.rand(n, generator=g, dtype=torch.float64) < torch.sigmoid(3 * X[:, 0])).double()
    return X, y


def test_one_rank_group_gives_the_one_process_iterates(one_rank_group):
    """The worker's GPyTorch run (CVI steps with a backtrack, then Adam on the hyperparameters
    and inducing points through CVIOptimizer.loss/reduce_grads) with every collective run on
    R = 1 equals the process_group=None run."""
    sys.path.insert(0, str(HERE))
    try:
        import distributed_worker
    finally:
        sys.path.remove(str(HERE))
    a = torch.stack(distributed_worker.gpytorch_classifier(None))
    b = torch.stack(distributed_worker.gpytorch_classifier(WORLD))
    assert a[-1, 185] == 1  # one backtrack
    assert (a - b).abs().max() < 1e-12


@pytest.mark.parametrize("batch", [None, 30])
def test_loss_is_minus_the_variational_elbo(batch):
    """CVIOptimizer.loss == -VariationalELBO(num_data=N)(model(x), y), value and gradients,
    with a hyperprior (counted once) and for a minibatch; one process."""
    X, y = data()
    model, lik = GP(X, M=10).double(), LogisticBernoulliLikelihood().double()
    prior = gpytorch.priors.GammaPrior(2.0, 1.0).double()
    model.covar_module.base_kernel.register_prior(
        "ls_prior", prior, lambda m: m.lengthscale, lambda m, v: m._set_lengthscale(v)
    )
    cvi = CVIOptimizer(model, lik)
    model.train(), lik.train()
    cvi.step(X, y)
    cvi.step(X, y)
    idx = None if batch is None else torch.arange(7, 7 + batch)
    x, t = (X, y) if idx is None else (X[idx], y[idx])
    params = cvi.hyperparameters()
    assert len(params) == 3  # constant mean, raw outputscale, raw lengthscale
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(X))
    ref = -mll(model(x), t)
    ref_grads = torch.autograd.grad(ref, params)
    ours = cvi.loss(x, t, indices=idx)
    grads = torch.autograd.grad(ours, params)
    assert abs(ours.item() - ref.item()) < 1e-12
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-10, atol=1e-12)
    cvi.reduce_grads()  # one process: nothing to do


def test_full_form_is_refused_and_the_strategy_can_carry_the_group(one_rank_group):
    X, y = data(40)
    with pytest.raises(ValueError, match=r"sparse form.*train_inputs=X_shard"):
        GP(X, process_group=WORLD)
    full = GP(X).double()
    with pytest.raises(ValueError, match="process_group=None"):
        CVIOptimizer(full, LogisticBernoulliLikelihood(), process_group=WORLD)
    sparse = GP(X, M=6, process_group=WORLD).double()  # the group on the strategy
    cvi = CVIOptimizer(sparse, LogisticBernoulliLikelihood().double())
    assert cvi.reducer is sparse.variational_strategy.reducer is not None
    assert cvi.num_data == 40
    assert torch.isfinite(cvi.step(X, y))


def test_process_group_needs_torch_distributed():
    X, _ = data(20)
    with pytest.raises(RuntimeError, match="init_process_group"):
        CVIOptimizer(GP(X, M=5).double(), LogisticBernoulliLikelihood(), process_group=WORLD)
