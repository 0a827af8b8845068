"""One data-parallel CVI run, for tests/test_distributed.py (not collected by pytest).

``python tests/distributed_worker.py OUT`` runs in one process; ``torchrun --nproc_per_node=2
tests/distributed_worker.py OUT`` runs the same script on two gloo ranks, each with its shard.
Rank 0 saves the iterates (q's mean and covariance, the loss, the hyperparameters) per step,
and those of a data-parallel StreamingCVI (update="pass", minibatches of 64 from each shard),
of a model with mean-field latents (global and per-row Gamma) under the adaptive ``CVI()``,
of a sparse GP classifier written in Pyro, and of a sparse GPyTorch GP classifier
(``pyro_cvi.contrib.gpytorch``; skipped without GPyTorch).
A third argument ``ckpt`` checkpoints after 3 steps, restores into fresh objects, and goes on.
"""

import os
import sys

import pyro
import pyro.distributions as dist
import torch
import torch.distributed as tdist
from pyro.infer import SVI
from torch.utils.data import DataLoader, TensorDataset

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.checkpoints.checkpoint import load_checkpoint, save_checkpoint
from pyro_cvi.scale.distributed import WORLD, shard
from pyro_cvi.scale.streaming import StreamingCVI

N, D, STEPS = 300, 4, 6


def model(X, y, t):
    scale = pyro.param("prior_scale", torch.tensor(1.5, dtype=X.dtype), dist.constraints.positive)
    sigma = pyro.param("sigma", torch.tensor(0.7, dtype=X.dtype), dist.constraints.positive)
    w = pyro.sample("w", dist.Normal(torch.zeros(D, dtype=X.dtype), scale).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
        pyro.sample("t", dist.Normal(X[:, :2] @ w[:2], sigma), obs=t)


def data():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(X @ w), generator=g)
    t = X[:, :2] @ w[:2] + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)
    return X, y, t


