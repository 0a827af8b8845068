"""The structure check runs when what the model reads changes (:func:`model_state`), and only
then: a static model whose inputs are unchanged is not run again, and every change that a fresh
trace would show (new or edited data, closure data, plain values that steer the model's control
flow, a helper's globals, a model that now raises) is still seen at the step it happens."""

import itertools

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.model.signature import MAX_ITEMS, model_state

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
NOISE = 0.5


def _data(dtype, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 2, generator=g, dtype=torch.float64)
    y = X @ torch.tensor([1.0, -2.0], dtype=torch.float64) + NOISE * torch.randn(
        n, generator=g, dtype=torch.float64
    )
    return X.to(dtype), y.to(dtype)


def _regression(runs=None):
    def model(X, y):
        if runs is not None:
            next(runs)  # (an iterator's state is not part of the key: counts runs unseen)
        w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w, NOISE), obs=y)

    return model


def _exact(X, y):
    """The conjugate posterior of w and -log p(y) (closed forms, float64)."""
    X, y = X.double(), y.double()
    P = torch.eye(2, dtype=torch.float64) + X.T @ X / NOISE**2
    cov = torch.linalg.inv(P)
    mean = cov @ X.T @ y / NOISE**2
    marg = dist.MultivariateNormal(
        torch.zeros(len(y), dtype=torch.float64),
        X @ X.T + NOISE**2 * torch.eye(len(y), dtype=torch.float64),
    )
    return mean, cov, -float(marg.log_prob(y))


def _tol(dtype):
    return dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-4)


def _assert_exact(guide, loss, X, y, dtype):
    mean, cov, nlml = _exact(X, y)
    q = guide.posterior("w")
    torch.testing.assert_close(q.mean.double(), mean, **_tol(dtype))
    torch.testing.assert_close(q.covariance_matrix.double(), cov, **_tol(dtype))
    assert loss == pytest.approx(nlml, rel=_tol(dtype)["rtol"])


@DTYPES
def test_a_static_model_with_unchanged_inputs_is_not_run_again(dtype):
    """After the first step (its analysis and check), steps on the same inputs run no model:
    the loss and q are the exact ones all along."""
    X, y = _data(dtype)
    runs = itertools.count()
    model = _regression(runs)
    svi = SVI(model, AutoCVI(model), CVI(step_size=1.0), loss=CVI_ELBO())
    svi.step(X, y)
    svi.step(X, y)
    before = next(runs)
    losses = [svi.step(X, y) for _ in range(5)]
    assert next(runs) == before + 1  # (the one call is this test's own next())
    _assert_exact(svi.guide, losses[-1], X, y, dtype)


@DTYPES
@pytest.mark.parametrize("edit", ["y-in-place", "X-in-place", "new-tensors", "new-length"])
def test_edited_or_new_data_refits_to_the_new_exact_posterior(edit, dtype):
    """Data passed as arguments: edited in place between steps (only its version counter
    changes), other tensors of the same shape, or of another length; the next steps reach the
    exact posterior of the new data (the old one is far from it)."""
    X, y = _data(dtype)
    model = _regression()
    svi = SVI(model, AutoCVI(model), CVI(step_size=1.0), loss=CVI_ELBO())
    for _ in range(3):
        svi.step(X, y)
    if edit == "y-in-place":
        y.mul_(-1.0)
    elif edit == "X-in-place":
        X[:, 1].mul_(-1.0)
    elif edit == "new-tensors":
        X, y = _data(dtype, seed=1)
        y = -y
    else:
        X, y = _data(dtype, n=55, seed=1)
        y = -y
    old = svi.guide.posterior("w").mean.double()
    losses = [svi.step(X, y) for _ in range(3)]
    mean = _exact(X, y)[0]
    assert float((old - mean).abs().max()) > 0.5  # (the change matters)
    _assert_exact(svi.guide, losses[-1], X, y, dtype)


SIZE = {"n": 3}
FLAGS = {"extra": False}


def _helper_adds_a_site(x):
    if FLAGS["extra"]:
        pyro.sample("v", dist.Normal(x.new_zeros(()), 1.0))


def _steered_model(X, y):
    """A model steered by module globals: a plain int (a plate's size) and a flag read by a
    helper function of its own."""
    with pyro.plate("groups", SIZE["n"]):
        pyro.sample("u", dist.Normal(X.new_zeros(()), 1.0))
    _helper_adds_a_site(X)
    w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(X @ w, NOISE), obs=y)


