"""A local level with latent step and noise scales: the Kalman chain beside its scales.

``sigma_level, sigma_obs ~ HalfNormal(1)``, ``x_0 ~ Normal(0, 1)``, and in a ``pyro.markov``
loop ``x_t ~ Normal(x_{t-1}, sigma_level)``, ``y_t ~ Normal(x_t, sigma_obs)`` (simulated with
``sigma_level = 0.3``, ``sigma_obs = 0.5``). Two ways, both ``AutoCVI`` + ``CVI()``:

* ``default``: beyond ``JOINT_MAX_DIM`` coordinates the chain keeps its Kalman block at the
  expected precisions ``E[1/s^2]`` and the remainder holds the two scales
  (``blocks/scaled_markov.py``);
* ``joint`` (``families={"x_t": "joint"}`` for every step): the chain and the scales in the
  remainder's one joint Gaussian (what the code before did up to 64 coordinates; from 65 to
  400 it fitted the states as one dense tree block at the expected prior, beyond 400 the joint).

``--spellings cumsum`` fits the same density written the vectorised way
(:func:`local_level_cumsum`: ``eps`` in a plate, ``x = eps.cumsum(-1)``, ``eps_0 ~ N(0, 1)``,
``eps_t ~ N(0, sigma_level)``), whose walk takes the same block (``blocks/scaled_walk.py``);
its ``joint`` way is ``families={"eps": "joint"}``.

Each fit is scored by ``Trace_ELBO`` (``--eval-particles`` draws, not timed) and its posterior
summaries are compared with the exact posterior: two scales on a 2-d grid of their logarithms
(``--grid`` points a side), ``log p(y | scales)`` and the smoothed states by a Kalman filter at
each grid point; ``-log p(y)`` is the bound no ``-ELBO`` can beat.

Usage::

    python scripts/benchmark_scaled_chain.py --quick
    python scripts/benchmark_scaled_chain.py --out results/benchmark_scaled_chain.json
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

from bench.reporting import Table, fmt, write_results  # noqa: E402

from pyro_cvi import CVI, CVI_ELBO, AutoCVI  # noqa: E402


def local_level(y):
    sl = pyro.sample("sigma_level", dist.HalfNormal(y.new_tensor(1.0)))
    so = pyro.sample("sigma_obs", dist.HalfNormal(y.new_tensor(1.0)))
    x = pyro.sample("x_0", dist.Normal(y.new_tensor(0.0), 1.0))
    pyro.sample("y_0", dist.Normal(x, so), obs=y[0])
    for t in pyro.markov(range(1, len(y))):
        x = pyro.sample(f"x_{t}", dist.Normal(x, sl))
        pyro.sample(f"y_{t}", dist.Normal(x, so), obs=y[t])


def local_level_cumsum(y):
    """:func:`local_level` written with a plate and ``cumsum`` (the same density)."""
    T = len(y)
    sl = pyro.sample("sigma_level", dist.HalfNormal(y.new_tensor(1.0)))
    so = pyro.sample("sigma_obs", dist.HalfNormal(y.new_tensor(1.0)))
    with pyro.plate("time", T):
        eps = pyro.sample("eps", dist.Normal(0.0, torch.cat([y.new_ones(1), sl.expand(T - 1)])))
    with pyro.plate("obs_time", T):
        pyro.sample("y", dist.Normal(eps.cumsum(-1), so), obs=y)


SPELLINGS = {"markov": local_level, "cumsum": local_level_cumsum}


def simulate(T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (0.3 * torch.randn(T, generator=g, dtype=torch.float64)).cumsum(0)
    return x + 0.5 * torch.randn(T, generator=g, dtype=torch.float64)


def exact_posterior(y: torch.Tensor, n: int = 80):
    """Grid over ``(log sigma_level, log sigma_obs)``; per point the Kalman filter's
    ``log p(y | s)`` and RTS smoother moments; returns ``-log p(y)``, the scales' means and sds,
    the states' means and sds (mixtures over the grid)."""
    y = y.double()
    a = torch.linspace(-4.0, 1.0, n, dtype=torch.float64)
    la, lb = torch.meshgrid(a, a, indexing="ij")
    la, lb = la.reshape(-1), lb.reshape(-1)
    q, r = torch.exp(2 * la), torch.exp(2 * lb)
    T = len(y)
    m, P = torch.zeros_like(q), torch.ones_like(q)
    ms, Ps, loglik = [], [], torch.zeros_like(q)
    for t in range(T):
        if t > 0:
            P = P + q
        S = P + r
        loglik = loglik - 0.5 * (torch.log(2 * math.pi * S) + (y[t] - m) ** 2 / S)
        K = P / S
        m = m + K * (y[t] - m)
        P = (1 - K) * P
        ms.append(m)
        Ps.append(P)
    sm, sP = [ms[-1]], [Ps[-1]]
    for t in range(T - 2, -1, -1):
        G = Ps[t] / (Ps[t] + q)
        sm.append(ms[t] + G * (sm[-1] - ms[t]))
        sP.append(Ps[t] + G * G * (sP[-1] - Ps[t] - q))
    sm, sP = torch.stack(sm[::-1]), torch.stack(sP[::-1])  # (T, grid)
    half = dist.HalfNormal(torch.tensor(1.0, dtype=torch.float64))
    logp = loglik + half.log_prob(la.exp()) + la + half.log_prob(lb.exp()) + lb
    h = float(a[1] - a[0])
    log_z = torch.logsumexp(logp, 0) + 2 * math.log(h)
    w = torch.softmax(logp, 0)
    out = {"neg_log_evidence": float(-log_z)}
    for name, v in (("sigma_level", la.exp()), ("sigma_obs", lb.exp())):
        mu = (w * v).sum()
        out[name] = (float(mu), float(((w * (v - mu) ** 2).sum()).sqrt()))
    xm = (sm * w).sum(1)
    xv = ((sP + sm**2) * w).sum(1) - xm**2
    out["x"] = (xm, xv.sqrt())
    return out


