"""An HMM with exponential emissions (``DiscreteHMM``): AutoCVI defaults against AutoNormal + Adam.

Two models, each on data simulated from it (a sticky chain, stay probability 0.9):

* ``ordered``: 3 states, the rates ordered by construction (``rate_k = sum_{j <= k} d_j``,
  ``d_j ~ Gamma(2, 2)``), ``T = 300``: the label symmetry is broken by the prior.
* ``client``: 3 states, unordered rates ``rate_k ~ Gamma(2, 1)`` i.i.d., both guides started
  at the prior median (``init_to_median``), ``T = 600``: every labelling is a mode, and the
  start is close to the symmetric point between them.
* ``close``: the ``client`` model on data with rates (0.5, 1, 2) and ``T = 2000``: the states
  overlap, and fits started at the median end in different modes a few nats apart.

Both take a ``Dirichlet`` transition matrix per row and a uniform initial state. Per model,
dtype and seed (the data and the runs' random streams):

* ``autocvi``: ``SVI(model, AutoCVI(model), CVI(), CVI_ELBO())`` with the defaults (the
  ``client`` model with ``init_loc_fn=init_to_median``; with ``--apart`` that strategy
  through ``pyro_cvi.blocks.exchangeable.init_apart``), ``--steps`` steps, its CPU
  (``time.process_time``, one torch thread, set-up included);
* ``adam``: ``AutoNormal`` + Adam (``Trace_ELBO``), each learning rate of ``--lrs``: one run
  per rate, its state kept at 3x each AutoCVI variant's CPU and scored there, so every
  variant meets Adam at 3x its own CPU; the best bound over the rates.
* with ``--starts N`` (N > 1) also ``autocvi_starts``: AutoCVI through
  :func:`pyro_cvi.methods.restarts.best_of_starts` (the model's start, through ``init_apart``
  with ``--starts-apart``, then ``N - 1`` uniform draws, ``--warmup`` steps each, scored by
  the bound), then the chosen fit for the rest of ``--steps``.
* with ``--decay`` also ``autocvi_decay``: the plain fit under the fixed step-size schedule
  :func:`hold_then_decay` instead of the adaptive step (a diagnostic: whether the gap is the
  step size inside a mode rather than the mode).

Both bounds are ``-ELBO`` estimates of the final guide from ``--draws`` draws of
``Trace_ELBO`` (standard error over 10 batches). A row passes when AutoCVI's bound is within
1 nat of Adam's best (``cvi - adam <= 1``).

    PYTHONPATH=$PWD python scripts/benchmark_hmm_exp.py [--models ordered,client]
        [--dtypes float32 float64] [--seeds 0 1 2] [--steps 300] [--decay]
        [--out results/benchmark_hmm_exp.json]
    PYTHONPATH=$PWD python scripts/benchmark_hmm_exp.py --merge a.json b.json --out c.json
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
from benchmark_remainder_cost import bound
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.infer.autoguide.initialization import init_to_median
from pyro.optim import Adam

ROOT = Path(__file__).resolve().parents[1]
K = 3
TRUE_RATES = (0.5, 2.0, 8.0)


def _hmm(y, rates):
    trans = pyro.sample("trans", dist.Dirichlet(y.new_ones(K, K)).to_event(1))
    hmm = dist.DiscreteHMM(y.new_zeros(K), trans.log(), dist.Exponential(rates))
    pyro.sample("y", hmm, obs=y)


def ordered(y):
    d = pyro.sample("d", dist.Gamma(y.new_full((K,), 2.0), 2.0).to_event(1))
    _hmm(y, d.cumsum(-1))


def client(y):
    rates = pyro.sample("rates", dist.Gamma(y.new_full((K,), 2.0), 1.0).to_event(1))
    _hmm(y, rates)


def simulate(T: int, seed: int, dtype, true_rates=TRUE_RATES) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + seed)
    rates = torch.tensor(true_rates, dtype=torch.float64)
    trans = torch.full((K, K), 0.1 / (K - 1), dtype=torch.float64)
    trans.fill_diagonal_(0.9)
    s = int(torch.randint(K, (), generator=g))
    y = []
    for _ in range(T):
        s = int(torch.multinomial(trans[s], 1, generator=g))
        y.append(float(-torch.rand((), generator=g, dtype=torch.float64).log() / rates[s]))
    return torch.tensor(y, dtype=dtype)


MODELS: Dict[str, Tuple[Callable, int, bool, Tuple[float, ...]]] = {
    "ordered": (ordered, 300, False, TRUE_RATES),
    "client": (client, 600, True, TRUE_RATES),
    "close": (client, 2000, True, (0.5, 1.0, 2.0)),
}


def _rates(model, guide, args) -> list:
    """The rates at the guide's median (sorted), to read off the mode found."""
    with torch.no_grad():
        med = guide.median(*args) if hasattr(guide, "median") else {}
    if "d" in med:
        r = med["d"].cumsum(-1)
    elif "rates" in med:
        r = med["rates"]
    else:
        return []
    return sorted(float(v) for v in r)


