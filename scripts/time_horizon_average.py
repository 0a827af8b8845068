"""CPU per step of the one-draw Horizon step with and without iterate averaging
(``Horizon(average=0.99)``, the default, against ``Horizon(average=0)``) on the BNN benchmark
models (``scripts/bench/bnn_models.py``), float32, one torch thread: two guides of the same
model (two param-store prefixes) step in alternating blocks of ``--block`` steps in one
process, so that the machine's load falls on both alike; each block's CPU time
(``time.process_time``) is kept, and the ratio of the medians per step is reported.

    python scripts/time_horizon_average.py --out F [--models bnn_wine,bnn_digits]
        [--steps 600] [--block 25] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import pyro
import torch
from pyro.infer import SVI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench.bnn_models import MODELS  # noqa: E402

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, Horizon, Remainder  # noqa: E402


def timed(name: str, steps: int, block: int, seed: int = 0) -> dict:
    make, data = MODELS[name]
    args = data(torch.float32)
    model = make()
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    runs = {}
    for label, avg in (("plain", 0.0), ("average", 0.99)):
        rule = Remainder(step=Horizon(average=avg))
        guide = AutoCVI(model, remainder=rule, prefix=f"T_{label}")
        runs[label] = SVI(model, guide, CVI(), CVI_ELBO())
    per = {k: [] for k in runs}
    for svi in runs.values():  # the first step (set-up, the batched run's check) not timed
        svi.step(*args)
    for _ in range(steps // block):
        for label, svi in runs.items():
            t0 = time.process_time()
            for _ in range(block):
                svi.step(*args)
            per[label].append(1000 * (time.process_time() - t0) / block)
    plain, avg = statistics.median(per["plain"]), statistics.median(per["average"])
    return {
        "model": name,
        "ms_plain": plain,
        "ms_average": avg,
        "ratio": avg / plain,
        "blocks": per,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bnn_wine,bnn_digits")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--block", type=int, default=25)
    ap.add_argument("--quick", action="store_true", help="one model, 100 steps")
    ap.add_argument("--out", default=None, help="JSON of the rows")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    models = a.models.split(",")
    steps = a.steps
    if a.quick:
        models, steps = models[:1], 100
    out = Path(a.out) if a.out else ROOT / "results" / "quick" / "time_horizon_average.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in models:
        r = timed(name, steps, a.block)
        rows.append(r)
        print(
            f"{name}: {r['ms_plain']:.2f} ms a step without averaging, {r['ms_average']:.2f} "
            f"with (x{r['ratio']:.2f})",
            flush=True,
        )
    meta = {"command": " ".join(sys.argv), "torch": torch.__version__, "load": os.getloadavg()}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    worst = max(r["ratio"] for r in rows)
    print(f"verdict: averaging costs at most x{worst:.2f} a step ({', '.join(models)})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
