"""Time to the answer on small problems: a fresh process's first call to a converged bound.

What a user waits for on a small problem is set-up (here: tracing, probing, analysis, warm start;
a JAX peer's: model construction and compilation) plus the steps to convergence. Every
configuration runs in a fresh child process (one torch / XLA thread, float64), so imports and
compilation are paid as a user pays them; imports are timed and reported on their own, outside
the time to the answer. Each configuration is repeated (``--repeats``) and the medians reported.
Times are process CPU seconds (``time.process_time``); the machine may be loaded, so the ratios
of one run count.

* ``markov``: the Markov GP of ``scripts/benchmark_peers.py`` (``T`` regular inputs, Poisson
  counts, Matern-3/2 with lengthscale 20 and variance 1 fixed, 10 Gauss-Hermite points, step
  size 1): ``AutoCVI`` + ``CVI(step_size=1)`` against BayesNewton's ``MarkovVariationalGP``
  (``inference(lr=1)`` + ``energy()`` under ``objax.Jit``; ``scripts/peers/bayesnewton_markov.py``
  in the interpreter of ``--bayesnewton-python``). The bound is the -ELBO each returns per step;
  the time to the answer runs from ``AutoCVI(model)`` (BayesNewton: building the model) to the
  first returned bound within 1e-6 relative of the run's last one (its converged value).
* ``a1a``: Bayesian logistic regression on a1a (the paper's protocol, prior precision 2.8072):
  ``AutoCVI`` with the default ``CVI()`` and with ``CVI(step_size=1)`` against the plain-torch
  CVI loop of ``bench.baselines.plain_cvi_logreg`` (step 1, from ``q`` = prior and from the Newton
  start). ``q`` is scored after every step by the exact -ELBO (32-point Gauss-Hermite) outside the
  clock; times to within 0.5 nat of the best -ELBO of any run and to within 1e-6 relative of the
  run's own last -ELBO. ``--checkout PATH`` adds the two ``AutoCVI`` rows of another
  checkout's ``pyro_cvi`` (a before/after in one period); the rows run interleaved, one
  repeat of every row after another.
* ``softmax``: 10-class logistic regression of ``scripts/benchmark_multiclass_speed.py`` (5,000
  training points, 41 features), the default ``CVI()``. **The criterion** ("MAP's test log-loss
  within 1 CPU s"): the time from ``AutoCVI(model)`` in a fresh process (set-up included) to
  the first step after which the plug-in prediction at ``q``'s mean, ``softmax(X E_q W)`` (what
  a user gets from ``guide.median()``), scores MAP's test log-loss (scikit-learn's L-BFGS mode,
  within ``MAP_TOL`` = 1e-6 nats: its mode is exact to about 1e-8 nats of test log-loss, and
  Newton's exact mode scores a few 1e-9 nats above it). The Laplace start makes the first call
  leave ``q`` at the Laplace approximation, whose mean is the mode. Beside it: ``q``'s
  posterior predictive after every step (256 fixed draws, outside the clock), the times to its
  converged value (within 1e-3 and 1e-4 nats of the run's last) and to MAP's log-loss, and to a
  returned bound within 1e-6 relative of the last. **No posterior predictive reaches MAP's
  log-loss here**: the model is misspecified (synthetic clusters, a linear softmax) and MAP
  over-confident in the wrong places, yet averaging over the posterior predicts worse still:
  the Laplace predictive at MAP (exact Hessian, 4,096 draws, printed) scores 0.265, the exact
  posterior by HMC 0.270 (``scripts/softmax_posterior_reference.py``), CVI's converged ``q``
  0.270-0.271, against MAP's plug-in 0.263.

    python scripts/benchmark_time_to_answer.py --bayesnewton-python /path/to/venv/bin/python
    python scripts/benchmark_time_to_answer.py --quick   # T = 200, 1000; 1 repeat; results/quick/

Writes ``results/benchmark_time_to_answer.json``; prints the tables and the ratios (package /
reference: below 1 means the package is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
REL_TOL = 1e-6
NAT_TOL = 0.5
#: "MAP's test log-loss" is reached within this many nats (scikit-learn's mode is inexact)
MAP_TOL = 1e-6
#: the converged predictive: test log-loss within these many nats of the run's last
PRED_TOLS = (1e-3, 1e-4)
MARKOV_POINTS = 10


# ----------------------------------------------------------------------------------------------
# Children: each prints one JSON line; ``hist`` is [(CPU s since the first call, bound, score)].
# ----------------------------------------------------------------------------------------------


def _imports() -> float:
    c = time.process_time()
    import pyro  # noqa: F401
    import torch

    import pyro_cvi  # noqa: F401

    torch.set_num_threads(1)
    return time.process_time() - c


def child_markov(T: int, steps: int) -> dict:
    import_cpu = _imports()
    import pyro
    import pyro.distributions as dist
    import torch
    from benchmark_peers import counts
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI
    from pyro_cvi.statespace import Matern32, markov_gp

    y = counts(T)
    t = torch.arange(T, dtype=torch.float64)

    def model(t, y):
        f = markov_gp("x", t, Matern32(lengthscale=20.0, variance=1.0))
        with pyro.plate("t", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

    c0 = time.process_time()
    guide = AutoCVI(model, num_quad_points=MARKOV_POINTS)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    hist = []
    for _ in range(steps):
        loss = svi.step(t, y)
        hist.append((time.process_time() - c0, float(loss), None))
    return dict(import_cpu=import_cpu, hist=hist)


def _a1a():
    import torch
    from bench.datasets import load_logreg

    data = load_logreg("a1a", dtype=torch.float64)
    return data.X_train, data.y_train, data.prior_precision


def child_a1a(variant: str, steps: int) -> dict:
    import_cpu = _imports()
    import pyro
    import torch
    from bench.baselines import logreg_neg_elbo, make_logreg_model
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI

    X, y, delta = _a1a()
    model = make_logreg_model(delta)
    pyro.set_rng_seed(0)
    c0 = time.process_time()
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI() if variant == "default" else CVI(step_size=1.0), CVI_ELBO())
    hist, cpu = [], 0.0
    for _ in range(steps):
        loss = svi.step(X, y)
        cpu += time.process_time() - c0
        with torch.no_grad():  # outside the clock
            q = guide.posterior("w")
            score = float(logreg_neg_elbo(X, y, q.loc, None, delta, scale_tril=q.scale_tril))
        hist.append((cpu, float(loss), score))
        c0 = time.process_time()
    return dict(import_cpu=import_cpu, hist=hist)


def child_a1a_plain(variant: str, steps: int) -> dict:
    c = time.process_time()
    import torch

    import_cpu = time.process_time() - c
    torch.set_num_threads(1)
    from bench.baselines import plain_cvi_logreg

    X, y, delta = _a1a()
    init = (y - 0.5, torch.tensor(-0.125)) if variant == "newton" else None
    fit = plain_cvi_logreg(
        X, y, delta, 1.0, steps, return_covariance=False, clock=time.process_time,
        init_sites=init,
    )  # fmt: skip
    # point t is q after t steps, its -ELBO computed with the next step's quadrature
    hist = [(p.seconds, p.neg_elbo, p.neg_elbo) for p in fit.history[1:]]
    return dict(import_cpu=import_cpu, hist=hist)


def child_softmax(steps: int) -> dict:
    import_cpu = _imports()
    import pyro
    import torch
    from benchmark_multiclass_speed import K, data, model, q_log_loss
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI

    def plugin_log_loss(guide, X, y) -> float:
        W = guide.posterior("w").mean.reshape(-1, K)
        return float(-(X @ W).log_softmax(-1)[torch.arange(len(y)), y].mean())

    Xtr, ytr, Xte, yte = data()
    pyro.set_rng_seed(0)
    c0 = time.process_time()
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
    hist, cpu = [], 0.0
    for _ in range(steps):
        loss = svi.step(Xtr, ytr)
        cpu += time.process_time() - c0
        # scores outside the clock: q's predictive, and the plug-in at q's mean (as MAP's)
        hist.append(
            (cpu, float(loss), q_log_loss(guide, Xte, yte), plugin_log_loss(guide, Xte, yte))
        )
        c0 = time.process_time()
    return dict(import_cpu=import_cpu, hist=hist)


def child_softmax_map() -> dict:
    c = time.process_time()
    import sklearn.linear_model  # noqa: F401
    import torch

    import_cpu = time.process_time() - c
    torch.set_num_threads(1)
    from benchmark_multiclass_speed import data, fit_map

    Xtr, ytr, Xte, yte = data()
    out = dict(import_cpu=import_cpu, **fit_map(Xtr, ytr, Xte, yte))
    out["laplace_log_loss"], out["newton_map_log_loss"] = laplace_log_loss(Xtr, ytr, Xte, yte)
    return out


def laplace_log_loss(Xtr, ytr, Xte, yte, draws: int = 4096) -> tuple:
    """References outside any clock: the test log-loss of the Laplace posterior predictive,
    ``-mean log E softmax(x^T W)`` with ``W ~ N(W*, H^-1)`` (``W*`` the mode by Newton's
    method, ``H`` the exact ``410 x 410`` Hessian of the negative log joint there) by ``draws``
    fixed draws, and of the plug-in at ``W*`` (the exact MAP's)."""
    import torch
    from softmax_posterior_reference import newton_map, plugin, predictive

    w, H = newton_map(Xtr, ytr)
    L = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)))
    return predictive(w, L, Xte, yte, draws), plugin(w.reshape(Xtr.shape[1], -1), Xte, yte)


