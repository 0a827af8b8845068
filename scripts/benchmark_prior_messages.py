"""Mean field against the joint Gaussian for block latents whose prior scale is a latent.

A hierarchical ``theta_j ~ Normal(mu, tau)`` (or a random walk's increments under a latent step
scale) with ``tau`` in the remainder. Two ways, both ``AutoCVI`` + ``CVI()``:

* ``joint`` (``AutoCVI(families={"theta": "joint"})``): ``theta`` (and its block) share the
  remainder's one joint Gaussian with ``tau``, which keeps their posterior correlation (the
  funnel);
* ``mean field`` (``AutoCVI(families={"theta": "gaussian"})``): ``theta``'s block stays exact
  beside the remainder and reads its prior at ``E_q[1/tau^2]`` in closed form
  (``model/prior_factor.py``); ``q(theta) q(tau)``.

The default picks one of them by the model's structure (the joint where it would hold at most
``JOINT_MAX_DIM`` coordinates, docs/architecture.md); each row records the pick, and the verdict
checks that it is the better side or within 0.5 nat of it. On the zoo's models with such
latents and on client-style models with 20 to 500 groups, both dtypes, in one process, the two
ways alternating. Every guide is scored by ``Trace_ELBO`` (``--eval-particles`` x 5 draws, not
timed); "to 0.5" is the CPU time until a checkpoint's estimate is within 0.5 nat of the run's
final one.

Usage::

    python scripts/benchmark_prior_messages.py --quick
    python scripts/benchmark_prior_messages.py --out results/benchmark_prior_messages.json
    python scripts/benchmark_prior_messages.py --groups 150 500 1000 5000 --eval-particles 50
    python scripts/benchmark_prior_messages.py --groups 150 500 --model grouped_regression \
        --dtypes float64 --steps 300 --eval-particles 50 --repeats 6
    python scripts/benchmark_prior_messages.py --groups 500 --model grouped_regression \
        --dtypes float64 --steps 900 --checkpoints 50 100 200 300 450 600 750 \
        --eval-particles 50 --repeats 6 --ways default tree \
        --out results/benchmark_groups_grouped_regression_curve.json
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

from bench.reporting import Table, fmt, write_results  # noqa: E402

from pyro_cvi import CVI, CVI_ELBO, AutoCVI  # noqa: E402
from pyro_cvi.divergence import DivergenceError  # noqa: E402
from pyro_cvi.model import gaussian_tree  # noqa: E402
from pyro_cvi.model.prior_factor import JOINT_MAX_DIM  # noqa: E402

#: zoo model -> the latents named for the mean field
ZOO_MODELS = {
    "eight_schools_centered": ["theta"],
    "radon_varying_slope": ["a", "b"],
    "varying_intercept_poisson": ["a"],
    "hierarchical_logistic": ["alpha"],
    "local_level": ["eps"],
    "stochastic_volatility": ["increments"],
}


def many_schools(sigma, y):
    """Groups of 4 Normal observations (known scale), ``theta_j ~ Normal(mu, tau)``."""
    mu = pyro.sample("mu", dist.Normal(sigma.new_tensor(0.0), 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(sigma.new_tensor(2.0)))
    with pyro.plate("groups", y.shape[0]):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        with pyro.plate("obs_per_group", y.shape[1]):
            pyro.sample("obs", dist.Normal(theta, sigma), obs=y.T)


def schools_data(groups: int, per_group: int = 4, spread: float = 0.7):
    """``groups`` groups of ``per_group`` points around ``theta_j ~ N(1, spread)``."""

    def data(dtype):
        g = torch.Generator().manual_seed(3)
        theta = 1.0 + spread * torch.randn(groups, generator=g, dtype=torch.float64)
        y = theta[:, None] + torch.randn(groups, per_group, generator=g, dtype=torch.float64)
        return (torch.tensor(1.0, dtype=dtype), y.to(dtype)), {}

    return data


def grouped_regression(group, x, y, num_groups: int):
    """Groups of points, varying intercepts, a common slope, a latent noise scale."""
    mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(x.new_tensor(1.0)))
    b = pyro.sample("b", dist.Normal(x.new_tensor(0.0), 2.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(x.new_tensor(1.0)))
    with pyro.plate("groups", num_groups):
        a = pyro.sample("a", dist.Normal(mu, tau))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Normal(a[group] + b * x, sigma), obs=y)


def grouped_data(groups: int, per_group: int = 10):
    """``groups`` groups of ``per_group`` points, intercepts ``N(0.5, 0.4)``, slope 0.8."""

    def data(dtype):
        g = torch.Generator().manual_seed(4)
        J, n = groups, groups * per_group
        a = 0.5 + 0.4 * torch.randn(J, generator=g, dtype=torch.float64)
        group = torch.arange(n) % J
        x = torch.randn(n, generator=g, dtype=torch.float64)
        y = a[group] + 0.8 * x + 0.6 * torch.randn(n, generator=g, dtype=torch.float64)
        return (group, x.to(dtype), y.to(dtype), J), {}

    return data


#: client-style models: ``(model, data, named latents, steps)``
CLIENTS = {
    "many_schools": (many_schools, schools_data(150), ["theta"], 300),
    "grouped_regression": (grouped_regression, grouped_data(60), ["a"], 300),
    "schools_20": (many_schools, schools_data(20), ["theta"], 300),
    "schools_50": (many_schools, schools_data(50), ["theta"], 300),
    "schools_100": (many_schools, schools_data(100), ["theta"], 300),
    "schools_500": (many_schools, schools_data(500), ["theta"], 300),
    "schools_30_of_2": (many_schools, schools_data(30, 2, 0.3), ["theta"], 300),
    "grouped_regression_150": (grouped_regression, grouped_data(150, 4), ["a"], 300),
}


def entry(name, dtype):
    """``(model, kwargs for AutoCVI, args, kwargs, named latents, steps)``."""
    if name in CLIENTS:
        model, data, named, steps = CLIENTS[name]
        args, kwargs = data(dtype)
        return model, {}, args, kwargs, named, steps
    from zoo import ZOO

    e = ZOO[name]
    model, guide_kwargs = e.build(dtype)
    d = e.data(dtype)
    return model, guide_kwargs, d.args, d.kwargs, ZOO_MODELS[name], e.steps


def score(model, guide, args, kwargs, particles, repeats=1):
    with torch.no_grad():
        v = [
            Trace_ELBO(num_particles=particles).loss(model, guide, *args, **kwargs)
            for _ in range(repeats)
        ]
    t = torch.tensor(v, dtype=torch.float64)
    se = float(t.std() / math.sqrt(len(v))) if len(v) > 1 else float("nan")
    return float(t.mean()), se


def default_pick(name, dtype):
    """Which side the default takes (classification only: no step)."""
    model, guide_kwargs, args, kwargs, named, _ = entry(name, dtype)
    pyro.clear_param_store()
    guide = AutoCVI(model, **guide_kwargs)
    guide(*args, **kwargs)
    joint = set(named) <= set(guide.engine.analysis.remainder)
    return "joint" if joint else "mean field"


def run(name, dtype, way, particles, quick):
    model, guide_kwargs, args, kwargs, named, steps = entry(name, dtype)
    steps = min(steps, 100) if quick else steps
    every = max(1, steps // 15)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    families = {n: "gaussian" if way == "mean field" else "joint" for n in named}
    guide = AutoCVI(model, families=families, **guide_kwargs)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    cpu, curve = 0.0, []
    for i in range(1, steps + 1):
        t = time.process_time()
        svi.step(*args, **kwargs)
        cpu += time.process_time() - t
        if i % every == 0 and i < steps:
            curve.append((cpu, score(model, guide, args, kwargs, max(10, particles // 5))[0]))
    bound, se = score(model, guide, args, kwargs, particles, repeats=5)
    curve.append((cpu, bound))
    remainder = list(guide.engine.analysis.remainder)
    kept = any("conjugate (E prior)" in line for line in guide.explain().splitlines())
    return {
        "bound": bound,
        "se": se,
        "cpu": cpu,
        "to_0_5": next(t for t, v in curve if v <= bound + 0.5),
        "remainder": remainder,
        "expected_prior": kept,
        "curve": curve,
    }


#: ``--groups``: spelling -> (family of the group latent, the most groups it runs at: a dense
#: joint costs O(G^3))
GROUP_WAYS = {
    "default": (None, None),
    "tree": ("gaussian", 1000),
    "named mean field": ("gaussian_diag", None),
    "joint": ("joint", 500),
}

#: ``--model``: name -> (model, data of G groups, the group latent)
GROUP_MODELS = {
    "many_schools": (many_schools, schools_data, "theta"),
    "grouped_regression": (grouped_regression, grouped_data, "a"),
}


def groups_rows(
    groups,
    dtypes,
    steps,
    particles,
    model_name="many_schools",
    ways=None,
    repeats=5,
    checkpoints=(),
):
    """A model of :data:`GROUP_MODELS` with ``G`` groups, each spelling of :data:`GROUP_WAYS`
    (the default takes the tree up to ``MAX_JOINT_DIM`` coordinates, else the group latent's
    exact block beside the remainder where the rule allows): ``-ELBO`` (``Trace_ELBO``,
    ``particles`` x 5, not timed), CPU seconds (set-up and steps, one thread) and the
    process's peak memory so far; at each step count in ``checkpoints`` a ``Trace_ELBO``
    estimate (``particles``, not timed, the random-number state restored after it so that the
    fit's trajectory is the one without checkpoints)."""
    import resource

    model, data, latent = GROUP_MODELS[model_name]
    out = {}
    for G in groups:
        for dt in dtypes:
            dtype = getattr(torch, dt)
            args, _ = data(G)(dtype)
            for way, (family, most) in GROUP_WAYS.items():
                key = f"{G}-{way}" + ("-f32" if dtype == torch.float32 else "")
                if (most is not None and G > most) or (ways and way not in ways):
                    continue
                families = None if family is None else {latent: family}
                pyro.clear_param_store()
                pyro.set_rng_seed(0)
                t = time.process_time()
                guide = AutoCVI(model, families=families)
                svi = SVI(model, guide, CVI(), CVI_ELBO())
                losses, curve = [], []
                for i in range(1, steps + 1):
                    try:
                        losses.append(svi.step(*args))
                    except DivergenceError as e:  # (the row is left out, said so)
                        print(key, "diverged:", str(e).splitlines()[0][:160], flush=True)
                        break
                    if i in checkpoints and i < steps:
                        cpu = time.process_time() - t
                        state = torch.get_rng_state()
                        curve.append((i, cpu, score(model, guide, args, {}, particles)[0]))
                        torch.set_rng_state(state)
                        t = time.process_time() - cpu
                if len(losses) < steps:
                    continue
                cpu = time.process_time() - t
                bound, se = score(model, guide, args, {}, particles, repeats=repeats)
                curve.append((steps, cpu, bound))
                an = guide.engine.analysis
                out[key] = {
                    "groups": G,
                    "way": way,
                    "dtype": dt,
                    "bound": bound,
                    "se": se,
                    "cpu": cpu,
                    "last_loss": float(losses[-1]),
                    "curve": curve,
                    "remainder": list(an.remainder),
                    "beside": sorted(getattr(an, "prior_beside", {})),
                    "observed_beside": sorted(getattr(an, "observed_beside", {})),
                    "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                }
                print(key, f"{bound:.2f} +- {se:.2f}", f"{cpu:.1f} s", curve[:-1], flush=True)
    return out


def groups_main(args):
    rows = groups_rows(
        args.groups,
        args.dtypes,
        args.steps,
        args.eval_particles,
        args.model,
        args.ways,
        args.repeats,
        set(args.checkpoints),
    )
    v = GROUP_MODELS[args.model][2]
    table = Table(
        f"{args.model} with G groups, {args.steps} steps: the default against other spellings",
        [
            ("G, way", f"groups; default: no families= ({v} beside the remainder over "
             f"{gaussian_tree.MAX_JOINT_DIM} tree coordinates where the rule allows); tree: "
             f"{{{v}: gaussian}}; named mean field: {{{v}: gaussian_diag}}; joint: {{{v}: joint}}"),
            ("-ELBO", "Trace_ELBO estimate (repeats x eval particles) +- SE"),
            ("CPU s", "set-up and steps, one thread (scoring not timed)"),
            ("peak MB", "the process's peak resident memory after the row (monotone)"),
            ("remainder", "the remainder's latents"),
        ],
    )  # fmt: skip
    for key, r in rows.items():
        table.add(
            key, f"{r['bound']:.2f} +- {r['se']:.2f}", fmt(r["cpu"], ".1f"),
            fmt(r["peak_mb"], ".0f"), ", ".join(r["remainder"]),
        )  # fmt: skip
    table.print()
    worst = []
    for key, r in rows.items():
        if r["way"] != "default":
            continue
        others = [
            o["bound"]
            for o in rows.values()
            if o["groups"] == r["groups"] and o["dtype"] == r["dtype"] and o["way"] != "default"
        ]
        if others:
            worst.append((r["bound"] - min(others), key))
    gap, where = max(worst) if worst else (float("nan"), "-")
    line = (
        f"Verdict: the default's -ELBO minus the best other spelling's is at most {gap:+.2f} "
        f"nat over the rows (at {where})."
    )
    print(line)
    write_results(
        args.out,
        {"steps": args.steps, "eval_particles": args.eval_particles, "rows": rows},
        title="Hierarchical models with many groups: the default against other spellings",
        verdict=line,
        tables=[table],
        command=" ".join(sys.argv if sys.argv[0].startswith("python") else ["python", *sys.argv]),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two models, float64, 100 steps")
    p.add_argument("--out", default="results/benchmark_prior_messages.json")
    p.add_argument("--eval-particles", type=int, default=400)
    p.add_argument("--models", nargs="*", default=None)
    p.add_argument("--dtypes", nargs="*", default=["float64", "float32"])
    p.add_argument("--groups", nargs="*", type=int, default=None, help="group counts")
    p.add_argument("--checkpoints", nargs="*", type=int, default=[], help="steps to score at")
    p.add_argument("--repeats", type=int, default=5, help="Trace_ELBO estimates (--groups)")
    p.add_argument("--model", default="many_schools", choices=sorted(GROUP_MODELS))
    p.add_argument("--ways", nargs="*", default=None, help="spellings of --groups (all)")
    p.add_argument("--steps", type=int, default=100, help="steps per run (with --groups)")
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    if args.groups:
        if args.out == p.get_default("out"):
            suffix = "" if args.model == "many_schools" else f"_{args.model}"
            args.out = f"results/benchmark_groups{suffix}.json"
        return groups_main(args)
    names = args.models or (
        ["eight_schools_centered", "schools_100"]
        if args.quick
        else list(ZOO_MODELS) + list(CLIENTS)
    )
    dtypes = ["float64"] if args.quick else args.dtypes
    particles = 100 if args.quick else args.eval_particles
    table = Table(
        "Mean field (an exact block beside the remainder) against the joint Gaussian",
        [
            ("model", "zoo or client model (-f32: float32)"),
            ("way", "joint: families={named: 'joint'}; mean field: families={named: 'gaussian'}"),
            ("pick", "* where the default (no families=) takes this way"),
            ("-ELBO", "final Trace_ELBO estimate (5 x eval particles) +- SE"),
            ("CPU s", "CPU seconds of the fit (one thread; scoring not timed)"),
            ("to 0.5", "CPU seconds until a checkpoint is within 0.5 nat of the final bound"),
            ("remainder", "the remainder's latents"),
        ],
    )
    payload = {"eval_particles": particles, "joint_max_dim": JOINT_MAX_DIM, "rows": {}}
    for name in names:
        for dt in dtypes:
            dtype = getattr(torch, dt)
            key = name + ("-f32" if dtype == torch.float32 else "")
            rec = {
                way: run(name, dtype, way, particles, args.quick) for way in ("joint", "mean field")
            }
            rec["default"] = default_pick(name, dtype)
            payload["rows"][key] = rec
            for way in ("joint", "mean field"):
                r = rec[way]
                table.add(
                    key, way, "*" if rec["default"] == way else "",
                    f"{r['bound']:.3f} +- {r['se']:.3f}", fmt(r["cpu"], ".2f"),
                    fmt(r["to_0_5"], ".2f"), ", ".join(r["remainder"]),
                )  # fmt: skip
    table.print()
    good, bad = [], []
    for key, rec in payload["rows"].items():
        best = min(rec["joint"]["bound"], rec["mean field"]["bound"])
        gap = rec[rec["default"]]["bound"] - best
        rec["gap"] = gap
        (good if gap <= 0.5 else bad).append(f"{key} ({rec['default']}, {gap:+.2f})")
    line = (
        f"Verdict: the default (the joint up to {JOINT_MAX_DIM} coordinates, else mean field) "
        f"is the better side or within 0.5 nat of it on {len(good)} of {len(good) + len(bad)} "
        f"rows; off by more on {len(bad)} ({', '.join(bad) or '-'}). Rows (pick, -ELBO above "
        f"the better side): {', '.join(good)}."
    )
    print(line)
    cmd = "python scripts/benchmark_prior_messages.py" + (" --quick" if args.quick else "")
    write_results(
        args.out,
        payload,
        title="Mean field against the joint for latents with a latent prior scale",
        verdict=line,
        tables=[table],
        command=cmd,
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
