#!/usr/bin/env python
"""Candidate minibatch rules for the sparse data-site GP, against ``SiteMemoryScaling``:
the gap to the full-batch optimum after 30 minibatch steps over ten batch orders.

The problem, the batch orders and the gap are those of ``scripts/benchmark_sparse_minibatch.py``
(N = 20,000, M = 200, B = 1,024, Bernoulli, step 1.0, order 0 = the script's order, order k =
seed k). Every candidate keeps each point's latest target ``g_n`` (SAG's memory over sites) and
differs in what stands for the points not kept (``U``) and which targets are kept:

* ``scaled``: the kept targets scaled by ``N / |K|`` (SAG's normalisation by the points seen; the
  mean kept site, scaled to the unseen count, at the kept points' inputs);
* ``window``: ``scaled``, keeping only the targets of the last ``W`` steps;
* ``recent``: the kept targets, plus those of the last ``R`` steps scaled to ``|U|``;
* ``impute``: each unseen point a site at q's current mean with the mean kept precision (adds
  precision, leaves q's mean that of the kept sites);
* ``saga``: ``scaled`` plus SAGA's correction ``gamma (|K| - |B n K|) / |B n K|`` times the
  batch's change of its kept targets, on the batch's sites;
* ``trust``: ``scaled`` with a target from step ``t`` weighted ``clip((t + 1 - w) / r, 0, 1)``
  (a ramp instead of a hard warm-up).

Each rule writes every site and recomputes q's sums (O(N M^2) a step): the script measures
accuracy only, not cost. A warm-up ``w`` drops the targets of steps ``t < w`` (the latest batch
alone, scaled by ``N / B``, stands for the data until then).

Usage::

    PYTHONPATH=$PWD python scripts/explore_minibatch_rules.py            # every rule, 10 orders
    PYTHONPATH=$PWD python scripts/explore_minibatch_rules.py --quick    # 2 orders, 2 rules

Writes ``results/explore_minibatch_rules.json`` (``--out``) and prints a table.
"""

import argparse
import json
import os
import time

import gpytorch
import torch
from bench.reporting import quick_path
from benchmark_sparse_minibatch import build

from pyro_cvi.contrib.gpytorch import CVIOptimizer, SiteMemoryScaling, SVIScaling


class Candidate(SVIScaling):
    """One rule of the module docstring (``fill``: scaled, recent, impute, trust)."""

    def __init__(self, fill="scaled", warmup=0, window=None, recent=None, gamma=0.0, ramp=1.0):
        super().__init__(1.0, warmup)
        self.fill, self.window, self.recent = fill, window, recent
        self.gamma, self.ramp = float(gamma), float(ramp)
        self.mem = None

    def apply(self, s, idx, target, N):
        t = self.num_steps
        self.num_steps += 1
        like = s.site_lam1
        if self.mem is None:
            self.mem = {
                "g1": torch.zeros_like(like),
                "g2": torch.zeros_like(like),
                "step": torch.full(like.shape, -1, dtype=torch.long),
            }
        g1_all, g2_all, step = self.mem["g1"], self.mem["g2"], self.mem["step"]
        g1, g2 = target[0].to(like), target[1].to(like).clamp_max(0.0)
        if t < self.warmup and self.fill != "trust":
            step.fill_(-1)
        was = step[idx] >= 0
        old1, old2, seen_before = g1_all[idx].clone(), g2_all[idx].clone(), float((step >= 0).sum())
        g1_all[idx], g2_all[idx], step[idx] = g1, g2, t
        kept = step >= 0
        if self.window is not None:
            kept = kept & (step > t - self.window)
        k = kept.to(like)
        nk = float(k.sum())
        if self.fill == "scaled":
            lam1, lam2 = (N / nk) * k * g1_all, (N / nk) * k * g2_all
        elif self.fill == "recent":
            rec = (kept & (step > t - self.recent)).to(like)
            r = (N - nk) / float(rec.sum())
            lam1, lam2 = (k + r * rec) * g1_all, (k + r * rec) * g2_all
        elif self.fill == "impute":
            lam1, lam2 = k * g1_all, k * g2_all
            s.set_sites(lam1, lam2.clamp_max(0.0))
            if nk < N:
                mean, _ = s.site_marginals(None)
                w2 = float((k * g2_all).sum()) / nk
                lam1, lam2 = lam1 + (1 - k) * (-2 * w2) * mean, lam2 + (1 - k) * w2
        elif self.fill == "trust":
            trust = k * ((step.to(like) + 1 - self.warmup) / self.ramp).clamp(0, 1)
            if float(trust.sum()) == 0:
                trust = (step == t).to(like)
            total = float(trust.sum())
            lam1, lam2 = (N / total) * trust * g1_all, (N / total) * trust * g2_all
        else:
            raise ValueError(self.fill)
        nb = float(was.sum())
        if self.gamma > 0 and nb > 0:  # SAGA: the batch's change stands for the others' drift
            c = self.gamma * (seen_before - nb) / nb * (N / nk)
            w = was.to(like)
            lam1, lam2 = lam1.clone(), lam2.clone()
            lam1[idx] += c * w * (g1 - old1)
            lam2[idx] += c * w * (g2 - old2)
        s.set_sites(lam1, lam2.clamp_max(0.0))


