"""CVI parameters set from outside the engine: every block's ``q`` follows them.

A guide is fitted a step, its parameters saved, fitted further, and the saved values put
back in one of the ways a user (or a restore) writes them: ``store[k].data.copy_(v)`` (a copy
that leaves the version counter as it was), ``with torch.no_grad(): p.copy_(v)``,
``store.set_state(...)``, ``store[k] = v`` (a new tensor) and ``store.save`` / ``store.load``.
Then the guide's ``evaluate_loss`` and its next ``svi.step``'s loss are those of a fresh guide
built over the same param store (``1e-12`` in float64; ``2e-5`` in float32, where the offsets of
the model's trace, read at another point by the fresh guide, round otherwise), and the values after
the step are the fresh guide's to their last digits, for each kind of
block that keeps its ``q`` between steps: the random walk's and the ``pyro.markov`` loop's Markov
blocks, the Markov GP's short path, a Gaussian block of a static model, and a walk with latent
scales beside the remainder.
"""

from __future__ import annotations

import copy

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from test_markov_float32 import scaled_walk  # a walk whose scales are remainder latents

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
D64 = torch.float64


def _counts(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(T, dtype=D64)
    return torch.poisson(torch.exp(torch.sin(t / 6.0) + 0.5), generator=g)


def walk(y):
    """A random walk (``cumsum``) observed through Poisson counts."""
    with pyro.plate("time", y.shape[0]):
        eps = pyro.sample("eps", dist.Normal(y.new_tensor(0.0), 0.3))
    with pyro.plate("obs", y.shape[0]):
        pyro.sample("y", dist.Poisson(eps.cumsum(-1).exp()), obs=y)


def loop(y):
    """The same walk as a ``pyro.markov`` loop."""
    x = pyro.sample("x_0", dist.Normal(y.new_tensor(0.0), 1.0))
    pyro.sample("y_0", dist.Poisson(x.exp()), obs=y[0])
    for t in pyro.markov(range(1, len(y))):
        x = pyro.sample(f"x_{t}", dist.Normal(x, 0.3))
        pyro.sample(f"y_{t}", dist.Poisson(x.exp()), obs=y[t])


def gp(t, y):
    """A Matern-3/2 GP observed through Poisson counts (the short path of ``markov_fast``)."""
    from pyro_cvi.statespace import Matern32, markov_gp

    f = markov_gp("f", t, Matern32(lengthscale=5.0, variance=1.0))
    with pyro.plate("t", len(t)):
        pyro.sample("y", dist.Poisson(f.exp()), obs=y)


def logistic(x, y):
    """A logistic regression: a Gaussian block of a static model (its trace kept)."""
    w = pyro.sample("w", dist.Normal(x.new_zeros(3), 1.0).to_event(1))
    with pyro.plate("n", len(y)):
        pyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def _logistic_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, generator=g, dtype=D64)
    w = torch.tensor([1.5, -2.0, 0.5], dtype=D64)
    return x, torch.bernoulli(torch.sigmoid(x @ w), generator=g)


def _level(T):
    g = torch.Generator().manual_seed(2)
    return (0.3 * torch.randn(T, generator=g, dtype=D64)).cumsum(0) + 0.2 * torch.randn(
        T, generator=g, dtype=D64
    )


#: ``model, data, the block kinds it takes``
CASES = {
    "walk": (walk, lambda: (_counts(30),), ["MarkovBlock"]),
    "loop": (loop, lambda: (_counts(12),), ["MarkovBlock"]),
    "gp": (gp, lambda: (torch.arange(40, dtype=D64), _counts(40)), ["MarkovBlock"]),
    "gaussian": (logistic, _logistic_data, ["GaussianBlock"]),
    "scaled_walk": (scaled_walk, lambda: (_level(70),), ["ScaledMarkovBlock", "RemainderBlock"]),
}


