"""The tools behind the docs site and the results: ``scripts/check_docs.py`` finds each kind of
rough edge in a built site (and passes a clean one), ``scripts/report.py`` titles a results file
that has no ``report`` section, and ``bench.reporting.write_results`` saves the plots next
to the JSON and records how long the run took."""

import importlib.util
import json
from pathlib import Path

import pytest

import pyro_cvi

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_docs = _load("check_docs")

PAGE = """<html><head>{head}</head><body><article>{body}</article></body></html>"""


def _site(tmp_path: Path, pages: dict) -> Path:
    for rel, (head, body) in pages.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(PAGE.format(head=head, body=body))
    (tmp_path / "_static" / "mathjax").mkdir(parents=True)
    (tmp_path / "_static" / "mathjax" / "tex-chtml.js").write_text("//")
    return tmp_path


def _pages(site: Path) -> dict:
    return {p.resolve(): p.read_text() for p in site.rglob("*.html")}


CLEAN = {
    "index.html": ("", '<a href="a.html#sec">a</a> <a href="https://pyro.ai">pyro</a>'),
    "a.html": (
        '<script defer src="_static/mathjax/tex-chtml.js?v=1"></script>',
        '<section id="sec"><span class="math">\\(x\\)</span></section>'
        '<div class="cell_output"><pre>-ELBO 12.3</pre></div>',
    ),
}


def test_a_clean_site_has_no_noise_links_or_offline_problems(tmp_path):
    site = _site(tmp_path, CLEAN).resolve()
    pages = _pages(site)
    assert check_docs.noise_problems(site, pages) == []
    assert check_docs.link_problems(site, pages) == []
    assert check_docs.offline_problems(site, pages) == []


@pytest.mark.parametrize(
    "body, what",
    [
        ('<div class="output stderr"><pre>step 3</pre></div>', "stderr"),
        ("<pre>/x/tqdm/auto.py:21: TqdmWarning: IProgress not found</pre>", "Python warning"),
        ("<pre>Traceback (most recent call last):\n  File</pre>", "traceback"),
    ],
)
def test_warning_text_in_a_page_is_found(tmp_path, body, what):
    site = _site(tmp_path, {"index.html": ("", body)}).resolve()
    found = check_docs.noise_problems(site, _pages(site))
    assert len(found) == 1 and what in found[0] and "index.html" in found[0]


def test_broken_links_and_anchors_are_found(tmp_path):
    pages = {
        "index.html": ("", '<a href="api/m.html#m.f">f</a><a href="gone.html">x</a>'),
        "api/m.html": ("", '<dt id="m.g">g</dt><a href="../index.html#top">up</a><a href="#m.g">'),
    }
    site = _site(tmp_path, pages).resolve()
    found = sorted(check_docs.link_problems(site, _pages(site)))
    assert found == [
        "api/m.html: link to a missing anchor '../index.html#top'",
        "index.html: link to a missing anchor 'api/m.html#m.f'",
        "index.html: link to a missing file 'gone.html'",
    ]


def test_cdn_assets_and_maths_without_local_mathjax_are_found(tmp_path):
    cdn = '<script src="https://cdn.jsdelivr.net/npm/mathjax@4/tex-mml-chtml.js"></script>'
    pages = {
        "cdn.html": (cdn, '<span class="math">x</span>'),
        "bare.html": ("", '<span class="math">x</span>'),
        "lost.html": ('<script src="_static/mathjax/gone.js"></script>', '<div class="math">'),
    }
    site = _site(tmp_path, pages).resolve()
    found = " | ".join(sorted(check_docs.offline_problems(site, _pages(site))))
    assert "bare.html: has maths but loads no MathJax" in found
    assert "cdn.html: loads" in found and "from another host" in found
    assert "lost.html: MathJax '_static/mathjax/gone.js' is not in the site" in found


def test_a_module_both_public_and_internal_is_found(tmp_path):
    toc = '<div class="toctree-wrapper"><a href="pyro_cvi.a.html">a</a>{}</div><footer>'
    pages = {
        "api/index.html": ("", toc.format('<a href="pyro_cvi.b.html">b</a>')),
        "api/internals.html": ("", toc.format("") + '<a href="pyro_cvi.c.html">next</a>'),
    }
    site = _site(tmp_path, pages)
    assert check_docs.api_split_problems(site) == [
        "pyro_cvi.a.html: listed as public API and as internals"
    ]


