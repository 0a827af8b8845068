"""Shared reporting for the benchmark scripts: tables that explain their columns, "never"
instead of ``None``, warnings for runs that left the target or blew up, a verdict in words,
and a ``report`` section in the JSON that ``scripts/report.py`` turns into the docs' results page.

Usage in a new script (``scripts/benchmark_x.py``)::

    from bench.reporting import Table, progress, verdict_line, write_results

    table = Table(
        "USPS 3-vs-5, hyperparameters fixed",                  # a heading
        [("method", "the inference method"),                    # (column, what it means)
         ("s->tgt", "seconds until -ELBO is within 0.5 nat of the best any method reached")],
    )
    for step in progress(range(n), "Adam lr=0.01"):            # tqdm on stderr
        ...
    table.add("cvi", seconds_or_none)                          # None prints as "never"
    table.note("adam", reached_then_left(history, target))     # remarks under the table
    table.ratio("adam_over_cvi", 12.3, "Adam's time / CVI's")  # explained derived numbers
    table.plot("seconds", "-ELBO - target", {"cvi": [(t, v), ...]}, logy=True)
    table.print()                                              # the table, then its legend
    line = verdict_line("CVI", 0.05, "Adam", None, budget=30.0)
    print(line)       # "Verdict: CVI reached the target in 0.05 s; Adam did not reach it in 30 s."
    write_results(args.out, payload, title="...", verdict=line, tables=[table],
                  command="python scripts/benchmark_x.py", quick=args.quick)

``write_results`` also saves every plot of the tables as a PNG next to the JSON
(``results/benchmark_x-<table>-<plot>.png``) and records how long the run took (wall and CPU
seconds since this module was imported, the machine and its load) in ``report["run"]``.
``scripts/report.py`` renders every ``results/*.json`` that has a ``report`` key (title,
command, verdict, tables with legends and remarks, plots); nothing else needs editing for a
new script to appear on the results page.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

#: Printed for a time or an iteration count to the target that never happened.
NEVER = "never"
#: A final loss this many times the target (in absolute value) is called absurd.
ABSURD_FACTOR = 10.0
#: Lists longer than this (loss traces) are thinned in the written JSON, so that the results
#: that back the README and the docs stay small enough to commit.
MAX_POINTS = 300

#: When the script that imports this module started (to the precision that matters here).
_STARTED = time.perf_counter()


def fmt(x: Any, spec: str = "", missing: str = "-") -> str:
    """``format(x, spec)``, or ``missing`` for ``None`` and NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return missing
    return format(x, spec)


def fmt_reach(x: Any, spec: str = "") -> str:
    """A time or an iteration count to the target: ``"never"`` when it was not reached."""
    return fmt(x, spec, missing=NEVER)


def fmt_seconds(x: Optional[float], spec: str = ".2f") -> str:
    """``"1.23 s"``, or ``"never"`` when the target was not reached."""
    return NEVER if x is None else f"{format(x, spec)} s"


