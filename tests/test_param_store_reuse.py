"""A second guide built in the same param store (no ``pyro.clear_param_store()`` between two
models fitted one after another) whose parameters were left there by a guide of another model
with other shapes: a ``ValueError`` naming the parameter and saying what to do, raised at
set-up (the guide usable once the store is cleared), never torch's raw reshape error later.
A guide of the same model built again resumes from the store (Pyro's rule), as before."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

DTYPES = [torch.float32, torch.float64]


def _logistic(n):  # a Gaussian block with one site per data point: <prefix>.sites.y
    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
        with pyro.plate("data", n):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model


def _remainder(n):  # a non-conjugate scale: the remainder's joint Gaussian (<prefix>.remainder)
    def model(X, y):
        s = pyro.sample("s", dist.LogNormal(X.new_zeros(n), 1.0).to_event(1))
        pyro.sample("y", dist.StudentT(3.0, X.new_zeros(n), s).to_event(1), obs=y[:n])

    return model


def _natural(n):  # Beta-Bernoulli rates: the mean field's natural parameters (<prefix>.natural*)
    def model(X, y):
        with pyro.plate("groups", n):
            p = pyro.sample("p", dist.Beta(X.new_tensor(2.0), X.new_tensor(2.0)))
            pyro.sample("y", dist.Bernoulli(p), obs=y[:n])

    return model


KINDS = {"sites": _logistic, "remainder": _remainder, "natural": _natural}


def _data(dtype, n=30):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(n, 2, generator=g, dtype=torch.float64).to(dtype)
    y = (torch.rand(n, generator=g, dtype=torch.float64) < 0.5).to(dtype)
    return X, y


def _fit(model, X, y, steps=2):
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    return guide, [svi.step(X, y) for _ in range(steps)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_another_models_parameters_in_the_store_are_a_named_error(kind, dtype):
    make = KINDS[kind]
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    X, y = _data(dtype, 30)
    _fit(make(20), X[:20], y[:20])
    assert any(f".{kind}" in n for n in pyro.get_param_store().keys())
    X2, y2 = _data(dtype, 30)
    model = make(30)
    svi = SVI(model, AutoCVI(model), CVI(), CVI_ELBO())
    with pytest.raises(ValueError, match=r"clear_param_store\(\)") as info:
        svi.step(X2, y2)
    msg = str(info.value)
    assert f"'AutoCVI.{kind}" in msg and "(20" in msg and "(30" in msg
    # the failed set-up leaves the guide usable: cleared, the same guide fits the new model
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    losses = [svi.step(X2, y2) for _ in range(3)]
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    _, fresh = _fit(make(30), X2, y2, 3)
    assert losses == fresh  # (the same fit as a fresh guide's, bit for bit)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_other_dtypes_parameters_in_the_store_are_a_named_error(dtype):
    other = torch.float64 if dtype == torch.float32 else torch.float32
    pyro.clear_param_store()
    X, y = _data(other)
    _fit(_logistic(30), X, y)
    X, y = _data(dtype)
    with pytest.raises(ValueError, match=f"AutoCVI.sites.y.*{other}.*{dtype}"):
        _fit(_logistic(30), X, y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_guide_of_the_same_model_built_again_resumes_from_the_store(dtype):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    X, y = _data(dtype)
    model = _remainder(30)
    first, _ = _fit(model, X, y, 5)
    loc = pyro.param("AutoCVI.remainder.loc").detach().clone()
    del first
    guide = AutoCVI(model)
    SVI(model, guide, CVI(), CVI_ELBO()).evaluate_loss(X, y)  # (set-up only: no step)
    assert torch.equal(pyro.param("AutoCVI.remainder.loc").detach(), loc)
