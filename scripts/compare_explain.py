"""``explain()`` of every zoo model, text for text, to show that a set-up change moves no factor.

Each zoo model is built in each dtype, fitted one step from a fixed seed (``AutoCVI`` with the
zoo's options, the default ``CVI()``, ``CVI_ELBO``), and its ``guide.explain()`` and first loss
(``float.hex``: exact) are recorded. ``--checkout PATH`` records another checkout's
``pyro_cvi`` (in a child process whose path puts that checkout first) with the same zoo::

    python scripts/compare_explain.py --checkout /tmp/old --out old.json
    python scripts/compare_explain.py --out new.json
    python scripts/compare_explain.py --compare old.json new.json
    python scripts/compare_explain.py --quick   # four models, float64

The comparison prints each entry that differs (its explanation, first loss or error) and a
verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["coin", "bayesian_regression", "poisson_regression", "local_level"]

_CHILD = r"""
import json, sys, warnings
sys.path.insert(0, {zoo!r})
import torch
torch.set_num_threads(1)
import pyro
from pyro.infer import SVI
import pyro_cvi
from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from zoo import ZOO
out = {{"_package": pyro_cvi.__file__}}
for name in {names!r} or list(ZOO):
    e = ZOO[name]
    for dt in {dtypes!r}:
        key = name + "/" + dt
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, kw = e.build(getattr(torch, dt))
                data = e.data(getattr(torch, dt))
                guide = AutoCVI(model, **kw)
                loss = SVI(model, guide, CVI(), CVI_ELBO()).step(*data.args, **data.kwargs)
                out[key] = {{"explain": guide.explain(), "loss": float(loss).hex()}}
        except Exception as ex:  # a model that fails is part of the record
            out[key] = {{"error": (type(ex).__name__ + ": " + str(ex))[:300]}}
print(json.dumps(out))
"""


def record(tree: Path, names: Optional[List[str]], dtypes: List[str]) -> Dict:
    code = _CHILD.format(zoo=str(ROOT / "tests"), names=names, dtypes=dtypes)
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tree
    )
    if out.returncode:
        raise SystemExit(f"the child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(a: Dict, b: Dict) -> str:
    keys = [k for k in sorted(set(a) | set(b)) if not k.startswith("_")]
    differ = [k for k in keys if a.get(k) != b.get(k)]
    for k in differ:
        print(f"{k}: differs")
        for side, rec in (("first", a.get(k)), ("second", b.get(k))):
            print(f"  {side}: {json.dumps(rec)[:400]}")
    same = len(keys) - len(differ)
    word = "identical" if not differ else f"{len(differ)} differ"
    return f"Verdict: explain() and first loss of {same} of {len(keys)} entries identical ({word})."


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK)}; float64")
    ap.add_argument("--models", nargs="*", default=None, help="zoo keys (default: all)")
    ap.add_argument("--dtypes", nargs="*", default=["float64", "float32"])
    ap.add_argument("--checkout", default=str(ROOT), help="the checkout whose pyro_cvi runs")
    ap.add_argument(
        "--compare", nargs="+", default=None, help="one record (against this run) or two"
    )
    ap.add_argument("--out", default=None, help="JSON record to write")
    args = ap.parse_args(argv)
    names = QUICK if args.quick and not args.models else args.models
    dtypes = ["float64"] if args.quick else args.dtypes
    if args.compare and len(args.compare) == 2:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare)
        print(compare(a, b))
        return
    rec = record(Path(args.checkout).resolve(), names, dtypes)
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=1))
    if args.compare:
        print(compare(json.loads(Path(args.compare[0]).read_text()), rec))
    else:
        n = sum(1 for k in rec if not k.startswith("_"))
        errors = sum(1 for k, v in rec.items() if not k.startswith("_") and "error" in v)
        print(
            f"Verdict: recorded explain() of {n} entries ({errors} errors) from {rec['_package']}."
        )


if __name__ == "__main__":
    main()