def run_child(argv: Sequence[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind")
    ap.add_argument("--T", type=int, default=0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--variant", default="default")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    if a.kind == "markov":
        out = child_markov(a.T, a.steps)
    elif a.kind == "a1a":
        out = child_a1a(a.variant, a.steps)
    elif a.kind == "a1a-plain":
        out = child_a1a_plain(a.variant, a.steps)
    elif a.kind == "softmax":
        out = child_softmax(a.steps)
    elif a.kind == "softmax-map":
        out = child_softmax_map()
    else:
        raise SystemExit(f"unknown child {a.kind!r}")
    if "pyro_cvi" in sys.modules:
        out["package"] = str(Path(sys.modules["pyro_cvi"].__file__).parent)
    print(json.dumps(out))


# ----------------------------------------------------------------------------------------------
# The parent: fresh processes, medians, tables.
# ----------------------------------------------------------------------------------------------


def _env(tree: Path = ROOT) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(HERE), env.get("PYTHONPATH", "")])
    return env


def spawn(
    args: List[str], python: str = sys.executable, timeout: int = 1800, tree: Path = ROOT
) -> dict:
    """Run a child (``tree``: the checkout whose ``pyro_cvi`` it imports) and read its JSON."""
    out = subprocess.run(
        [python, *args], capture_output=True, text=True, timeout=timeout, env=_env(tree), cwd=ROOT
    )
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ours(kind: str, tree: Path = ROOT, **kw: Any) -> dict:
    args = [str(Path(__file__).resolve()), "--child", kind]
    for k, v in kw.items():
        args += [f"--{k}", str(v)]
    return spawn(args, tree=tree)


def bayesnewton(python: str, T: int, steps: int) -> dict:
    import numpy as np

    sys.path.insert(0, str(HERE))
    from benchmark_peers import counts

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "y.npy")
        np.save(path, counts(T).numpy())
        script = str(HERE / "peers" / "bayesnewton_markov.py")
        r = spawn([script, path, "--steps", str(steps - 1), "--num-points", str(MARKOV_POINTS)],
                  python)  # fmt: skip
    cum, hist = r["setup_cpu"], []
    hist.append((cum, r["neg_elbo"][0], None))
    for cpu, e in zip(r["cpus"], r["neg_elbo"][1:]):
        cum += cpu
        hist.append((cum, e, None))
    return dict(import_cpu=r["import_cpu"], hist=hist, jax=r["jax"], bayesnewton=r["bayesnewton"])


