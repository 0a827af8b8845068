"""Trajectories of a fixed list of zoo models, recorded bit for bit, to show that a
restructuring of the engine changes no number.

For each model (both dtypes) it runs ``--steps`` steps of ``AutoCVI`` + ``CVI()`` + ``CVI_ELBO``
from a fixed seed and records every step's loss (``float.hex``: exact) and the final param
store (shape, dtype and a SHA-256 of the bytes of every parameter, plus its first values for a
reader). ``--compare OLD`` reads an earlier record and says, per model, whether the new run is
bit-identical (every loss and every parameter), and if not, the first step whose loss differs.

Usage::

    python scripts/compare_trajectories.py --out results/trajectories_ee331bf.json
    python scripts/compare_trajectories.py --compare results/trajectories_ee331bf.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]

QUICK = ["coin", "bayesian_regression", "lda"]

#: one or more models per kind of block: site-form Gaussian, Markov chain, mean field
#: (conjugate pairs, discrete labels, Gamma rates), the remainder, minibatches, collapsed sums
MODELS = [
    "coin",
    "coin_sequential",
    "poisson_regression",
    "bayesian_regression",
    "bnn",
    "subsampled_logistic",
    "eight_schools_noncentered",
    "gaussian_mixture",
    "lda",
    "hmm",
    "ppca",
    "local_level",
    "stochastic_volatility",
    "poisson_changepoint",
    "horseshoe_logistic",
    "lkj_mvn",
]


def _digest(t: torch.Tensor) -> Dict:
    t = t.detach().contiguous().cpu()
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype),
        "sha256": hashlib.sha256(t.reshape(-1).numpy().tobytes()).hexdigest(),
        "head": [float(x) for x in t.reshape(-1)[:3].tolist()],
    }


def run(entry, dtype, steps: int) -> Dict:
    """One model, one dtype: every loss and the final parameters (or the error)."""
    import pyro
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, kwargs = entry.build(dtype)
    data = entry.data(dtype)
    losses: List[str] = []
    t0 = time.process_time()
    try:
        guide = AutoCVI(model, **kwargs)
        svi = SVI(model, guide, CVI(), CVI_ELBO())
        for _ in range(steps):
            losses.append(float(svi.step(*data.args, **data.kwargs)).hex())
    except Exception as e:  # a failure is part of the trajectory too
        return {"losses": losses, "error": f"{type(e).__name__}: {str(e)[:160]}"}
    store = pyro.get_param_store()
    params = {n: _digest(store.get_param(n).unconstrained()) for n in sorted(store.keys())}
    return {"losses": losses, "params": params, "cpu": time.process_time() - t0}


def differs(new: Dict, old: Dict) -> Optional[str]:
    """``None`` when bit-identical, else where the two runs part (a shorter new run: its
    losses against the record's first ones, the parameters not compared)."""
    if new.get("error") != old.get("error"):
        return f"error {old.get('error')!r} -> {new.get('error')!r}"
    for i, (a, b) in enumerate(zip(new["losses"], old["losses"])):
        if a != b:
            return f"loss of step {i + 1}: {float.fromhex(b)!r} -> {float.fromhex(a)!r}"
    if len(new["losses"]) < len(old["losses"]) and "error" not in new:
        return None  # a shorter run (--quick): its losses are the record's first ones
    if len(new["losses"]) != len(old["losses"]):
        return f"{len(old['losses'])} -> {len(new['losses'])} steps"
    newp, oldp = new.get("params", {}), old.get("params", {})
    if set(newp) != set(oldp):
        return f"parameters {sorted(set(oldp) ^ set(newp))} added or removed"
    changed = [n for n in newp if newp[n]["sha256"] != oldp[n]["sha256"]]
    return f"final parameters differ: {changed}" if changed else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON record to write")
    p.add_argument("--compare", default=None, help="an earlier record")
    p.add_argument("--models", nargs="*", default=None, help="zoo keys (default: the list)")
    p.add_argument("--dtypes", nargs="*", default=["float64", "float32"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="three models, float64, 5 steps")
    p.add_argument("--zoo", default=str(ROOT / "tests"), help="folder holding the zoo package")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sys.path.insert(0, args.zoo)
    sys.path.insert(0, str(ROOT))  # this checkout's pyro_cvi, not an installed one
    from zoo import ZOO

    import pyro_cvi

    print(f"pyro_cvi from {Path(pyro_cvi.__file__).parent}")

    if args.quick:
        args.models = args.models or QUICK
        args.dtypes, args.steps = ["float64"], 5
    old = json.loads(Path(args.compare).read_text())["runs"] if args.compare else None
    names = args.models or MODELS
    runs: Dict[str, Dict] = {}
    same, parted = [], []
    for name in names:
        for dt in args.dtypes:
            key = name if dt == "float64" else f"{name}-f32"
            runs[key] = run(ZOO[name], getattr(torch, dt), args.steps)
            line = f"{key:34s} steps {len(runs[key]['losses']):3d}"
            if "error" in runs[key]:
                line += f"  error: {runs[key]['error']}"
            if old is not None:
                if key not in old:
                    line += "  (not in the earlier record)"
                else:
                    why = differs(runs[key], old[key])
                    (same if why is None else parted).append(key)
                    line += "  bit-identical" if why is None else f"  DIFFERS: {why}"
            print(line, flush=True)
    if old is None:
        verdict = f"Verdict: recorded {len(runs)} runs of {args.steps} steps."
    elif parted:
        verdict = f"Verdict: {len(parted)} of {len(runs)} runs differ: {', '.join(parted)}."
    else:
        verdict = f"Verdict: all {len(same)} runs are bit-identical to the earlier record."
    print(verdict)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "report": {
                "title": "Trajectories, bit for bit",
                "verdict": verdict,
                "command": "python scripts/compare_trajectories.py "
                + " ".join(argv or sys.argv[1:]),
                "quick": args.quick,
                "text": "Every step's loss (float.hex) and a SHA-256 of every final parameter "
                "of AutoCVI + CVI() + CVI_ELBO, seed 0, per zoo model and dtype.",
            },
            "steps": args.steps,
            "command": "python scripts/compare_trajectories.py " + " ".join(argv or sys.argv[1:]),
            "package": str(Path(pyro_cvi.__file__).parent),
            "runs": runs,
        }
        out.write_text(json.dumps(record, indent=1))
    return 1 if parted else 0


if __name__ == "__main__":
    raise SystemExit(main())
