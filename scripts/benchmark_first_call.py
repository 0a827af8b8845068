"""The first call on the zoo's models: its CPU time and whether it imports sympy.

A user's first ``svi.step`` pays the set-up (tracing, analysis, the warm start) and one step,
and whatever the process imports on the way. Torch imports sympy (0.4-0.5 CPU s, once per
process) the first time ``torch.autograd.grad`` is given explicit cotangents or
``torch.broadcast_shapes`` runs (``MultivariateNormal``, ``TransformedDistribution`` and
their transforms call it): on a small model that is most of the time to the first answer.
Each model runs in a fresh process (one thread, float64): ``AutoCVI`` with the zoo's options
and the default ``CVI()``; the first call's CPU seconds, whether sympy came in during it, and
whether the model's own code (run once under ``poutine.trace`` before the clock) imports it.
``--checkout PATH`` measures another checkout's ``pyro_cvi`` alongside (interleaved per
model: before/after in the same period)::

    python scripts/benchmark_first_call.py --checkout /tmp/old   # this tree against /tmp/old
    python scripts/benchmark_first_call.py --quick               # four models; results/quick/
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
QUICK = ["coin", "eight_schools_centered", "local_level", "bayesian_regression"]

_CHILD = r"""
import json, sys, time, warnings
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
import pyro
from pyro.infer import SVI
from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from zoo import ZOO
e = ZOO[{name!r}]
model, kwargs = e.build(torch.float64)
data = e.data(torch.float64)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pyro.poutine.trace(model).get_trace(*data.args, **data.kwargs)  # the model's own imports
    model_sympy = "sympy" in sys.modules
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    c = time.process_time()
    svi = SVI(model, AutoCVI(model, **kwargs), CVI(), CVI_ELBO())
    loss = svi.step(*data.args, **data.kwargs)
    cpu = time.process_time() - c
print(json.dumps(dict(cpu=cpu, sympy=(not model_sympy) and "sympy" in sys.modules,
                      model_sympy=model_sympy, loss=float(loss))))
"""


def child(name: str, tree: Path) -> Dict[str, Any]:
    code = _CHILD.format(tests=str(ROOT / "tests"), name=name)
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tree
    )
    if out.returncode:
        return dict(error=(out.stderr.strip().splitlines() or ["?"])[-1][:200])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Optional[List[str]] = None) -> dict:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT / "tests"))
    from bench.reporting import Table, write_results
    from zoo import ZOO

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"models {', '.join(QUICK)}")
    ap.add_argument("--models", nargs="*", default=None, help="zoo keys (default: all)")
    ap.add_argument("--checkout", default=None, help="another checkout to measure alongside")
    ap.add_argument("--out", default="results/benchmark_first_call.json")
    args = ap.parse_args(argv)
    names = args.models or (QUICK if args.quick else list(ZOO))
    trees = {"this": ROOT, **({"other": Path(args.checkout)} if args.checkout else {})}
    load_before = os.getloadavg()
    rows: Dict[str, Dict[str, Any]] = {}
    for name in names:
        rows[name] = {k: child(name, t) for k, t in trees.items()}
        print(name, {k: v.get("cpu", v.get("error")) for k, v in rows[name].items()}, flush=True)
    cols = [("model", "zoo key")]
    for k in trees:
        cols += [(f"{k} s", f"CPU s of the first call ({k})"), (f"{k} sympy", "imported it")]
    cols.append(("model's own", "the model's code alone imports sympy"))
    table = Table("The first call: CPU s and sympy (fresh process each)", cols)
    for name, r in rows.items():
        cells = [name]
        for k in trees:
            if "cpu" in r[k]:
                cells += [f"{r[k]['cpu']:.3f}", "yes" if r[k]["sympy"] else "no"]
            else:
                cells += ["error", "-"]
        own = r["this"].get("model_sympy")
        cells.append("yes" if own else "no" if own is not None else "-")
        table.add(*cells)
    table.print()
    verdicts = []
    for k in trees:
        ok = [r[k] for r in rows.values() if "cpu" in r[k]]
        n = sum(bool(x["sympy"]) for x in ok)
        med = statistics.median(x["cpu"] for x in ok) if ok else float("nan")
        verdicts.append(f"{k}: {n} of {len(ok)} first calls import sympy, median {med:.3f} CPU s")
    load = os.getloadavg()
    verdict = "Verdict: " + "; ".join(verdicts) + f"; load {load_before[0]:.1f} -> {load[0]:.1f}."
    print(verdict)
    payload = dict(config=dict(models=names, trees={k: str(v) for k, v in trees.items()},
                               load_before=load_before, load_after=load), rows=rows)  # fmt: skip
    write_results(
        args.out, payload, title="The first call on the zoo's models", verdict=verdict,
        tables=[table], command="python scripts/benchmark_first_call.py"
        + (" --quick" if args.quick else ""), quick=args.quick,
        text="One fresh process per model and tree; float64, one thread; CPU seconds.",
    )  # fmt: skip
    return payload


if __name__ == "__main__":
    main()
