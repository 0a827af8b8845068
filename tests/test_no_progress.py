"""A fit that does not move is never silent (:class:`pyro_cvi.divergence.Progress`): a guide
whose losses gain less than their own spread since the start, a spread far beyond a fit near
its optimum, warns once, naming its sites and what to do; a converging fit never does."""

import math
import statistics
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.divergence import Progress

DTYPES = [torch.float32, torch.float64]


def _feed(losses):
    p = Progress()
    reasons = [p.record(v) for v in losses]
    return [r for r in reasons if r is not None], p


def test_a_stalled_stream_warns_once_at_step_200():
    g = torch.Generator().manual_seed(0)
    losses = (2.5e7 + 1e7 * torch.randn(400, generator=g, dtype=torch.float64)).tolist()
    reasons, p = _feed(losses)
    # checks at steps 100, 150 and 200 all find it stalled: one warning, at step 200
    assert len(reasons) == 1 and p.warned and p.seen == (p.runs + 1) * p.tail == 200
    assert "spreads by" in reasons[0] and "3 checks in a row" in reasons[0]


def test_stretches_without_gain_between_gains_never_warn():
    # a one-draw fit of a network on a large data set: 100 steps at a time without gain and a
    # spread of ~30% of the loss, then a gain (the bound falls over hundreds of steps)
    g = torch.Generator().manual_seed(3)
    level = torch.tensor([8000.0, 8000.0, 5000.0, 5000.0, 3000.0, 3000.0, 2000.0, 2000.0])
    noise = torch.randn(8, 50, generator=g, dtype=torch.float64)
    losses = (level[:, None] * (1.0 + 0.3 * noise)).flatten().tolist()
    assert _feed(losses)[0] == []
    # the same stream stalled from step 100 on warns, once
    stalled = losses[:100] + (8000.0 * (1.0 + 0.3 * noise[2:])).flatten().tolist()
    assert len(_feed(stalled)[0]) == 1


def test_a_converging_stream_and_a_fit_at_its_optimum_never_warn():
    g = torch.Generator().manual_seed(1)
    t = torch.arange(400, dtype=torch.float64)
    noise = torch.randn(400, generator=g, dtype=torch.float64)
    decaying = (300.0 + 1e6 * torch.exp(-t / 10.0) + 2.0 * noise).tolist()
    at_optimum = (1500.0 + 30.0 * noise).tolist()  # flat from the start, a noisy Monte Carlo fit
    for losses in (decaying, at_optimum):
        assert _feed(losses)[0] == []


def test_the_rule_reads_the_spread_against_the_gain():
    # the same spread: stalled without a gain, fine while each 50 steps gain several spreads
    g = torch.Generator().manual_seed(2)
    noise = 5e3 * torch.randn(200, generator=g, dtype=torch.float64)
    t = torch.arange(200, dtype=torch.float64)
    flat = (2e4 + noise).tolist()
    falling = (1e5 - 500.0 * t + noise).tolist()  # 25,000 nats per 50 steps, spread 5,000
    assert len(_feed(flat)[0]) == 1
    assert _feed(falling)[0] == []
    # a converged Monte Carlo fit on a large data set: a spread of a few percent of the loss
    # (hundreds of nats) is noise, not a stall
    converged = (1.3e4 + 300.0 * torch.randn(300, generator=g, dtype=torch.float64)).tolist()
    assert _feed(converged)[0] == []
    assert _feed([math.nan] * 250)[0] == []  # (non-finite losses are the divergence check's)


def _llt(T, dtype):
    """A local linear trend written with two cumsums: the level's prior variance grows like
    ``T^3`` through the increments, so a start at the prior's scale lies far from the data."""
    g = torch.Generator().manual_seed(0)
    slope = (0.02 * torch.randn(T, generator=g, dtype=torch.float64)).cumsum(0)
    lvl = (slope + 0.2 * torch.randn(T, generator=g, dtype=torch.float64)).cumsum(0)
    y = (lvl + 0.5 * torch.randn(T, generator=g, dtype=torch.float64)).to(dtype)

    def model(y):
        sl = pyro.sample("sigma_level", dist.HalfNormal(y.new_tensor(1.0)))
        ss = pyro.sample("sigma_slope", dist.HalfNormal(y.new_tensor(0.2)))
        so = pyro.sample("sigma_obs", dist.HalfNormal(y.new_tensor(1.0)))
        with pyro.plate("time", T):
            eta = pyro.sample("eta", dist.Normal(y.new_tensor(0.0), ss))
            eps = pyro.sample("eps", dist.Normal(y.new_tensor(0.0), sl))
        level = (eta.cumsum(-1) + eps).cumsum(-1)
        with pyro.plate("obs_time", T):
            pyro.sample("y", dist.Normal(level, so), obs=y)

    return model, y


def _fit(model, y, steps, stop=False, families=None):
    guide = AutoCVI(model, families=families)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    losses, found = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            losses.append(svi.step(y))
            found = [str(w.message) for w in caught if "no progress" in str(w.message)]
            if stop and found:
                break
    return found, losses


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_long_cumsum_chain_in_the_remainder_warns(dtype):
    model, y = _llt(300, dtype)
    # float64 stalls at its start, float32 moves by step 75 and stalls at ~4e4; -log p(y) = 301.7
    # (by default the two cumsums take the Kalman block: ``'joint'`` keeps them in the remainder)
    found, losses = _fit(model, y, 400, stop=True, families={"eta": "joint"})
    assert min(losses) > 3000.0
    if dtype == torch.float32 and not found:
        # float32 can still creep down (seeds 0 and 2 on one thread: 42e3 -> 31e3 and 27e3 ->
        # 21e3 over the last 150 steps): no warning then is the rule (a gain beyond the spread)
        gain = statistics.median(losses[-50:]) / statistics.median(losses[-200:-150])
        assert gain < 0.9
        return
    assert len(found) == 1
    for word in ("eta", "eps", "families=", "init_scale=1e-3", "pyro.markov"):
        assert word in found[0]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_converging_fit_does_not_warn(dtype):
    model, y = _llt(40, dtype)
    found, losses = _fit(model, y, 110)
    assert found == []
    assert max(losses[-10:]) < losses[0]
