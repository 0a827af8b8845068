"""Sphinx configuration for the pyro-cvi documentation.

Build (warnings are errors, as in CI)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

At build time this file (1) writes one API page per module of ``pyro_cvi`` into
``docs/api/`` (git-ignored), so new modules appear without edits, and (2) runs
``scripts/report.py`` to turn every ``results/*.json`` into ``docs/_generated/results.md``
with its plots. Tutorials are the notebooks under ``tutorials/`` (``docs/tutorials`` is a
symlink), rendered with their stored outputs: nothing is executed here.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))

import pyro_cvi  # noqa: E402

project = "pyro-cvi"
author = "the pyro-cvi authors"
copyright = "2026, the pyro-cvi authors"
release = version = pyro_cvi.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3
nb_execution_mode = "off"  # notebooks are committed executed; tests/test_notebooks.py checks it
nb_merge_streams = True
# Notebooks and the pre-existing pages use their own heading levels; docstrings use
# ``z``-style double-backquote literals that can look like references to nothing.
suppress_warnings = ["myst.header", "misc.highlighting_failure", "mystnb.unknown_mime_type"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = True

html_theme = "furo"
html_title = f"pyro-cvi {release}"
html_static_path: list = []


def _public_modules() -> list:
    """Every importable module of ``pyro_cvi`` except private ones (``_x``)."""
    names = ["pyro_cvi"]
    for info in pkgutil.walk_packages(pyro_cvi.__path__, "pyro_cvi."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:  # an optional dependency (e.g. gpytorch) is missing
            continue
        names.append(info.name)
    return sorted(names)


def _write_api_pages() -> None:
    """One page per module; packages show their docstring only (their members are
    documented on the page of the module that defines them, so nothing appears twice)."""
    out = DOCS / "api"
    out.mkdir(exist_ok=True)
    for old in out.glob("*.rst"):
        old.unlink()
    modules = _public_modules()
    for name in modules:
        mod = importlib.import_module(name)
        is_pkg = hasattr(mod, "__path__")
        title = f"``{name}``"
        body = [title, "=" * len(title), "", f".. automodule:: {name}"]
        if is_pkg:
            body += ["   :no-members:", ""]
        else:
            body += [""]
        (out / f"{name}.rst").write_text("\n".join(body) + "\n")
    lines = [
        "API reference",
        "=============",
        "",
        "The user-facing classes are :class:`pyro_cvi.autoguide.AutoCVI`,",
        ":class:`pyro_cvi.optim.CVI` and :class:`pyro_cvi.elbo.CVI_ELBO` (all three importable",
        "from ``pyro_cvi``), and the GPyTorch adapter :mod:`pyro_cvi.contrib.gpytorch`.",
        "Every other module is documented below; the equation numbers refer to",
        "Khan & Lin (2017).",
        "",
        ".. toctree::",
        "   :maxdepth: 1",
        "",
    ]
    lines += [f"   {name}" for name in modules]
    (out / "index.rst").write_text("\n".join(lines) + "\n")


def _write_results_page() -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "report.py"), "--quiet"],
        check=True,
        cwd=ROOT,
        env={**os.environ, "MPLBACKEND": "Agg"},
    )


_write_api_pages()
_write_results_page()