def q_summary(guide, T: int):
    """Posterior means and sds under the fitted ``q``: the scales (log-normal), the states."""
    an = guide.engine.analysis
    names = [f"x_{t}" for t in range(T)]
    out = {}
    for b in guide.engine.blocks:
        if hasattr(b, "covariance") and hasattr(b, "loc_name"):
            loc = pyro.param(b.loc_name).detach().double()
            cov = b.covariance().detach().double()
            idx = {s.name: s.start for s in b.sites}
            for z in ("sigma_level", "sigma_obs"):
                i = idx[z]
                mu, v = loc[i], cov[i, i]
                mean = torch.exp(mu + v / 2)
                out[z] = (float(mean), float(mean * torch.sqrt(torch.expm1(v))))
            if "x_0" in idx:
                i = torch.tensor([idx[n] for n in names])
                out["x"] = (loc[i], cov[i, i].sqrt())
            if "eps" in idx:  # (x = cumsum(eps): its covariance L C L', L lower ones)
                i = torch.arange(idx["eps"], idx["eps"] + T)
                L = torch.ones(T, T, dtype=torch.float64).tril()
                out["x"] = (loc[i].cumsum(0), (L @ cov[i][:, i] @ L.T).diagonal().sqrt())
        elif getattr(b, "names", ()) == ("eps",):
            m = b.marginals()
            out["x"] = (m.mean[:, 0].detach().double(), m.cov[:, 0, 0].detach().double().sqrt())
        elif "x_0" in getattr(b, "names", ()):
            ms = [b.marginal(n) for n in names]
            out["x"] = (
                torch.stack([q.mean.reshape(()) for q in ms]).detach().double(),
                torch.stack([q.variance.reshape(()) for q in ms]).detach().double().sqrt(),
            )
    out["remainder"] = list(an.remainder)
    return out


