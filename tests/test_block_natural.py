"""``pyro_cvi.blocks.natural`` and ``pyro_cvi.blocks.mean_field``: Algorithm 2's blocks.

Beta-Bernoulli and Gamma-Poisson are conjugate: one step at ``step_size=1`` gives the exact
posterior; a fixed step ``beta`` moves the natural parameters ``beta`` of the way (eq. 12);
inside a subsampled plate only the minibatch's rows of a local block move."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks import MeanFieldBlock, NaturalBlock


def coin(y):
    f = pyro.sample("f", dist.Beta(torch.tensor(2.0, dtype=y.dtype), 3.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Bernoulli(f), obs=y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_conjugate_step_is_exact_and_a_fixed_step_is_eq_12(dtype):
    y = torch.tensor([1, 0, 1, 1, 1, 0, 1], dtype=dtype)
    guide = AutoCVI(coin)
    svi = SVI(coin, guide, CVI(step_size=0.25), loss=CVI_ELBO())
    guide(y)
    (mf,) = guide.engine.blocks
    assert isinstance(mf, MeanFieldBlock) and isinstance(mf.natural["f"], NaturalBlock)
    nb = mf.natural["f"]
    old = [p.detach().clone() for p in nb.params()]
    svi.step(y)
    q = guide.posterior("f")
    a, b = 2.0 + y.sum().item(), 3.0 + (1 - y).sum().item()
    # natural parameters of Beta(a, b) are (a - 1, b - 1) up to the family's convention: the
    # step covers a quarter of the way from the prior to the exact posterior in them
    target = mf.targets(guide.engine.context((y,), {}, {}, grads=False))["f"]
    for o, t, p in zip(old, target, nb.params()):
        assert torch.allclose(p.detach(), o + 0.25 * (t - o), atol=1e-6)
    svi_exact = SVI(coin, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    svi_exact.step(y)
    q = guide.posterior("f")
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert abs(q.concentration1.item() - a) < tol * a
    assert abs(q.concentration0.item() - b) < tol * b
    assert nb.valid() and mf.valid()
    assert set(mf.sample({})) == {"f"} and mf.sample({}, exclude=("f",)) == {}


def gamma_poisson(counts):
    with pyro.plate("units", len(counts), subsample_size=2) as idx:
        rate = pyro.sample("rate", dist.Gamma(torch.tensor(2.0, dtype=counts.dtype), 1.0))
        pyro.sample("c", dist.Poisson(rate), obs=counts[idx])


def test_local_blocks_step_only_their_minibatch_rows():
    counts = torch.tensor([3.0, 0.0, 7.0, 1.0, 4.0], dtype=torch.float64)
    guide = AutoCVI(gamma_poisson)
    svi = SVI(gamma_poisson, guide, CVI(step_size=0.5), loss=CVI_ELBO())
    guide(counts)
    nb = guide.engine.stepper["rate"]
    before = [p.detach().clone() for p in nb.params()]
    pyro.set_rng_seed(1)
    svi.step(counts)
    after = [p.detach() for p in nb.params()]
    moved = (after[0] != before[0]).reshape(len(counts), -1).any(-1)
    assert int(moved.sum()) == 2  # the minibatch's two rows, updated with beta = 1
    rows = moved.nonzero().reshape(-1)
    q = guide.posterior("rate")  # exact Gamma(2 + c_n, 1 + 1) on the updated rows
    conc = q.concentration.reshape(-1)[rows]
    assert torch.allclose(conc, 2.0 + counts[rows])
    assert torch.allclose(q.rate.reshape(-1)[rows], torch.full((2,), 2.0, dtype=torch.float64))


def gamma_chain(y):
    z1 = pyro.sample("z1", dist.Gamma(torch.tensor(2.0, dtype=y.dtype), 4.0))
    z2 = pyro.sample("z2", dist.Gamma(torch.tensor(3.0, dtype=y.dtype), 1.0 / z1))
    z3 = pyro.sample("z3", dist.Gamma(torch.tensor(0.1, dtype=y.dtype), 0.2 / z2))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Poisson(z3), obs=y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gamma_latents_start_at_the_prior_means_of_their_parents_means(dtype):
    """Without ``init_loc_fn`` a Gamma ``q`` starts at mean ``E[z | parents at their means]``
    with the prior's shape (at least 1), whatever the prototype draw upstream: z1 ~ Gamma(2, 4)
    at Gamma(2, 4); z2 at Gamma(3, 1 / 0.5); z3 (prior shape 0.1) at shape 1 and mean
    0.1 * 1.5 / 0.2."""
    y = torch.tensor([0.0, 2.0, 1.0], dtype=dtype)
    expected = {"z1": (2.0, 4.0), "z2": (3.0, 2.0), "z3": (1.0, 1.0 / 0.75)}
    for seed in (0, 1):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        guide = AutoCVI(gamma_chain)
        guide(y)
        for name, (shape, rate) in expected.items():
            q = guide.posterior(name)
            tol = 1e-6 if dtype == torch.float32 else 1e-12
            assert abs(q.concentration.item() - shape) < tol * shape, name
            assert abs(q.rate.item() - rate) < tol * rate, name
