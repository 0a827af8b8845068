"""A regime-switching local level: a global ``s ~ Categorical(pi)`` selects the transition,
the noise scales and the observation offset of a linear-Gaussian chain,
``x_t ~ N(a[s] x_{t-1}, q[s])``, ``y_t ~ N(x_t + c[s], r[s])`` (a ``pyro.markov`` loop), fitted
by the routes AutoCVI offers:

* ``default`` (an unmarked ``s``): in this tree, the chain's Kalman block with the expected
  prior over ``q(s)`` and ``q(s)`` by its exact expected message
  (``pyro_cvi.blocks.regime_markov``), ``CVI(step_size=1)``; run on an older tree
  (``PYTHONPATH``) the same option measures what that tree does (there: every ``x_t`` its own
  Gaussian in the mean field);
* ``summed out`` (``AutoCVI(discrete="collapse")``, as for a marked ``s``): ``s`` summed out
  in the remainder's log joint, ``q(x)`` one joint Gaussian stepped by natural gradients
  (default ``CVI()``).

Each guide is scored by an estimate of its own bound from many draws of the guide:
Trace_ELBO for a ``q(s)`` (``s`` drawn), TraceEnum_ELBO for the summed-out guide (the
collapsed bound); both are lower bounds on ``log p(y)``, higher is better. CPU seconds
(``time.process_time``, one thread) of the steps; ``steps to 0.01``: the first step whose
reported loss is within 0.01 of the last. Prints a table and writes
``results/benchmark_kalman_discrete.json``::

    PYTHONPATH=$PWD python scripts/benchmark_kalman_discrete.py [--seeds 3] [--T 60]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO, TraceEnum_ELBO, config_enumerate
from pyro.ops.indexing import Vindex

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.reporting import Table, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PI = [0.5, 0.5]
#: (a, q, c, r) per value of s: regimes the data tell apart, and close ones (q(s) stays mixed)
REGIMES = {
    "distinct": ([0.95, 0.6], [0.1, 0.5], [0.0, 0.5], [0.2, 0.4]),
    "close": ([0.9, 0.8], [0.3, 0.4], [0.0, 0.1], [0.3, 0.35]),
}


def data(T: int, seed: int, regimes: str) -> torch.Tensor:
    """A path from the model with ``s`` drawn (seed-wise)."""
    A, Q, C, R = REGIMES[regimes]
    g = torch.Generator().manual_seed(seed)
    s = int(torch.rand((), generator=g) < PI[1])
    x, ys = torch.randn((), generator=g, dtype=torch.float64), []
    for t in range(T):
        if t > 0:
            x = A[s] * x + Q[s] ** 0.5 * torch.randn((), generator=g, dtype=torch.float64)
        ys.append(x + C[s] + R[s] ** 0.5 * torch.randn((), generator=g, dtype=torch.float64))
    return torch.stack(ys)


def model_for(T: int, regimes: str):
    A, Q, C, R = REGIMES[regimes]

    def model(y):
        a, q, c, r = (y.new_tensor(v) for v in (A, Q, C, R))
        s = pyro.sample("s", dist.Categorical(y.new_tensor(PI)))
        x = pyro.sample("x_0", dist.Normal(y.new_zeros(()), 1.0))
        for t in pyro.markov(range(T)):
            if t > 0:
                x = pyro.sample(
                    f"x_{t}", dist.Normal(Vindex(a)[..., s] * x, Vindex(q)[..., s].sqrt())
                )
            loc = x + Vindex(c)[..., s]
            pyro.sample(f"y_{t}", dist.Normal(loc, Vindex(r)[..., s].sqrt()), obs=y[t])

    return model


def run(how: str, regimes: str, T: int, seed: int, steps: int, draws: int):
    y = data(T, seed, regimes)
    model = model_for(T, regimes)
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    if how == "default":
        guide, optim = AutoCVI(model), CVI(step_size=1.0)
    else:
        guide, optim = AutoCVI(model, discrete="collapse"), CVI()
    svi = SVI(model, guide, optim, loss=CVI_ELBO())
    t0 = time.process_time()
    losses = [svi.step(y) for _ in range(steps)]
    cpu = time.process_time() - t0
    text = guide.explain()
    route = (
        "kalman + q(s)"
        if "Markov gaussian chain" in text
        else "remainder, s summed"
        if "# remainder" in text
        else "mean field per x_t"
    )
    near = next(i for i, v in enumerate(losses) if abs(v - losses[-1]) < 0.01) + 1
    pyro.set_rng_seed(seed + 100)
    if "summed" in route:
        elbo, fit_model = TraceEnum_ELBO(max_plate_nesting=0), config_enumerate(model, "parallel")
    else:
        elbo, fit_model = Trace_ELBO(), model
    with torch.no_grad():
        est = torch.tensor([-elbo.loss(fit_model, guide, y) for _ in range(draws)])
    return {
        "how": how,
        "regimes": regimes,
        "route": route,
        "seed": seed,
        "T": T,
        "steps": steps,
        "steps_to_0.01": near,
        "cpu_s_per_step": cpu / steps,
        "bound": float(est.mean()),
        "se": float(est.std() / draws**0.5),
        "reported": -losses[-1],
        "cpu_s": cpu,
        "cpu_s_to_0.01": cpu * near / steps,
    }


COLUMNS = [
    ("regimes", "distinct (the data tell them apart) or close (q(s) stays mixed); data seed"),
    ("default route", "what an unmarked s gets in this tree"),
    ("-ELBO (default)", "-(Trace_ELBO) of the guide after the steps +- SE"),
    ("cpu s to 0.01 (default)", "CPU seconds until the reported loss is within 0.01 of the last"),
    ("-ELBO (summed)", "-(TraceEnum_ELBO) of the remainder's q(x), s summed +- SE"),
    ("cpu s to 0.01 (summed)", "the same for the summed-out guide"),
    ("gap", "default - summed out, in -ELBO (positive: the default's bound is lower)"),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one seed, T = 30, 100 draws")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--T", type=int, default=60)
    p.add_argument("--draws", type=int, default=200)
    p.add_argument("--steps", type=int, default=40, help="steps of the default route")
    p.add_argument("--summed-steps", type=int, default=300)
    p.add_argument("--regimes", nargs="*", default=list(REGIMES), choices=list(REGIMES))
    p.add_argument("--out", default=str(ROOT / "results" / "benchmark_kalman_discrete.json"))
    a = p.parse_args()
    if a.quick:
        a.seeds, a.T, a.draws = 1, 30, 100
    torch.set_num_threads(1)
    rows, gaps = [], {k: [] for k in a.regimes}
    table = Table("A regime-switching local level: the default route or s summed out", COLUMNS)
    for regimes in a.regimes:
        for seed in range(a.seeds):
            de = run("default", regimes, a.T, seed, a.steps, a.draws)
            so = run("summed out", regimes, a.T, seed, a.summed_steps, a.draws)
            rows += [de, so]
            gaps[regimes].append(so["bound"] - de["bound"])
            table.add(
                f"{regimes} {seed}",
                de["route"],
                f"{-de['bound']:.3f} +- {de['se']:.3f}",
                f"{de['cpu_s_to_0.01']:.2f}",
                f"{-so['bound']:.3f} +- {so['se']:.3f}",
                f"{so['cpu_s_to_0.01']:.2f}",
                f"{gaps[regimes][-1]:.3f}",
            )
    table.print()
    ratio = sum(r["cpu_s_to_0.01"] for r in rows[1::2]) / sum(r["cpu_s_to_0.01"] for r in rows[::2])
    spans = "; ".join(f"{k} regimes {min(g):.3f} to {max(g):.3f}" for k, g in gaps.items() if g)
    verdict = (
        f"Verdict: an unmarked global s ({rows[0]['route']}): its bound below s summed out by "
        f"{spans} nats (T = {a.T}, {a.seeds} seeds); {ratio:.1f}x less CPU time to within 0.01 "
        "of its last loss."
    )
    print(verdict)
    write_results(
        a.out,
        {"rows": rows, "args": vars(a)},
        title="A Kalman chain with a discrete parent: the default route against s summed out",
        verdict=verdict,
        tables=[table],
        command="PYTHONPATH=$PWD python scripts/benchmark_kalman_discrete.py "
        + " ".join(sys.argv[1:]),
        quick=a.quick,
    )


if __name__ == "__main__":
    main()