def progress(iterable: Iterable, desc: str, total: Optional[int] = None, **kwargs):
    """A tqdm progress bar on stderr (so the printed tables stay clean)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, leave=False, **kwargs)


def reached_then_left(
    values: Sequence[float], target: float, tol: float = 0.0, higher_is_better: bool = False
) -> Optional[str]:
    """A remark if a curve got within ``tol`` of ``target`` and then ended on the wrong side of
    it (noisy Monte Carlo steps, a learning rate too large); ``None`` otherwise. By default
    lower is better (a -ELBO); pass ``higher_is_better=True`` for a log-likelihood."""
    sign = -1.0 if higher_is_better else 1.0
    finite = [sign * v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return None
    bound = sign * target + tol
    first = next((i for i, v in enumerate(finite) if v <= bound), None)
    if first is None or finite[-1] <= bound:
        return None
    gap = abs(finite[-1] - sign * target)
    side = "below" if higher_is_better else "above"
    return (
        f"reached the target, then left it: ended at {sign * finite[-1]:.4g}, {gap:.3g} {side} "
        "the target (its time to the target counts the first hit)"
    )


def absurd_value(final: Optional[float], target: float, what: str = "-ELBO") -> Optional[str]:
    """A remark if ``final`` is non-finite or far above ``target`` (a diverged run)."""
    if final is None:
        return None
    if not math.isfinite(final):
        return f"ended at a non-finite {what}: the run diverged"
    scale = max(abs(target), 1.0)
    if final - target > (ABSURD_FACTOR - 1.0) * scale:
        return (
            f"ended at {what} {final:.3g}, {final / scale:.0f}x the target {target:.4g}: far "
            "from converged (it diverged, or its learning rate is too small or too large for "
            "this problem and budget); not a fair picture of the method at its best"
        )
    return None


def seconds_phrase(seconds: float) -> str:
    """``0.05 s``, ``12 s``, ``3.1 min``."""
    if seconds < 1:
        return f"{seconds:.2g} s"
    if seconds < 120:
        return f"{seconds:.3g} s"
    return f"{seconds / 60:.2g} min"


def reach_phrase(name: str, seconds: Optional[float], budget: Optional[float] = None) -> str:
    """``"CVI reached the target in 0.05 s"`` or ``"Adam did not reach it in 30 s"``."""
    if seconds is not None:
        return f"{name} reached the target in {seconds_phrase(seconds)}"
    if budget is not None:
        return f"{name} did not reach it in {seconds_phrase(budget)}"
    return f"{name} did not reach it"


def verdict_line(
    name: str,
    seconds: Optional[float],
    other: str,
    other_seconds: Optional[float],
    budget: Optional[float] = None,
    context: str = "",
) -> str:
    """One line in words comparing two methods' times to the same target."""
    parts = [reach_phrase(name, seconds)]
    second = reach_phrase(other, other_seconds, budget)
    if seconds is None and other_seconds is None:
        second = second.replace(" it", " it either")
    parts.append(second)
    text = "; ".join(parts)
    if seconds and other_seconds:
        ratio = other_seconds / seconds
        faster = f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.1f}x slower"
        text += f" ({name} {faster})"
    if context:
        text += f" {context}"
    return f"Verdict: {text}."