def hold_then_decay(t: int) -> float:
    """A fixed step-size schedule for the ``--decay`` variant: ``beta = 0.3`` for 100 steps,
    then ``0.3 (100 / t)^2`` (0.075 at step 200, 0.033 at 300): large steps while ``q``
    travels, then a Robbins-Monro decay that averages the Monte Carlo noise out of it."""
    return min(0.3, 0.3 * (100.0 / t) ** 2)


def run_autocvi(
    model,
    args,
    steps: int,
    draws: int,
    median: bool,
    starts: int = 1,
    warmup: int = 75,
    apart: bool = False,
    step_size=None,
) -> Dict:
    from pyro_cvi import CVI, CVI_ELBO, AutoCVI
    from pyro_cvi.blocks.exchangeable import init_apart
    from pyro_cvi.methods.restarts import best_of_starts

    pyro.clear_param_store()
    init = init_to_median if median else None
    if apart:  # label-symmetric components started apart (opt-in)
        init = init_apart(init or init_to_median)
    t0 = time.process_time()
    if starts > 1:
        make = lambda i: SVI(model, AutoCVI(model, init_loc_fn=i), CVI(), CVI_ELBO())  # noqa: E731
        out = best_of_starts(make, args, num_starts=starts, warmup_steps=warmup, init_loc_fn=init)
        svi, guide, extra = out.svi, out.guide, {"start_bounds": out.bounds, "chosen": out.chosen}
        losses = out.losses[out.chosen] + [svi.step(*args) for _ in range(steps - warmup)]
    else:
        guide = AutoCVI(model, init_loc_fn=init)
        opt = CVI() if step_size is None else CVI(step_size=step_size)
        svi, extra = SVI(model, guide, opt, CVI_ELBO()), {}
        losses = [svi.step(*args) for _ in range(steps)]
    cpu = time.process_time() - t0
    est, se = bound(model, guide, args, draws)
    # the blocks AutoCVI chose (the remainder's step where there is one)
    kinds = []
    for b in guide.engine.blocks:
        kind = getattr(b, "kind", type(b).__name__)
        if kind == "remainder":
            kind = "price" if b.hessian else ("one-draw" if b.onedraw else type(b.rule).__name__)
        kinds.append(kind)
    rule = "+".join(kinds)
    return {
        "cpu": cpu,
        "steps": steps,
        "rule": rule,
        "bound": est,
        "se": se,
        "last_loss": losses[-1],
        "rates": _rates(model, guide, args),
        "finite": all(math.isfinite(v) for v in losses),
        **extra,
    }


