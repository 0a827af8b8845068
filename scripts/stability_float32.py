"""Long-run stability: Monte Carlo CVI for logistic regression in float32 versus float64.

Runs ``--steps`` (default 10,000) CVI steps with Monte Carlo gradients (eq. 29) on breast-cancer
(scikit-learn's bundled copy, no download) in both precisions from the same seed, and reports
whether any loss or parameter became non-finite, how many steps were shrunk, and the final
-ELBO (exact, by quadrature in float64) of each run. Prints a table and writes
``results/stability_float32.json``.

    python scripts/stability_float32.py [--steps 10000] [--samples 4] [--step-size 0.05]
    python scripts/stability_float32.py --quick     # 1,000 steps per precision (a smoke run)
"""

from __future__ import annotations

import argparse
import math
import time

import pyro
import torch
from bench.baselines import logreg_neg_elbo, make_logreg_model  # noqa: E402
from bench.datasets import load_breast_cancer_sklearn  # noqa: E402
from bench.reporting import Table, progress, write_results  # noqa: E402
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

COLUMNS = [
    ("dtype", "the precision of the data, q and every CVI computation"),
    ("steps", "CVI steps with Monte Carlo gradients (eq. 29)"),
    ("s", "seconds for all steps"),
    ("NaN", "steps whose reported loss was NaN or infinite (0 is the requirement)"),
    ("valid", "whether every natural parameter was finite at the end"),
    ("shrunk", "steps shrunk to keep the precision positive definite (guide.num_shrunk)"),
    ("-ELBO (f64 eval)", "the final q's -ELBO, computed exactly (quadrature) in float64"),
]


def run(dtype: torch.dtype, steps: int, samples: int, beta: float) -> dict:
    data = load_breast_cancer_sklearn(dtype=torch.float64)
    X, y = data.X_train.to(dtype), data.y_train.to(dtype)
    model = make_logreg_model(data.prior_precision)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model, num_samples=samples)
    svi = SVI(model, guide, CVI(step_size=beta), loss=CVI_ELBO())
    losses, nonfinite, t0 = [], 0, time.perf_counter()
    name = str(dtype).replace("torch.", "")
    for _ in progress(range(steps), f"CVI {name}", mininterval=0.5):
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
    parser.add_argument("--steps", type=int, default=None, help="default 10,000 (1,000 quick)")
    parser.add_argument("--quick", action="store_true", help="1,000 steps (a smoke run)")
    parser.add_argument("--samples", type=int, default=4, help="Monte Carlo samples per step")
    parser.add_argument("--step-size", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="results/stability_float32.json")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 1_000 if args.quick else 10_000
    torch.set_num_threads(args.threads)
    rows = [
        run(dt, args.steps, args.samples, args.step_size) for dt in (torch.float32, torch.float64)
    ]
    table = Table(
        f"Monte Carlo CVI on breast-cancer, {args.steps} steps, step size {args.step_size}",
        COLUMNS,
    )
    for r in rows:
        table.add(
            r["dtype"],
            str(r["steps"]),
            f"{r['seconds']:.1f}",
            str(r["nonfinite_losses"]),
            str(r["params_finite"]),
            str(r["num_shrunk"]),
            f"{r['final_neg_elbo_float64_eval']:.4f}",
        )
    diff = rows[0]["final_neg_elbo_float64_eval"] - rows[1]["final_neg_elbo_float64_eval"]
    table.ratio(
        "float32 - float64 final -ELBO",
        diff,
        "nats; Monte Carlo noise alone moves the final -ELBO by a few hundredths",
    )
    table.print()
    healthy = all(r["nonfinite_losses"] == 0 and r["params_finite"] for r in rows)
    verdict = (
        f"Verdict: after {args.steps} Monte Carlo CVI steps "
        + (
            "neither precision produced a NaN or an invalid parameter"
            if healthy
            else "a precision produced a NaN or an invalid parameter (see the table)"
        )
        + f", and float32 ended {abs(diff):.3f} nat "
        + ("above" if diff > 0 else "below")
        + " float64."
    )
    write_results(
        args.out,
        {"runs": rows, "difference": diff, "args": vars(args)},
        title="Long-run stability: float32 against float64",
        verdict=verdict,
        tables=[table],
        command="python scripts/stability_float32.py" + (" --quick" if args.quick else ""),
        quick=args.quick,
    )
    print(verdict)


if __name__ == "__main__":
    main()
