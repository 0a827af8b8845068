"""Doubly stochastic mean-field CVI inside ``pyro.plate(..., subsample_size=B)``: it is SVI
(Hoffman et al. 2013) on conditionally conjugate models."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive
from pyro.infer.autoguide.initialization import init_to_value

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, step_sizes

K, SIGMA = 3, 5.0


def _data(N=600, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.tensor([-6.0, 0.0, 7.0], dtype=torch.float64)
    c = torch.randint(0, K, (N,), generator=g)
    return centers[c] + torch.randn(N, generator=g, dtype=torch.float64)


def _model(B=None):
    def model(x):
        with pyro.plate("components", K):
            mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), SIGMA))
        with pyro.plate("data", len(x), subsample_size=B) as ind:
            c = pyro.sample("c", dist.Categorical(x.new_ones(K) / K))
            pyro.sample("x", dist.Normal(mu[c], 1.0), obs=x[ind])

    return model


def _optimal_elbo(x, m, s2):
    """Full-data ELBO of q(mu) = N(m, s2) with the optimal q(c) for it (closed form)."""
    logits = x[:, None] * m - 0.5 * (m**2 + s2)
    phi = torch.softmax(logits, -1)
    ell = (phi * (-0.5 * math.log(2 * math.pi) - 0.5 * ((x[:, None] - m) ** 2 + s2))).sum()
    prior = (-0.5 * math.log(2 * math.pi * SIGMA**2) - 0.5 * (m**2 + s2) / SIGMA**2).sum()
    ent = (0.5 * torch.log(2 * math.pi * math.e * s2)).sum()
    ent = ent - (phi * phi.clamp_min(1e-300).log()).sum()
    return float(ell + prior + ent - len(x) * math.log(K))


INIT = {"mu": torch.tensor([-1.0, 0.5, 2.0], dtype=torch.float64)}


def test_minibatch_step_is_the_svi_update():
    """One step = local CAVI update of the batch, then the N/B-scaled natural-gradient step of
    the global (Hoffman et al. 2013, Alg. 3 / Blei et al. 2017, Alg. 3)."""
    x = _data()
    N, B, rho = len(x), 50, 0.3
    model = _model(B)
    guide = AutoCVI(model, init_loc_fn=init_to_value(values=INIT))
    idx = torch.arange(7, 7 + B)
    guide.draw_subsample = lambda args, kwargs: {"data": idx}
    svi = SVI(model, guide, CVI(step_size=rho), loss=CVI_ELBO())
    guide(x)
    lam1, lam2 = (p.detach().clone() for p in guide.engine.stepper["mu"].params())
    svi.step(x)
    m, s2 = -0.5 * lam1 / lam2, -0.5 / lam2
    phi = torch.softmax(x[idx, None] * m - 0.5 * (m**2 + s2), -1)
    hat1 = (N / B) * (phi * x[idx, None]).sum(0)
    hat2 = -0.5 / SIGMA**2 - 0.5 * (N / B) * phi.sum(0)
    new1, new2 = guide.engine.stepper["mu"].params()
    assert torch.allclose(new1, (1 - rho) * lam1 + rho * hat1, rtol=1e-10)
    assert torch.allclose(new2, (1 - rho) * lam2 + rho * hat2, rtol=1e-10)
    # the batch's locals got their full (beta = 1) update; the rest are untouched
    probs = guide.posterior("c").probs
    assert torch.allclose(probs[idx], phi, atol=1e-12)
    assert torch.allclose(probs[:7], torch.full((7, K), 1 / K, dtype=x.dtype))


@pytest.mark.slow
def test_minibatch_cvi_converges_to_the_full_batch_optimum():
    x = _data()
    full = _model(None)
    guide = AutoCVI(full, schedule="sequential", init_loc_fn=init_to_value(values=INIT))
    svi = SVI(full, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    for _ in range(30):
        loss_full = svi.step(x)
    q = guide.posterior("mu")
    best = _optimal_elbo(x, q.loc, q.scale**2)
    assert -loss_full == pytest.approx(best, rel=1e-8)

    pyro.clear_param_store()
    mb = _model(60)
    guide = AutoCVI(mb, init_loc_fn=init_to_value(values=INIT))
    svi = SVI(mb, guide, CVI(step_size=step_sizes.robbins_monro(1.0, 1.0, 0.7)), loss=CVI_ELBO())
    for _ in range(150):
        svi.step(x)
    q = guide.posterior("mu")
    got = _optimal_elbo(x, q.loc, q.scale**2)
    assert got == pytest.approx(best, rel=0.01)
    assert abs(got - best) / abs(best) < 1e-3  # in fact much closer than the 1% required
    # the guide samples the minibatch's locals (Predictive, plates as in Pyro)
    pred = Predictive(mb, guide=guide, num_samples=4)(x)
    assert pred["c"].shape == (4, 60) and pred["mu"].shape == (4, K)
