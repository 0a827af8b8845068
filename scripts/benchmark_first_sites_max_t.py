"""Where the Markov block's short path stops paying: ``kalman.FIRST_SITES_MAX_T``, d = 1, 2.

A Gaussian process of ``d <= 2`` states observed through its first coordinate, of at most
``FIRST_SITES_MAX_T[d]`` steps, is smoothed by the Markov block's short path
(:mod:`pyro_cvi.statespace.first_sites`: the scalar pass fed by its rows); a longer one by the
general path, the tree with a scalar top (``kalman.TREE_SCALAR``). (The general pass's own rule
``SEQUENTIAL_MAX_T``, for sites on the whole state, is ``scripts/benchmark_kalman.py``'s.)

This script times one Markov-GP CVI step both ways, interleaved in one process (the machine's
load falls on both alike): the problem of ``scripts/benchmark_time_to_answer.py``'s ``markov``
part (``T`` regular inputs, Poisson counts, lengthscale 20, variance 1, 10 Gauss-Hermite
points, ``CVI(step_size=1)``) with a Matern-1/2 kernel (``d = 1``) or a Matern-3/2 (``d = 2``).
After ten steps (converged: every later step does the same work) blocks of steps alternate
between the two ways, in alternating order; the table gives the least and the median CPU ms
per step of each (one thread, float64) and their ratio, and the crossing: the ``T`` where the
ratio passes 1, interpolated linearly between the grid's points.

    PYTHONPATH=. python scripts/benchmark_first_sites_max_t.py
    PYTHONPATH=. python scripts/benchmark_first_sites_max_t.py --d 2 --T 1500 2200 3000

Writes ``results/benchmark_first_sites_max_t.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

HERE = Path(__file__).resolve().parent

GRID = {1: [600, 1000, 1400, 1700, 2000, 2300, 2600], 2: [1000, 1600, 2000, 2300, 2600, 3000, 4000]}
QUICK_GRID = {1: [200, 400], 2: [200, 400]}


def crossing(Ts: List[int], ratios: List[float]) -> Optional[float]:
    """The first ``T`` where ``ratios`` (sequential over tree) passes 1, linearly interpolated;
    ``None`` where it does not on the grid."""
    for (t0, r0), (t1, r1) in zip(zip(Ts, ratios), zip(Ts[1:], ratios[1:])):
        if r0 <= 1.0 < r1:
            return t0 + (1.0 - r0) * (t1 - t0) / (r1 - r0)
    return None


def time_both(d: int, T: int, rounds: int) -> dict:
    """Least and median CPU ms per step with the sequential pass and with the tree, one
    process, blocks alternating."""
    import pyro
    import pyro.distributions as dist
    from benchmark_peers import counts
    from pyro.infer import SVI

    import pyro_cvi.statespace.kalman as K
    from pyro_cvi import CVI, CVI_ELBO, AutoCVI
    from pyro_cvi.statespace import Matern12, Matern32, markov_gp

    kernel = (Matern12 if d == 1 else Matern32)(lengthscale=20.0, variance=1.0)
    y, t = counts(T), torch.arange(T, dtype=torch.float64)

    def model(t, y):
        f = markov_gp("x", t, kernel)
        with pyro.plate("t", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

    kept = K.FIRST_SITES_MAX_T[d], K.SEQUENTIAL_MAX_T[d]
    ways = {"sequential": 10**9, "tree": 0}  # (0: every chain of this d takes the tree)
    pyro.clear_param_store()
    guide = AutoCVI(model, num_quad_points=10)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    n = max(3, 6000 // T)
    ms: Dict[str, List[float]] = {w: [] for w in ways}
    loss: Dict[str, float] = {}
    try:
        for _ in range(10):
            svi.step(t, y)
        for r in range(rounds):
            for way in ways if r % 2 == 0 else reversed(list(ways)):
                K.FIRST_SITES_MAX_T[d] = K.SEQUENTIAL_MAX_T[d] = ways[way]
                svi.step(t, y)  # (one step off the clock after the switch)
                c = time.process_time()
                for _ in range(n):
                    loss[way] = float(svi.step(t, y))
                ms[way].append((time.process_time() - c) / n * 1e3)
    finally:
        K.FIRST_SITES_MAX_T[d], K.SEQUENTIAL_MAX_T[d] = kept
    row = dict(d=d, T=T, steps_per_block=n, ms=ms, loss=loss)
    for way in ways:
        row[f"{way}_min"], row[f"{way}_median"] = min(ms[way]), statistics.median(ms[way])
    row["ratio_min"] = row["sequential_min"] / row["tree_min"]
    row["ratio_median"] = row["sequential_median"] / row["tree_median"]
    row["loss_rel_diff"] = abs(loss["sequential"] - loss["tree"]) / abs(loss["tree"])
    return row


def main(argv: Optional[List[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    ap.add_argument("--T", type=int, nargs="+", default=None, help="chain lengths (all d)")
    ap.add_argument("--rounds", type=int, default=16, help="blocks of steps per way")
    ap.add_argument("--quick", action="store_true", help="T = 200, 400; 2 rounds; results/quick/")
    ap.add_argument("--out", default="results/benchmark_first_sites_max_t.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = 2
    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    from bench.reporting import Table, write_results

    import pyro_cvi.statespace.kalman as K

    table = Table(
        "The short path (scalar pass) against the tree with a scalar top: one Markov-GP CVI step",
        [
            ("d", "state dimension (Matern-1/2: 1, Matern-3/2: 2)"),
            ("T", "chain length"),
            ("sequential ms", "least (median) CPU ms per step, the short path (scalar pass)"),
            ("tree ms", "least (median) CPU ms per step, the tree with a scalar top"),
            ("seq/tree", "least over least (median over median): below 1 the pass is faster"),
            ("-ELBO rel diff", "the two ways' last -ELBO, relative difference"),
        ],
    )
    rows, found = [], {}
    for d in args.d:
        grid = args.T or (QUICK_GRID if args.quick else GRID)[d]
        mine = []
        for T in grid:
            row = time_both(d, T, args.rounds)
            rows.append(row)
            mine.append(row)
            print(
                f"d={d} T={T}: sequential {row['sequential_min']:.3f} ms, tree "
                f"{row['tree_min']:.3f} ms ({row['ratio_min']:.2f})",
                flush=True,
            )
            table.add(
                d,
                T,
                f"{row['sequential_min']:.3f} ({row['sequential_median']:.3f})",
                f"{row['tree_min']:.3f} ({row['tree_median']:.3f})",
                f"{row['ratio_min']:.2f} ({row['ratio_median']:.2f})",
                f"{row['loss_rel_diff']:.1e}",
            )
        found[d] = dict(
            least=crossing([r["T"] for r in mine], [r["ratio_min"] for r in mine]),
            median=crossing([r["T"] for r in mine], [r["ratio_median"] for r in mine]),
            current=K.FIRST_SITES_MAX_T[d],
        )
    table.print()

    def fmt(x: Optional[float]) -> str:
        return "not on the grid" if x is None else f"~{x:.0f}"

    verdict = "Verdict: the short path is faster up to " + "; ".join(
        f"d = {d}: {fmt(f['least'])} steps by the least times ({fmt(f['median'])} by the "
        f"medians; FIRST_SITES_MAX_T {f['current']})"
        for d, f in found.items()
    ) + "."  # fmt: skip
    print(verdict)
    write_results(
        args.out,
        {"config": dict(threads=1, dtype="float64", rounds=args.rounds), "rows": rows,
         "crossing": {str(d): f for d, f in found.items()}},
        title="FIRST_SITES_MAX_T: the short path against the tree, one Markov-GP step",
        verdict=verdict,
        tables=[table],
        command="PYTHONPATH=. python scripts/benchmark_first_sites_max_t.py",
        text="Process CPU ms per step, one thread, blocks of steps alternating in one process.",
        quick=args.quick,
    )  # fmt: skip
    return {"rows": rows, "crossing": found}


if __name__ == "__main__":
    main()
