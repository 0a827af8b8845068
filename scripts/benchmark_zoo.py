"""The zoo benchmark: AutoCVI against Pyro's own guides on models from Pyro's tutorials/examples.

For every model of ``tests/zoo`` (see ``tests/zoo/__init__.py``), in one process, back to back:

* ``cvi``: ``SVI(model, AutoCVI(model), CVI(), CVI_ELBO())`` for the entry's number of
  steps (the default adaptive step, no per-model tuning). Its wall time ``T``
  is the budget of every baseline.
* ``normal``: ``AutoNormal`` + Adam (``Trace_ELBO``; ``TraceEnum_ELBO`` with the discrete sites
  enumerated where the model has any), trained for the same wall time ``T``, best of a small
  learning-rate grid (each grid point gets ``T``).
* ``mvn``: ``AutoMultivariateNormal`` + Adam, likewise, where the latent dimension is <= 300.
* extra baselines of an entry (the hand-written guide of Pyro's sparse gamma DEF example).

Every guide is then scored by ONE common estimator: the -ELBO of its bound estimated by
``Trace_ELBO`` (``TraceEnum_ELBO`` for models with discrete latents; AutoCVI's guide samples
its discrete sites, the baselines' are enumerated) with ``M`` calls of ``P`` particles, with its
standard error; and by the entry's held-out metric where one exists (mean log predictive
density of held-out points, nats, higher is better).

Columns: ``model``; ``kinds``: CVI's q families and factor kinds found by its analysis (as in
``guide.explain()``); ``cvi``: -ELBO +- se, and wall time; ``normal`` / ``mvn`` / ``extra``: the
same for the baselines at equal wall time; ``heldout``: the held-out metric (cvi / best
baseline); ``verdict``: ``better`` (CVI's -ELBO lower by more than 2 combined se), ``tie``
(within 2 se), ``worse`` (with the reason, from ``REASONS`` or the numbers).

    python scripts/benchmark_zoo.py [--quick] [--bound-only] [--models coin lda] [--out FILE]

``--natgrad`` runs the other table instead: Pyro's own Gaussian guides
(``AutoNormal``, ``AutoMultivariateNormal``, ``AutoLowRankMultivariateNormal``) with their usual
loss (``Trace_ELBO``; ``TraceEnum_ELBO`` with discrete sites enumerated), stepped by ``CVI()``
(natural gradients, ``pyro_cvi.natgrad``) for 400 steps beside Adam for 2000 steps, best of
lr in {0.005, 0.01, 0.02, 0.05}; same common estimator; ``reached``: CVI's -ELBO within the
larger of 0.5 nat and 0.5% of Adam's best; ``time``: CVI's wall time / the best Adam run's.
``--natgrad --quick``: 100 CVI steps against 500 Adam steps at lr 0.05, fewer models.

    python scripts/benchmark_zoo.py --natgrad [--quick] [--models ...] [--out FILE]

Timings are wall-clock on a shared machine, one torch thread, Pyro validation off.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import warnings
from pathlib import Path

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO, TraceEnum_ELBO
from pyro.infer.autoguide import (
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: tests/zoo
from bench.reporting import Table, quick_path, write_results  # noqa: E402
from bench.zoo_runs import hide_discrete, latent_size, zoo_elbo  # noqa: E402

from pyro_cvi import CVI, CVI_ELBO, AutoCVI  # noqa: E402
from tests.zoo import ZOO  # noqa: E402

# Why CVI loses where it does (filled from measurements).
REASONS = {}


def _baseline_model(entry):
    """The entry's model as a baseline autoguide sees it (enumerated sites hidden)."""
    return hide_discrete(entry.model) if entry.has_discrete else entry.model


def _elbo_cls(entry):
    return TraceEnum_ELBO if entry.has_discrete else Trace_ELBO


