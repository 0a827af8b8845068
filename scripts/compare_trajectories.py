"""Loss trajectories of the zoo models, bit for bit, to show that a refactor changes no number.

Each zoo model runs from a fixed seed (``pyro.set_rng_seed(0)``), in each dtype, in two modes:
``auto`` (``AutoCVI`` + the default adaptive ``CVI()`` + ``CVI_ELBO``) and ``sequential``
(``schedule="sequential"``, ``CVI(step_size=0.5)``). A run records every step's loss
(``float.hex``: exact) and the final param store (shape, dtype, a SHA-256 of every parameter's
bytes and its first values). With ``--drop-in`` it runs ``CVI()`` (adaptive, and at a fixed
step 0.5) on Pyro's ``AutoNormal``, ``AutoMultivariateNormal`` and
``AutoLowRankMultivariateNormal`` with ``Trace_ELBO`` instead.

``--checkout PATH`` runs the ``pyro_cvi`` of another checkout (default: this one), so that an
older commit is measured with the same script and the same zoo::

    git worktree add /tmp/old <commit>
    python scripts/compare_trajectories.py --checkout /tmp/old --out old.json
    python scripts/compare_trajectories.py --compare old.json          # this checkout vs old
    python scripts/compare_trajectories.py --compare old.json new.json  # two records

The comparison prints, per run, whether it is bit-identical (every loss and every final
parameter) or where it parts, and a verdict; ``--rtol`` also reports agreement of the losses
within a relative tolerance.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]

#: one or more models per kind of block: site-form Gaussian, Markov chain, mean field
#: (conjugate pairs, discrete labels, Gamma rates), the remainder, minibatches
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
QUICK = ["coin", "bayesian_regression", "lda"]
DROP_IN = ("AutoNormal", "AutoMultivariateNormal", "AutoLowRankMultivariateNormal")


def _digest(t: torch.Tensor) -> Dict:
    t = t.detach().contiguous().cpu()
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype),
        "sha256": hashlib.sha256(t.reshape(-1).numpy().tobytes()).hexdigest(),
        "head": [float(x) for x in t.reshape(-1)[:3].tolist()],
    }


def _run(make, model, data, steps: int) -> Dict:
    """``make() -> (guide, optim, loss)``; every loss and the final parameters (or the error)."""
    import pyro
    from pyro.infer import SVI

    losses: List[str] = []
    t0 = time.process_time()
    try:
        guide, optim, loss = make()
        svi = SVI(model, guide, optim, loss)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(steps):
                losses.append(float(svi.step(*data.args, **data.kwargs)).hex())
    except Exception as e:  # a run that fails is part of the trajectory
        return {"losses": losses, "error": f"{type(e).__name__}: {str(e)[:160]}"}
    store = pyro.get_param_store()
    params = {n: _digest(store.get_param(n).unconstrained()) for n in sorted(store.keys())}
    return {"losses": losses, "params": params, "cpu": time.process_time() - t0}


def runs_of(entry, dtype, steps: int, drop_in: bool) -> Dict[str, Dict]:
    """The runs of one model in one dtype, by mode."""
    import pyro
    from pyro.infer import Trace_ELBO
    from pyro.infer import autoguide as ag

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI

    model, kwargs = entry.build(dtype)
    data = entry.data(dtype)
    if drop_in:
        modes = {
            f"{g}/{m}": (
                lambda g=g, m=m: (
                    getattr(ag, g)(model),
                    CVI() if m == "auto" else CVI(step_size=0.5),
                    Trace_ELBO(),
                )
            )
            for g in DROP_IN
            for m in ("auto", "fixed")
        }
    else:
        modes = {
            "auto": lambda: (AutoCVI(model, **kwargs), CVI(), CVI_ELBO()),
            "sequential": lambda: (
                AutoCVI(model, **{**kwargs, "schedule": "sequential"}),
                CVI(step_size=0.5),
                CVI_ELBO(),
            ),
        }
    out = {}
    for mode, make in modes.items():
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        out[mode] = _run(make, model, data, steps)
    return out


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


def rel_diff(new: Dict, old: Dict) -> float:
    """The largest relative difference of the two runs' losses (inf when not comparable)."""
    a, b = new["losses"], old["losses"]
    if "error" in new or "error" in old or len(a) > len(b):
        return float("inf")
    worst = 0.0
    for u, v in zip(map(float.fromhex, a), map(float.fromhex, b)):
        if u == v or (u != u and v != v):  # equal, or both NaN
            continue
        worst = max(worst, abs(u - v) / max(abs(u), abs(v), 1e-300))
    return worst