def logistic(X, y):
    w = pyro.sample("w", dist.Normal(torch.zeros(D, dtype=X.dtype), 1.5).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def stream(X, y, group):
    """StreamingCVI, update="pass" (exact whatever the batching): q after each of 3 passes."""
    loader = DataLoader(TensorDataset(X, y), batch_size=64)
    st = StreamingCVI(
        logistic, step_size=0.7, update="pass", init_sites="prior", process_group=group
    )
    out = []
    for _ in range(3):
        elbo = st.run_pass(loader)
        q = st.posterior()
        out.append(torch.cat([torch.tensor([elbo]), q.loc, q.covariance_matrix.reshape(-1)]))
    return torch.stack(out)


def mixture(X, t):
    """Mean-field latents: a global Gamma noise precision ``tau``, per-row Gamma scales ``lam``
    (a Student-t likelihood; rank-local), and the global Gaussian ``w``."""
    two = torch.tensor(2.0, dtype=X.dtype)
    tau = pyro.sample("tau", dist.Gamma(two, 1.0))
    w = pyro.sample("w", dist.Normal(torch.zeros(D, dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        lam = pyro.sample("lam", dist.Gamma(two, 2.0))
        pyro.sample("t", dist.Normal(X @ w, (tau * lam).rsqrt()), obs=t)


def sparse_gp(X, y):
    """A sparse GP classifier: ``u ~ N(0, K_mm)`` at 5 inducing points, ``f = K_nm K_mm^-1 u``,
    with a learned lengthscale (in the prior and in the sites' Jacobian ``A(ell)``: its
    gradient runs through the all-reduced row statistics)."""
    ell = pyro.param("ell", torch.tensor(1.5, dtype=X.dtype), dist.constraints.positive)
    Z = torch.linspace(-2, 2, 5, dtype=X.dtype)[:, None].expand(5, D)
    k = lambda a, b: torch.exp(-0.5 * torch.cdist(a, b) ** 2 / ell**2)  # noqa: E731
    Kmm = k(Z, Z) + 1e-6 * torch.eye(5, dtype=X.dtype)
    u = pyro.sample("u", dist.MultivariateNormal(torch.zeros(5, dtype=X.dtype), Kmm))
    A = torch.linalg.solve(Kmm, k(Z, X)).T
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=A @ u), obs=y)


def others(X, y, t, group):
    """The default adaptive CVI() on the mean-field model, and the sparse GP: q per step."""
    rows = []
    for fn, data, site in ((mixture, (X, t), "w"), (sparse_gp, (X, y), "u")):
        pyro.clear_param_store()
        guide = AutoCVI(fn, process_group=group)
        svi = SVI(fn, guide, CVI(optim_args={"lr": 0.05}), loss=CVI_ELBO())
        for _ in range(5):
            loss = svi.step(*data)
            q = guide.posterior(site)
            if fn is mixture:
                extra = guide.posterior("tau").mean
            else:  # the covariance's first row and the learned lengthscale
                extra = torch.cat([q.covariance_matrix[0], pyro.param("ell").reshape(1)])
            rows.append(torch.cat([torch.tensor([loss]), q.loc, extra.detach().reshape(-1)]))
    return torch.cat(rows)


def gpytorch_classifier(group):
    """A sparse GPyTorch GP classifier (N = 200, M = 12 learned inducing points, logistic
    likelihood): 3 CVI steps at step size 1 (backtracking), then 4 hybrid iterations (a CVI
    step, then Adam on the lengthscale, outputscale and inducing points). Per step: the
    -ELBO, q(u)'s mean and covariance, the hyperparameters, the inducing points, the step
    size, the backtrack count and the hyperparameters' gradients (raw outputscale, raw
    lengthscale, inducing points: Adam's first steps hardly depend on their size). ``None``
    without GPyTorch."""
    try:
        import gpytorch
    except ImportError:  # pragma: no cover
        return None
    from pyro_cvi.contrib.gpytorch import (
        CVIOptimizer,
        CVIVariationalStrategy,
        LogisticBernoulliLikelihood,
    )

    g = torch.Generator().manual_seed(1)
    X = torch.rand(200, 2, generator=g, dtype=torch.float64) * 4 - 2
    f = 2.0 * torch.sin(1.5 * X[:, 0]) + X[:, 1]
    y = (torch.rand(200, generator=g, dtype=torch.float64) < torch.sigmoid(3 * f)).double()
    X, y = shard(X), shard(y)

    class GP(gpytorch.models.ApproximateGP):
        def __init__(self):
            # rank 1's X[:12] differs from rank 0's: the optimizer broadcasts rank 0's
            strategy = CVIVariationalStrategy(
                self, X[:12], len(X), learn_inducing_locations=True, train_inputs=X
            )
            super().__init__(strategy)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(x), self.covar_module(x)
            )

    model, likelihood = GP().double(), LogisticBernoulliLikelihood().double()
    model.covar_module.outputscale = 1000.0  # large: the undamped 3rd step overshoots
    cvi = CVIOptimizer(model, likelihood, step_size=1.0, process_group=group)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    model.train(), likelihood.train()
    rows = []
    for it in range(7):
        loss, hyper = cvi.step(X, y), torch.zeros((), dtype=X.dtype)
        grads = torch.zeros(26, dtype=X.dtype)
        if it >= 3:
            adam.zero_grad()
            hyper = cvi.loss(X, y)  # -ELBO / N of every rank's data
            hyper.backward()
            cvi.reduce_grads()  # the full-data gradients on every rank
            grads = torch.cat([p.grad.reshape(-1) for p in cvi.hyperparameters()])
            adam.step()
        loss = torch.stack([loss, hyper.detach() * cvi.num_data])
        with torch.no_grad():
            q = model.variational_strategy.variational_distribution
            kern = model.covar_module
            rows.append(
                torch.cat(
                    [loss.reshape(-1), q.mean, q.covariance_matrix.reshape(-1)]
                    + [kern.outputscale.reshape(1), kern.base_kernel.lengthscale.reshape(-1)]
                    + [model.variational_strategy.inducing_points.reshape(-1)]
                    + [torch.tensor([cvi.step_size, cvi.num_backtracks], dtype=X.dtype), grads]
                )
            )
    return rows


def build(group):
    guide = AutoCVI(model, process_group=group)
    optim = CVI(step_size=0.8, optim_args={"lr": 0.05})
    return guide, optim, SVI(model, guide, optim, loss=CVI_ELBO())


def main(out, ckpt=False):
    distributed = "RANK" in os.environ
    if distributed:
        tdist.init_process_group("gloo")
    torch.manual_seed(0)
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    X, y, t = (shard(a) for a in data())
    group = WORLD if distributed else None
    guide, optim, svi = build(group)
    rows = []
    for step in range(STEPS):
        loss = svi.step(X, y, t)
        q = guide.posterior("w")
        hyper = [pyro.param("prior_scale").detach(), pyro.param("sigma").detach()]
        rows.append(
            [torch.tensor([loss]), q.loc.detach(), q.covariance_matrix.detach().reshape(-1)]
            + [h.reshape(1) for h in hyper]
        )
        if ckpt and step == 2:
            path = os.path.join(os.path.dirname(out), "run.pt")
            save_checkpoint(path, optim, guide)
            pyro.clear_param_store()
            guide, optim, svi = build(group)
            load_checkpoint(path, optim, guide)
    streamed = stream(X, y, group)
    more = others(X, y, t, group)
    gp = gpytorch_classifier(group)
    if not distributed or tdist.get_rank() == 0:
        svi = torch.stack([torch.cat(r) for r in rows])
        torch.save({"svi": svi, "stream": streamed, "others": more, "gpytorch": gp}, out)
    if distributed:
        tdist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], ckpt=len(sys.argv) > 2)