def evaluate(entry, guide, data, M: int, P: int, model=None):
    """Common estimator: mean and standard error of the -ELBO over ``M`` calls of ``P``
    particles, the same for every guide of a model."""
    elbo = zoo_elbo(entry, num_particles=P)
    model = entry.model if model is None else model
    vals = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(M):
            vals.append(elbo.loss(model, guide, *data.args, **data.kwargs))
    v = torch.tensor(vals, dtype=torch.float64)
    ok = torch.isfinite(v)
    if not bool(ok.all()):
        return float("inf"), float("inf")
    return float(v.mean()), float(v.std() / math.sqrt(M))


def kinds(guide) -> str:
    """CVI's q families and factor kinds, from its analysis (what explain() prints)."""
    fams, facs = {}, {}
    for info in guide.engine.analysis.latents.values():
        fam = info.family.name if info.family is not None else "leaf"
        key = f"{fam}/{info.form}"
        fams[key] = fams.get(key, 0) + 1
        for f in info.factors:
            facs[f.kind] = facs.get(f.kind, 0) + 1
    q = ", ".join(f"{k} x{v}" for k, v in fams.items())
    return f"q: {q}; factors: " + ", ".join(f"{k} {v}" for k, v in facs.items())


def run_cvi(entry, data, steps: int, dtype=None):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, guide_kwargs = entry.build(dtype)
    guide = AutoCVI(model, **guide_kwargs)
    svi = SVI(model, guide, CVI(step_size=entry.step_size), CVI_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = svi.step(*data.args, **data.kwargs)
        wall = time.perf_counter() - t0
    return guide, svi, wall, loss


def bound_check(entry, svi, data, mc, mc_se, repeats: int, eps: float = 1e-7):
    """The loss CVI reports against the common estimator of the same ``q``: CVI's
    ``evaluate_loss`` averaged over ``repeats`` calls (once if it is exact), and
    ``z = (cvi - mc) / se`` with the combined standard error (floored at 1e-7 relative)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vals = [svi.evaluate_loss(*data.args, **data.kwargs) for _ in range(2)]
        if vals[0] != vals[1]:
            vals += [svi.evaluate_loss(*data.args, **data.kwargs) for _ in range(repeats - 2)]
        else:
            vals = vals[:1]
    v = torch.tensor(vals, dtype=torch.float64)
    se = float(v.std() / math.sqrt(len(v))) if len(v) > 1 else 0.0
    tot = math.sqrt(se**2 + mc_se**2)
    tot = max(tot, eps * abs(mc))  # round-off floor where q is exact and both se vanish
    z = (float(v.mean()) - mc) / tot
    return {"cvi_loss": float(v.mean()), "cvi_loss_se": se, "z": z, "exact": len(v) == 1}


def run_adam(entry, data, make_guide, lr: float, budget: float, desc: str):
    """Adam on ``make_guide(model)`` for ``budget`` seconds of wall time (set-up included)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = make_guide(entry)
    elbo = zoo_elbo(entry)
    svi = SVI(entry.model, guide, pyro.optim.Adam({"lr": lr}), elbo)
    steps, t0 = 0, time.perf_counter()
    with warnings.catch_warnings(), tqdm(desc=desc, leave=False, unit="step") as bar:
        warnings.simplefilter("ignore")
        while time.perf_counter() - t0 < budget:
            loss = svi.step(*data.args, **data.kwargs)
            steps += 1
            bar.update()
            if not math.isfinite(loss):
                break
    return guide, time.perf_counter() - t0, steps


def _init_kwargs(entry):
    init = entry.guide_kwargs.get("init_loc_fn")
    return {"init_loc_fn": init} if init is not None else {}


def _normal(entry):
    model = _baseline_model(entry)
    return AutoNormal(model, **_init_kwargs(entry))


def _mvn(entry):
    model = _baseline_model(entry)
    return AutoMultivariateNormal(model, **_init_kwargs(entry))


def _latent_dim(guide) -> int:
    return sum(
        int(info.event_shape.numel() * torch.Size(info.batch_shape).numel())
        for info in guide.engine.analysis.latents.values()
        if info.family is None or not info.family.is_discrete
    )


def bench(name, entry, quick: bool, lrs, M: int, P: int, baselines: bool = True):
    data = entry.data()
    steps = max(3, entry.steps // 4) if quick else entry.steps
    guide, svi, wall, _ = run_cvi(entry, data, steps)
    row = {"model": name, "source": entry.source, "kinds": kinds(guide), "cvi_steps": steps}
    row["cvi"] = dict(zip(("elbo", "se"), evaluate(entry, guide, data, M, P)), time=wall)
    row["bound"] = bound_check(entry, svi, data, row["cvi"]["elbo"], row["cvi"]["se"], M)
    if entry.heldout is not None:
        row["cvi"]["heldout"] = entry.heldout(entry.model, guide, data)
    # the same run in float32 (Pyro's default dtype): its -ELBO and bound check
    data32 = entry.data(torch.float32)
    g32, svi32, wall32, _ = run_cvi(entry, data32, steps, torch.float32)
    model32 = entry.build(torch.float32)[0]
    res = dict(zip(("elbo", "se"), evaluate(entry, g32, data32, M, P, model32)), time=wall32)
    res["bound"] = bound_check(entry, svi32, data32, res["elbo"], res["se"], M, eps=1e-6)
    row["cvi_f32"] = res
    if not baselines:
        row["verdict"], row["reason"] = "-", "baselines skipped"
        return row
    makers = {"normal": _normal}
    if _latent_dim(guide) <= 300:
        makers["mvn"] = _mvn
    for extra, factory in entry.baselines.items():
        makers[extra] = lambda e, factory=factory: factory(e.model)
    for base, make in makers.items():
        best = None
        for lr in lrs:
            try:
                g, t, n = run_adam(entry, data, make, lr, wall, f"{name}/{base}/lr={lr}")
                res = dict(zip(("elbo", "se"), evaluate(entry, g, data, M, P)))
                res.update(time=t, steps=n, lr=lr)
                if entry.heldout is not None and math.isfinite(res["elbo"]):
                    res["heldout"] = entry.heldout(entry.model, g, data)
            except Exception as e:  # a baseline that cannot run is reported, not fatal
                res = {"elbo": float("inf"), "se": 0.0, "time": wall, "error": repr(e)[:200]}
            if best is None or res["elbo"] < best["elbo"]:
                best = res
        row[base] = best
    row["verdict"], row["reason"] = verdict(name, row, list(makers))
    return row


def verdict(name, row, bases):
    cvi = row["cvi"]
    best_name = min(bases, key=lambda b: row[b]["elbo"])
    best = row[best_name]
    if not math.isfinite(best["elbo"]):
        return "better", "no baseline produced a finite bound"
    se = math.sqrt(cvi["se"] ** 2 + best["se"] ** 2)
    diff = cvi["elbo"] - best["elbo"]
    if diff < -2 * se:
        return "better", f"{-diff:.3g} nats below {best_name}"
    if diff <= 2 * se:
        return "tie", f"within 2 se ({diff:+.3g} vs se {se:.2g}) of {best_name}"
    return "worse", REASONS.get(name, f"{diff:.3g} nats above {best_name} (se {se:.2g})")


def _fmt(r):
    if r is None:
        return "-"
    if not math.isfinite(r["elbo"]):
        return "failed"
    return f"{r['elbo']:.2f}+-{r['se']:.2f} ({r['time']:.1f}s)"


COLUMNS = [
    ("model", "zoo entry (tests/zoo)"),
    ("cvi", "AutoCVI + default CVI(): common -ELBO estimate +- se (wall seconds of its steps)"),
    ("cvi f32", "the same in float32, with its bound z"),
    ("normal", "AutoNormal + Adam, best lr of the grid, same wall time: -ELBO +- se (s)"),
    ("mvn", "AutoMultivariateNormal + Adam likewise ('-': latent dimension > 300)"),
    ("other", "extra baselines of the entry (sparse gamma: the example's hand-written guide)"),
    ("lpd", "held-out mean log predictive density, CVI / best baseline (higher is better)"),
    (
        "bound z",
        "(loss svi.step reports - common estimate) / combined se; |z| <= 3: it is the bound",
    ),
    ("verdict", "better / tie (within 2 combined se) / worse than the best baseline's -ELBO"),
]
BASES = ("normal", "mvn")


def _extras(r):
    skip = ("model", "source", "kinds", "cvi_steps", "cvi", "cvi_f32", "verdict", "reason", "bound")
    return [k for k in r if k not in skip + BASES]


def _heldout(r):
    if "heldout" not in r["cvi"]:
        return "-"
    base = [r[b]["heldout"] for b in BASES + tuple(_extras(r)) if r[b].get("heldout") is not None]
    return f"{r['cvi']['heldout']:.3f} / " + (f"{max(base):.3f}" if base else "-")


def report(rows):
    """The table of ``rows`` (a :class:`bench.reporting.Table`) and the verdict line."""
    table = Table("AutoCVI on the zoo, against Pyro's autoguides at equal wall time", COLUMNS)
    for r in rows:
        other = "; ".join(f"{k} {_fmt(r[k])}" for k in _extras(r)) or "-"
        table.add(
            r["model"],
            _fmt(r["cvi"]),
            _fmt(r["cvi_f32"]) + f" z {r['cvi_f32']['bound']['z']:+.1f}",
            _fmt(r.get("normal")),
            _fmt(r.get("mvn")),
            other,
            _heldout(r),
            f"{r['bound']['z']:+.1f}" + (" (exact)" if r["bound"]["exact"] else ""),
            r["verdict"],
        )
        table.note(r["model"], f"{r['verdict']}: {r['reason']}")
        table.note(r["model"], r["kinds"])
    table.print()
    near = sum(abs(r["bound"]["z"]) <= 3 for r in rows)
    ok = [r["model"] for r in rows if r["verdict"] in ("better", "tie")]
    worse = [f"{r['model']} ({r['reason']})" for r in rows if r["verdict"] == "worse"]
    line = (
        f"Verdict: CVI's -ELBO was no worse than the best baseline's at equal wall time on "
        f"{len(ok)} of {len(rows)} zoo models"
        + (f"; worse on: {'; '.join(worse)}" if worse else "")
        + f". The loss svi.step reports was the bound (|z| <= 3) on {near} of {len(rows)}."
    )
    print(line)
    return table, line


# ---------------------------------------------------------------- --natgrad
NATGRAD_GUIDES = {
    "AutoNormal": AutoNormal,
    "AutoMVN": AutoMultivariateNormal,
    "AutoLowRankMVN": AutoLowRankMultivariateNormal,
}
NATGRAD_QUICK_MODELS = ("bayesian_regression", "poisson_regression", "eight_schools_noncentered")


def _gaussian_guide(entry, cls):
    model = _baseline_model(entry)
    return cls(model, **_init_kwargs(entry))


def _run_steps(entry, data, cls, optim, steps: int):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = _gaussian_guide(entry, cls)
    svi = SVI(entry.model, guide, optim, zoo_elbo(entry))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.process_time()  # CPU seconds (one thread): robust to a loaded machine
        for _ in range(steps):
            loss = svi.step(*data.args, **data.kwargs)
            if not math.isfinite(loss):
                break
        cpu = time.process_time() - t0
    return guide, cpu


def bench_natgrad(name, entry, quick: bool, M: int, P: int):
    """CVI() against Adam on each of Pyro's Gaussian guides (one row per guide)."""
    data = entry.data()
    cvi_steps, adam_steps = (100, 500) if quick else (400, 2000)
    lrs = (0.05,) if quick else (0.005, 0.01, 0.02, 0.05)
    rows = []
    for gname, cls in NATGRAD_GUIDES.items():
        if cls is not AutoNormal and latent_size(_baseline_model(entry), data) > 300:
            continue
        row = {"model": name, "guide": gname, "cvi_steps": cvi_steps, "adam_steps": adam_steps}
        try:
            g, wall = _run_steps(entry, data, cls, CVI(), cvi_steps)
            row["cvi"] = dict(zip(("elbo", "se"), evaluate(entry, g, data, M, P)), time=wall)
        except Exception as e:  # reported, not fatal
            row["cvi"] = {"elbo": float("inf"), "se": 0.0, "time": 0.0, "error": repr(e)[:200]}
        best = None
        for lr in lrs:
            try:
                g, wall = _run_steps(entry, data, cls, pyro.optim.Adam({"lr": lr}), adam_steps)
                res = dict(zip(("elbo", "se"), evaluate(entry, g, data, M, P)), time=wall, lr=lr)
            except Exception as e:
                res = {"elbo": float("inf"), "se": 0.0, "time": 0.0, "lr": lr, "error": repr(e)}
            if best is None or res["elbo"] < best["elbo"]:
                best = res
        row["adam"] = best
        a, c = best["elbo"], row["cvi"]["elbo"]
        row["reached"] = bool(math.isfinite(c) and c <= a + max(0.5, 0.005 * abs(a)))
        row["time_ratio"] = row["cvi"]["time"] / best["time"] if best["time"] > 0 else None
        rows.append(row)
    return rows


NATGRAD_COLUMNS = [
    ("model", "zoo entry (tests/zoo)"),
    ("guide", "Pyro's guide, loss Trace_ELBO (TraceEnum_ELBO with enumerated discrete sites)"),
    ("CVI()", "natural-gradient steps: common -ELBO +- se (CPU seconds of its steps)"),
    ("Adam", "best lr of the grid: -ELBO +- se (CPU seconds) [lr]"),
    ("reached", "CVI's -ELBO within max(0.5 nat, 0.5%) of Adam's best"),
    ("time", "CVI CPU time / Adam's (target <= 0.5)"),
]


def report_natgrad(rows, quick: bool):
    steps = f"{rows[0]['cvi_steps']} vs {rows[0]['adam_steps']}" if rows else ""
    table = Table(f"CVI() on Pyro's Gaussian guides against Adam ({steps} steps)", NATGRAD_COLUMNS)
    for r in rows:
        ratio = r["time_ratio"]
        table.add(
            r["model"],
            r["guide"],
            _fmt(r["cvi"]),
            _fmt(r["adam"]) + f" [{r['adam'].get('lr')}]",
            "yes" if r["reached"] else "no",
            "-" if ratio is None else f"{ratio:.2f}",
        )
    table.print()
    ok = [r for r in rows if r["reached"]]
    fast = [r for r in ok if r["time_ratio"] is not None and r["time_ratio"] <= 0.5]
    line = (
        f"Verdict: CVI() reached Adam's best bound on {len(ok)} of {len(rows)} (model, guide) "
        f"rows, in at most half of Adam's CPU time on {len(fast)}"
        + (" (quick settings)" if quick else "")
        + "."
    )
    print(line)
    return table, line


def main_natgrad(a):
    torch.set_num_threads(1)
    pyro.enable_validation(False)
    names = a.models or (list(NATGRAD_QUICK_MODELS) if a.quick else list(ZOO))
    M, P = (10, 10) if a.quick else (50, 20)
    rows = []
    if a.report:  # runs split by --models, joined
        rows = [r for f in a.report for r in json.loads(Path(f).read_text())["rows"]]
        names = []
    for name in tqdm(names, desc="zoo natgrad"):
        rows.extend(bench_natgrad(name, ZOO[name], a.quick, M, P))
        for r in rows[-3:]:
            if r["model"] == name:
                tqdm.write(f"{name}/{r['guide']}: cvi {_fmt(r['cvi'])} adam {_fmt(r['adam'])}")
    table, line = report_natgrad(rows, a.quick)
    meta = {"quick": a.quick, "M": M, "P": P, "torch": torch.__version__, "pyro": pyro.__version__}
    out = a.out if a.out != DEFAULT_OUT else str(ROOT / "results" / "benchmark_zoo_natgrad.json")
    write_results(
        out,
        {"meta": meta, "rows": rows},
        title="Zoo: CVI() natural gradients on Pyro's Gaussian guides against Adam",
        verdict=line,
        tables=[table],
        command="python scripts/benchmark_zoo.py --natgrad"
        + (" --quick" if a.quick else "")
        + (
            " --models " + " ".join(sorted({r["model"] for r in rows}))
            if a.models or a.report
            else ""
        ),
        quick=a.quick,
        text="CPU seconds (one thread) on a shared 2-core machine; CVI and Adam back to back.",
    )


DEFAULT_OUT = str(ROOT / "results" / "benchmark_zoo.json")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer steps and particles (< 2 min)")
    p.add_argument("--models", nargs="*", default=None, help="zoo names (default: all)")
    p.add_argument(
        "--bound-only", action="store_true", help="CVI and its bound check only, no baselines"
    )
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument(
        "--natgrad",
        action="store_true",
        help="CVI() on AutoNormal / AutoMVN / AutoLowRankMVN against Adam",
    )
    p.add_argument(
        "--report",
        nargs="*",
        default=None,
        help="print the table of earlier JSON outputs (e.g. runs split by --models) and exit",
    )
    a = p.parse_args(argv)
    a.out = str(quick_path(a.out, a.quick))  # --quick: under results/quick/
    if a.natgrad:
        return main_natgrad(a)
    if a.report:
        rows = [r for f in a.report for r in json.loads(Path(f).read_text())["rows"]]
        order = {n: i for i, n in enumerate(ZOO)}
        rows = sorted(rows, key=lambda r: order.get(r["model"], len(order)))
        table, line = report(rows)
        meta = json.loads(Path(a.report[0]).read_text())["meta"]
        _write(a.out, meta, rows, table, line, "--report " + " ".join(a.report))
        return
    torch.set_num_threads(1)
    pyro.enable_validation(False)
    names = a.models or list(ZOO)
    lrs = (0.05,) if a.quick else (0.01, 0.05)
    M, P = (10, 10) if a.quick else (50, 20)
    rows = []
    for name in tqdm(names, desc="zoo"):
        rows.append(bench(name, ZOO[name], a.quick, lrs, M, P, not a.bound_only))
        r = rows[-1]
        b = r["bound"]
        tqdm.write(
            f"{name}: cvi {_fmt(r['cvi'])} reported {b['cvi_loss']:.2f} (z {b['z']:+.1f}) "
            f"normal {_fmt(r.get('normal'))} -> {r['verdict']}"
        )
        partial = Path(a.out).with_suffix(".partial.json")  # rows so far, for long runs
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"meta": {"quick": a.quick}, "rows": rows}, default=float))
    table, line = report(rows)
    meta = {
        "quick": a.quick,
        "M": M,
        "P": P,
        "lrs": lrs,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyro": pyro.__version__,
    }
    _write(a.out, meta, rows, table, line, " ".join(sys.argv[1:]))


def _write(out, meta, rows, table, line, args):
    write_results(
        out,
        {"meta": meta, "rows": rows},
        title="Zoo: AutoCVI on models from Pyro's tutorials and examples",
        verdict=line,
        tables=[table],
        command=f"python scripts/benchmark_zoo.py {args}".strip(),
        quick=bool(meta.get("quick")),
        text="Timings on a shared 2-core machine under load; CVI and baselines back to back.",
    )


if __name__ == "__main__":
    main()
