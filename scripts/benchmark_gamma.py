"""Gamma-model benchmark: mean-field CVI versus the paper's Adam baseline (Khan & Lin 2017, Fig. 1).

Two non-conjugate models with Gamma posteriors (``bench.gamma_models``):

* ``pmf``: Poisson-gamma matrix factorisation (Appendix K) of scikit-learn's digits (1797 x 64
  counts), K factors; 20% of the entries are held out; metric: their mean Poisson
  log-likelihood at the posterior-mean rates.
* ``gfm``: the gamma factor model (Appendix J), ``y ~ N(0, Z Z^T + 0.1 I)``, on synthetic data;
  metric: the mean held-out log-likelihood at the posterior mean of ``Z``.

Methods, from the same initial posterior means:

* ``cvi``: ``SVI(model, AutoCVI(model), CVI(step_size), CVI_ELBO())``: exact prior messages,
  Monte Carlo likelihood messages (implicit reparameterisation + Fisher solve, Appendix F),
  a constant step size (the paper's choice), run with several random seeds (the Monte Carlo
  noise decides when a run leaves a plateau, so one seed is not a measurement);
* ``cvi+avg`` (Poisson MF only): the same with an exponential moving average of the natural
  parameters (iterate averaging), reported separately because it is not the paper's CVI;
* ``adam``: Pyro SVI, ``Trace_ELBO``, Adam on softplus-transformed Gamma parameters (the
  paper's baseline), the best of a learning-rate grid.

Only optimisation steps are timed (the metric is computed at checkpoints, outside the clock).
For each problem: Adam's best held-out metric over the grid and the time its best run took to
first reach it, CVI's time to reach that same metric per seed (median and worst), and the
ratios (Adam's time over CVI's median and over CVI's worst seed). Pyro's argument
validation is off for both, torch uses one thread.

    python scripts/benchmark_gamma.py [--quick] [--problems pmf gfm] [--seed 0]

Writes ``results/benchmark_gamma.json``.
"""

from __future__ import annotations

import argparse
import platform
import time
import warnings

import pyro
import torch
from bench import gamma_models as gm  # noqa: E402
from bench.reporting import (  # noqa: E402
    Table,
    fmt_reach,
    fmt_seconds,
    reach_phrase,
    reached_then_left,
    write_results,
)


def _problem(name: str, seed: int):
    if name == "pmf":
        K = 10
        X, train, test = gm.load_digits_counts(seed=seed)
        model = gm.poisson_mf_model(K)
        init = gm.random_init({"W": (K, X.shape[1]), "Z": (X.shape[0], K)}, seed=seed + 1)

        def metric(m):
            return gm.poisson_mf_heldout(m["W"], m["Z"], X, test)

        desc = f"digits {tuple(X.shape)}, K={K}, 20% entries held out"
        return model, (X, train), init, metric, desc
    if name == "gfm":
        D, K = 20, 4
        Y, Y_test, _ = gm.synthetic_gamma_factor(N=2000, N_test=1000, D=D, K=K, seed=seed)
        model = gm.gamma_factor_model(D, K)
        init = gm.random_init({"Z": (D, K)}, seed=seed + 1)

        def metric(m):
            return gm.gamma_factor_heldout(m["Z"], Y_test)

        desc = f"synthetic N=2000 (+1000 test), D={D}, K={K}"
        return model, (Y,), init, metric, desc
    raise ValueError(name)


SETTINGS = {
    # CVI: step-size schedule and Monte Carlo samples; Adam: learning-rate grid
    "pmf": dict(
        cvi_step=0.3,
        cvi_seeds=(0, 1, 2, 3),
        cvi_avg_step=0.3,
        cvi_avg_decay=0.98,
        cvi_samples=1,
        cvi_iters=1200,
        adam_lrs=(0.03, 0.1, 0.3, 1.0),
        adam_iters=2000,
    ),
    "gfm": dict(
        cvi_step=0.3,
        cvi_seeds=(0, 1, 2),
        cvi_samples=4,
        cvi_iters=600,
        adam_lrs=(0.01, 0.03, 0.1, 0.3),
        adam_iters=2000,
    ),
}
QUICK = {
    "pmf": dict(cvi_iters=300, adam_iters=600, adam_lrs=(0.1, 0.3), cvi_seeds=(0, 1)),
    "gfm": dict(cvi_iters=150, adam_iters=400, adam_lrs=(0.03, 0.1), cvi_seeds=(0, 1)),
}


def _levels(adam, cvi, fractions=(0.25, 0.5, 0.75, 1.0)):
    """Time-to-metric at several levels of Adam's own progress: (level, t_adam, t_cvi)."""
    out = []
    for f in fractions:
        i = max(0, int(round(f * len(adam.metric))) - 1)
        level = max(adam.metric[: i + 1])
        out.append(
            {
                "fraction_of_adam_run": f,
                "metric": level,
                "adam_seconds": adam.time_to(level),
                "cvi_seconds": cvi.time_to(level),
            }
        )
    return out