def first_within(hist: List[list], col: int, ok) -> Optional[tuple]:
    """(steps, CPU s) at the first entry whose column ``col`` satisfies ``ok``; None if never."""
    for i, h in enumerate(hist):
        if h[col] is not None and ok(h[col]):
            return i + 1, h[0]
    return None


def to_rel(hist: List[list], col: int) -> Optional[tuple]:
    final = hist[-1][col]
    return first_within(hist, col, lambda v: abs(v - final) <= REL_TOL * abs(final))


def to_converged(hist: List[list], col: int, tol: float) -> Optional[tuple]:
    """The first entry from which column ``col`` stays within ``tol`` of the run's last."""
    final, hit = hist[-1][col], None
    for i, h in enumerate(hist):
        if h[col] is None or abs(h[col] - final) > tol:
            hit = None
        elif hit is None:
            hit = (i + 1, h[0])
    return hit


def summarise(runs: List[dict], hits: List[Optional[tuple]]) -> dict:
    """Medians over repeats of the import, first-call, per-step and to-answer CPU seconds."""
    per_step = [statistics.median(b[0] - a[0] for a, b in zip(r["hist"], r["hist"][1:]))
                for r in runs]  # fmt: skip
    reached = [h for h in hits if h is not None]
    return dict(
        import_cpu=statistics.median(r["import_cpu"] for r in runs),
        first_cpu=statistics.median(r["hist"][0][0] for r in runs),
        step_cpu=statistics.median(per_step),
        steps=None if len(reached) < len(hits) else statistics.median(h[0] for h in reached),
        to_answer=None if len(reached) < len(hits) else statistics.median(h[1] for h in reached),
        to_answer_all=[None if h is None else h[1] for h in hits],
        final=runs[-1]["hist"][-1][1],
    )


