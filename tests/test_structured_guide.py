"""Structured SVI as a guide inside ``pyro.infer.SVI`` (``AutoStructuredCVI`` with ``CVI`` and
``CVI_ELBO``): the same global steps as ``StructuredSVI.step`` (to 1e-12), a loss that is the
exact ``-log p(y)`` at the exact posterior, and draws from the exact local conditionals."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from test_structured import S0, _groups, hierarchical, mixture_weights

from pyro_cvi import CVI, CVI_ELBO, AutoStructuredCVI, StructuredSVI, step_sizes

D = torch.float64


@pytest.mark.parametrize("which", ["continuous", "discrete"])
def test_steps_equal_structured_svi(which):
    if which == "continuous":
        model, args, site = hierarchical, (_groups(N=8, J=3, seed=1),), "mu"
    else:
        x = torch.tensor([-3.1, -2.5, 0.2, 0.9, 4.4, 3.7, 4.1], dtype=D)
        model, args, site = mixture_weights, (x,), "w"
    schedule = step_sizes.robbins_monro(0.8, 1.0, 0.75)
    guide = AutoStructuredCVI(model, step_size=schedule)
    guide(*args)  # set up
    ref = StructuredSVI(model, step_size=schedule)
    ref.setup(*args)
    svi = SVI(model, guide, CVI(), CVI_ELBO())  # CVI(): the guide's own schedule
    for t in range(1, 5):
        pyro.set_rng_seed(t)
        loss = svi.step(*args)
        pyro.set_rng_seed(t)
        ref.step(*args)
        got = [p.detach() for p in guide.posterior(site).mean.reshape(-1)]
        want = [p for p in ref.posterior(site).mean.reshape(-1)]
        assert torch.allclose(torch.stack(got), torch.stack(want), rtol=1e-12, atol=1e-12), t
        assert loss == loss  # finite
    names = dict(guide.named_parameters())
    assert set(names) == {f"ssvi0.{site}", f"ssvi1.{site}"} or set(names) == {f"ssvi0.{site}"}


def _log_evidence(Y):
    N, J = Y.shape
    cov = S0**2 * torch.ones(N * J, N * J, dtype=D)
    cov = cov + torch.block_diag(*[torch.eye(J, dtype=D) + torch.ones(J, J, dtype=D)] * N)
    return dist.MultivariateNormal(torch.zeros(N * J, dtype=D), cov).log_prob(Y.reshape(-1))


def test_loss_is_minus_log_evidence_at_the_exact_posterior():
    """With ``q(mu) = p(mu | y)`` and exact local conditionals the bound is tight: every
    single-draw loss equals ``-log p(y)``; Trace_ELBO of the guide agrees within its noise."""
    Y = _groups(N=6, J=4, seed=2)
    N, J = Y.shape
    prec = 1 / S0**2 + N * J / (1 + J)  # y_n ~ N(mu 1, I + 1 1'): 1' (I + 1 1')^-1 1 = J/(1+J)
    mean = (Y.sum() / (1 + J)) / prec
    exact = dist.Normal(mean, prec**-0.5)
    guide = AutoStructuredCVI(hierarchical, init_values={"mu": exact})
    svi = SVI(hierarchical, guide, CVI(step_size=1e-12), CVI_ELBO())
    log_z = float(_log_evidence(Y))
    for _ in range(3):
        assert svi.evaluate_loss(Y) == pytest.approx(-log_z, rel=1e-9)
    mc = Trace_ELBO(num_particles=400, vectorize_particles=False).loss(hierarchical, guide, Y)
    assert mc == pytest.approx(-log_z, abs=0.5)


def test_forward_draws_locals_from_their_exact_conditional():
    Y = _groups(N=5, J=3, seed=3)
    guide = AutoStructuredCVI(hierarchical)
    tr = pyro.poutine.trace(guide).get_trace(Y)
    mu = tr.nodes["mu"]["value"]
    q = tr.nodes["theta"]["fn"]
    loc = (mu + Y.sum(1, keepdim=True)) / (1 + Y.shape[1])
    assert torch.allclose(q.mean.reshape(-1), loc.reshape(-1), atol=1e-10)
    assert tr.nodes["theta"]["value"].shape == (5, 1)


def test_a_fixed_cvi_step_size_works():
    """``CVI(step_size=0.5)`` applies that step to AutoStructuredCVI (the optimizer talks to it
    through the owner protocol, ``pyro_cvi.update.NaturalGradientOwner``)."""
    from pyro_cvi.update import NaturalGradientOwner

    args = (_groups(N=8, J=3, seed=1),)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoStructuredCVI(hierarchical)
    svi = SVI(hierarchical, guide, CVI(step_size=0.5), CVI_ELBO())
    losses = [svi.step(*args) for _ in range(60)]
    assert isinstance(guide.engine, NaturalGradientOwner)
    assert guide.t == 60
    # the fixed step reaches the same q as the guide's own schedule, within the draws' noise
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    ref = AutoStructuredCVI(hierarchical)
    svi = SVI(hierarchical, ref, CVI(), CVI_ELBO())
    for _ in range(60):
        svi.step(*args)
    mine, theirs = guide.posterior("mu").mean, ref.posterior("mu").mean
    sd = ref.posterior("mu").stddev
    assert torch.allclose(mine, theirs, atol=float(3 * sd.max())), (mine, theirs)
    assert sum(losses[-10:]) / 10 < losses[0] + 50
