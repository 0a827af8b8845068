"""Every cell of docs/pairings.md (guide x optimizer x loss): it works and changes q, or it
raises the documented error. No pairing runs without changing q."""

import re
from pathlib import Path

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO, TraceEnum_ELBO, TraceGraph_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import (
    AutoDelta,
    AutoDiagonalNormal,
    AutoGuideList,
    AutoIAFNormal,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)
from torch.distributions import constraints

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

TABLE = Path(__file__).resolve().parent.parent / "docs" / "pairings.md"

ERRORS = {
    "E-elbo": (ValueError, "AutoCVI ran inside SVI.step under a Pyro ELBO"),
    "E-cvi-elbo": (TypeError, "CVI_ELBO needs an AutoCVI guide"),
    "E-torch": (ValueError, "AutoCVI + CVI_ELBO with an optimizer that is not CVI"),
}
WORKS = ("natural", "conjugate", "torch", "inner", "in-guide")


def _table():
    lines = [ln for ln in TABLE.read_text().splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = {}
    for ln in lines[1:]:
        row = [c.strip() for c in ln.strip("|").split("|")]
        for col, value in zip(header[1:], row[1:]):
            cells[(row[0], col)] = value
    return header[1:], cells


COLUMNS, CELLS = _table()


def model(X, y=None):
    w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
    tau = pyro.sample("tau", dist.LogNormal(X.new_zeros(()), 1.0))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(X @ w, tau), obs=y)


def _hand_normal(X, y=None):
    for site, shape in (("w", (2,)), ("tau", ())):
        loc = pyro.param(f"{site}_loc", X.new_zeros(shape))
        scale = pyro.param(f"{site}_scale", X.new_full(shape, 0.3), constraint=constraints.positive)
        if site == "w":
            pyro.sample("w", dist.Normal(loc, scale).to_event(1))
        else:
            pyro.sample("tau", dist.LogNormal(loc, scale))


def _hand_mvn(X, y=None):
    loc = pyro.param("q_loc", X.new_zeros(3))
    tril = pyro.param(
        "q_scale_tril", 0.3 * torch.eye(3, dtype=X.dtype), constraint=constraints.lower_cholesky
    )
    z = pyro.sample(
        "z", dist.MultivariateNormal(loc, scale_tril=tril), infer={"is_auxiliary": True}
    )
    pyro.sample("w", dist.Delta(z[:2], event_dim=1))
    pyro.sample("tau", dist.Delta(z[2].exp()))


def _listed(first):
    def make():
        guide = AutoGuideList(model)
        guide.append(first(poutine.block(model, expose=["w"])))
        guide.append(AutoDelta(poutine.block(model, expose=["tau"])))
        return guide

    return make


GUIDES = {
    "AutoNormal": lambda: AutoNormal(model),
    "AutoDiagonalNormal": lambda: AutoDiagonalNormal(model),
    "AutoMultivariateNormal": lambda: AutoMultivariateNormal(model),
    "AutoLowRankMultivariateNormal": lambda: AutoLowRankMultivariateNormal(model, rank=1),
    "hand-written Normal": lambda: _hand_normal,
    "hand-written MultivariateNormal": lambda: _hand_mvn,
    "AutoDelta": lambda: AutoDelta(model),
    "AutoIAFNormal": lambda: AutoIAFNormal(model, hidden_dim=[4]),
    "AutoCVI": lambda: AutoCVI(model),
    "AutoGuideList(AutoNormal, AutoDelta)": _listed(AutoNormal),
    "AutoGuideList(AutoMultivariateNormal, AutoDelta)": _listed(AutoMultivariateNormal),
    "AutoGuideList(AutoCVI, AutoDelta)": _listed(AutoCVI),
}
LOSSES = {
    "Trace": lambda: Trace_ELBO(),
    "MeanField": lambda: TraceMeanField_ELBO(),
    "Enum": lambda: TraceEnum_ELBO(max_plate_nesting=1),
    "Graph": lambda: TraceGraph_ELBO(),
    "CVI_ELBO": lambda: CVI_ELBO(),
}


def _data():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(30, 2, generator=g)
    y = X @ torch.tensor([1.0, -0.5]) + 0.5 * torch.randn(30, generator=g)
    return X, y


def _draw(guide, X, y):
    pyro.set_rng_seed(123)
    with torch.no_grad():
        tr = poutine.trace(guide).get_trace(X, y)
    return {n: tr.nodes[n]["value"].clone() for n in ("w", "tau")}


def test_table_covers_every_guide_and_loss():
    assert {g for g, _ in CELLS} == set(GUIDES)
    assert {c.split(" + ")[1] for c in COLUMNS} == set(LOSSES)
    assert set(CELLS.values()) <= set(WORKS) | set(ERRORS)


@pytest.mark.parametrize("cell", sorted(CELLS), ids=lambda c: f"{c[0]}|{c[1]}")
def test_pairing(cell):
    name, column = cell
    expected = CELLS[cell]
    opt_name, loss_name = column.split(" + ")
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    X, y = _data()
    guide = GUIDES[name]()
    optim = CVI() if opt_name == "CVI" else pyro.optim.Adam({"lr": 0.05})
    svi = SVI(model, guide, optim, loss=LOSSES[loss_name]())
    if expected in ERRORS:
        exc, message = ERRORS[expected]
        with pytest.raises(exc, match=re.escape(message)):
            for _ in range(3):
                svi.step(X, y)
        return
    svi.step(X, y)
    before = _draw(guide, X, y)
    for _ in range(3):
        assert torch.isfinite(torch.tensor(svi.step(X, y)))
    after = _draw(guide, X, y)
    for site in before:
        assert not torch.equal(before[site], after[site]), f"q of {site!r} did not change"
    if expected == "natural":  # stepped by natural gradients, not handed to the inner optimizer
        assert optim.gaussians.controls, "no Gaussian was stepped by natural gradients"
        assert any(r["rule"].startswith("natural") for r in optim.explain(print_table=False))
    if expected == "inner":  # no exponential-family site: CVI() is its inner optimizer
        rows = optim.explain(print_table=False)
        assert rows and all(r["rule"].startswith("inner") for r in rows)
        assert not optim.gaussians.controls
