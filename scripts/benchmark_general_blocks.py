"""Cheap steps for large general blocks: CVI's per-step time and -ELBO at equal wall time on
Bayesian neural networks (one joint Gaussian block with a general, Monte Carlo factor).

Compares, per model:

* ``cvi``: ``AutoCVI(model)`` with the defaults (``general_curvature="auto"``: the gradient-only
  estimate, Stein's lemma with one batched model run, for blocks above
  ``DENSE_HESSIAN_MAX_DIM`` dimensions);
* ``cvi-hessian``: ``AutoCVI(model, general_curvature="hessian")``, the dense Price Hessian
  per particle (the older path; per-step time only, a few steps);
* ``mvn``, ``normal``: ``AutoMultivariateNormal`` / ``AutoNormal`` with Adam (lr 0.01) and
  ``Trace_ELBO``.

Every guide is scored by one large-sample ``Trace_ELBO`` estimate (``--eval-particles``)
after the same wall time (``--budget`` seconds of steps; scoring is not timed). Models: the
zoo's ``bnn`` (tests/zoo, 40 weights and a Gamma noise precision) and ``bnn139``: a 4-23-1
tanh regression network with 139 Normal(0, 1) weights and a fixed noise scale.

Usage::

    python scripts/benchmark_general_blocks.py --quick
    python scripts/benchmark_general_blocks.py --out results/benchmark_general_blocks.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench.reporting import Table, fmt, write_results  # noqa: E402

from pyro_cvi import CVI, CVI_ELBO, AutoCVI  # noqa: E402
from tests.zoo import ZOO  # noqa: E402


def bnn139(X, y=None):
    """A 4-23-1 tanh regression network: 4 * 23 + 23 + 23 + 1 = 139 Normal(0, 1) weights."""
    H = 23
    zero = X.new_zeros(())
    W1 = pyro.sample("W1", dist.Normal(zero, 1.0).expand([X.shape[1], H]).to_event(2))
    b1 = pyro.sample("b1", dist.Normal(zero, 1.0).expand([H]).to_event(1))
    W2 = pyro.sample("W2", dist.Normal(zero, 1.0).expand([H]).to_event(1))
    b2 = pyro.sample("b2", dist.Normal(zero, 1.0))
    f = torch.tanh(X @ W1 + b1) @ W2 + b2
    with pyro.plate("data", X.shape[0]):
        pyro.sample("obs", dist.Normal(f, 0.2), obs=y)


def bnn139_data(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(100, 4, generator=g, dtype=dtype)
    y = torch.sin(X[:, 0]) + 0.5 * X[:, 1] * X[:, 2]
    return (X, y + 0.2 * torch.randn(100, generator=g, dtype=dtype))


def tanh_regression(X, y=None):
    """``y ~ Normal(tanh(X w), 0.3)``: one general factor on a D-dimensional block."""
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("obs", dist.Normal(torch.tanh(X @ w), 0.3), obs=y)


def tanh_data(D: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(D)
    X = torch.randn(100, D, generator=g, dtype=dtype) / D**0.5
    return (X, torch.tanh(X.sum(-1)) + 0.3 * torch.randn(100, generator=g, dtype=dtype))


def threshold_table(quick: bool) -> Table:
    """Per-step time of the dense and the gradient-only curvature by block dimension (the
    measurement behind ``DENSE_HESSIAN_MAX_DIM``)."""
    table = Table(
        "Dense Hessian vs gradient-only curvature by block dimension (tanh regression)",
        [
            ("D", "block dimension"),
            ("hessian ms", "AutoCVI(general_curvature='hessian') per step"),
            ("gradient ms", "AutoCVI(general_curvature='gradient') per step"),
        ],
    )
    for D in (2, 4, 8, 16, 32) if not quick else (2, 8, 32):
        args, row = tanh_data(D), []
        for mode in ("hessian", "gradient"):
            pyro.clear_param_store()
            pyro.set_rng_seed(0)
            guide = AutoCVI(tanh_regression, general_curvature=mode)
            svi = SVI(tanh_regression, guide, CVI(), CVI_ELBO())
            svi.step(*args)
            times = []
            for _ in range(5 if quick else 15):
                t = time.perf_counter()
                svi.step(*args)
                times.append(time.perf_counter() - t)
            row.append(fmt(1e3 * statistics.median(times), ".1f"))
        table.add(D, *row)
    return table


def models(dtype):
    return {
        "bnn (zoo, 40 weights)": (ZOO["bnn"].model, ZOO["bnn"].data(dtype).args),
        "bnn139": (bnn139, bnn139_data(dtype)),
    }


def make(method, model):
    if method == "cvi":
        guide = AutoCVI(model)
        return guide, SVI(model, guide, CVI(), CVI_ELBO())
    if method == "cvi-hessian":
        guide = AutoCVI(model, general_curvature="hessian")
        return guide, SVI(model, guide, CVI(), CVI_ELBO())
    cls = AutoMultivariateNormal if method == "mvn" else AutoNormal
    guide = cls(model)
    return guide, SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())


def per_step(methods, model, args, steps):
    """Median seconds of one ``svi.step`` per method (after two warm-up steps), the methods'
    steps interleaved so that a shared machine's load falls on all of them alike (their
    parameters have distinct names in the one param store)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    svis = {m: make(m, model)[1] for m in methods}
    times = {m: [] for m in methods}
    for i in range(steps + 2):
        for m, svi in svis.items():
            t = time.perf_counter()
            svi.step(*args)
            if i >= 2:
                times[m].append(time.perf_counter() - t)
    return {m: statistics.median(v) for m, v in times.items()}


