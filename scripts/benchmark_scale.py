"""Scale benchmark: CVI on a covtype-sized logistic regression, 1 and 2 processes, and 10M rows
streamed.

Problem (the paper's covtype setting, synthetic): ``X`` is ``N x 54`` (a constant column and 53
standard normal features), a known weight vector ``w* ~ N(0, 1)`` (seed 0), ``y ~
Bernoulli(sigmoid(X w*))``, prior ``w ~ N(0, I / 0.002)``, Gaussian ``q``. Every method's ``q``
is scored by the same exact evaluator: ``ELBO = -KL(q || prior) + sum_n E_q[log p(y_n | x_n^T
w)]`` by 32-point Gauss-Hermite quadrature (no Monte Carlo). Parts:

* ``covtype``: N = 581,012. CVI (``AutoCVI`` + ``CVI(step_size=1)``, in memory, one process)
  until converged; its optimum is its best ELBO; time to within 0.5 nat of it. Pyro Adam SVI
  (``Trace_ELBO``, minibatches of 4096 via ``pyro.plate(subsample_size=...)``, lr 0.01) with
  ``AutoNormal`` and ``AutoMultivariateNormal``: time to within 5 nat of CVI's optimum (scored
  every ~``--eval-every`` s of optimisation; scoring time is not counted). scikit-learn
  ``LogisticRegression`` (MAP with the same prior, L-BFGS): fit time, a speed floor (a point
  estimate, no ELBO). Memory: bytes of CVI's sites (N x 2, O(N)) and of q (D + D^2), and the
  process's peak RSS after the CVI phase.
* ``parallel``: the same CVI run in 1 and 2 gloo processes (``torch.multiprocessing``, each
  rank holds its shard and its sites; ``AutoCVI(process_group=WORLD)``): time to the 0.5 nat
  target, rows/s, and the largest difference of q's mean between the two runs.
* ``stream``: 10M rows (``--stream-rows``) generated in chunks of 100k by a fixed seed per
  chunk (never all in memory), fed by a ``DataLoader`` to ``StreamingCVI`` (``update="batch"``)
  for ``--passes`` passes, in a child process whose peak RSS is reported. Check: on the 1M-row
  subset (the first 10 chunks), streaming reaches within 1% (and in nats) of the in-memory
  ``AutoCVI`` optimum of the same 1M rows.

    python scripts/benchmark_scale.py [--quick] [--out results/benchmark_scale.json]

``--quick`` (< 2 min): N = 50,000, 300k streamed rows (200k subset), short baselines.
Timings are wall-clock on this machine (shared: see the note for the load); the device is
printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, IterableDataset

from pyro_cvi import CVI, CVI_ELBO, AutoCVI  # noqa: E402
from pyro_cvi.scale.streaming import StreamingCVI  # noqa: E402

D, DELTA, CHUNK = 54, 0.002, 100_000
GH_X, GH_W = (torch.tensor(a) for a in np.polynomial.hermite_e.hermegauss(32))
GH_W = GH_W / GH_W.sum()


# ------------------------------------------------------------------------------ data and model
def w_true() -> torch.Tensor:
    return torch.randn(D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def chunk(i: int, rows: int = CHUNK):
    """Rows ``[i CHUNK, i CHUNK + rows)`` of the synthetic problem (a fixed seed per chunk)."""
    g = torch.Generator().manual_seed(1000 + i)
    X = torch.randn(rows, D, generator=g, dtype=torch.float64)
    X[:, 0] = 1.0
    y = torch.bernoulli(torch.sigmoid(X @ w_true() / 4), generator=g)
    return X, y


def dataset(n: int):
    parts = [chunk(i, min(CHUNK, n - i * CHUNK)) for i in range((n + CHUNK - 1) // CHUNK)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class Chunks(IterableDataset):
    """The first ``n`` rows, generated chunk by chunk (the same chunks every pass)."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        for i in range((self.n + CHUNK - 1) // CHUNK):
            yield chunk(i, min(CHUNK, self.n - i * CHUNK))