#: the per-step criterion against BayesNewton's jitted step: within this factor up to this T,
#: faster beyond
PER_STEP_NEAR, NEAR_UP_TO = 2.0, 1000


def per_step_met(row: dict) -> bool:
    """Whether a Markov row's per-step ratio meets :data:`PER_STEP_NEAR` / ahead."""
    limit = PER_STEP_NEAR if row["T"] <= NEAR_UP_TO else 1.0
    return bool(row["ratio_per_step"] <= limit)


def _fmt(x: Optional[float], spec: str) -> str:
    return "never" if x is None else format(x, spec)


def part_markov(Ts: List[int], repeats: int, python: Optional[str]) -> tuple:
    from bench.reporting import Table, fmt

    table = Table(
        "Markov GP (Matern-3/2, Poisson): time to the converged bound, fresh process",
        [
            ("T", "chain length"),
            ("method", "ours: AutoCVI + CVI(step_size=1); BN: BayesNewton MarkovVariationalGP"),
            ("import s", "CPU s of importing torch/pyro/pyro_cvi (BN: jax/objax/bayesnewton)"),
            ("first s", "CPU s of the first call: set-up / compilation and one step"),
            ("ms/step", "median CPU ms of a later step (its -ELBO included)"),
            ("steps", "steps until the returned -ELBO is within 1e-6 relative of the last"),
            ("answer s", "CPU s from the first call to that -ELBO (set-up, compile included)"),
            ("-ELBO", "the last returned -ELBO"),
        ],
    )
    rows = []
    for T in Ts:
        steps = 25 if T <= 10_000 else 12
        res: Dict[str, Any] = {"T": T}
        for name in ("ours", "bayesnewton") if python else ("ours",):
            runs = []
            for _ in range(repeats):
                print(f"markov T={T}: {name} ...", flush=True)
                try:
                    runs.append(ours("markov", T=T, steps=steps) if name == "ours"
                                else bayesnewton(python, T, steps))  # fmt: skip
                except (RuntimeError, subprocess.SubprocessError, OSError, ValueError) as e:
                    print(f"   {name} failed: {e}", flush=True)
            if runs:
                res[name] = summarise(runs, [to_rel(r["hist"], 1) for r in runs])
                res[name]["runs"] = runs
        o, b = res.get("ours"), res.get("bayesnewton")
        if o and b:
            res["ratio_to_answer"] = (
                None if o["to_answer"] is None or b["to_answer"] is None
                else o["to_answer"] / b["to_answer"]
            )  # fmt: skip
            res["ratio_per_step"] = o["step_cpu"] / b["step_cpu"]
            res["bound_rel_diff"] = abs(o["final"] - b["final"]) / abs(b["final"])
        for name, label in (("ours", "ours"), ("bayesnewton", "BN")):
            s = res.get(name)
            if s:
                table.add(
                    T, label, f"{s['import_cpu']:.3f}", f"{s['first_cpu']:.3f}",
                    f"{1e3 * s['step_cpu']:.2f}", fmt(s["steps"], "g"),
                    _fmt(s["to_answer"], ".3f"), f"{s['final']:.6f}",
                )  # fmt: skip
        if o and b:
            table.ratio(f"T={T} ours / BN to the answer", res["ratio_to_answer"], "CPU s")
            table.ratio(f"T={T} ours / BN per step", res["ratio_per_step"], "CPU s")
            table.ratio(f"T={T} bound |ours - BN| / |BN|", res["bound_rel_diff"], "relative")
        rows.append(res)
    if not python:
        table.note("ours", "BayesNewton not run: pass --bayesnewton-python (JAX on the CPU)")
    table.print()
    return rows, table