RULES = {
    "SiteMemoryScaling(c=3, warm-up 3, no refresh) [earlier default]": lambda: SiteMemoryScaling(
        3.0, warmup=3, refresh=False
    ),
    "SiteMemoryScaling() [default: c=5, warm-up 2, refresh]": lambda: SiteMemoryScaling(),
    "scaled, warm-up 0": lambda: Candidate("scaled", 0),
    "scaled, warm-up 2": lambda: Candidate("scaled", 2),
    "scaled, warm-up 3": lambda: Candidate("scaled", 3),
    "scaled, warm-up 4": lambda: Candidate("scaled", 4),
    "scaled, warm-up 5": lambda: Candidate("scaled", 5),
    "scaled, warm-up 6": lambda: Candidate("scaled", 6),
    "window 16, warm-up 3": lambda: Candidate("scaled", 3, window=16),
    "window 13, warm-up 3": lambda: Candidate("scaled", 3, window=13),
    "recent 3, warm-up 4": lambda: Candidate("recent", 4, recent=3),
    "recent 8, warm-up 4": lambda: Candidate("recent", 4, recent=8),
    "impute, warm-up 4": lambda: Candidate("impute", 4),
    "saga 1.0, warm-up 4": lambda: Candidate("scaled", 4, gamma=1.0),
    "saga 0.3, warm-up 4": lambda: Candidate("scaled", 4, gamma=0.3),
    "trust ramp 4 from 2": lambda: Candidate("trust", 2, ramp=4),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--orders", type=int, default=10)
    ap.add_argument("--rules", help="substrings of the rule names, separated by ; (default: all)")
    ap.add_argument("--quick", action="store_true", help="two orders, two rules")
    ap.add_argument("--out", default="results/explore_minibatch_rules.json")
    args = ap.parse_args()
    args.out = str(quick_path(args.out, args.quick))  # --quick: under results/quick/
    if args.quick:
        args.orders, args.rules = 2, "default;scaled, warm-up 4"
    torch.set_num_threads(1)
    N, M, B, steps = 20000, 200, 1024, 30
    g = torch.Generator().manual_seed(0)  # the data of benchmark_sparse_minibatch.py
    X = (torch.rand(N, 2, generator=g, dtype=torch.float64) * 6) - 3
    f = torch.sin(X[:, 0]) + torch.cos(X[:, 1]) + 0.3 * torch.randn(N, generator=g, dtype=X.dtype)
    y = (f > 0).double()
    lik = gpytorch.likelihoods.BernoulliLikelihood()
    state = g.get_state()
    opt = CVIOptimizer(build(X, M), lik, step_size=0.8)
    optimum = min(float(opt.step(X, y)) for _ in range(30))
    wanted = None if not args.rules else [w.strip() for w in args.rules.split(";")]
    out = {"N": N, "M": M, "B": B, "steps": steps, "full_batch_optimum": optimum, "gaps": {}}
    print(f"N={N} M={M} B={B}, {steps} steps; full-batch optimum (-ELBO) {optimum:.2f}")
    for name, make in RULES.items():
        if wanted and not any(w in name for w in wanted):
            continue
        t0, gaps = time.process_time(), []
        for order in range(args.orders):
            if order == 0:
                g.set_state(state)
            else:
                g.manual_seed(order)
            model = build(X, M)
            opt = CVIOptimizer(model, lik, step_size=1.0, minibatch=make())
            perm, pos = torch.randperm(N, generator=g), 0
            for _ in range(steps):
                if pos + B > N:
                    perm, pos = torch.randperm(N, generator=g), 0
                idx = perm[pos : pos + B]
                pos += B
                opt.step(X[idx], y[idx], indices=idx)
            with torch.no_grad():
                gaps.append(float(CVIOptimizer(model, lik).step(X, y)) - optimum)
        out["gaps"][name] = gaps
        print(
            f"{name:44s} max {max(gaps):9.2f}  mean {sum(gaps) / len(gaps):9.2f}  "
            f"[{', '.join(f'{v:.2f}' for v in gaps)}]  ({time.process_time() - t0:.0f} CPU s)",
            flush=True,
        )
    below = [k for k, v in out["gaps"].items() if max(v) < 5]
    out["verdict"] = (
        f"below 5 nats on all {args.orders} orders: {', '.join(below) if below else 'none'}"
    )
    print(out["verdict"])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
