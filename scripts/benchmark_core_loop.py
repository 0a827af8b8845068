"""The core loop's cost: ``AutoCVI`` + ``CVI`` against the same algorithm in a plain torch loop.

Bayesian logistic regression (``w ~ N(0, I / delta)``, Gaussian ``q``), CPU seconds of the
process (``time.process_time``), one torch thread, float64, every method in one run:

* ``plain step b``: :func:`bench.baselines.plain_cvi_logreg`, Algorithm 1 from ``q`` = prior in a
  lean loop (per step one ``X^T W X``, one Cholesky, quadrature): the floor. Run at several
  constant steps; its best is the one to beat. ``plain (Newton start) step b``: the same from
  the sites of a Newton step at ``w = 0`` (``AutoCVI``'s start where the prior is flat: on the
  covtype-sized problem, prior variance 500, the loop diverges from ``q`` = prior).
* ``AutoCVI step b``: ``SVI(model, AutoCVI(model), CVI(step_size=b), CVI_ELBO())`` as a user
  writes it; ``AutoCVI default``: the same with the default ``CVI()`` (the adaptive step).
  Their set-up (``AutoCVI(model)`` and its first call: tracing, probing, the analysis, the warm
  start of the sites) is timed and added.

``q`` is scored after every step by the exact -ELBO (32-point Gauss-Hermite, outside the clock);
the target is the best -ELBO any run reached; "to target" is the CPU time until ``q`` is within
0.5 nat of it. Problems: a1a (the paper's protocol, prior precision 2.8072) and a covtype-sized
synthetic problem (``scripts/benchmark_scale.py``'s rows: ``--covtype-rows`` x 54, prior
precision 0.002).

    python scripts/benchmark_core_loop.py            # a1a and 581,012 covtype rows
    python scripts/benchmark_core_loop.py --quick    # a1a and 50,000 rows; results/quick/

Writes ``results/benchmark_core_loop.json`` (``--quick``: ``results/quick/``).
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Dict, List, Optional

import pyro
import torch
from bench.baselines import logreg_neg_elbo, make_logreg_model, plain_cvi_logreg, warm_up
from bench.datasets import load_logreg
from bench.reporting import Table, fmt, fmt_reach, write_results

TOL = 0.5


def run_plain(X, y, delta: float, step: float, iters: int, newton: bool = False) -> dict:
    c0 = time.process_time()
    init = (y - 0.5, torch.tensor(-0.125)) if newton else None
    fit = plain_cvi_logreg(
        X, y, delta, step, iters, return_covariance=False, clock=time.process_time,
        init_sites=init,
    )  # fmt: skip
    total = time.process_time() - c0
    hist = [(p.iteration, p.seconds, p.neg_elbo) for p in fit.history]
    return dict(history=hist, setup_cpu=0.0, cpu_per_step=total / max(iters, 1))


def run_api(X, y, delta: float, step, iters: int) -> dict:
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI

    model = make_logreg_model(delta)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    c0 = time.process_time()
    guide = AutoCVI(model)
    guide(X, y)
    setup = time.process_time() - c0
    svi = SVI(model, guide, CVI() if step is None else CVI(step_size=step), loss=CVI_ELBO())

    def score() -> float:
        with torch.no_grad():
            q = guide.posterior("w")
            return float(logreg_neg_elbo(X, y, q.loc, None, delta, scale_tril=q.scale_tril))

    hist, cpu = [(0, 0.0, score())], 0.0
    for t in range(1, iters + 1):
        c = time.process_time()
        svi.step(X, y)
        cpu += time.process_time() - c
        hist.append((t, cpu, score()))
    return dict(history=hist, setup_cpu=setup, cpu_per_step=cpu / iters)


def _to_target(run: dict, target: float) -> Optional[tuple]:
    for it, sec, v in run["history"]:
        if v <= target + TOL:
            return it, sec + run["setup_cpu"]
    return None


COLUMNS = [
    ("method", "plain: the plain-torch loop at a constant step; AutoCVI: the public API"),
    ("steps->tgt", "steps until q is within 0.5 nat of the best -ELBO of any run"),
    ("cpu s->tgt", "CPU seconds until then, set-up included"),
    ("setup cpu s", "CPU seconds of AutoCVI's set-up (tracing, probing, analysis, warm start)"),
    ("cpu ms/step", "CPU milliseconds per step (plain: its whole loop / steps)"),
    ("final -ELBO", "exact -ELBO of the last q"),
]


def benchmark(name, X, y, delta: float, plain_steps, newton_steps, api_steps, iters: int) -> dict:
    print(f"\n== {name}: N={X.shape[0]}, D={X.shape[1]}, delta={delta:g} ==", flush=True)
    runs: Dict[str, dict] = {}
    for b in plain_steps:
        runs[f"plain step {b:g}"] = run_plain(X, y, delta, b, iters)
    for b in newton_steps:
        runs[f"plain (Newton start) step {b:g}"] = run_plain(X, y, delta, b, iters, True)
    for b in api_steps:
        runs["AutoCVI default" if b is None else f"AutoCVI step {b:g}"] = run_api(
            X, y, delta, b, iters
        )
    target = min(v for r in runs.values() for _, _, v in r["history"])
    table = Table(f"{name}: best -ELBO {target:.3f}; target +{TOL} nat", COLUMNS)
    for key, r in runs.items():
        hit = _to_target(r, target)
        r["steps_to_target"], r["cpu_to_target"] = hit if hit else (None, None)
        table.add(
            key,
            fmt_reach(r["steps_to_target"], "d"),
            fmt_reach(r["cpu_to_target"], ".3f"),
            fmt(r["setup_cpu"] if key.startswith("AutoCVI") else None, ".3f"),
            f"{1e3 * r['cpu_per_step']:.2f}",
            f"{r['history'][-1][2]:.3f}",
        )
    plain = {k: r for k, r in runs.items() if k.startswith("plain")}
    best_key = min(
        (k for k in plain if plain[k]["cpu_to_target"] is not None),
        key=lambda k: plain[k]["cpu_to_target"],
        default=None,
    )
    ratios: Dict[str, Optional[float]] = {}
    for key, r in runs.items():
        if key.startswith("AutoCVI") and best_key and r["cpu_to_target"] is not None:
            ratios[f"{key} / best plain ({best_key})"] = (
                r["cpu_to_target"] / plain[best_key]["cpu_to_target"]
            )
            same = key.replace("AutoCVI", "plain")
            if same not in plain or plain[same]["cpu_to_target"] is None:
                same = key.replace("AutoCVI", "plain (Newton start)")
            if same in plain:
                ratios[f"{key} / {same}, per step"] = (
                    r["cpu_per_step"] / plain[same]["cpu_per_step"]
                )
                if plain[same]["cpu_to_target"] is not None:
                    ratios[f"{key} / {same}, to target"] = (
                        r["cpu_to_target"] / plain[same]["cpu_to_target"]
                    )
    for key, value in ratios.items():
        table.ratio(key, value, "CPU seconds, set-up included for AutoCVI")
    table.print()
    return dict(
        N=X.shape[0], D=X.shape[1], delta=delta, target=target, runs=runs, ratios=ratios,
        best_plain=best_key, table=table,
    )  # fmt: skip


def main(argv: Optional[List[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="50,000 covtype rows; results/quick")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--covtype-rows", type=int, default=None)
    ap.add_argument("--parts", nargs="+", default=["a1a", "covtype"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = args.covtype_rows or (50_000 if args.quick else 581_012)
    out = args.out or (
        "results/quick/benchmark_core_loop.json"
        if args.quick
        else "results/benchmark_core_loop.json"
    )
    torch.set_num_threads(1)
    warm_up()
    results, tables = {}, []
    if "a1a" in args.parts:
        d = load_logreg("a1a", args.data_dir)
        r = benchmark(
            "a1a", d.X_train, d.y_train, d.prior_precision,
            [0.4 / 1.4, 0.4, 0.6, 0.8, 1.0], [0.4, 1.0], [0.4, 1.0, None], 30,
        )  # fmt: skip
        tables.append(r.pop("table"))
        results["a1a"] = r
    if "covtype" in args.parts:
        from benchmark_scale import DELTA, dataset

        X, y = dataset(rows)
        r = benchmark(
            f"covtype-sized ({rows:,} rows)", X, y, DELTA, [], [0.5, 1.0], [1.0, None], 12
        )
        tables.append(r.pop("table"))
        results["covtype"] = r
    verdict = "; ".join(
        f"{k}: " + ", ".join(f"{n} = {v:.2f}" for n, v in r["ratios"].items())
        for k, r in results.items()
    )
    cfg = dict(
        threads=1, dtype="float64", device="cpu", clock="process CPU seconds",
        covtype_rows=rows, torch=torch.__version__, pyro=pyro.__version__,
        python=platform.python_version(),
    )  # fmt: skip
    write_results(
        out,
        {"config": cfg, "problems": results},
        title="The core loop: AutoCVI + CVI against the plain-torch loop (CPU seconds)",
        verdict="Verdict: " + verdict + ".",
        tables=tables,
        command="python scripts/benchmark_core_loop.py" + (" --quick" if args.quick else ""),
        quick=args.quick,
        text="Logistic regression, full-covariance Gaussian q; time to within 0.5 nat of the "
        "best -ELBO, CPU seconds of one process on one thread, set-up included.",
    )
    print("Verdict: " + verdict + ".")
    return results


if __name__ == "__main__":
    main()
