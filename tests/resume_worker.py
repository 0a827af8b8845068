"""A training run that can stop, checkpoint and resume in a fresh process (for the resume tests).

    python tests/resume_worker.py KIND MODE CKPT OUT

KIND: ``gaussian`` (logistic regression, one Gaussian block, quadrature, fixed step),
``montecarlo`` (logistic regression, Monte Carlo linear-predictor gradients, adaptive step),
``meanfield`` (Poisson-Gamma factorisation, natural blocks with Monte Carlo messages, adaptive
step), ``hybrid`` (Student-t regression with a learned offset: CVI + Adam, adaptive step).
``australian``: a user's report (logistic regression on australian, ``num_samples=4``,
``CVI(step_size=0.3)``; needs ../shared/data and scikit-learn).
MODE: ``full`` (all steps), ``first`` (the first half, then a checkpoint), ``resume`` (load,
then the second half) or ``resume-called`` (``guide(*data)`` before loading).
OUT receives the losses and the final param store.
"""

import sys
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.checkpoints.checkpoint import load_checkpoint, save_checkpoint

STEPS = 20 if len(sys.argv) > 1 and sys.argv[1] == "australian" else 12


def _logistic_data():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(80, 4, generator=g, dtype=torch.float64)
    w = torch.tensor([1.5, -2.0, 0.5, 0.0], dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(X @ w), generator=g)
    return X, y


def logistic(X, y=None):
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def poisson_mf(X):
    N, V = X.shape
    prior = dist.Gamma(X.new_tensor(0.3), X.new_tensor(0.3))
    W = pyro.sample("W", prior.expand([2, V]).to_event(2))
    with pyro.plate("rows", N):
        Z = pyro.sample("Z", prior.expand([2]).to_event(1))
        pyro.sample("X", dist.Poisson(Z @ W).to_event(1), obs=X)


def student(X, y=None):
    shift = pyro.param("shift", torch.tensor(0.0, dtype=X.dtype))
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 3.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.StudentT(3.0, X @ w + shift, 0.5), obs=y)


def build(kind):
    if kind in ("gaussian", "montecarlo"):
        data = _logistic_data()
        mc = kind == "montecarlo"
        guide = AutoCVI(logistic, num_samples=4 if mc else None)
        return logistic, guide, CVI() if mc else CVI(step_size=0.7), data
    if kind == "meanfield":
        g = torch.Generator().manual_seed(0)
        X = torch.poisson(torch.rand(10, 6, generator=g, dtype=torch.float64) * 3, generator=g)
        return poisson_mf, AutoCVI(poisson_mf), CVI(), (X,)
    if kind == "hybrid":
        g = torch.Generator().manual_seed(1)
        X = torch.randn(60, 3, generator=g, dtype=torch.float64)
        y = X @ torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64) + 0.7
        y = y + 0.3 * torch.randn(60, generator=g, dtype=torch.float64)
        y[::9] += 8.0
        guide = AutoCVI(student)
        return student, guide, CVI(optim_args={"lr": 0.05}), (X, y)
    if kind == "australian":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
        from bench.datasets import load_logreg

        d = load_logreg("australian")
        delta = d.prior_precision

        def model(X, y=None):
            w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), delta**-0.5).to_event(1))
            with pyro.plate("data", X.shape[0]):
                pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

        guide = AutoCVI(model, num_samples=4)
        return model, guide, CVI(step_size=0.3), (d.X_train, d.y_train)
    raise ValueError(kind)


def main(kind, mode, ckpt, out):
    pyro.set_rng_seed(123)
    model, guide, optim, data = build(kind)
    svi = SVI(model, guide, optim, loss=CVI_ELBO())
    losses = []
    half = STEPS // 2
    if mode.startswith("resume"):
        if mode == "resume-called":
            guide(*data)
        load_checkpoint(ckpt, optim, guide)
        steps = range(half, STEPS)
    else:
        steps = range(STEPS)
    for t in steps:
        losses.append(svi.step(*data))
        if mode == "first" and t == half - 1:
            save_checkpoint(ckpt, optim, guide)
            break
    store = pyro.get_param_store()
    state = {k: store[k].detach().clone() for k in store.keys()}
    torch.save({"losses": torch.tensor(losses, dtype=torch.float64), "store": state}, out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
