"""What typing the public API (``mypy --strict``, run by CI with ``[tool.mypy]`` in
pyproject.toml) found and guards: a tensor outside Pyro's param store given to ``CVI`` gets
the ValueError that says what to do (``ParamStoreDict.param_name`` returns ``None`` for it,
and ``CVI`` used to fail on that ``None`` with an AttributeError); and the modules the type
check covers exist, so that a file move cannot silently shrink it."""

import sys
from pathlib import Path

import pytest
import torch

from pyro_cvi import CVI

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cvi_steps_a_tensor_outside_the_param_store_by_its_inner_optimizer(dtype):
    """No refusal: a tensor CVI() cannot step by natural gradients gets Adam's first step
    (``-lr * sign(grad)``)."""
    p = torch.zeros(3, dtype=dtype, requires_grad=True)
    p.grad = torch.ones_like(p)
    cvi = CVI()
    cvi([p])
    assert torch.allclose(p.detach(), torch.full_like(p, -0.01), rtol=1e-4)
    assert [r["rule"] for r in cvi.explain(print_table=False)] == ["inner"]


def test_every_module_the_type_check_covers_exists():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is Python 3.11+")
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["strict"] is True
    missing = [f for f in config["files"] if not (ROOT / f).is_file()]
    assert not missing, f"[tool.mypy] files lists modules that do not exist: {missing}"
    assert any("autoguide" in f or "statespace" in f for f in config["files"])
