"""Gamma q or a Gaussian on log z for positive latent sites: which default gives the better ELBO?

For each model with positive latents, AutoCVI is run with the default CVI() twice: with the
native Gamma family on the positive sites, and with ``families={site: "gaussian"}`` (a Gaussian
on the unconstrained space, ``log z``). Both guides are scored by one common estimator, a
large-sample ``Trace_ELBO`` estimate of the bound (mean and standard error over repeated
evaluations), so the comparison does not trust either method's own loss. Sparse gamma DEF also
gets the hand-written guide of Pyro's ``examples/sparse_gamma_def.py`` (Gamma q with softplus
parameters), trained by Adam on ``Trace_ELBO``.

Prints a table with what each column means, and a one-line verdict; writes JSON (``--out``)
with a ``report`` section for the docs' results page (``scripts/report.py``).

    python scripts/compare_positive_families.py [--quick] [--out results/positive_families.json]
"""

import argparse
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

from benchmarks.reporting import Table, fmt, progress, write_results  # noqa: E402
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
    p.add_argument(
        "--quick", action="store_true", help="fewer steps and samples, no sparse gamma DEF"
    )
    p.add_argument("--out", default="results/positive_families.json")
    a = p.parse_args()
    steps, reps, particles, hand_steps = (30, 10, 10, 300) if a.quick else (200, 50, 50, 4000)
    warnings.simplefilter("ignore")
    table = Table(
        "Gamma q versus a Gaussian on log z for positive latents (default CVI())",
        [
            ("model", "the test model (tests/step_models.py) and its positive sites"),
            ("guide", "AutoCVI with Gamma q on the positive sites, or families=gaussian there"),
            ("-ELBO", "a common Trace_ELBO estimate of the bound (nats, lower is better)"),
            ("se", "standard error of that estimate over repeated evaluations"),
            ("fit_s", "wall time of the fit in seconds (a shared, loaded machine)"),
        ],
        text=f"{steps} CVI steps per fit; the bound scored with {reps} x {particles} particles.",
    )
    rows = []
    # --quick leaves out sparse gamma DEF: its Gaussian fit alone costs minutes (a smoke run).
    models = {k: v for k, v in POSITIVE.items() if not (a.quick and k == "sparse_gamma_def")}
    for name, sites in progress(models.items(), "models", total=len(models)):
        model, args, gk = MODELS[name]()
        for label, fams in (("gamma", {}), ("gaussian", {s: "gaussian" for s in sites})):
            guide, secs = fit_cvi(model, args, {**gk, "families": fams}, steps)
            m, se = score(model, guide, args, reps, particles)
            rows.append(dict(model=name, guide=f"AutoCVI ({label})", neg_elbo=m, se=se, fit_s=secs))
        if name == "sparse_gamma_def":
            model, args, _, hand = sparse_gamma_def()
            guide, secs = fit_hand(model, hand, args, hand_steps)
            m, se = score(model, guide, args, reps, particles)
            rows.append(
                dict(model=name, guide="hand-written (Adam)", neg_elbo=m, se=se, fit_s=secs)
            )
    for r in rows:
        table.add(
            r["model"],
            r["guide"],
            fmt(r["neg_elbo"], ".3f"),
            fmt(r["se"], ".3f"),
            fmt(r["fit_s"], ".1f"),
        )
    table.print()
    wins = {}
    for r in rows:
        if r["guide"].startswith("AutoCVI"):
            wins.setdefault(r["model"], []).append(r)
    better = sum(
        1
        for rs in wins.values()
        if min(rs, key=lambda r: r["neg_elbo"])["guide"].endswith("(gamma)")
    )
    verdict = (
        f"Verdict: Gamma q gave the better evaluated ELBO on {better} of {len(wins)} models "
        f"(the Gaussian on log z on {len(wins) - better})."
    )
    print(verdict)
    write_results(
        a.out,
        {"config": dict(quick=a.quick, steps=steps, reps=reps, particles=particles), "rows": rows},
        title="Positive latents: Gamma q or a Gaussian on log z",
        verdict=verdict,
        tables=[table],
        command="python scripts/compare_positive_families.py",
        quick=a.quick,
    )


if __name__ == "__main__":
    main()
