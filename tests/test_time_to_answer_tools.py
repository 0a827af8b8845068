"""The measures of ``scripts/benchmark_time_to_answer.py`` on made-up histories: the first
entry within a tolerance of the last, and the first from which a score stays there."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    path = ROOT / "scripts" / "benchmark_time_to_answer.py"
    spec = importlib.util.spec_from_file_location("_benchmark_time_to_answer", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# (CPU s, bound, score): the score dips below its converged value, then comes back
HIST = [
    [1.0, 10.0, 0.50],
    [2.0, 5.0, 0.2641],
    [3.0, 4.0, 0.2679],
    [4.0, 4.0 + 1e-5, 0.26975],
    [5.0, 4.0, 0.26981],
    [6.0, 4.0, 0.26980],
]


def test_the_converged_score_is_where_it_stays_within_the_tolerance():
    b = _script()
    assert b.to_converged(HIST, 2, 1e-3) == (4, 4.0)  # 0.2641 was within once, left again
    assert b.to_converged(HIST, 2, 1e-4) == (4, 4.0)
    assert b.to_converged(HIST, 2, 1e-6) == (6, 6.0)
    assert b.to_converged(HIST[:1], 2, 1e-9) == (1, 1.0)
    assert b.first_within(HIST, 2, lambda v: v <= 0.2629) is None  # MAP's level: never


def test_the_bound_within_a_relative_tolerance_of_the_last():
    b = _script()
    assert b.to_rel(HIST, 1) == (3, 3.0)  # the first within (4.0 + 1e-5 after it is not)
    assert b.to_rel([[1.0, 4.0, None], [2.0, 4.0 + 1e-6, None]], 1) == (1, 1.0)
