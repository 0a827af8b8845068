"""Sequential subsample plates in every block kind (here: a natural-form Beta latent, the mean
field): Pyro's SVI Part II tutorial model, whose site names (``obs_{i}``) change with every
minibatch, a short last minibatch given by the user's own indices (vectorised and sequential
plates), all in float32 and float64. Stochastic (minibatch) CVI with the default step
converges to the exact Beta posterior."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from test_loss_is_bound import assert_loss_is_bound

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def coin_part2(data):
    """Pyro's SVI Part II tutorial, as written there."""
    f = pyro.sample("latent_fairness", dist.Beta(data.new_tensor(10.0), data.new_tensor(10.0)))
    for i in pyro.plate("data_loop", len(data), subsample_size=5):
        pyro.sample(f"obs_{i}", dist.Bernoulli(f), obs=data[i])


@DTYPES
def test_svi_part2_coin_converges_to_the_exact_posterior(dtype):
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    data = torch.tensor([1.0] * 6 + [0.0] * 4, dtype=dtype)
    guide = AutoCVI(coin_part2)
    svi = SVI(coin_part2, guide, CVI(), CVI_ELBO())
    for _ in range(300):
        svi.step(data)
    q = guide.posterior("latent_fairness")
    # exact: Beta(10 + 6, 10 + 4); minibatch noise left by the Robbins-Monro schedule
    a, b = float(q.concentration1), float(q.concentration0)
    assert abs(a - 16.0) < 1.5 and abs(b - 14.0) < 1.5, (a, b)
    assert q.concentration1.dtype == dtype
    # the reported loss is the bound of this q (minibatch estimates on both sides)
    assert_loss_is_bound(coin_part2, guide, svi, (data,), M=30, P=10, z=3.0)


def _vectorised(data, idx):
    f = pyro.sample("f", dist.Beta(data.new_tensor(2.0), data.new_tensor(2.0)))
    with pyro.plate("data", len(data), subsample=idx) as i:
        pyro.sample("obs", dist.Bernoulli(f), obs=data[i])


def _sequential(data, idx):
    f = pyro.sample("f", dist.Beta(data.new_tensor(2.0), data.new_tensor(2.0)))
    for i in pyro.plate("data", len(data), subsample=idx):
        pyro.sample(f"obs_{i}", dist.Bernoulli(f), obs=data[i])


@DTYPES
@pytest.mark.parametrize("model", [_vectorised, _sequential], ids=["vectorised", "sequential"])
def test_short_last_minibatch(model, dtype):
    """Minibatches of 4, 4 and 2 (the user's indices): every epoch's steps stay finite and q
    ends near the exact Beta(2 + 7, 2 + 3)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    data = torch.tensor([1.0, 1, 0, 1, 0, 1, 1, 0, 1, 1], dtype=dtype)
    batches = [torch.arange(0, 4), torch.arange(4, 8), torch.arange(8, 10)]
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    for _ in range(60):
        for b in batches:
            loss = svi.step(data, b)
            assert torch.isfinite(torch.tensor(loss))
    q = guide.posterior("f")
    a, b = float(q.concentration1), float(q.concentration0)
    assert abs(a - 9.0) < 1.0 and abs(b - 5.0) < 1.0, (a, b)
