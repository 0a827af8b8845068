"""Every benchmark script in ``scripts/`` keeps the promises of the README's Benchmarks section:
a ``--quick`` flag (a smoke run under 2 minutes), a one-line verdict in words, and JSON written
to a path given by ``--out``. (Their run times are checked by running them, not here: no timing
assertions in unit tests.)"""

import re
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
#: Tools, not benchmarks.
NOT_BENCHMARKS = {
    "report.py",
    "smoke_test.py",
    "check_docs.py",
    "demo.py",
    "strip_tqdm_warning.py",
    "make_nuts_references.py",  # writes the reference posteriors of tests/zoo
    "run_gpytorch_examples.py",  # runs GPyTorch's example tests with the strategy swapped
    "count_markov_step_instructions.py",  # prints callgrind's count; writes no JSON
}
BENCHMARKS = sorted(p for p in SCRIPTS.glob("*.py") if p.name not in NOT_BENCHMARKS)


def test_there_are_benchmark_scripts():
    assert len(BENCHMARKS) >= 5


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_script_has_quick_verdict_and_out(path):
    source = path.read_text()
    assert '"--quick"' in source, f"{path.name} has no --quick flag"
    assert '"--out"' in source, f"{path.name} does not take --out for its JSON"
    assert re.search(r"verdict", source, re.I), f"{path.name} prints no verdict line"
    assert "print(None" not in source, f"{path.name} prints None where 'never' is meant"


def test_the_results_page_renders_every_committed_json(tmp_path):
    """``scripts/report.py`` (the docs' results page) reads every file in ``results/``, a
    list of records included (``check_resume.json``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("report", SCRIPTS / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    for path in sorted((SCRIPTS.parent / "results").glob("*.json")):
        lines = report.render_file(path, tmp_path, "results")
        assert lines and lines[0].startswith("## "), path.name


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_a_quick_run_never_overwrites_the_committed_results(path):
    """``--quick`` writes under ``results/quick/`` (git-ignored): through ``write_results`` or
    ``quick_path`` of ``scripts/bench/reporting.py``, or a default of its own there."""
    source = path.read_text()
    if re.search(r'"--out",[^)]*default=None', source) or '"--out", help=' in source:
        return  # writes JSON only where it is told to
    assert any(k in source for k in ("write_results(", "quick_path(", "results/quick")), path.name


def test_quick_path_redirects_only_results_files():
    from bench.reporting import quick_path

    assert (
        quick_path("results/benchmark_x.json", True).as_posix() == "results/quick/benchmark_x.json"
    )
    assert quick_path("results/benchmark_x.json", False).as_posix() == "results/benchmark_x.json"
    assert quick_path("/tmp/mine.json", True).as_posix() == "/tmp/mine.json"
