"""The Markov blocks' bound in float32 against float64, at one ``q`` and after a fit.

Per model: (1) fit in float64 for ``steps`` CVI steps, copy the parameters into a float32
guide, and report the float32 guide's loss of that same ``q`` less the float64 one (the same
random stream: the closed-form blocks' rounding, plus the remainder's draws in another
dtype); (2) fit in float32 from the same start for the same steps, copy its parameters into a
float64 guide, and report that guide's loss (the float32 fit's bound, evaluated in float64)
less the float64 fit's. Losses are ``CVI_ELBO``'s: exact for the Kalman blocks and closed-form
factors, a Monte Carlo estimate over the remainder's ``q`` (the mean of ``--draws`` random
streams where a model has one). Models: a local level (``x = cumsum(eps)``, fixed scales,
observed with sd 0.01 and 0.1, T = 1,000 and 10,000), a local linear trend with fixed scales
written with two cumsums (T = 1,000, near 20, sd 0.05), the Poisson Markov GP of
``scripts/benchmark_peers.py`` (Matern-3/2, lengthscale 20) at T = 10,000, and the zoo's chain
models. Prints a table and writes ``results/benchmark_markov_float32.json``.

    python scripts/benchmark_markov_float32.py [--label main] [--out PATH] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from bench.reporting import Table, write_results

ROOT = Path(__file__).resolve().parents[1]
D64, D32 = torch.float64, torch.float32

COLUMNS = [
    ("model", "the model (T: its steps)"),
    ("blocks", "the float64 guide's blocks (class names less 'Block')"),
    ("steps", "CVI steps of each fit (CVI() adaptive, AutoCVI defaults)"),
    ("-ELBO f64", "the float64 fit's loss (its own q, float64)"),
    ("same q: f32 - f64", "the float32 guide's loss of the float64 fit's q, less float64's"),
    ("fit: f32 - f64", "the float32 fit's loss evaluated in float64, less the float64 fit's"),
    ("s/step f32", "CPU seconds per float32 CVI step (median of the fit, under load)"),
]


def _level(T: int, sd: float):
    import pyro
    import pyro.distributions as dist

    g = torch.Generator().manual_seed(0)
    level = (0.1 * torch.randn(T, generator=g, dtype=D64)).cumsum(0)
    y = level + sd * torch.randn(T, generator=g, dtype=D64)

    def model(y):
        with pyro.plate("time", y.shape[0]):
            eps = pyro.sample("eps", dist.Normal(y.new_tensor(0.0), 0.1))
        with pyro.plate("obs", y.shape[0]):
            pyro.sample("y", dist.Normal(eps.cumsum(-1), sd), obs=y)

    return model, (y,), {}


def _trend(T: int, sd: float):
    """A local linear trend with fixed scales in two cumsums (a nested walk) near 20."""
    import pyro
    import pyro.distributions as dist

    g = torch.Generator().manual_seed(0)
    slope = (0.02 * torch.randn(T, generator=g, dtype=D64)).cumsum(0)
    level = 20.0 + (slope + 0.1 * torch.randn(T, generator=g, dtype=D64)).cumsum(0)
    y = level + sd * torch.randn(T, generator=g, dtype=D64)

    def model(y):
        with pyro.plate("time", y.shape[0]):
            eta = pyro.sample("eta", dist.Normal(y.new_tensor(0.0), 0.02))
            eps = pyro.sample("eps", dist.Normal(y.new_tensor(0.0), 0.1))
        with pyro.plate("obs_time", y.shape[0]):
            pyro.sample("y", dist.Normal((eta.cumsum(-1) + eps).cumsum(-1), sd), obs=y)

    return model, (y,), {}


def _poisson_gp(T: int):
    import pyro
    import pyro.distributions as dist

    from pyro_cvi.statespace import Matern32, markov_gp

    g = torch.Generator().manual_seed(0)
    t = torch.arange(T, dtype=D64)
    y = torch.poisson(torch.exp(torch.sin(t / 15.0) + 0.5), generator=g)

    def model(t, y):
        f = markov_gp("x", t, Matern32(lengthscale=20.0, variance=1.0))
        with pyro.plate("t", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

    return model, (t, y), {}


def _zoo(name: str):
    sys.path.insert(0, str(ROOT / "tests"))
    from zoo import ZOO

    entry = ZOO[name]
    model, kwargs = entry.build(D64)
    data = entry.data(D64)
    return model, data.args, kwargs


def _guide(model, args, kwargs, dtype, params=None):
    import pyro
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model, **kwargs)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    a = tuple(x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x for x in args)
    guide(*a)
    if params is not None:
        store = pyro.get_param_store()
        for k, v in params.items():
            store[k].data.copy_(v.to(store[k].dtype))
        for b in guide.engine.blocks:
            if hasattr(b, "forget"):
                b.forget()
    return guide, svi, a


def _fit(model, args, kwargs, dtype, steps: int):
    import pyro

    guide, svi, a = _guide(model, args, kwargs, dtype)
    cpus = []
    for _ in range(steps):
        c = time.process_time()
        svi.step(*a)
        cpus.append(time.process_time() - c)
    params = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    return params, sorted(cpus)[len(cpus) // 2]


def _loss(model, args, kwargs, dtype, params, draws: int) -> float:
    import pyro

    guide, svi, a = _guide(model, args, kwargs, dtype, params)
    stochastic = bool(getattr(guide.engine.analysis, "remainder", []))
    values = []
    for seed in range(draws if stochastic else 1):
        pyro.set_rng_seed(seed)
        with torch.no_grad():
            values.append(svi.evaluate_loss(*a))
    kinds = "+".join(type(b).__name__.replace("Block", "") for b in guide.engine.blocks)
    return sum(values) / len(values), kinds


def measure(name: str, make: Callable, steps: int, draws: int) -> Dict:
    model, args, kwargs = make()
    p64, _ = _fit(model, args, kwargs, D64, steps)
    l64, kinds = _loss(model, args, kwargs, D64, p64, draws)
    same = _loss(model, args, kwargs, D32, p64, draws)[0]
    p32, cpu32 = _fit(model, args, kwargs, D32, steps)
    fit32 = _loss(model, args, kwargs, D64, p32, draws)[0]
    return {
        "model": name,
        "blocks": kinds,
        "steps": steps,
        "neg_elbo_f64": l64,
        "same_q_f32_minus_f64": same - l64,
        "fit_f32_minus_f64": fit32 - l64,
        "cpu_step_f32": cpu32,
    }


def cases(quick: bool) -> List[tuple]:
    out = [
        ("local level T=1000 sd=0.01", lambda: _level(1000, 0.01), 20),
        ("local level T=1000 sd=0.1", lambda: _level(1000, 0.1), 20),
        ("nested trend T=1000 sd=0.05", lambda: _trend(1000, 0.05), 20),
    ]
    if not quick:
        out += [
            ("local level T=10000 sd=0.01", lambda: _level(10000, 0.01), 20),
            ("local level T=10000 sd=0.1", lambda: _level(10000, 0.1), 20),
            ("Poisson Markov GP T=10000", lambda: _poisson_gp(10000), 20),
        ]
    for name in ("local_level", "stochastic_volatility", "hmm_gaussian", "poisson_changepoint"):
        out.append((f"zoo {name}", lambda name=name: _zoo(name), 100))
    return out


def main(argv: Optional[List[str]] = None) -> Dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="", help="what was measured (a commit)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--draws", type=int, default=5, help="random streams of a MC loss")
    ap.add_argument("--quick", action="store_true", help="T = 1,000 and the zoo only")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import pyro_cvi

    table = Table(f"Markov blocks: float32 against float64 {args.label}".strip(), COLUMNS)
    rows = []
    for name, make, steps in cases(args.quick):
        print(f"{name} ...", flush=True)
        try:
            row = measure(name, make, steps, args.draws)
        except Exception as e:  # (a failed model is a row too)
            row = {"model": name, "error": f"{type(e).__name__}: {str(e)[:160]}"}
        rows.append(row)
        if "error" in row:
            table.add(name, "-", steps, row["error"], "-", "-", "-")
            continue
        table.add(
            name,
            row["blocks"],
            steps,
            f"{row['neg_elbo_f64']:.3f}",
            f"{row['same_q_f32_minus_f64']:+.4f}",
            f"{row['fit_f32_minus_f64']:+.4f}",
            f"{row['cpu_step_f32']:.4f}",
        )
    table.print()
    worst = max((abs(r.get("same_q_f32_minus_f64", 0.0)) for r in rows), default=0.0)
    verdict = f"Verdict: the largest float32 - float64 loss at one q is {worst:.4f} nats."
    print(verdict)
    out = args.out or str(ROOT / "results" / "benchmark_markov_float32.json")
    payload = {"label": args.label, "package": str(Path(pyro_cvi.__file__).parent), "rows": rows}
    write_results(
        out,
        payload,
        title="Markov blocks in float32",
        verdict=verdict,
        tables=[table],
        command="python scripts/benchmark_markov_float32.py",
        quick=args.quick,
    )
    return payload


if __name__ == "__main__":
    main()