def run_problem(name: str, seed: int, quick: bool):
    cfg = dict(SETTINGS[name])
    if quick:
        cfg.update(QUICK[name])
    model, args, init, metric, desc = _problem(name, seed)
    every = max(5, cfg["adam_iters"] // 60)
    adam = {}
    for lr in cfg["adam_lrs"]:
        pyro.set_rng_seed(seed)
        h, _ = gm.run_adam(
            model,
            args,
            init,
            metric,
            lr=lr,
            iters=cfg["adam_iters"],
            every=every,
            name=f"adam lr={lr}",
        )
        adam[lr] = h
        print(
            f"  {name} adam lr={lr:<5} best {h.best():.4f} after {h.seconds[-1]:.1f} s", flush=True
        )
    best_lr = max(adam, key=lambda k: adam[k].best())
    target = adam[best_lr].best()
    t_adam = adam[best_lr].time_to(target)

    def cvi_run(rng_seed, step_size, label, average=None):
        pyro.set_rng_seed(rng_seed)
        run, _ = gm.run_cvi(
            model,
            args,
            init,
            metric,
            iters=cfg["cvi_iters"],
            every=max(5, cfg["cvi_iters"] // 100),
            step_size=step_size,
            num_samples=cfg["cvi_samples"],
            average=average,
            name=label,
        )
        t = run.time_to(target)
        print(
            f"  {name} {label} best {run.best():.4f}; reaches Adam's best at {fmt_seconds(t)}",
            flush=True,
        )
        return run

    runs = [cvi_run(seed + s, cfg["cvi_step"], f"cvi seed={seed + s}") for s in cfg["cvi_seeds"]]
    times = [r.time_to(target) for r in runs]
    reached = sorted(t for t in times if t is not None)
    # median over seeds (a seed that never reaches the target counts as slower than all)
    # (the upper median for an even number of seeds)
    t_cvi = reached[len(runs) // 2] if len(reached) > len(runs) // 2 else None
    t_worst = max(reached) if len(reached) == len(runs) else None
    ratio = (t_adam / t_cvi) if t_cvi else None
    ratio_worst = (t_adam / t_worst) if t_worst else None
    avg = None
    if cfg.get("cvi_avg_step") is not None:
        # CVI with a constant step and iterate averaging (EMA of the natural parameters)
        avg = cvi_run(seed, cfg["cvi_avg_step"], "cvi+avg", average=cfg["cvi_avg_decay"])
    print(
        f"  {name} cvi over {len(runs)} seeds: reaches Adam's best {target:.4f} at median "
        f"{fmt_seconds(t_cvi)}, worst {fmt_seconds(t_worst)}",
        flush=True,
    )
    return {
        "problem": name,
        "description": desc,
        "target_adam_best": target,
        "adam_best_lr": best_lr,
        "adam_seconds_to_best": t_adam,
        "adam_iters_to_best": adam[best_lr].iters[adam[best_lr].metric.index(target)],
        "cvi_seconds_to_target": t_cvi,
        "cvi_seconds_to_target_per_seed": times,
        "cvi_seconds_to_target_worst": t_worst,
        "cvi_iters_to_target_per_seed": [
            r.iters[r.seconds.index(t)] if t is not None else None for r, t in zip(runs, times)
        ],
        "cvi_best": max(r.best() for r in runs),
        "speedup_adam_over_cvi": ratio,
        "speedup_adam_over_cvi_worst_seed": ratio_worst,
        "time_to_metric_levels": _levels(adam[best_lr], runs[0]),
        "cvi_avg_seconds_to_target": None if avg is None else avg.time_to(target),
        "cvi_avg_best": None if avg is None else avg.best(),
        "speedup_adam_over_cvi_avg": (
            None if avg is None or not avg.time_to(target) else t_adam / avg.time_to(target)
        ),
        "settings": cfg,
        "histories": {
            h.name: {"iters": h.iters, "seconds": h.seconds, "metric": h.metric, "elbo": h.elbo}
            for h in [*runs, *([avg] if avg is not None else []), *adam.values()]
        },
    }


COLUMNS = [
    ("problem", "pmf: Poisson-gamma matrix factorisation of digits; gfm: gamma factor model"),
    (
        "Adam best",
        "the best held-out log-likelihood (per entry, higher is better) that Adam's "
        "best learning rate reached: the target CVI has to reach",
    ),
    ("lr", "Adam's best learning rate of the grid"),
    ("Adam s", "seconds Adam's best run took to first reach its best"),
    (
        "CVI s med",
        "median over CVI's seeds of the seconds to reach Adam's best ('never': fewer "
        "than half of the seeds reached it)",
    ),
    ("Adam/CVI", "Adam s / CVI s med: how many times faster CVI reaches Adam's best"),
    ("worst s", "the slowest CVI seed's seconds to reach it ('never': some seed did not)"),
    ("Adam/worst", "Adam s / worst s"),
    ("CVI best", "the best held-out log-likelihood any CVI seed reached"),
    (
        "CVI+avg s",
        "seconds for CVI with iterate averaging to reach Adam's best (pmf only; '-': not run)",
    ),
    ("Adam/avg", "Adam s / CVI+avg s"),
]


def _ratio(r):
    return f"{r:.1f}x" if r else "-"


def _table(rows) -> Table:
    table = Table("Gamma models: CVI against Adam on the held-out log-likelihood", COLUMNS)
    for r in rows:
        avg = r["cvi_avg_seconds_to_target"]
        table.add(
            r["problem"],
            f"{r['target_adam_best']:.4f}",
            f"{r['adam_best_lr']:g}",
            f"{r['adam_seconds_to_best']:.2f}",
            fmt_reach(r["cvi_seconds_to_target"], ".2f"),
            _ratio(r["speedup_adam_over_cvi"]),
            fmt_reach(r["cvi_seconds_to_target_worst"], ".2f"),
            _ratio(r["speedup_adam_over_cvi_worst_seed"]),
            f"{r['cvi_best']:.4f}",
            "-" if r["cvi_avg_best"] is None else fmt_reach(avg, ".2f"),
            _ratio(r["speedup_adam_over_cvi_avg"]),
        )
        target = r["target_adam_best"]
        for name, h in r["histories"].items():
            left = reached_then_left(h["metric"], target, higher_is_better=True)
            table.note(f"{r['problem']} {name}", left)
        table.plot(
            "seconds (optimisation steps)",
            "held-out log-likelihood (higher is better)",
            {name: list(zip(h["seconds"], h["metric"])) for name, h in r["histories"].items()},
            logx=True,
            title=f"{r['problem']}: {r['description']}",
        )
    return table


def _verdict(rows) -> str:
    parts = []
    for r in rows:
        seeds = len(r["cvi_seconds_to_target_per_seed"])
        cvi = reach_phrase(f"CVI (median of {seeds} seeds)", r["cvi_seconds_to_target"])
        cvi = cvi.replace("the target", "Adam's best held-out log-likelihood").replace(
            "did not reach it", "did not reach Adam's best held-out log-likelihood"
        )
        adam = f"Adam's best run took {r['adam_seconds_to_best']:.3g} s to reach it"
        ratio = r["speedup_adam_over_cvi"]
        parts.append(f"{r['problem']}: {cvi}; {adam}" + (f" ({ratio:.1f}x)" if ratio else ""))
    return "Verdict: " + "; ".join(parts) + "."


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", nargs="+", default=["pmf", "gfm"])
    parser.add_argument("--quick", action="store_true", help="small budgets (a smoke test)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/benchmark_gamma.json")
    opts = parser.parse_args()

    torch.set_num_threads(1)
    pyro.enable_validation(False)
    warnings.filterwarnings("ignore", message=".*shrunk.*")
    t0 = time.time()
    rows = [run_problem(p, opts.seed, opts.quick) for p in opts.problems]

    _table(rows).print()
    print("\ntime to reach intermediate levels of Adam's best run (Adam s / CVI s, first seed):")
    for r in rows:
        cells = []
        for lv in r["time_to_metric_levels"]:
            tc = lv["cvi_seconds"]
            cells.append(f"{lv['metric']:.4f}: {lv['adam_seconds']:.1f}/{fmt_reach(tc, '.1f')}")
        print(f"  {r['problem']:6s} " + "  ".join(cells))
    meta = {
        "torch": torch.__version__,
        "pyro": pyro.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "quick": opts.quick,
        "seed": opts.seed,
        "wall_seconds": time.time() - t0,
    }
    verdict = _verdict(rows)
    write_results(
        opts.out,
        {"meta": meta, "results": rows},
        title="Gamma models: mean-field CVI against Adam",
        verdict=verdict,
        tables=[_table(rows)],
        command="python scripts/benchmark_gamma.py" + (" --quick" if opts.quick else ""),
        quick=opts.quick,
        text="Khan & Lin (2017), Fig. 1: Poisson-gamma matrix factorisation and the gamma "
        "factor model. CVI: exact prior messages, Monte Carlo likelihood messages, a constant "
        "step, several seeds. Adam: Pyro SVI on softplus Gamma parameters, best of a grid.",
    )
    print(verdict)


if __name__ == "__main__":
    main()