def part_a1a(repeats: int, checkout: Optional[str] = None) -> tuple:
    from bench.reporting import Table

    configs = [
        ("AutoCVI default", "a1a", "default", ROOT),
        ("AutoCVI step 1", "a1a", "step1", ROOT),
        ("plain step 1", "a1a-plain", "prior", ROOT),
        ("plain (Newton start) step 1", "a1a-plain", "newton", ROOT),
    ]
    if checkout:  # the same rows from another checkout's pyro_cvi, in the same period
        other = Path(checkout).resolve()
        configs[2:2] = [
            ("AutoCVI default (checkout)", "a1a", "default", other),
            ("AutoCVI step 1 (checkout)", "a1a", "step1", other),
        ]
    steps = 30
    raw: Dict[str, List[dict]] = {label: [] for label, *_ in configs}
    for _ in range(repeats):  # interleaved: a change of load hits every row alike
        for label, kind, variant, tree in configs:
            print(f"a1a: {label} ...", flush=True)
            raw[label].append(ours(kind, tree, variant=variant, steps=steps))
    best = min(h[2] for runs in raw.values() for r in runs for h in r["hist"])
    res: Dict[str, Any] = {"best_neg_elbo": best}
    table = Table(
        f"a1a logistic regression: best -ELBO {best:.4f}; fresh process per run",
        [
            ("method", "AutoCVI: the public API; plain: bench.baselines.plain_cvi_logreg"),
            ("import s", "CPU s of the imports (plain: torch only)"),
            ("first s", "CPU s of the first call (AutoCVI: set-up and one step)"),
            ("ms/step", "median CPU ms of a later step"),
            ("0.5 nat s", "CPU s until q's -ELBO is within 0.5 nat of the best (steps)"),
            ("1e-6 s", "CPU s until q's -ELBO is within 1e-6 relative of its last (steps)"),
            ("-ELBO", "q's last -ELBO (exact, 32-point Gauss-Hermite)"),
        ],
    )
    for label, runs in raw.items():
        near = summarise(runs, [first_within(r["hist"], 2, lambda v: v <= best + NAT_TOL)
                                for r in runs])  # fmt: skip
        rel = summarise(runs, [to_rel(r["hist"], 2) for r in runs])
        res[label] = dict(near=near, rel=rel, runs=runs, final_score=runs[-1]["hist"][-1][2])
        table.add(
            label, f"{near['import_cpu']:.3f}", f"{near['first_cpu']:.3f}",
            f"{1e3 * near['step_cpu']:.2f}",
            f"{_fmt(near['to_answer'], '.3f')} ({_fmt(near['steps'], 'g')})",
            f"{_fmt(rel['to_answer'], '.3f')} ({_fmt(rel['steps'], 'g')})",
            f"{res[label]['final_score']:.4f}",
        )  # fmt: skip
    plain = [k for k in raw if k.startswith("plain") and res[k]["near"]["to_answer"]]
    best_plain = min(plain, key=lambda k: res[k]["near"]["to_answer"]) if plain else None
    res["best_plain"] = best_plain
    ratios = {}
    for label in [k for k in raw if k.startswith("AutoCVI")]:
        a = res[label]["near"]["to_answer"]
        if best_plain and a is not None:
            ratios[f"{label} / {best_plain}, to 0.5 nat"] = a / res[best_plain]["near"]["to_answer"]
        same = "plain step 1" if "step 1" in label else best_plain
        b_rel = res[same]["rel"]["to_answer"] if same else None
        if res[label]["rel"]["to_answer"] is not None and b_rel:
            ratios[f"{label} / {same}, to 1e-6"] = res[label]["rel"]["to_answer"] / b_rel
    for k, v in ratios.items():
        table.ratio(k, v, "CPU s, set-up included")
    res["ratios"] = ratios
    table.print()
    return res, table


