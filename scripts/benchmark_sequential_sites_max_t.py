"""Where the scalar pass stops paying for ``d = 2`` by where the sites sit:
``kalman.SEQUENTIAL_FULL_SITES_MAX_T`` (sites on the whole state) beside
``kalman.SEQUENTIAL_MAX_T`` (sites on the first coordinate, a Gaussian process observed through
``f = x_0``: the pass's third-of-the-operations form).

For each ``T`` and each placement (``full``: ``scripts/benchmark_kalman.py``'s random stable
chain and full sites; ``first``: the same chain with ``eta = (e, 0)``, ``J = diag(j, 0)``), one
``smooth`` the way the rule runs it, the scalar pass (``kalman.SEQUENTIAL.marginals``, its own
output path) and the tree with a scalar top (``smooth(..., method=kalman.TREE_SCALAR)``),
interleaved call by call in alternating order (the machine's load falls on both alike); the
table gives the median CPU ms of each, their ratio and the crossing (the ``T`` where the ratio
passes 1, interpolated linearly), and what :func:`~pyro_cvi.statespace.kalman.smooth` picks.

    PYTHONPATH=. python scripts/benchmark_sequential_sites_max_t.py
    PYTHONPATH=. python scripts/benchmark_sequential_sites_max_t.py --lag-one --T 1000 1400 1800

Writes ``results/benchmark_sequential_sites_max_t.json`` (``--lag-one``: ``..._lag_one.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Dict, List, Optional

import torch
from bench.reporting import Table, write_results
from benchmark_first_sites_max_t import crossing
from benchmark_kalman import problem

from pyro_cvi.statespace import kalman

GRID = [400, 700, 1000, 1200, 1400, 1600, 1800, 2000, 2200]


def on_first(eta: torch.Tensor, J: torch.Tensor):
    """The sites moved onto the first coordinate (a positive ``j``: a valid ``q``)."""
    e = torch.stack([eta[:, 0], torch.zeros_like(eta[:, 0])], -1)
    j = torch.zeros_like(J)
    j[:, 0, 0] = J[:, 0, 0].abs() + 0.1
    return e, j


def time_both(T: int, sites: str, lag_one: bool, calls: int) -> Dict:
    chain, eta, J = problem(T, 2)
    if sites == "first":
        eta, J = on_first(eta, J)

    def seq():
        return kalman.SEQUENTIAL.marginals(chain, eta, J, lag_one)

    def tree():
        return kalman.smooth(chain, eta, J, lag_one=lag_one, method=kalman.TREE_SCALAR)

    out = seq()
    if out is None or out[0] is None:
        raise RuntimeError(f"the scalar pass did not take T={T} ({sites})")
    tree()
    ms: Dict[str, List[float]] = {"sequential": [], "tree_scalar": []}
    for i in range(calls):
        order = (("sequential", seq), ("tree_scalar", tree))
        for name, fn in order if i % 2 else order[::-1]:
            c = time.process_time()
            fn()
            ms[name].append(1e3 * (time.process_time() - c))
    picked = kalman.sites_smoother(kalman.choose_smoother(T, 2), eta, J)
    s, t = statistics.median(ms["sequential"]), statistics.median(ms["tree_scalar"])
    name = "tree_scalar" if picked is kalman.TREE_SCALAR else picked.name
    return dict(T=T, sites=sites, sequential_ms=s, tree_scalar_ms=t, ratio=s / t, picked=name)


def main(argv: Optional[List[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, nargs="*", default=None, help="chain lengths")
    ap.add_argument("--lag-one", action="store_true", help="with lag-one covariances")
    ap.add_argument("--calls", type=int, default=12, help="timed calls per way and point")
    ap.add_argument("--out", default=None, help="the JSON (default: results/...)")
    ap.add_argument(
        "--quick", action="store_true", help="two lengths, 3 calls; JSON under results/quick/"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.T, args.calls = args.T or [400, 1400], 3
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    Ts = args.T or GRID
    table = Table(
        "d = 2: the scalar pass against the tree with a scalar top, by where the sites sit"
        + (" (lag-one covariances)" if args.lag_one else ""),
        [
            ("sites", "full: on the whole state; first: on x_0 only"),
            ("T", "chain length"),
            ("seq ms", "kalman.SEQUENTIAL.marginals, median CPU ms"),
            ("tree-scalar ms", "smooth(method=kalman.TREE_SCALAR), median CPU ms"),
            ("ratio", "seq / tree-scalar: below 1 the scalar pass is faster"),
            ("picked", "what smooth runs (choose_smoother, then sites_smoother)"),
        ],
    )
    rows, crossings = [], {}
    for sites in ("full", "first"):
        part = [time_both(T, sites, args.lag_one, args.calls) for T in Ts]
        for r in part:
            table.add(
                sites, r["T"], f"{r['sequential_ms']:.3f}", f"{r['tree_scalar_ms']:.3f}",
                f"{r['ratio']:.2f}", r["picked"],
            )  # fmt: skip
        rows += part
        crossings[sites] = crossing([r["T"] for r in part], [r["ratio"] for r in part])
    table.print()

    def fmt(x):
        return "not on the grid" if x is None else f"T = {x:.0f}"

    verdict = (
        f"Verdict: full sites cross at {fmt(crossings['full'])} (rule: "
        f"{kalman.SEQUENTIAL_FULL_SITES_MAX_T[2]}), first-coordinate sites at "
        f"{fmt(crossings['first'])} (rule: {kalman.SEQUENTIAL_MAX_T[2]})."
    )
    print(verdict)
    tail = "_lag_one" if args.lag_one else ""
    out = args.out or f"results/benchmark_sequential_sites_max_t{tail}.json"
    write_results(
        out,
        {
            "config": dict(threads=1, dtype="float64", lag_one=args.lag_one, calls=args.calls),
            "rows": rows,
            "crossings": crossings,
        },
        title="d = 2: scalar pass or tree with a scalar top, by where the sites sit",
        verdict=verdict,
        tables=[table],
        command="PYTHONPATH=. python scripts/benchmark_sequential_sites_max_t.py"
        + (" --lag-one" if args.lag_one else ""),
        text="Process CPU ms on one thread, float64, median per call, interleaved.",
        quick=args.quick,
    )
    return {"rows": rows, "crossings": crossings}


if __name__ == "__main__":
    main()