def at_budget(method, model, args, budget, particles):
    """Steps for ``budget`` seconds, then the guide's -ELBO by one large Trace_ELBO estimate
    (mean and standard error over ``particles`` single-particle estimates)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide, svi = make(method, model)
    n, spent = 0, 0.0
    while spent < budget:
        t = time.perf_counter()
        svi.step(*args)
        spent += time.perf_counter() - t
        n += 1
    elbo = Trace_ELBO(num_particles=1)
    with torch.no_grad():
        vals = [elbo.loss(model, guide, *args) for _ in range(particles)]
    mean = sum(vals) / len(vals)
    se = statistics.stdev(vals) / math.sqrt(len(vals))
    return mean, se, n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short budgets (about 1 min)")
    p.add_argument("--budget", type=float, default=None, help="seconds of steps per method")
    p.add_argument("--eval-particles", type=int, default=None)
    p.add_argument("--out", default=str(ROOT / "results" / "benchmark_general_blocks.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    budget = args.budget or (6.0 if args.quick else 30.0)
    particles = args.eval_particles or (200 if args.quick else 1000)
    timing_steps = 8 if args.quick else 30
    t1 = Table(
        "Per-step time (median of svi.step), float64, one thread",
        [
            ("model", "the model"),
            ("D", "dimension of the Gaussian block with the general factor"),
            ("cvi ms", "AutoCVI defaults (gradient-only curvature above the dense threshold)"),
            ("hessian ms", "AutoCVI(general_curvature='hessian'): dense Price Hessian"),
            ("mvn ms", "AutoMultivariateNormal + Adam, Trace_ELBO"),
            ("normal ms", "AutoNormal + Adam, Trace_ELBO"),
            ("cvi/mvn", "CVI's step over AutoMVN's (target: at most 3)"),
            ("budget ratio", "AutoMVN's steps over CVI's in the equal-time runs below"),
        ],
    )
    t2 = Table(
        f"-ELBO after {budget:g} s of steps (scored by Trace_ELBO, {particles} particles)",
        [
            ("model", "the model"),
            ("method", "guide and optimiser"),
            ("steps", "steps taken in the budget"),
            ("-ELBO", "the large-sample Trace_ELBO estimate (lower is better)"),
            ("se", "its standard error"),
        ],
    )
    payload = {"budget_s": budget, "eval_particles": particles, "models": {}}
    ratios = []
    for name, (model, margs) in models(torch.float64).items():
        row = {}
        D = sum(p.numel() for p in _latents(model, margs))
        timed = {**per_step(("cvi", "mvn", "normal"), model, margs, timing_steps)}
        timed.update(per_step(("cvi-hessian",), model, margs, 3))
        for method, t in timed.items():
            row[f"{method}_step_s"] = t
        ratio = row["cvi_step_s"] / row["mvn_step_s"]
        ratios.append((name, ratio))
        for method in ("cvi", "mvn", "normal"):
            mean, se, n = at_budget(method, model, margs, budget, particles)
            row[f"{method}_neg_elbo"], row[f"{method}_se"], row[f"{method}_steps"] = mean, se, n
            t2.add(name, method, n, fmt(mean, ".2f"), fmt(se, ".2f"))
        t1.add(
            name,
            D,
            *(
                fmt(1e3 * row[f"{m}_step_s"], ".1f")
                for m in ("cvi", "cvi-hessian", "mvn", "normal")
            ),
            fmt(ratio, ".2f"),
            fmt(row["mvn_steps"] / row["cvi_steps"], ".2f"),
        )
        payload["models"][name] = row
    t3 = threshold_table(args.quick)
    t1.print()
    t2.print()
    t3.print()
    worst = max(ratios, key=lambda r: r[1])
    wins = [
        n
        for n, r in payload["models"].items()
        if r["cvi_neg_elbo"]
        <= min(r["mvn_neg_elbo"], r["normal_neg_elbo"]) + max(0.5, 3 * r["cvi_se"])
    ]
    line = (
        f"Verdict: a CVI step costs at most {worst[1]:.2f}x an AutoMVN Adam step "
        f"(worst: {worst[0]}; target 3x); CVI's -ELBO at equal wall time was no worse than the "
        f"best Adam baseline on {len(wins)} of {len(ratios)} models ({', '.join(wins) or 'none'})."
    )
    print(line)
    write_results(
        args.out,
        payload,
        title="Cheap steps for large general blocks (BNNs)",
        verdict=line,
        tables=[t1, t2, t3],
        command="python scripts/benchmark_general_blocks.py" + (" --quick" if args.quick else ""),
        quick=args.quick,
    )


def _latents(model, margs):
    """The sampled weights of the model's Normal sites (the Gaussian block's dimension)."""
    tr = pyro.poutine.trace(model).get_trace(*margs)
    return [
        s["value"]
        for s in tr.nodes.values()
        if s["type"] == "sample"
        and not s["is_observed"]
        and "prec" not in s["name"]
        and type(s["fn"]).__name__ != "_Subsample"  # a plate's indices
    ]


if __name__ == "__main__":
    main()
