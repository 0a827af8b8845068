"""``pyro_cvi.optim.CVI``: eq. 12 on the guide's natural parameters, the inner optimizer on
everything else, and its state."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, step_sizes


def coin(y):
    f = pyro.sample("f", dist.Beta(torch.tensor(2.0, dtype=y.dtype), 3.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Bernoulli(f), obs=y)


Y = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)


def _naturals(guide):
    return [p.detach().clone() for p in guide.engine.stepper["f"].params()]


@pytest.mark.parametrize("bad", ["fast", 0.0, 1.5, -0.1])
def test_step_sizes_outside_0_1_are_refused(bad):
    with pytest.raises(ValueError):
        CVI(step_size=bad)


def test_a_schedule_gives_beta_t_at_step_t():
    """A conjugate target is fixed, so after steps with betas b_1, b_2 the distance to it is
    (1 - b_1)(1 - b_2) of the start (eq. 12)."""
    guide = AutoCVI(coin)
    svi = SVI(coin, guide, CVI(step_size=step_sizes.robbins_monro(0.5, 1.0, 1.0)), CVI_ELBO())
    guide(Y)
    start = _naturals(guide)
    svi.step(Y)
    svi.step(Y)
    end = _naturals(guide)
    target = guide.engine.natural_targets((Y,), {})["f"]
    b = [step_sizes.robbins_monro(0.5, 1.0, 1.0)(t) for t in (1, 2)]
    for s, e, t in zip(start, end, target):
        assert torch.allclose(t - e, (1 - b[0]) * (1 - b[1]) * (t - s), atol=1e-12)


def hybrid(X, y):
    scale = pyro.param("prior_scale", torch.tensor(1.0, dtype=X.dtype), dist.constraints.positive)
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), scale).to_event(1))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)


def test_other_parameters_go_to_the_inner_optimizer():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(50, 2, generator=g, dtype=torch.float64)
    y = X @ torch.tensor([3.0, -2.0], dtype=torch.float64) + 0.5 * torch.randn(50, generator=g)
    guide = AutoCVI(hybrid)
    optim = CVI(step_size=1.0, optim=torch.optim.SGD, optim_args={"lr": 0.05})
    svi = SVI(hybrid, guide, optim, loss=CVI_ELBO())
    svi.step(X, y)
    before = pyro.param("prior_scale").item()
    svi.step(X, y)
    # the q of w is exact at each step (conjugate); the scale moves by SGD on the -ELBO:
    # the posterior of w has norm ~ 3.6 >> 1, so d(-ELBO)/d(scale) < 0 and the scale grows
    assert pyro.param("prior_scale").item() > before
    state = optim.get_state()
    fresh = CVI(step_size=1.0, optim=torch.optim.SGD, optim_args={"lr": 0.05})
    fresh.set_state(state)
    assert fresh.t == optim.t == 2
