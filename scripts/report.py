"""Regenerate the docs' results page from the benchmark JSON files.

Reads every ``results/*.json`` (``--results``) and writes ``docs/_generated/results.md`` with
one section per file and PNG plots beside it (``--out``). A file written through
:func:`bench.reporting.write_results` has a ``report`` section (title, command, verdict,
tables with a legend for every column, remarks, plots) and is rendered in full; any other JSON
file gets a title from the docstring of the script that wrote it and its numbers as tables, so
a new script shows up without editing this one.
The Sphinx build runs this script itself (``docs/conf.py``).

    python scripts/report.py [--results results] [--out docs/_generated]
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # also when imported from elsewhere (the tests)

from bench.reporting import plot_file, save_plot  # noqa: E402  (the plots next to the JSON)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "plot"


QUICK_NOTE = "These numbers are from a `--quick` run (small settings)."


def _duration(seconds: float) -> str:
    """``42 s``, ``3.5 min``, ``1.2 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _escape(cell: str) -> str:
    return str(cell).replace("|", "\\|")


def _markdown_table(columns: List[str], rows: List[List[str]]) -> List[str]:
    out = ["| " + " | ".join(_escape(c) for c in columns) + " |"]
    out.append("|" + "---|" * len(columns))
    out += ["| " + " | ".join(_escape(c) for c in r) + " |" for r in rows]
    return out


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool)) and len(str(v)) < 80


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _record_groups(data: Any, prefix: str = "") -> List[Tuple[str, Dict[str, Any]]]:
    """Every dict whose values are all dicts with scalar entries (``runs``, ``methods``, ...):
    each becomes a table, one row per entry."""
    found = []
    if not isinstance(data, dict):
        return found
    subs = [v for v in data.values() if isinstance(v, dict)]
    if (
        len(subs) >= 2
        and len(subs) == len(data)
        and all(sum(_is_scalar(x) for x in v.values()) >= 2 for v in subs)
    ):
        return [(prefix.rstrip("."), data)]
    for k, v in data.items():
        found += _record_groups(v, f"{prefix}{k}.")
    return found


def _scalars(data: Dict[str, Any], prefix: str = "", depth: int = 0) -> List[List[str]]:
    rows = []
    for k, v in data.items():
        name = f"{prefix}{k}"
        if _is_scalar(v):
            rows.append([name, _cell(v)])
        elif isinstance(v, dict) and depth < 2 and _record_groups(v) != [("", v)]:
            rows += _scalars(v, name + ".", depth + 1)
    return rows[:40]


def _script_for(stem: str) -> Optional[Path]:
    """The script that wrote ``results/<stem>.json`` (``benchmark_x_A`` -> ``benchmark_x.py``)."""
    names = sorted((p.stem for p in (ROOT / "scripts").glob("*.py")), key=len, reverse=True)
    for name in names:
        if stem == name or stem.startswith(name + "_"):
            return ROOT / "scripts" / f"{name}.py"
    return None


def _markdown(rst: str) -> str:
    """Docstring text for a Markdown page: roles and double backquotes as code."""
    text = re.sub(r":\w+:`~?(?:[\w.]+\.)?([^`<]+?)`", r"`\1`", rst)
    return text.replace("``", "`")


def _untitled(path: Path) -> Tuple[str, List[str]]:
    """A title and an introduction for a JSON file without a ``report``: the first line of the
    docstring of the script that wrote it, and for a part file (``<script>_<part>.json``) the
    paragraph of that docstring that begins "Part <part>"."""
    script = _script_for(path.stem)
    if script is None:
        return path.stem, []
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    head = doc.split("\n")[0].strip().rstrip(".")
    title, intro = head.split(":")[0] or path.stem, []
    part = path.stem[len(script.stem) + 1 :]
    if part:
        title += f", part {part}"
        for para in doc.split("\n\n"):
            flat = " ".join(para.split())
            if flat.startswith(f"Part {part},") or flat.startswith(f"Part {part}:"):
                what = re.split(r":(?![^(]*\))", flat[len(f"Part {part}") + 1 :])[0].strip()
                if len(what) > 60:
                    what = re.split(r", |``| \(", what)[0]
                title += f": {_markdown(what).strip()}"
                intro = [_markdown(flat), ""]
                break
    intro += [f"Written by `python scripts/{script.name}` (`{path.name}`, no report section).", ""]
    return title, intro