def run_adam(model, args, budget, lr: float, draws: int, median: bool) -> Dict:
    """AutoNormal + Adam at ``lr`` for ``budget`` CPU seconds, or for each of several budgets
    (a list: one run, its state kept at each budget and scored afterwards): one row each."""
    budgets = sorted(budget) if isinstance(budget, (list, tuple)) else [budget]
    pyro.clear_param_store()
    kw = {"init_loc_fn": init_to_median} if median else {}
    t0, n, states = time.process_time(), 0, []
    guide = AutoNormal(model, **kw)
    svi = SVI(model, guide, Adam({"lr": lr}), Trace_ELBO())
    for b in budgets:
        while time.process_time() - t0 < b:
            svi.step(*args)
            n += 1
        states.append((time.process_time() - t0, n, pyro.get_param_store().get_state()))
    rows = []
    for cpu, steps, state in states:
        pyro.get_param_store().set_state(state)
        est, se = bound(model, guide, args, draws)
        rows.append({"lr": lr, "cpu": cpu, "steps": steps, "bound": est, "se": se,
                     "rates": _rates(model, guide, args)})  # fmt: skip
    return rows if isinstance(budget, (list, tuple)) else rows[0]


TRACE_AT = (25, 50, 100, 150, 200, 300, 450, 600, 900, 1200, 1800, 2400, 3600)


