"""AutoCVI's defaults against AutoNormal + Adam (and IVON) per CPU second on models with no
exact structure: numpyro's one-hidden-layer BNN regression, a PyroModule 13-8-3 classifier on
sklearn's wine data, a 64-16-16-10 classifier on sklearn's digits, the horseshoe logistic
regression, stochastic volatility with a latent step scale (``scripts/bench/bnn_models.py``);
and the CPU per step of the ODE / recursion models (Lotka-Volterra RK4, one-compartment PK,
GARCH(1,1)) against AutoMultivariateNormal + Adam.

For each model and seed, float32, one torch thread, back to back in one process:

* ``autocvi``: ``SVI(model, AutoCVI(model), CVI(), CVI_ELBO())`` for ``budget`` CPU seconds;
* ``adam``: ``AutoNormal`` + Adam at each learning rate of {0.01, 0.03, 0.1}, each given 3x
  that budget; Adam's best bound is the lowest final estimate over the three;
* ``ivon`` (if ``ivon-opt`` is installed; ``scripts/bench/ivon_runner.py``): ``ivon.IVON`` at
  each learning rate of {0.03, 0.1, 0.3} (``--ivon-lrs``), each for AutoCVI's budget, one draw
  a step, its step size annealed to 0 by a cosine over the budget (``--ivon-schedule``),
  ``hess_init`` 1 and ``beta2`` 0.999 (``--ivon-hess-init``, ``--ivon-beta2``): on the networks
  the same network as an ``nn.Module`` (``ess = N``, weight decay ``1 / N``: prior precision
  1, the Bayesian posterior), on the other models Pyro's potential energy over the
  unconstrained latents (``ess`` = the number of observations, the prior in the loss); its
  Gaussian is written into an ``AutoNormal`` and scored as the others;
* ``user_steps``: AutoCVI's defaults for 300 steps; the last reported loss against a fresh
  estimate of the final ``q``'s bound (within 1 nat or 1%): where the guide is the
  remainder's joint Gaussian alone, 8,000 antithetic pairs through its batched log joint
  (``sharp_estimate``, standard errors 0.02-0.15 nat here), else the estimator below; and
  against the bound of the ``q`` that last loss was evaluated at (``gap_evaluated``: SVI
  returns the loss before its step). On the one-draw models the one-draw step without a
  report runs beside it with 16 tracked pairs (``user_steps_pairs``,
  ``Horizon(report_pairs=16)``), alternating ``--repeats`` times (``ms_pairs`` /
  ``ms_default``: the pairs' and the default's CPU per step).

Every final guide is scored by one estimator: ``-ELBO`` from 400 draws of ``Trace_ELBO``
(its standard error from the spread of 40 means of 10). *Time to reach* a bound: the CPU time
at which the running mean of the last 50 step losses first falls to it (plus 1 nat), from the
per-step losses (each an unbiased one-step estimate). The row reports AutoCVI's time to reach
Adam's best bound against the time Adam's best run took to reach it.

    python scripts/benchmark_bnn.py [--seeds 3] [--first-seed 0] [--models a,b] [--quick]
        [--out FILE]

The JSON is rewritten after every row, so that an interrupted run keeps the rows it finished.

``--quick``: one seed, a third of the budgets, output under ``results/quick/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench.bnn_models import MODELS, ODE_MODELS  # noqa: E402
from bench.ivon_runner import IVON_DEFAULTS, run_ivon  # noqa: E402

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, Horizon, strategies  # noqa: E402

#: AutoCVI's CPU budget per model (seconds); Adam gets 3x per learning rate
BUDGET = {
    "bnn_regression": 4.0,
    "bnn_wine": 6.0,
    "bnn_digits": 12.0,
    "horseshoe_logistic": 4.0,
    "stochastic_volatility": 5.0,
}
LRS = (0.01, 0.03, 0.1)
IVON_LRS = (0.03, 0.1, 0.3)
#: the step count a user picks: the reported loss there is compared with a fresh bound
USER_STEPS = 300
#: the models whose remainder takes the one-draw step by default; the tracked report of
#: ``Horizon(report_pairs=REPORT_PAIRS)`` is measured there beside the default (no pairs: the
#: draw's own estimate), alternating
ONEDRAW = ("bnn_wine", "bnn_digits")
REPORT_PAIRS = 16
WINDOW = 50
TOL = 1.0


def _estimate(model, guide, args, n: int = 40, p: int = 10):
    elbo = Trace_ELBO(num_particles=p)
    with torch.no_grad():
        v = torch.tensor([elbo.loss(model, guide, *args) for _ in range(n)], dtype=torch.float64)
    return float(v.mean()), float(v.std() / math.sqrt(n))


def _sharp_estimate(guide, args, pairs: int = 8000, chunk: int = 500):
    """``-ELBO`` of a guide whose only block is the remainder's joint Gaussian, from
    ``pairs`` antithetic pairs ``m +- L e`` through the block's batched log joint (``log p(x,
    T(u)) + log |T'(u)| - log q(u)``, fresh draws of the global stream): ``(mean, se)`` from
    the pairs' spread, or ``None`` for other guides. Sharper than :func:`_estimate` at the
    same CPU (one batched run per ``chunk`` pairs)."""
    eng = guide.engine
    if len(eng.blocks) != 1 or not eng.kinds.get("remainder"):
        return None
    rem = eng.kinds["remainder"][0]
    if rem.form == "lowrank":
        return None
    ctx = eng.context(args, {}, {}, False, False)
    p = rem._values()
    m, sc = p[rem.loc_name], p[rem.role_names[0]]
    out = []
    with torch.no_grad():
        for k in range(0, pairs, chunk):
            e = torch.randn(min(chunk, pairs - k), rem.dim, dtype=m.dtype)
            e = torch.cat([e, -e])
            u = m + (e @ sc.tril().mT if rem.form == "full" else sc * e)
            per = (rem._log_joint(ctx, u, {}) - rem._log_q(u)).double()
            n = per.shape[0] // 2
            out.append(0.5 * (per[:n] + per[n:]))
    v = torch.cat(out)
    return float(-v.mean()), float(v.std() / math.sqrt(v.numel()))


class Diverged(Exception):
    """A baseline's step failed on non-finite parameters; ``times``/``losses`` so far."""

    def __init__(self, times, losses, error: Exception):
        super().__init__(str(error).splitlines()[0])
        self.times, self.losses = times, losses


