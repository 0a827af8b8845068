"""Steps until :func:`pyro_cvi.methods.convergence.converged` says True, per model class, with the
bound there against the bound after ``extra`` more steps (both fresh ``Trace_ELBO``
estimates): whether True was right.

    python scripts/benchmark_convergence.py [--models a,b] [--max-steps 4000] [--extra 1000]
        [--out results/benchmark_convergence.json] [--quick] [--report-pairs N] [--seeds S]

``--quick``: the conjugate model only, 600 steps and 200 more, output under ``results/quick/``.
The verdict says, per model, whether the bound gained less than the check's tolerance in the
steps after it first said True.

AutoCVI's defaults (``CVI()``, float32, one thread) on the BNN benchmark's models
(``scripts/bench/bnn_models.py``), and AutoNormal + Adam (lr 0.01) on a conjugate model
(independent Normal means, whose optimum is the exact posterior).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench.bnn_models import MODELS  # noqa: E402
from bench.reporting import write_results  # noqa: E402

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, Horizon, Remainder  # noqa: E402
from pyro_cvi.methods.convergence import convergence_report  # noqa: E402

#: the models whose remainder takes the one-draw step by default (``--report-pairs`` applies)
ONEDRAW = ("bnn_wine", "bnn_digits")


def normal_means(x):
    with pyro.plate("groups", x.shape[0]):
        mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 5.0))
        with pyro.plate("obs", x.shape[1]):
            pyro.sample("x", dist.Normal(mu, 1.0), obs=x.mT)


def normal_means_data(dtype):
    g = torch.Generator().manual_seed(1)
    mu = 4.0 * torch.randn(4, 1, generator=g, dtype=torch.float64)
    return ((mu + torch.randn(4, 8, generator=g, dtype=torch.float64)).to(dtype),)


def _bound(model, guide, args):
    with torch.no_grad():
        v = torch.tensor(
            [Trace_ELBO(num_particles=10).loss(model, guide, *args) for _ in range(20)],
            dtype=torch.float64,
        )
    return float(v.mean()), float(v.std() / math.sqrt(len(v)))


def run(name, max_steps, extra, seed=0, report_pairs=0):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    if name == "normal_means_adam":
        model, args = normal_means, normal_means_data(torch.float32)
        guide = AutoNormal(model)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    else:
        make, data = MODELS[name]
        model, args = make(), data(torch.float32)
        pairs = report_pairs and name in ONEDRAW
        step = Remainder(step=Horizon(report_pairs=report_pairs)) if pairs else "auto"
        guide = AutoCVI(model, remainder=step)
        svi = SVI(model, guide, CVI(), CVI_ELBO())
    losses, first, at_first, rep = [], None, None, None
    for step in range(max_steps):
        losses.append(float(svi.step(*args)))
        if first is None and (step + 1) % 50 == 0:
            r = convergence_report(losses)
            if r.converged:
                first, at_first, rep = step + 1, _bound(model, guide, args), r
        if first is not None and step + 1 >= first + extra:
            break
    late = _bound(model, guide, args)
    row = {
        "model": name,
        "seed": seed,
        "report_pairs": report_pairs,
        "first_true": first,
        "bound_at_first": at_first,
        "steps_run": len(losses),
        "bound_at_end": late,
        "tol": None if rep is None else rep.tol,
        "noise": None if rep is None else rep.noise,
    }
    print(json.dumps(row), flush=True)
    return row


def verdict(rows) -> str:
    """Per model: the check said True, and the steps after it gained less than its tolerance
    (a right True), more (a premature one), or it never said True."""
    parts = []
    for r in rows:
        if r["first_true"] is None:
            parts.append(f"{r['model']}: never converged in {r['steps_run']} steps")
            continue
        gain = r["bound_at_first"][0] - r["bound_at_end"][0]
        right = gain <= r["tol"]
        parts.append(
            f"{r['model']}: True at step {r['first_true']}, then {gain:+.2f} nats "
            f"({'within' if right else 'beyond'} its tolerance {r['tol']:.2f})"
        )
    return "; ".join(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="normal_means_adam,bnn_regression,bnn_wine")
    ap.add_argument("--max-steps", type=int, default=4000)
    ap.add_argument("--extra", type=int, default=1000)
    ap.add_argument("--out", default=str(ROOT / "results" / "benchmark_convergence.json"))
    ap.add_argument(
        "--report-pairs",
        type=int,
        default=0,
        help="AutoCVI's Horizon(report_pairs=N) where the one-draw step is taken",
    )
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="the conjugate model, 600 + 200 steps")
    a = ap.parse_args(argv)
    if a.quick:
        a.models, a.max_steps, a.extra = "normal_means_adam", 600, 200
    torch.set_num_threads(1)
    rows = []
    for name in a.models.split(","):
        for seed in range(a.seeds):
            rows.append(run(name, a.max_steps, a.extra, seed, a.report_pairs))
            text = verdict(rows)
            write_results(
                a.out,
                {"rows": rows},
                title="The convergence check: when it says True, and the bound after",
                verdict=text,
                command="python scripts/benchmark_convergence.py" + (" --quick" if a.quick else ""),
                quick=a.quick,
            )
    print("verdict:", verdict(rows))


if __name__ == "__main__":
    main()
