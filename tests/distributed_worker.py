"""One data-parallel CVI run, for tests/test_distributed.py (not collected by pytest).

``python tests/distributed_worker.py OUT`` runs in one process; ``torchrun --nproc_per_node=2
tests/distributed_worker.py OUT`` runs the same script on two gloo ranks, each with its shard.
Rank 0 saves the iterates (q's mean and covariance, the loss, the hyperparameters) per step,
and those of a data-parallel StreamingCVI (update="pass", minibatches of 64 from each shard),
of a model with mean-field latents (global and per-row Gamma) under the adaptive ``CVI()``, and
of a sparse GP classifier.
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
from pyro_cvi.checkpoint import load_checkpoint, save_checkpoint
from pyro_cvi.distributed import WORLD, shard
from pyro_cvi.streaming import StreamingCVI

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
    if not distributed or tdist.get_rank() == 0:
        svi = torch.stack([torch.cat(r) for r in rows])
        torch.save({"svi": svi, "stream": streamed, "others": more}, out)
    if distributed:
        tdist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], ckpt=len(sys.argv) > 2)
