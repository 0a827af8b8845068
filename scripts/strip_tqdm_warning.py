"""Remove tqdm's "IProgress not found" warning from the stored outputs of notebooks.

``import pyro`` imports ``tqdm.auto``, which prints ``TqdmWarning: IProgress not found`` to
stderr in a Jupyter kernel without ipywidgets; executed that way, a tutorial stores the warning
and the docs would show it (``tests/test_notebooks.py`` fails on it). Execute with the
``tutorials`` extra installed (it brings ipywidgets), or strip that one output afterwards:

    python scripts/strip_tqdm_warning.py tutorials/*.ipynb

Only stderr outputs that consist of this warning are removed; any other output stays.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List

import nbformat

MARK = "TqdmWarning: IProgress not found"


def strip(path: Path) -> int:
    """Remove the warning's outputs from the notebook at ``path``; the number removed."""
    nb = nbformat.read(path, as_version=4)
    removed = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        keep = []
        for out in cell.get("outputs", []):
            text = out.get("text", "") if out.get("name") == "stderr" else ""
            lines = [line for line in text.splitlines() if line.strip()]
            if lines and MARK in lines[0] and len(lines) <= 2:  # the warning and its source line
                removed += 1
            else:
                keep.append(out)
        cell.outputs = keep
    if removed:
        nbformat.write(nb, path)
    return removed


def main(argv: List[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for name in argv:
        n = strip(Path(name))
        if n:
            print(f"{name}: removed {n} stored TqdmWarning output(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
