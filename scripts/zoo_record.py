"""The zoo's record: every model's bound with the default ``AutoCVI`` + ``CVI()``, kept per
commit, so that no change makes a model that fitted fit worse.

For each entry of ``tests/zoo`` (and each dtype) it runs ``entry.steps`` default steps and
records the bound: an independent ``Trace_ELBO`` estimate of the final guide (5 x ``--particles``
draws; its standard error kept) for models without discrete latents, the mean of the last five
reported losses for those with them (Pyro's ``Trace_ELBO`` would sample what AutoCVI sums out),
and the CPU seconds. It runs against whatever ``pyro_cvi`` is importable, so the same script
and the same zoo measure an older commit (``git worktree add /tmp/old <commit>``, then run it
from there with ``--zoo`` pointing at this checkout's ``tests``).

``--compare RECORD [RECORD ...]`` reads earlier records and prints, for each model, the new
bound beside the best earlier one; a model is a *regression* when it is worse than that best
by more than ``max(0.5, 0.5%)`` plus three standard errors. The verdict names them.

Usage::

    python scripts/zoo_record.py --out results/zoo_record_main.json \\
        --compare results/zoo_record_85a0a12.json results/zoo_record_9c97649.json
    python scripts/zoo_record.py --quick   # three small models, float64

``--jobs N`` measures the rows in ``N`` worker processes (each row seeds itself and runs on one
thread, so the record is the same as a serial run's; the costliest rows start first).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["coin", "poisson_regression", "bayesian_regression"]


def tolerance(best: float) -> float:
    """The slack of "no worse": ``max(0.5, 0.5% of |best|)`` nats."""
    return max(0.5, 0.005 * abs(best))


def measure(entry, dtype, particles: int) -> Dict:
    """One model, one dtype: the record row (``bound``, ``se``, ``cpu``, or ``error``)."""
    import pyro
    from pyro.infer import SVI, Trace_ELBO

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, kwargs = entry.build(dtype)
    data = entry.data(dtype)
    t0 = time.process_time()
    try:
        guide = AutoCVI(model, **kwargs)
        svi = SVI(model, guide, CVI(), CVI_ELBO())
        losses = [svi.step(*data.args, **data.kwargs) for _ in range(entry.steps)]
    except Exception as e:  # a failed fit is a row of the record too
        return {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    row = {"cpu": time.process_time() - t0, "last5": sum(losses[-5:]) / 5}
    row["remainder"] = list(getattr(guide.engine.analysis, "remainder", []))
    if entry.has_discrete or entry.subsampled:
        tail = torch.tensor(losses[-5:], dtype=torch.float64)
        row.update(bound=float(tail.mean()), se=float(tail.std() / math.sqrt(5)), how="last5")
        return row
    elbo = Trace_ELBO(num_particles=particles)
    with torch.no_grad():
        values = torch.tensor(
            [elbo.loss(model, guide, *data.args, **data.kwargs) for _ in range(5)],
            dtype=torch.float64,
        )
    row.update(bound=float(values.mean()), se=float(values.std() / math.sqrt(5)), how="trace")
    return row


def compare(new: Dict[str, Dict], olds: List[Dict[str, Dict]]) -> List[List]:
    """Rows ``[model, new, best earlier, slack, verdict]``."""
    rows = []
    for key, row in new.items():
        earlier = [o[key] for o in olds if key in o and "bound" in o[key]]
        best = min(earlier, key=lambda r: r["bound"]) if earlier else None
        if "bound" not in row:
            verdict = "failed" if best is not None else "failed (and before)"
            rows.append([key, row.get("error", "?"), _fmt(best), "", verdict])
            continue
        if best is None:
            rows.append([key, _fmt(row), "-", "", "new"])
            continue
        slack = tolerance(best["bound"]) + 3 * math.hypot(row.get("se", 0), best.get("se", 0))
        worse = row["bound"] - best["bound"]
        verdict = "REGRESSION" if worse > slack else ("better" if worse < -slack else "same")
        rows.append([key, _fmt(row), _fmt(best), f"{slack:.2f}", verdict])
    return rows


def _fmt(row: Optional[Dict]) -> str:
    if row is None:
        return "-"
    return f"{row['bound']:.3f} +- {row.get('se', 0):.3f}" if "bound" in row else "error"


def _worker(task):
    """One row in a worker process: ``(key, row)``."""
    zoo_dir, name, dt, particles = task
    torch.set_num_threads(1)
    if zoo_dir not in sys.path:
        sys.path.insert(0, zoo_dir)
    from zoo import ZOO

    key = name if dt == "float64" else f"{name}-f32"
    return key, measure(ZOO[name], getattr(torch, dt), particles)


def measure_all(names, dtypes, particles: int, zoo_dir: str, jobs: int) -> Dict[str, Dict]:
    """Every (model, dtype) row, in the order of ``names`` x ``dtypes``; ``jobs`` > 1: in that
    many spawned processes, the rows of the costliest models (by the last record) first."""
    tasks = [(zoo_dir, n, dt, particles) for n in names for dt in dtypes]
    keys = [n if dt == "float64" else f"{n}-f32" for _, n, dt, _ in tasks]
    if jobs <= 1:
        record = {}
        for task in tasks:
            key, row = _worker(task)
            record[key] = row
            print(key, json.dumps(row), flush=True)
        return record
    import multiprocessing as mp

    cost = _last_costs()
    order = sorted(range(len(tasks)), key=lambda i: -cost.get(keys[i], 0.0))
    found: Dict[str, Dict] = {}
    with mp.get_context("spawn").Pool(jobs) as pool:
        for key, row in pool.imap_unordered(_worker, [tasks[i] for i in order]):
            found[key] = row
            print(key, json.dumps(row), flush=True)
    return {k: found[k] for k in keys}


def _last_costs() -> Dict[str, float]:
    """CPU seconds per row of the newest record in results/ (for the order of the work)."""
    records = sorted((ROOT / "results").glob("zoo_record_*.json"), key=lambda f: f.stat().st_mtime)
    for f in reversed(records):
        rows = json.loads(f.read_text()).get("records", {})
        if rows:
            return {k: float(v.get("cpu", 0.0)) for k, v in rows.items()}
    return {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="three small models, float64 only")
    p.add_argument("--out", default=None, help="JSON record to write")
    p.add_argument("--models", nargs="*", default=None, help="zoo keys (default: all)")
    p.add_argument("--dtypes", nargs="*", default=["float64", "float32"])
    p.add_argument("--particles", type=int, default=200, help="Trace_ELBO draws (x 5)")
    p.add_argument("--zoo", default=str(ROOT / "tests"), help="folder holding the zoo package")
    p.add_argument("--compare", nargs="*", default=[], help="earlier records")
    p.add_argument("--label", default=None, help="what was measured (a commit)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (same record)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sys.path.insert(0, args.zoo)
    from zoo import ZOO

    names = QUICK if args.quick else (args.models or list(ZOO))
    dtypes = ["float64"] if args.quick else args.dtypes
    wall, cpu = time.time(), time.process_time()
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        p.error(f"unknown zoo models {unknown}; the zoo has {sorted(ZOO)}")
    record = measure_all(names, dtypes, args.particles, args.zoo, args.jobs)
    olds = [json.loads(Path(f).read_text())["records"] for f in args.compare]
    rows = compare(record, olds)
    bad = [r[0] for r in rows if r[4] in ("REGRESSION", "failed")]
    verdict = (
        f"Verdict: no model fits worse than its best earlier record ({len(rows)} rows)."
        if not bad
        else f"Verdict: {len(bad)} of {len(rows)} rows fit worse than before: {', '.join(bad)}."
    )
    if olds:
        print(f"{'model':34s} {'bound':>22s} {'best earlier':>22s} {'slack':>6s}  verdict")
        for r in rows:
            print(f"{r[0]:34s} {r[1]:>22s} {r[2]:>22s} {r[3]:>6s}  {r[4]}")
    print(verdict)
    if args.out or args.quick:
        out = Path(args.out or ROOT / "results" / "quick" / "zoo_record.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        table = {
            "heading": "The zoo's bounds",
            "columns": ["model", "bound", "best earlier", "slack", "verdict"],
            "rows": rows,
            "legend": {
                "bound": "-ELBO of the final guide (Trace_ELBO estimate, or the last five "
                "reported losses for discrete or subsampled models) +- its standard error",
                "slack": "max(0.5, 0.5%) + 3 standard errors",
            },
        }
        report = {
            "title": f"Zoo record{f' ({args.label})' if args.label else ''}",
            "verdict": verdict,
            "command": "python scripts/zoo_record.py " + " ".join(argv or sys.argv[1:]),
            "tables": [table] if olds else [],
            "quick": args.quick,
            "run": {
                "wall_seconds": time.time() - wall,
                "cpu_seconds": time.process_time() - cpu,  # (this process: jobs=1)
                "jobs": args.jobs,
                "cpu_count": os.cpu_count(),
            },
        }
        out.write_text(json.dumps({"report": report, "records": record}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
