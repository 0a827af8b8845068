"""Expected-precision messages through a Normal scale: Bayesian linear regression with a
non-conjugate noise-scale prior (Uniform, HalfNormal, HalfCauchy, LogNormal), N = 170, 3
predictors and an intercept.

Compares, per prior (CPU time, one thread, the runs alternating in one process):

* ``new``: ``AutoCVI`` + ``CVI()``: the block ``a, b`` takes the rows at ``E_q[1/sigma^2]``
  (closed form for a log-normal ``q(sigma)``, else many draws in one model run);
* ``old``: the same with that classification switched off: the Bonnet/Price message of
  8 draws with a dense Hessian each (the earlier path);
* ``adam``: ``AutoMultivariateNormal`` + Adam + ``Trace_ELBO``, 10x the CVI steps, the best of
  lr 0.01 / 0.03 / 0.1 by final bound.

Every guide is scored by a ``Trace_ELBO`` estimate (``--eval-particles``, not timed) at
checkpoints; "to 0.5" is the CPU time until the estimate is within 0.5 nat of the run's own
final one.

Usage::

    python scripts/benchmark_scale_messages.py --quick
    python scripts/benchmark_scale_messages.py --out results/benchmark_scale_messages.json
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench.reporting import Table, fmt, write_results  # noqa: E402

import pyro_cvi.model.block_factors as block_factors  # noqa: E402
from pyro_cvi import CVI, CVI_ELBO, AutoCVI  # noqa: E402

PRIORS = {
    "uniform": lambda: dist.Uniform(0.0, 10.0),
    "halfnormal": lambda: dist.HalfNormal(2.0),
    "halfcauchy": lambda: dist.HalfCauchy(2.0),
    "lognormal": lambda: dist.LogNormal(0.0, 1.0),
}
SCALE_FACTOR = block_factors.scale_factor


def data(seed=0, n=170):
    pyro.set_rng_seed(seed)
    X = torch.randn(n, 3)
    y = X @ torch.tensor([1.0, -2.0, 0.5]) + 1 + 0.9 * torch.randn(n)
    return X, y


def make_model(prior):
    def model(X, y):
        a = pyro.sample("a", dist.Normal(0.0, 10.0))
        b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        sigma = pyro.sample("sigma", PRIORS[prior]())
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Normal(a + X @ b, sigma), obs=y)

    return model


def score(model, guide, X, y, particles):
    with torch.no_grad():
        return float(Trace_ELBO(num_particles=particles).loss(model, guide, X, y))


def run(kind, prior, steps, every, particles, lr=None):
    """``(cpu per step, [(cpu seconds, -ELBO estimate)], explain line)``."""
    X, y = data()
    model = make_model(prior)
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    block_factors.scale_factor = SCALE_FACTOR if kind == "new" else (lambda *a: None)
    try:
        if kind == "adam":
            guide = AutoMultivariateNormal(model)
            svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())
        else:
            guide = AutoCVI(model)
            svi = SVI(model, guide, CVI(), CVI_ELBO())
        cpu, curve = 0.0, []
        for i in range(1, steps + 1):
            t = time.process_time()
            svi.step(X, y)
            cpu += time.process_time() - t
            if i % every == 0 or i == steps:
                curve.append((cpu, score(model, guide, X, y, particles)))
        line = ""
        if kind != "adam":
            line = next((s.strip() for s in guide.explain().splitlines() if "obs -> a" in s), "")
    finally:
        block_factors.scale_factor = SCALE_FACTOR
    return cpu / steps, curve, line


def to_within(curve, slack=0.5):
    final = curve[-1][1]
    return next(t for t, v in curve if v <= final + slack)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one prior, fewer steps")
    p.add_argument("--out", default="results/benchmark_scale_messages.json")
    p.add_argument("--steps", type=int, default=300, help="CVI steps (Adam: 10x)")
    p.add_argument("--eval-particles", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=2, help="alternating new/old runs")
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    priors = ["halfnormal"] if args.quick else list(PRIORS)
    steps = 60 if args.quick else args.steps
    particles = 200 if args.quick else args.eval_particles
    lrs = [0.03] if args.quick else [0.01, 0.03, 0.1]
    every = max(1, steps // 30)
    table = Table(
        "Regression with a non-conjugate noise scale (N = 170, D = 4)",
        [
            ("prior", "the prior of sigma"),
            ("method", "new: expected-precision rows; old: Bonnet/Price; adam: AutoMVN"),
            ("ms/step", "CPU milliseconds per step (mean of the repeats)"),
            ("to 0.5", "CPU seconds until the estimate is within 0.5 nat of its final one"),
            ("-ELBO", "final Trace_ELBO estimate"),
        ],
    )
    payload = {"steps": steps, "eval_particles": particles, "priors": {}}
    for prior in priors:
        rows = {"new": [], "old": []}
        for _ in range(1 if args.quick else args.repeats):
            for kind in ("new", "old"):  # alternating, same period
                rows[kind].append(run(kind, prior, steps, every, particles))
        adam = {lr: run("adam", prior, 10 * steps, 10 * every, particles, lr) for lr in lrs}
        best_lr = min(adam, key=lambda lr: adam[lr][1][-1][1])
        rec = {}
        for kind, runs in rows.items():
            per = sum(r[0] for r in runs) / len(runs)
            rec[kind] = {
                "ms_per_step": 1e3 * per,
                "to_within_0_5": sum(to_within(r[1]) for r in runs) / len(runs),
                "final": sum(r[1][-1][1] for r in runs) / len(runs),
                "explain": runs[0][2],
                "curves": [r[1] for r in runs],
            }
        a = adam[best_lr]
        rec["adam"] = {
            "lr": best_lr,
            "ms_per_step": 1e3 * a[0],
            "to_within_0_5": to_within(a[1]),
            "final": a[1][-1][1],
            "all_lr_final": {str(lr): adam[lr][1][-1][1] for lr in lrs},
            "curve": a[1],
        }
        payload["priors"][prior] = rec
        for kind in ("new", "old", "adam"):
            r = rec[kind]
            name = kind if kind != "adam" else f"adam lr={best_lr}"
            table.add(
                prior, name, fmt(r["ms_per_step"], ".2f"), fmt(r["to_within_0_5"], ".2f"),
                fmt(r["final"], ".2f"),
            )  # fmt: skip
    table.print()
    speed = {
        p: r["old"]["ms_per_step"] / r["new"]["ms_per_step"] for p, r in payload["priors"].items()
    }
    worse = [
        p for p, r in payload["priors"].items()
        if r["new"]["final"] > min(r["old"]["final"], r["adam"]["final"]) + 0.5
    ]  # fmt: skip
    line = (
        "Verdict: the expected-precision rows make a step "
        + ", ".join(f"{v:.1f}x ({p})" for p, v in speed.items())
        + " cheaper than the Bonnet/Price message; final bound within 0.5 nat of the best of "
        + f"old and Adam on {len(speed) - len(worse)} of {len(speed)} priors"
        + (f" (not: {', '.join(worse)})" if worse else "")
        + "."
    )
    print(line)
    write_results(
        args.out,
        payload,
        title="Expected-precision messages through a Normal scale",
        verdict=line,
        tables=[table],
        command="python scripts/benchmark_scale_messages.py" + (" --quick" if args.quick else ""),
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
