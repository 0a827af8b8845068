"""A mixture of logistic regressions, ``y ~ Bernoulli(logits = x b + c[s])``, two ways:

* ``mean field`` (``discrete="mean_field"``; the default for a global unmarked ``s``):
  ``q(s) q(b, c)``, the Gaussian block with one linear-predictor site per value of ``s`` and
  point, ``q(s)`` by its exact expected message (``pyro_cvi.model.discrete_glm``);
  ``schedule="sequential"``, ``CVI(step_size=1)``;
* ``summed out`` (``AutoCVI(discrete="collapse")``; the default for a plate-local ``s_n``):
  ``s`` summed out in the remainder's log joint, ``q(b, c)`` one joint Gaussian stepped by
  natural gradients (default ``CVI()``).

Each is scored by an estimate of its own bound from the same number of draws of its guide:
Trace_ELBO for the mean field (``s`` drawn from ``q(s)``), TraceEnum_ELBO for the summed-out
guide (``s`` summed, the collapsed bound). Both are lower bounds on ``log p(y)``; higher is
better. CPU seconds (``time.process_time``, one thread) to the last step. Prints a table and
writes ``results/benchmark_discrete_glm.json``::

    PYTHONPATH=$PWD python scripts/benchmark_discrete_glm.py [--seeds 3] [--n 200]
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
D, K = 2, 2


def data(n: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    s = (torch.rand(n, generator=g, dtype=torch.float64) < 0.3).long()
    eta = x @ torch.tensor([1.0, -0.8], dtype=torch.float64) + torch.tensor([-2.0, 2.0])[s]
    y = torch.bernoulli(torch.sigmoid(eta), generator=g)
    return x.to(dtype), y.to(dtype)


def model_for(local: bool, n: int):
    def model(x, y):
        b = pyro.sample("b", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
        c = pyro.sample("c", dist.Normal(x.new_tensor([-1.0, 1.0]), 1.0).to_event(1))
        pi = x.new_tensor([0.7, 0.3])
        if not local:
            shift = Vindex(c)[..., pyro.sample("s", dist.Categorical(pi))]
        with pyro.plate("n", n):
            if local:
                shift = Vindex(c)[..., pyro.sample("s", dist.Categorical(pi))]
            pyro.sample("y", dist.Bernoulli(logits=(x * b).sum(-1) + shift), obs=y)

    return model


def run(local: bool, how: str, n: int, seed: int, steps: int, draws: int):
    x, y = data(n, seed)
    model = model_for(local, n)
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    if how == "mean field":
        guide = AutoCVI(model, schedule="sequential", discrete="mean_field")
        optim = CVI(step_size=1.0)
    else:
        guide = AutoCVI(model, discrete="collapse")
        optim = CVI()
    svi = SVI(model, guide, optim, loss=CVI_ELBO())
    t0 = time.process_time()
    for _ in range(steps):
        svi.step(x, y)
    cpu = time.process_time() - t0
    text = guide.explain()
    route = "remainder" if "# remainder" in text else "blocks"
    pyro.set_rng_seed(seed + 100)
    if how == "mean field":
        elbo = Trace_ELBO(num_particles=draws, vectorize_particles=True, max_plate_nesting=1)
    else:  # (s summed out: the model marks it for TraceEnum_ELBO)
        elbo = TraceEnum_ELBO(num_particles=draws, vectorize_particles=True, max_plate_nesting=1)
        model = config_enumerate(model, "parallel")
    with torch.no_grad():
        est = torch.tensor([-elbo.loss(model, guide, x, y) for _ in range(4)])
    return {
        "model": "local s_n" if local else "global s",
        "how": how,
        "route": route,
        "seed": seed,
        "n": n,
        "steps": steps,
        "bound": float(est.mean()),
        "se": float(est.std() / 2),
        "cpu_s": cpu,
    }


COLUMNS = [
    ("model", "one global s, or one s_n per point"),
    ("mean field", "-(Trace_ELBO) of q(s) q(b, c) after 30 sequential sweeps at step 1 +- SE"),
    ("cpu s (mf)", "CPU seconds of those sweeps"),
    ("summed out", "-(TraceEnum_ELBO) of the remainder's q(b, c), s summed, after 300 steps"),
    ("cpu s (summed)", "CPU seconds of those steps"),
    ("gap", "mean field - summed out, in -ELBO (positive: the mean field's bound is lower)"),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one seed, N = 60, 500 draws")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--draws", type=int, default=500)
    p.add_argument("--out", default=str(ROOT / "results" / "benchmark_discrete_glm.json"))
    a = p.parse_args()
    if a.quick:
        a.seeds, a.n = 1, 60
    torch.set_num_threads(1)
    rows, table = (
        [],
        Table("A mixture of logistic regressions: the mean field or s summed out", COLUMNS),
    )
    gaps: dict = {"global s": [], "local s_n": []}
    for local in (False, True):
        for seed in range(a.seeds):
            mf = run(local, "mean field", a.n, seed, 30, a.draws)
            so = run(local, "summed out", a.n, seed, 300, a.draws)
            rows += [mf, so]
            gap = mf["bound"] - so["bound"]
            gaps[mf["model"]].append(gap)
            table.add(
                f"{mf['model']} (seed {seed})",
                f"{-mf['bound']:.3f} +- {mf['se']:.3f}",
                f"{mf['cpu_s']:.2f}",
                f"{-so['bound']:.3f} +- {so['se']:.3f}",
                f"{so['cpu_s']:.2f}",
                f"{-gap:.3f}",
            )
    table.print()
    g, loc = gaps["global s"], gaps["local s_n"]
    verdict = (
        f"Verdict: a global s, the mean field's bound within {max(-x for x in g):.3f} nats of s "
        f"summed out; one s_n per point, {min(-x for x in loc):.2f}-{max(-x for x in loc):.2f} "
        "nats below it (the default sums s_n out)."
    )
    print(verdict)
    write_results(
        a.out,
        {"rows": rows, "args": vars(a)},
        title="A GLM with a discrete parent: the mean field against s summed out",
        verdict=verdict,
        tables=[table],
        command="PYTHONPATH=$PWD python scripts/benchmark_discrete_glm.py "
        + " ".join(sys.argv[1:]),
        quick=a.quick,
    )


if __name__ == "__main__":
    main()
