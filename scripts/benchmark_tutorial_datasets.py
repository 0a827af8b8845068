#!/usr/bin/env python
"""GPyTorch's GP-classification tutorial loop on the tutorial's data and five more small sets,
with ``CVIVariationalStrategy`` swapped in line for line, against GPyTorch's strategies.

The loop is the tutorial's: a ConstantMean + ScaleKernel(RBF) prior, GPyTorch's
``BernoulliLikelihood``, the inducing points at the training inputs
(``learn_inducing_locations=False``), Adam lr 0.1 on ``model.parameters()``,
``loss = -VariationalELBO``, GPyTorch's default hyperparameter start (lengthscale and outputscale
0.69) unless a set says otherwise. Methods:

* ``gpytorch``: GPyTorch's ``UnwhitenedVariationalStrategy`` + ``CholeskyVariationalDistribution``
  (the tutorial);
* ``gpytorch-whitened``: its ``VariationalStrategy`` (the SVGP default);
* ``cvi-loop``: ``CVIVariationalStrategy`` (the CVI step in ``loss.backward()``), nothing else
  changed;
* ``cvi+opt``: the same with ``CVIOptimizer(model, likelihood).step(x, y)`` before each Adam step.

Data sets (float64; labels ``y ~ Bernoulli(Phi(f))`` with ``f`` a draw of a GP with the stated
true lengthscale and outputscale 4, except the tutorial's ``sign(cos(4 pi x))``): test accuracy
is against ``f > 0`` (the tutorial: ``cos(4 pi x) > 0``) on 500 fresh inputs. Reported: test
accuracy and -ELBO (nats, N times ``VariationalELBO``) after 50 (the tutorial's count), 100 and
500 Adam steps, and the CPU seconds of the 500 steps (one thread).

Usage::

    python scripts/benchmark_tutorial_datasets.py            # about 5 minutes on one core
    python scripts/benchmark_tutorial_datasets.py --quick    # 3 sets, 100 steps

Writes ``results/benchmark_tutorial_datasets.json`` (``--out``) and prints the table.
"""

from __future__ import annotations

import argparse
import math
import time

import gpytorch
import torch
from bench.reporting import Table, write_results
from gpytorch.variational import (
    CholeskyVariationalDistribution,
    UnwhitenedVariationalStrategy,
    VariationalStrategy,
)

from pyro_cvi.contrib.gpytorch import CVIOptimizer, CVIVariationalStrategy

METHODS = {
    "gpytorch": UnwhitenedVariationalStrategy,
    "gpytorch-whitened": VariationalStrategy,
    "cvi-loop": CVIVariationalStrategy,
    "cvi+opt": CVIVariationalStrategy,
}

#: name: (dimension, N, true lengthscale, input range, initial lengthscale or None)
SETS = {
    "tutorial (1-D, 60)": (1, 60, None, 1.0, None),
    "tutorial, start l=2": (1, 60, None, 1.0, 2.0),
    "1-D, 200, l=0.03": (1, 200, 0.03, 1.0, None),
    "1-D, 500, l=0.3": (1, 500, 0.3, 1.0, None),
    "2-D, 100, l=0.15": (2, 100, 0.15, 1.0, None),
    "2-D, 300, l=0.5": (2, 300, 0.5, 1.0, None),
    "2-D, 50, l=3 on [0,10]": (2, 50, 3.0, 10.0, None),
    "2-D, 100, l=0.15, start l=0.02": (2, 100, 0.15, 1.0, 0.02),
}
QUICK_SETS = ("tutorial (1-D, 60)", "1-D, 200, l=0.03", "2-D, 100, l=0.15")


def make_data(name: str, seed: int = 0, n_test: int = 500):
    dim, n, ls, width, _ = SETS[name]
    g = torch.Generator().manual_seed(seed)
    if ls is None:  # GPyTorch's tutorial
        x = torch.linspace(0, 1, n, dtype=torch.float64).unsqueeze(-1)
        y = torch.sign(torch.cos(x[:, 0] * (4 * math.pi))).add(1).div(2)
        xt = torch.rand(n_test, 1, generator=g, dtype=torch.float64)
        return x, y, xt, (torch.cos(xt[:, 0] * (4 * math.pi)) > 0).double()
    xs = torch.rand(n + n_test, dim, generator=g, dtype=torch.float64) * width
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    k.base_kernel.lengthscale, k.outputscale = ls, 4.0
    with torch.no_grad():
        K = k(xs).to_dense() + 1e-6 * torch.eye(n + n_test, dtype=torch.float64)
        f = torch.linalg.cholesky(K) @ torch.randn(n + n_test, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.special.ndtr(f[:n]), generator=g)
    return xs[:n], y, xs[n:], (f[n:] > 0).double()


