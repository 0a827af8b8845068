"""Every zoo model fitted with its data on another device (a GPU), beside the same fit on the CPU.

For each entry of ``tests/zoo`` and each dtype, the model's data are moved to ``--device``
(nothing else: a user's model that builds CPU tensors of its own fails under Pyro's own
inference on that device too, and is reported as such, not fitted). Then ``AutoCVI`` with the
default ``CVI()`` runs ``min(entry.steps, --steps)`` steps on the device and the same steps on
the CPU, and the row checks that

* the fit ran (no error), every reported loss is finite, and every parameter of the guide lives
  on the data's device and dtype;
* the device's bound (a ``Trace_ELBO`` estimate, or the mean of the last five reported losses for
  discrete or subsampled models) is within ``max(0.5, 0.5%) + 3 SE`` of the CPU's (the devices'
  random streams differ, so the fits are not bit-identical).

``CVI()`` on Pyro's ``AutoNormal`` (the drop-in path) gets the same comparison on the models
without discrete latents. Usage (on a machine with a GPU)::

    python scripts/check_device.py --device cuda --jobs 8 --out results/check_device.json
    python scripts/check_device.py --quick --device cpu   # three small models, both on the CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, List

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

QUICK = ["coin", "poisson_regression", "bayesian_regression"]


def to_device(obj, device):
    """``obj`` with every tensor in it (tuples, lists, dicts) moved to ``device``."""
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def _bound(entry, model, guide, data, losses, particles: int) -> Dict:
    from pyro.infer import Trace_ELBO

    if entry.has_discrete or entry.subsampled:
        tail = torch.tensor(losses[-5:], dtype=torch.float64)
        return {"bound": float(tail.mean()), "se": float(tail.std() / math.sqrt(5)), "how": "last5"}
    elbo = Trace_ELBO(num_particles=particles, vectorize_particles=False)
    with torch.no_grad():
        values = torch.tensor(
            [elbo.loss(model, guide, *data.args, **data.kwargs) for _ in range(5)],
            dtype=torch.float64,
        )
    return {"bound": float(values.mean()), "se": float(values.std() / math.sqrt(5)), "how": "trace"}


def _params_on(device: torch.device, dtype) -> List[str]:
    """Names of the param store's values that are not on ``device`` in ``dtype``."""
    import pyro

    off = []
    for name, value in pyro.get_param_store().items():
        if value.device.type != device.type or (value.is_floating_point() and value.dtype != dtype):
            off.append(f"{name} ({value.device}, {value.dtype})")
    return off


