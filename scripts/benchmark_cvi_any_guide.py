#!/usr/bin/env python
"""Steps to the analytic posterior: ``CVI()`` against Pyro's Adam on hand-written guides.

The guides and models of ``tests/test_cvi_any_guide.py`` (a conjugate Normal regression, four
parameterisations of a Normal guide, one sample of ``Trace_ELBO``) and
``tests/test_cvi_conjugate_guides.py`` (Pyro's own Gamma-Poisson test data, three
parameterisations, 64 vectorised particles). A run "reaches" the posterior at the first
checked step (every 10) from which on every check has the posterior mean within ``tol`` and
the posterior standard deviations (Gamma: shape and rate) within ``tol``: Pyro's ``prec``
in its tests/infer/test_inference.py (0.05 for the Normal; 0.2 and 0.15 for the Gamma's
shape and rate). Adam runs at each learning rate of {0.01, 0.03, 0.1} for up to 4,000
steps, ``CVI()`` (adaptive) up to 400; seeds 0 and 1. The row gives the median step count of
each (``>N``: not reached) and their ratio (target <= 0.1).

    PYTHONPATH=. python scripts/benchmark_cvi_any_guide.py  # results/...json
    PYTHONPATH=. python scripts/benchmark_cvi_any_guide.py --quick "Normal (positive)"
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

import test_cvi_any_guide as N  # noqa: E402
import test_cvi_conjugate_guides as C  # noqa: E402
from bench.reporting import quick_path  # noqa: E402

from pyro_cvi import CVI  # noqa: E402

LRS = (0.01, 0.03, 0.1)
ADAM_MAX, CVI_MAX, EVERY = 4000, 400, 10
SEEDS = (0, 1)


def _normal_case(form):
    guide = N.NORMALS[form][0]
    X, y = N._design(torch.float64)
    m_post, S_post = N._posterior(X, y)

    def ok():
        m, S = N._q(guide, X, y)
        sd, sd_post = S.diagonal().sqrt(), S_post.diagonal().sqrt()
        return bool((m - m_post).abs().max() < 0.05 and (sd - sd_post).abs().max() < 0.05)

    return N.model, guide, (X, y), Trace_ELBO, ok


def _gamma_case(form):
    C._positive.form = form
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)

    def ok():
        q = C._q(C.gamma_guide, x)
        return abs(float(q.concentration) - 7.0) < 0.2 and abs(float(q.rate) - 4.0) < 0.15

    def loss():
        return Trace_ELBO(num_particles=64, vectorize_particles=True, max_plate_nesting=1)

    return C.gamma_poisson, C.gamma_guide, (x,), loss, ok


def _steps(case, make_optim, max_steps, seed):
    model, guide, args, loss, ok = case
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    svi = SVI(model, guide, make_optim(), loss=loss())
    since = None
    for t in range(1, max_steps + 1):
        svi.step(*args)
        if t % EVERY == 0:
            if ok():
                since = t if since is None else since
            else:
                since = None
    return since  # None: not reached (or left again) by max_steps


def _median(xs, cap):
    vals = [x if x is not None else cap + 1 for x in xs]
    return statistics.median(vals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases", nargs="*", help="only the cases whose name contains one of these")
    ap.add_argument("--quick", action="store_true", help="one seed, Adam at lr 0.03 only")
    ap.add_argument("--out", default=str(ROOT / "results" / "benchmark_cvi_any_guide.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    pyro.enable_validation(False)
    seeds, lrs = ([0], [0.03]) if args.quick else (SEEDS, LRS)
    cases = {f"Normal ({f})": (lambda f=f: _normal_case(f)) for f in sorted(N.NORMALS)}
    cases.update({f"Gamma ({f})": (lambda i=i: _gamma_case(i)) for i, f in enumerate(C.FORMS)})
    if args.cases:  # a subset: names containing any argument
        cases = {k: v for k, v in cases.items() if any(a in k for a in args.cases)}
    rows = []
    t0 = time.process_time()
    for name, make in cases.items():
        case = make()
        cvi = [_steps(case, CVI, CVI_MAX, s) for s in seeds]
        adam = {}
        for lr in lrs:
            opt = lambda lr=lr: pyro.optim.Adam({"lr": lr})  # noqa: E731
            adam[lr] = [_steps(case, opt, ADAM_MAX, s) for s in seeds]
        best_lr = min(lrs, key=lambda lr: _median(adam[lr], ADAM_MAX))
        c, a = _median(cvi, CVI_MAX), _median(adam[best_lr], ADAM_MAX)
        row = {
            "case": name,
            "cvi_steps": cvi,
            "adam_steps": {str(k): v for k, v in adam.items()},
            "adam_lr": best_lr,
            "cvi_median": c,
            "adam_median": a,
            "ratio": c / a,
        }
        rows.append(row)
        fmt = lambda v, cap: f">{cap}" if v > cap else f"{v:g}"  # noqa: E731
        print(
            f"{name:24s} CVI {fmt(c, CVI_MAX):>6s}  Adam {fmt(a, ADAM_MAX):>6s} "
            f"[lr {best_lr}]  ratio {c / a:.3f}",
            flush=True,
        )
    ratios = [r["ratio"] for r in rows]
    met = sum(r <= 0.1 for r in ratios)
    print(
        f"Verdict: CVI() reaches the posterior in at most a tenth of Adam's steps in {met} of "
        f"{len(rows)} cases."
    )
    out = quick_path(args.out, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"cpu_seconds": time.process_time() - t0, "seeds": seeds, "every": EVERY}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
