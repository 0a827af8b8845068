"""A mixture of logistic regressions, ``y ~ Bernoulli(logits = x b + c[s])``, two ways:

* ``mean field`` (the default for an unmarked ``s``): ``q(s) q(b, c)``, the Gaussian block with
  one linear-predictor site per value of ``s`` and point, ``q(s)`` by its exact expected
  message (``pyro_cvi.model.discrete_glm``); ``schedule="sequential"``, ``CVI(step_size=1)``;
* ``summed out`` (``AutoCVI(discrete="collapse")``, the route every unmarked ``s`` took before):
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
import json
import time
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO, TraceEnum_ELBO, config_enumerate
from pyro.ops.indexing import Vindex

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

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
        guide = AutoCVI(model, schedule="sequential")
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--draws", type=int, default=500)
    p.add_argument("--out", default=str(ROOT / "results" / "benchmark_discrete_glm.json"))
    a = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(
        f"{'model':>10s} {'how':>11s} {'route':>9s} {'seed':>4s} {'steps':>5s} "
        f"{'bound':>10s} {'se':>6s} {'cpu s':>6s}"
    )
    for local in (False, True):
        for seed in range(a.seeds):
            for how, steps in (("mean field", 30), ("summed out", 300)):
                r = run(local, how, a.n, seed, steps, a.draws)
                rows.append(r)
                print(
                    f"{r['model']:>10s} {how:>11s} {r['route']:>9s} {seed:4d} {steps:5d} "
                    f"{r['bound']:10.3f} {r['se']:6.3f} {r['cpu_s']:6.2f}"
                )
    Path(a.out).write_text(json.dumps({"rows": rows, "args": vars(a)}, indent=1))


if __name__ == "__main__":
    main()