def _where(e: BaseException) -> str:
    """The innermost frame of ``pyro_cvi`` in the error's traceback (file:line and the line)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "pyro_cvi" in f.filename]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename.split('pyro_cvi/')[-1]}:{f.lineno} {f.line}"


def fit(entry, dtype, device: str, guide_name: str, steps: int, particles: int) -> Dict:
    """One fit on ``device``: its row (``bound``, ``se``, ``cpu``, checks, or ``error``)."""
    import pyro
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoNormal

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI

    dev = torch.device(device)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, kwargs = entry.build(dtype)
    data = entry.data(dtype)
    data.args = to_device(data.args, dev)
    data.kwargs = to_device(data.kwargs, dev)
    try:  # is the model itself clean on this device (no CPU tensors of its own)?
        with torch.no_grad(), pyro.poutine.block():
            pyro.poutine.trace(model).get_trace(*data.args, **data.kwargs)
    except Exception as e:
        return {"skipped": f"the model alone fails on {device}: {type(e).__name__}: {str(e)[:120]}"}
    t0 = time.process_time()
    try:
        if guide_name == "AutoCVI":
            guide, loss = AutoCVI(model, **kwargs), CVI_ELBO()
        else:
            guide, loss = AutoNormal(model), Trace_ELBO()
        svi = SVI(model, guide, CVI(), loss)
        losses = [svi.step(*data.args, **data.kwargs) for _ in range(steps)]
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:200]}", "where": _where(e)}
    row: Dict = {"cpu": time.process_time() - t0, "steps": steps}
    if guide_name == "AutoCVI":
        row["explain"], row["subsampled"] = guide.explain(), entry.subsampled
    row["nonfinite_losses"] = sum(1 for v in losses if not math.isfinite(v))
    row["params_off_device"] = _params_on(dev, dtype)
    try:
        row.update(_bound(entry, model, guide, data, losses, particles))
    except Exception as e:
        row["error"] = f"bound: {type(e).__name__}: {str(e)[:200]}"
    return row


def _worker(task):
    zoo_dir, name, dtype_name, device, guide_name, cap, particles = task
    torch.set_num_threads(1)
    if zoo_dir not in sys.path:
        sys.path.insert(0, zoo_dir)
    from zoo import ZOO

    entry = ZOO[name]
    steps = min(entry.steps, cap)
    dtype = getattr(torch, dtype_name)
    rows = {d: fit(entry, dtype, d, guide_name, steps, particles) for d in (device, "cpu")}
    return (name, dtype_name, guide_name), rows


def verdict_of(rows: Dict[str, Dict], device: str) -> str:
    dev, cpu = rows[device], rows["cpu"]
    if "skipped" in dev:
        return "model not device-clean"
    if "error" in dev and "error" in cpu and dev["error"][:40] == cpu["error"][:40]:
        return "fails on both"
    if "error" in dev:
        return "FAILED on device"
    if dev["nonfinite_losses"] or dev["params_off_device"]:
        return "FAILED checks"
    if "bound" not in cpu:
        return "cpu failed"
    if dev.get("explain") != cpu.get("explain") and not dev.get("subsampled"):
        # (a subsampled model's explain() names the last minibatch's sites: random)
        return "EXPLAIN DIFFERS"
    slack = max(0.5, 0.005 * abs(cpu["bound"])) + 3 * math.hypot(dev["se"], cpu["se"])
    gap = dev["bound"] - cpu["bound"]
    return "same" if abs(gap) <= slack else ("WORSE" if gap > 0 else "better")


def main(argv=None) -> int:
    from bench.reporting import Table, write_results

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="three small models, float64 only")
    p.add_argument("--out", default="results/check_device.json", help="JSON to write")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", nargs="*", default=None, help="zoo keys (default: all)")
    p.add_argument("--dtypes", nargs="*", default=["float64", "float32"])
    p.add_argument("--guides", nargs="*", default=["AutoCVI", "AutoNormal"])
    p.add_argument("--steps", type=int, default=60, help="at most this many steps a fit")
    p.add_argument("--particles", type=int, default=100, help="Trace_ELBO draws (x 5)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    args = p.parse_args(argv)
    zoo_dir = str(ROOT / "tests")
    sys.path.insert(0, zoo_dir)
    from zoo import ZOO

    names = QUICK if args.quick else (args.models or list(ZOO))
    dtypes = ["float64"] if args.quick else args.dtypes
    tasks = [
        (zoo_dir, n, dt, args.device, g, 10 if args.quick else args.steps, args.particles)
        for n in names
        for dt in dtypes
        for g in args.guides
        if not (g == "AutoNormal" and ZOO[n].has_discrete)
    ]
    records = sorted((ROOT / "results").glob("zoo_record_*.json"), key=lambda f: f.name)
    cost = json.loads(records[-1].read_text())["records"] if records else {}

    def last_cost(task) -> float:
        return cost.get(task[1] if task[2] == "float64" else f"{task[1]}-f32", {}).get("cpu", 0.0)

    tasks.sort(key=lambda t: -last_cost(t))
    if args.jobs <= 1:
        results = [_worker(t) for t in tasks]
    else:
        import multiprocessing as mp

        results = []
        # (a fresh process a fit: a device-side assert leaves its process's context unusable)
        with mp.get_context("spawn").Pool(args.jobs, maxtasksperchild=1) as pool:
            for key, rows in pool.imap_unordered(_worker, tasks):
                results.append((key, rows))
                print("|".join(key), verdict_of(rows, args.device), json.dumps(rows), flush=True)
    table = Table(
        f"The zoo on {args.device} beside the CPU",
        [
            ("model", "zoo entry, dtype"),
            ("guide", "AutoCVI, or Pyro's AutoNormal under CVI()"),
            ("device", f"-ELBO on {args.device} +- SE (or what failed)"),
            ("cpu", "-ELBO on the CPU +- SE"),
            ("s dev/cpu", "CPU seconds of the fit on each side"),
            ("verdict", "same: within max(0.5, 0.5%) + 3 SE"),
        ],
    )
    record = {}
    counts: Dict[str, int] = {}
    for (name, dt, g), rows in sorted(results):
        v = verdict_of(rows, args.device)
        counts[v] = counts.get(v, 0) + 1
        record[f"{name}|{dt}|{g}"] = {**rows, "verdict": v}
        d, c = rows[args.device], rows["cpu"]

        def cell(r):
            if "bound" in r and "error" not in r:
                return f"{r['bound']:.3f} +- {r['se']:.3f}"
            return (r.get("error") or r.get("skipped") or "?")[:60]

        times = f"{d.get('cpu', float('nan')):.1f}/{c.get('cpu', float('nan')):.1f}"
        table.add(f"{name} {dt}", g, cell(d), cell(c), times, v)
        if v.startswith("FAILED") or v in ("WORSE", "EXPLAIN DIFFERS"):
            table.note(f"{name} {dt}", json.dumps(d)[:300])
    table.print()
    bad = sum(
        n for v, n in counts.items() if v.startswith("FAILED") or v in ("WORSE", "EXPLAIN DIFFERS")
    )
    summary = ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
    what = (
        f"every fit on {args.device} ran and matched the CPU"
        if not bad
        else f"{bad} fits failed or fitted worse on {args.device}"
    )
    verdict = f"Verdict: {what} ({summary}; torch {torch.__version__})."

    print(verdict)
    payload = {"records": record, "device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda") and torch.cuda.is_available():
        payload["gpu"] = torch.cuda.get_device_name(0)
    write_results(
        args.out,
        payload,
        title=f"The zoo on {args.device}",
        verdict=verdict,
        tables=[table],
        command="python scripts/check_device.py " + " ".join(argv or sys.argv[1:]),
        quick=args.quick,
    )
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