def _run(svi, args, budget: float, baseline: bool = False):
    """Steps for ``budget`` CPU seconds: ``(cpu times, losses)``. A ``baseline`` run whose
    step fails on non-finite values (Adam at too large a rate) raises :class:`Diverged`."""
    times, losses = [], []
    t0 = time.process_time()
    while True:
        try:
            loss = svi.step(*args)
        except (ValueError, RuntimeError) as e:
            if not baseline:
                raise
            raise Diverged(times, losses, e) from e
        t = time.process_time() - t0
        times.append(t)
        losses.append(float(loss))
        if t >= budget:
            return times, losses


def time_to_reach(times, losses, target: float):
    """CPU time at which the running mean of the last WINDOW losses first reaches target."""
    acc = 0.0
    for i, v in enumerate(losses):
        acc += v
        if i >= WINDOW:
            acc -= losses[i - WINDOW]
        if i + 1 >= WINDOW and acc / WINDOW <= target + TOL:
            return times[i]
    return None


def _fresh(seed: int):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)


def run_autocvi(model, args, budget, seed):
    _fresh(seed)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    times, losses = _run(svi, args, budget)
    est = _estimate(model, guide, args)
    rem = guide.engine.kinds["remainder"][0]
    info = {}
    if rem is not None:
        info = {"form": rem.form, "step": type(rem.rule).__name__, "dim": rem.dim}
    return {"times": times, "losses": losses, "estimate": est, **info}


def run_adam(model, args, budget, seed, lr, guide_cls=AutoNormal):
    _fresh(seed)
    guide = guide_cls(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())
    try:
        times, losses = _run(svi, args, budget, baseline=True)
    except Diverged as e:  # never the best: its bound is +inf
        times = e.times or [budget]
        losses = e.losses or [math.inf]
        return {
            "times": times,
            "losses": losses,
            "estimate": (math.inf, 0.0),
            "lr": lr,
            "diverged": str(e),
        }
    return {"times": times, "losses": losses, "estimate": _estimate(model, guide, args), "lr": lr}