def trace(model, args, what: str, steps: int, draws: int, seed: int) -> list:
    """One long fit (``default``, ``decay`` or ``adam<lr>``), its bound, rates and CPU at the
    steps of ``TRACE_AT``: where along the way each fit is (a mode, or a path through one)."""
    from pyro_cvi import CVI, CVI_ELBO, AutoCVI

    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    if what.startswith("adam"):
        guide = AutoNormal(model, init_loc_fn=init_to_median)
        svi = SVI(model, guide, Adam({"lr": float(what[4:])}), Trace_ELBO())
    else:
        guide = AutoCVI(model, init_loc_fn=init_to_median)
        opt = CVI(step_size=hold_then_decay) if what == "decay" else CVI()
        svi = SVI(model, guide, opt, CVI_ELBO())
    cpu, out = 0.0, []
    for i in range(1, steps + 1):
        t0 = time.process_time()
        svi.step(*args)
        cpu += time.process_time() - t0
        if i in TRACE_AT:
            est, se = bound(model, guide, args, draws)
            out.append({"fit": what, "step": i, "cpu": cpu, "bound": est, "se": se,
                        "rates": _rates(model, guide, args)})  # fmt: skip
            print(f"{what} step {i} cpu {cpu:.1f} bound {est:.2f}+-{se:.2f} "
                  f"{[round(r, 3) for r in out[-1]['rates']]}", flush=True)  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--dtypes", nargs="*", default=["float32", "float64"])
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lrs", type=float, nargs="*", default=[0.01, 0.03, 0.1])
    p.add_argument("--draws", type=int, default=200)
    p.add_argument(
        "--adam-factor",
        type=float,
        default=3.0,
        help="Adam's CPU as a multiple of each AutoCVI variant's (the protocol: 3)",
    )
    p.add_argument("--starts", type=int, default=1, help="also AutoCVI from this many starts")
    p.add_argument("--warmup", type=int, default=75, help="steps of each start before scoring")
    p.add_argument(
        "--apart",
        action="store_true",
        help="AutoCVI with init_apart (label-symmetric components started apart)",
    )
    p.add_argument(
        "--starts-apart",
        action="store_true",
        help="the --starts fit's first start through init_apart (the plain fit as it is)",
    )
    p.add_argument(
        "--decay",
        action="store_true",
        help="also AutoCVI under the fixed schedule hold_then_decay (a diagnostic of the step)",
    )
    p.add_argument("--out", default=str(ROOT / "results" / "benchmark_hmm_exp.json"))
    p.add_argument("--quick", action="store_true", help="ordered, float64, seed 0, 30 steps")
    p.add_argument("--merge", nargs="+", help="merge these records into --out (no runs)")
    p.add_argument(
        "--trace",
        nargs="+",
        help="long fits (default, decay, adam0.01, ...) of the first model, dtype and seed for"
        " --steps steps, their bounds along the way",
    )
    a = p.parse_args()
    if a.merge:
        return merge(a.merge, a.out)
    if a.trace:  # long fits of one model, dtype and seed, their bounds along the way
        torch.set_num_threads(1)
        name, dt, seed = a.models.split(",")[0], a.dtypes[0], a.seeds[0]
        model, T, _, rates = MODELS[name]
        args = (simulate(T, seed, getattr(torch, dt), rates),)
        rows = [r for what in a.trace for r in trace(model, args, what, a.steps, a.draws, seed)]
        command = (
            f"PYTHONPATH=$PWD python scripts/benchmark_hmm_exp.py --models {name} --dtypes {dt}"
            f" --seeds {seed} --steps {a.steps} --trace {' '.join(a.trace)}"
        )
        verdict = "; ".join(
            f"{w} at step {r['step']}: {r['bound']:.2f}"
            for w in a.trace
            for r in [[x for x in rows if x["fit"] == w][-1]]
        )
        print(verdict)
        title = "HMM with exponential emissions: bounds along long fits"
        data = {"meta": {"command": command}, "rows": rows}
        v = f"Verdict: {verdict}"
        return write_results(a.out, data, title=title, verdict=v, command=command, quick=a.quick)
    if a.quick:
        a.models, a.dtypes, a.seeds, a.steps, a.lrs, a.draws = (
            "ordered",
            ["float64"],
            [0],
            30,
            [0.03],
            50,
        )
    torch.set_num_threads(1)
    rows = []
    for name in a.models.split(","):
        model, T, median, rates = MODELS[name]
        for dt in a.dtypes:
            for seed in a.seeds:
                args = (simulate(T, seed, getattr(torch, dt), rates),)
                fits = {}
                for key, n, apart in (
                    [("autocvi", 1, a.apart)]
                    + (
                        [("autocvi_starts", a.starts, a.apart or a.starts_apart)]
                        if a.starts > 1
                        else []
                    )
                    + ([("autocvi_decay", 1, a.apart)] if a.decay else [])
                ):
                    pyro.set_rng_seed(seed)
                    step = hold_then_decay if key == "autocvi_decay" else None
                    try:
                        fits[key] = run_autocvi(
                            model, args, a.steps, a.draws, median, n, a.warmup, apart, step
                        )
                    except Exception as e:  # a failed fit is a row too
                        fits[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}", "cpu": 10.0}
                # one Adam run per learning rate, scored at 3x each variant's CPU
                keys = list(fits)
                budgets = [a.adam_factor * fits[k]["cpu"] for k in keys]
                per_lr = []
                for lr in a.lrs:
                    pyro.set_rng_seed(seed)
                    per_lr.append(run_adam(model, args, budgets, lr, a.draws, median))
                order = sorted(range(len(keys)), key=lambda i: budgets[i])
                for rank, i in enumerate(order):
                    cvi = fits[keys[i]]
                    adams = [runs[rank] for runs in per_lr]
                    best = min(adams, key=lambda r: r["bound"])
                    cvi.update(adam=adams, adam_best=best)
                    if "bound" in cvi:
                        gap = cvi["bound"] - best["bound"]
                        cvi.update(gap=gap, ok=gap <= 1.0, adam_factor=a.adam_factor)
                last = fits[keys[-1]]
                row = {"model": name, "dtype": dt, "seed": seed, "T": T, **fits,
                       "adam": last["adam"], "adam_best": last["adam_best"]}  # fmt: skip
                # the row's verdict: the plain AutoCVI fit (with starts where asked)
                judged = fits["autocvi_starts" if a.starts > 1 else "autocvi"]
                if "bound" in judged:
                    row.update(gap=judged["gap"], ok=judged["ok"])
                rows.append(row)
                print(_line(row), flush=True)
                if not a.quick:  # (a long run keeps every finished row)
                    Path(a.out + ".partial").write_text(json.dumps(rows, default=str))
    command = (
        "PYTHONPATH=$PWD python scripts/benchmark_hmm_exp.py "
        + " ".join(
            f"--{k} {v}"
            for k, v in [
                ("models", a.models),
                ("dtypes", " ".join(a.dtypes)),
                ("seeds", " ".join(map(str, a.seeds))),
                ("steps", a.steps),
                ("lrs", " ".join(map(str, a.lrs))),
                ("draws", a.draws),
                ("starts", a.starts),
                ("warmup", a.warmup),
                ("adam-factor", a.adam_factor),
            ]
        )
        + (" --apart" if a.apart else "")
        + (" --starts-apart" if a.starts_apart else "")
        + (" --decay" if a.decay else "")
    )
    meta = {"command": command, "dtypes": a.dtypes, "seeds": a.seeds, "lrs": a.lrs,
            "draws": a.draws, "true_rates": TRUE_RATES, "torch": torch.__version__,
            "adam_factor": a.adam_factor}  # fmt: skip
    report(rows, [meta], a.out, a.quick)


