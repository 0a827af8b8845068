"""No model that fitted before fits worse: the fast zoo models against the committed records of
earlier commits (``results/zoo_record_*.json``, written by ``scripts/zoo_record.py``, which
also covers the rest of the zoo). A model fails when its bound is worse than the best earlier
record by more than ``max(0.5, 0.5%)`` plus three standard errors."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RECORDS = sorted((ROOT / "results").glob("zoo_record_*.json"))
FAST = [
    "coin",
    "poisson_regression",
    "bayesian_regression",
    "eight_schools_noncentered",
    "subsampled_logistic",
    "gaussian_mixture",
    "lda",
]


def _script():
    spec = importlib.util.spec_from_file_location("zoo_record", ROOT / "scripts" / "zoo_record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_records_exist_and_cover_the_fast_models():
    assert len(RECORDS) >= 2, RECORDS
    for path in RECORDS:
        records = json.loads(path.read_text())["records"]
        assert all(name in records for name in FAST), path.name


#: rows that fit worse than at 85a0a12 since 9c97649 put their latents in the remainder, not yet
#: given back (strict: the test fails once they fit again, so the entry must go)
KNOWN_REGRESSIONS: dict = {}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", FAST)
def test_no_fast_zoo_model_fits_worse_than_before(name, dtype, request):
    from zoo import ZOO

    if name in KNOWN_REGRESSIONS:
        request.applymarker(pytest.mark.xfail(reason=KNOWN_REGRESSIONS[name], strict=True))

    script = _script()
    key = name if dtype == torch.float64 else f"{name}-f32"
    earlier = [json.loads(p.read_text())["records"].get(key, {}) for p in RECORDS]
    earlier = [r for r in earlier if "bound" in r]
    assert earlier, f"no earlier record of {key}"
    row = script.measure(ZOO[name], dtype, particles=200)
    assert "bound" in row, row
    best = min(earlier, key=lambda r: r["bound"])
    slack = script.tolerance(best["bound"]) + 3 * math.hypot(row["se"], best.get("se", 0.0))
    assert row["bound"] <= best["bound"] + slack, (row, best)
