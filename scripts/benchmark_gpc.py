#!/usr/bin/env python
"""GP classification on USPS 3-vs-5: CVI (pyro_cvi.contrib.gpytorch) against GPyTorch baselines.

Protocol (``shared/data/README.md``): the 770/770 split of ``default_rng(147)``, a zero-mean GP
with kernel ``sf^2 exp(-|x - x'|^2 / (2 l^2))`` (``ScaleKernel(RBFKernel)``) and a logistic
likelihood (:class:`~pyro_cvi.contrib.gpytorch.LogisticBernoulliLikelihood`, shared by every
method; ``--likelihood probit`` swaps in GPyTorch's ``BernoulliLikelihood``). All methods use
the same kernel, likelihood and inducing set (the 770 training inputs; ``cvi-sparse`` uses
M = 100 k-means centres).

Part 1, hyperparameters fixed at log l = 2.5 and log sf = 2 (well conditioned) or 5 (the paper's):

* ``cvi``: :class:`CVIOptimizer` on a full :class:`CVIVariationalStrategy` (step 0.8, with
  backtracking);
* ``ngd``: GPyTorch ``NGD`` with ``NaturalVariationalDistribution`` (best of an lr grid);
* ``adam``: GPyTorch ``Adam`` with ``CholeskyVariationalDistribution`` (best of an lr grid);
* ``cvi-sparse``: CVI with M = 100 inducing points (dual parameterisation).

Part 2, hyperparameters learned (Adam, lr 0.1, on log sf and log l, from log sf = 2,
log l = 2.5): ``cvi`` (CVI step + Adam step per iteration), ``ngd`` (NGD + Adam, one backward),
``adam`` (Adam on everything), ``cvi-sparse`` (CVI + Adam on hyperparameters and inducing
locations).

Reported per run: iterations and wall time until the -ELBO is within 0.5 nat of the converged
-ELBO (the best final -ELBO of all runs in that setting), final -ELBO (gpytorch's
``VariationalELBO`` times N), test log-loss in bits, accuracy, seconds per iteration and peak
memory. Each run executes in a fresh (spawned) process; peak memory is that process's
``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (peak resident set size), given in total and as
the growth over the process's peak after data loading and model construction ("+MB"). On CUDA
``torch.cuda.max_memory_allocated`` is reported instead.

Usage::

    python scripts/benchmark_gpc.py            # full benchmark (~15 min on 2 CPU cores)
    python scripts/benchmark_gpc.py --quick    # 300 training points, few iterations (< 2 min)

    python scripts/benchmark_gpc.py --likelihood probit --out results/benchmark_gpc_probit.json

Writes ``results/benchmark_gpc.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import math
import multiprocessing as mp
import os
import platform
import resource
import time
from typing import Dict, List, Optional

import numpy as np
import torch
from bench.reporting import (  # noqa: E402
    Table,
    absurd_value,
    fmt,
    fmt_reach,
    progress,
    reach_phrase,
    reached_then_left,
    write_results,
)

TOLERANCE_NATS = 0.5


# --------------------------------------------------------------------------- model
def _log_positive():
    import gpytorch

    return gpytorch.constraints.Positive(transform=torch.exp, inv_transform=torch.log)


def make_model(
    kind: str,
    X: torch.Tensor,
    Z: Optional[torch.Tensor],
    learn_z: bool = False,
    ard: bool = False,
):
    """An ApproximateGP with a zero mean and ScaleKernel(RBF) on log-parameterised scales
    (one lengthscale per input dimension with ``ard=True``)."""
    import gpytorch

    from pyro_cvi.contrib.gpytorch import CVIVariationalStrategy

    N = X.shape[0]

    class GPClassifier(gpytorch.models.ApproximateGP):
        def __init__(self):
            if kind == "cvi":
                strategy = CVIVariationalStrategy(self, X, N)
            elif kind == "cvi-sparse":
                strategy = CVIVariationalStrategy(
                    self, Z, N, learn_inducing_locations=learn_z, train_inputs=X
                )
            elif kind == "ngd":
                dist = gpytorch.variational.NaturalVariationalDistribution(N)
                strategy = gpytorch.variational.VariationalStrategy(
                    self, X, dist, learn_inducing_locations=False
                )
            elif kind == "adam":
                dist = gpytorch.variational.CholeskyVariationalDistribution(N)
                strategy = gpytorch.variational.VariationalStrategy(
                    self, X, dist, learn_inducing_locations=False
                )
            else:
                raise ValueError(kind)
            super().__init__(strategy)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.RBFKernel(
                    ard_num_dims=X.shape[-1] if ard else None,
                    lengthscale_constraint=_log_positive(),
                ),
                outputscale_constraint=_log_positive(),
            )

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(x), self.covar_module(x)
            )

    return GPClassifier()


def kmeans_centres(X: torch.Tensor, M: int, seed: int = 0) -> torch.Tensor:
    try:
        from sklearn.cluster import KMeans
    except ImportError:  # pragma: no cover
        g = torch.Generator().manual_seed(seed)
        return X[torch.randperm(X.shape[0], generator=g)[:M]].clone()
    km = KMeans(M, n_init=4, random_state=seed).fit(X.cpu().numpy())
    return torch.as_tensor(km.cluster_centers_, dtype=X.dtype, device=X.device)


def evaluate(model, lik, X, y, X_test, y_test):
    """``(-ELBO, test log-loss in bits, accuracy)``: the -ELBO is N times gpytorch's
    ``VariationalELBO``; the predictive probability is ``likelihood(model(X_test))``."""
    import gpytorch

    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=X.shape[0])
    with torch.no_grad():
        model.train()
        lik.train()
        nelbo = -mll(model(X), y).item() * X.shape[0]
        model.eval()
        lik.eval()
        p = lik(model(X_test)).probs.clamp(1e-12, 1 - 1e-12)
        bits = -(y_test * torch.log2(p) + (1 - y_test) * torch.log2(1 - p)).mean().item()
        acc = ((p > 0.5).to(y_test) == y_test).to(torch.float64).mean().item()
        model.train()
        lik.train()
    return nelbo, bits, acc


# -------------------------------------------------------------------------- worker
def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def run_one(cfg: dict) -> dict:
    """Train one method under one setting; runs in its own process."""
    torch.set_num_threads(cfg["threads"])
    import gpytorch
    from bench.datasets import load_usps_3vs5

    from pyro_cvi.contrib.gpytorch import CVIOptimizer, LogisticBernoulliLikelihood

    device = torch.device(cfg["device"])
    dtype = getattr(torch, cfg["dtype"])
    data = load_usps_3vs5(cfg["data_dir"], dtype=dtype, device=device)
    X, y = data.X_train, data.y_train
    if cfg["n_train"] < X.shape[0]:
        X, y = X[: cfg["n_train"]], y[: cfg["n_train"]]
    N = X.shape[0]
    Z = None
    if cfg["method"] == "cvi-sparse":
        Z = kmeans_centres(X, cfg["num_inducing"])
    learn = cfg["learn"]
    model = make_model(cfg["method"], X, Z, learn_z=learn).to(device=device, dtype=dtype)
    model.covar_module.outputscale = math.exp(2 * cfg["log_sf"])
    model.covar_module.base_kernel.lengthscale = math.exp(cfg["log_l"])
    if cfg["likelihood"] == "probit":
        lik = gpytorch.likelihoods.BernoulliLikelihood()
    else:
        lik = LogisticBernoulliLikelihood()
    lik = lik.to(device=device, dtype=dtype)
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=N)
    model.train()
    lik.train()

    hypers = list(model.hyperparameters())
    if not learn:
        for p in hypers:
            p.requires_grad_(False)
    method = cfg["method"]
    lr = cfg["lr"]
    if method in ("cvi", "cvi-sparse"):
        cvi = CVIOptimizer(model, lik, step_size=lr)
        params = list(model.parameters()) if learn else []
        hyper_opt = torch.optim.Adam(params, lr=cfg["hyper_lr"]) if learn else None
    elif method == "ngd":
        var_opt = gpytorch.optim.NGD(model.variational_parameters(), num_data=N, lr=lr)
        hyper_opt = torch.optim.Adam(hypers, lr=cfg["hyper_lr"]) if learn else None
    else:
        groups = [{"params": list(model.variational_parameters()), "lr": lr}]
        if learn:
            groups.append({"params": hypers, "lr": cfg["hyper_lr"]})
        var_opt = torch.optim.Adam(groups)
        hyper_opt = None

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = _peak_mb(device)
    trace: List[List[float]] = []
    error = None
    elapsed = 0.0
    for it in range(cfg["iters"]):
        t0 = time.perf_counter()
        try:
            if method in ("cvi", "cvi-sparse"):
                loss = cvi.step(X, y).item()
                if hyper_opt is not None:  # the documented hybrid loop
                    hyper_opt.zero_grad()
                    (-mll(model(X), y)).backward()
                    hyper_opt.step()
            else:
                var_opt.zero_grad()
                if hyper_opt is not None:
                    hyper_opt.zero_grad()
                out = -mll(model(X), y)
                out.backward()
                var_opt.step()
                if hyper_opt is not None:
                    hyper_opt.step()
                loss = out.item() * N
        except Exception as e:  # report failures (e.g. Cholesky) instead of crashing the table
            error = f"{type(e).__name__}: {str(e)[:200]}"
            break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed += time.perf_counter() - t0
        trace.append([it, elapsed, loss])
        if not math.isfinite(loss):
            error = "non-finite -ELBO"
            break
        if elapsed > cfg["max_seconds"]:
            break
    peak = _peak_mb(device)

    result = dict(cfg)
    result.update(
        trace=trace,
        iterations=len(trace),
        total_time=elapsed,
        time_per_iter=elapsed / max(len(trace), 1),
        error=error,
        peak_mb=peak,
        peak_increase_mb=peak - rss_before,
    )
    if error is None:
        nelbo, bits, acc = evaluate(model, lik, X, y, data.X_test, data.y_test)
        result.update(final_nelbo=nelbo, test_logloss_bits=bits, accuracy=acc)
        result["final_log_sf"] = 0.5 * math.log(model.covar_module.outputscale.item())
        result["final_log_l"] = math.log(model.covar_module.base_kernel.lengthscale.item())
        if method in ("cvi", "cvi-sparse"):
            result["num_backtracks"] = cvi.num_backtracks
            result["num_clipped"] = cvi.num_clipped
            result["final_step_size"] = cvi.step_size
    return result


def sparse_scaling(sizes: List[int], M: int, threads: int, dtype: str, device: str) -> List[dict]:
    """Seconds per sparse CVI step on synthetic 256-D inputs: should grow like N M^2."""
    import gpytorch  # noqa: F401

    from pyro_cvi.contrib.gpytorch import CVIOptimizer, LogisticBernoulliLikelihood

    torch.set_num_threads(threads)
    dt, dev = getattr(torch, dtype), torch.device(device)
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in sizes:
        X = (torch.rand(n, 256, generator=g, dtype=dt) * 2 - 1).to(dev)
        y = (X[:, :8].sum(-1) > 0).to(dt)
        model = make_model("cvi-sparse", X, X[:M].clone()).to(device=dev, dtype=dt)
        model.covar_module.outputscale = math.exp(4.0)
        model.covar_module.base_kernel.lengthscale = math.exp(2.5)
        opt = CVIOptimizer(model, LogisticBernoulliLikelihood().to(device=dev, dtype=dt), 0.8)
        opt.step(X, y)
        reps = 3
        t0 = time.perf_counter()
        for _ in range(reps):
            opt.step(X, y)
        per = (time.perf_counter() - t0) / reps
        rows.append(
            {"n": n, "m": M, "seconds_per_step": per, "ns_per_nm2": 1e9 * per / (n * M * M)}
        )
    return rows


# ---------------------------------------------------------------------------- main
def reach(trace: List[List[float]], target: float):
    for it, t, v in trace:
        if v <= target:
            return int(it) + 1, float(t)
    return None, None


def summarise(runs: List[dict]) -> dict:
    """Pick the best lr per method and fill in iterations/time to within 0.5 nat."""
    ok = [r for r in runs if r.get("final_nelbo") is not None and r["error"] is None]
    full_ok = [r for r in ok if r["method"] != "cvi-sparse"]
    ref = min(r["final_nelbo"] for r in (full_ok or ok)) if ok else float("nan")
    for r in runs:
        r["reference_nelbo"] = ref
        r["iters_to_tol"], r["time_to_tol"] = reach(r["trace"], ref + TOLERANCE_NATS)
    best: Dict[str, dict] = {}
    for r in runs:
        m = r["method"]
        key = (
            r["time_to_tol"] if r["time_to_tol"] is not None else float("inf"),
            r.get("final_nelbo") if r.get("final_nelbo") is not None else float("inf"),
        )
        if m not in best or key < best[m]["_key"]:
            best[m] = dict(r, _key=key)
    for r in best.values():
        r.pop("_key")
    return {"reference_nelbo": ref, "best": best, "all_runs": runs}


COLUMNS = [
    (
        "method",
        "cvi: CVIOptimizer on the full CVIVariationalStrategy; ngd: GPyTorch NGD on "
        "NaturalVariationalDistribution; adam: GPyTorch Adam on CholeskyVariationalDistribution; "
        "cvi-sparse: CVI with M inducing points (its -ELBO is a looser bound, not the target)",
    ),
    ("lr/step", "the step size or learning rate of the method's best run of the grid"),
    (
        "iters",
        "iterations until the -ELBO is within 0.5 nat of the converged -ELBO (the best "
        "final -ELBO of the full methods); 'never': not within the run",
    ),
    ("time(s)", "seconds until then"),
    ("s/iter", "seconds per iteration"),
    ("-ELBO", "final -ELBO (GPyTorch VariationalELBO x N, nats, lower is better)"),
    ("logloss", "test log-loss in bits per point (lower is better)"),
    ("acc", "test accuracy"),
    ("peakMB", "peak resident memory of the run's own process (MB)"),
    ("+MB", "growth of that peak over the peak after data loading and model set-up (MB)"),
]


def gpc_table(title: str, summary: dict) -> Table:
    ref = summary["reference_nelbo"]
    table = Table(f"{title}   (converged -ELBO = {ref:.3f}; tol {TOLERANCE_NATS} nat)", COLUMNS)
    cvi_time = summary["best"].get("cvi", {}).get("time_to_tol")
    for m, r in summary["best"].items():
        table.add(
            m,
            f"{r['lr']:.3g}",
            fmt_reach(r["iters_to_tol"], "d"),
            fmt_reach(r["time_to_tol"], ".2f"),
            f"{r['time_per_iter']:.3f}",
            fmt(r.get("final_nelbo"), ".3f"),
            fmt(r.get("test_logloss_bits"), ".4f"),
            fmt(r.get("accuracy"), ".3f"),
            f"{r['peak_mb']:.0f}",
            f"{r['peak_increase_mb']:.0f}",
        )
        if r["error"]:
            table.note(m, "failed: " + r["error"][:120])
        table.note(m, reached_then_left([v for _, _, v in r["trace"]], ref, TOLERANCE_NATS))
        table.note(m, absurd_value(r.get("final_nelbo"), ref))
        if m != "cvi" and cvi_time and r["time_to_tol"]:
            table.ratio(f"{m}/cvi time", r["time_to_tol"] / cvi_time, f"{m}'s time(s) / cvi's")
        if r.get("learn"):
            table.note(m, f"learned log sf {r['final_log_sf']:.2f}, log l {r['final_log_l']:.2f}")
    series = {
        m: [(t, v - ref) for _, t, v in r["trace"] if t > 0 and v - ref > 1e-3]
        for m, r in summary["best"].items()
        if m != "cvi-sparse"
    }
    table.plot(
        "seconds",
        "-ELBO minus the converged -ELBO (nats)",
        series,
        logx=True,
        logy=True,
        title=title,
    )
    return table


def _verdict(parts: Dict[str, dict], budget: float) -> str:
    out = []
    for part, summary in parts.items():
        best = summary["best"]
        if "cvi" not in best:
            continue
        cvi = reach_phrase("CVI", best["cvi"]["time_to_tol"])
        others = [
            reach_phrase(
                {"ngd": "NGD", "adam": "Adam"}[m],
                best[m]["time_to_tol"],
                best[m]["trace"][-1][1] if best[m]["trace"] else budget,
            )
            for m in ("ngd", "adam")
            if m in best
        ]
        out.append(f"{part}: " + ", ".join([cvi] + others))
    return "Verdict: " + "; ".join(out) + "."


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", default=None, help="folder with usps_3vs5.npz")
    ap.add_argument("--quick", action="store_true", help="300 training points, few iterations")
    ap.add_argument("--out", default="results/benchmark_gpc.json")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    ap.add_argument(
        "--likelihood",
        default="logistic",
        choices=["logistic", "probit"],
        help="logistic (the protocol; our LogisticBernoulliLikelihood) or probit "
        "(gpytorch.likelihoods.BernoulliLikelihood)",
    )
    ap.add_argument(
        "--in-process", action="store_true", help="no subprocesses (memory is cumulative)"
    )
    args = ap.parse_args(argv)

    from bench.datasets import data_dir

    root = str(data_dir(args.data_dir))
    quick = args.quick
    base = dict(
        data_dir=root,
        device=args.device,
        dtype=args.dtype,
        likelihood=args.likelihood,
        threads=args.threads,
        n_train=300 if quick else 770,
        num_inducing=50 if quick else 100,
        log_l=2.5,
        hyper_lr=0.1,
        max_seconds=60.0 if quick else 240.0,
    )
    # (method, learn, [step sizes / learning rates], iterations)
    if quick:
        fixed_plan = [
            ("cvi", [0.8], 25),
            ("ngd", [0.5], 25),
            ("adam", [0.05], 60),
            ("cvi-sparse", [0.8], 25),
        ]
        learned_plan = [("cvi", [0.8], 40), ("ngd", [0.5], 40), ("cvi-sparse", [0.8], 40)]
        settings = [2.0, 5.0]
    else:
        fixed_plan = [
            ("cvi", [0.5, 0.8, 1.0], 60),
            ("ngd", [0.2, 0.5, 0.8], 60),
            ("adam", [0.01, 0.03, 0.1], 300),
            ("cvi-sparse", [0.8], 60),
        ]
        learned_plan = [
            ("cvi", [0.8], 150),
            ("ngd", [0.5], 150),
            ("adam", [0.03], 300),
            ("cvi-sparse", [0.8], 300),
        ]
        settings = [2.0, 5.0]

    jobs = []
    for log_sf in settings:
        for method, lrs, iters in fixed_plan:
            for lr in lrs:
                jobs.append(
                    dict(
                        base,
                        part=f"fixed log_sf={log_sf:g}",
                        method=method,
                        lr=lr,
                        iters=iters,
                        log_sf=log_sf,
                        learn=False,
                    )
                )
    for method, lrs, iters in learned_plan:
        for lr in lrs:
            jobs.append(
                dict(
                    base,
                    part="learned from log_sf=2",
                    method=method,
                    lr=lr,
                    iters=iters,
                    log_sf=2.0,
                    learn=True,
                )
            )

    t_start = time.perf_counter()
    results: List[dict] = []
    if args.in_process:
        for cfg in jobs:
            results.append(run_one(cfg))
    else:
        ctx = mp.get_context("spawn")
        # one fresh process per run, so that ru_maxrss is per run
        bar = progress(jobs, "GPC runs (one process each)")
        for cfg in bar:
            bar.set_postfix_str(f"{cfg['part']}, {cfg['method']} lr={cfg['lr']}")
            with cf.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
                results.append(pool.submit(run_one, cfg).result())

    parts: Dict[str, dict] = {}
    tables: List[Table] = []
    for part in dict.fromkeys(r["part"] for r in results):
        parts[part] = summarise([r for r in results if r["part"] == part])
        tables.append(gpc_table(part, parts[part]))
        tables[-1].print()

    report = {
        "meta": {
            "quick": quick,
            "likelihood": args.likelihood,
            "n_train": base["n_train"],
            "num_inducing_sparse": base["num_inducing"],
            "dtype": args.dtype,
            "device": args.device,
            "threads_per_run": args.threads,
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "memory": "peak RSS of each run's own process via resource.getrusage(RUSAGE_SELF)"
            ".ru_maxrss (MB); +MB = growth over the peak after setup"
            if args.device == "cpu"
            else "torch.cuda.max_memory_allocated (MB)",
            "tolerance_nats": TOLERANCE_NATS,
            "wall_seconds": time.perf_counter() - t_start,
        },
        "parts": parts,
    }
    try:
        import gpytorch

        report["meta"]["gpytorch"] = gpytorch.__version__
    except ImportError:  # pragma: no cover
        pass
    fixed2 = parts.get("fixed log_sf=2", {}).get("best", {})
    if "cvi" in fixed2 and "ngd" in fixed2 and fixed2["cvi"]["time_to_tol"]:
        if fixed2["ngd"]["time_to_tol"]:
            ratio = fixed2["ngd"]["time_to_tol"] / fixed2["cvi"]["time_to_tol"]
            report["meta"]["ngd_over_cvi_time_to_tol_logsf2"] = ratio
            print(
                f"\nNGD / CVI wall time to within {TOLERANCE_NATS} nat (log sf = 2): {ratio:.1f}x "
                "(how many times longer NGD takes than CVI to reach the same -ELBO)"
            )
    sizes = [1000, 2000, 4000] if quick else [1000, 2000, 4000, 8000, 16000]
    scaling = sparse_scaling(sizes, 100, args.threads, args.dtype, args.device)
    report["sparse_scaling"] = scaling
    scale = Table(
        "sparse CVI step (M = 100, D = 256; the kernel matrix K_ZX dominates)",
        [
            ("N", "training points (synthetic, D = 256 inputs)"),
            ("s/step", "seconds per sparse CVI step"),
            ("ns/(N M^2)", "nanoseconds per N M^2: constant if the step is O(N M^2)"),
        ],
    )
    for r in scaling:
        scale.add(str(r["n"]), f"{r['seconds_per_step']:.3f}", f"{r['ns_per_nm2']:.2f}")
    scale.plot(
        "N",
        "seconds per step",
        {"sparse CVI": [(r["n"], r["seconds_per_step"]) for r in scaling]},
        logx=True,
        logy=True,
    )
    scale.print()
    tables.append(scale)
    verdict = _verdict(parts, base["max_seconds"])
    report["meta"]["wall_seconds"] = time.perf_counter() - t_start
    write_results(
        args.out,
        report,
        title=f"GP classification (USPS 3 vs 5, {args.likelihood}): CVI against GPyTorch NGD "
        "and Adam",
        verdict=verdict,
        tables=tables,
        command="python scripts/benchmark_gpc.py" + (" --quick" if quick else ""),
        quick=quick,
        text=f"{base['n_train']} training points, the same kernel, likelihood and inducing set "
        "for every method; the best step size or learning rate of each method's grid.",
    )
    print(verdict)
    return report


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