def run_user_steps(model, args, seed, steps: int = USER_STEPS, report_pairs=None):
    """AutoCVI's defaults for ``steps`` steps (with ``report_pairs``: the one-draw step's
    ``Horizon(report_pairs=...)``): the last reported loss (and the mean of the last 10)
    against a fresh estimate of the bound of the final ``q``, and the CPU per step."""
    _fresh(seed)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    choose = strategies.Remainder.choose_step
    if report_pairs is not None:  # the default rule's own Horizon step (its q), with pairs

        def with_pairs(self, hierarchical):
            step = choose(self, hierarchical)
            if isinstance(step, Horizon):
                step = dataclasses.replace(step, report_pairs=report_pairs)
            return step

        strategies.Remainder.choose_step = with_pairs
    t0 = time.process_time()
    try:
        losses = [float(svi.step(*args))]
    finally:
        strategies.Remainder.choose_step = choose
    losses += [float(svi.step(*args)) for _ in range(steps - 2)]
    cpu = time.process_time() - t0
    state = torch.get_rng_state()  # (the last step draws what it would have)
    evaluated = _sharp_estimate(guide, args)  # the q that the last step's loss is of
    torch.set_rng_state(state)
    t0 = time.process_time()
    losses.append(float(svi.step(*args)))
    ms = 1000 * (cpu + time.process_time() - t0) / steps
    est = _estimate(model, guide, args)
    sharp = _sharp_estimate(guide, args)
    ref = sharp if sharp is not None else est
    gap = losses[-1] - ref[0]
    # the last loss is that of the q before the last step (SVI's convention); its gap there
    gap_evaluated = None if evaluated is None else losses[-1] - evaluated[0]
    return {
        "steps": steps,
        "report_pairs": report_pairs,
        "ms_per_step": ms,
        "reported": losses[-1],
        "reported_mean10": sum(losses[-10:]) / 10,
        "estimate": est,
        "sharp_estimate": sharp,
        "gap": gap,
        "ok": abs(gap) <= max(TOL, 0.01 * abs(ref[0])),
        "sharp_estimate_evaluated": evaluated,
        "gap_evaluated": gap_evaluated,
    }


def bench_model(
    name,
    seeds,
    scale,
    with_ivon,
    first=0,
    done=None,
    ivon_cfg=None,
    ivon_lrs=IVON_LRS,
    user_steps=True,
    adam_lrs=LRS,
):
    make, data = MODELS[name]
    args = data(torch.float32)
    budget = BUDGET[name] * scale
    rows = []
    for seed in range(first, first + seeds):
        model = make()
        cvi = run_autocvi(model, args, budget, seed)
        row = {
            "model": name,
            "seed": seed,
            "budget_s": budget,
            "autocvi": {k: v for k, v in cvi.items() if k not in ("times", "losses")},
            "autocvi_steps": len(cvi["losses"]),
            "autocvi_ms_per_step": 1000 * cvi["times"][-1] / len(cvi["times"]),
            "load": os.getloadavg(),
        }
        adams = [run_adam(model, args, 3 * budget, seed, lr) for lr in adam_lrs]
        if adams:  # (without Adam: AutoCVI beside IVON only)
            best = min(adams, key=lambda r: r["estimate"][0])
            target = best["estimate"][0]
            row.update(
                {
                    "adam": {
                        str(r["lr"]): {
                            "estimate": r["estimate"],
                            "steps": len(r["losses"]),
                            **({"diverged": r["diverged"]} if "diverged" in r else {}),
                        }
                        for r in adams
                    },
                    "adam_best_lr": best["lr"],
                    "adam_best": target,
                    "adam_ms_per_step": 1000 * best["times"][-1] / len(best["times"]),
                    "autocvi_time_to_adam_best": time_to_reach(cvi["times"], cvi["losses"], target),
                    "adam_time_to_adam_best": time_to_reach(best["times"], best["losses"], target),
                }
            )
        if with_ivon:
            try:
                n_obs = args[-1].shape[0]
                ivs = [
                    run_ivon(name, model, args, budget, seed, lr, n_obs, _estimate, ivon_cfg)
                    for lr in ivon_lrs
                ]
                row["ivon"] = min(ivs, key=lambda r: r["estimate"][0])
                row["ivon_all"] = {str(r["lr"]): r["estimate"][0] for r in ivs}
                row["ivon_steps"] = {str(r["lr"]): r["steps"] for r in ivs}
            except ImportError:
                row["ivon"] = "ivon-opt not installed"
        if user_steps and name in ONEDRAW:  # (before the default: the first pays no warm-up)
            row["user_steps_pairs"] = run_user_steps(model, args, seed, report_pairs=REPORT_PAIRS)
        if user_steps:
            row["user_steps"] = run_user_steps(model, args, seed)
        rows.append(row)
        _print_row(row)
        if done is not None:
            done(row)
    return rows