def part_softmax(repeats: int, steps: int) -> tuple:
    from bench.reporting import Table

    print("softmax: MAP ...", flush=True)
    mp = ours("softmax-map")
    runs = []
    for _ in range(repeats):
        print("softmax: CVI() ...", flush=True)
        runs.append(ours("softmax", steps=steps))
    target = mp["test_log_loss"]
    to_map = summarise(runs, [first_within(r["hist"], 2, lambda v: v <= target) for r in runs])
    plug = summarise(
        runs, [first_within(r["hist"], 3, lambda v: v <= target + MAP_TOL) for r in runs]
    )
    rel = summarise(runs, [to_rel(r["hist"], 1) for r in runs])
    pred = {tol: summarise(runs, [to_converged(r["hist"], 2, tol) for r in runs])
            for tol in PRED_TOLS}  # fmt: skip
    table = Table(
        "10-class logistic regression (N = 5,000, D = 41): fresh process per run",
        [
            ("method", "MAP: scikit-learn L-BFGS; CVI(): AutoCVI with every default"),
            ("import s", "CPU s of the imports"),
            (
                "first s",
                "CPU s of the first call (CVI(): set-up, the loss and the Laplace "
                "start, which is the first step; MAP: the fit)",
            ),
            ("ms/step", "median CPU ms of a later step"),
            ("pred 1e-3 s", "CPU s until q's test log-loss is within 1e-3 nats of its last"),
            ("pred 1e-4 s", "CPU s until q's test log-loss is within 1e-4 nats of its last"),
            ("to MAP s", "CPU s until q's test log-loss <= MAP's (steps)"),
            ("plug-in to MAP s", "CPU s until the plug-in at q's mean scores MAP's (steps)"),
            ("plug-in 1st", "the plug-in at q's mean after the first call (test log-loss)"),
            ("1e-6 s", "CPU s until the returned -ELBO is within 1e-6 relative of the last"),
            ("test log-loss", "the last"),
        ],
    )
    table.add("MAP", f"{mp['import_cpu']:.3f}", f"{mp['cpu']:.3f}", "-", "-", "-", "-", "-",
              "-", "-", f"{target:.4f}")  # fmt: skip
    table.add("Laplace", "-", "-", "-", "-", "-", "-", "-", "-", "-",
              f"{mp['laplace_log_loss']:.4f}")  # fmt: skip
    table.add(
        "CVI()", f"{to_map['import_cpu']:.3f}", f"{to_map['first_cpu']:.3f}",
        f"{1e3 * to_map['step_cpu']:.1f}",
        *(f"{_fmt(pred[t]['to_answer'], '.3f')} ({_fmt(pred[t]['steps'], 'g')})"
          for t in PRED_TOLS),
        f"{_fmt(to_map['to_answer'], '.3f')} ({_fmt(to_map['steps'], 'g')})",
        f"{_fmt(plug['to_answer'], '.3f')} ({_fmt(plug['steps'], 'g')})",
        f"{runs[-1]['hist'][0][3]:.7f}",
        f"{_fmt(rel['to_answer'], '.3f')} ({_fmt(rel['steps'], 'g')})",
        f"{runs[-1]['hist'][-1][2]:.4f}",
    )  # fmt: skip
    scores = [h[2] for r in runs for h in r["hist"][1:]]
    table.note(
        "CVI()",
        f"converged predictive {runs[-1]['hist'][-1][2]:.4f} against MAP's plug-in "
        f"{target:.4f}; lowest on the way {min(scores):.4f} (a q not yet converged); the "
        f"plug-in at q's mean: {runs[-1]['hist'][-1][3]:.4f} at the last step; after the "
        f"first call the plug-in {runs[-1]['hist'][0][3]:.7f}, q's predictive "
        f"{runs[-1]['hist'][0][2]:.4f}",
    )
    table.note(
        "MAP",
        f"scikit-learn's mode {target:.9f}, Newton's exact mode "
        f"{mp['newton_map_log_loss']:.9f}; reached: within {MAP_TOL:g} nats",
    )
    table.note(
        "Laplace",
        "the posterior predictive of the Laplace approximation at MAP (exact Hessian, 4,096 "
        "draws), outside any clock: a Bayesian predictive above MAP's plug-in "
        f"({mp['laplace_log_loss']:.4f} against {target:.4f}), so MAP's level is no target "
        "for q's predictive",
    )
    table.print()
    predictive = {str(t): v for t, v in pred.items()}
    out = dict(map=mp, to_map=to_map, plugin_to_map=plug, rel=rel, predictive=predictive)
    return dict(out, runs=runs), table


