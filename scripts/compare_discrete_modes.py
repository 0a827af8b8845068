"""Collapsed versus mean-field discrete latents: ``AutoCVI(discrete="collapse" | "mean_field")``.

Two models with finite discrete latents, as written in Pyro's tutorial and examples:

* ``gmm``: the Gaussian mixture tutorial (``config_enumerate``; ``weights ~ Dirichlet(0.5)``,
  ``scale ~ LogNormal(0, 2)``, ``locs ~ Normal(0, 10)`` in a components plate, assignments in
  a data plate), on the tutorial's five points ``[0, 1, 10, 11, 12]``, K = 2;
* ``hmm``: examples/hmm.py ``model_1`` (a Dirichlet transition matrix, Beta emission
  probabilities, ``pyro.markov`` over time, ``poutine.mask`` on the sequence lengths), on
  synthetic binary sequences drawn from a 3-state HMM (fixed seed);
* ``zoo_gmm``, ``zoo_hmm``: the same two models and the data of ``tests/zoo`` (30 points from
  two clusters; 8 sequences of 6 tones), when this checkout has the zoo.

Methods, all from the same initial values and for the same wall-time budget per model:

* ``collapse``: AutoCVI(discrete="collapse"): the discrete latents summed out exactly (the
  TraceEnum contraction), Monte Carlo CVI messages to the continuous q;
* ``mean_field``: AutoCVI(discrete="mean_field"): a Categorical q per discrete latent;
* ``adam``: AutoNormal over the continuous sites + Adam + TraceEnum_ELBO (the tutorial's
  baseline), the best of a small learning-rate grid.

CVI uses its default adaptive step (``CVI()``), with ``init_scale`` None (natural-form sites
start with the prior's spread) or 0.1 (AutoNormal's default spread). Every final guide is
scored by one estimator: a large-sample TraceEnum_ELBO (the model under
``config_enumerate``; a guide's own discrete sites are sampled and scored as in any guide).
Only optimisation is timed; the machine may be loaded, and all methods run back to back in
one process.

Columns: ``model``; ``method``; ``setting`` (init_scale or Adam's lr); ``steps`` done in the budget;
``time_s`` (optimisation wall time, after a first set-up step timed apart as ``first_s``);
``-ELBO`` (the common estimate) and ``se`` (its standard error); ``vs adam`` (-ELBO minus the
Adam baseline's: negative is better).

    python scripts/compare_discrete_modes.py [--quick] [--out results/compare_discrete_modes.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer import SVI, TraceEnum_ELBO, config_enumerate
from pyro.infer.autoguide import AutoNormal
from pyro.infer.autoguide.initialization import init_to_median, init_to_value

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pyro_cvi import CVI, CVI_ELBO, AutoCVI  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = None


# ------------------------------------------------------------------------------------ models
def gmm_problem():
    K = 2
    data = torch.tensor([0.0, 1.0, 10.0, 11.0, 12.0])

    @config_enumerate
    def model(data):
        weights = pyro.sample("weights", dist.Dirichlet(0.5 * torch.ones(K)))
        scale = pyro.sample("scale", dist.LogNormal(0.0, 2.0))
        with pyro.plate("components", K):
            locs = pyro.sample("locs", dist.Normal(0.0, 10.0))
        with pyro.plate("data", len(data)):
            assignment = pyro.sample("assignment", dist.Categorical(weights))
            pyro.sample("obs", dist.Normal(locs[assignment], scale), obs=data)

    init = {
        "weights": torch.full((K,), 1.0 / K),
        "scale": torch.tensor(1.0),
        "locs": data[torch.tensor([1, 3])],
    }
    return model, (data,), init, ["assignment"], 1


def hmm_problem(num_seqs=10, T=12, D=4, H=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    trans = torch.full((H, H), 0.1 / (H - 1)) + 0.9 * torch.eye(H) - 0.1 / (H - 1) * torch.eye(H)
    emit = torch.rand(H, D, generator=g) * 0.8 + 0.1
    lengths = torch.randint(T // 2, T + 1, (num_seqs,), generator=g)
    seqs = torch.zeros(num_seqs, T, D)
    for s in range(num_seqs):
        x = int(torch.randint(0, H, (), generator=g))
        for t in range(int(lengths[s])):
            x = int(torch.multinomial(trans[x], 1, generator=g))
            seqs[s, t] = torch.bernoulli(emit[x], generator=g)

    @config_enumerate
    def model(sequences, lengths):
        probs_x = pyro.sample("probs_x", dist.Dirichlet(0.9 * torch.eye(H) + 0.1).to_event(1))
        probs_y = pyro.sample("probs_y", dist.Beta(0.1, 0.9).expand([H, D]).to_event(2))
        tones = pyro.plate("tones", D, dim=-1)
        with pyro.plate("sequences", num_seqs, dim=-2):
            x = 0
            for t in pyro.markov(range(T)):
                with poutine.mask(mask=(t < lengths).unsqueeze(-1)):
                    x = pyro.sample(f"x_{t}", dist.Categorical(probs_x[x]))
                    with tones:
                        pyro.sample(
                            f"y_{t}", dist.Bernoulli(probs_y[x.squeeze(-1)]), obs=sequences[:, t]
                        )

    probs_x = 0.9 * torch.eye(H) + 0.1 / H
    probs_y = 0.5 + 0.3 * (torch.rand(H, D, generator=g) - 0.5)  # breaks the states' symmetry
    init = {"probs_x": probs_x / probs_x.sum(-1, keepdim=True), "probs_y": probs_y}
    return model, (seqs, lengths), init, [f"x_{t}" for t in range(T)], 2


PROBLEMS = {"gmm": gmm_problem, "hmm": hmm_problem}

try:  # the zoo's versions (tests/zoo, when this checkout has it): the same models, its data
    from tests.zoo.latent import gaussian_mixture, gaussian_mixture_data, hmm_data, hmm_model_1

    def zoo_gmm_problem():
        (data,) = gaussian_mixture_data(torch.float32).args
        init = {"locs": torch.tensor([0.0, 10.0])}
        return gaussian_mixture, (data,), init, ["assignment"], 1

    def zoo_hmm_problem():
        seqs, lengths = hmm_data(torch.float32).args
        return hmm_model_1, (seqs, lengths), {}, [f"x_{t}" for t in range(seqs.shape[1])], 2

    PROBLEMS.update(zoo_gmm=zoo_gmm_problem, zoo_hmm=zoo_hmm_problem)
except ImportError:  # pragma: no cover
    pass


# ------------------------------------------------------------------------------------ runs
def _run(svi, args, budget, desc):
    """One set-up step (reported apart: analysis, first contraction), then steps until the
    budget is spent."""
    t0 = time.perf_counter()
    svi.step(*args)
    first = time.perf_counter() - t0
    steps, t0 = 1, time.perf_counter()
    bar = tqdm(desc=desc, leave=False, unit="step") if tqdm is not None else None
    while time.perf_counter() - t0 < budget:
        svi.step(*args)
        steps += 1
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return steps, time.perf_counter() - t0, first


def evaluate(model, guide, args, plate_dims, particles, repeats):
    elbo = TraceEnum_ELBO(max_plate_nesting=plate_dims, num_particles=particles)
    with torch.no_grad():
        vals = [elbo.loss(model, guide, *args) for _ in range(repeats)]
    v = torch.tensor(vals, dtype=torch.float64)
    good = torch.isfinite(v)
    if not bool(good.all()):
        return float("inf"), float("nan")
    return float(v.mean()), float(v.std() / math.sqrt(len(v)))


def run_cvi(problem, mode, init_scale, budget, seed, ev):
    model, args, init, _, plate_dims = problem
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    init_loc_fn = init_to_value(values=init) if init else None
    guide = AutoCVI(model, discrete=mode, init_loc_fn=init_loc_fn, init_scale=init_scale)
    svi = SVI(model, guide, CVI(), loss=CVI_ELBO())  # the default adaptive step
    steps, secs, first = _run(svi, args, budget, f"{mode} init_scale={init_scale}")
    loss, se = evaluate(model, guide, args, plate_dims, *ev)
    return dict(
        method=mode,
        setting=f"init_scale={init_scale}",
        steps=steps,
        time_s=secs,
        first_step_s=first,
        loss=loss,
        se=se,
    )


def run_adam(problem, lr, budget, seed, ev):
    model, args, init, discrete, plate_dims = problem
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    init_loc_fn = init_to_value(values=init) if init else init_to_median
    guide = AutoNormal(poutine.block(model, hide=discrete), init_loc_fn=init_loc_fn)
    svi = SVI(
        model, guide, pyro.optim.Adam({"lr": lr}), loss=TraceEnum_ELBO(max_plate_nesting=plate_dims)
    )
    steps, secs, first = _run(svi, args, budget, f"adam lr={lr}")
    loss, se = evaluate(model, guide, args, plate_dims, *ev)
    return dict(
        method="adam",
        setting=f"lr={lr}",
        steps=steps,
        time_s=secs,
        first_step_s=first,
        loss=loss,
        se=se,
    )


def best(rows):
    return min(rows, key=lambda r: r["loss"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small budgets (under 2 minutes)")
    p.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path("results") / "compare_discrete_modes.json"))
    a = p.parse_args(argv)
    from bench.reporting import quick_path

    a.out = str(quick_path(a.out, a.quick))  # --quick: under results/quick/
    torch.set_num_threads(1)
    pyro.enable_validation(False)
    warnings.filterwarnings("ignore")
    budgets = {"gmm": 15.0, "zoo_gmm": 15.0, "hmm": 120.0, "zoo_hmm": 120.0}
    scales, lrs = [None, 0.1], [0.01, 0.05]
    ev = {"gmm": (200, 10), "zoo_gmm": (200, 10), "hmm": (20, 5), "zoo_hmm": (20, 5)}
    if a.quick:
        budgets = {k: 4.0 for k in budgets}
        scales, lrs = [0.1], [0.05]
        ev = {k: (20, 3) for k in ev}
    results = {}
    for name in a.problems:
        problem = PROBLEMS[name]()
        rows = []
        for lr in lrs:
            rows.append(run_adam(problem, lr, budgets[name], a.seed, ev[name]))
        for mode in ("collapse", "mean_field"):
            for sc in scales:
                rows.append(run_cvi(problem, mode, sc, budgets[name], a.seed, ev[name]))
        results[name] = rows
    print(
        f"{'model':8s} {'method':11s} {'setting':15s} {'steps':>6s} {'time_s':>7s} {'first_s':>7s} "
        f"{'-ELBO':>10s} {'se':>7s} {'vs adam':>8s}"
    )
    summary = {}
    for name, rows in results.items():
        ref = best([r for r in rows if r["method"] == "adam"])["loss"]
        for r in rows:
            r["vs_adam"] = r["loss"] - ref
            print(
                f"{name:8s} {r['method']:11s} {r['setting']:15s} {r['steps']:6d} "
                f"{r['time_s']:7.1f} {r['first_step_s']:7.2f} {r['loss']:10.3f} {r['se']:7.3f} "
                f"{r['vs_adam']:+8.3f}"
            )
        summary[name] = {
            m: best([r for r in rows if r["method"] == m])
            for m in ("adam", "collapse", "mean_field")
        }
    wins = {
        name: s["collapse"]["loss"] + 2 * s["collapse"]["se"] < s["mean_field"]["loss"]
        for name, s in summary.items()
    }
    parts = [
        f"{name}: collapse {s['collapse']['loss']:.2f}, mean_field {s['mean_field']['loss']:.2f}, "
        f"adam {s['adam']['loss']:.2f}"
        for name, s in summary.items()
    ]
    default = "collapse" if all(wins.values()) else "mean_field"
    verdict = f"Best -ELBO at equal wall time ({'; '.join(parts)}): " + (
        "collapse is tighter on every model, so it is the better default."
        if default == "collapse"
        else "collapse is not tighter on every model ("
        + ", ".join(n for n, w in wins.items() if not w)
        + "), so mean_field stays the default."
    )
    print(verdict)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"quick": a.quick, "budgets_s": budgets, "results": results, "verdict": verdict},
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