def test_report_titles_a_part_file_from_its_script_docstring(tmp_path):
    report = _load("report")
    path = tmp_path / "benchmark_multiclass_D.json"
    data = {
        "quick": False,
        "D": {"N": 255, "methods": {"mc": {"a": 1.0, "b": 2}, "cubature": {"a": 3.0, "b": 4}}},
    }
    path.write_text(json.dumps(data))
    lines = report.render_file(path, tmp_path, "results")
    assert lines[0].startswith("## Multi-class classification, part D: K = 3")
    text = "\n".join(lines)
    assert "| D.N | 255 |" in text
    assert "| methods | a | b |" in text and "| mc | 1 | 2 |" in text
    assert "benchmark_multiclass.py" in text


def test_report_keeps_the_file_name_when_no_script_wrote_it(tmp_path):
    report = _load("report")
    path = tmp_path / "something_else.json"
    path.write_text(json.dumps({"x": 1}))
    lines = report.render_file(path, tmp_path, "results")
    assert lines[0] == "## something_else" and "| x | 1 |" in lines


def test_write_results_saves_the_plots_next_to_the_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from bench.reporting import Table, write_results

    table = Table("t", [("method", "m"), ("s", "seconds")])
    table.add("cvi", "1.0")
    table.plot("step", "-ELBO", {"cvi": [(1, 3.0), (2, 2.0)], "adam": [(1, 4.0), (2, 3.5)]})
    table.plot("step", "gap", {"cvi": [(1, 1.0), (2, 0.1)]}, logy=True)
    out = write_results(
        str(tmp_path / "bench.json"), {"x": 1}, title="T", verdict="V", tables=[table]
    )
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["bench-0-0.png", "bench-0-1.png"]
    for name in pngs:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run = json.loads(out.read_text())["report"]["run"]
    assert run["wall_seconds"] >= 0 and run["cpu_seconds"] > 0 and run["cpu_count"] >= 1
    assert "bench-0-1.png" in capsys.readouterr().out


def _conf():
    spec = importlib.util.spec_from_file_location("_docs_conf", ROOT / "docs" / "conf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # no side effects: the pages are written in setup(app)
    return module


def test_the_api_reference_splits_public_modules_from_internals():
    pytest.importorskip("gpytorch")
    conf = _conf()
    modules = conf._all_modules()
    public, internal = conf._public_split(modules)
    assert set(public) | set(internal) == set(modules) and not set(public) & set(internal)
    for name in ("pyro_cvi.autoguide", "pyro_cvi.optim", "pyro_cvi.elbo", "pyro_cvi.step_sizes"):
        assert name in public
    for name in ("pyro_cvi.checkpoints.checkpoint", "pyro_cvi.contrib.gpytorch.strategy"):
        assert name in public
    assert conf._home(pyro_cvi.StructuredSVI) in public
    assert "pyro_cvi.statespace.kalman" in public  # it defines smooth(), exported by statespace
    for name in ("pyro_cvi.engine", "pyro_cvi.update", "pyro_cvi.families.base"):
        assert name in internal


def test_a_module_page_documents_only_what_the_module_defines():
    conf = _conf()
    from pyro_cvi.families import base

    own = conf._own_members(base)
    assert "ExponentialFamily" in own
    assert "log_minus_digamma" in base.__all__ and "log_minus_digamma" not in own  # special's
    page = "\n".join(conf._module_page("pyro_cvi.families.base"))
    assert ":members: ExponentialFamily" in page and "digamma" not in page


def test_strip_tqdm_warning_removes_that_warning_only(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    strip = _load("strip_tqdm_warning").strip
    warning = (
        "/x/tqdm/auto.py:21: TqdmWarning: IProgress not found. Please update jupyter.\n"
        "  from .autonotebook import tqdm as notebook_tqdm\n"
    )
    cell = nbformat.v4.new_code_cell("import pyro", execution_count=1)
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stderr", text=warning),
        nbformat.v4.new_output("stream", name="stderr", text="RuntimeWarning: step shrunk\n"),
        nbformat.v4.new_output("stream", name="stdout", text="-ELBO 12.3\n"),
    ]
    path = tmp_path / "t.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), path)
    assert strip(path) == 1
    outs = nbformat.read(path, as_version=4).cells[0].outputs
    assert [o.text for o in outs] == ["RuntimeWarning: step shrunk\n", "-ELBO 12.3\n"]
    assert strip(path) == 0
