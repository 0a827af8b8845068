"""The package beside its peers, in one process tree: BayesNewton (Markov GP) and GPyTorch NGD.

Part ``markov``: the Markov-GP problem of ``scripts/time_markov_step.py`` (``T`` regular inputs,
Poisson counts, Matern-3/2 with lengthscale 20 and variance 1 fixed, 10 Gauss-Hermite points,
step size 1), fitted by ``AutoCVI`` + ``CVI(step_size=1)`` here and by BayesNewton's
``MarkovVariationalGP`` (``inference(lr=1)`` + ``energy()``, JIT-compiled) in a child process
run with ``--bayesnewton-python`` (an interpreter with BayesNewton and JAX on the CPU;
:mod:`peers.bayesnewton_markov`), on the same counts. Per ``T``: set-up (first step; BayesNewton:
model and compilation) and the median step, in process CPU seconds on one thread, float64; the
-ELBO after the last step of each (the same optimum); steps until the -ELBO changes by less
than 1e-6 relative. Skipped (and said so) when no such interpreter is given or found.

Part ``gpytorch``: GPyTorch's classification-tutorial model (``benchmark_gpytorch_loop.py``,
60 points, hyperparameters fixed): GPyTorch NGD (lr 0.5) against ``CVIVariationalStrategy`` +
``CVIOptimizer``, 30 steps each; CPU seconds per step and steps to within 0.5 nat of the better
final -ELBO.

    python scripts/benchmark_peers.py --bayesnewton-python /path/to/venv/bin/python
    python scripts/benchmark_peers.py --quick      # T = 200, 1000; results/quick/

Writes ``results/benchmark_peers.json``; prints the tables and the ratios (package / peer: below
1 means the package is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch
from bench.reporting import Table, fmt, write_results

HERE = Path(__file__).resolve().parent
REL_TOL = 1e-6


def counts(T: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    t = torch.arange(T, dtype=torch.float64)
    return torch.poisson(torch.exp(torch.sin(t / 50.0) + 0.5 * torch.sin(t / 7.0)), generator=g)


def steps_for(T: int) -> int:
    return 20 if T <= 10_000 else (6 if T <= 100_000 else 3)


def converged_at(losses: List[float]) -> Optional[int]:
    for i in range(1, len(losses)):
        if abs(losses[i] - losses[i - 1]) <= REL_TOL * abs(losses[i]):
            return i
    return None


def ours_markov(T: int, steps: int, points: int) -> dict:
    import pyro
    import pyro.distributions as dist
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI
    from pyro_cvi.statespace import Matern32, markov_gp

    y = counts(T)
    t = torch.arange(T, dtype=torch.float64)

    def model(t, y):
        f = markov_gp("x", t, Matern32(lengthscale=20.0, variance=1.0))
        with pyro.plate("t", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

    pyro.clear_param_store()
    c0 = time.process_time()
    guide = AutoCVI(model, num_quad_points=points)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    losses = [svi.step(t, y)]
    setup = time.process_time() - c0
    cpus = []
    for _ in range(steps):
        c = time.process_time()
        losses.append(svi.step(t, y))
        cpus.append(time.process_time() - c)
    return dict(setup_cpu=setup, cpu=statistics.median(cpus), neg_elbo=losses)


def find_bayesnewton(python: Optional[str]) -> Optional[str]:
    if python:
        return python
    try:
        import bayesnewton  # noqa: F401

        return sys.executable
    except ImportError:
        return None


def bayesnewton_markov(python: str, T: int, steps: int, points: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "y.npy")
        np.save(path, counts(T).numpy())
        cmd = [python, str(HERE / "peers" / "bayesnewton_markov.py"), path]
        cmd += ["--steps", str(steps), "--num-points", str(points)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


MARKOV_COLUMNS = [
    ("T", "chain length (data points)"),
    ("ours setup s", "CPU s of AutoCVI's first svi.step (tracing, analysis, warm start, step)"),
    ("BN setup s", "CPU s of BayesNewton's model construction and first (compiling) call"),
    ("ours ms/step", "median CPU ms of one svi.step (the step and its -ELBO)"),
    ("BN ms/step", "median CPU ms of one inference(lr=1) + energy() call"),
    ("ratio", "ours / BayesNewton per step (below 1: the package is faster)"),
    ("ours conv", "steps until the -ELBO changed by < 1e-6 relative"),
    ("BN conv", "the same for BayesNewton"),
    ("-ELBO ours", "after the last step"),
    ("-ELBO BN", "after the last step"),
]


def part_markov(Ts: List[int], python: Optional[str], points: int) -> tuple:
    table = Table("Markov GP (Matern-3/2, Poisson): the package and BayesNewton", MARKOV_COLUMNS)
    rows = []
    for T in Ts:
        steps = steps_for(T)
        print(f"markov T={T}: package ...", flush=True)
        ours = ours_markov(T, steps, points)
        bn = None
        if python:
            print(f"markov T={T}: BayesNewton ...", flush=True)
            try:
                bn = bayesnewton_markov(python, T, steps, points)
            except (subprocess.SubprocessError, OSError, ValueError) as e:
                print(f"   BayesNewton failed: {type(e).__name__}: {e}")
        row = dict(T=T, steps=steps, ours=ours, bayesnewton=bn)
        row["ratio"] = None if bn is None else ours["cpu"] / bn["cpu"]
        rows.append(row)
        table.add(
            T,
            f"{ours['setup_cpu']:.3f}",
            fmt(None if bn is None else bn["setup_cpu"], ".3f"),
            f"{1e3 * ours['cpu']:.2f}",
            fmt(None if bn is None else 1e3 * bn["cpu"], ".2f"),
            fmt(row["ratio"], ".2f"),
            fmt(converged_at(ours["neg_elbo"]), "d"),
            fmt(None if bn is None else converged_at(bn["neg_elbo"]), "d"),
            f"{ours['neg_elbo'][-1]:.6f}",
            fmt(None if bn is None else bn["neg_elbo"][-1], ".6f"),
        )
    if not python:
        table.note("BN", "BayesNewton not run: pass --bayesnewton-python (JAX on the CPU)")
    table.print()
    return rows, table


def part_gpytorch(iters: int) -> tuple:
    from benchmark_gpytorch_loop import run

    x = torch.linspace(0, 1, 60)  # the tutorial's data, float32 as there
    y = (torch.sign(torch.cos(x * (4 * torch.pi))) + 1) / 2
    res = {}
    for name in ("gpytorch-ngd", "cvi+opt"):
        run(name, x, y, 2, True)  # one-time costs outside the clock
        c0 = time.process_time()
        r = run(name, x, y, iters, True)
        r["cpu_per_step"] = (time.process_time() - c0) / iters
        res[name] = r
    best = min(min(r["losses"]) for r in res.values())
    table = Table(
        "GP classification (GPyTorch's tutorial model, hyperparameters fixed)",
        [
            ("method", "gpytorch-ngd: NGD lr 0.5; cvi+opt: CVIVariationalStrategy + CVIOptimizer"),
            ("steps->tgt", "steps until the -ELBO is within 0.5 nat of the best"),
            ("cpu ms/step", "CPU ms per step (the whole loop / steps)"),
            ("cpu s->tgt", "steps->tgt x cpu ms/step"),
            ("final -ELBO", "after the last step"),
        ],
    )
    for name, r in res.items():
        hit = next((i for i, v in enumerate(r["losses"]) if v <= best + 0.5), None)
        r["steps_to_target"] = hit
        r["cpu_to_target"] = None if hit is None else hit * r["cpu_per_step"]
        table.add(
            name,
            fmt(hit, "d"),
            f"{1e3 * r['cpu_per_step']:.2f}",
            fmt(r["cpu_to_target"], ".4f"),
            f"{r['neg_elbo']:.4f}",
        )
    a, b = res["cvi+opt"]["cpu_to_target"], res["gpytorch-ngd"]["cpu_to_target"]
    ratio = None if a is None or b is None or b == 0 else a / b
    table.ratio("cvi / ngd to target", ratio, "CPU seconds (below 1: the package is faster)")
    table.print()
    return {"methods": res, "ratio_to_target": ratio}, table


def main(argv: Optional[List[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="T = 200, 1000; results/quick")
    ap.add_argument("--T", type=float, nargs="*", default=None, help="chain lengths")
    ap.add_argument("--bayesnewton-python", default=None, help="interpreter with BayesNewton")
    ap.add_argument("--num-points", type=int, default=10, help="Gauss-Hermite points, both")
    ap.add_argument("--parts", nargs="+", default=["markov", "gpytorch"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    Ts = [int(T) for T in args.T] if args.T else (
        [200, 1000] if args.quick else [200, 1000, 10_000, 100_000, 1_000_000]
    )  # fmt: skip
    out = args.out or f"results/{'quick/' if args.quick else ''}benchmark_peers.json"
    python = find_bayesnewton(args.bayesnewton_python)
    if python and not shutil.which(python) and not os.path.exists(python):
        python = None
    payload: dict = {"config": dict(threads=1, dtype="float64", device="cpu", T=Ts)}
    tables, verdicts = [], []
    if "markov" in args.parts:
        rows, table = part_markov(Ts, python, args.num_points)
        payload["markov"] = rows
        tables.append(table)
        r = [f"T={x['T']}: {x['ratio']:.2f}x" for x in rows if x["ratio"] is not None]
        verdicts.append(
            "Markov GP, package / BayesNewton per step: " + (", ".join(r) if r else "not run")
        )
    if "gpytorch" in args.parts:
        payload["gpytorch"], table = part_gpytorch(30)
        tables.append(table)
        ratio = payload["gpytorch"]["ratio_to_target"]
        verdicts.append(
            "GP classification, CVI / GPyTorch NGD to the target: "
            + ("n/a" if ratio is None else f"{ratio:.2f}x")
        )
    verdict = "Verdict: " + "; ".join(verdicts) + "."
    print(verdict)
    write_results(
        out,
        payload,
        title="The package beside BayesNewton and GPyTorch NGD (CPU seconds, one thread)",
        verdict=verdict,
        tables=tables,
        command="python scripts/benchmark_peers.py --bayesnewton-python PYTHON"
        + (" --quick" if args.quick else ""),
        quick=args.quick,
        text="Process CPU seconds on one thread, float64; BayesNewton in a child process.",
    )
    return payload


if __name__ == "__main__":
    main()
