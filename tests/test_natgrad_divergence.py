"""``CVI()`` on Pyro's Gaussian guides sees a diverging fit in the loss ``svi.step`` got: the
Gaussians go back to the best q and a DivergenceError says what to do (before: losses of 1e19
went on silently); a converging run is never stopped."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer import autoguide as ag

from pyro_cvi import CVI, DivergenceError

DTYPES = [torch.float32, torch.float64]
GUIDES = [
    "AutoNormal",
    "AutoDiagonalNormal",
    "AutoMultivariateNormal",
    "AutoLowRankMultivariateNormal",
]


def _data(dtype):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(40, 3, generator=g, dtype=torch.float64)
    y = X @ torch.ones(3, dtype=torch.float64) + 0.1 * torch.randn(40, generator=g).double()
    return X.to(dtype), y.to(dtype)


def model(X, y):
    s = pyro.param("s", torch.tensor(1.0, dtype=X.dtype), constraint=dist.constraints.positive)
    w = pyro.sample("w", dist.Normal(X.new_zeros(3), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(X @ w, s), obs=y)


def _gaussians(guide):
    store = pyro.get_param_store()
    return {
        n: store[n].unconstrained().detach().clone()
        for n in store.keys()
        if n.startswith(type(guide).__name__ + ".")
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("guide_name", GUIDES)
def test_a_diverging_fit_is_stopped_and_q_put_back_to_its_best(guide_name, dtype):
    """A noise scale driven away by a far too large learning rate: the loss grows by orders of
    magnitude. Seeds are tried until the run diverges within 80 steps (it does for most)."""
    X, y = _data(dtype)
    for seed in range(10):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        guide = getattr(ag, guide_name)(model)
        optim = CVI(optim_args={"lr": 50.0})
        svi = SVI(model, guide, optim, loss=Trace_ELBO())
        guide(X, y)  # set up: the Gaussians exist from here
        losses, states = [], []
        try:
            for _ in range(80):
                states.append(_gaussians(guide))  # the q whose loss the next step gets
                losses.append(svi.step(X, y))
        except DivergenceError as e:
            error = e
            break
    else:
        pytest.fail("no seed diverged")
    best, at = min((v, i) for i, v in enumerate(losses))
    # the guard's loss is the -ELBO of the sites the loss ran (natgrad.observe), the same
    # estimate as Trace_ELBO's up to the order of the sums
    assert optim.guard.best == pytest.approx(best, rel=1e-4 if dtype == torch.float32 else 1e-9)
    assert optim.guard.step == at + 1
    assert "the fit diverged for the Gaussians" in str(error)
    assert f"{optim.guard.best:.6g}" in str(error)
    now = _gaussians(guide)
    assert now.keys() == states[at].keys()
    assert all(torch.equal(now[k], states[at][k]) for k in now)  # exactly the best q


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("guide_name", GUIDES)
def test_a_converging_fit_is_never_stopped(guide_name, dtype):
    X, y = _data(dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = getattr(ag, guide_name)(model)
    svi = SVI(model, guide, CVI(optim_args={"lr": 0.05}), loss=Trace_ELBO())
    losses = [svi.step(X, y) for _ in range(150)]
    assert sum(losses[-20:]) / 20 < sum(losses[:20]) / 20


def test_a_non_finite_first_loss_says_the_initial_q_is_invalid():
    X, y = _data(torch.float64)
    pyro.clear_param_store()
    guide = ag.AutoNormal(model)
    svi = SVI(model, guide, CVI(), loss=Trace_ELBO())
    with pytest.raises(DivergenceError, match="the loss of the initial q is inf"):
        svi.step(X, y * float("inf"))
    assert math.isfinite(svi.step(X, y))  # the run goes on with good data


def test_the_optimizer_in_a_hand_written_loop_sees_the_loss():
    """Called directly (not by svi.step), CVI sees the same loss: the guard checks it."""
    X, y = _data(torch.float64)
    pyro.clear_param_store()
    guide = ag.AutoNormal(model)
    optim = CVI(step_size=0.5)
    loss = Trace_ELBO()
    with pyro.poutine.trace(param_only=True) as tr:
        value = loss.loss_and_grads(model, guide, X, y)
    params = {site["value"].unconstrained() for site in tr.trace.nodes.values()}
    optim(params)
    assert optim.guard.seen == 1 and optim.t == 1
    assert optim.guard.best == pytest.approx(value, rel=1e-9)


def test_a_loss_that_runs_no_model_gives_the_guard_nothing():
    """A custom loss that runs only the guide (here its entropy): no -ELBO estimate can be
    formed, nothing is checked, the step is taken."""
    X, y = _data(torch.float64)
    pyro.clear_param_store()

    def guide(X, y):
        m = pyro.param("w_m", X.new_zeros(3))
        s = pyro.param("w_s", X.new_ones(3), constraint=dist.constraints.positive)
        pyro.sample("w", dist.Normal(m, s).to_event(1))

    def negative_entropy(model, guide, X, y):
        q = pyro.poutine.trace(guide).get_trace(X, y).nodes["w"]["fn"]
        return -q.base_dist.entropy().sum()

    optim = CVI(step_size=0.5)
    SVI(model, guide, optim, loss=negative_entropy).step(X, y)
    assert optim.guard.seen == 0 and optim.t == 1