def model(X, y):
    w = pyro.sample("w", dist.Normal(X.new_zeros(D), DELTA**-0.5).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def sub_model(X, y, batch):
    w = pyro.sample("w", dist.Normal(X.new_zeros(D), DELTA**-0.5).to_event(1))
    with pyro.plate("data", X.shape[0], subsample_size=batch) as idx:
        pyro.sample("y", dist.Bernoulli(logits=X[idx] @ w), obs=y[idx])


def elbo(X, y, m, V) -> float:
    """Exact ELBO of ``q = N(m, V)`` (32-point Gauss-Hermite per row), in chunks."""
    total = 0.0
    s = 2 * y - 1
    for i in range(0, X.shape[0], CHUNK):
        A = X[i : i + CHUNK]
        fm, fv = A @ m, ((A @ V) * A).sum(-1)
        eta = fm[:, None] + fv.sqrt()[:, None] * GH_X
        total += float((torch.nn.functional.logsigmoid(s[i : i + CHUNK, None] * eta) @ GH_W).sum())
    var0 = 1 / DELTA
    L = torch.linalg.cholesky(V)
    kl = 0.5 * (V.trace() / var0 + m @ m / var0 - D + D * np.log(var0) - 2 * L.diag().log().sum())
    return total - float(kl)


def first_within(times, values, target):
    for t, v in zip(times, values):
        if v >= target:
            return t
    return None


def fmt_s(t):
    return "never" if t is None else f"{t:.2f} s"


# ------------------------------------------------------------------------------ CVI in memory
def SVI_(guide):
    return pyro.infer.SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())


def cvi_trajectory(X, y, steps, group=None):
    pyro.clear_param_store()
    guide = AutoCVI(model, process_group=group)
    svi = SVI_(guide)
    t0 = time.perf_counter()
    marks, elbos = [], []
    for _ in range(steps):
        marks.append(time.perf_counter() - t0)  # q_{k-1} existed at this time
        elbos.append(-svi.step(X, y))
    if len(marks) > 1:  # q_0 exists only after the set-up inside the first step
        marks[0] = marks[1]
    q = guide.posterior("w")
    return guide, q, marks, elbos


