#!/usr/bin/env python
"""CVI against the other methods of the source papers, on the same problems, in one table each.

Methods (all in one process, back to back, one torch thread):

* ``cvi``: conjugate-computation VI (Khan & Lin 2017); for logistic regression the GLM form of
  Algorithm 1 (``bench.baselines.plain_cvi_logreg``), for GP classification
  ``pyro_cvi.contrib.gpytorch``, for the global/local models mean-field ``AutoCVI`` (VMP sweep);
* ``kl-prox``: KL proximal-gradient VI (Khan et al. 2015) with the paper's step ``beta = 0.25``,
  linearised in the moments (eqs. 16-17 for the GLM, 18-19 for the GP) or in the mean parameters
  (then exactly CVI with step ``beta / (1 + beta) = 0.2``), and ``kl-prox point``: the
  proximal-point method (eq. 2) with the subproblem solved by L-BFGS (``bench.kl_proximal``);
* ``ssvi``: structured SVI (Hoffman & Blei 2015, ``pyro_cvi.StructuredSVI``);
* ``adam``: Pyro's ``AutoMultivariateNormal`` + ``Trace_ELBO`` + ``Adam``;
* ``ngd``: GPyTorch's natural-gradient descent with ``NaturalVariationalDistribution``.

Problems and protocols (``shared/data/README.md``): Bayesian logistic regression on a1a
(Khan et al. 2015, Table 2 row), GP classification on USPS 3-vs-5 (Table 3 row; log l = 2.5,
log sf = 2, and the paper's 5 in the full run), and three models with global and local latents
(``bench.structured_models``: a Gaussian mixture, a topic model on the "bars" corpus,
a hierarchical normal model) for mean-field CVI against SSVI, scored by the held-out
log-likelihood per group against wall time over several initialisations.

Usage::

    python scripts/benchmark_methods.py            # full (~10 min on 2 loaded cores)
    python scripts/benchmark_methods.py --quick    # < 2 min
    python scripts/benchmark_methods.py --out results/benchmark_methods.json

Writes JSON (``--out``) with a ``report`` section and prints the tables and a verdict.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
from bench.baselines import (  # noqa: E402
    logreg_log_loss_bits,
    make_logreg_model,
    plain_cvi_logreg,
    pyro_adam_logreg,
    time_to_target,
    warm_up,
)
from bench.datasets import data_dir, load_logreg, load_usps_3vs5  # noqa: E402
from bench.kl_proximal import (  # noqa: E402
    kl_prox_gradient_glm,
    kl_prox_gradient_gp,
    kl_proximal_point_glm,
)
from bench.reporting import Table, fmt, fmt_reach, write_results  # noqa: E402
from bench.structured_models import PROBLEMS, make_problem, run_cvi, run_ssvi  # noqa: E402

#: Khan et al. (2015), Table 2 (a1a, "Proximal") and Table 3 (USPS-3vs5, "Proximal").
PAPER_A1A = {"neg_elbo": 590.1, "log_loss": 0.488}
PAPER_USPS_LOG_LOSS = 0.055
#: The paper's fixed proximal step for the logistic likelihood (Section 6): r = 1/(1 + beta) = 0.8.
KL_PROX_BETA = 0.25
A1A_TOL = 1.0  # nats: the "within 1 nat of CVI's optimum"
GPC_TOL = 0.5
HELDOUT_TOL = 0.05  # nats per held-out group


# ------------------------------------------------------------------------ logistic regression
def logreg_section(args, root) -> dict:
    data = load_logreg("a1a", root)
    X, y, delta = data.X_train, data.y_train, data.prior_precision
    fits = {}
    fits["cvi"] = plain_cvi_logreg(X, y, delta, 1.0, 15)
    fits["kl-prox (16-17)"] = kl_prox_gradient_glm(X, y, delta, KL_PROX_BETA, num_iters=50)
    fits["kl-prox, mean-linearised"] = kl_prox_gradient_glm(
        X, y, delta, KL_PROX_BETA, num_iters=50, linearize="mean"
    )
    if not args.quick:
        fits["kl-prox point"] = kl_proximal_point_glm(
            X, y, delta, beta=3.0, num_iters=8, inner_iters=30
        )
    budget = 5.0 if args.quick else 30.0
    fits["adam (lr 0.05)"] = pyro_adam_logreg(
        make_logreg_model(delta),
        X,
        y,
        0.05,
        100_000,
        prior_precision=delta,
        checkpoint_every=20,
        time_limit=budget,
        progress="a1a: Adam lr=0.05",
    )
    optimum = fits["cvi"].history[-1].neg_elbo
    table = Table(
        f"Bayesian logistic regression, a1a (N={X.shape[0]}, D={X.shape[1]}, delta={delta:g})",
        [
            ("method", "inference method (see the script's docstring)"),
            ("iters", "iterations run"),
            ("seconds", "wall time of those iterations"),
            ("-ELBO", "final -ELBO on the training set (Gauss-Hermite quadrature)"),
            ("gap", "-ELBO minus CVI's converged -ELBO (nats)"),
            ("s->1nat", "seconds until -ELBO is within 1 nat of CVI's optimum ('never')"),
            ("bits", "test log-loss in bits on a1a.t (30,956 points)"),
        ],
        text=f"Khan et al. (2015) Table 2, 'Proximal' on a1a: Neg-Log-Lik {PAPER_A1A['neg_elbo']}, "
        f"log-loss {PAPER_A1A['log_loss']} (their own random 5% of Adult, see the closing note).",
    )
    rows = {}
    for name, fit in fits.items():
        last = fit.history[-1]
        reach = time_to_target(fit.history, optimum, A1A_TOL)
        bits = logreg_log_loss_bits(data.X_test, data.y_test, fit.loc, fit.covariance)
        rows[name] = dict(
            iters=last.iteration,
            seconds=last.seconds,
            neg_elbo=last.neg_elbo,
            gap=last.neg_elbo - optimum,
            seconds_to_1nat=None if reach is None else reach[1],
            log_loss_bits=bits,
        )
        r = rows[name]
        table.add(
            name,
            r["iters"],
            f"{r['seconds']:.3f}",
            f"{r['neg_elbo']:.2f}",
            f"{r['gap']:+.3f}",
            fmt_reach(r["seconds_to_1nat"], ".3f"),
            f"{bits:.4f}",
        )
    table.plot(
        "seconds",
        "-ELBO - CVI optimum + 0.01",
        {n: [(h.seconds, h.neg_elbo - optimum + 0.01) for h in f.history] for n, f in fits.items()},
        logy=True,
    )
    return dict(table=table, rows=rows, optimum=optimum, adam_budget=budget)


# ------------------------------------------------------------------------ GP classification
def _load_gpc_runner():
    spec = importlib.util.spec_from_file_location(
        "benchmark_gpc", ROOT / "scripts/benchmark_gpc.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _se_kernel(A, B, log_sf, log_l):
    return math.exp(2 * log_sf) * torch.exp(-torch.cdist(A, B).square() / (2 * math.exp(2 * log_l)))


def gpc_section(args, root) -> dict:
    gpc = _load_gpc_runner()
    data = load_usps_3vs5(root)
    n = 300 if args.quick else 770
    iters = 25 if args.quick else 60
    X, y = data.X_train[:n], data.y_train[:n]
    settings = [2.0] if args.quick else [2.0, 5.0]
    table = Table(
        f"GP classification, USPS 3-vs-5 (N={n} train, {data.X_test.shape[0]} test, log l = 2.5)",
        [
            ("log sf", "kernel log signal sd (2: well conditioned, 5: the paper's)"),
            ("method", "inference method"),
            ("iters", "iterations run"),
            ("seconds", "wall time of those iterations"),
            ("-ELBO", "final -ELBO (each method's own evaluation: quadrature, exact KL)"),
            ("s->0.5nat", "seconds until within 0.5 nat of the best final -ELBO of the setting"),
            ("bits", "test log-loss in bits"),
        ],
        text=f"Khan et al. (2015) Table 3, 'Proximal' on USPS-3vs5: {PAPER_USPS_LOG_LOSS} "
        "(hyperparameters chosen on a 15 x 15 grid, 5 random splits).",
    )
    rows: Dict[str, dict] = {}
    base = dict(
        data_dir=str(root), device="cpu", dtype="float64", likelihood="logistic", threads=1,
        n_train=n, num_inducing=50, log_l=2.5, hyper_lr=0.1, max_seconds=120.0, learn=False,
        iters=iters, part="fixed",
    )  # fmt: skip
    for log_sf in settings:
        K = _se_kernel(X, X, log_sf, 2.5)
        Ks = _se_kernel(X, data.X_test, log_sf, 2.5)
        kd = torch.full((data.X_test.shape[0],), math.exp(2 * log_sf), dtype=K.dtype)
        runs = {}
        for method, lr in (("cvi", 0.8), ("ngd", 0.5)):
            res = gpc.run_one(dict(base, method=method, lr=lr, log_sf=log_sf))
            runs[method] = dict(
                trace=[(t[1], t[2]) for t in res["trace"]],
                neg_elbo=res.get("final_nelbo", math.nan),
                bits=res.get("test_logloss_bits", math.nan),
                error=res["error"],
            )
        for name, lin in (("kl-prox (18-19)", "moments"), ("kl-prox, mean-linearised", "mean")):
            fit = kl_prox_gradient_gp(K, y, KL_PROX_BETA, 2 * iters, linearize=lin)
            runs[name] = dict(
                trace=[(h.seconds, h.neg_elbo) for h in fit.history[1:]],
                neg_elbo=fit.history[-1].neg_elbo,
                bits=fit.log_loss_bits(Ks, kd, data.y_test),
                error=None,
            )
        best = min(r["neg_elbo"] for r in runs.values() if math.isfinite(r["neg_elbo"]))
        for name, r in runs.items():
            reach = next((s for s, v in r["trace"] if v <= best + GPC_TOL), None)
            r.update(iters=len(r["trace"]), seconds=r["trace"][-1][0] if r["trace"] else math.nan)
            r["seconds_to_target"] = reach
            rows[f"log_sf={log_sf:g} {name}"] = {k: v for k, v in r.items() if k != "trace"}
            table.add(
                f"{log_sf:g}",
                name,
                r["iters"],
                f"{r['seconds']:.2f}",
                fmt(r["neg_elbo"], ".2f"),
                fmt_reach(reach, ".2f"),
                fmt(r["bits"], ".4f"),
            )
            table.note(name, r["error"])
    return dict(table=table, rows=rows)


# ------------------------------------------------------------------------ global/local models
def structured_section(args) -> dict:
    seeds = range(1 if args.quick else 4)
    n = 100 if args.quick else 200
    plan = {  # problem: (CVI sweeps, SSVI steps)
        "gmm": (8, 30) if args.quick else (30, 150),
        "topics": (8, 30) if args.quick else (30, 150),
        "hierarchical": (8, 30) if args.quick else (30, 100),
    }
    table = Table(
        f"Global/local models: mean-field CVI vs structured SVI ({len(seeds)} initialisations, "
        f"{n} train and {n} held-out groups)",
        [
            ("problem", "model (scripts/bench/structured_models.py)"),
            ("method", "mean-field CVI (AutoCVI, VMP sweep) or SSVI (Hoffman & Blei, Alg. 1)"),
            ("iters", "sweeps / SSVI steps per run"),
            ("sec/run", "mean wall time of a run (evaluation excluded)"),
            ("heldout", "mean over initialisations of the final held-out log-lik per group"),
            ("worst", "the worst initialisation's final held-out log-lik per group"),
            ("reached", f"runs within {HELDOUT_TOL} nat/group of the best any run reached"),
            ("s->tgt", "median seconds to that target over the runs that reached it"),
        ],
        text="Held-out: log (1/S) sum_s p(y_test | beta_s), beta_s ~ q(beta), locals summed or "
        "integrated out exactly; the same scorer for both methods.",
    )
    rows: Dict[str, dict] = {}
    for name in PROBLEMS:
        problem = make_problem(name, 0, n)
        sweeps, steps = plan[name]
        every_c, every_s = max(1, sweeps // 8), max(1, steps // 10)
        runs = {"cvi (mean field)": [], "ssvi (structured)": []}
        for seed in seeds:
            runs["cvi (mean field)"].append(run_cvi(problem, seed, sweeps, every_c, 16))
            runs["ssvi (structured)"].append(run_ssvi(problem, seed, steps, every_s, 16))
            print(f"  {name} seed {seed}: done", file=sys.stderr, flush=True)
        best = max(h[2] for rs in runs.values() for r in rs for h in r.history)
        for method, rs in runs.items():
            finals = [r.history[-1][2] for r in rs]
            reach = [
                next((h[1] for h in r.history if h[2] >= best - HELDOUT_TOL), None) for r in rs
            ]
            hit = [s for s in reach if s is not None]
            row = dict(
                iters=rs[0].history[-1][0],
                seconds=statistics.mean(r.history[-1][1] for r in rs),
                heldout=statistics.mean(finals),
                worst=min(finals),
                finals=finals,
                reached=len(hit),
                runs=len(rs),
                seconds_to_target=statistics.median(hit) if hit else None,
            )
            rows[f"{name} {method}"] = row
            table.add(
                name,
                method,
                row["iters"],
                f"{row['seconds']:.2f}",
                f"{row['heldout']:.3f}",
                f"{row['worst']:.3f}",
                f"{row['reached']}/{row['runs']}",
                fmt_reach(row["seconds_to_target"], ".2f"),
            )
        table.plot(
            "seconds",
            f"{name}: held-out log-lik per group",
            {m: [(h[1], h[2]) for h in rs[0].history] for m, rs in runs.items()},
            title=f"{name}, first initialisation",
        )
    return dict(table=table, rows=rows)


# ------------------------------------------------------------------------ verdict
def _verdict(logreg: dict, structured: dict) -> str:
    rows = logreg["rows"]

    def reach(name: str, budget: Optional[float] = None) -> str:
        s = rows[name]["seconds_to_1nat"]
        if s is None:
            return f"{name} never did" + (f" in {budget:g} s" if budget else "")
        return f"{name} in {s:.3g} s"

    adam = next(k for k in rows if k.startswith("adam"))
    parts = [
        f"on a1a CVI reached 1 nat of its optimum {reach('cvi')[4:]}, "
        f"{reach('kl-prox (16-17)')}, {reach(adam, logreg['adam_budget'])}"
    ]
    better: List[str] = []
    worse: List[str] = []
    for name in PROBLEMS:
        c = structured["rows"][f"{name} cvi (mean field)"]
        s = structured["rows"][f"{name} ssvi (structured)"]
        diff = s["heldout"] - c["heldout"]
        (better if diff > HELDOUT_TOL else worse if diff < -HELDOUT_TOL else better).append(
            f"{name} {diff:+.2f}"
        )
    parts.append(
        "structured SVI's mean held-out log-lik per group minus mean-field CVI's: "
        + ", ".join(better + worse)
    )
    return "Verdict: " + "; ".join(parts) + "."


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small settings, under 2 minutes")
    ap.add_argument("--data-dir", default=None, help="folder with a1a and usps_3vs5.npz")
    ap.add_argument("--out", default="results/benchmark_methods.json")
    ap.add_argument("--skip", nargs="*", default=[], choices=["logreg", "gpc", "structured"])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    root = data_dir(args.data_dir)
    warm_up()
    start = time.perf_counter()
    sections = {}
    if "logreg" not in args.skip:
        sections["logreg"] = logreg_section(args, root)
        sections["logreg"]["table"].print()
    if "gpc" not in args.skip:
        sections["gpc"] = gpc_section(args, root)
        sections["gpc"]["table"].print()
    if "structured" not in args.skip:
        sections["structured"] = structured_section(args)
        sections["structured"]["table"].print()
    verdict = (
        _verdict(sections["logreg"], sections["structured"])
        if {"logreg", "structured"} <= sections.keys()
        else "Verdict: partial run (sections skipped)."
    )
    print(verdict)
    payload = {
        "quick": args.quick,
        "machine": platform.platform(),
        "torch": torch.__version__,
        "total_seconds": time.perf_counter() - start,
        **{k: v["rows"] for k, v in sections.items()},
    }
    write_results(
        args.out,
        payload,
        title="CVI, KL-proximal VI, structured SVI, Pyro Adam and GPyTorch NGD",
        verdict=verdict,
        tables=[v["table"] for v in sections.values()],
        command="python scripts/benchmark_methods.py" + (" --quick" if args.quick else ""),
        quick=args.quick,
    )
    return payload


if __name__ == "__main__":
    main()
