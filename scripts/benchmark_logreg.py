"""Bayesian logistic regression benchmark: CVI through the Pyro API versus Pyro Adam and plain CVI.

The protocol of ``shared/data/README.md`` (the paper's Table 3 datasets): prior
``w ~ N(0, I / delta)``, Gaussian ``q``; the -ELBO of ``q`` on the training set and the test
log-loss (bits) by Gauss-Hermite quadrature. Methods, side by side on each dataset:

* ``cvi_api``: ``SVI(model, AutoCVI(model), CVI(step_size), CVI_ELBO())`` as a user would run it:
  exact (quadrature) gradients, the default start (sites at the prior mean's curvature) and
  ``--api-step`` (default 1.0); its time to the target is also reported with the guide's
  set-up (tracing and probing the model) included.
* ``cvi_api_prior``: ``AutoCVI(model, init_sites="prior")`` (Algorithm 1's start, ``q`` = the
  prior) with the paper's step size ``beta = w / (1 + w)`` (Table 2): the same iterates as
  ``plain_cvi``, so the pair measures the framework's overhead.
* ``plain_cvi``: :func:`bench.baselines.plain_cvi_logreg`, the same algorithm in a lean
  plain-torch loop: the floor for the framework's overhead.
* ``adam``: Pyro SVI, ``AutoMultivariateNormal``, ``Trace_ELBO`` (one particle by default),
  ``pyro.optim.Adam``: the best of a small learning-rate grid (the first to reach the target,
  else the lowest final -ELBO); every rate runs until ``--adam-iters`` steps or the time cap.

Only optimisation steps are timed; ``q`` is snapshotted at checkpoints and scored afterwards.
The converged -ELBO of a dataset is the best any method reaches; each method's iterations and
seconds to get within 0.5 nat of it are reported, with the ratios Adam / CVI and CVI / plain.

    python scripts/benchmark_logreg.py [--data-dir DIR] [--datasets a1a australian] [--quick]

Writes ``results/benchmark_logreg.json``.
"""

from __future__ import annotations

import argparse
import inspect
import platform
import time
from typing import Dict, List, Optional

import pyro
import torch
from bench.baselines import (  # noqa: E402
    LogRegFit,
    evaluate_checkpoints,
    make_logreg_model,
    plain_cvi_logreg,
    pyro_adam_logreg,
    run_svi_checkpoints,
    time_to_target,
    warm_up,
)
from bench.datasets import LogRegData, load_logreg  # noqa: E402
from bench.reporting import (  # noqa: E402
    Table,
    absurd_value,
    fmt,
    fmt_reach,
    reach_phrase,
    reached_then_left,
    write_results,
)

DATASETS = ["a1a", "australian", "breast-cancer", "colon-cancer"]
#: The paper's step sizes (Table 2): beta = w / (1 + w).
PAPER_W = {"a1a": 0.4, "australian": 0.4, "breast-cancer": 0.3, "colon-cancer": 0.3}
TOL = 0.5  # nats


def _beta(name: str) -> float:
    w = PAPER_W.get(name, 0.4)
    return w / (1.0 + w)


class _CPUTimedSVI:
    """``svi`` whose ``step`` adds its process CPU seconds to ``cpu``."""

    def __init__(self, svi):
        self.svi, self.cpu = svi, 0.0

    def step(self, *args, **kwargs):
        c0 = time.process_time()
        try:
            return self.svi.step(*args, **kwargs)
        finally:
            self.cpu += time.process_time() - c0


def run_plain(data: LogRegData, num_iters: int) -> LogRegFit:
    c0 = time.process_time()
    fit = plain_cvi_logreg(
        data.X_train, data.y_train, data.prior_precision, _beta(data.name), num_iters
    )
    fit.extra["cpu_seconds"] = time.process_time() - c0  # (the loop and V formed once)
    return fit