def _rank(rank, world, port, n, steps, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    X, y = dataset(n)
    X, y = (
        X[rank * n // world : (rank + 1) * n // world],
        y[rank * n // world : (rank + 1) * n // world],
    )
    from pyro_cvi.scale.distributed import WORLD

    _, q, marks, elbos = cvi_trajectory(X, y, steps, WORLD)
    if rank == 0:
        torch.save({"marks": marks, "elbos": elbos, "loc": q.loc}, out)
    torch.distributed.destroy_process_group()


def parallel(n, steps, world, tmp):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(Path(tmp) / f"par{world}.pt")
    t0 = time.perf_counter()
    mp.spawn(_rank, args=(world, port, n, steps, out), nprocs=world, join=True)
    res = torch.load(out)
    res["wall"] = time.perf_counter() - t0
    return res


# ------------------------------------------------------------------------------ Adam baselines
def adam(X, y, guide_cls, budget, eval_every, target, batch=4096, lr=0.01):
    from tqdm.auto import tqdm

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = guide_cls(sub_model)
    svi = pyro.infer.SVI(
        sub_model, guide, pyro.optim.Adam({"lr": lr}), loss=pyro.infer.Trace_ELBO()
    )
    spent, marks, elbos, steps = 0.0, [], [], 0
    bar = tqdm(total=budget, desc=guide_cls.__name__, unit="s", leave=False)
    while spent < budget:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < eval_every:
            svi.step(X, y, batch)
            steps += 1
        dt = time.perf_counter() - t0
        spent += dt
        bar.update(dt)
        with torch.no_grad():
            if guide_cls is pyro.infer.autoguide.AutoNormal:
                m, V = guide.locs.w.detach(), torch.diag(guide.scales.w.detach() ** 2)
            else:
                L = guide.scale_tril.detach()
                m, V = guide.loc.detach(), L @ L.T
        marks.append(spent)
        elbos.append(elbo(X, y, m, V))
        if elbos[-1] >= target:
            break
    bar.close()
    return {
        "steps": steps,
        "seconds": spent,
        "best_elbo": max(elbos),
        "time_to_5nat": first_within(marks, elbos, target),
        "rows_per_s": steps * batch / spent,
    }


# ------------------------------------------------------------------------------ streaming
def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _Progress(IterableDataset):
    """The chunks of ``Chunks(n)``, printing rows done, seconds and peak RSS every 10 chunks and
    saving them to ``out`` (a cut-off run keeps what it measured)."""

    def __init__(self, n: int, res: dict, out: str):
        self.n, self.res, self.out, self.t0 = n, res, out, time.perf_counter()

    def __iter__(self):
        for i, c in enumerate(Chunks(self.n)):
            yield c
            rows = min(self.n, (i + 1) * CHUNK)
            if (i + 1) % 10 == 0 or rows == self.n:
                t, rss = time.perf_counter() - self.t0, _rss_mb()
                self.res.update(rows_done=rows, seconds_so_far=t, peak_rss_mb_so_far=rss)
                Path(self.out).write_text(json.dumps(self.res))
                print(f"  streamed {rows:,} rows, {t:.0f} s, peak RSS {rss:.0f} MB", flush=True)


def stream_child(part, n, passes, out):
    """In a fresh process (its own peak RSS). ``memory``: stream ``n`` rows ``passes`` times.
    ``subset``: stream the first ``n`` rows ``passes`` times, then in-memory AutoCVI on them."""
    torch.set_num_threads(1)
    res = {}
    t0 = time.perf_counter()
    if part == "memory":
        st = StreamingCVI(model, update="batch")
        for p in range(passes):
            st.run_pass(DataLoader(_Progress(n, res, out), batch_size=None))
            print(f"  stream {n:,} rows: pass {p + 1} done at {time.perf_counter() - t0:.1f} s")
        res["seconds"] = time.perf_counter() - t0
        res["rows_per_s"] = n * passes / res["seconds"]
        res["loc_error_vs_truth"] = float((st.posterior().loc - w_true() / 4).abs().max())
        res["peak_rss_mb_streaming"] = _rss_mb()
    else:
        loader = DataLoader(Chunks(n), batch_size=None)
        st = StreamingCVI(model, update="batch")
        for _ in range(passes):
            st.run_pass(loader)
        res["subset_stream_elbo"] = st.elbo(loader)
        res["subset_stream_seconds"] = time.perf_counter() - t0
        print(f"  subset streamed: ELBO {res['subset_stream_elbo']:.2f}", flush=True)
        X, y = dataset(n)
        _, q, _, _ = cvi_trajectory(X, y, 12)
        res["subset_memory_elbo"] = elbo(X, y, q.loc.detach(), q.covariance_matrix.detach())
        res["subset_gap_nats"] = res["subset_memory_elbo"] - res["subset_stream_elbo"]
        res["subset_gap_rel"] = abs(res["subset_gap_nats"]) / abs(res["subset_memory_elbo"])
        res["peak_rss_mb_subset_process"] = _rss_mb()
    Path(out).write_text(json.dumps(res))


# ------------------------------------------------------------------------------ main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run under 2 minutes")
    ap.add_argument("--out", default="results/benchmark_scale.json")
    ap.add_argument("--rows", type=int, default=581_012)
    ap.add_argument("--cvi-steps", type=int, default=10)
    ap.add_argument("--adam-budget", type=float, default=120.0, help="seconds per Adam guide")
    ap.add_argument("--eval-every", type=float, default=2.0)
    ap.add_argument("--stream-rows", type=int, default=10_000_000)
    ap.add_argument("--subset-rows", type=int, default=1_000_000)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--parts", default="covtype,parallel,stream")
    ap.add_argument("--subset-passes", type=int, default=3, help="passes on the 1M subset")
    ap.add_argument("--stream-child", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--render", metavar="JSON", help="only print the tables of a written run")
    a = ap.parse_args()
    from bench.reporting import quick_path

    a.out = str(quick_path(a.out, a.quick))  # --quick: under results/quick/
    if a.render:
        return render(a.render)
    if a.stream_child:
        part, n, p, out = a.stream_child
        return stream_child(part, int(n), int(p), out)
    if a.quick:
        a.rows, a.cvi_steps, a.adam_budget, a.eval_every = 50_000, 6, 6.0, 1.0
        a.stream_rows, a.subset_rows, a.passes = 300_000, 200_000, 3
    torch.set_num_threads(1)
    parts = a.parts.split(",")
    device = f"CPU ({platform.processor() or platform.machine()}, torch threads 1); no GPU"
    print(f"device: {device}; load average {os.getloadavg()}")
    report = {"device": device, "args": vars(a), "load_average_start": os.getloadavg()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    if "covtype" in parts:
        X, y = dataset(a.rows)
        print(f"covtype-sized problem: {a.rows:,} x {D}")
        guide, q, marks, elbos = cvi_trajectory(X, y, a.cvi_steps)
        rss_cvi = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        final = elbo(X, y, q.loc.detach(), q.covariance_matrix.detach())
        opt = max(max(elbos), final)
        t_cvi = first_within(marks, elbos, opt - 0.5)
        sites = sum(v.numel() * v.element_size() for v in guide.natural_params().values())
        cov = q.covariance_matrix
        q_bytes = (cov.numel() + q.loc.numel()) * cov.element_size()
        cvi = {
            "elbo_per_step": elbos,
            "time_per_step": marks,
            "optimum": opt,
            "time_to_0.5nat": t_cvi,
            "rows_per_s": a.rows * len(marks) / (marks[-1] or 1),
            "sites_bytes": sites,
            "q_bytes": q_bytes,
            "peak_rss_mb_after_cvi": rss_cvi,
        }
        print(
            f"  CVI: optimum ELBO {opt:.2f}; within 0.5 nat at {fmt_s(t_cvi)}; "
            f"sites {sites / 1e6:.1f} MB (N x 2), q {q_bytes / 1e3:.1f} kB (D + D^2), "
            f"peak RSS {rss_cvi:.0f} MB"
        )
        from sklearn.linear_model import LogisticRegression

        t0 = time.perf_counter()
        lr = LogisticRegression(C=1 / DELTA, fit_intercept=False, max_iter=1000).fit(
            X.numpy(), y.numpy()
        )
        t_sk = time.perf_counter() - t0
        map_gap = float(np.abs(lr.coef_[0] - q.loc.detach().numpy()).max())
        print(f"  scikit-learn MAP: {t_sk:.2f} s (max |w_MAP - m_CVI| = {map_gap:.2e})")
        ad = {}
        for cls in (pyro.infer.autoguide.AutoNormal, pyro.infer.autoguide.AutoMultivariateNormal):
            ad[cls.__name__] = r = adam(X, y, cls, a.adam_budget, a.eval_every, opt - 5.0)
            print(
                f"  Adam {cls.__name__}: within 5 nat at {fmt_s(r['time_to_5nat'])} "
                f"(best ELBO {r['best_elbo']:.1f} after {r['seconds']:.0f} s, {r['steps']} steps)"
            )
        report["covtype"] = {
            "rows": a.rows,
            "cvi": cvi,
            "sklearn_map_seconds": t_sk,
            "sklearn_map_vs_cvi_mean": map_gap,
            "adam": ad,
        }
        Path(a.out).write_text(json.dumps(report, indent=1, default=str))  # (kept if cut off)
        del X, y, guide
    if "parallel" in parts:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            res = {w: parallel(a.rows, a.cvi_steps, w, tmp) for w in (1, 2)}
        opt = max(max(r["elbos"]) for r in res.values())
        par = {}
        for w, r in res.items():
            t = first_within(r["marks"], r["elbos"], opt - 0.5)
            par[w] = {
                "time_to_0.5nat": t,
                "seconds": r["marks"][-1],
                "wall_with_startup": r["wall"],
                "rows_per_s": a.rows * len(r["marks"]) / r["marks"][-1],
            }
            print(
                f"  {w} process(es): within 0.5 nat at {fmt_s(t)}; "
                f"{par[w]['rows_per_s']:,.0f} rows/s"
            )
        par["max_mean_difference"] = float((res[1]["loc"] - res[2]["loc"]).abs().max())
        print(f"  max |m_1proc - m_2proc| = {par['max_mean_difference']:.2e}")
        report["parallel"] = par
        Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    if "stream" in parts:
        outs = {k: str(Path(a.out).with_suffix(f".{k}.json")) for k in ("memory", "subset")}
        print(
            f"streaming {a.stream_rows:,} rows, {a.passes} pass(es); the {a.subset_rows:,}-row "
            f"subset: {a.subset_passes} passes and in memory (two child processes at once)"
        )
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--stream-child", k, str(n), str(p), str(o)]
            )
            for k, n, p, o in (
                ("memory", a.stream_rows, a.passes, outs["memory"]),
                ("subset", a.subset_rows, a.subset_passes, outs["subset"]),
            )
        ]
        codes = [p.wait() for p in procs]
        st = {}
        for o in map(Path, outs.values()):
            if o.exists():
                st.update(json.loads(o.read_text()))
                o.unlink()
        if any(codes):
            st["failed"] = f"child exit codes {codes}"
        report["stream"] = st
    report["load_average_end"] = os.getloadavg()
    Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    render(a.out, quick=a.quick)


def render(path: str, quick: bool = False) -> None:
    """Print the tables (every column explained) and the verdict of a run's JSON, and add the
    ``report`` section for the docs' results page (``scripts/report.py``)."""
    from bench.reporting import Table, fmt, fmt_seconds, verdict_line, write_results

    rep = json.loads(Path(path).read_text())
    rep.pop("report", None)
    tables, words = [], []
    cov = rep.get("covtype")
    if cov:
        c, opt = cov["cvi"], cov["cvi"]["optimum"]
        t = Table(
            f"covtype-sized logistic regression ({cov['rows']:,} x {D}, prior precision {DELTA})",
            [
                ("method", "the inference method (one process, one torch thread)"),
                ("target", "the tolerance below CVI's optimum ELBO that counts as reached"),
                ("s->target", "optimisation seconds until the exact ELBO is within the target"),
                ("best gap", "nats between CVI's optimum and the method's best ELBO"),
                ("rows/s", "data rows processed per second of optimisation"),
                ("memory", "CVI: bytes of its sites (O(N)) and of q (O(D^2)); peak RSS"),
            ],
        )
        t.add(
            "CVI (AutoCVI, step 1)",
            "0.5 nat",
            fmt_seconds(c["time_to_0.5nat"]),
            "0",
            fmt(c["rows_per_s"], ",.0f"),
            f"sites {c['sites_bytes'] / 1e6:.1f} MB, q {c['q_bytes'] / 1e3:.1f} kB, "
            f"RSS {c['peak_rss_mb_after_cvi']:.0f} MB",
        )
        for name, r in cov["adam"].items():
            t.add(
                f"Pyro Adam {name}",
                "5 nat",
                fmt_seconds(r["time_to_5nat"]),
                f"{opt - r['best_elbo']:,.1f}",
                f"{r['rows_per_s']:,.0f}",
                f"{r['steps']} steps of 4096 rows in {r['seconds']:.0f} s",
            )
        t.add(
            "scikit-learn MAP (speed floor)",
            "-",
            f"{cov['sklearn_map_seconds']:.2f} (fit)",
            "-",
            "-",
            f"point estimate; max |w_MAP - m_CVI| = {cov['sklearn_map_vs_cvi_mean']:.1e}",
        )
        elbos, times = c["elbo_per_step"], c["time_per_step"]
        t.plot(
            "seconds",
            "optimum - ELBO (nat)",
            {"CVI": [(x, max(opt - e, 1e-3)) for x, e in zip(times, elbos)]},
            logy=True,
        )
        tables.append(t)
        adam_t = [r["time_to_5nat"] for r in cov["adam"].values()]
        reached = [x for x in adam_t if x is not None]
        words.append(
            verdict_line(
                "CVI (0.5 nat)",
                c["time_to_0.5nat"],
                "Pyro Adam (5 nat, best guide)",
                min(reached) if reached else None,
                budget=rep["args"]["adam_budget"],
            )[len("Verdict: ") : -1]
        )
    par = rep.get("parallel")
    if par:
        t = Table(
            "data-parallel CVI: the same run in 1 and 2 gloo processes",
            [
                ("processes", "gloo ranks, each with its shard of the rows and its sites"),
                ("s->0.5 nat", "seconds until the ELBO is within 0.5 nat of the optimum"),
                ("s total", "seconds of the CVI steps (without process start-up)"),
                ("wall", "seconds with process start-up and data generation"),
                ("rows/s", "rows per second of CVI steps, all ranks together"),
            ],
            text=f"max |m_1 process - m_2 processes| = {par['max_mean_difference']:.1e}",
        )
        for w in ("1", "2"):
            r = par.get(w) or par.get(int(w))
            t.add(
                w,
                fmt_seconds(r["time_to_0.5nat"]),
                fmt(r["seconds"], ".1f"),
                fmt(r["wall_with_startup"], ".1f"),
                fmt(r["rows_per_s"], ",.0f"),
            )
        tables.append(t)
        words.append(
            f"2 processes reached it in {fmt_seconds(par['2']['time_to_0.5nat'])}, "
            f"1 in {fmt_seconds(par['1']['time_to_0.5nat'])} (means equal to "
            f"{par['max_mean_difference']:.0e})"
        )
    st = rep.get("stream")
    if st:
        n = rep["args"]["stream_rows"]
        t = Table(
            "streaming CVI (StreamingCVI, update='batch', chunks of 100k rows from a DataLoader)",
            [
                ("rows", "rows streamed per pass (never all in memory)"),
                ("passes", "passes over the data"),
                ("seconds", "wall seconds of the passes"),
                ("rows/s", "rows per second"),
                ("peak RSS", "the streaming process's peak resident memory (MB)"),
                ("subset gap", "in-memory optimum minus streamed ELBO on the 1M-row subset"),
            ],
        )
        done = st.get("rows_done", n)
        gap = st.get("subset_gap_nats")
        gap_s = "-" if gap is None else f"{gap:.3f} nat ({100 * st['subset_gap_rel']:.4f} %)"
        rss = st.get("peak_rss_mb_streaming", st.get("peak_rss_mb_so_far"))
        secs = st.get("seconds", st.get("seconds_so_far"))
        t.add(
            f"{done:,}" + ("" if "seconds" in st else f" of {n:,} (cut off)"),
            str(rep["args"]["passes"]),
            fmt(secs, ".0f"),
            fmt(None if secs is None else done / secs, ",.0f"),
            fmt(rss, ".0f") + " MB",
            gap_s,
        )
        tables.append(t)
        words.append(
            f"streamed {done:,} rows in {fmt(rss, '.0f')} MB peak RSS, "
            + (
                "gap on the subset not measured"
                if gap is None
                else f"{100 * st['subset_gap_rel']:.4f} % from the in-memory optimum on the subset"
            )
        )
    for t in tables:
        t.print()
    verdict = "Verdict: " + "; ".join(words) + "."
    print(verdict)
    write_results(
        path,
        rep,
        title="Scale: covtype-sized logistic regression, data-parallel and streaming CVI",
        verdict=verdict,
        tables=tables,
        command="python scripts/benchmark_scale.py",
        quick=quick,
        text=f"Device: {rep['device']}. Load average at start {rep['load_average_start']}.",
    )


if __name__ == "__main__":
    main()
