"""The spread of the one-draw remainder's reported loss at a fixed ``q``, with and without
``Horizon(report_pairs=n)``, on the benchmark models whose remainder takes the one-draw step
(``scripts/bench/bnn_models.py``: the wine and digits networks).

For each model and seed (float32, one thread): AutoCVI's defaults for ``--steps`` steps; then,
at that ``q``, ``--reports`` evaluations of the reported loss (``CVI_ELBO().loss``) for each
``n`` in ``--pairs``, and an independent ``Trace_ELBO`` estimate of the same guide's bound.
Each row gives the reports' mean and standard deviation and the mean's distance to the
estimate in standard errors.

    python scripts/benchmark_report_spread.py [--models bnn_wine,bnn_digits] [--seeds 2]
        [--steps 300] [--reports 60] [--pairs 0,1,4,16] [--out FILE] [--quick]

``--quick``: the wine network, one seed, 50 steps, 10 reports, pairs 0 and 4, output under
``results/quick/``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench.bnn_models import MODELS  # noqa: E402
from bench.reporting import write_results  # noqa: E402

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, Horizon  # noqa: E402


def run(name: str, seed: int, steps: int, reports: int, pairs) -> dict:
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    make, data = MODELS[name]
    model, args = make(), data(torch.float32)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    for _ in range(steps):
        svi.step(*args)
    (block,) = [b for b in guide.engine.blocks if b.kind == "remainder"]
    if not block.onedraw:
        raise SystemExit(f"{name}: its remainder does not take the one-draw step")
    default = block.rule
    with torch.no_grad():
        est = torch.tensor(
            [Trace_ELBO(num_particles=10).loss(model, guide, *args) for _ in range(40)],
            dtype=torch.float64,
        )
    row = {
        "model": name,
        "seed": seed,
        "steps": steps,
        "dim": block.dim,
        "form": block.form,
        "estimate": [float(est.mean()), float(est.std() / math.sqrt(len(est)))],
        "one_draw_sd_trace_elbo": float(est.std() * math.sqrt(10)),
    }
    for n in pairs:
        block.rule = Horizon(report_pairs=n)  # only the report reads it here: no step is taken
        v = torch.tensor(
            [CVI_ELBO().loss(model, guide, *args) for _ in range(reports)], dtype=torch.float64
        )
        se = math.hypot(float(v.std()) / math.sqrt(reports), row["estimate"][1])
        row[f"pairs_{n}"] = {
            "mean": float(v.mean()),
            "sd": float(v.std()),
            "z_vs_estimate": (float(v.mean()) - row["estimate"][0]) / se,
        }
    block.rule = default
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bnn_wine,bnn_digits")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reports", type=int, default=60)
    ap.add_argument("--pairs", default="0,1,4,16")
    ap.add_argument("--out", default=str(ROOT / "results" / "benchmark_report_spread.json"))
    ap.add_argument("--quick", action="store_true", help="wine, one seed, 50 steps, 10 reports")
    a = ap.parse_args(argv)
    if a.quick:
        a.models, a.seeds, a.steps, a.reports, a.pairs = "bnn_wine", 1, 50, 10, "0,4"
    torch.set_num_threads(1)
    pairs = [int(p) for p in a.pairs.split(",")]
    rows = []
    for name in a.models.split(","):
        for seed in range(a.seeds):
            rows.append(run(name, seed, a.steps, a.reports, pairs))
    lines = []
    for r in rows:
        sds = ", ".join(f"{n} pairs {r[f'pairs_{n}']['sd']:.2f}" for n in pairs)
        zs = max(abs(r[f"pairs_{n}"]["z_vs_estimate"]) for n in pairs)
        lines.append(f"{r['model']} seed {r['seed']}: report sd {sds}; max |z| {zs:.1f}")
    text = "; ".join(lines)
    write_results(
        a.out,
        {"rows": rows},
        title="The one-draw remainder's reported loss at a fixed q: spread by report pairs",
        verdict=text,
        command="python scripts/benchmark_report_spread.py " + " ".join(sys.argv[1:]),
        quick=a.quick,
    )
    print("verdict:", text)


if __name__ == "__main__":
    main()
