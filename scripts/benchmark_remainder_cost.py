"""The remainder's cost per step on recursion and ODE models, against AutoMultivariateNormal + Adam.

Four small models whose log joint is a long chain of small operations (a Python recursion, an
ODE solver's steps), where a dense Hessian is not cheap by construction:

* ``garch``: GARCH(1,1) as a Python recursion over 120 returns; latents ``mu``, ``omega``,
  ``alpha``, ``beta`` (4).
* ``pk``: a one-compartment pharmacokinetic model (first-order absorption and elimination),
  integrated by RK4 in torch; latents ``ka``, ``ke``, ``V``, ``sigma`` (4 positive).
* ``lotka_volterra``: predator-prey, RK4 in torch; four rates, two initial states, two noise
  scales (8 positive latents).
* ``arma``: ARMA(1,1) by its innovations recursion; ``mu``, ``phi``, ``theta``, ``sigma`` (4).

For each model and dtype, one process, one torch thread, back to back:

* ``autocvi``: ``SVI(model, AutoCVI(model), CVI(), CVI_ELBO())`` with the defaults, ``--steps``
  steps; its CPU per step (``time.process_time``, set-up excluded) and the step chosen.
* ``adam``: ``AutoMultivariateNormal`` + Adam (``Trace_ELBO``), each learning rate of
  ``--lrs`` (three by default), run for 3x AutoCVI's CPU time; its CPU per step, and the best
  lr's bound.

Both bounds are ``-ELBO`` estimates of the final guide from ``--draws`` draws of
``Trace_ELBO`` (standard error from 10 batches). A row passes when AutoCVI's CPU per step is
within 1.5x Adam's and its bound is no worse than Adam's best by more than
``max(0.5, 0.5%)`` plus 3 standard errors.

    PYTHONPATH=$PWD python scripts/benchmark_remainder_cost.py [--models garch,pk]
        [--dtypes float32 float64] [--steps 200] [--out results/benchmark_remainder_cost.json]
    # runs split by model, one process each, then one record:
    PYTHONPATH=$PWD python scripts/benchmark_remainder_cost.py --merge a.json b.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Callable, Dict, Tuple

import pyro
import pyro.distributions as dist
import torch
from bench.reporting import write_results
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal
from pyro.optim import Adam

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- models
def garch(y):
    mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 1.0))
    omega = pyro.sample("omega", dist.LogNormal(y.new_tensor(-2.0), 1.0))
    alpha = pyro.sample("alpha", dist.Beta(y.new_tensor(2.0), 8.0))
    beta = pyro.sample("beta", dist.Beta(y.new_tensor(8.0), 2.0))
    var = omega / (1 - alpha - beta).clamp_min(1e-3)
    sds = []
    for t in range(y.shape[0]):
        sds.append(var.sqrt())
        var = omega + alpha * (y[t] - mu) ** 2 + beta * var
    with pyro.plate("time", y.shape[0]):
        pyro.sample("y", dist.Normal(mu, torch.stack(sds, -1)), obs=y)


def garch_data(dtype):
    g = torch.Generator().manual_seed(1)
    y, var = [], 0.05 / (1 - 0.15 - 0.75)
    for _ in range(120):
        e = math.sqrt(var) * float(torch.randn((), generator=g, dtype=torch.float64))
        y.append(0.1 + e)
        var = 0.05 + 0.15 * e * e + 0.75 * var
    return (torch.tensor(y, dtype=dtype),)


def _rk4(f, x, h, n):
    out = []
    for _ in range(n):
        k1 = f(x)
        k2 = f([a + 0.5 * h * b for a, b in zip(x, k1)])
        k3 = f([a + 0.5 * h * b for a, b in zip(x, k2)])
        k4 = f([a + h * b for a, b in zip(x, k3)])
        x = [a + h / 6 * (b + 2 * c + 2 * d + e) for a, b, c, d, e in zip(x, k1, k2, k3, k4)]
        out.append(x)
    return out


def pk(t_obs, conc):
    one = conc.new_tensor(1.0)
    ka = pyro.sample("ka", dist.LogNormal(0.0 * one, 0.5))
    ke = pyro.sample("ke", dist.LogNormal(-1.5 * one, 0.5))
    V = pyro.sample("V", dist.LogNormal(2.0 * one, 0.5))
    sigma = pyro.sample("sigma", dist.LogNormal(-2.0 * one, 0.5))
    h, per = 0.25, 4  # RK4 steps of 0.25 h, observations hourly
    path = _rk4(
        lambda x: [-ka * x[0], ka * x[0] - ke * x[1]], [100.0 * one, 0.0 * one], h, per * 12
    )
    c = torch.stack([path[per * (i + 1) - 1][1] for i in range(12)], -1) / V
    with pyro.plate("obs", 12):
        pyro.sample("conc", dist.LogNormal(c.clamp_min(1e-6).log(), sigma), obs=conc)


def pk_data(dtype):
    g = torch.Generator().manual_seed(2)
    t = torch.arange(1.0, 13.0, dtype=torch.float64)
    ka, ke, V = 1.2, 0.25, 8.0
    c = 100 * ka / (V * (ka - ke)) * ((-ke * t).exp() - (-ka * t).exp())
    c = c * (0.1 * torch.randn(12, generator=g, dtype=torch.float64)).exp()
    return (t.to(dtype), c.to(dtype))


def lotka_volterra(obs):
    one = obs.new_tensor(1.0)
    a = pyro.sample("a", dist.LogNormal(0.0 * one, 0.5))
    b = pyro.sample("b", dist.LogNormal(-3.0 * one, 0.5))
    c = pyro.sample("c", dist.LogNormal(0.0 * one, 0.5))
    d = pyro.sample("d", dist.LogNormal(-3.0 * one, 0.5))
    x0 = pyro.sample("x0", dist.LogNormal(3.4 * one, 0.5))
    y0 = pyro.sample("y0", dist.LogNormal(1.6 * one, 0.5))
    sx = pyro.sample("sx", dist.LogNormal(-1.5 * one, 0.5))
    sy = pyro.sample("sy", dist.LogNormal(-1.5 * one, 0.5))
    per, n = 5, obs.shape[0]
    path = _rk4(lambda s: [s[0] * (a - b * s[1]), s[1] * (d * s[0] - c)], [x0, y0], 0.2, per * n)
    xs = torch.stack([path[per * (i + 1) - 1][0] for i in range(n)], -1)
    ys = torch.stack([path[per * (i + 1) - 1][1] for i in range(n)], -1)
    with pyro.plate("time", n):
        pyro.sample("hare", dist.LogNormal(xs.clamp_min(1e-6).log(), sx), obs=obs[:, 0])
        pyro.sample("lynx", dist.LogNormal(ys.clamp_min(1e-6).log(), sy), obs=obs[:, 1])


def lotka_volterra_data(dtype):
    g = torch.Generator().manual_seed(3)
    s = [torch.tensor(30.0, dtype=torch.float64), torch.tensor(5.0, dtype=torch.float64)]
    path = _rk4(lambda z: [z[0] * (0.55 - 0.028 * z[1]), z[1] * (0.024 * z[0] - 0.8)], s, 0.2, 100)
    xy = torch.stack([torch.stack(path[5 * (i + 1) - 1]) for i in range(20)])
    xy = xy * (0.25 * torch.randn(20, 2, generator=g, dtype=torch.float64)).exp()
    return (xy.to(dtype),)


def arma(y):
    mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 1.0))
    phi = pyro.sample("phi", dist.Uniform(y.new_tensor(-1.0), 1.0))
    theta = pyro.sample("theta", dist.Uniform(y.new_tensor(-1.0), 1.0))
    sigma = pyro.sample("sigma", dist.LogNormal(y.new_tensor(-1.0), 1.0))
    errs, prev_e, prev_y = [], 0.0 * mu, mu
    for t in range(y.shape[0]):
        e = y[t] - (mu + phi * (prev_y - mu) + theta * prev_e)
        errs.append(e)
        prev_e, prev_y = e, y[t]
    with pyro.plate("time", y.shape[0]):
        pyro.sample("e", dist.Normal(0.0, sigma), obs=torch.stack(errs, -1))


def arma_data(dtype):
    g = torch.Generator().manual_seed(4)
    y, e_prev, y_prev = [], 0.0, 0.5
    for _ in range(100):
        e = 0.3 * float(torch.randn((), generator=g, dtype=torch.float64))
        yt = 0.5 + 0.6 * (y_prev - 0.5) + 0.3 * e_prev + e
        y.append(yt)
        e_prev, y_prev = e, yt
    return (torch.tensor(y, dtype=dtype),)


MODELS: Dict[str, Tuple[Callable, Callable]] = {
    "garch": (garch, garch_data),
    "pk": (pk, pk_data),
    "lotka_volterra": (lotka_volterra, lotka_volterra_data),
    "arma": (arma, arma_data),
}


# --------------------------------------------------------------------------- measuring
def bound(model, guide, args, draws: int) -> Tuple[float, float]:
    """``-ELBO`` from ``draws`` Trace_ELBO draws: (mean, standard error over 10 batches)."""
    elbo = Trace_ELBO(num_particles=max(1, draws // 10))
    with torch.no_grad():
        vals = torch.tensor(
            [elbo.loss(model, guide, *args) for _ in range(10)], dtype=torch.float64
        )
    return float(vals.mean()), float(vals.std() / math.sqrt(10))


def run_autocvi(model, args, steps: int, draws: int, step: str = "default") -> Dict:
    from pyro_cvi import CVI, CVI_ELBO, AutoCVI, Horizon, Remainder

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    kw = {}
    if step == "onedraw":
        kw["remainder"] = Remainder(step=Horizon())
    elif step == "price":
        kw["remainder"] = Remainder(curvature="hessian")
    guide = AutoCVI(model, **kw)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    svi.step(*args)  # set-up and the first step
    t0 = time.process_time()
    losses = [svi.step(*args) for _ in range(steps)]
    cpu = time.process_time() - t0
    blocks = [b for b in guide.engine.blocks if b.kind == "remainder"]
    rule = "-"
    if blocks:
        b = blocks[0]
        rule = "price" if b.hessian else ("one-draw" if b.onedraw else type(b.rule).__name__)
        rule += f" ({b.form}, D={b.dim})"
    est, se = bound(model, guide, args, draws)
    return {
        "cpu": cpu + 0.0,
        "cpu_per_step": cpu / steps,
        "steps": steps,
        "rule": rule,
        "bound": est,
        "se": se,
        "last_loss": losses[-1],
        "finite": all(math.isfinite(v) for v in losses),
    }


def run_adam(model, args, budget: float, lr: float, draws: int) -> Dict:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMultivariateNormal(model)
    svi = SVI(model, guide, Adam({"lr": lr}), Trace_ELBO())
    svi.step(*args)
    t0, n = time.process_time(), 0
    while time.process_time() - t0 < budget:
        svi.step(*args)
        n += 1
    cpu = time.process_time() - t0
    est, se = bound(model, guide, args, draws)
    return {
        "lr": lr,
        "cpu": cpu,
        "steps": n,
        "cpu_per_step": cpu / max(n, 1),
        "bound": est,
        "se": se,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--dtypes", nargs="*", default=["float32", "float64"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lrs", type=float, nargs="*", default=[0.01, 0.03, 0.1])
    p.add_argument("--draws", type=int, default=500)
    p.add_argument(
        "--step",
        default="default",
        choices=["default", "onedraw", "price"],
        help="the remainder's step (default: the default rule's choice)",
    )
    p.add_argument("--out", default=str(ROOT / "results" / "benchmark_remainder_cost.json"))
    p.add_argument(
        "--quick", action="store_true", help="garch and arma, float64, 20 steps (results/quick/)"
    )
    p.add_argument(
        "--merge",
        nargs="*",
        default=None,
        help="write --out from the rows of these JSON files (runs split by model) and exit",
    )
    a = p.parse_args()
    if a.merge:
        return merge(a.merge, a.out)
    if a.quick:
        a.models, a.dtypes, a.steps, a.lrs, a.draws = "garch,arma", ["float64"], 20, [0.05], 50
    torch.set_num_threads(1)
    rows = []
    for name in a.models.split(","):
        model, data = MODELS[name]
        for dt in a.dtypes:
            args = data(getattr(torch, dt))
            try:
                cvi = run_autocvi(model, args, a.steps, a.draws, a.step)
            except Exception as e:  # a failed fit is a row too
                cvi = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            budget = 3 * cvi.get("cpu", 10.0)
            adams = [run_adam(model, args, budget, lr, a.draws) for lr in a.lrs]
            best = min(adams, key=lambda r: r["bound"] if math.isfinite(r["bound"]) else math.inf)
            row = {"model": name, "dtype": dt, "autocvi": cvi, "adam": adams, "adam_best": best}
            if "bound" in cvi:
                ratio = cvi["cpu_per_step"] / best["cpu_per_step"]
                slack = max(0.5, 0.005 * abs(best["bound"])) + 3 * math.hypot(cvi["se"], best["se"])
                row.update(
                    cost_ratio=ratio,
                    gap=cvi["bound"] - best["bound"],
                    cost_ok=ratio <= 1.5,
                    bound_ok=cvi["bound"] - best["bound"] <= slack,
                )
            rows.append(row)
            print(_line(row), flush=True)
    meta = {
        "command": "PYTHONPATH=$PWD python scripts/benchmark_remainder_cost.py "
        + " ".join(
            f"--{k} {v}" for k, v in [("models", a.models), ("steps", a.steps), ("step", a.step)]
        ),
        "dtypes": a.dtypes,
        "lrs": a.lrs,
        "draws": a.draws,
        "torch": torch.__version__,
    }
    report(rows, [meta], a.out, a.quick)


def merge(paths, out: str) -> None:
    """One record from runs split by model (each its own process): their rows and commands."""
    rows, metas = [], []
    for path in paths:
        data = json.loads(Path(path).read_text())
        rows += data["rows"]
        metas += data["meta"] if isinstance(data["meta"], list) else [data["meta"]]
    for r in rows:
        print(_line(r))
    report(rows, metas, out, False)


def report(rows, metas, out: str, quick: bool) -> None:
    met = all(r.get("cost_ok") and r.get("bound_ok") for r in rows)
    verdict = (
        "met: every row within 1.5x Adam's CPU per step and no worse than Adam's bound at 3x time"
        if met
        else "not met: "
        + ", ".join(
            f"{r['model']}-{r['dtype']}"
            + ("" if r.get("cost_ok") else " (cost)")
            + ("" if r.get("bound_ok") else " (bound)")
            for r in rows
            if not (r.get("cost_ok") and r.get("bound_ok"))
        )
    )
    done = {(r["model"], r["dtype"]) for r in rows}
    missing = [f"{m}-{d}" for m in MODELS for d in ("float32", "float64") if (m, d) not in done]
    if missing and not quick:
        verdict += f" on the rows measured; not measured: {', '.join(missing)}"
    print(verdict)
    write_results(
        out,
        {"meta": metas if len(metas) > 1 else metas[0], "rows": rows},
        title="The remainder's CPU per step on recursion and ODE models, against AutoMVN + Adam",
        verdict=f"Verdict: {verdict}",
        command="; ".join(m["command"] for m in metas),
        quick=quick,
    )


def _line(r: Dict) -> str:
    c, b = r["autocvi"], r["adam_best"]
    if "error" in c:
        return f"{r['model']:15s} {r['dtype']:8s} AutoCVI error: {c['error']}"
    return (
        f"{r['model']:15s} {r['dtype']:8s} {c['rule']:28s}"
        f" cvi {1e3 * c['cpu_per_step']:7.1f} ms/step"
        f"  adam {1e3 * b['cpu_per_step']:6.1f} ms/step  ratio {r['cost_ratio']:5.2f}"
        f"  bound cvi {c['bound']:9.2f}+-{c['se']:.2f}  adam(lr {b['lr']}) {b['bound']:9.2f}"
        f"+-{b['se']:.2f}  {'ok' if r['cost_ok'] and r['bound_ok'] else 'FAIL'}"
    )


if __name__ == "__main__":
    main()
