"""Set-up work done once where it was done twice, deciding and drawing exactly as before.

* :func:`~pyro_cvi.model.factor_roles.factor_spec`: the classification reads the spec the
  block grouping analysed (a hierarchical prior whose scale is a latent), and replays its
  draws from torch's random stream: the same specs, the same ``explain()`` and the same
  random state as analysing the factor again; a spec whose analysis drew otherwise (a model
  run that draws) is analysed again;
* the first step finds the data the set-up just analysed (no reanalysis check): the same
  losses as with the check; other data at the first step is still analysed anew.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

import pyro_cvi.model.analysis as analysis_module
from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.engine import Engine
from pyro_cvi.model import factor_roles
from pyro_cvi.model.factor_roles import analyze_factor, factor_spec

DTYPES = [torch.float32, torch.float64]
IDS = ["f32", "f64"]


def _hierarchical(dtype):
    g = torch.Generator().manual_seed(3)
    group = torch.randint(0, 4, (40,), generator=g)
    X = torch.randn(40, 2, generator=g).to(dtype)
    y = torch.bernoulli(torch.full((40,), 0.4), generator=g).to(dtype)

    def model(group, X, y):
        mu = pyro.sample("mu", dist.Normal(X.new_tensor(0.0), 2.0))
        sigma = pyro.sample("sigma", dist.HalfNormal(X.new_tensor(1.0)))
        beta = pyro.sample("beta", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
        with pyro.plate("groups", 4):
            alpha = pyro.sample("alpha", dist.Normal(mu, sigma))
        with pyro.plate("data", 40):
            pyro.sample("y", dist.Bernoulli(logits=alpha[group] + X @ beta), obs=y)

    return model, (group, X, y)


def _fit(model, args, steps=2):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    losses = [svi.step(*args) for _ in range(steps)]
    return guide, losses, torch.get_rng_state()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_a_kept_spec_is_the_analysis_again(dtype, monkeypatch):
    model, args = _hierarchical(dtype)
    reads = []

    def counting(an, site, kept):
        if kept is not None and kept[None] and site in kept:
            reads.append(site)
        return factor_spec(an, site, kept)

    monkeypatch.setattr(analysis_module, "factor_spec", counting)
    guide, losses, state = _fit(model, args)
    assert reads == ["alpha"]  # the tree member with a latent scale: asked twice
    text = guide.explain()
    specs = guide.engine.analysis.specs

    monkeypatch.setattr(analysis_module, "factor_spec", lambda an, s, kept: analyze_factor(an, s))
    old, old_losses, old_state = _fit(model, args)
    assert old_losses == losses  # bit for bit
    assert torch.equal(old_state, state)
    assert old.explain() == text
    old_specs = old.engine.analysis.specs
    assert specs.keys() == old_specs.keys()
    for site, spec in specs.items():
        other = old_specs[site]
        assert (spec.exact, spec.reason, spec.roles) == (other.exact, other.reason, other.roles)
        assert spec.jacobians.keys() == other.jacobians.keys()
        for n, A in spec.jacobians.items():
            assert torch.equal(A, other.jacobians[n])


def test_a_spec_kept_replays_its_draws_and_one_that_drew_otherwise_is_not(monkeypatch):
    def projections(an, site, draws=None):  # (draws as analyze_factor takes them)
        for shape in [(3,), (2, 5)]:
            if draws is not None:
                draws.append((torch.Size(shape), torch.float64, torch.device("cpu")))
            torch.randn(shape, dtype=torch.float64)
        if site == "hidden":  # a model run that draws
            torch.rand(4)
        return factor_roles.FactorSpec(site, True, site)

    monkeypatch.setattr(factor_roles, "analyze_factor", projections)
    kept = {None: False}
    torch.manual_seed(5)
    first = factor_spec(None, "a", kept)
    factor_spec(None, "hidden", kept)
    assert set(kept) == {None, "a"}
    kept[None] = True
    before = torch.get_rng_state()
    assert factor_spec(None, "a", kept) is first  # read, not analysed again
    after_read = torch.get_rng_state()
    torch.set_rng_state(before)
    projections(None, "a")
    assert torch.equal(torch.get_rng_state(), after_read)  # the stream moved as analysing
    again = factor_spec(None, "hidden", kept)
    assert again.site == "hidden" and again is not first  # analysed again
    assert factor_spec(None, "a", kept).site == "a"  # (read once: then analysed)
    assert factor_spec(None, "b", None).site == "b"  # outside a regrouping: analysed


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_the_first_step_reads_the_data_the_set_up_analysed(dtype, monkeypatch):
    model, args = _hierarchical(dtype)
    checks = []
    reanalyse = Engine.reanalyse_if_new_data

    def counted(self, *a, **k):
        checks.append(1)
        return reanalyse(self, *a, **k)

    monkeypatch.setattr(Engine, "reanalyse_if_new_data", counted)
    _, losses, state = _fit(model, args)
    assert checks == []  # the same tensors every step: never a reanalysis check

    new_data = Engine.new_data
    first = []

    def always_on_first(self, a, k):  # the check as before: run at the first step
        out = new_data(self, a, k)
        if not first:
            first.append(1)
            return True
        return out

    monkeypatch.setattr(Engine, "new_data", always_on_first)
    _, old_losses, old_state = _fit(model, args)
    assert checks == [1]
    assert old_losses == losses and torch.equal(old_state, state)

    # set up on other data (a loss evaluated), then a step on these: analysed anew
    monkeypatch.setattr(Engine, "new_data", new_data)
    pyro.clear_param_store()
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    svi.evaluate_loss(args[0], args[1] + 1.0, args[2])
    checks.clear()
    svi.step(*args)
    assert checks == [1]
    assert guide.engine.analysis.args[1] is args[1]  # the analysis is of these data