def bench_ode(name, steps: int = 30):
    """CPU per step: AutoCVI's defaults vs AutoMultivariateNormal + Adam (median of 3 runs
    of ``steps`` steps after 5 warm-up steps), and both bounds after equal step counts."""
    make, data = ODE_MODELS[name]
    args = data(torch.float32)
    model = make()
    out = {"model": name}
    for label, build in (
        ("autocvi", lambda: SVI(model, AutoCVI(model), CVI(), CVI_ELBO())),
        (
            "adam_mvn",
            lambda: SVI(
                model, AutoMultivariateNormal(model), pyro.optim.Adam({"lr": 0.03}), Trace_ELBO()
            ),
        ),
    ):
        per = []
        for rep in range(3):
            _fresh(rep)
            svi = build()
            for _ in range(5):
                svi.step(*args)
            t0 = time.process_time()
            for _ in range(steps):
                svi.step(*args)
            per.append((time.process_time() - t0) / steps)
        out[f"{label}_ms_per_step"] = 1000 * sorted(per)[1]
    out["ratio"] = out["autocvi_ms_per_step"] / out["adam_mvn_ms_per_step"]
    print(
        f"{name:22s} AutoCVI {out['autocvi_ms_per_step']:8.2f} ms/step   AutoMVN+Adam "
        f"{out['adam_mvn_ms_per_step']:8.2f} ms/step   ratio {out['ratio']:.2f}",
        flush=True,
    )
    return out


def _fmt(x):
    return "   never" if x is None else f"{x:8.2f}"


def _print_row(r):
    timed = "autocvi_time_to_adam_best" in r
    print(
        f"{r['model']:22s} seed {r['seed']}  AutoCVI {r['autocvi']['estimate'][0]:8.2f} "
        f"({r['autocvi'].get('step', '-')}, {r['autocvi'].get('form', '-')}, "
        f"{r['autocvi_ms_per_step']:.1f} ms/step)"
        + (
            f"  Adam best {r['adam_best']:8.2f} "
            f"(lr {r['adam_best_lr']}, {r['adam_ms_per_step']:.1f} ms/step)  time to Adam's "
            f"best: AutoCVI {_fmt(r['autocvi_time_to_adam_best'])} s, Adam "
            f"{_fmt(r['adam_time_to_adam_best'])} s"
            if timed
            else ""
        )
        + (
            f"  IVON {r['ivon']['estimate'][0]:8.2f} (lr {r['ivon']['lr']})"
            if isinstance(r.get("ivon"), dict)
            else ""
        )
        + (
            f"  at {r['user_steps']['steps']} steps: reported {r['user_steps']['reported']:.2f},"
            f" bound {r['user_steps']['estimate'][0]:.2f}"
            if "user_steps" in r
            else ""
        ),
        flush=True,
    )


def _no_worse(a, b) -> bool:
    """``a`` no worse than ``b`` (both ``(-ELBO, its standard error)``) beyond two standard
    errors of their difference."""
    return a[0] <= b[0] + 2.0 * math.hypot(a[1], b[1])


