"""The exact Kalman smoothers side by side: the reduction tree with its explicit descent
(``kalman.TREE``), the associative scans (``kalman.SCAN``, Sarkka & Garcia-Fernandez 2021) and,
for ``d <= 2``, the scalar sequential pass (``kalman.SEQUENTIAL``) and the tree with a scalar top
(``kalman.TREE_SCALAR``).

Per state dimension ``d`` and chain length ``T``: the median process CPU time of one
``smooth(..., lag_one=True)`` (one thread, float64, random stable chain and sites), each method,
their ratio, and which one :func:`~pyro_cvi.statespace.kalman.choose_smoother` picks. The rules
``kalman.SCAN_MAX_T`` and ``kalman.SEQUENTIAL_MAX_T`` are set from this table (the sites here are
full, the scalar pass's general form: a Gaussian process observed through ``f = x_0`` takes its
third-of-the-operations form, so its crossing with the tree with a scalar top lies later).

    PYTHONPATH=. python scripts/benchmark_kalman.py
    PYTHONPATH=. python scripts/benchmark_kalman.py --quick      # d = 1, 2; T <= 1000

Writes ``results/benchmark_kalman.json`` (``--quick``: ``results/quick/``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import List, Optional

import torch
from bench.reporting import Table, write_results

from pyro_cvi.statespace import LinearGaussianChain, kalman


def problem(T: int, d: int):
    g = torch.Generator().manual_seed(T + d)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    def spd(*s):
        M = r(*s, d, d)
        return M @ M.transpose(-1, -2) / d + 0.3 * torch.eye(d, dtype=torch.float64)

    chain = LinearGaussianChain(r(d), spd(), 0.7 * r(T - 1, d, d), r(T - 1, d), spd(T - 1))
    return chain, r(T, d), spd(T)


def cpu_per_call(fn, budget: float) -> float:
    fn()  # warm
    times: List[float] = []
    start = time.process_time()
    while len(times) < 5 or (time.process_time() - start < budget and len(times) < 200):
        c = time.process_time()
        fn()
        times.append(time.process_time() - c)
    return statistics.median(times)


def main(argv: Optional[List[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="the JSON (default: results/...)")
    ap.add_argument("--budget", type=float, default=0.5, help="CPU s per measurement")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dims = [1, 2] if args.quick else [1, 2, 3, 4, 6]
    Ts = (
        [2, 7, 64, 200, 1000, 2000, 4000]
        if args.quick
        else [2, 7, 64, 200, 400, 700, 1000, 1500, 2000, 3000, 4000, 10_000, 100_000]
    )
    table = Table(
        "Kalman smoothers: tree, scan, sequential (CPU ms per call, one thread)",
        [
            ("d", "state dimension"),
            ("T", "chain length"),
            ("tree ms", "kalman.TREE"),
            ("scan ms", "kalman.SCAN"),
            ("scan/tree", "below 1: the scan is faster"),
            ("seq ms", "kalman.SEQUENTIAL (d <= 2)"),
            ("tree-scalar ms", "kalman.TREE_SCALAR (d <= 2)"),
            ("chosen", "kalman.choose_smoother(T, d)"),
        ],
    )
    rows = []
    for d in dims:
        for T in Ts:
            if T * d * d > 2_000_000:
                continue
            chain, eta, J = problem(T, d)
            ms = {}
            small = (kalman.SEQUENTIAL, kalman.TREE_SCALAR) if d <= 2 else ()
            for m in (kalman.TREE, kalman.SCAN) + small:
                name = "tree_scalar" if m is kalman.TREE_SCALAR else m.name
                ms[name] = 1e3 * cpu_per_call(
                    lambda c=chain, e=eta, j=J, m=m: kalman.smooth(c, e, j, lag_one=True, method=m),
                    args.budget,
                )
            chosen = kalman.choose_smoother(T, d)
            chosen = "tree_scalar" if chosen is kalman.TREE_SCALAR else chosen.name
            ratio = ms["scan"] / ms["tree"]
            seq, top = ms.get("sequential"), ms.get("tree_scalar")
            rows.append(
                dict(d=d, T=T, tree_ms=ms["tree"], scan_ms=ms["scan"], sequential_ms=seq,
                     tree_scalar_ms=top, chosen=chosen)
            )  # fmt: skip
            table.add(
                d, T, f"{ms['tree']:.3f}", f"{ms['scan']:.3f}", f"{ratio:.2f}",
                "-" if seq is None else f"{seq:.3f}", "-" if top is None else f"{top:.3f}",
                chosen,
            )  # fmt: skip
            said = ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
            print(f"d={d} T={T}: {said}", flush=True)
    table.print()
    wins = [
        f"d={r['d']} T={r['T']}"
        for r in rows
        if r["chosen"]
        != min(
            (k for k in ("tree", "scan", "sequential", "tree_scalar") if r[k + "_ms"] is not None),
            key=lambda k: r[k + "_ms"],
        )
    ]
    verdict = "Verdict: the rule picks the faster smoother " + (
        "everywhere." if not wins else "except at " + ", ".join(wins) + "."
    )
    print(verdict)
    out = args.out or f"results/{'quick/' if args.quick else ''}benchmark_kalman.json"
    write_results(
        out,
        {"config": dict(threads=1, dtype="float64", device="cpu"), "rows": rows},
        title="Kalman smoothers: reduction tree, associative scan, sequential pass",
        verdict=verdict,
        tables=[table],
        command="PYTHONPATH=. python scripts/benchmark_kalman.py"
        + (" --quick" if args.quick else ""),
        quick=args.quick,
        text="Process CPU seconds on one thread, float64, median per call.",
    )
    return {"rows": rows}


if __name__ == "__main__":
    main()
