"""Gamma q or a Gaussian on log z for positive latent sites: which default gives the better ELBO?

For each model with positive latents, AutoCVI is run with the default CVI() twice: with the
native Gamma family on the positive sites, and with ``families={site: "gaussian"}`` (a Gaussian
on the unconstrained space, ``log z``). Both guides are scored by one common estimator, a
large-sample ``Trace_ELBO`` estimate of the bound (mean and standard error over repeated
evaluations), so the comparison does not trust either method's own loss. Sparse gamma DEF also
gets the hand-written guide of Pyro's ``examples/sparse_gamma_def.py`` (Gamma q with softplus
parameters), trained by Adam on ``Trace_ELBO``.

Columns: model; guide; -ELBO (the common Trace_ELBO estimate, lower is better); se (its
standard error); fit_s (wall time of the fit, on a shared, loaded machine).

    python scripts/compare_positive_families.py [--quick] [--out results/positive_families.json]
"""

import argparse
import json
import math
import os
import sys
import time
import warnings

import pyro
from pyro.infer import SVI, Trace_ELBO
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from step_models import MODELS, sparse_gamma_def  # noqa: E402

from pyro_cvi import CVI, CVI_ELBO, AutoCVI  # noqa: E402

POSITIVE = {
    "halfnormal_regression": ["sigma"],
    "eight_schools_centred": ["tau"],
    "gamma_poisson_glm": ["phi"],
    "gaussian_mixture": ["scale"],
    "sparse_gamma_def": ["w_top", "w_mid", "w_bottom", "z_top", "z_mid", "z_bottom"],
}


def score(model, guide, args, reps, particles):
    elbo = Trace_ELBO(num_particles=particles)
    vals = [elbo.loss(model, guide, *args) for _ in range(reps)]
    m = sum(vals) / len(vals)
    se = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1) / len(vals))
    return m, se


def fit_cvi(model, args, kwargs, steps):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model, **kwargs)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    t = time.perf_counter()
    for _ in range(steps):
        svi.step(*args)
    return guide, time.perf_counter() - t


def fit_hand(model, guide, args, steps):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    svi = SVI(model, guide, pyro.optim.ClippedAdam({"lr": 0.05, "clip_norm": 10.0}), Trace_ELBO())
    t = time.perf_counter()
    for _ in tqdm(range(steps), desc="hand-written guide (Adam)", leave=False):
        svi.step(*args)
    return guide, time.perf_counter() - t


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="results/positive_families.json")
    a = p.parse_args()
    steps, reps, particles, hand_steps = (60, 20, 20, 1000) if a.quick else (200, 50, 50, 4000)
    warnings.simplefilter("ignore")
    rows = []
    for name, sites in POSITIVE.items():
        model, args, gk = MODELS[name]()
        for label, fams in (("gamma", {}), ("gaussian", {s: "gaussian" for s in sites})):
            guide, secs = fit_cvi(model, args, {**gk, "families": fams}, steps)
            m, se = score(model, guide, args, reps, particles)
            rows.append(dict(model=name, guide=f"AutoCVI ({label})", neg_elbo=m, se=se, fit_s=secs))
            print(f"{name:24s} {rows[-1]['guide']:22s} {m:12.3f} {se:8.3f} {secs:7.1f}", flush=True)
        if name == "sparse_gamma_def":
            model, args, _, hand = sparse_gamma_def()
            guide, secs = fit_hand(model, hand, args, hand_steps)
            m, se = score(model, guide, args, reps, particles)
            rows.append(
                dict(model=name, guide="hand-written (Adam)", neg_elbo=m, se=se, fit_s=secs)
            )
            print(f"{name:24s} {rows[-1]['guide']:22s} {m:12.3f} {se:8.3f} {secs:7.1f}", flush=True)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    wins = {}
    for r in rows:
        if r["guide"].startswith("AutoCVI"):
            wins.setdefault(r["model"], []).append(r)
    better = sum(
        1
        for rs in wins.values()
        if min(rs, key=lambda r: r["neg_elbo"])["guide"].endswith("(gamma)")
    )
    print(
        f"Gamma gave the better evaluated ELBO on {better} of {len(wins)} models "
        f"(the Gaussian on log z on {len(wins) - better})."
    )


if __name__ == "__main__":
    main()