def _fallback(path: Path, data: Dict[str, Any]) -> List[str]:
    """A section for a JSON file without a ``report``: a title, and its numbers as tables."""
    title, intro = _untitled(path)
    lines = [f"## {title}", ""] + intro
    if data.get("quick"):
        lines += ["```{note}", QUICK_NOTE, "```", ""]
    scalars = [r for r in _scalars(data) if r[0] != "quick"]
    if scalars:
        lines += _markdown_table(["key", "value"], scalars) + [""]
    for name, group in _record_groups(data)[:6]:
        columns: List[str] = []
        for entry in group.values():
            columns += [k for k, v in entry.items() if _is_scalar(v) and k not in columns]
        columns = columns[:10]
        rows = [[k] + [_cell(e.get(c, "")) for c in columns] for k, e in group.items()]
        lines += [f"### {name}", ""] + _markdown_table([name.split(".")[-1]] + columns, rows)
        lines += [""]
    return lines


def render_file(path: Path, img_dir: Path, rel: str) -> List[str]:
    data = json.loads(path.read_text())
    rep = data.get("report")
    if not isinstance(rep, dict):
        return _fallback(path, data)
    lines = [f"## {rep.get('title') or path.stem}", ""]
    if rep.get("quick"):
        lines += ["```{note}", QUICK_NOTE, "```", ""]
    if rep.get("verdict"):
        lines += [f"**{rep['verdict']}**", ""]
    if rep.get("command"):
        lines += [f"Reproduce: `{rep['command']}` (writes `{path.name}`).", ""]
    run = rep.get("run")
    if isinstance(run, dict) and run.get("wall_seconds") is not None:
        load = run.get("load_average")
        on = f"{run.get('cpu_count')} CPUs" + (f", load {load[0]:.1f} at the end" if load else "")
        lines += [
            f"This run took {_duration(run['wall_seconds'])} "
            f"({_duration(run.get('cpu_seconds') or 0)} of CPU; {on}).",
            "",
        ]
    if rep.get("text"):
        lines += [rep["text"], ""]
    for t, table in enumerate(rep.get("tables", [])):
        lines += [f"### {table['heading']}", ""]
        if table.get("text"):
            lines += [table["text"], ""]
        lines += _markdown_table(table["columns"], table["rows"]) + [""]
        legend = table.get("legend", {})
        if legend:
            lines += ["Columns:", ""]
            lines += [f"- **{_escape(c)}**: {e}" for c, e in legend.items()] + [""]
        if table.get("ratios"):
            lines += ["Ratios:", ""] + [f"- {r}" for r in table["ratios"]] + [""]
        if table.get("remarks"):
            lines += ["Remarks:", ""] + [f"- {r}" for r in table["remarks"]] + [""]
        for p, spec in enumerate(table.get("plots", [])):
            name = plot_file(_slug(path.stem), t, p)
            save_plot(spec, img_dir / name)
            alt = spec.get("title") or f"{spec['ylabel']} against {spec['xlabel']}"
            lines += [f"![{_escape(alt)}]({rel}/{name})", ""]
    return lines


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "results"), help="folder of JSON files")
    ap.add_argument("--out", default=str(ROOT / "docs" / "_generated"), help="output folder")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    img = out / "results"
    img.mkdir(parents=True, exist_ok=True)
    for old in img.glob("*.png"):
        old.unlink()
    files = sorted(Path(args.results).glob("*.json"))
    lines = [
        "# Results",
        "",
        "Generated by `scripts/report.py` from the JSON files in `results/`, which the",
        "benchmark scripts write (`python scripts/<name>.py`, or `--quick` for a smoke run).",
        "Times are wall-clock seconds on the machine that ran the script, with CVI and its",
        "baselines run back to back in one process; the target of a comparison is the best",
        "-ELBO any method reached, and a method reaches it when it gets within the stated",
        "tolerance.",
        "",
    ]
    if not files:
        lines += ["No results yet: run a benchmark script, then `python scripts/report.py`.", ""]
    for f in files:
        lines += render_file(f, img, "results")
    page = out / "results.md"
    page.write_text("\n".join(lines))
    if not args.quiet:
        print(f"wrote {page} ({len(files)} result files)")
    return page


if __name__ == "__main__":
    main()
