"""The README's ``python`` code blocks run as pasted, and the output it shows is the output
they print (the ``explain()`` table and the converged -ELBO)."""

import contextlib
import io
import re
from pathlib import Path

import pyro
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(language: str):
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.M | re.S)


def test_readme_has_python_blocks():
    assert _blocks("python"), "README.md lost its Usage snippet"


@pytest.fixture
def readme_output():
    pytest.importorskip("sklearn")
    pyro.clear_param_store()
    out = io.StringIO()
    namespace = {"__name__": "__readme__"}
    with contextlib.redirect_stdout(out):
        for code in _blocks("python"):
            exec(compile(code, str(README), "exec"), namespace)  # noqa: S102
    pyro.clear_param_store()
    return out.getvalue()


def test_readme_blocks_run_and_match_the_shown_output(readme_output):
    shown = _blocks("text")
    assert shown, "README.md shows no output of its Usage snippet"
    printed = [" ".join(line.split()) for line in readme_output.splitlines()]
    for line in shown[0].splitlines():
        if line.strip() and line.strip() != "...":
            want = " ".join(line.split())
            assert want in printed, f"README shows {line!r}, which the snippet does not print"


def test_readme_results_rows_are_measured():
    """Every row of the results table is a measurement: no placeholder, and the script it cites
    exists (rows for later work are added with their numbers, not before)."""
    section = README.read_text().split("\n## Results\n")[1].split("\n## ")[0]
    visible = re.sub(r"<!--.*?-->", "", section, flags=re.S)
    rows = [line for line in visible.splitlines() if line.startswith("|")][2:]
    assert len(rows) >= 4, "the README's results table lost its rows"
    for row in rows:
        assert not re.search(r"pending|TODO|TBD|\.\.\. \|", row), f"placeholder row: {row}"
        for script in re.findall(r"scripts/([\w]+\.py)", row):
            assert (README.parent / "scripts" / script).exists(), f"{row} cites a missing script"
    assert not re.search(r"^[A-Z_]+_ROWS$", visible, re.M), "an unfilled row marker"
