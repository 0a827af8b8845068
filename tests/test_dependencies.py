"""Every dependency counts: a factor depends on a latent through its distribution's parameters
or through its observed value (``pyro.sample("z", d, obs=f(x))``, a soft constraint as Pyro's
own autoguide tests write it). Before, ``x`` was a "leaf" and ``q(x)`` stayed its prior."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def _fit(model, steps):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    for _ in range(steps):
        svi.step()
    return guide


@DTYPES
def test_latent_observed_through_its_value_gets_the_exact_posterior(dtype):
    def model():
        x = pyro.sample("x", dist.Normal(torch.tensor(0.0, dtype=dtype), 1.0))
        pyro.sample("z", dist.Normal(torch.tensor(3.0, dtype=dtype), 0.1), obs=x)

    guide = _fit(model, 30)
    assert "leaf" not in guide.explain()
    q = guide.posterior("x")
    # N(0, 1) N(x | 3, 0.1^2): precision 101, mean 3 * 100 / 101
    assert abs(float(q.mean) - 300 / 101) < 2e-3, q.mean
    assert abs(float(q.stddev) - math.sqrt(1 / 101)) < 2e-3, q.stddev


@DTYPES
def test_observed_value_of_a_function_of_a_positive_latent(dtype):
    """``obs=2 * s`` with a Gamma ``s`` (natural form): q's mean within 2% and sd within 10% of the
    posterior's (by quadrature on a fine grid; q is Gamma, the posterior is not)."""

    def model():
        s = pyro.sample("s", dist.Gamma(torch.tensor(2.0, dtype=dtype), 1.0))
        pyro.sample("c", dist.Normal(torch.tensor(3.0, dtype=dtype), 0.4), obs=2 * s)

    guide = _fit(model, 100)
    q = guide.posterior("s")
    x = torch.linspace(1e-4, 6, 200001, dtype=torch.float64)
    lp = dist.Gamma(2.0, 1.0).log_prob(x) + dist.Normal(3.0, 0.4).log_prob(2 * x)
    w = (lp - lp.max()).exp()
    w = w / w.sum()
    mean = (w * x).sum()
    sd = (w * (x - mean) ** 2).sum().sqrt()
    assert abs(float(q.mean) - float(mean)) < 0.02 * float(mean), (q.mean, mean)
    assert abs(float(q.stddev) - float(sd)) < 0.1 * float(sd), (q.stddev, sd)  # (the prior: 1.4)


def _two_clusters(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(50, generator=g, dtype=torch.float64)
    b = torch.randn(50, generator=g, dtype=torch.float64)
    return torch.cat([0.5 * a - 1.5, 0.5 * b + 1.5]).to(dtype)


def mixture_same_family(data):
    """Latents used only inside a distribution object: MixtureSameFamily's components."""
    w = pyro.sample("w", dist.Dirichlet(data.new_ones(2)))
    locs = pyro.sample("locs", dist.Normal(data.new_zeros(2), 5.0).to_event(1))
    with pyro.plate("data", len(data)):
        mix = dist.MixtureSameFamily(dist.Categorical(w), dist.Normal(locs, 0.5))
        pyro.sample("obs", mix, obs=data)


def discrete_hmm(y):
    """Emission means used only inside a DiscreteHMM, scored over all T steps at once."""
    locs = pyro.sample("locs", dist.Normal(y.new_tensor([-1.0, 1.0]), 2.0).to_event(1))
    trans = y.new_tensor([[0.9, 0.1], [0.1, 0.9]]).log()
    init = y.new_tensor([0.5, 0.5]).log()
    pyro.sample("y", dist.DiscreteHMM(init, trans, dist.Normal(locs, 0.5)), obs=y)


def _fit_args(model, args, steps):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    losses = [svi.step(*args) for _ in range(steps)]
    return guide, losses


@DTYPES
def test_latents_inside_a_distribution_object_get_q(dtype):
    """MixtureSameFamily and DiscreteHMM hold their latents inside the distribution object (no
    ``arg_constraints`` entry): found through autograd of ``log_prob``, so they are no leaves,
    and their q moves to the clusters (which a leaf's prior, N(0, 5^2), would not)."""
    data = _two_clusters(dtype)
    guide, losses = _fit_args(mixture_same_family, (data,), 150)
    assert "leaf" not in guide.explain()
    locs = guide.median()["locs"].double().sort().values
    assert torch.allclose(locs, torch.tensor([-1.5, 1.5], dtype=torch.float64), atol=0.25), locs
    assert all(math.isfinite(v) for v in losses)
    guide, losses = _fit_args(discrete_hmm, (data,), 60)  # y of shape (T,): no false error
    assert "leaf" not in guide.explain()
    locs = guide.median()["locs"].double()
    assert torch.allclose(locs, torch.tensor([-1.5, 1.5], dtype=torch.float64), atol=0.25), locs


def test_a_value_of_the_wrong_shape_is_still_refused():
    """The shape check stays for laws that do not score the whole value per batch element."""

    def model(y):
        m = pyro.sample("m", dist.Normal(y.new_tensor(0.0), 1.0))
        with pyro.plate("data", 5):
            pyro.sample("y", dist.Normal(m, 1.0), obs=y)

    with pytest.raises(ValueError, match="observed site 'y' has shape"):
        _fit_args(model, (torch.zeros(5, 1, dtype=torch.float64),), 1)
