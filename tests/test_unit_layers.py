"""Units (the package's sub-packages and top-level modules) in layers: no import cycle between
units, function-local and ``TYPE_CHECKING`` imports included; and an engine that names no kind
of block (the registry of ``pyro_cvi/blocks/registry.py`` builds them).

A *unit* is ``pyro_cvi.X`` for a top-level module ``X.py`` or a sub-package ``X/``; an import
of any module of unit B from any module of unit A is an edge A -> B.
"""

import re

from test_architecture import ROOT, _a_cycle, _strongly_connected, import_graph

#: no knot is left: the checkpoints (which save guides and optimizers) are a unit of their own
#: above ``autoguide`` and ``optim``, and ``scale`` (the collectives they call) below them.
KNOWN_KNOTS = []


def _unit(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def unit_graph():
    """``{unit: {unit: ["a.module:line -> b.module", ...]}}``."""
    graph, _ = import_graph()
    units = {}
    for a, deps in graph.items():
        ua = _unit(a)
        if ua is None:
            continue
        units.setdefault(ua, {})
        for b, lines in deps.items():
            ub = _unit(b)
            if ub is not None and ub != ua:
                units[ua].setdefault(ub, []).append(f"{a}:{min(lines)} -> {b}")
                units.setdefault(ub, {})
    return units


def test_the_unit_graph_sees_function_local_imports():
    units = unit_graph()
    assert "model" in units["engine"] and "blocks" in units["engine"]
    # step_control imports divergence inside a function only
    assert "divergence" in units["step_control"]
    cycle = {"a": {"b": ["x"]}, "b": {"a": ["y"]}, "c": {"a": ["z"]}}
    assert _strongly_connected(cycle) == [["a", "b"]]


def test_no_import_cycle_between_units():
    units = unit_graph()
    knots = _strongly_connected(units)
    lines = []
    for comp in knots:
        if comp in KNOWN_KNOTS:
            continue
        cycle = _a_cycle(units, comp)
        steps = [f"{a} -> {b} ({units[a][b][0]})" for a, b in zip(cycle, cycle[1:])]
        lines.append(f"cycle among {comp}:\n    " + "\n    ".join(steps))
    assert not lines, "import cycles between units:\n" + "\n".join(lines)
    assert knots == KNOWN_KNOTS, f"the known knot changed: {knots}; update KNOWN_KNOTS"


#: what names a kind of block: its class, a latent's form, the per-kind fields of old, a
#: kind's admission rule (what the remainder takes is the remainder kind's own rule,
#: registered with it: ``register_kind(..., admits=)``)
KIND_AWARE = re.compile(
    r"\b(GaussianBlock|MarkovBlock|MeanFieldBlock|NaturalBlock|RemainderBlock|SiteFormBlock)\b"
    r"|\.form\b|\b(NATURAL|SITE|LEAF_FORM|REMAINDER|REMAINDER_OWNER)\b"
    r"|\b(self|engine)\.(gaussian|natural|mean_field|remainder)\b"
    r"|\bgradient_only\b|\b(o|options|self\.options)\.(remainder|general_curvature)\b"
)


def kind_aware_places(path):
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split("#", 1)[0]
        if KIND_AWARE.search(code):
            out.append(f"{path.name}:{n}: {line.strip()}")
    return out


def test_the_engine_and_the_guide_name_no_kind_of_block():
    places = kind_aware_places(ROOT / "engine.py") + kind_aware_places(ROOT / "autoguide.py")
    assert not places, "kind-aware places:\n" + "\n".join(places)


def test_the_kind_checker_flags_the_forms(tmp_path):
    src = tmp_path / "x.py"
    src.write_text(
        "if info.form == NATURAL:\n"
        "    b = RemainderBlock(an)\n"
        "self.mean_field = None\n"
        "blocks = build_blocks(found)  # a NaturalBlock in a comment\n"
        "rule = lambda dim: gradient_only(o, dim)\n"
        "if o.remainder is not None and o.remainder.enabled:\n"
        "    mode = self.options.general_curvature\n"
        "an = Analysis(model, **analysis_options(o))  # o.remainder in a comment\n"
    )
    assert [p.split(":")[1] for p in kind_aware_places(src)] == ["1", "2", "3", "5", "6", "7"]