def merge(paths, out: str) -> None:
    """One record from runs split by seed and dtype (each its own process)."""
    rows, metas = [], []
    for path in paths:
        data = json.loads(Path(path).read_text())
        rows += data["rows"]
        metas += data["meta"] if isinstance(data["meta"], list) else [data["meta"]]
    for r in rows:
        print(_line(r))
    report(rows, metas, out, False)


def report(rows, metas, out: str, quick: bool) -> None:
    """The verdict (the plain fit, or the fit with starts where it ran) and the record."""
    met = [r for r in rows if r.get("ok")]
    starts = any("autocvi_starts" in r for r in rows)
    factors = sorted({float(m.get("adam_factor", 3.0)) for m in metas})
    verdict = (
        f"{'met' if rows and len(met) == len(rows) else 'not met'}: AutoCVI"
        f"{' (several starts)' if starts else ''} within 1 nat of AutoNormal"
        f" + Adam's best bound ({'/'.join(f'{f:g}' for f in factors)}x CPU) on {len(met)}"
        f" of {len(rows)} rows"
    )
    for key in ("autocvi", "autocvi_starts", "autocvi_decay"):
        done = [r[key] for r in rows if "bound" in r.get(key, {})]
        if done:
            gaps = ", ".join(f"{c['gap']:+.2f}" for c in done)
            ok = sum(c["ok"] for c in done)
            verdict += f"; {key}: {ok} of {len(done)} (gaps {gaps})"
    print(verdict)
    write_results(
        out,
        {"meta": metas if len(metas) > 1 else metas[0], "rows": rows},
        title="HMM with exponential emissions: AutoCVI defaults against AutoNormal + Adam",
        verdict=f"Verdict: {verdict}",
        command="; ".join(m["command"] for m in metas),
        quick=quick,
    )


def _line(r: Dict) -> str:
    b = r["adam_best"]
    head = f"{r['model']:8s} {r['dtype']:8s} seed {r['seed']}"
    rates = lambda v: "[" + ", ".join(f"{x:.2f}" for x in v) + "]"  # noqa: E731
    out = [head]
    for key in ("autocvi", "autocvi_starts", "autocvi_decay"):
        c = r.get(key)
        if c is None:
            continue
        if "error" in c:
            out.append(f"  {key} error: {c['error']}")
            continue
        out.append(
            f"  {key:14s} {c['rule']:12s} {c['bound']:9.2f}+-{c['se']:.2f} {rates(c['rates'])}"
            f" cpu {c['cpu']:.1f} gap {c['gap']:+.2f} {'ok' if c['ok'] else 'FAIL'}"
        )
        b = c.get("adam_best", b)
        out.append(
            f"    adam(lr {b['lr']}, cpu {b['cpu']:.1f}) {b['bound']:9.2f}+-{b['se']:.2f}"
            f" {rates(b['rates'])}"
        )
    return "\n".join(out)


if __name__ == "__main__":
    main()
