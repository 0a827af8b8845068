"""Long runs of every stepping path: finite, and no drift after 20,000 steps.

Every path of :mod:`bench.long_runs` (``AutoCVI``; ``CVI()`` on AutoNormal,
AutoDiagonalNormal, AutoMultivariateNormal and AutoLowRankMultivariateNormal; the GPyTorch
``CVIOptimizer`` and GPyTorch's own loop; streaming; structured SVI) on a regression and a
classification problem, in float32 and float64. A run passes when every loss is finite and the
mean loss of its last 1,000 steps is within 1 nat of the lowest mean of any 1,000 consecutive
steps. A fresh estimate of the final q's -ELBO (every Pyro path and streaming: 2,000
independent draws of the guide; structured SVI: 2,000 draws of its final q(beta) plus the
closed-form KL; GPyTorch: its objective evaluated afresh) is set beside the mean loss of the
last 1,000 steps: they agree when within 3 standard errors (both estimates' together) plus
0.01 nat. Prints a table and writes
``results/check_long_runs.json`` (rewritten after every run, so a partial matrix is kept);
``--quick`` runs 2,000 steps and writes to ``results/quick/``. ``--resume`` keeps the rows
already in the JSON and runs only the missing ones (``--limit N``: at most N of them), so the
matrix can be measured a few runs at a time; ``--merge A.json B.json`` adds the rows of other
runs' files (several processes, each with its own ``--out``) to ``--out`` without running any.

    python scripts/check_long_runs.py                      # the whole matrix, 20,000 steps
    python scripts/check_long_runs.py --quick
    python scripts/check_long_runs.py --paths AutoCVI "CVI() AutoNormal" --dtypes float32
    python scripts/check_long_runs.py --resume --limit 3   # three more of the missing runs
    python scripts/check_long_runs.py --merge /tmp/other.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
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
    ("bound", "fresh estimate of the final q's -ELBO (- where the path has none)"),
    ("agrees", "last 1k within 3 SE + 0.01 of the fresh bound (- not measured)"),
    ("ms/step", "CPU milliseconds per step (a shared machine: indicative only)"),
    ("ok", "finite, no exception, gap <= 1, and the loss agrees with the bound where measured"),
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
    ap.add_argument(
        "--resume", action="store_true", help="keep the rows in --out; run only missing ones"
    )
    ap.add_argument("--limit", type=int, default=None, help="run at most this many")
    ap.add_argument(
        "--merge",
        nargs="*",
        default=[],
        help="JSON files of other runs of the same length (e.g. another process's --out): "
        "their rows are added to --out and nothing is run",
    )
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
    rows = _kept(out, steps) if args.resume or args.merge else []
    done = {(r["path"], r["model"], r["dtype"]) for r in rows}
    if args.merge:
        for other in args.merge:
            for r in _kept(other, steps):
                if (r["path"], r["model"], r["dtype"]) not in done:
                    rows.append(r)
                    done.add((r["path"], r["model"], r["dtype"]))
        rank = {c: i for i, c in enumerate(order)}
        rows.sort(key=lambda r: rank.get((r["path"], r["model"], r["dtype"]), len(rank)))
        _write(rows, steps, out, args.quick, total=len(order))
        return 0 if all(r["ok"] for r in rows) else 1
    todo = [c for c in order if c not in done][: args.limit]
    for path, model, dtype in todo:
        r = run(path, model, DTYPES[dtype], steps)
        n = len(r["losses"])
        agrees = None
        if r["bound"] is not None and math.isfinite(r["last"]):
            se = math.hypot(r["bound_se"], r["last_se"])
            agrees = abs(r["last"] - r["bound"]) <= 3 * se + 0.01
        row = {
            "path": path,
            "model": model,
            "dtype": dtype,
            "steps": n,
            "finite": r["finite"],
            "last_1k": r["last"],
            "best_1k": r["best"],
            "gap": r["gap"],
            "last_se": r["last_se"],
            "bound": r["bound"],
            "bound_se": r["bound_se"],
            "agrees": agrees,
            "ms_per_step": 1000 * r["seconds"] / max(n, 1),
            "error": r["error"],
            "ok": r["ok"] and agrees is not False,
        }
        rows.append(row)
        print(
            f"{path:36s} {model:10s} {dtype:7s} {n:6d} steps  gap {row['gap']:.4f}  "
            f"bound {row['bound']}  ok={row['ok']}  {row['error'] or ''}",
            flush=True,
        )
        _write(rows, steps, out, args.quick, total=len(order))
    if not todo:
        _write(rows, steps, out, args.quick, total=len(order))
    return 0 if all(r["ok"] for r in rows) else 1


def _kept(out: str, steps: int) -> list:
    """The rows of an earlier run of the same length in ``out`` (none if there is none)."""
    if not os.path.exists(out):
        return []
    with open(out) as f:
        old = json.load(f)
    return list(old.get("rows", [])) if old.get("steps") == steps else []


def _num(v) -> str:
    return "-" if v is None else f"{v:.4f}"


def _write(rows, steps, out, quick, total):
    final = len(rows) == total
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
            _num(r.get("bound")),
            {None: "-", True: "yes", False: "NO"}[r.get("agrees")],
            f"{r['ms_per_step']:.1f}",
            "yes" if r["ok"] else "NO",
        )
        table.note(f"{r['path']} / {r['model']} / {r['dtype']}", r["error"])
    bad = [r for r in rows if not r["ok"]]
    done = "" if final else f" (partial: {len(rows)} of {total} runs)"
    with_bound = [r for r in rows if r.get("agrees") is not None]
    verdict = (
        f"all {len(rows)} runs finite with a gap of at most 1 nat; {len(with_bound)} checked "
        f"against a fresh estimate of the bound, all agree{done}"
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
        command="python scripts/check_long_runs.py --resume" + (" --quick" if quick else ""),
        quick=quick,
    )


if __name__ == "__main__":
    sys.exit(main())