def run_cvi_api(
    data: LogRegData,
    num_iters: int,
    init_sites: Optional[str] = None,
    beta: Optional[float] = None,
) -> LogRegFit:
    """CVI through the public API. The set-up (``AutoCVI(model)`` and its first call, which
    traces and probes the model) is timed separately, so it can be added to the step time."""
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI
    from pyro_cvi.step_sizes import paper

    X, y, delta = data.X_train, data.y_train, data.prior_precision
    model = make_logreg_model(delta)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    kwargs = {} if init_sites is None else {"init_sites": init_sites}
    t0, c0 = time.perf_counter(), time.process_time()
    guide = AutoCVI(model, **kwargs)
    guide(X, y)
    setup, setup_cpu = time.perf_counter() - t0, time.process_time() - c0
    step = beta if beta is not None else paper(PAPER_W.get(data.name, 0.4))
    svi = _CPUTimedSVI(SVI(model, guide, CVI(step_size=step), loss=CVI_ELBO()))

    def snapshot():
        q = guide.posterior("w")
        return q.loc, None, q.scale_tril

    checkpoints, losses = run_svi_checkpoints(svi, (X, y), num_iters, snapshot, 1)
    history = evaluate_checkpoints(checkpoints, X, y, delta)
    last = checkpoints[-1]
    cov = last.scale_tril @ last.scale_tril.T
    extra = {"setup_seconds": setup, "losses": losses, "explain": guide.explain()}
    extra.update(setup_cpu_seconds=setup_cpu, cpu_seconds=svi.cpu)
    return LogRegFit(last.loc, cov, history, checkpoints, extra, scale_tril=last.scale_tril)


def run_adam(
    data: LogRegData, lrs: List[float], num_iters: int, time_limit: float, particles: int
) -> Dict[float, LogRegFit]:
    X, y, delta = data.X_train, data.y_train, data.prior_precision
    every = 10 if X.shape[1] <= 200 else 5
    fits = {}
    for lr in lrs:
        fits[lr] = pyro_adam_logreg(
            make_logreg_model(delta),
            X,
            y,
            lr,
            num_iters,
            prior_precision=delta,
            num_particles=particles,
            checkpoint_every=every,
            time_limit=time_limit,
            progress=f"{data.name}: Adam lr={lr:g}",
        )
    return fits


def _summary(data: LogRegData, fit: LogRegFit, target: float, setup: float = 0.0) -> dict:
    final = fit.neg_elbo(data.X_train, data.y_train, data.prior_precision)
    log_loss = fit.log_loss_bits(data.X_test, data.y_test)
    hit = time_to_target(fit.history, target, TOL)
    out = {
        "iters_to_target": None if hit is None else hit[0],
        "seconds_to_target": None if hit is None else hit[1],
        "final_neg_elbo": final,
        "best_neg_elbo": min(p.neg_elbo for p in fit.history),
        "test_log_loss_bits": log_loss,
        "total_iters": fit.num_iters,
        "total_seconds": fit.seconds,
        "seconds_per_iter": fit.seconds / max(fit.num_iters, 1),
        "history": [list(p) for p in fit.history],
    }
    if "cpu_seconds" in (fit.extra or {}):
        out["cpu_seconds"] = fit.extra["cpu_seconds"]
        out["cpu_seconds_per_iter"] = fit.extra["cpu_seconds"] / max(fit.num_iters, 1)
    if "setup_cpu_seconds" in (fit.extra or {}):
        out["setup_cpu_seconds"] = fit.extra["setup_cpu_seconds"]
    if setup:
        out["setup_seconds"] = setup
        out["seconds_to_target_incl_setup"] = None if hit is None else hit[1] + setup
    return out


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _best_adam(
    data: LogRegData, fits: Dict[float, LogRegFit], target: float
) -> tuple[float, LogRegFit]:
    def key(item):
        lr, fit = item
        hit = time_to_target(fit.history, target, TOL)
        return (0, hit[1]) if hit is not None else (1, fit.history[-1].neg_elbo)

    return min(fits.items(), key=key)