def _put(values, state, how, tmp_path):
    """Put the saved ``values`` (unconstrained) / ``state`` back into the param store ``how``."""
    store = pyro.get_param_store()
    if how == "data":
        for k, v in values.items():
            store.get_param(k).unconstrained().data.copy_(v)
    elif how == "no_grad":
        with torch.no_grad():
            for k, v in values.items():
                store.get_param(k).unconstrained().copy_(v)
    elif how == "set_state":
        store.set_state(copy.deepcopy(state))
    elif how == "setitem":
        for k in values:
            store[k] = state["params"][k].detach().clone()  # (constrained: as the user sees it)
    else:  # save and load
        path = tmp_path / "params.pt"
        saved = pyro.get_param_store().get_state()
        store.set_state(copy.deepcopy(state))
        store.save(path)
        store.set_state(saved)
        store.load(path)


def _values():
    store = pyro.get_param_store()
    return {k: store.get_param(k).unconstrained().detach().clone() for k in store.keys()}


def _fit(model, args, optim, steps):
    guide = AutoCVI(model)
    svi = SVI(model, guide, optim, CVI_ELBO())
    for _ in range(steps):
        svi.step(*args)
    return guide, svi


def _then(svi, args):
    """The loss of the current ``q`` (seed 1), the next step's loss (seed 2) and the values
    after it."""
    pyro.set_rng_seed(1)
    with torch.no_grad():
        loss = svi.evaluate_loss(*args)
    pyro.set_rng_seed(2)
    step = svi.step(*args)
    return loss, step, _values()


@DTYPES
@pytest.mark.parametrize("how", ["data", "no_grad", "set_state", "setitem", "load"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("auto", [False, True], ids=["fixed", "auto"])
def test_values_set_from_outside_are_those_of_a_fresh_guide(case, how, auto, dtype, tmp_path):
    """Fitted a step, saved, fitted 3 more, the saved values put back ``how``: the loss, the
    next step's loss and the values after it are a fresh guide's over the same store, and the
    loss differs from the one before the values were put back (a stale ``q`` fails)."""
    model, data, kinds = CASES[case]
    args = tuple(a.to(dtype) for a in data())
    optim = CVI if auto else (lambda: CVI(step_size=0.5))
    pyro.set_rng_seed(0)
    guide, svi = _fit(model, args, optim(), 1)
    assert [type(b).__name__ for b in guide.engine.blocks] == kinds
    values, state = _values(), copy.deepcopy(pyro.get_param_store().get_state())
    for _ in range(3):
        svi.step(*args)
    pyro.set_rng_seed(1)
    with torch.no_grad():
        before = svi.evaluate_loss(*args)
    _put(values, state, how, tmp_path)
    now = copy.deepcopy(pyro.get_param_store().get_state())
    loss, step, after = _then(svi, args)
    pyro.clear_param_store()
    pyro.get_param_store().set_state(now)
    fresh = SVI(model, AutoCVI(model), optim(), CVI_ELBO())
    loss0, step0, after0 = _then(fresh, args)
    # (float32: the offsets of the model's trace, which the fresh guide reads at another point)
    tol = 1e-12 if dtype == D64 else 2e-5
    assert abs(before - loss0) > max(1e-6, 10 * tol) * abs(loss0), (before, loss0)
    assert abs(loss - loss0) <= tol * abs(loss0), (loss, loss0)
    assert abs(step - step0) <= tol * abs(step0), (step, step0)
    # (the step's offsets are read at the model's trace, which a fresh guide takes at another
    # point: the last digits of the new sites may differ; the remainder's step reads its own
    # Monte Carlo history too)
    assert after.keys() == after0.keys()
    for k, v in after.items():
        rtol = 0.05 if ".remainder." in k else 1e-10 if dtype == D64 else 1e-4
        assert torch.allclose(v, after0[k], rtol=rtol, atol=rtol), (k, (v - after0[k]).abs().max())
