"""The one-draw step's plateau test (``Horizon(plateau=W)``, ``pyro_cvi.natgrad.horizon``):
over each run of ``W`` bound estimates, the sizes halve (down to ``final``) where the median
of ``l[t + W/2] - l[t]`` is not below minus its standard error, and stay where the losses
still fall beyond their noise.

* the test itself, on loss sequences whose verdict is certain: a strictly falling sequence
  keeps the sizes; a flat or rising one halves them each run, down to ``final``; pure noise
  around a constant reaches ``final``;
* the block records its own estimates: on a model whose posterior is Gaussian, a long fit
  decays its sizes, and still reaches the closed-form posterior (both dtypes);
* a checkpoint round trip of the test's state; the rule's validation.
"""

import math

import pyro
import pytest
import torch
from pyro.infer import SVI
from test_horizon_step import _data, _posterior, lognormal_regression

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, Horizon, Remainder
from pyro_cvi.natgrad.horizon import HorizonControl

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def _feed(control: HorizonControl, losses) -> list:
    """Each loss as one step's record; the factor after every step."""
    out = []
    for v in losses:
        control.record(float(v))
        control.observe()
        out.append(control.factor)
    return out


def test_a_falling_bound_keeps_the_sizes():
    c = HorizonControl(Horizon(plateau=20))
    g = torch.Generator().manual_seed(0)
    # a slope of -1 a step under noise of sd 1: each difference over 10 steps is -10 +- 1.4
    losses = -torch.arange(200, dtype=torch.float64) + torch.randn(200, generator=g)
    assert _feed(c, losses.tolist())[-1] == 1.0
    cosine = c.rule.final + (1 - c.rule.final) * 0.5 * (1 + math.cos(math.pi * 200 / 2000))
    assert c.decay() == pytest.approx(cosine)


@pytest.mark.parametrize("slope", [0.0, 0.5])
def test_a_flat_or_rising_bound_halves_the_sizes_each_run(slope):
    c = HorizonControl(Horizon(plateau=10, final=0.1))
    factors = _feed(c, [slope * t for t in range(50)])
    # halved at the end of each run of 10: 0.5, 0.25, 0.125, then the floor
    assert factors[9] == 0.5 and factors[8] == 1.0
    assert factors[19] == 0.25 and factors[29] == 0.125 and factors[39] == 0.1
    rho, lr = c.step_sizes()
    assert rho == pytest.approx(0.1 * c.rule.rho) and lr == pytest.approx(0.1 * c.rule.lr)


def test_noise_around_a_constant_reaches_the_floor():
    c = HorizonControl(Horizon(plateau=50, final=0.05))
    g = torch.Generator().manual_seed(3)
    losses = 100.0 + 5.0 * torch.randn(3000, generator=g, dtype=torch.float64)
    _feed(c, losses.tolist())
    # five halvings take the factor to the floor; 60 runs each halve with probability 0.84
    assert c.factor == 0.05


def test_no_record_no_test_and_the_state_round_trip():
    c = HorizonControl(Horizon(plateau=10))
    for _ in range(30):  # steps without an estimate (another block's report): no test
        c.observe()
    assert c.factor == 1.0 and c.losses == []
    _feed(c, [1.0] * 15)
    state = c.state()
    assert state["factor"] == 0.5 and len(state["losses"]) == 5
    d = HorizonControl(Horizon(plateau=10))
    d.load(state)
    assert d.factor == 0.5 and d.losses == c.losses and d.losses is not c.losses
    old = HorizonControl(Horizon(plateau=10))
    old.load({"t": 3, "ceiling": 1.0, "gbar": None, "n": 0})  # a state saved before the test
    assert old.factor == 1.0 and old.losses == []


def test_plateau_validation():
    for bad in (-1, 2, 1.5):
        with pytest.raises(ValueError, match="plateau"):
            Horizon(plateau=bad)
    assert HorizonControl(Horizon(plateau=0)).rule.plateau == 0


@DTYPES
def test_a_long_fit_decays_and_still_reaches_the_posterior(dtype):
    """600 steps with the default horizon (2,000 steps, whose cosine alone would leave 0.8 of
    the sizes): the plateau test decays them, and q is the closed-form posterior."""
    X, y = _data(dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(lognormal_regression, remainder=Remainder(covariance="full", step=Horizon()))
    svi = SVI(lognormal_regression, guide, CVI(), CVI_ELBO())
    for _ in range(600):
        svi.step(X, y)
    rem = guide.engine.kinds["remainder"][0]
    assert rem.control.factor <= 0.25
    perm = [0, 1, 2] if rem.names[0] == "z" else [1, 2, 0]
    mean, S = _posterior(X, y)
    mean, S = mean[perm], S[perm][:, perm]
    q = rem.joint_unconstrained()
    sd = S.diagonal().sqrt()
    assert torch.all((q.mean.double() - mean).abs() < 0.05 * sd), (q.mean, mean)
    C = q.covariance_matrix.double()
    assert torch.allclose(C, S, rtol=0.1, atol=0.1 * float(S.diagonal().min()))