def benchmark_dataset(data: LogRegData, args, api_ok: bool, api_prior: bool) -> dict:
    N, D = data.X_train.shape
    fits: Dict[str, LogRegFit] = {}
    setups: Dict[str, float] = {}
    print(
        f"\n== {data.name}: N={N}, D={D}, delta={data.prior_precision:g}, "
        f"beta={_beta(data.name):.4f} ==",
        flush=True,
    )
    fits["plain_cvi"] = run_plain(data, args.cvi_iters)
    if api_ok:
        try:
            fits["cvi_api"] = run_cvi_api(data, args.cvi_iters, beta=args.api_step)
            setups["cvi_api"] = fits["cvi_api"].extra["setup_seconds"]
            if api_prior:
                fits["cvi_api_prior"] = run_cvi_api(data, args.cvi_iters, init_sites="prior")
                setups["cvi_api_prior"] = fits["cvi_api_prior"].extra["setup_seconds"]
        except Exception as e:  # report and carry on with the baselines
            print(f"   CVI through the Pyro API failed: {type(e).__name__}: {e}")
    adam_fits = run_adam(data, args.adam_lrs, args.adam_iters, args.adam_time, args.adam_particles)

    all_histories = [f.history for f in fits.values()] + [f.history for f in adam_fits.values()]
    target = min(p.neg_elbo for h in all_histories for p in h)
    best_lr, fits["adam"] = _best_adam(data, adam_fits, target)

    methods = {
        name: _summary(data, fit, target, setups.get(name, 0.0)) for name, fit in fits.items()
    }
    methods["adam"]["lr"] = best_lr
    methods["adam"]["particles"] = args.adam_particles
    adam_grid = {}
    for lr, fit in adam_fits.items():
        s = _summary(data, fit, target)
        s.pop("history")
        adam_grid[str(lr)] = s
    if "cvi_api" in fits:
        methods["cvi_api"]["explain"] = fits["cvi_api"].extra["explain"]

    api = methods.get("cvi_api", {})
    ratios = {
        "adam_over_cvi": _ratio(methods["adam"]["seconds_to_target"], api.get("seconds_to_target")),
        "adam_over_cvi_incl_setup": _ratio(
            methods["adam"]["seconds_to_target"], api.get("seconds_to_target_incl_setup")
        ),
        "cvi_over_plain": _ratio(
            api.get("seconds_to_target"), methods["plain_cvi"]["seconds_to_target"]
        ),
        "cvi_over_plain_per_iter": _ratio(
            api.get("seconds_per_iter"), methods["plain_cvi"]["seconds_per_iter"]
        ),
        "cvi_over_plain_per_iter_cpu": _ratio(
            api.get("cpu_seconds_per_iter"), methods["plain_cvi"].get("cpu_seconds_per_iter")
        ),
        "cvi_over_plain_incl_setup": _ratio(
            api.get("seconds_to_target_incl_setup"), methods["plain_cvi"]["seconds_to_target"]
        ),
    }
    if methods["adam"]["seconds_to_target"] is None and api.get("seconds_to_target"):
        # Adam never got there: its whole run is a lower bound on its time to the target
        ratios["adam_over_cvi_lower_bound"] = (
            methods["adam"]["total_seconds"] / api["seconds_to_target"]
        )
    _table(data.name, target, methods, ratios, adam_grid).print()
    return {
        "N": N,
        "D": D,
        "prior_precision": data.prior_precision,
        "beta": _beta(data.name),
        "target_neg_elbo": target,
        "tolerance_nats": TOL,
        "methods": methods,
        "adam_lr_grid": adam_grid,
        "ratios": ratios,
    }