def main(argv: Optional[List[str]] = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        run_child(argv[1:])
        return {}
    sys.path.insert(0, str(HERE))
    from bench.reporting import write_results

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="T = 200, 1000; 1 repeat; results/quick")
    ap.add_argument("--T", type=float, nargs="*", default=None, help="chain lengths")
    ap.add_argument("--repeats", type=int, default=None, help="fresh processes per config (3)")
    ap.add_argument("--bayesnewton-python", default=None, help="interpreter with BayesNewton")
    ap.add_argument("--parts", nargs="+", default=["markov", "a1a", "softmax"])
    ap.add_argument("--softmax-steps", type=int, default=16)
    ap.add_argument(
        "--checkout", default=None, help="a1a: another checkout's AutoCVI rows, interleaved"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    Ts = [int(T) for T in args.T] if args.T else (
        [200, 1000] if args.quick else [200, 1000, 10_000, 100_000]
    )  # fmt: skip
    python = args.bayesnewton_python
    if python and not os.path.exists(python):
        print(f"no interpreter at {python}: BayesNewton not measured")
        python = None
    out = args.out or f"results/{'quick/' if args.quick else ''}benchmark_time_to_answer.json"
    payload: Dict[str, Any] = {"config": dict(threads=1, dtype="float64", device="cpu", T=Ts,
                                              repeats=repeats)}  # fmt: skip
    payload["config"]["load_before"] = os.getloadavg()
    tables, verdicts = [], []
    if "markov" in args.parts:
        rows, table = part_markov(Ts, repeats, python)
        payload["markov"] = rows
        tables.append(table)
        r = [f"T={x['T']}: {x['ratio_to_answer']:.3g}x (per step {x['ratio_per_step']:.3g}x, "
             f"{'met' if per_step_met(x) else 'not met'}; bounds {x['bound_rel_diff']:.1e} "
             "relative)" for x in rows if x.get("ratio_to_answer") is not None]  # fmt: skip
        verdicts.append("Markov GP, ours / BayesNewton to the answer (per step: within "
                        f"{PER_STEP_NEAR}x at T <= {NEAR_UP_TO}, ahead beyond): "
                        + (", ".join(r) if r else "BayesNewton not run"))  # fmt: skip
    if "a1a" in args.parts:
        payload["a1a"], table = part_a1a(repeats, args.checkout)
        tables.append(table)
        verdicts.append(
            "a1a: " + "; ".join(f"{k} = {v:.2f}x" for k, v in payload["a1a"]["ratios"].items())
        )
    if "softmax" in args.parts:
        payload["softmax"], table = part_softmax(repeats, args.softmax_steps)
        tables.append(table)
        t = payload["softmax"]["to_map"]["to_answer"]
        u = payload["softmax"]["plugin_to_map"]["to_answer"]
        c = payload["softmax"]["predictive"][str(PRED_TOLS[0])]["to_answer"]
        verdicts.append("10-class (MAP's plug-in test log-loss is below every Bayesian "
                        "predictive here: Laplace's "
                        f"{payload['softmax']['map']['laplace_log_loss']:.4f}): "
                        "the converged predictive (1e-3 nats) "
                        + ("never reached" if c is None else f"in {c:.2f} CPU s")
                        + ", MAP's test log-loss by q's predictive "
                        + ("never reached" if t is None else f"in {t:.2f} CPU s")
                        + ", by the plug-in at q's mean (the criterion, target 1 CPU s) "
                        + ("never" if u is None else f"in {u:.2f} CPU s, "
                           + ("met" if u <= 1.0 else "not met")))  # fmt: skip
    payload["config"]["load_after"] = os.getloadavg()
    verdicts.append("load average (1, 5, 15 min) before {:.1f} {:.1f} {:.1f}, after {:.1f} {:.1f} "
                    "{:.1f}".format(*payload["config"]["load_before"],
                                    *payload["config"]["load_after"]))  # fmt: skip
    verdict = "Verdict: " + "; ".join(verdicts) + "."
    print(verdict)
    write_results(
        out,
        payload,
        title="Time to the answer on small problems (fresh processes, CPU seconds, one thread)",
        verdict=verdict,
        tables=tables,
        command="python scripts/benchmark_time_to_answer.py --bayesnewton-python PYTHON"
        + (" --quick" if args.quick else ""),
        quick=args.quick,
        text="Process CPU seconds on one thread, float64; each configuration in a fresh process; "
        "medians over repeats; imports timed separately and outside the time to the answer.",
    )
    return payload


if __name__ == "__main__":
    main()