def compare(new: Dict[str, Dict], old: Dict[str, Dict], rtol: float) -> List[str]:
    """Print a line per run of ``new``; return the keys that differ (beyond ``rtol``)."""
    same, parted, beyond = [], [], []
    for key, run in new.items():
        if key not in old:
            print(f"{key:48s} (not in the earlier record)")
            continue
        why = differs(run, old[key])
        (same if why is None else parted).append(key)
        line = "bit-identical" if why is None else f"DIFFERS: {why}"
        if why is not None and rtol > 0:
            rel = rel_diff(run, old[key])
            line += f" (losses within {rel:.3g} relative)"
            if not rel <= rtol:
                beyond.append(key)
        print(f"{key:48s} {line}")
    print(f"{len(same)} of {len(same) + len(parted)} runs identical bit for bit")
    if rtol > 0:
        print(f"{len(same) + len(parted) - len(beyond)} runs agree within {rtol:g} relative")
    return beyond if rtol > 0 else parted


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON record to write")
    p.add_argument(
        "--compare", nargs="+", default=None, metavar="RECORD", help="OLD (run now) or OLD NEW"
    )
    p.add_argument("--models", nargs="*", default=None, help="zoo keys (default: the list)")
    p.add_argument("--dtypes", nargs="*", default=["float64", "float32"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="three models, float64, 5 steps")
    p.add_argument("--drop-in", action="store_true", help="CVI() on Pyro's Gaussian guides")
    p.add_argument("--rtol", type=float, default=0.0, help="also report agreement within rtol")
    p.add_argument("--checkout", default=str(ROOT), help="the checkout whose pyro_cvi runs")
    p.add_argument("--zoo", default=str(ROOT / "tests"), help="folder holding the zoo package")
    args = p.parse_args(argv)
    command = "python scripts/compare_trajectories.py " + " ".join(argv or sys.argv[1:])
    if args.compare and len(args.compare) == 2:  # two records
        old, new = (json.loads(Path(f).read_text())["runs"] for f in args.compare)
        bad = compare(new, old, args.rtol)
        print(f"Verdict: {'identical' if not bad else f'{len(bad)} runs differ'}")
        return 1 if bad else 0
    torch.set_num_threads(1)
    sys.path.insert(0, args.zoo)
    sys.path.insert(0, args.checkout)
    from zoo import ZOO

    import pyro_cvi

    package = str(Path(pyro_cvi.__file__).parent)
    print(f"pyro_cvi from {package}")
    if args.quick:
        args.models = args.models or QUICK
        args.dtypes, args.steps = ["float64"], 5
    old = json.loads(Path(args.compare[0]).read_text())["runs"] if args.compare else None
    runs: Dict[str, Dict] = {}
    for name in args.models or MODELS:
        for dt in args.dtypes:
            key = name if dt == "float64" else f"{name}-f32"
            for mode, run in runs_of(
                ZOO[name], getattr(torch, dt), args.steps, args.drop_in
            ).items():
                runs[f"{key}/{mode}"] = run
                if old is None:
                    err = f"  error: {run['error']}" if "error" in run else ""
                    print(f"{key}/{mode:40s} steps {len(run['losses']):3d}{err}", flush=True)
    bad: List[str] = []
    if old is None:
        verdict = f"Verdict: recorded {len(runs)} runs of {args.steps} steps."
    else:
        bad = compare(runs, old, args.rtol)
        verdict = (
            f"Verdict: {len(bad)} of {len(runs)} runs differ: {', '.join(bad)}."
            if bad
            else f"Verdict: all {len(runs)} runs are bit-identical to the earlier record."
        )
    print(verdict)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "title": "Trajectories, bit for bit",
            "verdict": verdict,
            "command": command,
            "quick": args.quick,
            "text": "Every step's loss (float.hex) and a SHA-256 of every final parameter, "
            f"seed 0, per zoo model, dtype and mode; pyro_cvi from {package}.",
        }
        record = {"report": report, "steps": args.steps, "package": package, "runs": runs}
        out.write_text(json.dumps(record, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
