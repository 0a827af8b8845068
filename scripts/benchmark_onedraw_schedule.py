"""The one-draw step's schedule and report against the two wine cells of the BNN benchmark
(``scripts/benchmark_bnn.py``): for each configuration of :class:`~pyro_cvi.Horizon` (fields
replaced in the default rule's step, as ``benchmark_bnn.py --horizon-options`` does) and seed,
float32, one torch thread:

* the loss reported at step 300 against a sharp estimate (4,000 antithetic pairs through the
  block's batched log joint) of the bound of the ``q`` it was evaluated at (the ``q`` before
  the last step), and of the ``q`` after it (the ``q`` the user holds, ``gap_after``: what
  ``benchmark_bnn.py``'s ``gap`` compares); within 1 nat or 1% is the benchmark's criterion;
* with ``--redraws N``: ``N`` fresh one-draw reports at the ``q`` after step 300 (their mean,
  spread, median, skew and the fraction below the bound: ``report_spread``);
* with ``--average BETA``: the bound of the exponential average of the iterates' diagonal
  ``(m, s)`` at step 300, its change over step 300, and at the budget (an iterate-averaging
  step's ``q``, measured beside the step's own; the prototype of ``Horizon(average=...)``,
  which the library now does on the diagonal form by default: run it with the config
  ``'{"average": 0}'`` to average the plain step's iterates); with ``--average-pairs N``, a
  :class:`~pyro_cvi.natgrad.report.TrackedReport` of the average's bound from ``N`` pairs a
  step over steps 201-300 against that bound;
* the same run continued to the CPU budget (6 s on wine, as the benchmark gives AutoCVI):
  the sharp bound of the final ``q`` and the steps taken, to set beside IVON's bound at
  equal CPU (``benchmark_bnn.py``'s rows).

    python scripts/benchmark_onedraw_schedule.py --out F [--model bnn_wine] [--seeds 0,1,2,3,4]
        [--budget 6] [--configs '{}' '{"plateau": 50, "report_pairs": 8}' ...] [--redraws N]
        [--quick]

Configurations run one after another (each over all seeds) in one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from pyro.infer import SVI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import benchmark_bnn as B  # noqa: E402
from bench.bnn_models import MODELS  # noqa: E402

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, Horizon, strategies  # noqa: E402
from pyro_cvi.natgrad.report import TrackedReport  # noqa: E402

STEPS = 300
PAIRS = 4000
#: the steps over which ``--average-pairs`` tracks the average's report up to step 300
TRACK_STEPS = 100


def spread(svi, args, bound: float, n: int) -> dict:
    """``n`` redraws of the one-draw report at the current ``q`` (``svi.evaluate_loss``: the
    step's own estimator, fresh draws) against its sharp ``bound``."""
    v = torch.tensor([svi.evaluate_loss(*args) for _ in range(n)], dtype=torch.float64)
    sd = v.std()
    return {
        "redraws": n,
        "mean": float(v.mean()),
        "se": float(sd / n**0.5),
        "sd": float(sd),
        "median": float(v.median()),
        "skew": float((((v - v.mean()) / sd) ** 3).mean()),
        "below_bound": float((v < bound).double().mean()),
    }


def sharp_at(guide, args, m: torch.Tensor, s: torch.Tensor, pairs: int = PAIRS, chunk=500):
    """``-ELBO`` of the diagonal Gaussian ``N(m, diag(s^2))`` over the remainder's packed
    coordinates (``B._sharp_estimate``'s estimator at given parameters): ``(mean, se)``."""
    rem = guide.engine.kinds["remainder"][0]
    ctx = guide.engine.context(args, {}, {}, False, False)
    out, const = [], s.abs().log().sum() + 0.5 * rem.dim * math.log(2 * math.pi)
    with torch.no_grad():
        for k in range(0, pairs, chunk):
            e = torch.randn(min(chunk, pairs - k), rem.dim, dtype=m.dtype)
            e = torch.cat([e, -e])
            log_q = -0.5 * e.pow(2).sum(-1) - const
            per = (rem._log_joint(ctx, m + s * e, {}) - log_q).double()
            n = per.shape[0] // 2
            out.append(0.5 * (per[:n] + per[n:]))
    v = torch.cat(out)
    return float(-v.mean()), float(v.std() / math.sqrt(v.numel()))


def pair_losses(guide, args, m, s, e) -> torch.Tensor:
    """``-(log p - log q)`` of ``N(m, diag(s^2))`` at the antithetic pairs ``m +- s e``,
    averaged per pair (``e``: ``[n, D]``)."""
    rem = guide.engine.kinds["remainder"][0]
    ctx = guide.engine.context(args, {}, {}, False, False)
    e2 = torch.cat([e, -e])
    const = s.abs().log().sum() + 0.5 * rem.dim * math.log(2 * math.pi)
    with torch.no_grad():
        per = -(rem._log_joint(ctx, m + s * e2, {}) + 0.5 * e2.pow(2).sum(-1) + const).double()
    n = e.shape[0]
    return 0.5 * (per[:n] + per[n:])


class Average:
    """The bias-corrected exponential average (rate ``1 - beta``) of the remainder's diagonal
    ``(m, s)`` over the steps: the ``q`` an iterate-averaging step would hand the user."""

    def __init__(self, guide, beta: float, pairs: int = 0):
        self.rem, self.beta, self.n = guide.engine.kinds["remainder"][0], beta, 0
        self.m = self.s = None
        #: a tracked report of the average's bound (``pairs`` tracked pairs a step)
        self.pairs, self.tracked, self.value = pairs, TrackedReport(), None
        self.gen = torch.Generator().manual_seed(0x5EED)

    def report(self, guide, args) -> float:
        """:class:`~pyro_cvi.natgrad.report.TrackedReport`'s estimate of the average's
        ``-ELBO`` from ``pairs`` fresh pairs here and at the previous average."""
        m, s = self.q()
        prev = self.tracked.previous(1)
        e = torch.randn(self.pairs, self.rem.dim, generator=self.gen, dtype=m.dtype)
        now = pair_losses(guide, args, m, s, e)
        before = None if prev is None else pair_losses(guide, args, prev["m"], prev["s"], e)
        self.value = self.tracked.update(1, {"m": m, "s": s}, now, before)
        return self.value

    def update(self) -> None:
        p = self.rem._values()
        m, s = p[self.rem.loc_name].detach(), p[self.rem.role_names[0]].detach().abs()
        if self.m is None:
            self.m, self.s = torch.zeros_like(m), torch.zeros_like(s)
        self.m = self.beta * self.m + (1 - self.beta) * m
        self.s = self.beta * self.s + (1 - self.beta) * s
        self.n += 1

    def q(self):
        c = 1.0 - self.beta**self.n
        return self.m / c, self.s / c


def run(
    name: str,
    opts: dict,
    seed: int,
    budget: float,
    steps: int = STEPS,
    redraws: int = 0,
    average: float = 0.0,
    average_pairs: int = 0,
) -> dict:
    """One run under ``opts``: the step-``steps`` gap and the bound at ``budget`` CPU s (with
    ``redraws``: the one-draw report's spread at the ``q`` after step ``steps``; with
    ``average``: the bound of :class:`Average`'s ``q`` there, its change over that step, and
    at ``budget``; with ``average_pairs``: a tracked report of the average's bound over the
    last ``TRACK_STEPS`` steps to ``steps``, against its sharp bound; none of this CPU is
    counted)."""
    choose = strategies.Remainder.choose_step

    def replaced(self, hierarchical):
        step = choose(self, hierarchical)
        return dataclasses.replace(step, **opts) if isinstance(step, Horizon) else step

    strategies.Remainder.choose_step = replaced
    try:
        make, data = MODELS[name]
        args = data(torch.float32)
        model = make()
        B._fresh(seed)
        guide = AutoCVI(model)
        svi = SVI(model, guide, CVI(), CVI_ELBO())
        cpu, t, row = 0.0, 0, {"seed": seed}
        avg = None
        while t < steps or cpu < budget:
            if t == steps - 1:  # the q that the next step's loss is of
                state = torch.get_rng_state()
                evaluated = B._sharp_estimate(guide, args, pairs=PAIRS)
                if avg is not None:
                    avg_before = sharp_at(guide, args, *avg.q())
                torch.set_rng_state(state)
            t0 = time.process_time()
            loss = float(svi.step(*args))
            cpu += time.process_time() - t0
            t += 1
            if average:
                avg = avg or Average(guide, average, average_pairs)
                state = torch.get_rng_state()
                avg.update()
                if average_pairs and steps - TRACK_STEPS < t <= steps:
                    avg.report(guide, args)
                if t == steps and t > 1:
                    after_avg = sharp_at(guide, args, *avg.q())
                    row.update(
                        average=average,
                        average_bound=after_avg[0],
                        average_step_change=after_avg[0] - avg_before[0],
                    )
                    if average_pairs:
                        gap = avg.value - after_avg[0]
                        row.update(
                            average_pairs=average_pairs,
                            average_report=avg.value,
                            average_gap=gap,
                            average_ok=abs(gap) <= max(B.TOL, 0.01 * abs(after_avg[0])),
                        )
                torch.set_rng_state(state)
            if t == steps:
                gap = loss - evaluated[0]
                state = torch.get_rng_state()  # the q the user holds after the last step
                after = B._sharp_estimate(guide, args, pairs=PAIRS)
                torch.set_rng_state(state)
                gap_after = loss - after[0]
                row.update(
                    reported=loss,
                    bound=evaluated[0],
                    gap=gap,
                    ok=abs(gap) <= max(B.TOL, 0.01 * abs(evaluated[0])),
                    bound_after=after[0],
                    gap_after=gap_after,
                    ok_after=abs(gap_after) <= max(B.TOL, 0.01 * abs(after[0])),
                    ms_per_step=1000 * cpu / steps,
                )
                if redraws:
                    row["report_spread"] = spread(svi, args, after[0], redraws)
        row.update(steps=t, cpu=cpu, final_bound=B._sharp_estimate(guide, args, pairs=PAIRS))
        if avg is not None:
            row["average_final_bound"] = sharp_at(guide, args, *avg.q())
        return row
    finally:
        strategies.Remainder.choose_step = choose


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bnn_wine")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--budget", type=float, default=None, help="CPU s (default: the benchmark's)")
    ap.add_argument("--configs", nargs="+", default=["{}"], help="Horizon fields, JSON each")
    ap.add_argument(
        "--redraws",
        type=int,
        default=0,
        help="redraws of the one-draw report at the q after step 300 (its spread and skew)",
    )
    ap.add_argument(
        "--average",
        type=float,
        default=0.0,
        help="beta of an exponential average of the iterates (diagonal q) whose bound is measured",
    )
    ap.add_argument(
        "--average-pairs",
        type=int,
        default=0,
        help="with --average: tracked report pairs of the average's bound (steps 201-300)",
    )
    ap.add_argument("--quick", action="store_true", help="one seed, a third of the budget")
    ap.add_argument("--out", default=None, help="JSON of the rows (required)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out) if a.out else ROOT / "results" / "quick" / "benchmark_onedraw_schedule.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    budget = a.budget if a.budget is not None else B.BUDGET[a.model]
    seeds = [int(s) for s in a.seeds.split(",")]
    if a.quick:
        seeds, budget = seeds[:1], budget / 3
    meta = {
        "command": " ".join(sys.argv),
        "model": a.model,
        "budget_s": budget,
        "torch": torch.__version__,
        "load_at_start": os.getloadavg(),
    }
    results = []
    for text in a.configs:
        opts = json.loads(text)
        rows = [
            run(
                a.model,
                opts,
                s,
                budget,
                redraws=a.redraws,
                average=a.average,
                average_pairs=a.average_pairs,
            )
            for s in seeds
        ]
        ok = sum(r["ok"] for r in rows)
        ok_after = sum(r["ok_after"] for r in rows)
        verdict = (
            f"verdict {a.model} {json.dumps(opts)}: reported loss at {STEPS} steps within "
            f"{B.TOL:g} nat or 1% of the bound in {ok}/{len(rows)} (of the q it was evaluated "
            f"at), {ok_after}/{len(rows)} (of the q after the step); bound at {budget:g} CPU s "
            + ", ".join(f"{r['final_bound'][0]:.2f} ({r['steps']} steps)" for r in rows)
        )
        print(verdict, flush=True)
        results.append({"options": opts, "rows": rows, "verdict": verdict})
        out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
