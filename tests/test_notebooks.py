"""Every tutorial is committed executed: the docs site renders the stored outputs
(``nb_execution_mode = "off"`` in ``docs/conf.py``), so a notebook saved without them would
appear on the site with no numbers and no plots."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb"))


def test_there_are_tutorials():
    assert len(NOTEBOOKS) >= 6


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_has_stored_outputs(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    unexecuted = [i for i, c in enumerate(code) if c.get("execution_count") is None]
    assert not unexecuted, (
        f"{path.name}: code cells {unexecuted} were never executed; execute the notebook in "
        "place (see CONTRIBUTING.md) and commit it with its outputs"
    )
    outputs = [o for c in code for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: stored outputs contain an error: {errors[0].get('ename')}"
    source = "".join("".join(c["source"]) for c in code)
    if "matplotlib" in source or "plt." in source:
        images = [o for o in outputs if "image/png" in o.get("data", {})]
        assert images, (
            f"{path.name} plots with matplotlib but stores no image: it was executed with a "
            "non-interactive backend (unset MPLBACKEND) or without running the plotting cells"
        )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_outputs_carry_no_warnings(path):
    """The docs render the stored outputs: a warning there (e.g. tqdm's ``TqdmWarning: IProgress
    not found``, which ``import pyro`` prints in a kernel without ipywidgets) is noise on the
    site. Execute with the ``tutorials`` extra installed (it brings ipywidgets), or fix the
    cause of the warning in the library."""
    nb = json.loads(path.read_text())
    for i, cell in enumerate(c for c in nb["cells"] if c["cell_type"] == "code"):
        for out in cell.get("outputs", []):
            assert out.get("name") != "stderr", (
                f"{path.name}, code cell {i}: a stored stderr output (a warning or a progress "
                f"bar), which the docs would show: {''.join(out.get('text', ''))[:200]!r}"
            )
            text = "".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", ""))
            found = re.search(r"\b[A-Z]\w*Warning: .*", text)
            assert not found, f"{path.name}, code cell {i}: a stored warning: {found.group(0)!r}"
