"""AutoCVI against the drop-in on every zoo model: the measurement of "AutoCVI never loses".

For each model (default: every zoo model, the client models of ``tests/zoo/clients.py``
first) and each dtype (float32, float64), one process, one torch thread, back to back:

* ``autocvi``: ``SVI(model, AutoCVI(model), CVI(), CVI_ELBO())``, 300 steps (defaults).
* ``cvi_normal`` / ``cvi_mvn``: ``CVI()`` on ``AutoNormal`` / ``AutoMultivariateNormal`` with
  ``Trace_ELBO`` (``TraceEnum_ELBO`` over the enumerated discrete sites), 400 steps.
* ``adam_normal`` / ``adam_lowrank`` / ``adam_mvn``: ``AutoNormal`` /
  ``AutoLowRankMultivariateNormal`` / ``AutoMultivariateNormal`` + Adam, each learning rate of
  the grid {0.003, 0.01, 0.03, 0.1} given 3x AutoCVI's process CPU time (3x ``cvi_normal``'s
  where AutoCVI raised); the best by a 200-draw estimate is kept.

Every fitted guide is scored by one estimator: ``-ELBO`` from 1000 draws (``M`` calls of
``Trace_ELBO(num_particles=P, vectorize_particles=False)``, ``TraceEnum_ELBO`` where the guide
leaves discrete sites to the model), with its standard error (spread of the ``M`` call means).
For AutoCVI also: its reported loss (mean of the last 20 step losses) against that estimate,
``z = (reported - estimate) / se`` (se of both combined), and the count of non-finite step
losses. Where a NUTS reference exists (``tests/zoo/references``), the mean over parameters of
``|posterior mean - NUTS mean| / NUTS sd`` from 1000 draws of each guide (on the model's
symmetry-free quantities, ``zoo.clients.CANONICAL``). A row says whether AutoCVI is no worse
than each competitor: its estimate at most ``max(0.5 nat, 0.5%)`` above the competitor's.

    python scripts/benchmark_remainder.py [--models a,b] [--dtype float32|float64|both]
        [--steps-scale 0.25] [--quick] [--out FILE]

``--quick``: ``--steps-scale 0.25`` (unless given), Adam at lr 0.03 only, 200 draws per
estimate, output under ``results/quick/`` (git-ignored). An error in one method is recorded
in its cell (text) and the row goes on; an error outside the methods is recorded in the row.

To measure a change to AutoCVI alone, reuse the competitors of an earlier run (their Adam
budget stays that run's) and rescore joined runs against the references on disk::

    python scripts/benchmark_remainder.py --competitors-from results/benchmark_remainder.json
    python scripts/benchmark_remainder.py --report run_a.json run_b.json --out joined.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import traceback
import warnings
from pathlib import Path

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer import SVI, Trace_ELBO, TraceEnum_ELBO
from pyro.infer.autoguide import (
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)
from pyro.poutine.util import site_is_subsample

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench.reporting import Table, write_results  # noqa: E402

from pyro_cvi import CVI, CVI_ELBO, AutoCVI  # noqa: E402
from tests.zoo import ZOO  # noqa: E402
from tests.zoo.clients import CLIENTS  # noqa: E402
from tests.zoo.reference import (  # noqa: E402
    latent_sites,
    load_reference,
    max_plate_nesting,
    mean_error,
    posterior_means,
)

DTYPES = {"float32": torch.float32, "float64": torch.float64}
LRS = (0.003, 0.01, 0.03, 0.1)
AUTOCVI_STEPS, CVI_STEPS = 300, 400
DRAWS, CHUNK = 1000, 20  # the -ELBO estimate: DRAWS particles in calls of CHUNK
SELECT_DRAWS = 200  # the estimate that picks Adam's learning rate
POSTERIOR_DRAWS = 1000
COMPETITORS = ("cvi_normal", "cvi_mvn", "adam_normal", "adam_lowrank", "adam_mvn")
GUIDES = {
    "normal": AutoNormal,
    "lowrank": AutoLowRankMultivariateNormal,
    "mvn": AutoMultivariateNormal,
}


# ---------------------------------------------------------------- the model as fitted
class Case:
    """One (model, dtype): the model, its data, and how Pyro's guides see it."""

    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype
        self.entry = ZOO[name]
        self.data = self.entry.data(dtype)
        self.model, self.guide_kwargs = self.entry.build(dtype)
        self.nesting = max_plate_nesting(self.model, self.data)
        self.sites = latent_sites(self.model, self.data)
        self.same_data = dtype == torch.float64 or _same(self.data, self.entry.data(torch.float64))

    @property
    def hidden_model(self):
        """The model with its enumerated discrete sites hidden from Pyro's autoguides."""
        if not self.entry.has_discrete:
            return self.model

        def enumerated(msg):
            return msg["type"] == "sample" and msg["infer"].get("enumerate") == "parallel"

        return poutine.block(self.model, hide_fn=enumerated)

    def elbo(self, guide=None, **kw):
        """Trace_ELBO when ``guide`` samples every latent the model draws, else TraceEnum_ELBO
        (the discrete sites the guide leaves to the model's enumeration)."""
        if guide is not None and self.entry.has_discrete:
            args, kwargs = self.data.args, self.data.kwargs
            with torch.no_grad(), poutine.block():
                tr = poutine.trace(guide).get_trace(*args, **kwargs)
                mtr = poutine.trace(poutine.replay(self.model, trace=tr)).get_trace(*args, **kwargs)
            missing = [
                n
                for n, s in mtr.nodes.items()
                if s["type"] == "sample" and not s["is_observed"] and n not in tr.nodes
                if not site_is_subsample(s) and s["fn"].support.is_discrete
            ]
            if not missing:
                return Trace_ELBO(**kw)
        if self.entry.has_discrete:
            return TraceEnum_ELBO(max_plate_nesting=self.nesting, **kw)
        return Trace_ELBO(**kw)

    def inits(self):
        init = self.guide_kwargs.get("init_loc_fn")
        return {"init_loc_fn": init} if init is not None else {}


