"""Models built to fool AutoCVI's analysis (``tests/fooling_cases.py``): how each is
classified, and whether the loss it reports is the bound of the ``q`` it samples.

For every case and dtype: the default ``AutoCVI`` + ``CVI()`` for ``--steps`` steps, then

* the kinds ``explain()`` gives the watched factor; a factor whose parameter is not affine in
  the latents (the case's ``affine=False``) must not be ``conjugate``/``linear-predictor``
  (an exact rule), only a Monte Carlo one (``general``, ``natural-gradient``, ...);
* ``guide.check_bound(num_particles=--draws)``: the reported loss against a Trace_ELBO
  estimate of the same guide, agreeing within 3 standard errors;
* for a model that must be refused (the case's ``cause``): whether the error names it, and
  whether it is a raw error (``AssertionError``, a torch ``RuntimeError``) instead of a
  ``ValueError``/``NotImplementedError`` of Pyro's or pyro-cvi's.

Prints a table and a verdict, writes JSON (``--out``, default ``results/check_fooling.json``).

Usage::

    python scripts/check_fooling.py                       # every case, float64 and float32
    python scripts/check_fooling.py --cases relu abs --dtypes float64
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
from bench.reporting import quick_path  # noqa: E402

#: kinds that claim an exact (affine) dependence on the latent
EXACT_KINDS = ("conjugate prior", "conjugate", "conjugate (MC)", "linear-predictor")
_KINDS = (
    "conjugate prior|conjugate \\(MC\\)|conjugate|linear-predictor|softmax-predictor|general|"
    "natural-gradient|collapsed|leaf|constant"
)
_LINE = re.compile(rf"^\s*(\S+) -> (.+?)\s+({_KINDS})\s+(.*)$")


def kinds_of(explained: str, site: Optional[str]) -> List[str]:
    """``kind (latent): why`` of every ``explain()`` line of factor ``site``."""
    out = []
    for line in explained.splitlines():
        m = _LINE.match(line)
        if m and m.group(1) == site:
            out.append(f"{m.group(3)} ({m.group(2)}): {m.group(4)}")
    if site is not None and not out and "remainder" in explained:
        out.append("in the remainder (natural-gradient)")
    return out


def run_case(case, dtype, steps: int, draws: int) -> Dict:
    import pyro
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    row: Dict = {"case": case.name, "group": case.group, "dtype": str(dtype)[6:]}
    t0 = time.process_time()
    model, args = case.build(dtype)
    guide = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            guide = AutoCVI(model, **case.guide_kwargs)
            svi = SVI(model, guide, CVI(), CVI_ELBO())
            losses = [svi.step(*args) for _ in range(steps)]
            row["last_loss"] = losses[-1]
            row["explain"] = kinds_of(guide.explain(), case.site)
            check = guide.check_bound(*args, num_particles=draws, warn=False)
            row.update(
                reported=check.reported,
                estimate=check.estimate,
                se=check.se,
                z=check.z,
                within_3se=check.agrees,
            )
        except Exception as e:  # a refusal is a row of the table too
            msg = str(e).splitlines()[0] if str(e) else ""
            row["error"] = f"{type(e).__name__}: {msg[:300]}"
            row["raw_error"] = isinstance(e, (AssertionError, IndexError, TypeError)) or (
                type(e) is RuntimeError
            )
            if case.cause:
                row["names_cause"] = any(w.lower() in str(e).lower() for w in case.cause)
            if guide is not None and guide.prototype_trace is not None and "explain" not in row:
                try:
                    row["explain"] = kinds_of(guide.explain(), case.site)
                except Exception:
                    pass
    row["warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:120]}" for w in caught})
    row["cpu_s"] = round(time.process_time() - t0, 2)
    row["verdict"], row["why"] = verdict(case, row)
    return row


def verdict(case, row) -> tuple:
    """``("ok" | "FAIL", reason)``."""
    kinds = row.get("explain", [])
    if "error" in row:
        if not case.cause:
            return "FAIL", "refused a model it should fit"
        if row.get("raw_error"):
            return "FAIL", "a raw error"
        if not row.get("names_cause"):
            return "FAIL", "the error does not name the cause"
        return "ok", "refused by name"
    if case.cause:
        if row.get("within_3se"):
            return "FAIL", "fitted a model it should refuse (its loss is the bound of that q)"
        return "FAIL", "fitted a model it should refuse, loss not the bound"
    if case.affine is False and any(k.split(" (")[0] in EXACT_KINDS for k in kinds):
        if not row.get("within_3se"):
            return "FAIL", "classified exact, loss not the bound"
        return "FAIL", "classified exact (the loss agrees here)"
    if not row.get("within_3se"):
        return "FAIL", "loss not the bound"
    return "ok", "classified right or general; loss is the bound"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="*", default=None, help="case names (default: all)")
    p.add_argument("--dtypes", nargs="*", default=["float64", "float32"])
    p.add_argument("--steps", type=int, default=30, help="CVI() steps per fit")
    p.add_argument("--draws", type=int, default=2000, help="Trace_ELBO draws of the check")
    p.add_argument("--out", default=str(ROOT / "results" / "check_fooling.json"))
    p.add_argument("--quick", action="store_true", help="4 cases, float64, 10 steps, 400 draws")
    args = p.parse_args(argv)
    if args.quick:
        args.dtypes, args.steps, args.draws = ["float64"], 10, 400
        args.cases = args.cases or ["control_affine", "clamp_100z", "relu", "factor_in_plate"]
    args.out = str(quick_path(args.out, args.quick))
    torch.set_num_threads(1)
    from fooling_cases import CASES

    cases = [c for c in CASES if args.cases is None or c.name in args.cases]
    rows = []
    for case in cases:
        for dt in args.dtypes:
            row = run_case(case, getattr(torch, dt), args.steps, args.draws)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(f"{'case':24s} {'dtype':8s} {'kind of the watched factor':44s} {'loss':>22s}  verdict")
    for r in rows:
        kind = "; ".join(k.split(":")[0] for k in r.get("explain", [])) or "-"
        if "error" in r:
            loss = r["error"][:22]
        else:
            loss = f"{r['reported']:.3f}/{r['estimate']:.3f} z={r['z']:+.1f}"
        what = f"{r['verdict']}: {r['why']}"
        print(f"{r['case']:24s} {r['dtype']:8s} {kind[:44]:44s} {loss:>22s}  {what}")
    bad = [f"{r['case']}/{r['dtype']}" for r in rows if r["verdict"] != "ok"]
    print(
        f"\nVerdict: {len(rows) - len(bad)} of {len(rows)} rows ok ({len(cases)} models)"
        + (f"; failing: {', '.join(bad)}" if bad else "")
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"steps": args.steps, "draws": args.draws, "rows": rows, "failing": bad}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
