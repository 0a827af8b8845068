"""Sphinx configuration for the pyro-cvi documentation.

Build (warnings are errors, as in CI)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

At build time this file (1) writes one API page per module of ``pyro_cvi`` into
``docs/api/`` (git-ignored), so new modules appear without edits: the public ones under "API
reference", every other one under "Internals"; and (2) runs
``scripts/report.py`` to turn every ``results/*.json`` into ``docs/_generated/results.md``
with its plots. Tutorials are the notebooks under ``tutorials/`` (``docs/tutorials`` is a
symlink), rendered with their stored outputs: nothing is executed here.

Maths is rendered by a MathJax copied into the site from the ``sphinx-mathjax-offline`` package
(the ``docs`` extra), so the site needs no network. ``scripts/check_docs.py`` checks the built
site: every page it promises, no warning text in any rendered output, no broken internal link or
anchor, no script loaded from another host.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pkgutil
import shutil
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
exclude_patterns = ["_build", "_generated/static", "**.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3
nb_execution_mode = "off"  # notebooks are committed executed; tests/test_notebooks.py checks it
nb_merge_streams = True
# Notebooks and the pre-existing pages use their own heading levels; docstrings use
# ``z``-style double-backquote literals that can look like references to nothing.
suppress_warnings = ["myst.header", "misc.highlighting_failure", "mystnb.unknown_mime_type"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
# ``members`` is given per page (docs/api/*.rst, written below): a default ``members: True``
# would override the explicit member lists that keep re-exported objects off a page.
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = True

html_theme = "furo"
html_title = f"pyro-cvi {release}"


#: What ``tex-chtml.js`` loads (its fonts, TeX extensions on demand, the menu and the
#: accessibility tools); the package's other combined bundles (SVG output etc.) are left out.
MATHJAX_PARTS = ["tex-chtml.js", "output", "input", "ui", "a11y", "adaptors", "sre"]


STATIC = DOCS / "_generated" / "static"  # git-ignored; holds mathjax/


def _copy_mathjax() -> None:
    """The MathJax 3 files that ``sphinx-mathjax-offline`` ships (``MATHJAX_PARTS`` of them),
    copied into ``STATIC/mathjax`` and from there into the site's ``_static`` by
    ``html_static_path``."""
    spec = importlib.util.find_spec("sphinx-mathjax-offline")  # its import name has dashes
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the docs render maths with a bundled MathJax: pip install -e '.[docs]' "
            "(it brings sphinx-mathjax-offline)"
        )
    source = Path(list(spec.submodule_search_locations)[0]) / "static" / "mathjax"
    target = STATIC / "mathjax"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for part in MATHJAX_PARTS:
        if (source / part).is_dir():
            shutil.copytree(source / part, target / part)
        else:
            shutil.copy2(source / part, target / part)


html_static_path = [str(STATIC)]
mathjax_path = "mathjax/tex-chtml.js"  # relative to _static: no CDN, the site works offline


#: The public API: these packages (their docstring and a table of what they export) and the
#: modules that define what their ``__all__`` exports. ``PUBLIC_MODULES`` adds whole modules
#: that users call directly. Every other module is listed on the "Internals" page.
PUBLIC_PACKAGES = [
    "pyro_cvi",
    "pyro_cvi.scale",
    "pyro_cvi.checkpoints",
    "pyro_cvi.methods",
    "pyro_cvi.statespace",
    "pyro_cvi.contrib",
    "pyro_cvi.contrib.gpytorch",
]
PUBLIC_MODULES = [
    "pyro_cvi.methods.bound_check",
    "pyro_cvi.methods.restarts",
    "pyro_cvi.contrib.pyro_gp",
    "pyro_cvi.checkpoints.checkpoint",
    "pyro_cvi.scale.distributed",
    "pyro_cvi.scale.streaming",
]


def _all_modules() -> list:
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


def _is_package(name: str) -> bool:
    return hasattr(importlib.import_module(name), "__path__")


def _home(obj) -> str:
    """The module that defines ``obj`` (a module is its own home)."""
    if inspect.ismodule(obj):
        return obj.__name__
    return getattr(obj, "__module__", None) or ""


def _public_split(modules: list) -> tuple:
    """``(public, internal)`` module names: see ``PUBLIC_PACKAGES`` and ``PUBLIC_MODULES``."""
    public = set(PUBLIC_PACKAGES) | set(PUBLIC_MODULES)
    missing = sorted(public - set(modules))
    if missing:  # a module moved or was renamed: say so instead of dropping its page
        raise RuntimeError(
            f"docs/conf.py names public modules that do not exist or do not import: {missing} "
            "(moved? update PUBLIC_PACKAGES / PUBLIC_MODULES; missing gpytorch? pip install "
            "-e '.[docs]')"
        )
    for pkg in PUBLIC_PACKAGES:
        mod = importlib.import_module(pkg)
        for name in getattr(mod, "__all__", []):
            home = _home(getattr(mod, name))
            if home.startswith("pyro_cvi.") and home in modules:
                public.add(home)
    return sorted(public), [m for m in modules if m not in public]


def _summary(obj) -> str:
    """The first paragraph of ``obj``'s docstring, on one line."""
    doc = inspect.getdoc(obj) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    return text.rstrip(":") + "." if text.endswith(":") else text  # no block follows here


