"""Peak memory and time per step of a hierarchical model with many groups (the observations'
Jacobian in the group latent selects one group per row).

``many_schools`` of ``scripts/benchmark_prior_messages.py`` (``G`` groups of 4 Normal
observations, ``theta_j ~ Normal(mu, tau)``) with the default ``AutoCVI`` + ``CVI()``, each row
in a fresh child process (one thread): its peak resident memory (the child's own
``ru_maxrss``), the set-up time (the guide's construction and first step), the mean time of the
following steps, and the last loss. ``--checkout PATH`` runs another checkout's ``pyro_cvi``
(the same script, the same model), so that a commit is measured against an older one::

    git worktree add --detach /tmp/old main
    python scripts/benchmark_large_groups_memory.py --checkout /tmp/old --out /tmp/old.json
    python scripts/benchmark_large_groups_memory.py --compare /tmp/old.json

Usage::

    python scripts/benchmark_large_groups_memory.py --quick
    python scripts/benchmark_large_groups_memory.py --groups 500 1000 5000 \
        --out results/benchmark_large_groups_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench.reporting import Table, write_results  # noqa: E402

#: the child: builds the model, times the steps, prints one JSON line
CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
import pyro
import pyro_cvi  # (first: the model's script puts its own checkout first on the path)
from pyro_cvi import CVI, CVI_ELBO, AutoCVI
sys.path.insert(0, {scripts!r})
from benchmark_prior_messages import many_schools, schools_data
from pyro.infer import SVI
G, steps, dtype = {groups}, {steps}, getattr(torch, {dtype!r})
families = {families!r}
args, _ = schools_data(G)(dtype)
pyro.clear_param_store()
pyro.set_rng_seed(0)
t = time.process_time()
guide = AutoCVI(many_schools, families=families)
svi = SVI(many_schools, guide, CVI(), CVI_ELBO())
losses = [svi.step(*args)]
setup = time.process_time() - t
t = time.process_time()
for _ in range(steps - 1):
    losses.append(svi.step(*args))
per_step = (time.process_time() - t) / max(1, steps - 1)
print("ROW", json.dumps({{"setup": setup, "per_step": per_step, "last_loss": float(losses[-1]),
    "losses": [float(v).hex() for v in losses], "module": pyro_cvi.__file__}}))
"""

#: spelling -> the group latent's family (``None``: the default)
WAYS = {"default": None, "named mean field": {"theta": "gaussian_diag"}}


def run_row(checkout: Path, groups: int, steps: int, dtype: str, way: str) -> dict:
    """One child process: its row, and its own peak resident memory (MB)."""
    code = CHILD.format(
        scripts=str(ROOT / "scripts"),
        groups=groups,
        steps=steps,
        dtype=dtype,
        families=WAYS[way],
    )
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True, cwd=checkout
    )
    out = proc.stdout.read() if proc.stdout is not None else ""
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"G={groups} {way} {dtype}: the child failed (status {status})")
    line = next(ln for ln in out.splitlines() if ln.startswith("ROW "))
    row = json.loads(line[4:])
    if not Path(row["module"]).resolve().is_relative_to(checkout.resolve()):
        raise RuntimeError(f"the child ran {row['module']}, not the checkout {checkout}")
    row["peak_mb"] = usage.ru_maxrss / 1024
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", nargs="*", type=int, default=[500, 1000, 5000])
    p.add_argument("--steps", type=int, default=20, help="steps per row")
    p.add_argument("--dtypes", nargs="*", default=["float64", "float32"])
    p.add_argument("--ways", nargs="*", default=list(WAYS), choices=list(WAYS))
    p.add_argument("--checkout", default=str(ROOT), help="the checkout whose pyro_cvi runs")
    p.add_argument("--compare", default=None, help="a record of this script to compare with")
    p.add_argument("--quick", action="store_true", help="G = 500, float64, 5 steps")
    p.add_argument("--out", default="results/benchmark_large_groups_memory.json")
    args = p.parse_args()
    if args.quick:
        args.groups, args.dtypes, args.steps, args.ways = [500], ["float64"], 5, ["default"]
    old = json.loads(Path(args.compare).read_text())["rows"] if args.compare else {}
    rows = {}
    table = Table(
        f"many_schools with G groups, {args.steps} steps, one thread, one process a row",
        [
            ("G, way", "groups; default: no families=; named mean field: {theta: gaussian_diag}"),
            ("peak MB", "the child process's peak resident memory"),
            ("set-up s", "CPU s of the guide's construction and first step"),
            ("s/step", "mean CPU s of the following steps"),
            ("last loss", "the last step's loss"),
            ("before", "peak MB, s/step and whether the losses are bit-identical, in --compare"),
        ],
    )
    for G in args.groups:
        for dt in args.dtypes:
            for way in args.ways:
                key = f"{G}-{way}" + ("-f32" if dt == "float32" else "")
                r = run_row(Path(args.checkout), G, args.steps, dt, way)
                r.update(groups=G, way=way, dtype=dt)
                rows[key] = r
                o = old.get(key)
                before = "-"
                if o is not None:
                    same = "same losses" if o["losses"] == r["losses"] else "losses differ"
                    before = f"{o['peak_mb']:.0f} MB, {o['per_step']:.3f} s/step, {same}"
                table.add(
                    key,
                    f"{r['peak_mb']:.0f}",
                    f"{r['setup']:.2f}",
                    f"{r['per_step']:.4f}",
                    f"{r['last_loss']:.3f}",
                    before,
                )
                print(key, f"{r['peak_mb']:.0f} MB", f"{r['per_step']:.4f} s/step", flush=True)
    top = max(r["groups"] for r in rows.values())
    pick = [r for r in rows.values() if r["groups"] == top]
    best = min(pick, key=lambda r: (r["way"] != "default", r["dtype"] != "float64"))
    key = f"{top}-{best['way']}" + ("-f32" if best["dtype"] == "float32" else "")
    verdict = (
        f"Verdict: at G = {top} ({best['way']}, {best['dtype']}) the peak memory is "
        f"{best['peak_mb']:.0f} MB and a step takes {best['per_step']:.3f} CPU s"
    )
    o = old.get(key)
    if o is not None:
        same = "the same losses" if o["losses"] == best["losses"] else "other losses"
        verdict += f" (before: {o['peak_mb']:.0f} MB, {o['per_step']:.3f} s; {same})."
    else:
        verdict += "."
    print(verdict)
    write_results(
        args.out,
        {"steps": args.steps, "checkout": args.checkout, "rows": rows},
        title="Hierarchical models with many groups: peak memory and time per step",
        verdict=verdict,
        tables=[table],
        command="python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