def make_model(method: str, x: torch.Tensor, init_ls):
    strategy_cls = METHODS[method]

    class GPClassificationModel(gpytorch.models.ApproximateGP):
        def __init__(self, train_x):
            variational_distribution = CholeskyVariationalDistribution(train_x.size(0))
            variational_strategy = strategy_cls(
                self, train_x, variational_distribution, learn_inducing_locations=False
            )
            super().__init__(variational_strategy)
            self.mean_module = gpytorch.means.ConstantMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(x), self.covar_module(x)
            )

    model = GPClassificationModel(x).double()
    if init_ls is not None:
        model.covar_module.base_kernel.lengthscale = init_ls
    return model


def evaluate(model, likelihood, x, y, xt, yt):
    """Test accuracy and the -ELBO (nats) at the current q and hyperparameters."""
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, y.numel())
    with torch.no_grad():
        neg_elbo = -float(mll(model(x), y)) * y.numel()
        model.eval()
        likelihood.eval()
        acc = float(((likelihood(model(xt)).mean > 0.5).double() == yt).double().mean())
    model.train()
    likelihood.train()
    return acc, neg_elbo


def run(method: str, data, init_ls, steps: int, checkpoints):
    x, y, xt, yt = data
    torch.manual_seed(0)
    model = make_model(method, x, init_ls)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood().double()
    model.train()
    likelihood.train()
    cvi = CVIOptimizer(model, likelihood) if method == "cvi+opt" else None
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, y.numel())
    out, losses, cpu = {}, [], 0.0
    for i in range(1, steps + 1):
        t0 = time.process_time()
        if cvi is not None:
            cvi.step(x, y)
        optimizer.zero_grad()
        loss = -mll(model(x), y)
        loss.backward()
        optimizer.step()
        cpu += time.process_time() - t0
        losses.append(float(loss.detach()) * y.numel())
        if i in checkpoints:
            acc, neg_elbo = evaluate(model, likelihood, x, y, xt, yt)
            out[i] = {"accuracy": acc, "neg_elbo": neg_elbo, "cpu_seconds": cpu}
    out["lengthscale"] = float(model.covar_module.base_kernel.lengthscale.detach())
    out["losses"] = losses
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 sets, 100 steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out_path = args.out or (
        "results/quick/benchmark_tutorial_datasets.json"
        if args.quick
        else "results/benchmark_tutorial_datasets.json"
    )
    steps = 100 if args.quick else 500
    checkpoints = (50, 100) if args.quick else (50, 100, 500)
    names = QUICK_SETS if args.quick else tuple(SETS)
    table = Table(
        "GPyTorch's tutorial loop, strategy swapped in (float64, one thread)",
        [
            ("data set", "inputs, N, true lengthscale (and start if not GPyTorch's 0.69)"),
            ("method", "gpytorch = the tutorial's UnwhitenedVariationalStrategy"),
        ]
        + [(f"acc@{c}", f"test accuracy after {c} Adam steps") for c in checkpoints]
        + [(f"-ELBO@{c}", f"-ELBO (nats) after {c} steps") for c in checkpoints]
        + [("cpu s", f"CPU seconds of the {steps} steps")],
    )
    payload = {"steps": steps, "checkpoints": list(checkpoints), "sets": {}}
    no_worse = []
    for name in names:
        data = make_data(name)
        init_ls = SETS[name][4]
        rows = {}
        for method in METHODS:
            r = run(method, data, init_ls, steps, checkpoints)
            rows[method] = r
            table.add(
                name,
                method,
                *[f"{r[c]['accuracy']:.3f}" for c in checkpoints],
                *[f"{r[c]['neg_elbo']:.1f}" for c in checkpoints],
                f"{r[checkpoints[-1]]['cpu_seconds']:.2f}",
            )
        payload["sets"][name] = rows
        ref = rows["gpytorch"]
        for method in ("cvi-loop", "cvi+opt"):
            ok = all(
                rows[method][c]["accuracy"] >= ref[c]["accuracy"]
                and rows[method][c]["neg_elbo"] <= ref[c]["neg_elbo"] + 1e-6
                for c in checkpoints
            )
            no_worse.append((name, method, ok))
    table.print()
    bad = [f"{m} on {n}" for n, m, ok in no_worse if not ok]
    verdict = (
        f"Verdict: with the strategy swapped in, accuracy and -ELBO are no worse than GPyTorch's "
        f"tutorial strategy at {', '.join(map(str, checkpoints))} steps on "
        f"{len(no_worse) - len(bad)} of {len(no_worse)} (set, loop) pairs"
        + (f"; worse: {'; '.join(bad)}." if bad else ".")
    )
    print(verdict)
    payload["no_worse"] = [{"set": n, "method": m, "no_worse": ok} for n, m, ok in no_worse]
    write_results(
        out_path,
        payload,
        title="GPyTorch's GP-classification tutorial loop on six data sets",
        verdict=verdict,
        tables=[table],
        quick=args.quick,
        command="python scripts/benchmark_tutorial_datasets.py"
        + (" --quick" if args.quick else ""),
    )


if __name__ == "__main__":
    main()
