"""Long runs of every stepping path: finite, and no drift after 20,000 steps.

Every path of :mod:`bench.long_runs` (``AutoCVI``; ``CVI()`` on AutoNormal,
AutoDiagonalNormal, AutoMultivariateNormal and AutoLowRankMultivariateNormal; the GPyTorch
``CVIOptimizer`` and GPyTorch's own loop; streaming; structured SVI) on a regression and a
classification problem, in float32 and float64. A run passes when every loss is finite and the
mean loss of its last 1,000 steps is within 1 nat of the lowest mean of any 1,000 consecutive
steps. Prints a table and writes ``results/check_long_runs.json`` (rewritten after every run,
so a partial matrix is kept); ``--quick`` runs 2,000 steps and writes to ``results/quick/``.

    python scripts/check_long_runs.py                      # the whole matrix, 20,000 steps
    python scripts/check_long_runs.py --quick
    python scripts/check_long_runs.py --paths AutoCVI "CVI() AutoNormal" --dtypes float32
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
from bench.long_runs import MODELS, PATHS, run
from bench.reporting import Table, write_results

COLUMNS = [
    ("path", "how q is stepped"),
    ("model", "regression (Normal likelihood) or logistic (Bernoulli; structured SVI: a mixture)"),
    ("dtype", "the precision of the data and of q"),
    ("steps", "steps taken (the run stops at an exception)"),
    ("finite", "whether every loss was finite"),
    ("last 1k", "mean loss of the last 1,000 steps"),
    ("best 1k", "lowest mean loss of any 1,000 consecutive steps"),
    ("gap", "last 1k - best 1k (the requirement: at most 1 nat)"),
    ("ms/step", "wall milliseconds per step (a shared machine: indicative only)"),
    ("ok", "finite, no exception, and gap <= 1"),
]

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="default 20,000 (2,000 with --quick)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--paths", nargs="*", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    steps = args.steps or (2_000 if args.quick else 20_000)
    out = args.out or (
        "results/quick/check_long_runs.json" if args.quick else "results/check_long_runs.json"
    )
    torch.set_num_threads(1)
    combos = list(itertools.product(args.models, args.dtypes))
    # every path gets one run before any gets a second (a partial matrix covers every path)
    order = [
        (p, *combos[(i + k) % len(combos)])
        for k in range(len(combos))
        for i, p in enumerate(args.paths)
    ]
    rows = []
    for path, model, dtype in order:
        r = run(path, model, DTYPES[dtype], steps)
        n = len(r["losses"])
        row = {
            "path": path,
            "model": model,
            "dtype": dtype,
            "steps": n,
            "finite": r["finite"],
            "last_1k": r["last"],
            "best_1k": r["best"],
            "gap": r["gap"],
            "ms_per_step": 1000 * r["seconds"] / max(n, 1),
            "error": r["error"],
            "ok": r["ok"],
        }
        rows.append(row)
        print(
            f"{path:36s} {model:10s} {dtype:7s} {n:6d} steps  gap {row['gap']:.4f}  "
            f"ok={row['ok']}  {row['error'] or ''}",
            flush=True,
        )
        _write(rows, steps, out, args.quick, final=len(rows) == len(order))
    return 0 if all(r["ok"] for r in rows) else 1


def _write(rows, steps, out, quick, final):
    table = Table(f"Long runs: {steps} steps per run", COLUMNS)
    for r in rows:
        table.add(
            r["path"],
            r["model"],
            r["dtype"],
            str(r["steps"]),
            str(r["finite"]),
            f"{r['last_1k']:.4f}",
            f"{r['best_1k']:.4f}",
            f"{r['gap']:.4f}",
            f"{r['ms_per_step']:.1f}",
            "yes" if r["ok"] else "NO",
        )
        table.note(f"{r['path']} / {r['model']} / {r['dtype']}", r["error"])
    bad = [r for r in rows if not r["ok"]]
    done = "" if final else f" (partial: {len(rows)} runs so far)"
    verdict = (
        f"all {len(rows)} runs finite with a gap of at most 1 nat{done}"
        if not bad
        else f"{len(bad)} of {len(rows)} runs failed{done}: "
        + "; ".join(f"{r['path']} {r['model']} {r['dtype']}" for r in bad)
    )
    if final:
        table.print()
        print(verdict)
    write_results(
        out,
        {"steps": steps, "rows": rows},
        title="Long runs of every stepping path",
        verdict=verdict,
        tables=[table],
        command="python scripts/check_long_runs.py" + (" --quick" if quick else ""),
        quick=quick,
    )


if __name__ == "__main__":
    sys.exit(main())