def _same(a, b) -> bool:
    """Whether two ZooData hold the same numbers (up to the float32 cast)."""
    for x, y in zip(list(a.args) + list(a.kwargs.values()), list(b.args) + list(b.kwargs.values())):
        if torch.is_tensor(x) and x.is_floating_point():
            if x.shape != y.shape or not torch.allclose(
                x.double(), y.double(), rtol=1e-6, atol=1e-6
            ):
                return False
    return True


def estimate(case: Case, guide, draws: int = DRAWS) -> dict:
    """``-ELBO`` of ``guide`` from ``draws`` particles in calls of :data:`CHUNK`, with its
    standard error; ``inf`` when any call is non-finite."""
    chunk = min(CHUNK, draws)
    elbo = case.elbo(guide, num_particles=chunk, vectorize_particles=False)
    vals = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(max(1, draws // chunk)):
            vals.append(elbo.loss(case.model, guide, *case.data.args, **case.data.kwargs))
    v = torch.tensor(vals, dtype=torch.float64)
    if not bool(torch.isfinite(v).all()):
        return {"elbo": math.inf, "se": math.inf, "draws": draws}
    return {"elbo": float(v.mean()), "se": float(v.std() / math.sqrt(len(v))), "draws": draws}


def posterior_draws(case: Case, guide, n: int = POSTERIOR_DRAWS) -> dict:
    """``{site: (n, *shape)}`` for the model's continuous latent sites, from ``n`` runs of
    ``guide`` (vectorised under an outer plate where the guide allows it)."""
    args, kwargs = case.data.args, case.data.kwargs
    with torch.no_grad(), poutine.block(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            plate = pyro.plate("_posterior_draws", n, dim=-(case.nesting + 1))
            with plate:
                tr = poutine.trace(guide).get_trace(*args, **kwargs)
            out = {k: tr.nodes[k]["value"].reshape(n, *s) for k, s in case.sites.items()}
            return out
        except Exception:  # a guide that does not vectorise: one run per draw
            runs = [poutine.trace(guide).get_trace(*args, **kwargs) for _ in range(n)]
            return {k: torch.stack([r.nodes[k]["value"] for r in runs]) for k in case.sites}


def score(case: Case, guide, ref, draws: int = DRAWS) -> dict:
    """The -ELBO estimate, the posterior means of the model's (canonical) latent quantities
    from :data:`POSTERIOR_DRAWS` draws, and their distance from the NUTS reference where
    the reference applies (float32 rows only where their data are the float64 data cast)."""
    out = estimate(case, guide, draws)
    if not math.isfinite(out["elbo"]):
        return out
    try:
        out["means"] = posterior_means(case.name, posterior_draws(case, guide))
    except Exception as e:  # reported in the cell
        out["means_error"] = _err(e)
    _compare(case.name, out, ref, case.same_data)
    return out


def _compare(name: str, out: dict, ref, same_data: bool) -> None:
    out.pop("nuts", None)
    if ref is None or "means" not in out:
        return
    if not same_data:
        out["nuts_skipped"] = "this dtype's data are not the float64 data the reference used"
        return
    try:
        out["nuts"] = mean_error(name, out["means"], ref)
    except Exception as e:  # reported in the cell
        out["nuts_error"] = _err(e)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:400]


# ---------------------------------------------------------------- the methods
def _steps(svi, case: Case, steps: int, budget: float = math.inf):
    """``steps`` steps (or until ``budget`` CPU seconds); losses and CPU seconds."""
    losses, t0 = [], time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            losses.append(float(svi.step(*case.data.args, **case.data.kwargs)))
            if time.process_time() - t0 >= budget:
                break
    return losses, time.process_time() - t0


def run_autocvi(case: Case, steps: int, ref, draws: int, max_cpu: float = math.inf) -> dict:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(case.model, **case.guide_kwargs)
    svi = SVI(case.model, guide, CVI(), CVI_ELBO())
    losses, cpu = _steps(svi, case, steps, max_cpu)
    out = {"steps": len(losses), "cpu": cpu, "nonfinite": sum(not math.isfinite(v) for v in losses)}
    out["capped"] = len(losses) < steps  # stopped at max_cpu
    last = torch.tensor(losses[-20:], dtype=torch.float64)
    out["reported"] = float(last.mean())
    out["reported_se"] = float(last.std() / math.sqrt(len(last))) if len(last) > 1 else 0.0
    out.update(score(case, guide, ref, draws))
    se = math.sqrt(out["se"] ** 2 + out["reported_se"] ** 2)
    if math.isfinite(out["elbo"]) and math.isfinite(out["reported"]):
        out["z"] = (out["reported"] - out["elbo"]) / max(se, 1e-7 * abs(out["elbo"]))
    try:
        out["kinds"] = _kinds(guide)
    except Exception:  # the analysis is reported where it exists
        pass
    return out


def _kinds(guide) -> str:
    fams, facs = {}, {}
    for info in guide.engine.analysis.latents.values():
        key = f"{info.family.name if info.family is not None else 'leaf'}/{info.form}"
        fams[key] = fams.get(key, 0) + 1
        for f in info.factors:
            facs[f.kind] = facs.get(f.kind, 0) + 1
    q = ", ".join(f"{k} x{v}" for k, v in fams.items())
    return f"q: {q}; factors: " + ", ".join(f"{k} {v}" for k, v in facs.items())


def run_cvi(case: Case, kind: str, steps: int, ref, draws: int, max_cpu: float = math.inf) -> dict:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = GUIDES[kind](case.hidden_model, **case.inits())
    svi = SVI(case.model, guide, CVI(), case.elbo())
    losses, cpu = _steps(svi, case, steps, max_cpu)
    out = {"steps": len(losses), "cpu": cpu, "nonfinite": sum(not math.isfinite(v) for v in losses)}
    out["capped"] = len(losses) < steps
    out.update(score(case, guide, ref, draws))
    return out


def run_adam(case: Case, kind: str, budget: float, lrs, ref, draws: int) -> dict:
    """Each lr of ``lrs`` for ``budget`` CPU seconds; the best by a short estimate is scored."""
    best, tried = None, {}
    for lr in lrs:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        try:
            guide = GUIDES[kind](case.hidden_model, **case.inits())
            svi = SVI(case.model, guide, pyro.optim.Adam({"lr": lr}), case.elbo())
            losses, cpu = _steps(svi, case, 10**9, budget)
            quick = estimate(case, guide, min(SELECT_DRAWS, draws))
            tried[lr] = quick["elbo"]
        except Exception as e:  # one lr that fails is recorded, the grid goes on
            tried[lr] = _err(e)
            continue
        if best is None or quick["elbo"] < best[0]:
            best = (quick["elbo"], lr, guide, len(losses), cpu, pyro.get_param_store().get_state())
    if best is None:
        return {"error": "every learning rate failed", "tried": tried}
    _, lr, guide, steps, cpu, state = best
    pyro.get_param_store().set_state(state)
    out = {"lr": lr, "steps": steps, "cpu": cpu, "budget": budget, "tried": tried}
    out.update(score(case, guide, ref, draws))
    return out


def no_worse(autocvi: dict, other: dict):
    """AutoCVI's -ELBO at most max(0.5 nat, 0.5%) above ``other``'s (None if either failed
    to produce a number; a competitor that failed counts as beaten)."""
    a, b = autocvi.get("elbo"), other.get("elbo")
    if a is None or not math.isfinite(a):
        return False
    if b is None or not math.isfinite(b):
        return True
    return a <= b + max(0.5, 0.005 * abs(b))


def run_case(
    name: str,
    dtype: torch.dtype,
    scale: float,
    lrs,
    draws: int,
    stored=None,
    max_cpu: float = math.inf,
) -> dict:
    """One (model, dtype) row; the competitors' cells taken from ``stored`` (a row of an
    earlier run) when given, so that only AutoCVI runs."""
    row = {"model": name, "dtype": str(dtype).replace("torch.", ""), "client": name in CLIENTS}
    try:
        case = Case(name, dtype)
        ref = load_reference(name)
        row["reference"] = ref is not None
        row["same_data"] = case.same_data
        cvi_steps = max(5, round(CVI_STEPS * scale))
        methods = {}
        try:
            n = max(5, round(AUTOCVI_STEPS * scale))
            methods["autocvi"] = run_autocvi(case, n, ref, draws, max_cpu)
        except Exception as e:
            methods["autocvi"] = {"error": _err(e), "trace": traceback.format_exc()[-1500:]}
        if stored is not None:
            methods.update({c: stored["methods"][c] for c in COMPETITORS})
            row["competitors_from"] = stored.get("source_file", "an earlier run")
            row["adam_budget_basis"] = stored.get("adam_budget_basis")
        for kind in ("normal", "mvn") if stored is None else ():
            try:
                methods[f"cvi_{kind}"] = run_cvi(case, kind, cvi_steps, ref, draws, max_cpu)
            except Exception as e:
                methods[f"cvi_{kind}"] = {"error": _err(e)}
        if stored is None:
            budget = 3.0 * methods["autocvi"].get("cpu", methods["cvi_normal"].get("cpu", 10.0))
            row["adam_budget_capped"] = budget > max_cpu
            budget = min(budget, max_cpu)
            row["adam_budget_basis"] = "autocvi" if "cpu" in methods["autocvi"] else "cvi_normal"
        for kind in ("normal", "lowrank", "mvn") if stored is None else ():
            try:
                methods[f"adam_{kind}"] = run_adam(case, kind, budget, lrs, ref, draws)
            except Exception as e:
                methods[f"adam_{kind}"] = {"error": _err(e)}
        row["methods"] = methods
        row["no_worse"] = {c: no_worse(methods["autocvi"], methods[c]) for c in COMPETITORS}
    except Exception as e:  # outside any one method: recorded in the row
        row["error"] = _err(e)
        row["trace"] = traceback.format_exc()[-1500:]
    return row


# ---------------------------------------------------------------- the table
def _cell(m: dict) -> str:
    if m is None:
        return "-"
    if "error" in m:
        return "error"
    if not math.isfinite(m.get("elbo", math.inf)):
        return "non-finite"
    s = f"{m['elbo']:.1f}+-{m['se']:.1f}"
    if "nuts" in m:
        s += f" [{m['nuts']['mean']:.2f}sd]"
    return s


COLUMNS = [
    ("model", "zoo entry (client models first); dtype"),
    ("autocvi", "AutoCVI + CVI() + CVI_ELBO: -ELBO +- se [mean |mean - NUTS| / NUTS sd]"),
    ("z", "AutoCVI's reported loss (mean of its last 20 steps) - estimate, in combined se"),
    ("nf", "AutoCVI's non-finite step losses"),
    ("cpu", "AutoCVI's CPU seconds ('cap': stopped at --max-cpu before its steps)"),
    ("cvi_normal", "CVI() on AutoNormal, Trace_ELBO / TraceEnum_ELBO, 400 steps"),
    ("cvi_mvn", "CVI() on AutoMultivariateNormal, 400 steps"),
    ("adam_normal", "AutoNormal + Adam, best lr of the grid, 3x AutoCVI's CPU time"),
    ("adam_lowrank", "AutoLowRankMultivariateNormal + Adam, likewise"),
    ("adam_mvn", "AutoMultivariateNormal + Adam, likewise"),
    ("no worse", "competitors AutoCVI is no worse than (max(0.5 nat, 0.5%)), of 5"),
]


def report(rows, title: str):
    table = Table(title, COLUMNS)
    for r in rows:
        label = f"{r['model']} {r['dtype'].replace('float', 'f')}"
        if "error" in r:
            table.add(label, "error", *["-"] * 9)
            table.note(label, r["error"])
            continue
        m = r["methods"]
        a = m["autocvi"]
        z = a.get("z")
        table.add(
            label,
            _cell(a),
            "-" if z is None else f"{z:+.1f}",
            str(a.get("nonfinite", "-")),
            (f"{a['cpu']:.1f}" + (" cap" if a.get("capped") else "")) if "cpu" in a else "-",
            *[_cell(m[c]) for c in COMPETITORS],
            f"{sum(r['no_worse'].values())}/5",
        )
        for k, v in m.items():
            if "error" in v:
                table.note(label, f"{k}: {v['error']}")
        if "kinds" in a:
            table.note(label, f"autocvi {a['kinds']}")
    table.print()
    done = [r for r in rows if "error" not in r]
    ok = [r for r in done if all(r["no_worse"].values())]
    bound = [r for r in done if r["methods"]["autocvi"].get("z") is not None]
    bound_ok = [r for r in bound if abs(r["methods"]["autocvi"]["z"]) <= 3]
    finite = [r for r in done if r["methods"]["autocvi"].get("nonfinite") == 0]
    near = [
        r
        for r in done
        if "nuts" in r["methods"]["autocvi"] and r["methods"]["autocvi"]["nuts"]["mean"] <= 0.2
    ]
    with_ref = [r for r in done if r.get("reference")]
    line = (
        f"Verdict: AutoCVI was no worse than all five competitors on {len(ok)} of {len(rows)} "
        f"(model, dtype) rows; its reported loss was within 3 se of the estimate on "
        f"{len(bound_ok)} of {len(rows)}; no non-finite loss on {len(finite)} of {len(rows)}; "
        f"posterior means within 0.2 NUTS sd on {len(near)} of {len(with_ref)} rows with a "
        f"reference."
    )
    print(line)
    return table, line


def rereport(a) -> None:
    """The table of earlier runs (``--report``), NUTS distances recomputed from their stored
    posterior means with the references on disk now (written after the runs, or updated)."""
    runs = [json.loads(Path(f).read_text()) for f in a.report]
    rows = [r for run in runs for r in run["rows"]]
    order = {n: i for i, n in enumerate(_default_models())}
    rows.sort(key=lambda r: (order.get(r["model"], len(order)), r["dtype"]))
    for r in rows:
        ref = load_reference(r["model"])
        r["reference"] = ref is not None
        for m in r.get("methods", {}).values():
            _compare(r["model"], m, ref, r.get("same_data", r["dtype"] == "float64"))
    title = "AutoCVI against CVI() on Pyro's guides and Adam, every zoo model, both dtypes"
    table, line = report(rows, title)
    meta = runs[0].get("meta", {})
    quick = bool(meta.get("quick"))
    out = a.out or str(ROOT / "results" / ("quick/" if quick else "") / "benchmark_remainder.json")
    write_results(
        out,
        {"meta": meta, "rows": rows},
        title="AutoCVI's remainder: AutoCVI against the drop-in on the zoo",
        verdict=line,
        tables=[table],
        command="python scripts/benchmark_remainder.py " + " ".join(sys.argv[1:]),
        quick=quick,
        text="CPU seconds (process time, one torch thread) on a shared 2-core machine.",
    )


def _default_models():
    return list(CLIENTS) + [n for n in ZOO if n not in CLIENTS]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default=None, help="comma-separated zoo names (default: all)")
    p.add_argument("--dtype", default="both", choices=("float32", "float64", "both"))
    p.add_argument("--steps-scale", type=float, default=None, help="multiplies every step count")
    p.add_argument("--quick", action="store_true", help="steps x0.25, one lr, 200 draws")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--max-cpu",
        type=float,
        default=600.0,
        help="CPU seconds after which AutoCVI's and CVI()'s steps stop, and the most each Adam "
        "run gets (recorded as capped)",
    )
    p.add_argument(
        "--competitors-from",
        nargs="+",
        default=None,
        help="reuse the competitors' cells of earlier JSON outputs (same model and dtype) and "
        "run AutoCVI only; rows missing there run in full",
    )
    p.add_argument(
        "--report",
        nargs="+",
        default=None,
        help="join earlier JSON outputs, rescore their posterior means against the current "
        "NUTS references, print the table and write --out",
    )
    a = p.parse_args(argv)
    if a.report:
        return rereport(a)
    torch.set_num_threads(1)
    pyro.enable_validation(False)
    scale = a.steps_scale if a.steps_scale is not None else (0.25 if a.quick else 1.0)
    lrs = (0.03,) if a.quick else LRS
    draws = SELECT_DRAWS if a.quick else DRAWS
    names = a.models.split(",") if a.models else _default_models()
    dtypes = list(DTYPES.values()) if a.dtype == "both" else [DTYPES[a.dtype]]
    sub = "quick/" if a.quick else ""
    out = a.out or str(ROOT / "results" / sub / "benchmark_remainder.json")
    stored = {}
    for f in a.competitors_from or ():
        for r in json.loads(Path(f).read_text())["rows"]:
            if "methods" in r and all(c in r["methods"] for c in COMPETITORS):
                stored[r["model"], r["dtype"]] = {**r, "source_file": f}
    rows = []
    for name in names:
        for dtype in dtypes:
            t0 = time.process_time()
            key = (name, str(dtype).replace("torch.", ""))
            rows.append(run_case(name, dtype, scale, lrs, draws, stored.get(key), a.max_cpu))
            r = rows[-1]
            a_ = r.get("methods", {}).get("autocvi", {})
            print(
                f"{name} {r['dtype']}: autocvi {_cell(a_) if a_ else r.get('error')} "
                f"({time.process_time() - t0:.0f} CPU s for the row)",
                file=sys.stderr,
                flush=True,
            )
            partial = Path(out).with_suffix(".partial.json")
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({"rows": rows}, default=float))
    title = "AutoCVI against CVI() on Pyro's guides and Adam, every zoo model, both dtypes"
    table, line = report(rows, title)
    meta = {
        "quick": a.quick,
        "steps_scale": scale,
        "lrs": lrs,
        "draws": draws,
        "chunk": CHUNK,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyro": pyro.__version__,
    }
    write_results(
        out,
        {"meta": meta, "rows": rows},
        title="AutoCVI's remainder: AutoCVI against the drop-in on the zoo",
        verdict=line,
        tables=[table],
        command="python scripts/benchmark_remainder.py " + " ".join(sys.argv[1:]),
        quick=a.quick,
        text="CPU seconds (process time, one torch thread) on a shared 2-core machine.",
    )


if __name__ == "__main__":
    main()
