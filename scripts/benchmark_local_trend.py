"""A local linear trend with latent scales written with two cumsums: the exact Kalman block.

``sigma_level, sigma_obs ~ HalfNormal(1)``, ``sigma_slope ~ HalfNormal(0.2)``; in one plate of
``T`` ``eta ~ Normal(0, sigma_slope)``, ``eps ~ Normal(0, sigma_level)``;
``level = (eta.cumsum(-1) + eps).cumsum(-1)``; ``y ~ Normal(level, sigma_obs)`` (simulated with
slope sd 0.02, level sd 0.2, noise 0.5). Ways, all ``AutoCVI`` + ``CVI()``:

* ``default``: the two increments sites as one chain of ``x_t = (slope_t, level_t - slope_t)``
  (``A = [[1, 0], [1, 1]]``, diagonal ``Q``), its Kalman block at the expected precisions
  beside the remainder's ``q`` of the three scales (``blocks/scaled_walk.py``);
* ``remainder``: ``families={"eta": "joint"}``, the whole model in the remainder's one joint
  Gaussian (the default before);
* ``markov``: the brief's ``pyro.markov`` spelling of a 2-d state (``x_0 ~ N(0, I)``: another
  model, its own exact answer not computed; for its speed).

Each fit is scored by ``Trace_ELBO`` (``--eval-particles``, not timed) against the exact
``-log p(y)`` of the cumsum model: a Kalman filter on ``(slope, level)`` at every point of a
grid of the three log scales (``--grid`` a side). Usage::

    python scripts/benchmark_local_trend.py --quick
    python scripts/benchmark_local_trend.py --out results/benchmark_local_trend.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

import trend_models as tm  # noqa: E402
from bench.reporting import Table, fmt, write_results  # noqa: E402

from pyro_cvi import CVI, CVI_ELBO, AutoCVI  # noqa: E402

trend = tm.trend(tm.latent_scales)


def trend_markov(y):
    """A 2-d ``pyro.markov`` loop on ``(level, slope)`` with ``x_0 ~ N(0, I)``."""
    sl, ss, so = tm.latent_scales(y)
    A = y.new_tensor([[1.0, 1.0], [0.0, 1.0]])
    s = torch.stack([sl, ss])
    x = pyro.sample("x_0", dist.Normal(y.new_zeros(2), 1.0).to_event(1))
    pyro.sample("y_0", dist.Normal(x[0], so), obs=y[0])
    for t in pyro.markov(range(1, len(y))):
        x = pyro.sample(f"x_{t}", dist.Normal(A @ x, s).to_event(1))
        pyro.sample(f"y_{t}", dist.Normal(x[0], so), obs=y[t])


def simulate(T: int) -> torch.Tensor:
    return tm.simulate(T)


def exact_trend(y: torch.Tensor, n: int = 80) -> float:
    """``-log p(y)`` of :func:`trend`: ``log p(y | scales)`` by a Kalman filter on ``(slope,
    level)`` at every point of an ``n^3`` grid of the log scales, integrated by the rule."""
    return tm.grid_neg_log_evidence(y, n, ((-6, 1), (-9, 0.5), (-5, 1)))


def run(T, dtype, way, steps, particles):
    y = simulate(T).to(dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = trend_markov if way == "markov" else trend
    families = {"eta": "joint"} if way == "remainder" else None
    guide = AutoCVI(model, families=families)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    t0 = time.process_time()
    guide(y)
    for _ in range(steps):
        svi.step(y)
    cpu = time.process_time() - t0
    with torch.no_grad():
        v = [Trace_ELBO(num_particles=particles // 6).loss(model, guide, y) for _ in range(6)]
    t = torch.tensor(v, dtype=torch.float64)
    kinds = [type(b).__name__ for b in guide.engine.blocks]
    return {"bound": float(t.mean()), "se": float(t.std() / math.sqrt(6)), "cpu": cpu,
            "steps": steps, "blocks": kinds}  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="T = 100, float64, 30 steps")
    p.add_argument("--out", default="results/benchmark_local_trend.json")
    p.add_argument("--lengths", nargs="*", type=int, default=[300, 1000])
    p.add_argument("--steps", nargs="*", type=int, default=[150, 300], help="one per length")
    p.add_argument("--dtypes", nargs="*", default=["float64", "float32"])
    p.add_argument("--ways", nargs="*", default=["default", "markov"])
    p.add_argument("--eval-particles", type=int, default=300)
    p.add_argument("--grid", type=int, default=80)
    p.add_argument("--gap", type=float, default=1.0, help="the verdict's nats over -log p(y)")
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    lengths = [100] if args.quick else args.lengths
    steps = [30] if args.quick else args.steps
    dtypes = ["float64"] if args.quick else args.dtypes
    particles = 60 if args.quick else args.eval_particles
    table = Table(
        "Local linear trend (two cumsums) with latent scales",
        [
            ("T", "length (-f32: float32)"),
            ("way", "default: the Kalman block; remainder: families={'eta': 'joint'}; markov"),
            ("steps", "CVI steps"),
            ("-ELBO", "Trace_ELBO +- SE"),
            ("-log p(y)", "exact, the cumsum model (grid)"),
            ("gap", "-ELBO - (-log p(y))"),
            ("CPU s", "fit, set-up included (one thread)"),
        ],
    )
    payload = {"eval_particles": particles, "rows": {}}
    good, bad = [], []
    for T, n in zip(lengths, steps):
        exact = exact_trend(simulate(T), 24 if args.quick else args.grid)
        for dt in dtypes:
            key = f"T={T}" + ("-f32" if dt == "float32" else "")
            rec = {"exact": exact}
            for way in args.ways:
                r = rec[way] = run(T, getattr(torch, dt), way, n, particles)
                gap = r["bound"] - exact
                shown = f"{gap:+.2f}" if way != "markov" else "-"
                table.add(key, way, n, f"{r['bound']:.2f} +- {r['se']:.2f}", f"{exact:.2f}",
                          shown, fmt(r["cpu"], ".1f"))  # fmt: skip
                print(key, way, r, f"exact {exact:.3f}", flush=True)
                if way == "default":
                    (good if gap <= args.gap else bad).append(f"{key} ({gap:+.2f})")
            payload["rows"][key] = rec
    table.print()
    line = (
        f"Verdict: the default fit's -ELBO is within {args.gap} nat of -log p(y) on "
        f"{len(good)} of {len(good) + len(bad)} rows ({', '.join(good + bad) or '-'})."
    )
    print(line)
    cmd = "python scripts/benchmark_local_trend.py" + (" --quick" if args.quick else "")
    write_results(args.out, payload, title="Local linear trend with two cumsums",
                  verdict=line, tables=[table], command=cmd, quick=args.quick)  # fmt: skip


if __name__ == "__main__":
    main()
