"""Process CPU and wall time of one Markov-GP CVI step.

A synthetic Poisson time series (``scripts/benchmark_statespace.py``'s data: ``T`` regular
inputs), ``markov_gp`` with a Matern-3/2 kernel (``--kernel``: Matern-1/2 or 5/2, state dim 1
or 3; lengthscale 20, variance 1), plain
``AutoCVI``; ``--learn`` makes the lengthscale and variance ``pyro.param``s (the hybrid step:
CVI for ``q``, Adam for the hyperparameters, ``CVI(step_size=1.0)``), else
``CVI(step_size="auto")`` (``--fixed``: ``CVI(step_size=1.0)``, the peer benchmark's step).
Prints the set-up (first step) and the median (and the least) of ``--steps`` more steps, CPU
beside wall, on one thread, float64, CPU. To compare two checkouts on one machine,
run it with ``PYTHONPATH`` set to each in turn (``scripts/`` alone imports the installed copy).

    PYTHONPATH=. python scripts/time_markov_step.py 200 1000 100000 [--learn] [--steps 10]
    PYTHONPATH=. python scripts/time_markov_step.py --quick      # T = 200, 1000, 10000

Writes the rows as JSON to ``--out`` (default: none) and ends with a verdict against the
targets (2 ms CPU per step at T = 200, 0.25 s at T = 1e5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def time_steps(
    T: int, learn: bool, steps: int, fixed: bool = False, kernel: str = "matern32"
) -> dict:
    import pyro
    import pyro.distributions as dist
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI, statespace
    from pyro_cvi.statespace import markov_gp

    Kernel = getattr(statespace, kernel.capitalize())  # (Matern12: d = 1, Matern52: d = 3)

    d64 = torch.float64
    g = torch.Generator().manual_seed(0)
    t = torch.arange(T, dtype=d64)
    y = torch.poisson(torch.exp(torch.sin(t / 50.0) + 0.5 * torch.sin(t / 7.0)), generator=g)

    def model(t, y):
        if learn:
            pos = dist.constraints.positive
            ls = pyro.param("ls", torch.tensor(20.0, dtype=d64), constraint=pos)
            s2 = pyro.param("s2", torch.tensor(1.0, dtype=d64), constraint=pos)
            k = Kernel(ls, s2)
        else:
            k = Kernel(lengthscale=20.0, variance=1.0)
        f = markov_gp("x", t, k)
        with pyro.plate("t", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

    pyro.clear_param_store()
    guide = AutoCVI(model, num_quad_points=10)
    svi = SVI(model, guide, CVI(step_size=1.0 if learn or fixed else "auto"), loss=CVI_ELBO())
    t0, c0 = time.perf_counter(), time.process_time()
    svi.step(t, y)
    setup = (time.perf_counter() - t0, time.process_time() - c0)
    walls, cpus = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = svi.step(t, y)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return dict(
        T=T,
        setup_wall=setup[0],
        setup_cpu=setup[1],
        wall=statistics.median(walls),
        cpu=statistics.median(cpus),
        cpu_min=min(cpus),
        loss=loss,
    )


TARGETS = {200: 2e-3, 100000: 0.25}  # CPU s per step, fixed hyperparameters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("T", type=float, nargs="*", help="chain lengths")
    ap.add_argument("--learn", action="store_true", help="learn lengthscale and variance")
    ap.add_argument("--steps", type=int, default=10, help="timed steps after the first")
    ap.add_argument("--fixed", action="store_true", help="CVI(step_size=1.0) instead of auto")
    ap.add_argument("--quick", action="store_true", help="T = 200, 1000, 10000")
    ap.add_argument(
        "--kernel", default="matern32", choices=["matern12", "matern32", "matern52"],
        help="the GP's kernel (state dim 1, 2, 3)",
    )  # fmt: skip
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    Ts = [int(T) for T in args.T] or ([200, 1000, 10000] if args.quick else [200, 1000, 100000])
    torch.set_num_threads(1)
    import pyro_cvi

    print(
        f"pyro_cvi from {os.path.dirname(pyro_cvi.__file__)}; device cpu, float64, 1 thread, "
        f"{args.kernel}"
    )
    head = f"{'T':>9} {'setup s':>8} {'ms/step cpu':>12} {'least cpu':>10} {'ms/step wall':>13}"
    print(head + f" {'last loss':>16}")
    rows = []
    for T in Ts:
        r = time_steps(T, args.learn, args.steps, args.fixed, args.kernel)
        rows.append(r)
        print(
            f"{r['T']:>9} {r['setup_cpu']:>8.2f} {1e3 * r['cpu']:>12.2f}"
            f" {1e3 * r['cpu_min']:>10.2f} {1e3 * r['wall']:>13.2f}"
            f" {r['loss']:>16.6f}"
        )
    met = [
        f"T={r['T']}: {1e3 * r['cpu']:.2f} ms CPU against {1e3 * TARGETS[r['T']]:g} ms "
        + ("(met)" if r["cpu"] <= TARGETS[r["T"]] else "(not met)")
        for r in rows
        if r["T"] in TARGETS and not args.learn and args.kernel == "matern32"
    ]
    print("Verdict: " + ("; ".join(met) if met else "no row with an issue-25 target") + ".")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(
                dict(
                    learn=args.learn,
                    fixed=args.fixed,
                    kernel=args.kernel,
                    device="cpu",
                    dtype="float64",
                    rows=rows,
                ),  # fmt: skip
                fh,
            )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
