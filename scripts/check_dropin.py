#!/usr/bin/env python
"""``CVI()`` as a drop-in for Adam on the table of model/guide pairs in ``tests/dropin_cases.py``.

Each case is trained twice from the same start, with Pyro's Adam (lr 0.01, the learning rate
``CVI()`` gives its inner optimizer) and with ``pyro_cvi.CVI()``, for the case's number of steps;
"trains" means the many-draw -ELBO estimate fell by at least the case's margin (the same
criterion for both). Prints a table (case, Adam trains?, CVI runs?, CVI trains?, error) and
writes ``results/check_dropin.json``; ``--xfail`` prints the cases ``CVI()`` does not train as
the literal that ``tests/test_dropin_table.py`` marks.

    python scripts/check_dropin.py                    # every case
    python scripts/check_dropin.py -k gamma --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import dropin_cases as table  # noqa: E402
from bench.reporting import quick_path  # noqa: E402

from pyro_cvi import CVI  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("-k", default=None, help="only cases whose name contains this")
    ap.add_argument("--out", default=str(ROOT / "results" / "check_dropin.json"))
    ap.add_argument("--no-adam", action="store_true", help="skip the Adam ground truth")
    ap.add_argument("--xfail", action="store_true", help="print the set CVI() fails as a literal")
    ap.add_argument("--quick", action="store_true", help="the fast share, CVI() only (< 2 min)")
    a = ap.parse_args(argv)
    if a.quick:
        a.no_adam = True
    torch.set_num_threads(1)
    cases = [c for c in table.CASES if (a.k is None or a.k in c.name) and (c.fast or not a.quick)]
    rows = []
    t0 = time.process_time()
    print(f"{'case':45s} {'adam':>6s} {'cvi runs':>8s} {'cvi trains':>10s}  error")
    for case in cases:
        row = {
            "case": case.name,
            "tags": list(case.tags),
            "steps": case.steps,
            "margin": case.margin,
            "loop": case.loop,
        }
        if not a.no_adam:
            row["adam"] = table.run_case(case, table.adam).row()
        row["cvi"] = table.run_case(case, CVI).row()
        rows.append(row)
        adam = "-" if a.no_adam else ("yes" if row["adam"]["trains"] else "NO")
        cvi = row["cvi"]
        err = (cvi["error"] or "") if not cvi["runs"] else ""
        if not a.no_adam and row["adam"]["error"]:
            err = "adam: " + row["adam"]["error"]
        print(
            f"{case.name:45s} {adam:>6s} {'yes' if cvi['runs'] else 'no':>8s} "
            f"{'yes' if cvi['trains'] else 'no':>10s}  {err[:110]}",
            flush=True,
        )
    n = len(rows)
    adam_ok = sum(r["adam"]["trains"] for r in rows) if not a.no_adam else None
    runs = sum(r["cvi"]["runs"] for r in rows)
    trains = sum(r["cvi"]["trains"] for r in rows)
    adam = "Adam not run" if adam_ok is None else f"Adam trains {adam_ok}"
    verdict = f"Verdict: of {n} cases, {adam}; CVI() runs {runs} and trains {trains}."
    print(verdict)
    failing = sorted(r["case"] for r in rows if not r["cvi"]["trains"])
    if a.xfail:
        print("FAILING = frozenset(" + json.dumps(failing, indent=4) + ")")
    out = quick_path(a.out, a.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "pyro": __import__("pyro").__version__,
        "command": "python scripts/check_dropin.py" + (f" -k {a.k}" if a.k else ""),
        "cpu_seconds": time.process_time() - t0,
        "criterion": "many-draw -ELBO estimate after `steps` steps below the start by `margin`; "
        "Adam lr 0.01",
    }
    out.write_text(
        json.dumps({"meta": meta, "verdict": verdict, "cvi_fails": failing, "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