def score(model, guide, y, particles):
    with torch.no_grad():
        v = [Trace_ELBO(num_particles=particles // 5).loss(model, guide, y) for _ in range(5)]
    t = torch.tensor(v, dtype=torch.float64)
    return float(t.mean()), float(t.std() / math.sqrt(len(v)))


def run(T, dtype, way, steps, particles, ref, spelling="markov"):
    y = simulate(T).to(dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = SPELLINGS[spelling]
    names = ["eps"] if spelling == "cumsum" else [f"x_{t}" for t in range(T)]
    families = {n: "joint" for n in names} if way == "joint" else None
    guide = AutoCVI(model, families=families)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    t0 = time.process_time()
    guide(y)
    setup = time.process_time() - t0
    for _ in range(steps):
        svi.step(y)
    cpu = time.process_time() - t0
    bound, se = score(model, guide, y, particles)
    s = q_summary(guide, T)
    xm, xs = s["x"]
    rx, rs = ref["x"]
    return {
        "bound": bound,
        "se": se,
        "cpu": cpu,
        "setup_cpu": setup,
        "steps": steps,
        "remainder": s["remainder"],
        "sigma_level": s["sigma_level"],
        "sigma_obs": s["sigma_obs"],
        "x_mean_err": float((xm - rx).abs().max()),
        "x_sd_ratio": (float((xs / rs).min()), float((xs / rs).max())),
        "chain_messages": "Kalman prior, E[1/s^2]" in guide.explain(),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="T = 100, float64, 30 steps")
    p.add_argument("--out", default="results/benchmark_scaled_chain.json")
    p.add_argument("--lengths", nargs="*", type=int, default=[100, 300, 1000])
    p.add_argument("--dtypes", nargs="*", default=["float64", "float32"])
    p.add_argument("--ways", nargs="*", default=["default", "joint"])
    p.add_argument("--spellings", nargs="*", default=["markov"], choices=sorted(SPELLINGS))
    p.add_argument("--joint-max-length", type=int, default=300, help="longest T the joint runs")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-particles", type=int, default=1000)
    p.add_argument("--grid", type=int, default=80)
    p.add_argument("--label", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    lengths = [100] if args.quick else args.lengths
    dtypes = ["float64"] if args.quick else args.dtypes
    steps = 30 if args.quick else args.steps
    particles = 100 if args.quick else args.eval_particles
    table = Table(
        "Local level with latent scales: the chain's Kalman block beside its scales",
        [
            ("T", "length (-f32: float32)"),
            ("way", "default: the Kalman block at E[1/s^2]; joint: families={'x_t': 'joint'}"),
            ("-ELBO", "Trace_ELBO estimate +- SE (eval particles)"),
            ("-log p(y)", "exact (grid), the bound"),
            ("CPU s", "fit CPU seconds, set-up included (one thread)"),
            ("sigma_level", "q mean +- sd (exact)"),
            ("sigma_obs", "q mean +- sd (exact)"),
            ("x err", "max |E_q x_t - E x_t|"),
            ("sd ratio", "min / max of sd_q(x_t) / sd(x_t)"),
        ],
    )
    payload = {"eval_particles": particles, "steps": steps, "rows": {}, "label": args.label}
    for T in lengths:
        ref = exact_posterior(simulate(T), args.grid)
        for dt, spelling in [(dt, sp) for dt in dtypes for sp in args.spellings]:
            dtype = getattr(torch, dt)
            key = f"T={T}" + ("-f32" if dtype == torch.float32 else "")
            key += "" if spelling == "markov" else f"-{spelling}"
            rec = {"exact": {k: v for k, v in ref.items() if k != "x"}}
            for way in args.ways:
                if way == "joint" and T > args.joint_max_length:
                    continue
                r = run(T, dtype, way, steps, particles, ref, spelling)
                rec[way] = r
                table.add(
                    key, way, f"{r['bound']:.2f} +- {r['se']:.2f}",
                    f"{ref['neg_log_evidence']:.2f}", fmt(r["cpu"], ".1f"),
                    f"{r['sigma_level'][0]:.3f}+-{r['sigma_level'][1]:.3f} "
                    f"({ref['sigma_level'][0]:.3f}+-{ref['sigma_level'][1]:.3f})",
                    f"{r['sigma_obs'][0]:.3f}+-{r['sigma_obs'][1]:.3f} "
                    f"({ref['sigma_obs'][0]:.3f}+-{ref['sigma_obs'][1]:.3f})",
                    f"{r['x_mean_err']:.3f}", f"{r['x_sd_ratio'][0]:.2f}/{r['x_sd_ratio'][1]:.2f}",
                )  # fmt: skip
                print(key, way, {k: v for k, v in r.items() if k != "remainder"}, flush=True)
            payload["rows"][key] = rec
    table.print()
    good, bad = [], []
    for key, rec in payload["rows"].items():
        if "default" not in rec or "joint" not in rec:
            continue
        d, j = rec["default"], rec["joint"]
        gap = d["bound"] - j["bound"]
        ok = gap <= 3 * math.hypot(d["se"], j["se"]) + 0.05
        (good if ok else bad).append(f"{key} ({gap:+.2f})")
    line = (
        f"Verdict: the default's -ELBO is no worse than the joint's (within 3 SE) on "
        f"{len(good)} of {len(good) + len(bad)} rows ({', '.join(good + bad) or '-'}); "
        f"worse on: {', '.join(bad) or 'none'}."
    )
    rows = payload["rows"]
    pairs = [(k, k[: -len("-cumsum")]) for k in rows if k.endswith("-cumsum")]
    pairs = [(c, m) for c, m in pairs if "default" in rows.get(m, {}) and "default" in rows[c]]
    if pairs:
        gaps = [rows[c]["default"]["bound"] - rows[m]["default"]["bound"] for c, m in pairs]
        line += (
            " The cumsum spelling's default against the Markov loop's: "
            + ", ".join(f"{m} {g:+.2f}" for (_, m), g in zip(pairs, gaps))
            + "."
        )
    print(line)
    cmd = "python scripts/benchmark_scaled_chain.py" + (" --quick" if args.quick else "")
    write_results(
        args.out,
        payload,
        title="Local level with latent scales: Kalman block beside the remainder",
        verdict=line,
        tables=[table],
        command=cmd,
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
