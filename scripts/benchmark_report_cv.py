"""How much of the one-draw remainder's report noise control variates from the step's own
quantities remove, at a fixed ``q`` (the wine and digits networks of
``scripts/bench/bnn_models.py``, whose remainder holds every latent and takes the one-draw
step).

After AutoCVI's defaults for ``--steps`` steps, at that ``q = N(m, diag(s^2))``, for ``--draws``
independent draws ``u = m + s eps`` the one-draw estimate of the loss

    l(u) = -[f(u) + E_q log prior - log q(u)]       (f: the log joint without the known prior)

and, each with its exactly known mean, its corrections (``dz = u - m``, ``P0`` the known prior
precisions, ``g = grad f(u)``, ``c`` the step's momentum average of ``E[g]``, independent of
the draw, ``h = s^-2 - P0`` the step's curvature):

* ``quad``: minus ``(dz^T P0 dz - tr(P0 S)) / 2`` (the prior's quadratic fluctuation);
* ``quad+c``: also minus ``c^T dz`` (the linear term, with an estimate of its slope);
* ``quad+r/2``: also minus ``r^T dz / 2``, ``r = g + h dz`` (the draw's own residual; its
  mean ``tr(S (E[hess f] + h)) / 2`` is zero only where the curvature has converged);
* ``entropy``: ``log q(u)`` replaced by its expectation (``-H(q)``).

Each row gives the mean and standard deviation over the draws and the bound's independent
``Trace_ELBO`` estimate.

    python scripts/benchmark_report_cv.py [--models bnn_wine,bnn_digits] [--seeds 1]
        [--steps 300] [--draws 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pyro
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench.bnn_models import MODELS  # noqa: E402
from bench.reporting import write_results  # noqa: E402

from pyro_cvi import CVI, CVI_ELBO, AutoCVI  # noqa: E402


def _log_joint(model, args, block, u: torch.Tensor) -> torch.Tensor:
    """``log p(x, T(u)) + log |T'(u)|`` of one packed draw."""
    values, logdet = block.unpack(u)
    tr = poutine.trace(poutine.condition(model, data=values)).get_trace(*args)
    return tr.log_prob_sum() + logdet


def run(name: str, seed: int, steps: int, draws: int) -> dict:
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    make, data = MODELS[name]
    model, args = make(), data(torch.float32)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    for _ in range(steps):
        svi.step(*args)
    (block,) = [b for b in guide.engine.blocks if b.kind == "remainder"]
    if not (block.onedraw and block.form == "diag"):
        raise SystemExit(f"{name}: its remainder does not take the diagonal one-draw step")
    p = {k: v.detach() for k, v in block._values().items()}
    m, s = p[block.loc_name], p[block.role_names[0]]
    a, p0 = block.prior_loc, block.prior_prec
    c = block.control.center()
    c = torch.zeros_like(m) if c is None else c
    h = s.pow(-2) - p0
    prior_mean = float(-0.5 * (p0 * ((m - a).pow(2) + s * s)).sum())
    entropy = float(s.log().sum() + 0.5 * m.numel() * (1.0 + math.log(2 * math.pi)))
    cols: dict = {k: [] for k in ("raw", "quad", "quad+c", "quad+r/2", "entropy")}
    for _ in range(draws):
        eps = torch.randn_like(m)
        dz = s * eps
        u = (m + dz).requires_grad_(True)
        full = _log_joint(model, args, block, u)
        f = full + 0.5 * (p0 * (u - a).pow(2)).sum()  # the known prior taken out
        (g,) = torch.autograd.grad(f, u)
        with torch.no_grad():
            log_q = float(-0.5 * eps.pow(2).sum() - s.log().sum()) - 0.5 * m.numel() * math.log(
                2 * math.pi
            )
            raw = -(float(f) + prior_mean - log_q)
            quad = raw + 0.5 * float((dz * dz * p0).sum() - (p0 * s * s).sum())
            r = g + h * dz
            cols["raw"].append(raw)
            cols["quad"].append(quad)
            cols["quad+c"].append(quad + float((c * dz).sum()))
            cols["quad+r/2"].append(quad + 0.5 * float((r * dz).sum()))
            cols["entropy"].append(-(float(f) + prior_mean + entropy))
    with torch.no_grad():
        est = torch.tensor(
            [Trace_ELBO(num_particles=10).loss(model, guide, *args) for _ in range(40)],
            dtype=torch.float64,
        )
    row = {
        "model": name,
        "seed": seed,
        "steps": steps,
        "dim": block.dim,
        "estimate": [float(est.mean()), float(est.std() / math.sqrt(len(est)))],
    }
    for k, v in cols.items():
        t = torch.tensor(v, dtype=torch.float64)
        row[k] = {"mean": float(t.mean()), "sd": float(t.std())}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bnn_wine,bnn_digits")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--draws", type=int, default=300)
    ap.add_argument("--out", default=str(ROOT / "results" / "benchmark_report_cv.json"))
    ap.add_argument("--quick", action="store_true", help="wine, 30 steps, 40 draws; results/quick/")
    a = ap.parse_args(argv)
    if a.quick:
        a.models, a.seeds, a.steps, a.draws = "bnn_wine", 1, 30, 40
    torch.set_num_threads(1)
    rows = [
        run(name, seed, a.steps, a.draws) for name in a.models.split(",") for seed in range(a.seeds)
    ]
    keys = ("raw", "quad", "quad+c", "quad+r/2", "entropy")
    text = "; ".join(
        f"{r['model']} seed {r['seed']}: sd "
        + ", ".join(f"{k} {r[k]['sd']:.1f}" for k in keys)
        + f" (bound {r['estimate'][0]:.1f})"
        for r in rows
    )
    write_results(
        a.out,
        {"rows": rows},
        title="The one-draw report's spread under control variates with known means",
        verdict=text,
        command="python scripts/benchmark_report_cv.py " + " ".join(sys.argv[1:]),
        quick=a.quick,
    )
    print("verdict:", text)


if __name__ == "__main__":
    main()
