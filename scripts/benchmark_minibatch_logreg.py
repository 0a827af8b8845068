"""Logistic regression on minibatches (``pyro.plate(..., subsample_size=256)``), defaults.

N = 20,000 synthetic points, D = 10, minibatches of 256, ``AutoCVI`` + ``CVI()`` as a user
writes them, float32 and float64, ten seeds. After each pass over the data (N / B steps) it
computes the *full-data* -ELBO of the current ``q(w)`` in closed form (Gauss-Hermite per point,
exact KL) and its gap to the full-batch optimum (full-batch ``AutoCVI``, 15 steps at step size
1). The per-point sites of a subsampled plate (the incremental form) should reach the full-data
bound within 1 nat in at most 3 passes, and never diverge.

Usage::

    python scripts/benchmark_minibatch_logreg.py            # 10 seeds x 2 dtypes, ~2 min
    python scripts/benchmark_minibatch_logreg.py --quick    # 2 seeds, float64
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench.reporting import Table, write_results  # noqa: E402

from pyro_cvi import CVI, CVI_ELBO, AutoCVI  # noqa: E402

N, D, B = 20000, 10, 256
PASSES = 5
_x, _w = np.polynomial.hermite_e.hermegauss(40)
GH = torch.tensor(_x), torch.tensor(_w) / math.sqrt(2 * math.pi)


def data(seed: int, dtype):
    g = torch.Generator().manual_seed(100 + seed)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    w0 = torch.randn(D, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(X @ w0), generator=g)
    return X.to(dtype), y.to(dtype)


def model_minibatch(X, y):
    w = pyro.sample("w", dist.Normal(X.new_zeros(D), 1.0).to_event(1))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("y", dist.Bernoulli(logits=X[idx] @ w), obs=y[idx])


def model_full(X, y):
    w = pyro.sample("w", dist.Normal(X.new_zeros(D), 1.0).to_event(1))
    with pyro.plate("data", N):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def full_neg_elbo(q, X, y) -> float:
    """The full-data -ELBO of ``q(w)`` in float64."""
    X, y = X.double(), y.double()
    m, S = q.mean.detach().double(), q.covariance_matrix.detach().double()
    fm, fv = X @ m, ((X @ S) * X).sum(-1)
    eta = fm[:, None] + fv.sqrt()[:, None] * GH[0][None]
    ll = (y[:, None] * eta - torch.nn.functional.softplus(eta)) @ GH[1]
    eye = torch.eye(D, dtype=torch.float64)
    prior = dist.MultivariateNormal(torch.zeros(D, dtype=torch.float64), eye)
    return float(torch.distributions.kl_divergence(dist.MultivariateNormal(m, S), prior) - ll.sum())


def run(seed: int, dtype):
    X, y = data(seed, dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoCVI(model_full)
    svi = SVI(model_full, guide, CVI(step_size=1.0), CVI_ELBO())
    for _ in range(15):
        svi.step(X, y)
    best = full_neg_elbo(guide.posterior("w"), X, y)
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoCVI(model_minibatch)
    svi = SVI(model_minibatch, guide, CVI(), CVI_ELBO())
    t0, gaps, error = time.process_time(), [], ""
    try:
        for _ in range(PASSES):
            for _ in range(math.ceil(N / B)):
                svi.step(X, y)
            gaps.append(full_neg_elbo(guide.posterior("w"), X, y) - best)
    except Exception as e:  # a divergence is a row of the table
        error = f"{type(e).__name__}: {str(e)[:80]}"
    return best, gaps, time.process_time() - t0, error


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 seeds, float64")
    p.add_argument("--out", default=str(ROOT / "results" / "benchmark_minibatch_logreg.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    seeds = range(2 if args.quick else 10)
    dtypes = [torch.float64] if args.quick else [torch.float64, torch.float32]
    cols = [
        ("seed", "data and RNG seed"),
        ("dtype", "the data's dtype"),
        ("optimum", "full-batch -ELBO (full-batch AutoCVI, step 1)"),
    ]
    cols += [
        (f"gap {k}", f"full-data -ELBO of q after pass {k} minus the optimum (nats)")
        for k in range(1, PASSES + 1)
    ]
    cols += [("CPU s", "CPU seconds of the minibatch run"), ("error", "an exception, if any")]
    table = Table("Full-data bound after each pass", cols)
    records, worst3, failures = [], 0.0, 0
    for dt in dtypes:
        for seed in seeds:
            best, gaps, cpu, error = run(seed, dt)
            name = str(dt).replace("torch.", "")
            cells = [seed, name, f"{best:.2f}"] + [f"{g:.3f}" for g in gaps]
            cells += ["-"] * (PASSES - len(gaps)) + [f"{cpu:.1f}", error or "-"]
            table.rows.append(cells)
            print(" ".join(str(c) for c in cells), flush=True)
            records.append(
                dict(seed=seed, dtype=name, optimum=best, gaps=gaps, cpu=cpu, error=error)
            )
            failures += bool(error) or len(gaps) < 3
            worst3 = max(worst3, gaps[2] if len(gaps) >= 3 else math.inf)
    ok = failures == 0 and worst3 < 1.0
    verdict = (
        f"Verdict: every run within {worst3:.3f} nat of the full-data optimum after 3 passes, "
        "none diverged."
        if ok
        else f"Verdict: {failures} runs failed or diverged; worst gap after 3 passes "
        f"{worst3:.3f} nat."
    )
    print(verdict)
    write_results(
        args.out,
        {"runs": records},
        title="Minibatch logistic regression (N=20,000, B=256)",
        verdict=verdict,
        tables=[table],
        quick=args.quick,
        command="python scripts/benchmark_minibatch_logreg.py" + (" --quick" if args.quick else ""),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
