"""Divergence is never silent (:mod:`pyro_cvi.divergence`): a training loss that is not finite or
grows by orders of magnitude raises :class:`~pyro_cvi.DivergenceError`, the guide is put back
to its best q, and the next step continues from there; the adaptive ``CVI()`` undoes such a
point by itself (whatever its Monte Carlo variance estimate says)."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, DivergenceError

N, D = 50, 3


def _poisson(dtype, scale=10.0):
    """A Poisson regression with a prior far wider than the data's scale: from the prior, a
    fixed full step with 4-sample Monte Carlo messages often overshoots by orders of magnitude
    (whether it does depends on the draws); with ``scale=30`` the initial -ELBO overflows."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = torch.poisson(torch.exp(X @ torch.full((D,), 1.5, dtype=torch.float64)), generator=g)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(D), scale).to_event(1))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Poisson(torch.exp(X @ w)), obs=y)

    return model, X.to(dtype), y.to(dtype)


def _guide(model):
    return AutoCVI(model, init_sites="prior", num_samples=4)


def test_an_exploding_loss_raises_and_rolls_back_to_the_best_q():
    model, X, y = _poisson(torch.float64)
    for seed in range(6):  # the overshoot depends on the Monte Carlo draws: most seeds diverge
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        guide = _guide(model)
        svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
        losses = []
        try:
            for _ in range(10):
                losses.append(svi.step(X, y))
        except DivergenceError as e:
            info = e
            break
    else:
        raise AssertionError("a fixed full step from the prior never diverged in 6 seeds")
    best = min(losses)
    assert len(losses) >= 2 and math.isfinite(best) and best < 1e4
    text = str(info)
    assert "sites ['w']" in text and "rolled back" in text and "CVI()" in text
    assert f"{best:.6g}" in text
    # the guide holds the best q: its loss is the best loss, and CVI() steps on from it
    assert svi.evaluate_loss(X, y) == pytest.approx(best, rel=1e-3)
    adaptive = SVI(model, guide, CVI(), loss=CVI_ELBO())
    after = [adaptive.step(X, y) for _ in range(15)]
    assert all(math.isfinite(v) for v in after)
    assert max(after) <= best * (1 + 1e-4) and after[-1] < best


def test_a_non_finite_initial_loss_is_an_error_and_the_guide_stays_usable():
    """In float32 a prior three times wider makes exp(X w) overflow at the initial q (the
    -ELBO is NaN): no best q to go back to; the error names the fix. At the first test's
    prior, q started at the data (``init_sites="laplace"``, the default) fits."""
    model, X, y = _poisson(torch.float32, scale=30.0)
    pyro.set_rng_seed(0)
    svi = SVI(model, _guide(model), CVI(step_size=1.0), loss=CVI_ELBO())
    with pytest.raises(DivergenceError, match="initial q is nan.*init_sites='laplace'"):
        svi.step(X, y)
    pyro.clear_param_store()
    model, X, y = _poisson(torch.float32)  # the prior of the first test: q starts at the data
    guide = AutoCVI(model, num_samples=4)
    svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
    losses = [svi.step(X, y) for _ in range(15)]
    assert all(math.isfinite(v) for v in losses) and losses[-1] <= min(losses[:3])


def test_the_adaptive_step_undoes_an_exploded_point_despite_its_noise():
    """The same model under CVI(): the overshooting step is undone (its huge Monte Carlo
    variance estimate does not make it acceptable), no error, and the loss never explodes."""
    model, X, y = _poisson(torch.float64)
    pyro.set_rng_seed(0)
    guide = _guide(model)
    svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
    losses = [svi.step(X, y) for _ in range(15)]
    assert all(math.isfinite(v) for v in losses)
    assert max(losses[1:]) <= losses[1] * (1 + 1e-4)
    assert guide.num_backtracks >= 1


def test_a_diverging_hyperparameter_is_reported_and_q_kept():
    """A learned noise scale driven away by a far too large learning rate: the -ELBO grows
    by orders of magnitude; the error says to lower the learning rate, q is its best."""
    g = torch.Generator().manual_seed(1)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = X @ torch.ones(D, dtype=torch.float64) + 0.1 * torch.randn(N, generator=g).double()

    def model(X, y):
        s = pyro.param("s", torch.tensor(1.0, dtype=X.dtype), constraint=dist.constraints.positive)
        w = pyro.sample("w", dist.Normal(X.new_zeros(D), 1.0).to_event(1))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Normal(X @ w, s), obs=y)

    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(optim_args={"lr": 50.0}), loss=CVI_ELBO())
    with pytest.raises(DivergenceError, match="a lower learning rate"):
        for _ in range(50):
            svi.step(X, y)
    assert torch.isfinite(guide.posterior("w").mean).all()
