"""Unit tests of the one classifier (pyro_cvi.model.analysis): blocks, factor kinds and owners."""

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer import SVI
from pyro.infer.autoguide.initialization import init_to_sample

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.model.analysis import CONJUGATE, GENERAL, LINEAR, MEANFIELD, PRIOR, Analysis

F64 = torch.float64


def _analysis(model, *args, **kwargs):
    guide = AutoCVI(model, **kwargs)
    guide(*args)
    return guide.engine.analysis


def test_sites_sharing_a_factor_form_one_block_and_others_do_not():
    x = torch.linspace(-1, 1, 10, dtype=F64)

    def model(x):
        a = pyro.sample("a", dist.Normal(x.new_zeros(()), 10.0))
        b = pyro.sample("b", dist.Normal(x.new_zeros(()), 1.0))
        c = pyro.sample("c", dist.Normal(x.new_zeros(()), 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(a + b * x, 0.5), obs=x)
            pyro.sample("z", dist.Bernoulli(logits=c * x), obs=(x > 0).to(F64))

    an = _analysis(model, x)
    assert [b.names for b in an.blocks] == [("a", "b"), ("c",)]
    assert an.owner["y"] == 0 and an.owner["z"] == 1 and an.owner["a"] == 0
    kinds = {(f.site, f.kind) for b in an.blocks for f in b.factors}
    assert kinds == {("a", PRIOR), ("b", PRIOR), ("y", CONJUGATE), ("c", PRIOR), ("z", LINEAR)}
    A = next(f.jacobian for f in an.blocks[0].factors if f.site == "y")
    torch.testing.assert_close(A, torch.stack([torch.ones_like(x), x], 1))
    assert "# a, b: q = joint gaussian, D=2 (site form)" in an.explain()


def test_shared_factor_with_a_natural_latent_is_conjugate_given_it():
    X = torch.randn(20, 3, dtype=F64)

    def model(X):
        w = pyro.sample("w", dist.Normal(X.new_zeros(3), 1.0).to_event(1))
        tau = pyro.sample("tau", dist.Gamma(X.new_tensor(2.0), 2.0))
        with pyro.plate("data", 20):
            pyro.sample("y", dist.Normal(X @ w, tau.rsqrt()), obs=X[:, 0])

    an = _analysis(model, X)
    assert an.latents["tau"].form == "natural" and an.latents["w"].form == "site"
    assert an.owner["y"] == MEANFIELD  # its ELBO term: exact over both, counted once
    f = next(f for f in an.blocks[0].factors if f.site == "y")
    assert f.kind == CONJUGATE and f.given_others
    tau = next(f for f in an.latents["tau"].factors if f.site == "y")
    assert tau.kind == CONJUGATE


def test_non_affine_and_two_parameter_factors_are_general():
    x = torch.linspace(-1, 1, 10, dtype=F64)

    def model(x):
        a = pyro.sample("a", dist.Normal(x.new_zeros(()), 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(a**3 * x, 1.0), obs=x)
            pyro.sample("v", dist.Normal(a * x, a.exp()), obs=x)

    an = _analysis(model, x, remainder="off")
    kinds = {f.site: (f.kind, f.reason) for f in an.blocks[0].factors}
    assert kinds["y"][0] == GENERAL and "not affine" in kinds["y"][1]
    assert kinds["v"][0] == GENERAL and "loc, scale depend on a" in kinds["v"][1]


def test_factors_without_latents_are_constants_in_the_loss():
    """An observation with a learnable scale and no latent parent is part of the bound."""
    x = torch.linspace(-1, 1, 10, dtype=F64)

    def model(x):
        s = pyro.param("s", torch.tensor(0.7, dtype=F64))
        m = pyro.sample("m", dist.Normal(x.new_zeros(()), 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(m, 1.0), obs=x)
            pyro.sample("noise", dist.Normal(0.0, s), obs=x)

    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    svi.step(x)
    loss = svi.evaluate_loss(x)
    # exact: -log p(y) of the conjugate part, minus the constant factor
    n = len(x)
    cov = torch.eye(n, dtype=F64) + torch.ones(n, n, dtype=F64)
    log_py = dist.MultivariateNormal(x.new_zeros(n), cov).log_prob(x)
    s = pyro.param("s").detach()  # (moved by the hybrid Adam step)
    log_noise = dist.Normal(0.0, s).log_prob(x).sum()
    assert abs(loss - float(-(log_py + log_noise))) < 1e-9
    assert guide.engine.analysis.owner["noise"] == "constant"


def test_markov_recycled_enumeration_dims_do_not_make_false_dependencies():
    """``x_2`` and ``x_0`` share an enumeration dim under pyro.markov, but not an id."""
    y = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=F64)

    def model(y):
        probs = torch.tensor([[0.9, 0.1], [0.2, 0.8]], dtype=F64)
        x = 0
        for t in pyro.markov(range(len(y))):
            x = pyro.sample(f"x_{t}", dist.Categorical(probs[x]))
            pyro.sample(f"y_{t}", dist.Bernoulli(probs[x, 1]), obs=y[t])

    trace = poutine.trace(poutine.block(model, hide_fn=lambda s: s["is_observed"])).get_trace(y)
    an = Analysis(model, (y,), {}, trace)
    assert an.deps["y_2"] == {"x_2"}
    assert an.deps["x_2"] == {"x_1"}
    assert an.deps["x_3"] == {"x_2"}


def test_setup_runs_the_model_a_small_fixed_number_of_times():
    calls = []
    X = torch.randn(30, 4, dtype=F64)

    def model(X, y=None):
        calls.append(1)
        w = pyro.sample("w", dist.Normal(X.new_zeros(4), 1.0).to_event(1))
        b = pyro.sample("b", dist.Normal(X.new_zeros(()), 1.0))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)

    y = (X[:, 0] > 0).to(F64)
    guide = AutoCVI(model, init_loc_fn=init_to_sample)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    svi.step(X, y)
    # prototype, analysis, one run at moved values (dependencies autograd does not record),
    # three probe runs (two random moves and a reflection through zero, shared by the block's
    # factors), the start at init_loc_fn's values,
    # initial q; the model has no learnable parameter, so its trace at the block's fixed point
    # is reused, and each step runs it once more only to see a change of its structure
    assert len(calls) == 9
    svi.step(X, y)
    assert len(calls) == 10
    Xc = X.clone()
    svi.step(Xc, y)  # new data: analysed and traced again, once
    n = len(calls)
    svi.step(Xc, y)
    svi.step(Xc, y)
    assert len(calls) == n + 2


def test_a_model_with_parameters_is_traced_once_per_step():
    calls = []
    X = torch.randn(30, 4, dtype=F64)

    def model(X, y=None):
        calls.append(1)
        s = pyro.param("s", torch.tensor(1.0, dtype=F64))
        w = pyro.sample("w", dist.Normal(X.new_zeros(4), s).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    y = (X[:, 0] > 0).to(F64)
    svi = SVI(model, AutoCVI(model), CVI(step_size=1.0), loss=CVI_ELBO())
    svi.step(X, y)
    n = len(calls)
    for _ in range(3):
        svi.step(X, y)
    assert len(calls) == n + 3
