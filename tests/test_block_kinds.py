"""The registry of block kinds (``pyro_cvi/blocks/registry.py``): the engine builds its blocks
from the registered kinds and never names one, so a new kind is one file and one registration.

The toy kind here claims every scalar Gaussian block spec before the built-in site kind sees
it and fits it with :class:`ConjugateScalarBlock` (the worked example of docs/architecture.md,
exact conjugate messages); beside it the built-in kinds (a Gamma natural block in the mean
field, a Gaussian block) fit as without it.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from test_block_protocol import ConjugateScalarBlock

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks import (
    GaussianBlock,
    MeanFieldBlock,
    RemainderBlock,
    register_kind,
    registered_kinds,
    unregister_kind,
)


def build_toy(found):
    """The toy kind: every scalar Gaussian block spec becomes a :class:`ConjugateScalarBlock`."""
    specs = found.take_specs(lambda s: len(s.names) == 1 and s.dim == 1 and s.chain is None)
    return [
        ConjugateScalarBlock(s, found.prefix, found.owned_by(s.index), found.options) for s in specs
    ]


@pytest.fixture
def toy_kind():
    register_kind("toy scalar", 5, build_toy)  # the one registration
    yield
    unregister_kind("toy scalar")


def model(y, counts, X, labels):
    x = pyro.sample("x", dist.Normal(y.new_tensor(1.0), 2.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(3.0 * x - 1.0, 0.5), obs=y)
    rate = pyro.sample("rate", dist.Gamma(y.new_tensor(2.0), 1.0))
    with pyro.plate("counts", len(counts)):
        pyro.sample("c", dist.Poisson(rate), obs=counts)
    w = pyro.sample("w", dist.Normal(y.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("labels", len(labels)):
        pyro.sample("b", dist.Bernoulli(logits=X @ w), obs=labels)


def _data(dtype):
    g = torch.Generator().manual_seed(3)
    y = torch.tensor([2.0, 1.5, 2.7, 1.9], dtype=dtype)
    counts = torch.tensor([3.0, 1.0, 4.0, 2.0, 2.0], dtype=dtype)
    X = torch.randn(20, 2, generator=g, dtype=torch.float64).to(dtype)
    labels = (X[:, 0] > 0).to(dtype)
    return y, counts, X, labels


def _fit(data, steps=10):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    losses = [svi.step(*data) for _ in range(steps)]
    return guide, losses


def test_the_builtin_kinds_are_registered_in_rank_order():
    names = [k.name for k in registered_kinds()]
    assert names[:3] == ["site", "mean field", "remainder"]
    ranks = [k.rank for k in registered_kinds()]
    assert ranks == sorted(ranks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_new_kind_is_fitted_by_the_engine_beside_the_builtin_kinds(toy_kind, dtype):
    data = _data(dtype)
    guide, losses = _fit(data)
    kinds = guide.engine.kinds
    assert list(kinds) == ["toy scalar", "site", "mean field"]
    assert [type(b) for b in kinds["toy scalar"]] == [ConjugateScalarBlock]
    assert [type(b) for b in kinds["site"]] == [GaussianBlock]
    assert [type(b) for b in kinds["mean field"]] == [MeanFieldBlock]
    assert guide.engine.block_for("x") is kinds["toy scalar"][0]
    # x's q is the exact posterior (its factors are its own: eq. 2)
    y = data[0].double()
    prec = 1 / 4 + len(y) * 9 / 0.25
    mean = (1.0 / 4 + (3.0 * (y + 1.0)).sum().item() / 0.25) / prec
    q = guide.posterior("x")
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    assert abs(q.mean.double().item() - mean) < tol * (1 + abs(mean))
    assert abs(q.variance.double().item() - 1 / prec) < tol / prec
    # the other kinds fit as without the toy kind: the same q of rate and w
    unregister_kind("toy scalar")
    ref, ref_losses = _fit(data)
    assert isinstance(ref.engine.block_for("x"), GaussianBlock)
    for name in ("rate", "w"):
        a, b = guide.posterior(name), ref.posterior(name)
        assert torch.allclose(a.mean, b.mean, rtol=1e-4 if dtype == torch.float32 else 1e-9)
        assert torch.allclose(a.variance, b.variance, rtol=1e-4 if dtype == torch.float32 else 1e-9)
    # and the same bound: every factor is counted once, whichever kind owns it
    assert abs(losses[-1] - ref_losses[-1]) < (1e-3 if dtype == torch.float32 else 1e-8)


def test_the_remainder_is_a_kind_like_the_others():
    """A latent without an exact message: the engine holds the remainder kind's block only."""

    def model(y):
        s = pyro.sample("s", dist.LogNormal(y.new_tensor(0.0), 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.StudentT(3.0, 0.0, s), obs=y)

    y = torch.tensor([0.3, -1.2, 2.0, 0.1], dtype=torch.float64)
    guide = AutoCVI(model)
    guide(y)
    assert [type(b) for b in guide.engine.kinds["remainder"]] == [RemainderBlock]
    assert guide.engine.blocks == guide.engine.kinds["remainder"]