COLUMNS = [
    (
        "method",
        "cvi_api: AutoCVI + CVI + CVI_ELBO as a user runs it (step --api-step); "
        "cvi_api_prior: the same from q = prior with the paper's step w/(1+w); plain_cvi: the "
        "same algorithm in a plain torch loop (the overhead floor); adam: Pyro's Adam on "
        "AutoMultivariateNormal, the best learning rate of the grid",
    ),
    (
        "iters->tgt",
        "steps until the -ELBO is within 0.5 nat of the best -ELBO any method "
        "reached ('never': not within the run)",
    ),
    ("sec->tgt", "seconds of optimisation steps until then (set-up excluded)"),
    ("+setup", "the same, plus the guide's set-up (tracing and probing the model once)"),
    ("final -ELBO", "-ELBO of the last q on the training set, by quadrature (lower is better)"),
    ("log-loss", "test log-loss in bits per point under the last q (lower is better)"),
    ("iters", "steps run in total (Adam stops at --adam-iters or the --adam-time cap)"),
    ("sec", "seconds of all steps run"),
    ("ms/iter", "milliseconds per step (wall)"),
    (
        "cpu ms/iter",
        "process CPU milliseconds per step (cvi_api: svi.step only; plain_cvi: its "
        "whole loop; '-': not measured)",
    ),
    ("setup cpu s", "process CPU seconds of the guide's set-up"),
]
RATIOS = {
    "adam_over_cvi": "Adam's seconds to the target / cvi_api's (how many times faster CVI is)",
    "adam_over_cvi_incl_setup": "the same with cvi_api's set-up added to its time",
    "cvi_over_plain": "cvi_api's seconds to the target / plain_cvi's (the framework's cost; "
    "below 1 when cvi_api's step 1.0 needs fewer steps than plain_cvi's paper step)",
    "cvi_over_plain_per_iter": "cvi_api's time per step / plain_cvi's (the framework's "
    "overhead per step)",
    "cvi_over_plain_per_iter_cpu": "the same in process CPU seconds (target: <= 1.2)",
    "cvi_over_plain_incl_setup": "cvi_api's seconds to the target with its set-up / "
    "plain_cvi's (target at --api-step 0.4: <= 1.5)",
    "adam_over_cvi_lower_bound": "Adam never reached the target: its whole run / cvi_api's "
    "time to the target (Adam is at least this many times slower)",
}


def _table(name: str, target: float, methods: dict, ratios: dict, grid: dict) -> Table:
    table = Table(
        f"{name}: converged -ELBO {target:.3f} (the best of all methods); target = +{TOL} nat",
        COLUMNS,
    )
    for key, m in methods.items():
        label = key if key != "adam" else f"adam lr={m['lr']:g}"
        table.add(
            label,
            fmt_reach(m["iters_to_target"], "d"),
            fmt_reach(m["seconds_to_target"], ".3f"),
            fmt(m.get("seconds_to_target_incl_setup"), ".3f"),
            f"{m['final_neg_elbo']:.3f}",
            f"{m['test_log_loss_bits']:.4f}",
            str(m["total_iters"]),
            f"{m['total_seconds']:.2f}",
            f"{1e3 * m['seconds_per_iter']:.2f}",
            fmt(
                None if "cpu_seconds_per_iter" not in m else 1e3 * m["cpu_seconds_per_iter"], ".2f"
            ),
            fmt(m.get("setup_cpu_seconds"), ".3f"),
        )
        history = [p[2] for p in m["history"]]
        table.note(label, reached_then_left(history, target, TOL))
        table.note(label, absurd_value(m["final_neg_elbo"], target))
    for lr, g in grid.items():
        bad = absurd_value(g["final_neg_elbo"], target)
        if bad and float(lr) != methods["adam"]["lr"]:
            table.note(f"adam lr={lr} (a worse rate of the grid, not in the table)", bad)
    for key, value in ratios.items():
        table.ratio(key, value, RATIOS.get(key, ""))
    series = {
        (f"adam lr={m['lr']:g}" if k == "adam" else k): [
            (p[1], max(p[2] - target, 1e-3)) for p in m["history"] if p[1] > 0
        ]
        for k, m in methods.items()
    }
    table.plot(
        "seconds (optimisation steps)",
        "-ELBO minus the converged -ELBO (nats)",
        series,
        logx=True,
        logy=True,
        title=name,
    )
    return table


