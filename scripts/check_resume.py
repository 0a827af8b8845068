"""Exact resume in a fresh process: max |difference| to the uninterrupted run.

For each model kind of ``tests/resume_worker.py`` (Gaussian block, Monte Carlo gradients,
mean field, hybrid CVI + Adam; and the issue's report: australian, ``num_samples=4``, step 0.3,
20 steps) it runs the uninterrupted steps, the first half and a checkpoint, and the second half
resumed in a fresh process, without and with a call of ``guide(*data)`` before
``load_checkpoint``. Prints a table and a verdict and writes ``results/check_resume.json``.

    OMP_NUM_THREADS=1 python scripts/check_resume.py           # about 2-3 minutes on one core
    OMP_NUM_THREADS=1 python scripts/check_resume.py --quick   # Gaussian block only
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from bench.reporting import quick_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "resume_worker.py"
KINDS = ("gaussian", "montecarlo", "meanfield", "hybrid", "australian")


def run(kind, mode, folder):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = Path(folder) / f"{kind}.{mode}.pt"
    cmd = [sys.executable, "-W", "ignore", str(WORKER), kind, mode, f"{folder}/{kind}.ckpt", out]
    subprocess.run(list(map(str, cmd)), check=True, env=env)
    return torch.load(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the Gaussian block only")
    parser.add_argument("--out", default=str(ROOT / "results" / "check_resume.json"))
    args = parser.parse_args()
    args.out = str(quick_path(args.out, args.quick))  # --quick: under results/quick/
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for kind in KINDS[:1] if args.quick else KINDS:
            full, first = run(kind, "full", folder), run(kind, "first", folder)
            half = len(first["losses"])
            moved = sum(not torch.equal(full["store"][k], first["store"][k]) for k in full["store"])
            for mode in ("resume", "resume-called"):
                r = run(kind, mode, folder)
                dl = (r["losses"] - full["losses"][half:]).abs().max().item()
                dp = max((r["store"][k] - full["store"][k]).abs().max().item() for k in r["store"])
                rows.append(
                    {
                        "kind": kind,
                        "mode": mode,
                        "max_abs_loss_diff": dl,
                        "max_abs_param_diff": dp,
                        "bit_identical": dl == 0.0 and dp == 0.0,
                        "params_moved_after_checkpoint": moved,
                    }
                )
    print(f"{'kind':<12}{'mode':<15}{'max |dloss|':>12}{'max |dparam|':>14}  bit-identical")
    for r in rows:
        print(
            f"{r['kind']:<12}{r['mode']:<15}{r['max_abs_loss_diff']:>12.3g}"
            f"{r['max_abs_param_diff']:>14.3g}  {r['bit_identical']}"
        )
    ok = all(r["bit_identical"] for r in rows)
    exact = sum(r["bit_identical"] for r in rows)
    print(f"verdict: {'PASS' if ok else 'FAIL'}: {exact} of {len(rows)} resumes bit-identical")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
