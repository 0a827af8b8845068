#!/usr/bin/env python
"""``CVI()`` on Pyro's Gaussian guides against Adam on the centred eight schools (a funnel).

For AutoNormal, AutoLowRankMultivariateNormal and AutoMultivariateNormal, side by side in one
process (one torch thread, float64): Adam at each learning rate of {0.01, 0.03, 0.1} for 2,000
steps, and ``CVI()`` (the default adaptive step, :mod:`pyro_cvi.natgrad.control`) for 2,000
steps. Every ``--every`` steps the guide's bound is estimated with 4,000 vectorised
``Trace_ELBO`` draws (not timed). The row reports Adam's best 2,000-step -ELBO, its CPU time,
and the CPU time ``CVI()`` needs to reach it (within its estimate's noise, 0.05 nat), as a
fraction of Adam's; the target is at most 0.5.

    PYTHONPATH=. python scripts/benchmark_natgrad_control.py            # results/...json
    PYTHONPATH=. python scripts/benchmark_natgrad_control.py --quick    # results/quick/
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import (
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)

from pyro_cvi import CVI

Y = [28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0]
SIGMA = [15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0]
GUIDES = {
    "AutoNormal": AutoNormal,
    "AutoLowRankMultivariateNormal": AutoLowRankMultivariateNormal,
    "AutoMultivariateNormal": AutoMultivariateNormal,
}


def model(sigma, y):
    mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(y.new_tensor(5.0)))
    with pyro.plate("schools", len(y)):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def estimate(guide, data, draws: int) -> float:
    loss = Trace_ELBO(num_particles=draws, vectorize_particles=True, max_plate_nesting=1)
    with torch.no_grad():
        return float(loss.loss(model, guide, *data))


def run(guide_cls, optim, data, steps: int, every: int, draws: int, seed: int = 0):
    """``[(step, CPU seconds of training so far, -ELBO estimate)]``."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = guide_cls(model)
    svi = SVI(model, guide, optim, Trace_ELBO())
    out, cpu = [], 0.0
    for t in range(1, steps + 1):
        t0 = time.process_time()
        svi.step(*data)
        cpu += time.process_time() - t0
        if t % every == 0:
            out.append((t, cpu, estimate(guide, data, draws)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="500 steps, AutoNormal only")
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    torch.set_num_threads(1)
    data = (torch.tensor(SIGMA, dtype=torch.float64), torch.tensor(Y, dtype=torch.float64))
    steps, every, draws = (500, 50, 1000) if a.quick else (2000, 50, 4000)
    guides = ["AutoNormal"] if a.quick else list(GUIDES)
    rows = []
    for name in guides:
        adam = {}
        for lr in (0.01, 0.03, 0.1):
            adam[lr] = run(GUIDES[name], pyro.optim.Adam({"lr": lr}), data, steps, every, draws)
        best_lr = min(adam, key=lambda lr: adam[lr][-1][2])
        target, adam_cpu = adam[best_lr][-1][2], adam[best_lr][-1][1]
        cvi = run(GUIDES[name], CVI(), data, steps, every, draws)
        reach = next((c for _, c, v in cvi if v <= target + 0.05), None)
        row = {
            "guide": name,
            "adam_lr": best_lr,
            "adam_elbo": target,
            "adam_cpu": adam_cpu,
            "cvi_elbo": cvi[-1][2],
            "cvi_cpu_to_adam": reach,
            "ratio": None if reach is None else reach / adam_cpu,
            "cvi_trajectory": cvi,
            "adam_trajectory": adam[best_lr],
        }
        rows.append(row)
        ratio = "not reached" if reach is None else f"{reach / adam_cpu:.2f}"
        print(
            f"{name:32s} Adam(lr={best_lr}) {target:8.2f} in {adam_cpu:6.1f} s | CVI() "
            f"{cvi[-1][2]:8.2f}; to Adam's bound: {ratio} of Adam's time"
        )
    out = a.out or (
        "results/quick/benchmark_natgrad_control.json"
        if a.quick
        else "results/benchmark_natgrad_control.json"
    )
    met = [r["guide"] for r in rows if r["ratio"] is not None and r["ratio"] <= 1 / 3]
    verdict = (
        f"CVI() reaches Adam's {steps}-step bound in a third of Adam's CPU time or less on "
        f"{len(met)} of {len(rows)} guides" + (f" ({', '.join(met)})" if met else "")
    )
    print(f"verdict: {verdict}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"steps": steps, "rows": rows, "verdict": verdict}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