def table(rows) -> list:
    """One line per timed row: CPU seconds to Adam's best bound (AutoCVI, Adam, their
    ratio), the final bounds (AutoCVI, Adam's best, IVON's best) and the verdicts."""
    head = (
        f"{'model':22s} {'seed':>4s} {'t AutoCVI':>9s} {'t Adam':>8s} {'ratio':>6s} "
        f"{'AutoCVI':>16s} {'Adam best':>9s} {'IVON best':>16s} {'half':>5s} {'>=IVON':>6s}"
    )
    lines = [head]
    for r in rows:
        if "autocvi" not in r:
            continue
        timed = "autocvi_time_to_adam_best" in r
        a, b = r.get("autocvi_time_to_adam_best"), r.get("adam_time_to_adam_best")
        ratio = "-" if a is None or b is None else f"{a / b:.2f}"
        half = (
            "-" if not timed else ("yes" if a is not None and (b is None or a <= 0.5 * b) else "NO")
        )
        adam = f"{r['adam_best']:9.2f}" if timed else "-"
        est = r["autocvi"]["estimate"]
        iv = r.get("ivon")
        ivs = (
            f"{iv['estimate'][0]:8.2f} +- {iv['estimate'][1]:.2f}" if isinstance(iv, dict) else "-"
        )
        vs = (
            "-" if not isinstance(iv, dict) else ("yes" if _no_worse(est, iv["estimate"]) else "NO")
        )
        lines.append(
            f"{r['model']:22s} {r['seed']:4d} {_fmt(a) if timed else '-':>9s} "
            f"{_fmt(b) if timed else '-':>8s} {ratio:>6s} "
            f"{est[0]:8.2f} +- {est[1]:.2f} {adam:>9s} {ivs:>16s} {half:>5s} {vs:>6s}"
        )
    return lines


def verdict(rows, odes) -> list:
    """Lines per model: in how many seeds AutoCVI reached Adam's best bound in at most half
    of the time Adam took, was no worse than IVON's best (of three learning rates) at equal
    CPU, and reported a loss within 1 nat or 1% of the bound at 300 steps; for the ODEs,
    whether AutoCVI's CPU per step is within 1.5x."""
    lines = []
    for name in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == name]
        timed = [r for r in rs if "autocvi_time_to_adam_best" in r]
        wins = 0
        for r in timed:
            a, b = r["autocvi_time_to_adam_best"], r["adam_time_to_adam_best"]
            wins += a is not None and (b is None or a <= 0.5 * b)
        if timed:
            lines.append(
                f"verdict {name}: AutoCVI in at most half of Adam's time in {wins}/{len(timed)}"
            )
        ivs = [r for r in rs if isinstance(r.get("ivon"), dict)]
        if ivs:
            ok = sum(_no_worse(r["autocvi"]["estimate"], r["ivon"]["estimate"]) for r in ivs)
            lines.append(
                f"verdict {name}: AutoCVI no worse than IVON at equal CPU in {ok}/{len(ivs)}"
            )
        for key, how in (
            ("user_steps", ""),
            ("user_steps_pairs", f" ({REPORT_PAIRS} tracked report pairs)"),
        ):
            us = [r[key] for r in rs if key in r]
            if us:
                ok = sum(u["ok"] for u in us)
                ms = sum(u["ms_per_step"] for u in us if "ms_per_step" in u) / len(us)
                ev = [
                    abs(u["gap_evaluated"])
                    <= max(TOL, 0.01 * abs(u["sharp_estimate_evaluated"][0]))
                    for u in us
                    if u.get("gap_evaluated") is not None
                ]
                of = f"; of the q it is the loss of: {sum(ev)}/{len(ev)}" if ev else ""
                lines.append(
                    f"verdict {name}: reported loss{how} at {USER_STEPS} steps within {TOL:g} nat"
                    f" or 1% of the bound in {ok}/{len(us)} ({ms:.1f} ms a step{of})"
                )
    for o in odes:
        ok = "within" if o["ratio"] <= 1.5 else "NOT within"
        lines.append(f"verdict {o['model']}: CPU per step {ok} 1.5x of AutoMVN+Adam")
    return lines