class Table:
    """A printed table whose every column is explained underneath, with per-row remarks.

    ``columns`` is a list of ``(name, explanation)``. Cells are strings (format them with
    :func:`fmt` / :func:`fmt_reach`) or numbers (printed with ``str``)."""

    def __init__(self, heading: str, columns: List[Tuple[str, str]], text: str = ""):
        self.heading = heading
        self.columns = list(columns)
        self.text = text
        self.rows: List[List[str]] = []
        self.remarks: List[str] = []
        self.ratios: List[str] = []
        self.plots: List[Dict[str, Any]] = []

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.heading}: {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([c if isinstance(c, str) else str(c) for c in cells])

    def note(self, row: str, remark: Optional[str]) -> None:
        """A remark about one row (``None`` is ignored, so checks can be passed directly)."""
        if remark:
            self.remarks.append(f"{row}: {remark}")

    def ratio(self, name: str, value: Optional[float], meaning: str) -> None:
        """A derived number printed under the table with what it means (skipped if None)."""
        if value is not None and math.isfinite(value):
            self.ratios.append(f"{name} = {value:.3g}: {meaning}")

    def plot(
        self,
        xlabel: str,
        ylabel: str,
        series: Dict[str, Sequence[Sequence[float]]],
        logx: bool = False,
        logy: bool = False,
        title: str = "",
    ) -> None:
        """A line plot for the results page: ``series`` maps a label to ``(x, y)`` points."""
        clean = {
            k: [[float(x), float(y)] for x, y in v if math.isfinite(x) and math.isfinite(y)]
            for k, v in series.items()
        }
        self.plots.append(
            dict(xlabel=xlabel, ylabel=ylabel, series=clean, logx=logx, logy=logy, title=title)
        )

    def render(self) -> str:
        names = [c for c, _ in self.columns]
        widths = [max(len(n), *(len(r[i]) for r in self.rows)) for i, n in enumerate(names)]

        def line(cells: Sequence[str]) -> str:  # first column left-aligned, numbers right
            return "  ".join(
                c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
            )

        head = line(names)
        out = [f"\n{self.heading}"] + ([self.text] if self.text else [])
        out += [head, "-" * len(head)] + [line(r) for r in self.rows]
        pad = max(len(n) for n in names)
        out += ["columns:"] + [f"  {n:<{pad}}  {e}" for n, e in self.columns]
        if self.ratios:
            out += ["ratios:"] + [f"  {r}" for r in self.ratios]
        if self.remarks:
            out += ["remarks:"] + [f"  ! {r}" for r in self.remarks]
        return "\n".join(out)

    def print(self) -> None:
        print(self.render(), flush=True)

    def as_dict(self) -> Dict[str, Any]:
        return {
            "heading": self.heading,
            "text": self.text,
            "columns": [c for c, _ in self.columns],
            "legend": {c: e for c, e in self.columns},
            "rows": self.rows,
            "remarks": self.remarks,
            "ratios": self.ratios,
            "plots": self.plots,
        }


def thin(obj: Any, max_points: int = MAX_POINTS) -> Any:
    """``obj`` with every list longer than ``max_points`` cut to about ``max_points`` items:
    half evenly spaced, half log-spaced in the index (the start of a loss trace is where it
    moves), always keeping the first and the last item. Floats keep 6 significant digits."""
    if isinstance(obj, dict):
        return {k: thin(v, max_points) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        n = len(obj)
        if n > max_points:
            half = max_points // 2
            idx = {round(i * (n - 1) / (half - 1)) for i in range(half)}
            idx |= {
                min(n - 1, round(math.exp(i * math.log(n) / (half - 1))) - 1) for i in range(half)
            }
            obj = [obj[i] for i in sorted(idx)]
        return [thin(v, max_points) for v in obj]
    if isinstance(obj, float) and math.isfinite(obj):
        return float(f"{obj:.6g}")
    return obj


def _process_age() -> Optional[float]:
    """Wall seconds since this process started (Linux ``/proc``); ``None`` elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def run_info() -> Dict[str, Any]:
    """How long this process has run (wall seconds since it started, or since this module was
    imported where ``/proc`` is missing; CPU seconds of the process and its finished children)
    and on what: recorded in every report, so that the durations in the README's "How long
    things take" table come from real runs."""
    t = os.times()
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    age = _process_age()
    return {
        "wall_seconds": round(age if age is not None else time.perf_counter() - _STARTED, 1),
        "cpu_seconds": round(t.user + t.system + t.children_user + t.children_system, 1),
        "cpu_count": os.cpu_count(),
        "load_average": load,
        "machine": platform.platform(),
    }


def plot_file(stem: str, table: int, plot: int) -> str:
    """The file name of plot ``plot`` of table ``table`` of ``<stem>.json``."""
    return f"{stem}-{table}-{plot}.png"


def save_plot(spec: Dict[str, Any], path: Path) -> Path:
    """Draw one plot spec (:meth:`Table.plot`) into a PNG at ``path``. Uses matplotlib's
    object-oriented API only (no ``pyplot``), so it changes no global backend or figure."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.6))
    ax = fig.subplots()
    for label, points in spec["series"].items():
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=label)
    if spec.get("logx"):
        ax.set_xscale("log")
    if spec.get("logy"):
        ax.set_yscale("log")
    ax.set_xlabel(spec["xlabel"])
    ax.set_ylabel(spec["ylabel"])
    if spec.get("title"):
        ax.set_title(spec["title"], fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def save_plots(json_path: Path, tables: Sequence[Dict[str, Any]]) -> List[Path]:
    """Every plot of ``tables`` (``Table.as_dict()`` form) as a PNG next to ``json_path``; none
    (with a note) when matplotlib is not installed."""
    specs = [(t, p, spec) for t, tab in enumerate(tables) for p, spec in enumerate(tab["plots"])]
    if not specs:
        return []
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"no plots next to {json_path}: matplotlib is not installed", file=sys.stderr)
        return []
    return [save_plot(s, json_path.with_name(plot_file(json_path.stem, t, p))) for t, p, s in specs]


def quick_path(path: str, quick: bool) -> Path:
    """A ``--quick`` run never overwrites a committed full result: ``results/x.json`` becomes
    ``results/quick/x.json`` (git-ignored); any other path is kept."""
    out = Path(path)
    if quick and out.parent.name == "results":
        return out.parent / "quick" / out.name
    return out


def write_results(
    path: str,
    payload: Dict[str, Any],
    *,
    title: str,
    verdict: str,
    tables: Sequence[Table] = (),
    command: str = "",
    quick: bool = False,
    text: str = "",
) -> Path:
    """Write ``payload`` as JSON with a ``report`` section for ``scripts/report.py``, and the
    tables' plots as PNG files next to it (:func:`save_plots`)."""
    report = {
        "title": title,
        "command": command,
        "verdict": verdict,
        "quick": quick,
        "text": text,
        "tables": [t.as_dict() for t in tables],
        "run": run_info(),
    }
    out = quick_path(path, quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = thin({**payload, "report": report})
    out.write_text(json.dumps(data, separators=(",", ":"), default=float) + "\n")
    print(f"wrote {out}")
    for png in save_plots(out, data["report"]["tables"]):
        print(f"wrote {png}")
    return out