def _own_members(mod) -> list:
    """The names of ``mod.__all__`` that ``mod`` defines itself: a name re-exported from
    another ``pyro_cvi`` module is documented there only (one page per object, so that the
    "source" links of ``viewcode`` and every cross-reference land on an existing anchor)."""
    own = []
    for name in getattr(mod, "__all__", []):
        home = _home(getattr(mod, name))
        if not (home.startswith("pyro_cvi") and home != mod.__name__):
            own.append(name)
    return own


def _table(title: str, rows: list) -> list:
    if not rows:
        return []
    out = [f".. list-table:: {title}", "   :widths: 30 70", ""]
    for ref, text in rows:
        out += [f"   * - {ref}", f"     - {text or ' '}"]
    return out + [""]


def _package_page(name: str, modules: list) -> list:
    """A package: its docstring, a table of what it exports (linked to where each object is
    documented) and a table of its sub-modules."""
    mod = importlib.import_module(name)
    body = [f".. automodule:: {name}", "   :no-members:", ""]
    exported = []
    for attr in getattr(mod, "__all__", []):
        obj = getattr(mod, attr)
        if inspect.ismodule(obj):
            exported.append((f":py:mod:`{attr} <{obj.__name__}>`", _summary(obj)))
        else:
            target = f"{_home(obj)}.{getattr(obj, '__qualname__', attr)}"
            exported.append((f":py:obj:`{attr} <{target}>`", _summary(obj)))
    body += _table(f"Exported by ``{name}``", exported)
    children = [m for m in modules if m != name and m.rsplit(".", 1)[0] == name]
    subs = [(f":py:mod:`{m}`", _summary(importlib.import_module(m))) for m in children]
    body += _table("Modules", subs)
    return body


def _module_page(name: str) -> list:
    mod = importlib.import_module(name)
    body = [f".. automodule:: {name}"]
    if not hasattr(mod, "__all__"):
        body += ["   :members:"]  # autodoc skips imported objects by their __module__
    elif _own_members(mod):
        body += [f"   :members: {', '.join(_own_members(mod))}"]
    return body + [""]


def _write_api_pages() -> None:
    """One page per module, in two sections: the public API (``api/index``) and the internals
    (``api/internals``). Each object is documented on the page of the module that defines it."""
    out = DOCS / "api"
    out.mkdir(exist_ok=True)
    for old in out.glob("*.rst"):
        old.unlink()
    modules = _all_modules()
    public, internal = _public_split(modules)
    for name in modules:
        title = f"``{name}``"
        head = [title, "=" * len(title), ""]
        # a public package lists its public sub-modules, an internal one all of its own
        listed = public if name in public else modules
        page = _package_page(name, listed) if _is_package(name) else _module_page(name)
        (out / f"{name}.rst").write_text("\n".join(head + page) + "\n")
    index = [
        "API reference",
        "=============",
        "",
        "The user-facing classes are :class:`~pyro_cvi.autoguide.AutoCVI`,",
        ":class:`~pyro_cvi.optim.CVI` and :class:`~pyro_cvi.elbo.CVI_ELBO` (all three importable",
        "from ``pyro_cvi``), and the GPyTorch adapter :mod:`pyro_cvi.contrib.gpytorch`. The",
        "equation numbers refer to Khan & Lin (2017). The modules that implement the pipeline",
        "are on the :doc:`internals` page.",
        "",
        ".. toctree::",
        "   :maxdepth: 1",
        "",
    ]
    (out / "index.rst").write_text("\n".join(index + [f"   {m}" for m in public]) + "\n")
    internals = [
        "Internals",
        "=========",
        "",
        "The modules behind the public API: tracing and analysing the model, the messages, the",
        "blocks, the exponential families and the update (:doc:`../architecture` says how they fit",
        "together). They are documented for contributors; their names and signatures may change",
        "between releases without notice.",
        "",
        ".. toctree::",
        "   :maxdepth: 1",
        "",
    ]
    (out / "internals.rst").write_text("\n".join(internals + [f"   {m}" for m in internal]) + "\n")


def _write_results_page() -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "report.py"), "--quiet"],
        check=True,
        cwd=ROOT,
        env={**os.environ, "MPLBACKEND": "Agg"},
    )


def setup(app) -> None:
    """Sphinx calls this before reading the sources: generate what the site is built from
    (importing this file has no side effects, so the tests can check the functions above)."""
    _copy_mathjax()
    _write_api_pages()
    _write_results_page()
