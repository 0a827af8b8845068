"""Long-run stability: Monte Carlo CVI for logistic regression in float32 versus float64.

Runs ``--steps`` (default 10,000) CVI steps with Monte Carlo gradients (eq. 29) on breast-cancer
(scikit-learn's bundled copy, no download) in both precisions from the same seed, and reports
whether any loss or parameter became non-finite, how many steps were shrunk, and the final
-ELBO (exact, by quadrature in float64) of each run. Prints a table and writes
``results/stability_float32.json``.

    python scripts/stability_float32.py [--steps 10000] [--samples 4] [--step-size 0.05]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import pyro
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks/
from benchmarks.baselines import logreg_neg_elbo, make_logreg_model  # noqa: E402
from benchmarks.datasets import load_breast_cancer_sklearn  # noqa: E402


def run(dtype: torch.dtype, steps: int, samples: int, beta: float) -> dict:
    data = load_breast_cancer_sklearn(dtype=torch.float64)
    X, y = data.X_train.to(dtype), data.y_train.to(dtype)
    model = make_logreg_model(data.prior_precision)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model, num_samples=samples)
    svi = SVI(model, guide, CVI(step_size=beta), loss=CVI_ELBO())
    losses, nonfinite, t0 = [], 0, time.perf_counter()
    for _ in range(steps):
        loss = svi.step(X, y)
        nonfinite += not math.isfinite(loss)
        losses.append(loss)
    seconds = time.perf_counter() - t0
    q = guide.posterior("w")
    params_finite = all(bool(torch.isfinite(p).all()) for p in guide.natural_params().values())
    exact = float(
        logreg_neg_elbo(
            data.X_train,
            data.y_train,
            q.loc.double(),
            q.covariance_matrix.double(),
            data.prior_precision,
        )
    )
    tail = losses[-500:]
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "steps": steps,
        "seconds": seconds,
        "nonfinite_losses": nonfinite,
        "params_finite": params_finite,
        "num_shrunk": guide.num_shrunk,
        "num_rejected": guide.num_rejected,
        "final_neg_elbo_float64_eval": exact,
        "mean_reported_loss_last_500": sum(tail) / len(tail),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=4, help="Monte Carlo samples per step")
    parser.add_argument("--step-size", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="results/stability_float32.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [
        run(dt, args.steps, args.samples, args.step_size) for dt in (torch.float32, torch.float64)
    ]
    print(
        f"{'dtype':8s} {'steps':>6s} {'s':>7s} {'NaN':>4s} {'valid':>6s} {'shrunk':>6s} "
        f"{'-ELBO (f64 eval)':>17s}"
    )
    for r in rows:
        print(
            f"{r['dtype']:8s} {r['steps']:6d} {r['seconds']:7.1f} {r['nonfinite_losses']:4d} "
            f"{str(r['params_finite']):>6s} {r['num_shrunk']:6d} "
            f"{r['final_neg_elbo_float64_eval']:17.4f}"
        )
    diff = rows[0]["final_neg_elbo_float64_eval"] - rows[1]["final_neg_elbo_float64_eval"]
    print(f"float32 - float64 final -ELBO: {diff:+.4f} nat")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": rows, "difference": diff, "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