def _verdict(per_dataset: dict, budget: float) -> str:
    parts = []
    for name, r in per_dataset.items():
        api = r["methods"].get("cvi_api", r["methods"]["plain_cvi"])
        adam = r["methods"]["adam"]
        adam_budget = adam["total_seconds"] if adam["seconds_to_target"] is None else None
        parts.append(
            f"{name}: {reach_phrase('CVI', api['seconds_to_target'])}, "
            f"{reach_phrase('Adam', adam['seconds_to_target'], adam_budget)}"
        )
    return "Verdict: " + "; ".join(parts) + "."


def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=None, help="folder of the LIBSVM files")
    parser.add_argument("--datasets", nargs="+", default=DATASETS, choices=DATASETS)
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke test)")
    parser.add_argument("--cvi-iters", type=int, default=None, help="CVI steps (default 100)")
    parser.add_argument("--adam-lrs", type=float, nargs="+", default=[0.01, 0.03, 0.1])
    parser.add_argument("--adam-iters", type=int, default=None, help="max Adam steps per lr")
    parser.add_argument("--adam-time", type=float, default=None, help="time cap per lr (s)")
    parser.add_argument("--adam-particles", type=int, default=1)
    parser.add_argument("--api-step", type=float, default=1.0, help="CVI step of cvi_api")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for every method (default 1: stable timings on shared cores)",
    )
    parser.add_argument("--out", default="results/benchmark_logreg.json")
    args = parser.parse_args(argv)
    if args.cvi_iters is None:
        args.cvi_iters = 30 if args.quick else 100
    if args.adam_iters is None:
        args.adam_iters = 500 if args.quick else 20000
    if args.adam_time is None:
        args.adam_time = 3.0 if args.quick else 30.0
    torch.set_num_threads(args.threads)

    try:
        from pyro_cvi import AutoCVI

        api_ok = True
        api_prior = "init_sites" in inspect.signature(AutoCVI.__init__).parameters
    except ImportError as e:
        print(f"pyro_cvi.AutoCVI is not available ({e}); benchmarking the baselines only")
        api_ok = api_prior = False

    warm_up()
    results = {
        "config": {
            "datasets": args.datasets,
            "quick": args.quick,
            "cvi_iters": args.cvi_iters,
            "adam_lrs": args.adam_lrs,
            "adam_iters": args.adam_iters,
            "adam_time_cap_s": args.adam_time,
            "adam_particles": args.adam_particles,
            "threads": args.threads,
            "tolerance_nats": TOL,
            "torch": torch.__version__,
            "pyro": pyro.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "device": "cpu",
            "dtype": "float64",  # (bench.datasets.load_logreg's default)
            "timing": "optimisation steps only; q scored at checkpoints outside the clock",
        },
        "datasets": {},
    }
    tables = []
    for name in args.datasets:
        data = load_logreg(name, args.data_dir)
        results["datasets"][name] = r = benchmark_dataset(data, args, api_ok, api_prior)
        tables.append(
            _table(name, r["target_neg_elbo"], r["methods"], r["ratios"], r["adam_lr_grid"])
        )

    verdict = _verdict(results["datasets"], args.adam_time)
    print()
    write_results(
        args.out,
        results,
        title="Bayesian logistic regression: CVI against Pyro's Adam",
        verdict=verdict,
        tables=tables,
        command="python scripts/benchmark_logreg.py" + (" --quick" if args.quick else ""),
        quick=args.quick,
        text="Prior N(0, I/delta), full-covariance Gaussian q, the paper's datasets (Table 3). "
        "Adam is the best of the learning rates "
        + ", ".join(f"{lr:g}" for lr in args.adam_lrs)
        + f", each run for up to {args.adam_iters} steps or {args.adam_time:g} s. Device cpu, "
        f"float64, {args.threads} thread(s).",
    )
    print(verdict)
    return results


if __name__ == "__main__":
    main()
