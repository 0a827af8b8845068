#!/usr/bin/env python
"""``CVI()`` as a drop-in optimizer of Pyro's Gaussian autoguides on every zoo model.

For every model of ``tests/zoo`` and dtype, back to back in one process (one torch thread):

* ``SVI(model, Guide(model), CVI(), Trace_ELBO())`` for ``--steps`` steps (300 by default) with
  each of ``AutoNormal``, ``AutoDiagonalNormal``, ``AutoMultivariateNormal`` and
  ``AutoLowRankMultivariateNormal`` (the joint ones only up to 300 latent coordinates;
  ``TraceEnum_ELBO`` with the discrete sites enumerated where the model has any), the default
  adaptive step: does it run (no exception, every loss finite), and its bound;
* ``AutoNormal`` + Adam for the same steps at lr 0.01, 0.03 and 0.1: the best bound.

Every guide is scored by one estimator: the -ELBO over ``M`` calls of ``P`` particles (fixed
seed), with its standard error. A run that raises (``DivergenceError``) is scored at the ``q``
it was left with (the guard puts back its best ``q``) and counted as diverged.

``--errors`` sweeps for failures instead (no bound, no Adam): every model x guide x dtype with the
adaptive step and a fixed step (``--fixed``, 0.5) for ``--steps`` steps (30 by default there),
listing each exception that is not the project's own (raised outside ``pyro_cvi``: a raw torch or
Pyro error) and each non-finite loss returned without an error.

``--checkout PATH`` runs the ``pyro_cvi`` of another checkout (the zoo stays this one's), for a
before/after table: ``--compare BEFORE.json`` compares this run with a record, row by row
(``worse``: bound higher by more than ``max(0.5 nat, 3 combined se)``).

    python scripts/benchmark_dropin_zoo.py [--quick] [--models ...] [--dtypes float32 float64]
        [--out results/benchmark_dropin_zoo.json] [--compare BEFORE.json] [--checkout PATH]
    python scripts/benchmark_dropin_zoo.py --errors [--steps 30] [--fixed 0.5] [--models ...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
import warnings
from pathlib import Path

from bench.zoo_runs import hide_discrete, latent_size, zoo_elbo

ROOT = Path(__file__).resolve().parents[1]


def _setup(checkout):
    if checkout:
        sys.path.insert(0, str(Path(checkout).resolve()))
    else:
        sys.path.insert(0, str(ROOT))
    sys.path.insert(1, str(ROOT / "tests"))
    sys.path.insert(2, str(ROOT / "scripts"))


GUIDES = (
    "AutoNormal",
    "AutoDiagonalNormal",
    "AutoMultivariateNormal",
    "AutoLowRankMultivariateNormal",
)
JOINT_MAX = 300
ADAM_LRS = (0.01, 0.03, 0.1)
QUICK_MODELS = ("stochastic_volatility", "sparse_gamma_def", "eight_schools_noncentered")


def _model(entry, dtype):
    """``(model or (model, model with its discrete sites hidden), guide kwargs for dtype)``."""
    model, kwargs = entry.build(dtype)
    return ((model, hide_discrete(model)) if entry.has_discrete else model), kwargs


def evaluate(entry, model, guide, data, M: int, P: int):
    """``(mean, se)`` of the -ELBO over ``M`` calls of ``P`` particles (seed fixed)."""
    import pyro
    import torch

    pyro.set_rng_seed(12345)
    elbo = zoo_elbo(entry, num_particles=P)
    vals = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(M):
            vals.append(elbo.loss(model, guide, *data.args, **data.kwargs))
    v = torch.tensor(vals, dtype=torch.float64)
    if not bool(torch.isfinite(v).all()):
        return math.inf, math.inf
    return float(v.mean()), float(v.std() / math.sqrt(M))


def run_one(entry, dtype, guide_name, optim_name, lr, steps, M, P):
    import pyro
    from pyro.infer import SVI
    from pyro.infer import autoguide as ag

    from pyro_cvi import CVI

    data = entry.data(dtype)
    built, kwargs = _model(entry, dtype)  # (the entry's own kwargs hold float64 init values)
    model, hidden = (built, built) if not isinstance(built, tuple) else built
    init = {"init_loc_fn": kwargs["init_loc_fn"]} if "init_loc_fn" in kwargs else {}
    row = {"model": entry.name, "dtype": str(dtype).split(".")[-1], "guide": guide_name}
    row["optim"] = optim_name if lr is None else f"{optim_name} {lr:g}"
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = getattr(ag, guide_name)(hidden, **init)
    optim = CVI() if optim_name == "CVI" else pyro.optim.Adam({"lr": lr})
    svi = SVI(model, guide, optim, zoo_elbo(entry))
    losses, error = [], None
    t0 = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(steps):
            try:
                loss = float(svi.step(*data.args, **data.kwargs))
            except Exception as e:  # a run that raises is part of the table
                error = f"step {i}: {type(e).__name__}: {str(e)[:160]}"
                break
            losses.append(loss)
            if not math.isfinite(loss):
                error = f"step {i}: loss {loss}"
                break
    row["cpu"] = time.process_time() - t0
    row["steps_done"] = len(losses)
    row["error"] = error
    row["last_losses"] = losses[-5:]
    try:
        row["bound"], row["se"] = evaluate(entry, model, guide, data, M, P)
    except Exception as e:
        row["bound"], row["se"] = math.inf, math.inf
        row["error"] = (error or "") + f" | bound: {type(e).__name__}: {str(e)[:100]}"
    return row


def raised_where(error: BaseException) -> str:
    """``"own"`` where the innermost frame that raised is ``pyro_cvi``'s (a project error, which
    names the site and says what to do), else ``"raw"`` (torch's or Pyro's own message)."""
    frames = traceback.extract_tb(error.__traceback__)
    last = frames[-1].filename if frames else ""
    return "own" if "/pyro_cvi/" in last.replace("\\", "/") else "raw"


def sweep_one(entry, dtype, guide_name, step_size, steps):
    """One ``CVI(step_size)`` run for the error sweep: a row with ``kind`` ``"ok"``, ``"own"``
    (a project error), ``"raw"`` (an error raised outside ``pyro_cvi``) or ``"nonfinite"`` (a
    non-finite loss returned without an error or ``CVI()``'s warning that the step was
    skipped; ``warned`` counts those with the warning)."""
    import pyro
    from pyro.infer import SVI
    from pyro.infer import autoguide as ag

    from pyro_cvi import CVI

    data = entry.data(dtype)
    built, kwargs = _model(entry, dtype)
    model, hidden = (built, built) if not isinstance(built, tuple) else built
    init = {"init_loc_fn": kwargs["init_loc_fn"]} if "init_loc_fn" in kwargs else {}
    row = {"model": entry.name, "dtype": str(dtype).split(".")[-1], "guide": guide_name}
    row["step"] = "auto" if step_size == "auto" else f"fixed {step_size:g}"
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = getattr(ag, guide_name)(hidden, **init)
    svi = SVI(model, guide, CVI(step_size=step_size), zoo_elbo(entry))
    row["kind"], row["error"], row["steps_done"], row["warned"] = "ok", None, 0, 0
    for i in range(steps):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                loss = float(svi.step(*data.args, **data.kwargs))
            except Exception as e:
                row["kind"] = raised_where(e)
                row["error"] = f"step {i}: {type(e).__name__}: {str(e)[:200]}"
                break
        row["steps_done"] = i + 1
        if not math.isfinite(loss):
            if any(str(w.message).startswith("CVI(): this step was skipped") for w in said):
                row["warned"] += 1  # skipped with a warning that says so: not silent
                continue
            row["kind"], row["error"] = "nonfinite", f"step {i}: loss {loss}"
            break
    return row


def sweep(names, dtypes, guides, steps, fixed, out) -> int:
    """The error sweep (``--errors``): prints a line per failing run, then the verdict."""
    import torch
    from zoo import ZOO

    rows = []
    for name in names:
        entry = ZOO[name]
        for dt in dtypes:
            dtype = getattr(torch, dt)
            built, _ = _model(entry, dtype)
            hidden = built[1] if isinstance(built, tuple) else built
            size = latent_size(hidden, entry.data(dtype))
            for g in guides:
                if g in GUIDES[2:] and size > JOINT_MAX:
                    continue
                for step in ("auto", fixed):
                    r = sweep_one(entry, dtype, g, step, steps)
                    rows.append(r)
                    if r["kind"] != "ok":
                        print(
                            f"{name:28s} {dt:8s} {g:30s} {r['step']:9s} {r['kind']:9s} "
                            f"{r['error'][:150]}",
                            flush=True,
                        )
    bad = [r for r in rows if r["kind"] in ("raw", "nonfinite")]
    own = [r for r in rows if r["kind"] == "own"]
    line = (
        f"Verdict: {len(rows)} runs of {steps} steps; {len(bad)} raw errors or silent non-finite "
        f"losses, {len(own)} project errors, {len(rows) - len(bad) - len(own)} ran"
    )
    print(line)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows, "verdict": line}, indent=1))
    print(f"wrote {path}")
    return 1 if bad else 0


def key(row):
    return (row["model"], row["dtype"], row["guide"], row["optim"])


def compare(rows, before):
    """Row-by-row against a record: ``(worse, better, changed_runs)`` lists of texts."""
    old = {key(r): r for r in before}
    worse, better, runs = [], [], []
    for r in rows:
        o = old.get(key(r))
        if o is None:
            continue
        if bool(o["error"]) != bool(r["error"]):
            runs.append(
                f"{'/'.join(key(r))}: {'diverged' if o['error'] else 'ran'} -> "
                f"{'diverged' if r['error'] else 'ran'}"
            )
        a, b = o["bound"], r["bound"]
        tol = max(0.5, 3.0 * math.hypot(o["se"], r["se"]) if math.isfinite(a + b) else 0.5)
        text = f"{'/'.join(key(r))}: {a:.2f} -> {b:.2f}"
        if b > a + tol or (math.isfinite(a) and not math.isfinite(b)):
            worse.append(text)
        elif b < a - tol or (math.isfinite(b) and not math.isfinite(a)):
            better.append(text)
    return worse, better, runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="*", default=None, help="zoo keys (default: all)")
    ap.add_argument("--dtypes", nargs="*", default=["float32", "float64"])
    ap.add_argument("--guides", nargs="*", default=list(GUIDES))
    ap.add_argument("--steps", type=int, default=None, help="300 (--errors: 30)")
    ap.add_argument("--errors", action="store_true", help="sweep for errors (see above)")
    ap.add_argument("--fixed", type=float, default=0.5, help="--errors: the fixed step")
    ap.add_argument("--no-adam", action="store_true", help="skip AutoNormal + Adam")
    ap.add_argument("--M", type=int, default=10, help="calls of the bound estimator")
    ap.add_argument("--P", type=int, default=10, help="particles per call")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_MODELS}, float64, 100 steps")
    ap.add_argument("--out", default=str(ROOT / "results" / "benchmark_dropin_zoo.json"))
    ap.add_argument("--compare", default=None, help="a record of this script (before)")
    ap.add_argument("--checkout", default=None, help="the checkout whose pyro_cvi runs")
    a = ap.parse_args(argv)
    _setup(a.checkout)
    import torch
    from zoo import ZOO

    import pyro_cvi

    torch.set_num_threads(1)
    if a.errors:
        out = (
            a.out
            if "--out" in (argv or sys.argv)
            else str(ROOT / "results/quick/benchmark_dropin_zoo_errors.json")
        )
        return sweep(a.models or list(ZOO), a.dtypes, a.guides, a.steps or 30, a.fixed, out)
    a.steps = a.steps or 300
    if a.quick:
        a.models = a.models or list(QUICK_MODELS)
        a.dtypes, a.steps = ["float64"], 100
    names = a.models or list(ZOO)
    print(f"pyro_cvi from {Path(pyro_cvi.__file__).parent}", flush=True)
    rows = []
    for name in names:
        entry = ZOO[name]
        for dt in a.dtypes:
            dtype = getattr(torch, dt)
            built, _ = _model(entry, dtype)
            hidden = built[1] if isinstance(built, tuple) else built
            size = latent_size(hidden, entry.data(dtype))
            runs = [(g, "CVI", None) for g in a.guides]
            if not a.no_adam:
                runs += [("AutoNormal", "Adam", lr) for lr in ADAM_LRS]
            for g, opt, lr in runs:
                if g in GUIDES[2:] and size > JOINT_MAX:
                    continue
                r = run_one(entry, dtype, g, opt, lr, a.steps, a.M, a.P)
                r["latent_size"] = size
                rows.append(r)
                status = "ran" if not r["error"] else f"FAILED {r['error'][:90]}"
                print(
                    f"{name:32s} {dt:8s} {g:30s} {r['optim']:9s} {r['bound']:12.2f} "
                    f"+- {r['se']:.2f}  {r['cpu']:6.1f}s  {status}",
                    flush=True,
                )
    cvi = [r for r in rows if r["optim"] == "CVI"]
    diverged = [f"{'/'.join(key(r)[:3])} ({r['error'][:60]})" for r in cvi if r["error"]]
    # AutoNormal + CVI() against AutoNormal + Adam's best lr, same steps
    gaps = []
    for r in cvi:
        if r["guide"] != "AutoNormal":
            continue
        adam = [
            x["bound"]
            for x in rows
            if x["optim"].startswith("Adam")
            and x["model"] == r["model"]
            and x["dtype"] == r["dtype"]
        ]
        if adam:
            best = min(adam)
            gaps.append((r["model"], r["dtype"], r["bound"], best, r["bound"] - best))
    behind = [g for g in gaps if not g[4] <= max(0.5, 0.005 * abs(g[3]))]
    line = (
        f"Verdict: {len(cvi) - len(diverged)} of {len(cvi)} CVI() runs ran {a.steps} steps, "
        f"{len(diverged)} raised or went non-finite"
        + (f" ({'; '.join(diverged)})" if diverged else "")
        + (
            f"; AutoNormal + CVI() within max(0.5 nat, 0.5%) of AutoNormal + Adam's best lr on "
            f"{len(gaps) - len(behind)} of {len(gaps)}"
            if gaps
            else ""
        )
    )
    payload = {"args": vars(a), "rows": rows, "adam_gaps": gaps}
    if a.compare:
        before = json.loads(Path(a.compare).read_text())["rows"]
        worse, better, runs = compare(rows, before)
        payload["compare"] = {"record": a.compare, "worse": worse, "better": better, "runs": runs}
        for title, items in (("worse", worse), ("better", better), ("ran/diverged", runs)):
            print(f"{title}: {len(items)}")
            for t in items:
                print("   ", t)
        line += f"; against {Path(a.compare).name}: {len(worse)} worse, {len(better)} better"
    print(line)
    payload["verdict"] = line
    from bench.reporting import quick_path

    out = quick_path(a.out, a.quick)  # (--quick: results/quick/, git-ignored)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
