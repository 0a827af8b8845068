"""Pyro's semantics: AutoCVI's q and loss against exact answers and Trace_ELBO, construct by
construct.

Each model of ``tests/test_semantics.py`` that has a closed form (a weighted conjugate
regression, a tempered tree, chain, leaf, Beta-Bernoulli, Gamma-Poisson) is fitted in float64
with ``CVI(step_size=1.0)``; the table gives the largest error of q's mean and covariance
against the tempered posterior, the reported loss against ``-log Z`` and against a Trace_ELBO
estimate of the same guide (``M x P`` draws: 10,000, or 2,000 with ``--quick``), in standard
errors (at least 1e-8 relative: round-off). Prints the table and a verdict and writes
``results/check_semantics.json``.

    OMP_NUM_THREADS=1 python scripts/check_semantics.py           # a few minutes on one core
    OMP_NUM_THREADS=1 python scripts/check_semantics.py --quick   # 2,000 Trace_ELBO draws
"""

import argparse
import json
import math
import sys
from pathlib import Path

import pyro
import torch
from bench.reporting import quick_path
from pyro.infer import Trace_ELBO

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import test_semantics as ts  # noqa: E402

F64 = torch.float64


def regression_cases():
    X, y = ts._data(F64)
    for build in ts.WEIGHTS:
        model, cp, cl = build(X, y)
        names = ["a", "b"] if build is ts.two_sites_one_scaled else ["w"]
        m, V, log_z = ts.tempered_regression(X, y, cp, cl)
        yield build.__name__, model, (X, y), names, (m, V), log_z


def beta_bernoulli(cp, cl):
    y = torch.tensor([1.0, 0, 1, 1, 0, 1, 1, 1, 0, 1], dtype=F64)
    model = ts._weighted(
        cp,
        cl,
        lambda y: pyro.sample("p", ts.dist.Beta(y.new_tensor(ts.A0), ts.B0)),
        lambda p, y: pyro.sample("y", ts.dist.Bernoulli(p), obs=y),
    )
    k = float(y.sum())
    a, b = cp * (ts.A0 - 1) + 1 + cl * k, cp * (ts.B0 - 1) + 1 + cl * (len(y) - k)

    def log_beta(a, b):
        return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)

    log_z = -cp * log_beta(ts.A0, ts.B0) + log_beta(a, b)
    return f"beta_bernoulli_{cp}_{cl}", model, (y,), ["p"], None, log_z


def measure(name, model, args, names, exact, log_z, M, P):
    guide, svi = ts._fit(model, args, steps=10)
    row = {"construct": name}
    if exact is not None:
        mean, cov = ts._joint(guide, names)
        row["mean_error"] = float((mean - exact[0]).abs().max())
        row["cov_error"] = float((cov - exact[1]).abs().max())
    first = svi.evaluate_loss(*args)
    if svi.evaluate_loss(*args) == first:
        loss, loss_se = first, 0.0
    else:
        v = torch.tensor([first] + [svi.evaluate_loss(*args) for _ in range(39)], dtype=F64)
        loss, loss_se = float(v.mean()), float(v.std()) / math.sqrt(len(v))
    row["loss"], row["loss_se"], row["minus_log_z"] = loss, loss_se, -log_z
    elbo = Trace_ELBO(num_particles=P)
    v = torch.tensor([elbo.loss(model, guide, *args) for _ in range(M)], dtype=F64)
    mc, se = float(v.mean()), float(v.std()) / math.sqrt(M)
    # (at an exact tempered posterior Trace_ELBO's draws are all equal: round-off is the floor)
    both = max(math.sqrt(se**2 + loss_se**2), 1e-8 * abs(mc))
    row["trace_elbo"], row["trace_elbo_se"] = mc, se
    row["z"] = (loss - mc) / both
    row["ok"] = (
        abs(loss + log_z) <= 4 * loss_se + 1e-6 * abs(log_z)
        and abs(row["z"]) <= 3
        and row.get("mean_error", 0.0) < 1e-6
        and row.get("cov_error", 0.0) < 1e-6
    )
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,000 Trace_ELBO draws")
    parser.add_argument("--out", default=str(ROOT / "results" / "check_semantics.json"))
    args = parser.parse_args()
    args.out = str(quick_path(args.out, args.quick))
    torch.set_num_threads(1)
    M, P = (10, 200) if args.quick else (10, 1000)
    cases = list(regression_cases())
    cases += [beta_bernoulli(cp, cl) for cp, cl in ts.WEIGHT_PAIRS]
    rows = []
    print(
        f"{'construct':32s} {'|dmean|':>9s} {'|dcov|':>9s} {'loss':>11s} {'-log Z':>11s} "
        f"{'Trace_ELBO':>11s} {'se':>8s} {'z':>6s}"
    )
    for case in cases:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        r = measure(*case, M, P)
        rows.append(r)
        print(
            f"{r['construct']:32s} {r.get('mean_error', float('nan')):9.1e} "
            f"{r.get('cov_error', float('nan')):9.1e} {r['loss']:11.6f} {r['minus_log_z']:11.6f} "
            f"{r['trace_elbo']:11.6f} {r['trace_elbo_se']:8.1e} {r['z']:6.1f}"
        )
    bad = [r["construct"] for r in rows if not r["ok"]]
    verdict = (
        f"verdict: all {len(rows)} constructs give the tempered posterior and Trace_ELBO's loss"
        if not bad
        else f"verdict: {len(bad)} of {len(rows)} constructs disagree: {bad}"
    )
    print(verdict)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"draws": M * P, "rows": rows, "verdict": verdict}))


if __name__ == "__main__":
    main()
