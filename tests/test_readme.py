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


def _distributed_block() -> str:
    (code,) = [b for b in _blocks("python") if "torchrun" in b]
    return code


def _run_script(tmp_path, *launcher):
    import os
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(_distributed_block())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    root = str(README.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, *launcher, str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    # each rank's result, also when two ranks' prints share a line of the captured stdout
    return re.findall(r"-ELBO [^,]+, posterior mean \[[^\]]*\]", out.stdout)


def test_readme_distributed_example_runs_as_pasted_in_one_process(tmp_path):
    (line,) = _run_script(tmp_path)
    assert re.match(r"-ELBO \d+\.\d{4}, posterior mean \[", line)


@pytest.mark.slow
def test_readme_distributed_example_runs_as_pasted_under_torchrun(tmp_path):
    """Two ranks print the one-process result (the exact full-batch step on every rank)."""
    (single,) = _run_script(tmp_path)
    lines = _run_script(
        tmp_path, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"
    )
    assert len(lines) == 2
    for line in lines:
        loss, mean = line.split(", posterior mean ")
        loss1, mean1 = single.split(", posterior mean ")
        assert abs(float(loss.split()[1]) - float(loss1.split()[1])) < 1e-6
        assert mean == mean1
