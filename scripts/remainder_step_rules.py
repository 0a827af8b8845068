"""The remainder's default step on every zoo model that has one, and on the recursion and ODE
models of ``benchmark_remainder_cost.py``: its size, form, step, and the two structural facts
the rule reads (``blocks/remainder_rules.VectorisedLogJoint``): the log joint's span and
whether a chain of enumerated states is summed out.

    PYTHONPATH=$PWD python scripts/remainder_step_rules.py [--dtype float64]
        [--out results/remainder_step_rules.json]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Dict, Optional

import pyro
import torch
from bench.reporting import write_results
from benchmark_remainder_cost import MODELS as COST_MODELS
from pyro.infer import SVI

ROOT = Path(__file__).resolve().parents[1]


def row(model, args, kwargs, guide_kwargs) -> Optional[Dict]:
    from pyro_cvi import CVI, CVI_ELBO, AutoCVI
    from pyro_cvi.blocks.remainder_rules import discrete_chain, log_joint_span

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model, **guide_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        SVI(model, guide, CVI(), CVI_ELBO()).step(*args, **kwargs)
    for b in guide.engine.blocks:
        if getattr(b, "kind", None) == "remainder":
            step = "price" if b.hessian else ("one-draw" if b.onedraw else type(b.rule).__name__)
            return {
                "dim": b.dim,
                "form": b.form,
                "step": step,
                "span": log_joint_span(b.analysis, b.owned),
                "discrete_chain": discrete_chain(b.analysis),
            }
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float64")
    p.add_argument("--out", default=str(ROOT / "results" / "remainder_step_rules.json"))
    p.add_argument("--quick", action="store_true", help="three zoo models and GARCH")
    a = p.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "tests"))
    from zoo import ZOO

    dt = getattr(torch, a.dtype)
    rows = {}
    zoo = ["bayesian_regression", "arma11", "hmm_gaussian"] if a.quick else list(ZOO)
    cost = ["garch"] if a.quick else list(COST_MODELS)
    for name in zoo:
        entry = ZOO[name]
        model, kw = entry.build(dt)
        data = entry.data(dt)
        rows[name] = row(model, data.args, data.kwargs, kw)
    for name in cost:
        model, data = COST_MODELS[name]
        rows[f"cost:{name}"] = row(model, data(dt), {}, {})
    rows = {k: v for k, v in rows.items() if v is not None}
    counts: Dict[str, int] = {}
    for v in rows.values():
        counts[v["step"]] = counts.get(v["step"], 0) + 1
    steps = ", ".join(f"{n} take {k}" for k, n in sorted(counts.items()))
    for k, v in rows.items():
        print(
            f"{k:30s} D={v['dim']:4d} {v['form']:5s} {v['step']:13s} span {v['span']:5d}"
            f"  chain {v['discrete_chain']}"
        )
    print(f"Verdict: {len(rows)} models with a remainder; {steps}")
    write_results(
        a.out,
        {"dtype": a.dtype, "rows": rows},
        title="The remainder's default step by the model's structure",
        verdict=f"Verdict: {len(rows)} models with a remainder; {steps}",
        command=f"PYTHONPATH=$PWD python scripts/remainder_step_rules.py --dtype {a.dtype}",
        quick=a.quick,
    )


if __name__ == "__main__":
    main()
