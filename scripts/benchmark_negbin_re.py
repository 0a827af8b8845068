"""A negative-binomial regression with non-centred random effects: AutoCVI's defaults after a
user's step count against AutoNormal + Adam.

The model (300 counts, 10 groups, 3 covariates)::

    b0 ~ N(0, 2^2),  w ~ N(0, I_3),  sigma ~ LogNormal(-1, 0.5),  z_g ~ N(0, 1) (g = 1..10)
    phi ~ Gamma(2, 0.5)                        (the negative binomial's concentration)
    y_n ~ GammaPoisson(phi, phi / mu_n),   log mu_n = b0 + x_n' w + sigma z_{g(n)}

(``GammaPoisson(phi, phi / mu)`` is the negative binomial of mean ``mu`` and variance
``mu + mu^2 / phi``). For each dtype, one process, one torch thread, back to back:

* ``autocvi``: ``SVI(model, AutoCVI(model), CVI(), CVI_ELBO())``, ``--steps`` steps.
* ``adam``: ``AutoNormal`` + Adam (``Trace_ELBO``), each learning rate of ``--lrs``, for 3x
  AutoCVI's CPU time.

Both bounds are ``-ELBO`` estimates of the final guide from ``--draws`` Trace_ELBO draws
(standard error from 10 batches). A row passes when AutoCVI's bound is no worse than Adam's best
by more than ``max(0.5, 0.1%)`` plus 3 standard errors.

    PYTHONPATH=$PWD python scripts/benchmark_negbin_re.py [--dtypes float32 float64]
        [--steps 300] [--out results/benchmark_negbin_re.json]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Dict, Tuple

import pyro
import pyro.distributions as dist
import torch
from bench.reporting import write_results
from benchmark_remainder_cost import bound
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.optim import Adam

ROOT = Path(__file__).resolve().parents[1]


def negbin_re(X, group, y):
    one = X.new_tensor(1.0)
    b0 = pyro.sample("b0", dist.Normal(0.0 * one, 2.0))
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    sigma = pyro.sample("sigma", dist.LogNormal(-1.0 * one, 0.5))
    phi = pyro.sample("phi", dist.Gamma(2.0 * one, 0.5))
    with pyro.plate("groups", 10):
        z = pyro.sample("z", dist.Normal(0.0 * one, 1.0))
    with pyro.plate("data", X.shape[0]):
        mu = (b0 + X @ w + sigma * z[group]).exp()
        pyro.sample("y", dist.GammaPoisson(phi, phi / mu), obs=y)


def negbin_data(dtype, n: int = 300, seed: int = 5) -> Tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    X = torch.randn(n, 3, generator=g, dtype=f64)
    group = torch.arange(n) % 10
    z = torch.randn(10, generator=g, dtype=f64)
    mu = (1.0 + X @ torch.tensor([0.4, -0.3, 0.2], dtype=f64) + 0.5 * z[group]).exp()
    phi = 3.0
    rate = torch._standard_gamma(torch.full((n,), phi, dtype=f64), generator=g) / phi * mu
    y = torch.poisson(rate, generator=g)
    return X.to(dtype), group, y.to(dtype)


def run_autocvi(args, steps: int, draws: int) -> Dict:
    from pyro_cvi import CVI, CVI_ELBO, AutoCVI

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(negbin_re)
    svi = SVI(negbin_re, guide, CVI(), CVI_ELBO())
    t0 = time.process_time()
    losses = [svi.step(*args) for _ in range(steps)]
    cpu = time.process_time() - t0
    blocks = [f"{b.kind}" for b in guide.engine.blocks]
    est, se = bound(negbin_re, guide, args, draws)
    return {
        "cpu": cpu,
        "steps": steps,
        "blocks": blocks,
        "bound": est,
        "se": se,
        "last_loss": losses[-1],
    }


def run_adam(args, budget: float, lr: float, draws: int) -> Dict:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(negbin_re)
    svi = SVI(negbin_re, guide, Adam({"lr": lr}), Trace_ELBO())
    t0, n = time.process_time(), 0
    while time.process_time() - t0 < budget:
        svi.step(*args)
        n += 1
    est, se = bound(negbin_re, guide, args, draws)
    return {"lr": lr, "cpu": time.process_time() - t0, "steps": n, "bound": est, "se": se}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", nargs="*", default=["float32", "float64"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lrs", type=float, nargs="*", default=[0.01, 0.03, 0.1])
    p.add_argument("--draws", type=int, default=1000)
    p.add_argument("--out", default=str(ROOT / "results" / "benchmark_negbin_re.json"))
    p.add_argument("--quick", action="store_true", help="float64, 30 steps (results/quick/)")
    a = p.parse_args()
    if a.quick:
        a.dtypes, a.steps, a.lrs, a.draws = ["float64"], 30, [0.03], 100
    torch.set_num_threads(1)
    rows = []
    for dt in a.dtypes:
        args = negbin_data(getattr(torch, dt))
        cvi = run_autocvi(args, a.steps, a.draws)
        adams = [run_adam(args, 3 * cvi["cpu"], lr, a.draws) for lr in a.lrs]
        best = min(adams, key=lambda r: r["bound"])
        slack = max(0.5, 1e-3 * abs(best["bound"])) + 3 * math.hypot(cvi["se"], best["se"])
        gap = cvi["bound"] - best["bound"]
        row = {"dtype": dt, "autocvi": cvi, "adam": adams, "adam_best": best, "gap": gap}
        row["ok"] = gap <= slack
        rows.append(row)
        print(
            f"{dt:8s} AutoCVI {cvi['bound']:9.2f}+-{cvi['se']:.2f} ({a.steps} steps,"
            f" {cvi['cpu']:.1f} s, {'+'.join(cvi['blocks'])})  AutoNormal+Adam(lr {best['lr']})"
            f" {best['bound']:9.2f}+-{best['se']:.2f} ({best['steps']} steps)  gap {gap:+.2f}"
            f"  {'ok' if row['ok'] else 'FAIL'}",
            flush=True,
        )
    met = all(r["ok"] for r in rows)
    verdict = (
        "met: AutoCVI's bound no worse than AutoNormal + Adam's best at 3x the time"
        if met
        else "not met: " + ", ".join(r["dtype"] for r in rows if not r["ok"])
    )
    print(verdict)
    command = f"PYTHONPATH=$PWD python scripts/benchmark_negbin_re.py --steps {a.steps}"
    meta = {"command": command, "dtypes": a.dtypes, "lrs": a.lrs, "draws": a.draws}
    write_results(
        a.out,
        {"meta": meta, "rows": rows},
        title="Negative-binomial random-effects regression: AutoCVI against AutoNormal + Adam",
        verdict=f"Verdict: {verdict}",
        command=command,
        quick=a.quick,
    )


if __name__ == "__main__":
    main()