@DTYPES
@pytest.mark.parametrize(
    "change",
    [
        ("size", 4, ValueError, r"site 'u' changed since the guide was analysed"),
        ("extra", True, ValueError, r"sample sites changed.*added \['v'\]"),
    ],
    ids=["plain-int-global", "helper-global-flag"],
)
def test_plain_values_and_helpers_that_steer_the_model_are_seen(change, dtype):
    """A plain value (not a tensor) that changes a plate's size, and a flag read by a helper
    function that adds a site: the step after the change raises, by name; undone, the run
    continues bit for bit as an undisturbed one."""
    key, value, exc, message = change
    X, y = _data(dtype)
    box, key = (SIZE, "n") if key == "size" else (FLAGS, key)

    def run(disturb):
        pyro.clear_param_store()
        original = box[key]
        svi = SVI(_steered_model, AutoCVI(_steered_model), CVI(), loss=CVI_ELBO())
        losses = [svi.step(X, y) for _ in range(3)]
        if disturb:
            box[key] = value
            try:
                with pytest.raises(exc, match=message):
                    svi.step(X, y)
            finally:
                box[key] = original
        losses += [svi.step(X, y) for _ in range(2)]
        return losses

    assert run(True) == run(False)


@DTYPES
def test_a_model_that_now_raises_through_a_closure_flag_is_seen(dtype):
    X, y = _data(dtype)
    state = {"raise": False}

    def model(X, y):
        if state["raise"]:
            raise RuntimeError("the model's own failure")
        _regression()(X, y)

    svi = SVI(model, AutoCVI(model), CVI(), loss=CVI_ELBO())
    for _ in range(3):
        svi.step(X, y)
    state["raise"] = True
    with pytest.raises(RuntimeError, match="the model's own failure"):
        svi.step(X, y)


@DTYPES
def test_a_remainder_model_runs_its_check_trace_only_on_change(dtype):
    """A model fitted by the remainder's joint Gaussian (its blocks move the trace): while its
    inputs are the same its step takes no trace of its own at q's means; a site added through
    a closure flag is still seen."""
    g = torch.Generator().manual_seed(0)
    y = (0.3 * torch.randn(25, generator=g, dtype=torch.float64)).to(dtype)
    flags = {"extra": False}
    runs = itertools.count()

    def model(y):
        next(runs)
        s = pyro.sample("s", dist.LogNormal(y.new_tensor(0.0), 1.0))
        r = pyro.sample("r", dist.Beta(y.new_tensor(2.0), 2.0))
        if flags["extra"]:
            pyro.sample("v", dist.Normal(y.new_tensor(0.0), 1.0))
        prev = y.new_tensor(0.0)
        for t in range(y.shape[0]):  # a recursion: no affine structure for the exact blocks
            pyro.sample(f"y_{t}", dist.Normal(r * torch.tanh(prev), s), obs=y[t])
            prev = y[t]

    pyro.set_rng_seed(0)
    svi = SVI(model, AutoCVI(model), CVI(), loss=CVI_ELBO())
    for _ in range(3):
        svi.step(y)
    assert svi.guide.engine.kinds.get("remainder")  # (the block this test is about)
    before = next(runs)
    for _ in range(4):
        svi.step(y)
    # per step one batched run of the draws and one of the report's antithetic pairs, no trace
    assert next(runs) - before == 4 * 2 + 1
    flags["extra"] = True
    with pytest.raises(ValueError, match=r"added \['v'\]"):
        svi.step(y)
    flags["extra"] = False
    assert torch.isfinite(torch.tensor(svi.step(y)))


def test_model_state_sees_types_arrays_and_gives_up_past_its_budget():
    X = torch.zeros(3)
    box = {"flag": 1, "arr": np.zeros(3)}

    def model():
        return X, box

    key = model_state(model, (), {})
    box["flag"] = True  # (True == 1: the type is part of the key)
    assert model_state(model, (), {}) != key
    box["flag"] = 1
    assert model_state(model, (), {}) == key
    box["arr"] = np.zeros(4)
    assert model_state(model, (), {}) != key
    box["arr"] = np.zeros(3)
    X.add_(1.0)  # an in-place edit: the version counter
    assert model_state(model, (), {}) != key
    many = [0] * (2 * MAX_ITEMS)
    assert model_state(lambda: many, (), {}) is None  # cut short: nothing concluded