def with_horizon_options(options: dict) -> None:
    """Every AutoCVI run of this process: the default rule's :class:`Horizon` step with
    ``options`` replaced (other steps as they are)."""
    choose = strategies.Remainder.choose_step

    def replaced(self, hierarchical):
        step = choose(self, hierarchical)
        return dataclasses.replace(step, **options) if isinstance(step, Horizon) else step

    strategies.Remainder.choose_step = replaced


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first .. first + seeds - 1")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ode", default=",".join(ODE_MODELS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-ivon", action="store_true")
    ap.add_argument(
        "--adam-lrs",
        default=",".join(map(str, LRS)),
        help="Adam's learning rates; '' for none (AutoCVI beside IVON only, no timed row)",
    )
    ap.add_argument(
        "--ivon-lrs",
        default=",".join(map(str, IVON_LRS)),
        help="IVON's learning rates (its best bound is kept)",
    )
    ap.add_argument("--ivon-hess-init", type=float, default=IVON_DEFAULTS["hess_init"])
    ap.add_argument("--ivon-beta2", type=float, default=IVON_DEFAULTS["beta2"])
    ap.add_argument(
        "--ivon-schedule", choices=("cosine", "constant"), default=IVON_DEFAULTS["schedule"]
    )
    ap.add_argument(
        "--no-user-steps",
        action="store_true",
        help="leave out the 300-step reported-loss rows (the timed and IVON rows only)",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        help="JSON files of runs (e.g. one process per seed): their rows merged into --out, "
        "the table and verdicts printed, nothing run",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--user-steps-only",
        action="store_true",
        help="only the 300-step reported-loss rows (default and paired report), no ODEs",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="with --user-steps-only: runs of each, alternating (their CPU per step)",
    )
    ap.add_argument(
        "--horizon-options",
        default="",
        help="JSON fields replaced in the default rule's Horizon step, e.g. '{\"horizon\": 300}'",
    )
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.horizon_options:
        with_horizon_options(json.loads(a.horizon_options))
    scale = 1.0 / 3 if a.quick else 1.0
    seeds = 1 if a.quick else a.seeds
    out = (
        Path(a.out)
        if a.out
        else ROOT / "results" / ("quick" if a.quick else "") / "benchmark_bnn.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list = []
    odes: list = []

    def save():
        out.write_text(json.dumps({"meta": meta, "rows": rows, "ode": odes}, indent=1))

    def keep(row):
        rows.append(row)
        save()

    ivon_cfg = {"hess_init": a.ivon_hess_init, "beta2": a.ivon_beta2, "schedule": a.ivon_schedule}
    ivon_lrs = tuple(float(v) for v in a.ivon_lrs.split(","))
    meta = {
        "ivon": None if a.no_ivon else {**IVON_DEFAULTS, **ivon_cfg, "lrs": ivon_lrs},
        "torch": torch.__version__,
        "pyro": pyro.__version__,
        "python": platform.python_version(),
        "threads": 1,
        "dtype": "float32",
        "tolerance_nats": TOL,
        "window": WINDOW,
        "command": " ".join(sys.argv),
        "load_at_start": os.getloadavg(),
        "horizon_options": a.horizon_options or None,
    }
    if a.merge:
        parts = [json.loads(Path(f).read_text()) for f in a.merge]
        rows = [r for part in parts for r in part["rows"]]
        rows.sort(key=lambda r: (list(MODELS).index(r["model"]), r["seed"]))
        meta = {**meta, "merged": {f: part["meta"] for f, part in zip(a.merge, parts)}}
        meta["verdict"] = verdict(rows, [])
        for line in table(rows) + meta["verdict"]:
            print(line)
        save()
        print(f"wrote {out}")
        return
    for name in [m for m in a.models.split(",") if m]:
        if a.user_steps_only:
            make, data = MODELS[name]
            for seed in range(a.first_seed, a.first_seed + seeds):
                model, args = make(), data(torch.float32)
                row = {"model": name, "seed": seed}
                for _ in range(a.repeats):  # alternating: the report's cost against none
                    if name in ONEDRAW:
                        us = run_user_steps(model, args, seed, 300, REPORT_PAIRS)
                        row.setdefault("user_steps_pairs", us)
                        row.setdefault("ms_pairs", []).append(us["ms_per_step"])
                    us = run_user_steps(model, args, seed)
                    row.setdefault("user_steps", us)
                    row.setdefault("ms_default", []).append(us["ms_per_step"])
                print(json.dumps(row), flush=True)
                keep(row)
            continue
        bench_model(
            name,
            seeds,
            scale,
            not a.no_ivon,
            a.first_seed,
            keep,
            ivon_cfg,
            ivon_lrs,
            not a.no_user_steps,
            tuple(float(v) for v in a.adam_lrs.split(",") if v),
        )
    for n in [n for n in a.ode.split(",") if n and not a.user_steps_only]:
        odes.append(bench_ode(n, 10 if a.quick else 30))
        save()
    for line in table(rows) + verdict(rows, odes):
        print(line)
    save()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
