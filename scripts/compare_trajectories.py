"""Loss trajectories of the zoo models, to show that a refactor changes no number.

Runs every zoo model (``tests/zoo``) from a fixed seed for a few steps with the default
adaptive ``CVI()`` and with the sequential schedule at a fixed step 0.5, and writes the losses
to JSON. With ``--drop-in`` it runs ``CVI()`` (adaptive, and at a fixed step 0.5) on Pyro's
``AutoNormal``, ``AutoMultivariateNormal`` and ``AutoLowRankMultivariateNormal`` with
``Trace_ELBO`` instead (the natural-gradient steps of Pyro's own Gaussian guides).
Run it on two checkouts (``PYTHONPATH=<checkout>``) and compare the files::

    PYTHONPATH=/path/old python scripts/compare_trajectories.py --out old.json
    PYTHONPATH=. python scripts/compare_trajectories.py --out new.json
    python scripts/compare_trajectories.py --compare old.json new.json

The comparison prints the runs that differ and a verdict: identical means bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def trajectories(names, steps: int):
    import pyro
    import torch
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI

    sys.path.insert(0, str(ROOT / "tests"))  # the zoo is a test helper
    from zoo import ZOO

    torch.set_num_threads(1)
    out = {}
    for name in names or list(ZOO):
        entry = ZOO[name]
        for mode in ("auto", "sequential"):
            pyro.clear_param_store()
            pyro.set_rng_seed(0)
            data = entry.data()
            kw = dict(entry.guide_kwargs)
            if mode == "sequential":
                kw["schedule"] = "sequential"
            optim = CVI() if mode == "auto" else CVI(step_size=0.5)
            try:
                guide = AutoCVI(entry.model, **kw)
                svi = SVI(entry.model, guide, optim, loss=CVI_ELBO())
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    out[f"{name}/{mode}"] = [
                        svi.step(*data.args, **data.kwargs) for _ in range(steps)
                    ]
            except Exception as e:  # a run that fails is part of the trajectory
                out[f"{name}/{mode}"] = f"{type(e).__name__}: {str(e)[:100]}"
        print(name, out[f"{name}/auto"], flush=True)
    return out


DROP_IN = ("AutoNormal", "AutoMultivariateNormal", "AutoLowRankMultivariateNormal")


def drop_in_trajectories(names, steps: int):
    import pyro
    import torch
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer import autoguide as ag

    from pyro_cvi import CVI

    sys.path.insert(0, str(ROOT / "tests"))  # the zoo is a test helper
    from zoo import ZOO

    torch.set_num_threads(1)
    out = {}
    for name in names or list(ZOO):
        entry = ZOO[name]
        for guide_name in DROP_IN:
            for mode in ("auto", "fixed"):
                key = f"{name}/{guide_name}/{mode}"
                pyro.clear_param_store()
                pyro.set_rng_seed(0)
                data = entry.data()
                optim = CVI() if mode == "auto" else CVI(step_size=0.5)
                try:
                    guide = getattr(ag, guide_name)(entry.model)
                    svi = SVI(entry.model, guide, optim, loss=Trace_ELBO())
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        out[key] = [svi.step(*data.args, **data.kwargs) for _ in range(steps)]
                except Exception as e:  # a run that fails is part of the trajectory
                    out[key] = f"{type(e).__name__}: {str(e)[:100]}"
        print(name, out[f"{name}/{DROP_IN[1]}/auto"], flush=True)
    return out


def _rel_diff(x, y) -> float:
    """The largest relative difference of two loss lists (inf when not comparable)."""
    if not (isinstance(x, list) and isinstance(y, list)) or len(x) != len(y):
        return float("inf")
    worst = 0.0
    for u, v in zip(x, y):
        if u == v or (u != u and v != v):  # equal, or both NaN
            continue
        worst = max(worst, abs(u - v) / max(abs(u), abs(v), 1e-300))
    return worst


def compare(a_path: str, b_path: str, rtol: float = 0.0) -> int:
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    keys = sorted(set(a) | set(b))
    differ = [k for k in keys if a.get(k) != b.get(k)]
    for k in differ:
        print(f"{k}: {a.get(k)} vs {b.get(k)} (relative {_rel_diff(a.get(k), b.get(k)):.3g})")
    print(f"{len(keys) - len(differ)} of {len(keys)} runs identical bit for bit")
    beyond = [k for k in differ if not _rel_diff(a.get(k), b.get(k)) <= rtol]
    if rtol > 0:
        print(f"{len(keys) - len(beyond)} of {len(keys)} runs agree within {rtol:g} relative")
    verdict = "identical" if not differ else f"{len(differ)} runs differ"
    if differ and rtol > 0:
        verdict += f", {len(beyond)} beyond {rtol:g} relative"
    print(f"Verdict: {verdict}")
    return 0 if not beyond else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON file for the trajectories")
    ap.add_argument("--models", nargs="*", help="zoo entries (default: all)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="three small models, three steps")
    ap.add_argument("--rtol", type=float, default=0.0, help="tolerance of --compare")
    ap.add_argument("--drop-in", action="store_true", help="CVI() on Pyro's Gaussian guides")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two JSON files")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare, rtol=args.rtol)
    names = args.models
    steps = args.steps
    if args.quick:
        names, steps = names or ["coin", "poisson_regression", "hmm"], 3
    out = (drop_in_trajectories if args.drop_in else trajectories)(names, steps)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"Verdict: {len(out)} trajectories written" + (f" to {args.out}" if args.out else ""))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
