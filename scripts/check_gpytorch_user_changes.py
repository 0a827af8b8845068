"""What a GPyTorch user changes between training steps, case by case: seen at the next step or
refused by name.

Each case of ``tests/gpytorch_user_changes.py`` trains a sparse GP regression (40 points, 10
inducing points, Gaussian likelihood, ``step_size=1.0``) for 3 steps with one stepper (``loop``:
GPyTorch's ``loss.backward()``; ``cvi``: ``CVIOptimizer`` on the strategy built the GPyTorch way;
``sites``: ``CVIOptimizer`` on the data-site sparse form), changes one thing by hand and takes 3
more steps. The table gives the largest error of q(u)'s mean (in prior standard deviations) and
covariance (in prior variances) against the exact optimal q(u) after the change (closed form,
float64), how far the old answer is from the new one, or the error the step raised. Prints the
table and a verdict and writes ``results/check_gpytorch_user_changes.json``.

    OMP_NUM_THREADS=1 python scripts/check_gpytorch_user_changes.py          # about a minute
    OMP_NUM_THREADS=1 python scripts/check_gpytorch_user_changes.py --quick  # float64 only
"""

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
from bench.reporting import quick_path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import gpytorch_user_changes as uc  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="float64 only")
    parser.add_argument("--out", default=str(ROOT / "results" / "check_gpytorch_user_changes.json"))
    args = parser.parse_args()
    args.out = str(quick_path(args.out, args.quick))
    torch.set_num_threads(1)
    dtypes = [torch.float64] if args.quick else [torch.float32, torch.float64]
    rows = []
    print(f"{'case':46s} {'dtype':8s} {'|dmean|':>9s} {'|dcov|':>9s} {'old gap':>9s}  outcome")
    for dtype in dtypes:
        tol = uc.tolerance(dtype)
        for name, case in uc.CASES.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                r = uc.run_case(name, dtype)
            err_type = r.pop("error_type", None)
            if case.error is not None:
                ok = err_type is not None and issubclass(err_type, case.error[0])
                ok = ok and case.error[1] in r["error"]
                outcome = ("refused: " if ok else "NOT REFUSED: ") + r.get("error", "no error")
            else:
                ok = "error" not in r and r["mean_error"] < tol and r["cov_error"] < tol
                outcome = ("exact" if ok else "WRONG") if "error" not in r else r["error"]
            r["ok"], r["expected"] = ok, "error" if case.error else "exact q(u)"
            rows.append(r)
            print(
                f"{name:46s} {r['dtype']:8s} {r.get('mean_error', float('nan')):9.1e} "
                f"{r.get('cov_error', float('nan')):9.1e} "
                f"{r.get('old_answer_gap', float('nan')):9.1e}  {outcome[:90]}"
            )
    bad = [f"{r['case']} ({r['dtype']})" for r in rows if not r["ok"]]
    n = len(uc.CASES)
    verdict = (
        f"verdict: all {n} changes in {len(dtypes)} dtype(s) are seen at the next step (q(u) "
        "exact after it) or refused by name"
        if not bad
        else f"verdict: {len(bad)} of {len(rows)} rows wrong: {bad}"
    )
    print(verdict)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "verdict": verdict}, indent=1))


if __name__ == "__main__":
    main()
