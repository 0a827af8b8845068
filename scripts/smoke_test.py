"""Smoke test of an installed pyro-cvi (run by ``scripts/check_wheel.sh`` in a fresh venv).

Checks that ``pyro_cvi`` is imported from the given environment (not the source tree), that
its version matches the installed metadata, that the typing marker and the licence are
shipped, and that a 5-step CVI fit of a small logistic regression lowers the -ELBO.

    python scripts/smoke_test.py VENV_DIR
"""

import sys
from importlib import metadata
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI

import pyro_cvi
from pyro_cvi import CVI, CVI_ELBO, AutoCVI

venv = Path(sys.argv[1]).resolve()
where = Path(pyro_cvi.__file__).resolve()
assert venv in where.parents, f"pyro_cvi imported from {where}, not from {venv}"
assert metadata.version("pyro-cvi") == pyro_cvi.__version__, "version mismatch"
assert (where.parent / "py.typed").exists(), "py.typed missing"
files = [str(f) for f in metadata.files("pyro-cvi") or []]
assert any("LICENSE" in f for f in files), "LICENSE missing from the distribution"


def model(X, y=None):
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


g = torch.Generator().manual_seed(0)
X = torch.randn(200, 3, generator=g, dtype=torch.float64)
y = torch.bernoulli(torch.sigmoid(X @ torch.tensor([1.0, -2.0, 0.5], dtype=X.dtype)), generator=g)
pyro.set_rng_seed(0)
guide = AutoCVI(model)
svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
losses = [svi.step(X, y) for _ in range(5)]
assert losses[-1] < losses[0], losses
print(f"pyro-cvi {pyro_cvi.__version__} from {where.parent}:")
print(f"  -ELBO {losses[0]:.2f} -> {losses[-1]:.2f} in 5 CVI steps")
