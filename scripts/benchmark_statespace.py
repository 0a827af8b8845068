"""State-space (Markov) CVI: scaling in T, and the coal-mining data against GPyTorch SVGP + NGD.

Three parts, each a table (columns explained under it) and a JSON (``--out``):

1. **Scaling.** A synthetic Poisson time series, ``y_t ~ Poisson(exp(f(t)))`` with ``f`` a
   Matern-3/2 GP (lengthscale 20, variance 1, fixed) at ``T = 1e3 .. 1e6`` regular inputs,
   fitted by plain ``AutoCVI`` on a model written with ``markov_gp`` (Kalman smoother,
   O(T d^3)). Time per ``svi.step`` after the first (set-up) step, steps until the -ELBO
   changes by less than 1e-6 relative, -ELBO per data point, peak memory (each T in its own
   process). The slope of log(time/step) against log(T) from the smallest to the largest T
   measures the growth (1 = linear).
2. **Dense path.** The same model with a ``MultivariateNormal`` prior (dense CVI, O(T^3) time,
   O(T^2) memory), while its kernel matrix fits the memory budget (``--dense-mem-gb``).
3. **Coal mining** (data/README.md protocol: T = 200 bins, the first T // 10 of
   ``default_rng(0).permutation(T)`` held out). Matern-3/2 with lengthscale and variance
   learned: Markov CVI (the hybrid ``svi.step``: CVI for q, Adam for the hyperparameters) on
   the training bins (irregular inputs) against GPyTorch SVGP + NGD with M = 50 inducing
   points (NGD for q, Adam for the hyperparameters). Held-out Poisson log-likelihood
   ``sum_i log E_q[Poisson(y_i | exp(f_i) binsize)]`` (Gauss-Hermite, 64 points), wall time.

4. **Random walk written with cumsum** (``--parts cumsum``): the forecasting-tutorial model
   ``eps ~ Normal(0, 0.05)`` (``T`` increments, ``.to_event(1)``), ``x = eps.cumsum(-1)``,
   ``y_t ~ Poisson(exp(x_t))`` on the same synthetic counts, fitted by plain ``AutoCVI``: the
   Markov block (random walk recognised, Kalman smoother) at T = 1e3, 2e3, 1e4, 1e5 against the
   dense Gaussian block (recognition switched off) at T = 1e3, 2e3; ``CVI(step_size=1)``.

Timings are on a shared, loaded CPU (``--threads`` torch threads); compare rows of one run.

    python scripts/benchmark_statespace.py                  # full (several minutes)
    python scripts/benchmark_statespace.py --quick          # under 2 minutes
    python scripts/benchmark_statespace.py --parts cumsum   # only part 4
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import resource
import time

import numpy as np
import torch
from bench.reporting import Table, fmt, fmt_reach, progress, write_results  # noqa: E402

REL_TOL = 1e-6
STEP_COLUMNS = [
    ("s/step", "median wall time of one svi.step after the first"),
    ("cpu s/step", "median process CPU time of one svi.step after the first"),
    (
        "steps",
        f"steps until the -ELBO changed by < {REL_TOL:g} relative ('never' if not within the "
        "step cap)",
    ),
]
#: BayesNewton's CVI per step (s, CPU, one thread, JIT-compiled) on this machine kind, from the
#: the reference table (T = 200: the coal data, the same Matern-3/2 model); not run by this script
BAYESNEWTON_ISSUE_25 = {200: 0.67e-3, 1000: 2.7e-3, 10000: 21e-3, 100000: 0.29, 1000000: 2.8}
#: the targets: CPU s per Markov CVI step
STEP_TARGETS = {200: 2e-3, 100000: 0.25}
PEAK_COLUMN = ("peak MB", "peak resident memory of the process that ran this row")
PART_NAMES = {"scaling": "scaling in T", "coal": "coal mining", "cumsum": "cumsum random walks"}
ALL_PARTS = set(PART_NAMES)
D64 = torch.float64


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def synthetic(T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(T, dtype=D64)
    f = torch.sin(t / 50.0) + 0.5 * torch.sin(t / 7.0)
    return t, torch.poisson(torch.exp(f), generator=g)


def run_scaling(cfg: dict) -> dict:
    """One T, one path (``markov`` or ``dense``), in its own process."""
    torch.set_num_threads(cfg["threads"])
    import pyro
    import pyro.distributions as dist
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI
    from pyro_cvi.statespace import Matern32, markov_gp

    T, path = cfg["T"], cfg["path"]
    t, y = synthetic(T)
    kernel = Matern32(lengthscale=20.0, variance=1.0)

    def markov(t, y):
        f = markov_gp("x", t, kernel)
        with pyro.plate("t", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

    def dense(t, y):
        K = kernel.covariance(t, t) + 1e-8 * torch.eye(len(t), dtype=D64)
        f = pyro.sample("f", dist.MultivariateNormal(t.new_zeros(len(t)), covariance_matrix=K))
        with pyro.plate("t", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

    model = markov if path == "markov" else dense
    pyro.clear_param_store()
    guide = AutoCVI(model, num_quad_points=cfg["quad"])
    svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
    out = timed_steps(svi, (t, y), cfg["max_steps"])
    return dict(T=T, path=path, neg_elbo_per_point=out["losses"][-1] / T, **out)


def timed_steps(svi, args, max_steps: int, run_all: bool = False) -> dict:
    """The first step (set-up) and up to ``max_steps`` more, timed; stops at convergence
    (-ELBO change < REL_TOL relative) unless ``run_all``."""
    t0, c0 = time.perf_counter(), time.process_time()
    losses = [svi.step(*args)]
    setup, setup_cpu = time.perf_counter() - t0, time.process_time() - c0
    times, cpus, converged = [], [], None
    for k in range(max_steps):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(svi.step(*args))
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        if converged is None and abs(losses[-1] - losses[-2]) < REL_TOL * abs(losses[-1]):
            converged = k + 2
            if not run_all:
                break
    return dict(
        setup_s=setup,
        setup_cpu_s=setup_cpu,
        step_s=float(np.median(times)),
        step_cpu_s=float(np.median(cpus)),
        steps=len(losses),
        converged=converged,
        losses=losses,
        peak_mb=_peak_mb(),
    )


def run_cumsum(cfg: dict) -> dict:
    """One T, one path of part 4 (``markov``: random walk recognised; ``dense``: not)."""
    torch.set_num_threads(cfg["threads"])
    import pyro
    import pyro.distributions as dist
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI
    from pyro_cvi.statespace import random_walk

    random_walk.RECOGNISE_RANDOM_WALKS = cfg["path"] == "markov"
    T = cfg["T"]
    _, y = synthetic(T)

    def model(y):
        eps = pyro.sample(
            "eps", dist.Normal(torch.zeros((), dtype=D64), 0.05).expand([T]).to_event(1)
        )
        x = eps.cumsum(-1)
        with pyro.plate("obs", T):
            pyro.sample("y", dist.Poisson(x.exp()), obs=y)

    pyro.clear_param_store()
    guide = AutoCVI(model, num_quad_points=cfg["quad"])
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    out = timed_steps(svi, (y,), cfg["max_steps"], cfg.get("run_all", False))
    markov = "Markov prior: Kalman smoother" in guide.explain()
    return dict(T=T, path=cfg["path"], markov=markov, neg_elbo=out["losses"][-1], **out)


def cumsum_part(args, quad: int):
    """Part 4: the table, its rows and a verdict sentence."""
    Ts = [1000, 10000] if args.quick else [1000, 2000, 10000, 100000]
    dense_Ts = [1000] if args.quick else [1000, 2000]
    table = Table(
        "Random walk x = eps.cumsum(-1), Poisson counts: recognised (Markov) vs dense block",
        [
            (
                "path",
                "markov: the random walk recognised, Kalman smoother (O(T)); dense: "
                "the same model with recognition off, one dense Gaussian block (O(T^3))",
            ),
            ("T", "number of increments and of Poisson counts"),
            ("setup s", "the first svi.step: analysis (detection by JVPs), probes, initial q"),
            *STEP_COLUMNS,
            ("-ELBO", "the -ELBO after the last step (T <= 2e3: 12 steps on both paths)"),
            PEAK_COLUMN,
        ],
        text=f"Poisson sites in closed form; CVI(step_size=1.0); increments Normal(0, 0.05); "
        f"device cpu, float64, {args.threads} thread(s); each row in its own process.",
    )
    rows = []
    for path, sizes in (("markov", Ts), ("dense", dense_Ts)):
        for T in progress(sizes, f"cumsum random walk, {path}"):
            cap = 12 if T <= 2000 else (10 if T <= 10000 else 5)
            cfg = dict(T=T, path=path, threads=args.threads, quad=quad, max_steps=cap)
            cfg["run_all"] = T <= 2000  # the same 12 steps on both paths: comparable -ELBOs
            rows.append(in_process(run_cumsum, cfg))
    for r in rows:
        table.add(
            r["path"] if r["markov"] == (r["path"] == "markov") else r["path"] + " (?)",
            r["T"],
            fmt(r["setup_s"], ".2f"),
            fmt(r["step_s"], ".4f"),
            fmt(r["step_cpu_s"], ".4f"),
            fmt_reach(r["converged"]),
            fmt(r["neg_elbo"], ".6f"),
            fmt(r["peak_mb"], ".0f"),
        )
    mk = {r["T"]: r for r in rows if r["path"] == "markov"}
    dn = {r["T"]: r for r in rows if r["path"] == "dense"}
    rel = {}
    for T in sorted(set(mk) & set(dn)):
        a, b = mk[T]["losses"], dn[T]["losses"]
        rel[T] = max(abs(x - z) / abs(z) for x, z in zip(a, b))
        table.ratio(f"max rel. -ELBO diff T={T}", rel[T], "over all 13 losses, Markov vs dense")
    for T in dn:
        if T in mk:
            table.ratio(f"dense/markov T={T}", dn[T]["step_s"] / mk[T]["step_s"], "s/step ratio")
    Tm = sorted(mk)
    slope = None
    if len(Tm) >= 2:
        slope = math.log(mk[Tm[-1]]["step_s"] / mk[Tm[0]]["step_s"]) / math.log(Tm[-1] / Tm[0])
        table.ratio("slope", slope, f"d log(s/step) / d log T, T={Tm[0]} to {Tm[-1]}")
    table.print()
    big = mk[Tm[-1]]
    sentence = (
        f"The cumsum random walk ran as a Markov chain at {big['step_s']:.2f} s per step at "
        f"T = {Tm[-1]:.0e} (slope {fmt(slope, '.2f')}); the dense block took "
        f"{dn[max(dn)]['step_s']:.2f} s per step at T = {max(dn)}, and where both ran the "
        f"-ELBOs agree to {fmt(max(rel.values(), default=None), '.1e')} relative."
    )
    return table, dict(rows=rows, max_rel_diff=rel, slope=slope), sentence


def in_process(fn, cfg):
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, (cfg,))


# ---------------------------------------------------------------------------------- coal
def heldout_loglik(mean, var, y, binsize, num_points: int = 64) -> float:
    """``sum_i log int Poisson(y_i | exp(f) binsize) N(f; mean_i, var_i) df``."""
    x, w = np.polynomial.hermite_e.hermegauss(num_points)
    x, w = torch.tensor(x, dtype=D64), torch.tensor(w / w.sum(), dtype=D64)
    f = mean[:, None] + var.clamp_min(0).sqrt()[:, None] * x
    lp = torch.distributions.Poisson(torch.exp(f) * binsize).log_prob(y[:, None])
    return float(torch.logsumexp(lp + w.log(), -1).sum())


def coal_markov(data, iters: int, lr: float, every: int):
    import pyro
    import pyro.distributions as dist
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI
    from pyro_cvi.statespace import Matern32, markov_gp, predict

    train, test = ~data.test, data.test
    t_tr, y_tr, binsize = data.t[train], data.y[train], data.binsize

    def model(t, y):
        ls = pyro.param("ls", torch.tensor(10.0, dtype=D64), constraint=dist.constraints.positive)
        s2 = pyro.param("s2", torch.tensor(1.0, dtype=D64), constraint=dist.constraints.positive)
        f = markov_gp("x", t, Matern32(ls, s2))
        with pyro.plate("bins", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f) * binsize), obs=y)

    pyro.clear_param_store()
    guide = AutoCVI(model)
    # a fixed beta = 1: the ELBO moves with the hyperparameters, so the adaptive step's
    # backtracking (which compares successive ELBOs) would only cost re-evaluations here
    svi = SVI(model, guide, CVI(step_size=1.0, optim_args={"lr": lr}), loss=CVI_ELBO())
    history, elapsed = [], 0.0
    for it in progress(range(iters), "Markov CVI (coal)"):
        t0 = time.perf_counter()
        loss = svi.step(t_tr, y_tr)
        elapsed += time.perf_counter() - t0
        if (it + 1) % every == 0 or it == iters - 1:
            mean, var = predict(guide, "x", data.t[test], t_tr, y_tr)
            history.append((elapsed, heldout_loglik(mean, var, data.y[test], binsize), loss))
    hyper = dict(
        lengthscale=float(pyro.param("ls").detach()), variance=float(pyro.param("s2").detach())
    )
    return history, hyper


def coal_svgp(data, iters: int, lr: float, ngd_lr: float, every: int, M: int = 50):
    import gpytorch

    train, test = ~data.test, data.test
    x_tr, y_tr, binsize = data.t[train], data.y[train], data.binsize
    shift, scale = float(x_tr.mean()), 1.0

    class PoissonLikelihood(gpytorch.likelihoods._OneDimensionalLikelihood):
        def forward(self, function_samples, *args, **kwargs):
            return torch.distributions.Poisson(torch.exp(function_samples) * binsize)

    class SVGP(gpytorch.models.ApproximateGP):
        def __init__(self, Z):
            q = gpytorch.variational.NaturalVariationalDistribution(len(Z))
            s = gpytorch.variational.VariationalStrategy(self, Z, q, learn_inducing_locations=False)
            super().__init__(s)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(1.5))

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(x), self.covar_module(x)
            )

    X = ((x_tr - shift) / scale)[:, None]
    Z = torch.linspace(float(X.min()), float(X.max()), M, dtype=D64)[:, None]
    model = SVGP(Z).double()
    model.covar_module.base_kernel.lengthscale = 10.0
    model.covar_module.outputscale = 1.0
    lik = PoissonLikelihood().double()
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(y_tr))
    ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=len(y_tr), lr=ngd_lr)
    adam = torch.optim.Adam(list(model.hyperparameters()), lr=lr)
    Xte = ((data.t[test] - shift) / scale)[:, None]
    history, elapsed = [], 0.0
    for it in progress(range(iters), "SVGP + NGD (coal)"):
        model.train()
        t0 = time.perf_counter()
        ngd.zero_grad()
        adam.zero_grad()
        loss = -mll(model(X), y_tr)  # per data point: NGD scales by num_data itself
        loss.backward()
        ngd.step()
        adam.step()
        elapsed += time.perf_counter() - t0
        if (it + 1) % every == 0 or it == iters - 1:
            model.eval()
            with torch.no_grad():
                p = model(Xte)
                ll = heldout_loglik(p.mean, p.variance, data.y[test], binsize)
            history.append((elapsed, ll, float(loss.detach()) * len(y_tr)))
    k = model.covar_module
    hyper = dict(
        lengthscale=float(k.base_kernel.lengthscale.detach()),
        variance=float(k.outputscale.detach()),
    )
    return history, hyper


def first_time_at(history, level: float):
    for t, ll, _ in history:
        if ll >= level - 1e-9:
            return t
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: under 2 minutes")
    ap.add_argument("--out", default="results/benchmark_statespace.json")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dense-mem-gb", type=float, default=2.0)
    ap.add_argument("--data", default=None, help="data folder (default: $PYRO_CVI_DATA)")
    ap.add_argument(
        "--parts",
        default=",".join(sorted(ALL_PARTS)),
        help="comma-separated parts to run: scaling (with the dense path), coal, cumsum",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    Ts = [200, 1000, 10000, 30000] if args.quick else [200, 1000, 10000, 100000, 1000000]
    dense_Ts = [1000] if args.quick else [1000, 2000, 4000, 8000]
    quad = 10

    parts = set(args.parts.split(","))
    tables, payload, sentences = [], dict(threads=args.threads, device="cpu", dtype="float64"), []
    if "scaling" in parts:
        # ---------------------------------------------------------------- scaling
        scale = Table(
            "Scaling: Poisson time series, Matern-3/2 (fixed hyperparameters), plain AutoCVI",
            [
                (
                    "path",
                    "markov: Kalman-smoother block (O(T d^3)); dense: MVN prior block (O(T^3))",
                ),
                ("T", "number of time points (one Poisson count each)"),
                ("setup s", "the first svi.step: analysis, probes, initial q"),
                *STEP_COLUMNS,
                ("-ELBO/T", "the last -ELBO per time point"),
                PEAK_COLUMN,
            ],
            text=f"{quad} Gauss-Hermite points per non-Poisson site (Poisson: closed form); "
            f"CVI(step_size='auto'); device cpu, float64, {args.threads} thread(s); each row "
            "in its own process.",
        )
        rows = []
        for T in progress(Ts, "Markov CVI scaling"):
            cap = 30 if T <= 10000 else (8 if T <= 100000 else 3)
            cap = 60 if T <= 1000 else cap  # (short chains: more steps, a steadier median)
            rows.append(
                in_process(
                    run_scaling,
                    dict(T=T, path="markov", threads=args.threads, quad=quad, max_steps=cap),
                )
            )
        for T in progress(dense_Ts, "dense CVI"):
            need_gb = 6 * T * T * 8 / 2**30  # K, its Cholesky and the solves' copies
            if need_gb > args.dense_mem_gb:
                scale.note(f"dense T={T}", f"not run: needs ~{need_gb:.1f} GB > --dense-mem-gb")
                continue
            rows.append(
                in_process(
                    run_scaling,
                    dict(
                        T=T,
                        path="dense",
                        threads=args.threads,
                        quad=quad,
                        max_steps=30 if T <= 2000 else 3,
                    ),
                )
            )
        for r in rows:
            scale.add(
                r["path"],
                r["T"],
                fmt(r["setup_s"], ".2f"),
                fmt(r["step_s"], ".4f"),
                fmt(r["step_cpu_s"], ".4f"),
                fmt_reach(r["converged"]),
                fmt(r["neg_elbo_per_point"], ".6f"),
                fmt(r["peak_mb"], ".0f"),
            )
        mk = [r for r in rows if r["path"] == "markov"]
        slope = None
        if len(mk) >= 2:
            slope = math.log(mk[-1]["step_s"] / mk[0]["step_s"]) / math.log(
                mk[-1]["T"] / mk[0]["T"]
            )
            scale.ratio(
                "slope",
                slope,
                f"d log(s/step) / d log T from T={mk[0]['T']} to T={mk[-1]['T']} (1 = linear)",
            )
        for r in mk:
            bn = BAYESNEWTON_ISSUE_25.get(r["T"])
            if bn is not None:
                scale.ratio(
                    f"bayesnewton/markov T={r['T']:g}",
                    bn / r["step_cpu_s"],
                    f"BayesNewton's jitted CVI step ({bn * 1e3:g} ms, the published table: not run "
                    "here) / this run's CPU s per step; > 1: pyro-cvi faster",
                )
            target = STEP_TARGETS.get(r["T"])
            if target is not None:
                scale.ratio(
                    f"target/markov T={r['T']:g}",
                    target / r["step_cpu_s"],
                    f"the target ({target:g} s CPU per step) / this run's; >= 1: met",
                )
        for T in dense_Ts:
            d = [r for r in rows if r["path"] == "dense" and r["T"] == T]
            m = [r for r in mk if r["T"] == T]
            if d and m:
                scale.ratio(
                    f"dense/markov T={T}",
                    d[0]["step_s"] / m[0]["step_s"],
                    "dense time per step / Markov time per step",
                )
        scale.plot(
            "T",
            "seconds per step",
            {
                p: [(r["T"], r["step_s"]) for r in rows if r["path"] == p]
                for p in ("markov", "dense")
            },
            logx=True,
            logy=True,
        )
        scale.print()
        tables.append(scale)
        payload.update(scaling=rows, slope=slope)
        big = mk[-1]
        small = mk[0]
        sentences.append(
            f"Markov CVI took {small['step_cpu_s'] * 1e3:.2f} ms CPU per step at "
            f"T = {small['T']} and {big['step_cpu_s']:.3f} s CPU ({big['step_s']:.3f} s wall) "
            f"at T = {big['T']:.0e} (slope {fmt(slope, '.2f')} in log-log)."
        )
    if "coal" in parts:
        # ---------------------------------------------------------------- coal
        from bench.datasets import load_coal

        data = load_coal(200, args.data)
        iters = 60 if args.quick else 150
        every = 5
        mh, mhyp = coal_markov(data, iters, lr=0.05, every=every)
        sh, shyp = coal_svgp(
            data, 2 * iters if args.quick else 400, lr=0.05, ngd_lr=0.1, every=every
        )
        coal = Table(
            "Coal-mining disasters: T = 200 bins, 20 held out, Matern-3/2 with learned "
            "hyperparameters",
            [
                (
                    "method",
                    "markov-cvi: AutoCVI on markov_gp (Kalman smoother) + Adam lr 0.05; "
                    "svgp-ngd: GPyTorch SVGP, M = 50 fixed inducing points, NGD lr 0.1 + "
                    "Adam lr 0.05",
                ),
                ("iters", "training iterations (one svi.step / one NGD + Adam step each)"),
                ("wall s", "training wall time (evaluation excluded)"),
                (
                    "held-out ll",
                    "final held-out Poisson log-likelihood (sum over 20 bins; higher is better)",
                ),
                (
                    "s to svgp",
                    "training time until the held-out log-lik first reached SVGP's final "
                    "value (checked every 5 iterations)",
                ),
                ("lengthscale", "learned lengthscale (years)"),
                ("variance", "learned kernel variance"),
            ],
        )
        svgp_final = sh[-1][1]
        for name, h, hyp, n in (("markov-cvi", mh, mhyp, iters), ("svgp-ngd", sh, shyp, None)):
            coal.add(
                name,
                n or (2 * iters if args.quick else 400),
                fmt(h[-1][0], ".2f"),
                fmt(h[-1][1], ".3f"),
                fmt_reach(first_time_at(h, svgp_final), ".2f"),
                fmt(hyp["lengthscale"], ".2f"),
                fmt(hyp["variance"], ".3f"),
            )
        coal.plot(
            "seconds",
            "held-out log-lik",
            {"markov-cvi": [(t, ll) for t, ll, _ in mh], "svgp-ngd": [(t, ll) for t, ll, _ in sh]},
        )
        coal.print()
        tables.append(coal)
        payload.update(coal=dict(markov=mh, svgp=sh, markov_hyper=mhyp, svgp_hyper=shyp))
        t_cvi = first_time_at(mh, svgp_final)
        sentences.append(
            f"On the coal data Markov CVI reached SVGP+NGD's final held-out log-lik "
            f"({svgp_final:.3f}) in "
            + (f"{t_cvi:.2f} s" if t_cvi is not None else "never")
            + f" against SVGP's {sh[-1][0]:.2f} s of training, ending at {mh[-1][1]:.3f}."
        )
    if "cumsum" in parts:
        table, result, sentence = cumsum_part(args, quad)
        tables.append(table)
        payload.update(cumsum=result)
        sentences.append(sentence)
    line = "Verdict: " + " ".join(sentences)
    print(line)
    flags = (" --quick" * args.quick) + (f" --parts {args.parts}" if parts != ALL_PARTS else "")
    write_results(
        args.out,
        payload,
        title="State-space CVI: " + ", ".join(n for p, n in PART_NAMES.items() if p in parts),
        verdict=line,
        tables=tables,
        command="python scripts/benchmark_statespace.py" + flags,
        quick=args.quick,
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
