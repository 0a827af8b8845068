"""Model changes are seen (:mod:`pyro_cvi.model.signature`): a model traced once per data is
still run every step, so a site added later, a site that appears only sometimes, a changed
distribution or a model that starts raising gives an error (and the guide stays as it was);
data read from the model's closure or module globals behaves as data passed as arguments."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

N = 60


def _data(dtype):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, 2, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(X[:, 0] - X[:, 1]), generator=g)
    return X.to(dtype), y.to(dtype)


def _changing_model(state):
    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
        if state.get("extra"):
            pyro.sample("v", dist.Normal(X.new_zeros(()), 1.0))
        if state.get("raise"):
            raise RuntimeError("the model's own failure")
        with pyro.plate("data", N):
            if state.get("normal"):
                pyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
            else:
                pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model


CHANGES = {
    "site-added": ({"extra": True}, ValueError, r"sample sites changed.*added \['v'\]"),
    "model-raises": ({"raise": True}, RuntimeError, "the model's own failure"),
    "distribution-changed": (
        {"normal": True},
        ValueError,
        r"site 'y' changed since the guide was analysed: it was a Bernoulli.*now a Normal",
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_model_that_changes_after_the_first_steps_is_seen(change, dtype):
    """The change raises at the step it happens (before, the old bound was returned, the
    model never re-run); undone, the next step is bit for bit an undisturbed run's."""
    X, y = _data(dtype)
    flags, exc, message = CHANGES[change]

    def run(disturb):
        pyro.clear_param_store()
        state = {}
        model = _changing_model(state)
        guide = AutoCVI(model)
        svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
        losses = [svi.step(X, y) for _ in range(3)]
        if disturb:
            state.update(flags)
            with pytest.raises(exc, match=message):
                svi.step(X, y)
            state.clear()
        losses += [svi.step(X, y) for _ in range(2)]
        return losses, guide.posterior("w").mean.detach()

    (clean, m), (after, m_after) = run(False), run(True)
    assert after == clean and torch.equal(m, m_after)


def test_a_site_that_appears_only_sometimes_is_an_error_when_it_appears():
    X, y = _data(torch.float64)
    calls = {"n": 0}

    def model(X, y):
        calls["n"] += 1
        w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
        if calls["n"] % 7 == 0:
            pyro.sample("sometimes", dist.Normal(X.new_zeros(()), 1.0))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    svi = SVI(model, AutoCVI(model), CVI(), loss=CVI_ELBO())
    with pytest.raises(ValueError, match=r"added \['sometimes'\]"):
        for _ in range(20):
            svi.step(X, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("how", ["in-place", "rebound-global"])
def test_data_read_from_a_closure_or_a_global_behaves_as_arguments(how, dtype):
    """Covariates the model reads from outside (changed in place, or a module global bound
    to a new tensor) are re-analysed at the next step, as new arguments would be: the fit is
    the one of a guide given the new data from the start (before: the old data's bound)."""
    X, y = _data(dtype)
    box = {"X": X.clone()}
    closure_X = box["X"]

    def model_closure(y):
        w = pyro.sample("w", dist.Normal(closure_X.new_zeros(2), 1.0).to_event(1))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Bernoulli(logits=closure_X @ w), obs=y)

    global GLOBAL_X
    GLOBAL_X = X.clone()
    model = model_closure if how == "in-place" else _global_model
    svi = SVI(model, AutoCVI(model), CVI(step_size=1.0), loss=CVI_ELBO())
    for _ in range(3):
        svi.step(y)
    if how == "in-place":
        closure_X.mul_(-1.0)
    else:
        GLOBAL_X = -X
    changed = [svi.step(y) for _ in range(8)]
    w_changed = svi.guide.posterior("w").mean.detach()

    pyro.clear_param_store()
    closure_X.copy_(-X)
    GLOBAL_X = -X
    ref_svi = SVI(model, AutoCVI(model, prefix="ref"), CVI(step_size=1.0), loss=CVI_ELBO())
    ref = [ref_svi.step(y) for _ in range(11)]
    w_ref = ref_svi.guide.posterior("w").mean.detach()
    assert changed[-1] == pytest.approx(ref[-1], rel=1e-5)
    torch.testing.assert_close(w_changed, w_ref, rtol=1e-4, atol=1e-4)
    assert float(w_changed[0]) < 0 < float(w_changed[1])  # the sign flip of X was seen


GLOBAL_X = None


def _global_model(y):
    w = pyro.sample("w", dist.Normal(GLOBAL_X.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("data", N):
        pyro.sample("y", dist.Bernoulli(logits=GLOBAL_X @ w), obs=y)
