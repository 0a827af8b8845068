#!/usr/bin/env python
"""Sparse GP classification with minibatch CVI steps: cost of a step and distance
to the full-batch optimum.

Data: ``N`` points in 2-D (``x ~ U[-3, 3]^2``, ``y = 1[sin(x1) + cos(x2) + 0.3 eps > 0]``), ``M``
inducing points (the first ``M`` inputs), a ScaleKernel(RBF) prior with fixed hyperparameters,
GPyTorch's ``BernoulliLikelihood``, the sparse data-site form of ``CVIVariationalStrategy``
(``train_inputs=X``) and :class:`CVIOptimizer`.

Reported: process CPU seconds of one full-batch step and of one minibatch step (medians; the
minibatch step updates the running sums by the batch's rows and computes the batch's marginals
only), and the full-data -ELBO after 30 minibatch steps (``B`` rows, step size ``--step``,
default 1.0: a site is updated only when its row is in the batch, at the current q; epochs of
random batches) against the optimum of 30 full-batch steps (step size 0.8), for the two rules of
a minibatch step: the batch's sites moved to their targets with the others kept
(``minibatch=None``), eq. 14 of Khan & Lin 2017 (:class:`~pyro_cvi.contrib.gpytorch.SVIScaling`)
with the step sizes of :class:`SVIScaling` (``--svi-c``, ``--svi-warmup``; defaults the
class's), the earlier eq. 14 schedule ``c / (t + c)``, ``c = 3`` (``SVIScaling(3, warmup=1)``),
the default, :class:`~pyro_cvi.contrib.gpytorch.SiteMemoryScaling` (``--memory-c``,
``--memory-warmup``; defaults the class's: every kept point's linear part re-targeted at q's
current mean after each step), and the earlier default (``SiteMemoryScaling(3, warmup=3,
refresh=False)``), all from the same permutations. ``--orders K`` repeats the default rule on
K - 1 further batch orders (seeds 1, 2, ...; with ``--compare-stale`` the earlier default
too); the verdict is about the worst order.

Usage::

    python scripts/benchmark_sparse_minibatch.py            # N=20,000, M=200, B=1024
    python scripts/benchmark_sparse_minibatch.py --quick    # N=5,000, M=100, B=512

Writes ``results/benchmark_sparse_minibatch.json`` (``--out``) and prints a table.
"""

import argparse
import json
import os
import statistics
import time

import gpytorch
import torch
from bench.reporting import quick_path  # noqa: E402

from pyro_cvi.contrib.gpytorch import (
    CVIOptimizer,
    CVIVariationalStrategy,
    SiteMemoryScaling,
    SVIScaling,
)


