"""One Markov-GP CVI step with the state-space code of an earlier revision against this tree's,
interleaved in one process (the machine's load falls on both alike).

The problem of ``scripts/benchmark_time_to_answer.py``'s ``markov`` part (``T`` regular inputs,
Poisson counts, Matern-3/2 with lengthscale 20 and variance 1, 10 Gauss-Hermite points,
``CVI(step_size=1)``). The earlier revision's ``statespace/sequential.py`` and
``statespace/posterior.py`` (read by ``git show``) stand in for this tree's: its sequential
smoother (with its ``SEQUENTIAL_MAX_T``) and its ``SiteRows`` methods. After ten steps (converged:
every later step does the same work) blocks of steps alternate between the two, in alternating
order; the minimum and the median CPU ms per step of each, one thread, and the returned -ELBO of
both (equal).

    PYTHONPATH=. python scripts/compare_markov_step.py --before 0d471d9 --T 200 1000 3000

Writes ``results/compare_markov_step.json``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _old_module(rev: str, path: str, name: str, tmp: str):
    """``path`` at ``rev`` as a module, its relative imports made absolute."""
    text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    text = text.replace("from .", "from pyro_cvi.statespace.")
    file = Path(tmp) / f"{name}.py"
    file.write_text(text)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look themselves up there)
    spec.loader.exec_module(module)
    return module


def main(argv: Optional[List[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default="0d471d9", help="the earlier revision")
    ap.add_argument("--T", type=int, nargs="+", default=[200, 1000, 3000])
    ap.add_argument("--rounds", type=int, default=12, help="blocks of steps per side")
    ap.add_argument("--out", default="results/compare_markov_step.json")
    ap.add_argument("--quick", action="store_true", help="T = 200, 3 rounds; results/quick/")
    args = ap.parse_args(argv)
    if args.quick:
        args.T, args.rounds = [200], 3
    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    import pyro
    import pyro.distributions as dist
    from bench.reporting import Table, write_results
    from benchmark_peers import counts
    from pyro.infer import SVI

    import pyro_cvi.statespace.kalman as K
    import pyro_cvi.statespace.posterior as P
    from pyro_cvi import CVI, CVI_ELBO, AutoCVI
    from pyro_cvi.statespace import Matern32, markov_gp

    tmp = tempfile.mkdtemp()
    seq_old = _old_module(args.before, "pyro_cvi/statespace/sequential.py", "seq_before", tmp)
    post_old = _old_module(args.before, "pyro_cvi/statespace/posterior.py", "post_before", tmp)
    kal_old = subprocess.run(
        ["git", "show", f"{args.before}:pyro_cvi/statespace/kalman.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    old_max = ast.literal_eval(kal_old.split("SEQUENTIAL_MAX_T = ")[1].split("\n")[0])
    names = ("scatter", "information", "moments")
    sides: Dict[str, Any] = {
        "before": (
            seq_old.SequentialSmoother(K.tensor_smoother),
            old_max,
            {k: getattr(post_old.SiteRows, k) for k in names},
            # (a revision without the tree's scalar top: the tree past the scalar pass)
            getattr(K, "TREE_SCALAR", None) if "TREE_SCALAR" in kal_old else K.TREE,
        ),
        "after": (
            K.SEQUENTIAL,
            dict(K.SEQUENTIAL_MAX_T),
            {k: getattr(P.SiteRows, k) for k in names},
            getattr(K, "TREE_SCALAR", None),
        ),
    }

    def use(side: str) -> None:
        seq, rule, methods, long = sides[side]
        if long is not None:
            K.TREE_SCALAR = long
        K.SEQUENTIAL = seq
        K.SEQUENTIAL_MAX_T.clear()
        K.SEQUENTIAL_MAX_T.update(rule)
        for k, f in methods.items():
            setattr(P.SiteRows, k, f)

    table = Table(
        f"Markov GP step: state-space code at {args.before} against this tree (one process)",
        [
            ("T", "chain length"),
            ("before ms", "min (median) CPU ms per step, the earlier revision's code"),
            ("after ms", "min (median) CPU ms per step, this tree's"),
            ("after/before", "min over min (median over median)"),
            ("-ELBO", "the last returned -ELBO, before / after"),
        ],
    )
    rows = []
    for T in args.T:
        pyro.clear_param_store()
        y, t = counts(T), torch.arange(T, dtype=torch.float64)

        def model(t, y):
            f = markov_gp("x", t, Matern32(lengthscale=20.0, variance=1.0))
            with pyro.plate("t", len(t)):
                pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

        guide = AutoCVI(model, num_quad_points=10)
        svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
        for _ in range(10):
            svi.step(t, y)
        n = max(3, 3000 // T)
        ms: Dict[str, List[float]] = {"before": [], "after": []}
        loss: Dict[str, float] = {}
        for r in range(args.rounds):
            for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
                use(side)
                c = time.process_time()
                for _ in range(n):
                    loss[side] = float(svi.step(t, y))
                ms[side].append((time.process_time() - c) / n * 1e3)
        use("after")
        row = dict(T=T, loss=loss, ms=ms)
        b, a = min(ms["before"]), min(ms["after"])
        mb, ma = statistics.median(ms["before"]), statistics.median(ms["after"])
        row.update(ratio_min=a / b, ratio_median=ma / mb)
        rows.append(row)
        elbos = f"{loss['before']:.9f} / {loss['after']:.9f}"
        table.add(
            T, f"{b:.3f} ({mb:.3f})", f"{a:.3f} ({ma:.3f})", f"{a / b:.2f} ({ma / mb:.2f})", elbos
        )
        print(f"T={T}: after/before {a / b:.2f} (medians {ma / mb:.2f})", flush=True)
    table.print()
    verdict = "Verdict: per step after/before " + ", ".join(
        f"T={r['T']}: {r['ratio_min']:.2f} (medians {r['ratio_median']:.2f})" for r in rows
    ) + "; the same -ELBO to " + "{:.1e}".format(max(
        abs(r["loss"]["before"] - r["loss"]["after"]) / abs(r["loss"]["before"]) for r in rows
    )) + " relative."  # fmt: skip
    print(verdict)
    write_results(
        args.out,
        {"config": dict(threads=1, dtype="float64", before=args.before), "rows": rows},
        title="Markov GP step: earlier state-space code against this tree, one process",
        verdict=verdict,
        tables=[table],
        command="PYTHONPATH=. python scripts/compare_markov_step.py --before " + args.before,
        text="Process CPU ms per step, one thread, blocks of steps alternating in one process.",
        quick=args.quick,
    )
    return {"rows": rows}


if __name__ == "__main__":
    main()
