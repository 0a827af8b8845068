"""Check a built documentation site for what the project promises it contains (CI runs this
after ``sphinx -W``, so a page that silently disappears or a rough edge fails the build):

* the API reference of ``AutoCVI``, ``CVI``, ``CVI_ELBO`` and ``pyro_cvi.contrib.gpytorch``
  (its strategy and its optimizer), the public modules on ``api/index.html`` and every other
  module on ``api/internals.html`` (no module on both);
* one page per notebook in ``tutorials/``, with at least one plot (an ``<img>``) on it;
* the results page, with a section for every ``results/*.json`` that has a ``report``, and no
  section titled with a bare file name;
* no warning text in any rendered page (a stored ``stderr`` output, ``SomethingWarning:``, a
  traceback): what a reader sees is the library's output, not noise from the machine that ran it;
* no broken internal link: every ``href`` to a page of the site points to a file that exists,
  and its ``#anchor`` to an ``id`` on that page (Sphinx's ``linkcheck`` builder does not see the
  links that ``viewcode`` and the theme write into the HTML, so they are checked here);
* the site works offline: no script or stylesheet from another host, and every page with
  maths loads the bundled MathJax, which exists.

    python scripts/check_docs.py [docs/_build/html]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Set
from urllib.parse import unquote, urldefrag

ROOT = Path(__file__).resolve().parents[1]

#: (page under api/, HTML anchor that autodoc writes for the documented object)
API = [
    ("pyro_cvi.autoguide.html", 'id="pyro_cvi.autoguide.AutoCVI"'),
    ("pyro_cvi.optim.html", 'id="pyro_cvi.optim.CVI"'),
    ("pyro_cvi.elbo.html", 'id="pyro_cvi.elbo.CVI_ELBO"'),
    ("pyro_cvi.contrib.html", 'href="pyro_cvi.contrib.gpytorch.html'),
    ("pyro_cvi.contrib.gpytorch.html", 'id="module-pyro_cvi.contrib.gpytorch"'),
    (
        "pyro_cvi.contrib.gpytorch.strategy.html",
        'id="pyro_cvi.contrib.gpytorch.strategy.CVIVariationalStrategy"',
    ),
    ("pyro_cvi.contrib.gpytorch.optim.html", 'id="pyro_cvi.contrib.gpytorch.optim.CVIOptimizer"'),
]

#: Text that means a warning or an error leaked into a rendered page.
NOISE = [
    (re.compile(r'class="output stderr'), "a stored stderr output"),
    (re.compile(r"\b[A-Z]\w*Warning: "), "a Python warning"),
    (re.compile(r"Traceback \(most recent call last\)"), "a traceback"),
]
_HREF = re.compile(r'\shref="([^"]*)"')
_ID = re.compile(r'\sid="([^"]*)"')
_EXTERNAL_ASSET = re.compile(r'<(?:script|link)\b[^>]*\s(?:src|href)="(?:https?:)?//[^"]*"[^>]*>')
_MATHJAX = re.compile(r'<script\b[^>]*\ssrc="([^"]*mathjax[^"]*\.js)[^"]*"')


def _line_of(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    plain = re.sub(r"<[^>]+>", "", text[start : end if end >= 0 else None]).strip()
    return plain[:120]


def noise_problems(site: Path, pages: Dict[Path, str]) -> List[str]:
    """Warning text in any rendered page."""
    found = []
    for path, text in pages.items():
        for pattern, what in NOISE:
            m = pattern.search(text)
            if m:
                where = path.relative_to(site)
                found.append(f"{where}: {what}: {_line_of(text, m.start())!r}")
    return found


def link_problems(site: Path, pages: Dict[Path, str]) -> List[str]:
    """Internal links to a missing page, or to a missing ``#anchor`` on an existing page."""
    ids: Dict[Path, Set[str]] = {p: set(_ID.findall(t)) for p, t in pages.items()}
    found = []
    for path, text in pages.items():
        for href in set(_HREF.findall(text)):
            if re.match(r"^[a-zA-Z][\w+.-]*:", href) or href.startswith("//"):
                continue  # another site, mailto:, javascript:
            url, frag = urldefrag(href)
            url = url.split("?")[0]
            target = (path.parent / unquote(url)).resolve() if url else path
            where = path.relative_to(site)
            if url and not target.exists():
                found.append(f"{where}: link to a missing file {href!r}")
            elif frag and target.suffix == ".html" and unquote(frag) not in ids.get(target, ()):
                found.append(f"{where}: link to a missing anchor {href!r}")
    return found


def offline_problems(site: Path, pages: Dict[Path, str]) -> List[str]:
    """Scripts or stylesheets from another host; maths without the bundled MathJax."""
    found = []
    for path, text in pages.items():
        where = path.relative_to(site)
        for m in _EXTERNAL_ASSET.finditer(text):
            found.append(f"{where}: loads {m.group(0)[:100]!r} from another host")
        if 'class="math' in text:
            mj = _MATHJAX.search(text)
            if not mj:
                found.append(f"{where}: has maths but loads no MathJax")
            elif not (path.parent / mj.group(1)).resolve().exists():
                found.append(f"{where}: MathJax {mj.group(1)!r} is not in the site")
    return found


def api_split_problems(site: Path) -> List[str]:
    """The public API page and the internals page each list their modules, none on both."""

    def listed(rel: str) -> Set[str]:
        path = site / rel
        if not path.exists():
            return set()
        text = path.read_text(encoding="utf-8")
        start = text.find('class="toctree-wrapper')
        end = min(i for i in (text.find("<footer", start), len(text)) if i >= 0)
        toc = text[start:end] if start >= 0 else ""
        return set(re.findall(r'href="(pyro_cvi[\w.]*\.html)"', toc))

    public, internal = listed("api/index.html"), listed("api/internals.html")
    found = []
    if not public:
        found.append("api/index.html: lists no module")
    if not internal:
        found.append("api/internals.html: missing, or lists no module")
    for page in sorted(public & internal):
        found.append(f"{page}: listed as public API and as internals")
    return found


def problems(site: Path) -> List[str]:
    """Everything missing from or wrong in the built site at ``site`` (empty when it is fine)."""
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
    titles = [re.sub(r"<[^>]+>", "", t).strip() for t in re.findall(r"<h2>(.*?)</h2>", results)]
    for js in sorted((ROOT / "results").glob("*.json")):
        data = json.loads(js.read_text())
        report = data.get("report") if isinstance(data, dict) else None
        if results and isinstance(report, dict) and js.stem not in results:
            found.append(f"_generated/results.html: no section for {js.name}")
        if any(t.rstrip("¶").strip() == js.stem for t in titles):
            found.append(f"_generated/results.html: the section for {js.name} has no title")
    found += api_split_problems(site)
    pages = {p.resolve(): p.read_text(encoding="utf-8") for p in sorted(site.rglob("*.html"))}
    site = site.resolve()
    found += noise_problems(site, pages)
    found += link_problems(site, pages)
    found += offline_problems(site, pages)
    return found


def main() -> int:
    site = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "_build" / "html"
    if not (site / "index.html").exists():
        print(f"no site at {site}: build it first (python -m sphinx -W -b html docs {site})")
        return 1
    bad = problems(site)
    for line in bad:
        print(f"problem: {line}")
    if bad:
        print(f"the docs site at {site} has {len(bad)} problem(s): fix the pages above, rebuild")
        return 1
    n = len(list((ROOT / "tutorials").glob("*.ipynb")))
    print(
        f"docs site complete: API reference (public + internals), {n} tutorials with plots, the "
        "results page; no warning text, no broken internal link or anchor, maths offline"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