def build(X, M):
    class SparseGP(gpytorch.models.ApproximateGP):
        def __init__(self):
            strategy = CVIVariationalStrategy(self, X[:M].clone(), X.shape[0], train_inputs=X)
            super().__init__(strategy)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
            self.covar_module.base_kernel.lengthscale = 1.0
            self.covar_module.outputscale = 4.0

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(x), self.covar_module(x)
            )

    return SparseGP().double()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--m", type=int, default=200)
    ap.add_argument("--b", type=int, default=1024)
    ap.add_argument("--step", type=float, default=1.0)
    ap.add_argument("--svi-c", type=float, default=SVIScaling().c, help="SVIScaling(c=...)")
    ap.add_argument(
        "--svi-warmup", type=int, default=SVIScaling().warmup, help="SVIScaling(warmup=...)"
    )
    ap.add_argument("--memory-c", type=float, default=SiteMemoryScaling().c)
    ap.add_argument("--memory-warmup", type=int, default=SiteMemoryScaling().warmup)
    ap.add_argument(
        "--batch-seed", type=int, help="seed of the batch permutations (default: after the data)"
    )
    ap.add_argument("--orders", type=int, default=1, help="batch orders for the default rule")
    ap.add_argument(
        "--compare-stale", action="store_true", help="--orders: also the earlier default"
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="results/benchmark_sparse_minibatch.json")
    args = ap.parse_args()
    args.out = str(quick_path(args.out, args.quick))  # --quick: under results/quick/
    if args.quick:
        args.n, args.m, args.b = 5000, 100, 512
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    N, M, B = args.n, args.m, args.b
    X = (torch.rand(N, 2, generator=g, dtype=torch.float64) * 6) - 3
    f = torch.sin(X[:, 0]) + torch.cos(X[:, 1]) + 0.3 * torch.randn(N, generator=g, dtype=X.dtype)
    y = (f > 0).double()
    lik = gpytorch.likelihoods.BernoulliLikelihood()

    # full batch: 30 steps to the optimum, timing the later ones
    model = build(X, M)
    opt = CVIOptimizer(model, lik, step_size=0.8)
    full_times, losses = [], []
    for _ in range(30):
        t0 = time.process_time()
        losses.append(float(opt.step(X, y)))
        full_times.append(time.process_time() - t0)
    optimum = min(losses)

    # minibatches: 30 steps of B random rows (epochs without replacement), each rule from the
    # same permutations
    if args.batch_seed is not None:
        g.manual_seed(args.batch_seed)
    state = g.get_state()
    rules = {
        "kept": None,
        "svi_c3": SVIScaling(3.0, warmup=1),
        "svi": SVIScaling(args.svi_c, warmup=args.svi_warmup),
        "memory": SiteMemoryScaling(args.memory_c, warmup=args.memory_warmup),
        "stale": SiteMemoryScaling(3.0, warmup=3, refresh=False),  # the earlier default
    }
    finals, times = {}, {}
    for name, scaling in rules.items():
        g.set_state(state)
        model = build(X, M)
        opt = CVIOptimizer(model, lik, step_size=args.step, minibatch=scaling)
        mb_times, perm, pos = [], torch.randperm(N, generator=g), 0
        for _ in range(30):
            if pos + B > N:
                perm, pos = torch.randperm(N, generator=g), 0
            idx = perm[pos : pos + B]
            pos += B
            t0 = time.process_time()
            opt.step(X[idx], y[idx], indices=idx)
            mb_times.append(time.process_time() - t0)
        with torch.no_grad():
            finals[name] = float(CVIOptimizer(model, lik).step(X, y))  # -ELBO of q before it
        times[name] = mb_times
    final, mb_times = finals["memory"], times["memory"]
    gaps = {"script": final - optimum}
    stale_gaps = {"script": finals["stale"] - optimum}
    for seed in range(1, args.orders):
        for refresh in (True, False) if args.compare_stale else (True,):
            g.manual_seed(seed)
            model = build(X, M)
            rule = (
                SiteMemoryScaling(args.memory_c, warmup=args.memory_warmup)
                if refresh
                else SiteMemoryScaling(3.0, warmup=3, refresh=False)
            )
            opt = CVIOptimizer(model, lik, step_size=args.step, minibatch=rule)
            perm, pos = torch.randperm(N, generator=g), 0
            for _ in range(30):
                if pos + B > N:
                    perm, pos = torch.randperm(N, generator=g), 0
                idx = perm[pos : pos + B]
                pos += B
                opt.step(X[idx], y[idx], indices=idx)
            with torch.no_grad():
                gap = float(CVIOptimizer(model, lik).step(X, y)) - optimum
            (gaps if refresh else stale_gaps)[f"seed {seed}"] = gap

    full_step = statistics.median(full_times[1:])
    mb_step = statistics.median(mb_times[1:])
    out = {
        "N": N,
        "M": M,
        "B": B,
        "full_batch_step_cpu_s": full_step,
        "minibatch_step_cpu_s": mb_step,
        "ratio": mb_step / full_step,
        "full_batch_optimum": optimum,
        "after_30_minibatch_steps": final,
        "gap_nats": final - optimum,
        "gap_nats_batch_sites_kept": finals["kept"] - optimum,
        "gap_nats_c_over_t_plus_c_3": finals["svi_c3"] - optimum,
        "gap_nats_eq14_svi_scaling": finals["svi"] - optimum,
        "minibatch_step_cpu_s_eq14_svi_scaling": statistics.median(times["svi"][1:]),
        "svi_c": args.svi_c,
        "svi_warmup": args.svi_warmup,
        "memory_c": args.memory_c,
        "memory_warmup": args.memory_warmup,
        "minibatch_step_cpu_s_batch_sites_kept": statistics.median(times["kept"][1:]),
        "batch_seed": args.batch_seed,
        "gap_nats_orders": gaps,
        "gap_nats_orders_earlier_default": stale_gaps,
        "minibatch_step_cpu_s_earlier_default": statistics.median(times["stale"][1:]),
        "dtype": "float64",
        "device": "cpu",
    }
    print(f"N={N} M={M} B={B} (float64, CPU, one thread)")
    print(f"{'full-batch step':28s} {full_step:8.4f} s CPU")
    print(f"{'minibatch step':28s} {mb_step:8.4f} s CPU   ratio {mb_step / full_step:.3f}")
    print(f"{'full-batch optimum':28s} {optimum:10.2f}")
    kept = finals["kept"]
    print(f"{'30 steps, batch sites kept':28s} {kept:10.2f}   gap {kept - optimum:.2f} nats")
    c3 = finals["svi_c3"]
    print(f"{'30 steps, eq. 14, 3/(t+3)':28s} {c3:10.2f}   gap {c3 - optimum:.2f} nats")
    e14 = finals["svi"]
    print(f"{'30 steps, eq. 14, SVIScaling':28s} {e14:10.2f}   gap {e14 - optimum:.2f} nats")
    print(f"{'30 steps, SiteMemoryScaling':28s} {final:10.2f}   gap {final - optimum:.2f} nats")
    stale = finals["stale"]
    print(f"{'30 steps, earlier default':28s} {stale:10.2f}   gap {stale - optimum:.2f} nats")
    for k, v in gaps.items():
        was = f"   (earlier default {stale_gaps[k]:.2f})" if k in stale_gaps else ""
        print(f"{'  order ' + k:28s} {'':10s}   gap {v:.2f} nats{was}")
    ratio, gap = mb_step / full_step, max(gaps.values())
    verdict = (
        f"verdict: a minibatch step costs {ratio:.2f} of a full-batch step (target <= 0.25: "
        f"{'met' if ratio <= 0.25 else 'not met'}); 30 minibatch steps (SiteMemoryScaling, "
        f"c = {args.memory_c:g}, warm-up {args.memory_warmup}, the default) end "
        f"{', '.join(f'{v:.2f}' for v in gaps.values())} nats from the full-batch optimum over "
        f"{len(gaps)} batch order(s) (target < 5 on every order: "
        f"{'met' if gap < 5 else 'not met'})"
    )
    out["verdict"] = verdict
    print(verdict)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
