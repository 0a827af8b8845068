"""Models that cannot run with enumeration dims (they assert the shapes of their own samples,
as Pyro's ``Trace_ELBO`` runs them with none): the analysis finds their discrete dependencies
by unenumerated runs with each discrete latent moved. A prior-only discrete subtree is then
its own exact posterior (``q(x, y) = p(x) p(y | x)``, -ELBO 0); a discrete latent that would
need enumerated messages is refused by name, with the model's own error."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from fooling_cases import CASES
from pyro.infer import SVI, Trace_ELBO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

DTYPES = [torch.float64, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_asserting_prior_only_discrete_model_is_fitted_exactly(dtype):
    (case,) = [c for c in CASES if c.name == "asserting_discrete"]
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, args = case.build(dtype)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    losses = [svi.step(*args) for _ in range(3)]
    assert losses == [0.0, 0.0, 0.0]  # q(x, y) is the prior: KL 0
    assert guide.engine.analysis.leaves == {"x", "y"}
    # the guide draws y from p(y | x) at its own draw of x: Trace_ELBO's terms cancel per draw
    tr = pyro.poutine.trace(guide).get_trace(*args)
    x, y = tr.nodes["x"]["value"], tr.nodes["y"]["value"]
    assert x.shape == y.shape == (5, 4, 3)
    lp = tr.nodes["y"]["fn"].log_prob(y)
    want = dist.Bernoulli(0.2 + 0.6 * x).log_prob(y)
    assert torch.allclose(lp, want)
    elbo = Trace_ELBO(num_particles=50).loss(model, guide, *args)
    assert elbo == pytest.approx(0.0, abs=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_discrete_latent_that_needs_enumeration_is_refused_by_name(dtype):
    def model(data):
        with pyro.plate("rows", 4, dim=-1):
            x = pyro.sample("x", dist.Bernoulli(data.new_tensor(0.3)))
            assert x.shape == (4,), x.shape
            pyro.sample("y", dist.Normal(2.0 * x, 1.0), obs=data)

    data = torch.tensor([0.1, 2.2, 1.9, -0.3], dtype=dtype)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    with pytest.raises(ValueError, match=r"enumeration dims \(AssertionError.*'x'"):
        svi.step(data)


@pytest.mark.parametrize("dtype", DTYPES)
def test_discrete_dependencies_without_enumeration_match_the_enumerated_ones(dtype):
    """The same model with and without its assert: the moved runs find what Pyro's enumeration
    bookkeeping finds (``y`` reads ``x``; ``z`` reads neither)."""
    from pyro_cvi.model.dependencies import moved_discrete_dependencies
    from pyro_cvi.model.tracing import trace_model

    def model(data):
        with pyro.plate("rows", 3, dim=-1):
            x = pyro.sample("x", dist.Categorical(data.new_tensor([0.2, 0.3, 0.5])))
            pyro.sample("y", dist.Normal(x.to(data.dtype), 1.0), obs=data)
            pyro.sample("z", dist.Bernoulli(data.new_tensor(0.4)))

    data = torch.zeros(3, dtype=dtype)
    values = {"x": torch.tensor([0, 2, 1]), "z": torch.zeros(3, dtype=dtype)}
    tr = trace_model(model, values, (data,), {})

    def rerun(moved):
        return trace_model(model, {**values, **moved}, (data,), {})

    deps = moved_discrete_dependencies(tr, ["x", "z"], rerun)
    assert deps == {"x": set(), "y": {"x"}, "z": set()}
