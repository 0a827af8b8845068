"""Label-symmetric components start apart (``blocks.exchangeable.init_apart``, opt-in): a
mixture's and an HMM's component parameters under Pyro's generic starts go to the prior's K-point
quantization
(checked against the prior's closed-form CDF and quantile function); sites whose relabelling
the data see, sites the data do not see yet, and a user's own values keep their start, drawn
from torch's random stream exactly as without the test."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.infer.autoguide.initialization import (
    InitMessenger,
    init_to_mean,
    init_to_median,
    init_to_value,
)

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks.exchangeable import init_apart
from pyro_cvi.blocks.natural import init_messenger

DTYPES = [torch.float32, torch.float64]


def hmm_exp(y):
    rates = pyro.sample("rates", dist.Gamma(y.new_full((3,), 2.0), 1.0).to_event(1))
    trans = pyro.sample("trans", dist.Dirichlet(y.new_ones(3, 3)).to_event(1))
    pyro.sample("y", dist.DiscreteHMM(y.new_zeros(3), trans.log(), dist.Exponential(rates)), obs=y)


def mixture(y):
    weights = pyro.sample("weights", dist.Dirichlet(y.new_ones(2)))
    scale = pyro.sample("scale", dist.HalfNormal(y.new_tensor(2.0)))
    with pyro.plate("components", 2):
        locs = pyro.sample("locs", dist.Normal(y.new_tensor(0.0), 5.0))
    with pyro.plate("data", y.shape[0]):
        z = pyro.sample("z", dist.Categorical(weights))
        pyro.sample("obs", dist.Normal(locs[z], scale), obs=y)


def regression(x, y):
    b = pyro.sample("b", dist.Normal(x.new_zeros(3), 1.0).to_event(1))
    with pyro.plate("features", 3):
        c = pyro.sample("c", dist.Normal(x.new_tensor(0.0), 1.0))
    pyro.sample("y", dist.Normal(x @ (b + c), 1.0).to_event(1), obs=y)


def network(x, y):
    """A one-hidden-layer network: at the all-zero start the output reads no hidden unit."""
    w1 = pyro.sample("w1", dist.Normal(x.new_zeros(4, 2), 1.0).to_event(2))
    b1 = pyro.sample("b1", dist.Normal(x.new_zeros(4), 1.0).to_event(1))
    w2 = pyro.sample("w2", dist.Normal(x.new_zeros(4), 1.0).to_event(1))
    h = torch.tanh(x @ w1.T + b1)
    pyro.sample("y", dist.Normal(h @ w2, 1.0).to_event(1), obs=y)


def _starts(model, init, *args):
    pyro.set_rng_seed(0)
    tr = pyro.poutine.trace(init_messenger(init_apart(init))(model)).get_trace(*args)
    return {n: s["value"] for n, s in tr.nodes.items() if s["type"] == "sample"}


def _plain(model, init, *args):
    pyro.set_rng_seed(0)
    tr = pyro.poutine.trace(InitMessenger(init)(model)).get_trace(*args)
    return {n: s["value"] for n, s in tr.nodes.items() if s["type"] == "sample"}


def _hmm_data(dtype, T=60):
    g = torch.Generator().manual_seed(1)
    return (-torch.rand(T, generator=g, dtype=torch.float64).log()).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("init", [init_to_median, init_to_mean])
def test_hmm_rates_start_at_the_gamma_quantization(dtype, init):
    rates = _starts(hmm_exp, init, _hmm_data(dtype))["rates"]
    assert rates.dtype == dtype
    cdf = 1 - (1 + rates.double()) * (-rates.double()).exp()  # Gamma(2, 1)'s CDF
    # component k at quantile (k - 1/2) / 3, from 4,096 prior draws (sd of a quantile ~0.008)
    assert torch.allclose(cdf, torch.tensor([1 / 6, 1 / 2, 5 / 6], dtype=torch.float64), atol=0.03)
    assert bool((rates[1:] > rates[:-1]).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixture_locations_start_at_the_normal_quartiles(dtype):
    y = torch.cat([torch.full((5,), -2.0), torch.full((5,), 2.5)]).to(dtype)
    locs = _starts(mixture, init_to_median, y)["locs"]
    q = 5 * math.sqrt(2) * torch.erfinv(torch.tensor(0.5, dtype=torch.float64))  # 5 Phi^-1(3/4)
    expect = torch.tensor([-1.0, 1.0], dtype=torch.float64) * q
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert torch.allclose(locs.double(), expect, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("init", [init_to_median, init_to_mean])
def test_sites_the_data_tell_apart_keep_their_start_and_stream(dtype, init):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 3, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(20, generator=g, dtype=torch.float64).to(dtype)
    ours, after_ours = _starts(regression, init, x, y), torch.rand(2)
    plain, after_plain = _plain(regression, init, x, y), torch.rand(2)
    for name in ("b", "c"):
        assert torch.equal(ours[name], plain[name])  # bit for bit: same random medians
    assert torch.equal(after_ours, after_plain)  # the stream left where it was


@pytest.mark.parametrize("dtype", DTYPES)
def test_hidden_units_nothing_reads_yet_keep_their_start(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 2, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(10, generator=g, dtype=torch.float64).to(dtype)
    ours, plain = _starts(network, init_to_mean, x, y), _plain(network, init_to_mean, x, y)
    for name in ("w1", "b1", "w2"):
        assert torch.equal(ours[name], plain[name])
        assert bool((ours[name] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_without_init_apart_the_start_is_pyros(dtype):
    y = _hmm_data(dtype)
    pyro.set_rng_seed(0)
    tr = pyro.poutine.trace(init_messenger(init_to_median)(hmm_exp)).get_trace(y)
    assert torch.equal(tr.nodes["rates"]["value"], _plain(hmm_exp, init_to_median, y)["rates"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_users_own_values_are_kept(dtype):
    y = _hmm_data(dtype)
    given = torch.tensor([1.0, 1.0, 1.0], dtype=dtype)
    rates = _starts(hmm_exp, init_to_value(values={"rates": given}), y)["rates"]
    assert torch.equal(rates, given)


@pytest.mark.parametrize("dtype", DTYPES)
def test_autocvi_starts_the_mixture_apart_and_finds_both_components(dtype):
    g = torch.Generator().manual_seed(3)
    c = torch.rand(200, generator=g, dtype=torch.float64) < 0.4
    y = (torch.where(c, -2.0, 2.5) + torch.randn(200, generator=g, dtype=torch.float64)).to(dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(mixture, init_loc_fn=init_apart(init_to_median))
    svi = SVI(mixture, guide, CVI(), CVI_ELBO())
    for _ in range(100):
        svi.step(y)
    locs = guide.median(y)["locs"].double()
    # the two components near the data's two centres (posterior sd ~0.1), in the start's order
    assert torch.allclose(locs, torch.tensor([-2.0, 2.5], dtype=torch.float64), atol=0.4)
