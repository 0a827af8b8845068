"""Gamma q or a Gaussian on log z for positive latent sites: which default gives the better ELBO?

For each model with positive latents, AutoCVI is run with the default CVI() twice: with the
native Gamma family on the positive sites, and with ``families={site: "gaussian"}`` (a Gaussian
on the unconstrained space, ``log z``). Both guides are scored by one common estimator, a
large-sample ``TraceMeanField_ELBO`` estimate of the bound (the same bound as ``Trace_ELBO``,
with the KL terms in closed form where Pyro has them; mean and standard error over repeated
evaluations), so the comparison does not trust either method's own loss. Sparse gamma DEF also
gets the hand-written guide of Pyro's ``examples/sparse_gamma_def.py`` (Gamma q with softplus
parameters) trained with the example's recipe: ``AdagradRMSProp(eta=4.5, t=0.1)`` on
``TraceMeanField_ELBO``, parameters clipped from below after every step.

Prints a table with what each column means ("not finite" when a guide's bound could not be
estimated), and a one-line verdict; writes JSON (``--out``)
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
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.reporting import Table, fmt, progress, write_results  # noqa: E402
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
    elbo = TraceMeanField_ELBO(num_particles=particles)
    try:
        try:
            vals = [elbo.loss(model, guide, *args) for _ in range(reps)]
        except NotImplementedError:  # discrete guide sites: no closed-form KL; the same bound
            elbo = Trace_ELBO(num_particles=particles)
            vals = [elbo.loss(model, guide, *args) for _ in range(reps)]
    except ValueError:  # a sample outside the model's support (e.g. exp overflow on log z)
        return math.nan, math.nan
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
    opt = pyro.optim.AdagradRMSProp({"eta": 4.5, "t": 0.1})
    svi = SVI(model, guide, opt, TraceMeanField_ELBO())
    t = time.perf_counter()
    for _ in tqdm(range(steps), desc="hand-written guide (example recipe)", leave=False):
        svi.step(*args)
        for name, value in pyro.get_param_store().named_parameters():
            value.data.clamp_(min=-2.5 if "alpha" in name else -4.5)
    return guide, time.perf_counter() - t


def _key(v):
    return math.inf if not math.isfinite(v) else v


def _fmt(v):
    return f"{v:12.3f}" if math.isfinite(v) else "  not finite"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="fewer steps and samples, no sparse gamma DEF"
    )
    p.add_argument("--out", default="results/positive_families.json")
    a = p.parse_args()
    steps, reps, particles, hand_steps = (30, 10, 10, 300) if a.quick else (300, 40, 50, 1500)
    warnings.simplefilter("ignore")
    table = Table(
        "Gamma q versus a Gaussian on log z for positive latents (default CVI())",
        [
            ("model", "the test model (tests/step_models.py) and its positive sites"),
            ("guide", "AutoCVI with Gamma q on the positive sites, or families=gaussian there"),
            ("-ELBO", "a common TraceMeanField_ELBO estimate of the bound (nats, lower is better)"),
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
                dict(model=name, guide="hand-written (example)", neg_elbo=m, se=se, fit_s=secs)
            )
    for r in rows:
        table.add(
            r["model"],
            r["guide"],
            fmt(r["neg_elbo"], ".3f") if math.isfinite(r["neg_elbo"]) else "not finite",
            fmt(r["se"], ".3f"),
            fmt(r["fit_s"], ".1f"),
        )
    sg = {r["guide"]: r["neg_elbo"] for r in rows if r["model"] == "sparse_gamma_def"}
    cvi, hand = sg.get("AutoCVI (gamma)", math.nan), sg.get("hand-written (example)", math.nan)
    if math.isfinite(cvi) and math.isfinite(hand):
        gap = 100.0 * (cvi - hand) / abs(hand)
        side = "above (worse than)" if gap > 0 else "below (better than)"
        what = "the hand-written guide's"
        table.note("sparse_gamma_def", f"AutoCVI's -ELBO is {abs(gap):.1f}% {side} {what}")
    table.print()
    wins = {}
    for r in rows:
        if r["guide"].startswith("AutoCVI"):
            wins.setdefault(r["model"], []).append(r)
    better = sum(
        1
        for rs in wins.values()
        if min(rs, key=lambda r: _key(r["neg_elbo"]))["guide"].endswith("(gamma)")
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
