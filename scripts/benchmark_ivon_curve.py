"""Where the CPU goes between AutoCVI's defaults and IVON on one model: the bound against
the step count and against CPU time for both, so that a gap at equal CPU
(``scripts/benchmark_bnn.py``) splits into the cost of a step and the steps to a bound.

For one model and seed, float32, one torch thread:

* ``autocvi``: ``SVI(model, AutoCVI(model), CVI(), CVI_ELBO())``, one run, its ``-ELBO``
  estimated at each step count of ``--autocvi-steps`` (the estimates' CPU is not counted);
* ``ivon``: ``scripts/bench/ivon_runner.py`` at one learning rate, one run per step count of
  ``--ivon-steps``, each with its cosine schedule over that many steps.

Every guide is scored by ``benchmark_bnn``'s estimator (400 draws of ``Trace_ELBO``). The
verdict says, at AutoCVI's last step count, how many IVON steps and CPU seconds reach
AutoCVI's bound (by linear interpolation between IVON's step counts), and the ratio of the
two methods' CPU per step.

    python scripts/benchmark_ivon_curve.py --model bnn_wine [--seed 0] [--quick] [--out F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pyro
import torch
from pyro.infer import SVI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench.bnn_models import MODELS  # noqa: E402
from bench.ivon_runner import IVON_DEFAULTS, run_ivon  # noqa: E402
from benchmark_bnn import _estimate  # noqa: E402

from pyro_cvi import CVI, CVI_ELBO, AutoCVI  # noqa: E402


def autocvi_curve(model, args, seed, counts):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    out, cpu, done = [], 0.0, 0
    for n in counts:
        t0 = time.process_time()
        for _ in range(n - done):
            svi.step(*args)
        cpu += time.process_time() - t0
        done = n
        state = torch.get_rng_state()
        out.append({"steps": n, "cpu_s": cpu, "estimate": _estimate(model, guide, args)})
        torch.set_rng_state(state)
        print(f"AutoCVI {n:6d} steps {cpu:7.2f} s  -ELBO {out[-1]['estimate'][0]:9.2f}", flush=True)
    return out


def ivon_curve(name, model, args, seed, counts, lr):
    out = []
    for n in counts:
        r = run_ivon(name, model, args, 0.0, seed, lr, args[-1].shape[0], _estimate, None, n)
        out.append({"steps": n, "cpu_s": r["cpu_s"], "estimate": r["estimate"]})
        print(
            f"IVON    {n:6d} steps {r['cpu_s']:7.2f} s  -ELBO {r['estimate'][0]:9.2f}", flush=True
        )
    return out


def reach(curve, target):
    """Interpolated (steps, CPU s) at which ``curve`` first reaches ``target``, else None."""
    prev = None
    for c in curve:
        v = c["estimate"][0]
        if v <= target:
            if prev is None:
                return c["steps"], c["cpu_s"]
            w = (prev["estimate"][0] - target) / (prev["estimate"][0] - v)
            return (
                prev["steps"] + w * (c["steps"] - prev["steps"]),
                prev["cpu_s"] + w * (c["cpu_s"] - prev["cpu_s"]),
            )
        prev = c
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bnn_wine", choices=sorted(MODELS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--autocvi-steps", default="250,500,1000,1500,2500")
    ap.add_argument("--ivon-steps", default="500,1000,2000,4000,8000,16000")
    ap.add_argument("--ivon-lr", type=float, default=0.1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    ac = [int(v) for v in a.autocvi_steps.split(",")]
    iv = [int(v) for v in a.ivon_steps.split(",")]
    if a.quick:
        ac, iv = [50, 100], [100, 200]
    out = Path(a.out) if a.out else ROOT / "results" / "quick" / "benchmark_ivon_curve.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    make, data = MODELS[a.model]
    args = data(torch.float32)
    model = make()
    res = {
        "meta": {
            "model": a.model,
            "seed": a.seed,
            "ivon": {**IVON_DEFAULTS, "lr": a.ivon_lr},
            "command": " ".join(sys.argv),
            "load": __import__("os").getloadavg(),
        },
        "autocvi": autocvi_curve(model, args, a.seed, ac),
        "ivon": ivon_curve(a.model, model, args, a.seed, iv, a.ivon_lr),
    }
    last = res["autocvi"][-1]
    ms_a = 1000 * last["cpu_s"] / last["steps"]
    ms_i = 1000 * res["ivon"][-1]["cpu_s"] / res["ivon"][-1]["steps"]
    hit = reach(res["ivon"], last["estimate"][0])
    res["verdict"] = {
        "autocvi_ms_per_step": ms_a,
        "ivon_ms_per_step": ms_i,
        "ivon_to_autocvi_final": hit,
    }
    out.write_text(json.dumps(res, indent=1))
    where = (
        "never within its step counts"
        if hit is None
        else f"in {hit[0]:.0f} steps, {hit[1]:.2f} CPU s"
    )
    print(
        f"verdict {a.model} seed {a.seed}: AutoCVI {last['estimate'][0]:.2f} after "
        f"{last['steps']} steps, {last['cpu_s']:.2f} CPU s ({ms_a:.2f} ms a step); IVON "
        f"({ms_i:.2f} ms a step, {ms_a / ms_i:.1f}x cheaper) reaches it {where}"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
