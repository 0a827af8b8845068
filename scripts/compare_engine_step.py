"""A whole CVI step (engine, optimizer, blocks) of an earlier revision against this tree's,
blocks of steps alternating between two worker processes (the machine's load falls on both
alike; each worker times its own CPU).

The earlier revision is exported by ``git archive`` into a temporary folder; each worker
imports ``pyro_cvi`` from its own tree, builds the problem, takes ten steps (converged: every
later step does the same work), then runs blocks of steps on request, in alternating order.
Problems:

* ``markov``: the task of ``scripts/benchmark_time_to_answer.py``'s ``markov`` part (``T``
  regular inputs, Poisson counts, Matern-3/2, 10 Gauss-Hermite points, ``CVI(step_size=1)``),
  float64;
* ``minibatch``: the Bernoulli regression of ``tests/test_minibatch_sites.py`` (N = 1,000
  points, minibatches of 25, D = 3, ``CVI()`` with its adaptive step), float64 and float32.

Reports the minimum and the median CPU ms per step of each side, one thread, and the last
returned -ELBO of both (the same problem and seed: equal where the two trees compute the
same numbers).

    PYTHONPATH=. python scripts/compare_engine_step.py --before 5644d94 --T 200 1000

Writes ``results/compare_engine_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

WORKER = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
import pyro
import pyro.distributions as dist
from pyro.infer import SVI
from pyro_cvi import CVI, CVI_ELBO, AutoCVI

problem, size, dtype = sys.argv[1], int(sys.argv[2]), getattr(torch, sys.argv[3])
pyro.clear_param_store()
pyro.set_rng_seed(3)
if problem == "markov":
    from pyro_cvi.statespace import Matern32, markov_gp

    g = torch.Generator().manual_seed(0)
    t = torch.arange(size, dtype=torch.float64)
    y = torch.poisson(torch.exp(torch.sin(t / 50.0) + 0.5 * torch.sin(t / 7.0)), generator=g)
    t, y = t.to(dtype), y.to(dtype)

    def model(t, y):
        f = markov_gp("x", t, Matern32(lengthscale=20.0, variance=1.0))
        with pyro.plate("t", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

    guide = AutoCVI(model, num_quad_points=10)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    inputs = (t, y)
else:
    N, B, D = size, 25, 3
    g = torch.Generator().manual_seed(4)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = torch.randn(D, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(X @ w), generator=g)
    X, y = X.to(dtype), y.to(dtype)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", N, subsample_size=B) as idx:
            pyro.sample("y", dist.Bernoulli(logits=X[idx] @ w), obs=y[idx])

    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
    inputs = (X, y)
for _ in range(10):
    svi.step(*inputs)
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    c = time.process_time()
    for _ in range(n):
        loss = svi.step(*inputs)
    print(json.dumps({"ms": (time.process_time() - c) / n * 1e3, "loss": float(loss)}), flush=True)
"""


class Worker:
    """One side: a process importing ``pyro_cvi`` from ``tree``."""

    def __init__(self, tree: str, problem: str, size: int, dtype: str):
        env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, problem, str(size), dtype],
            cwd=tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout.readline().strip() == "ready", f"worker in {tree} failed"

    def run(self, n: int) -> dict:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main(argv: Optional[List[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default="HEAD", help="the earlier revision")
    ap.add_argument("--T", type=int, nargs="+", default=[200, 1000], help="Markov chain lengths")
    ap.add_argument("--minibatch", nargs="*", default=["float64", "float32"],
                    help="dtypes of the minibatch problem (none: skip it)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=10, help="blocks of steps per side")
    ap.add_argument("--out", default="results/compare_engine_step.json")
    ap.add_argument("--quick", action="store_true", help="T = 200, 3 rounds; results/quick/")
    args = ap.parse_args(argv)
    if args.quick:
        args.T, args.minibatch, args.rounds = [200], ["float64"], 3
        args.out = str(Path("results/quick") / Path(args.out).name)
    sys.path.insert(0, str(HERE))
    from bench.reporting import Table, write_results

    tmp = tempfile.mkdtemp()
    archive = subprocess.run(["git", "archive", args.before, "pyro_cvi"], cwd=ROOT,
                             capture_output=True, check=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    trees = {"before": tmp, "after": str(ROOT)}
    cases = [("markov", T, "float64") for T in args.T]
    cases += [("minibatch", 1000, d) for d in args.minibatch]
    table = Table(
        f"A whole CVI step at {args.before} against this tree (two alternating workers)",
        [
            (
                "problem",
                "markov: Poisson counts on a Matern-3/2 chain; minibatch: Bernoulli "
                "regression, minibatches of 25",
            ),  # fmt: skip
            ("size", "chain length T, or data points N"),
            ("dtype", "of the data"),
            ("before ms", "min (median) CPU ms per step, the earlier revision"),
            ("after ms", "min (median) CPU ms per step, this tree"),
            ("after/before", "min over min (median over median)"),
            ("-ELBO", "the last returned -ELBO, before / after"),
        ],
    )
    rows = []
    for problem, size, dtype in cases:
        workers = {side: Worker(tree, problem, size, dtype) for side, tree in trees.items()}
        n = max(3, 3000 // size) if problem == "markov" else 100
        ms: Dict[str, List[float]] = {"before": [], "after": []}
        loss: Dict[str, float] = {}
        for r in range(args.rounds):
            for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
                out = workers[side].run(n)
                ms[side].append(out["ms"])
                loss[side] = out["loss"]
        for w in workers.values():
            w.close()
        b, a = min(ms["before"]), min(ms["after"])
        mb, ma = statistics.median(ms["before"]), statistics.median(ms["after"])
        rows.append(dict(problem=problem, size=size, dtype=dtype, loss=loss, ms=ms,
                         ratio_min=a / b, ratio_median=ma / mb))  # fmt: skip
        table.add(problem, size, dtype, f"{b:.3f} ({mb:.3f})", f"{a:.3f} ({ma:.3f})",
                  f"{a / b:.2f} ({ma / mb:.2f})",
                  f"{loss['before']:.9f} / {loss['after']:.9f}")  # fmt: skip
        print(f"{problem} {size} {dtype}: after/before {a / b:.2f} (medians {ma / mb:.2f})",
              flush=True)  # fmt: skip
    table.print()
    verdict = "Verdict: per step after/before " + ", ".join(
        f"{r['problem']} {r['size']} {r['dtype']}: {r['ratio_min']:.2f} "
        f"(medians {r['ratio_median']:.2f})" for r in rows
    )  # fmt: skip
    print(verdict)
    write_results(
        args.out,
        {"config": dict(threads=1, before=args.before), "rows": rows},
        title="A whole CVI step: an earlier revision against this tree, alternating workers",
        verdict=verdict,
        tables=[table],
        command="PYTHONPATH=. python scripts/compare_engine_step.py --before " + args.before,
        text="Process CPU ms per step, one thread, blocks of steps alternating between two "
        "worker processes.",
        quick=args.quick,
    )
    return {"rows": rows}


if __name__ == "__main__":
    main()
