"""Check a built documentation site for what the project promises it contains (CI runs this
after ``sphinx -W``, so a page that silently disappears fails the build):

* the API reference of ``AutoCVI``, ``CVI``, ``CVI_ELBO`` and ``pyro_cvi.contrib.gpytorch``
  (its strategy and its optimizer);
* one page per notebook in ``tutorials/``, with at least one plot (an ``<img>``) on it;
* the results page, with a section for every ``results/*.json`` that has a ``report``.

    python scripts/check_docs.py [docs/_build/html]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]

#: (page under api/, HTML anchor that autodoc writes for the documented object)
API = [
    ("pyro_cvi.autoguide.html", 'id="pyro_cvi.autoguide.AutoCVI"'),
    ("pyro_cvi.optim.html", 'id="pyro_cvi.optim.CVI"'),
    ("pyro_cvi.elbo.html", 'id="pyro_cvi.elbo.CVI_ELBO"'),
    ("pyro_cvi.contrib.gpytorch.html", 'id="module-pyro_cvi.contrib.gpytorch"'),
    (
        "pyro_cvi.contrib.gpytorch.strategy.html",
        'id="pyro_cvi.contrib.gpytorch.strategy.CVIVariationalStrategy"',
    ),
    ("pyro_cvi.contrib.gpytorch.optim.html", 'id="pyro_cvi.contrib.gpytorch.optim.CVIOptimizer"'),
]


def problems(site: Path) -> List[str]:
    """Everything missing from the built site at ``site`` (empty when it is complete)."""
    found: List[str] = []

    def page(rel: str) -> str:
        path = site / rel
        if not path.exists():
            found.append(f"{rel}: page missing")
            return ""
        return path.read_text(encoding="utf-8")

    for rel, anchor in API:
        text = page(f"api/{rel}")
        if text and anchor not in text:
            found.append(f"api/{rel}: no {anchor}")
    for nb in sorted((ROOT / "tutorials").glob("*.ipynb")):
        text = page(f"tutorials/{nb.stem}.html")
        if text and "<img" not in text:
            found.append(f"tutorials/{nb.stem}.html: no plot")
    results = page("_generated/results.html")
    for js in sorted((ROOT / "results").glob("*.json")):
        report = json.loads(js.read_text()).get("report")
        if results and isinstance(report, dict) and js.stem not in results:
            found.append(f"_generated/results.html: no section for {js.name}")
    return found


def main() -> int:
    site = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "_build" / "html"
    missing = problems(site)
    for line in missing:
        print(f"missing: {line}")
    if missing:
        print(f"the docs site at {site} is incomplete: rebuild it, or fix the pages above")
        return 1
    n = len(list((ROOT / "tutorials").glob("*.ipynb")))
    print(f"docs site complete: API reference, {n} tutorials with plots, the results page")
    return 0


if __name__ == "__main__":
    sys.exit(main())
