"""``AutoCVI(init_scale=s)``: natural-form sites start at the ``init_loc_fn`` value with spread
``s`` on the family's unconstrained scale (as AutoNormal's ``init_scale``)."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide.initialization import init_to_value

from pyro_cvi import AutoCVI

F64 = torch.float64
VALUES = {
    "s": torch.tensor(2.0, dtype=F64),
    "p": torch.tensor(0.3, dtype=F64),
    "w": torch.tensor([0.2, 0.3, 0.5], dtype=F64),
    "u": torch.tensor(1.0, dtype=F64),
    "v": torch.tensor([0.5, -1.0], dtype=F64),
}


def model():
    s = pyro.sample("s", dist.LogNormal(torch.tensor(0.0, dtype=F64), 2.0))
    p = pyro.sample("p", dist.Beta(torch.tensor(0.5, dtype=F64), 0.5))
    w = pyro.sample("w", dist.Dirichlet(torch.ones(3, dtype=F64)))
    u = pyro.sample("u", dist.Uniform(torch.tensor(0.0, dtype=F64), 4.0))
    with pyro.plate("k", 2):  # batched: natural form (a site-form Gaussian starts at its prior)
        v = pyro.sample("v", dist.Normal(torch.zeros(2, dtype=F64), 5.0))
    one = torch.tensor(1.0, dtype=F64)
    pyro.sample("y", dist.Normal(torch.tanh(v).sum(), s * u), obs=one)
    pyro.sample("b", dist.Bernoulli(p), obs=one)
    pyro.sample("c", dist.Categorical(w), obs=torch.tensor(1))


# each site's draws on the scale where the spread is set: log, logit, logit of z / 4
UNCONSTRAIN = {
    "s": torch.log,
    "p": torch.logit,
    "w": torch.logit,
    "u": lambda z: torch.logit(z / 4),
    "v": lambda z: z,
}


@pytest.mark.parametrize("scale", [0.1, 0.5])
def test_init_scale_sets_the_starting_spread(scale):
    pyro.set_rng_seed(0)
    guide = AutoCVI(model, init_loc_fn=init_to_value(values=VALUES), init_scale=scale)
    guide()
    n = 20000
    for name, value in VALUES.items():
        u = UNCONSTRAIN[name](guide.posterior(name).sample((n,)))
        sd = u.std(0)
        # Gamma, Beta, Dirichlet: sd(log z), sd(logit z) ~ scale up to O(scale^2) terms
        # (Dirichlet: the largest component's; the others are tighter)
        assert (sd <= scale * (1.05 + scale) + 4 * scale / n**0.5).all(), (name, sd)
        assert sd.max() >= scale * (1 - scale) - 4 * scale / n**0.5, (name, sd)
        if name in ("s", "p", "u"):  # the init value is q's mean (s, p) or median (u): its
            # unconstrained centre is that value's image up to the O(scale^2) skew
            centre = float(u.median() - UNCONSTRAIN[name](value))
            assert abs(centre) < 0.6 * scale**2 + 0.01, (name, centre)
        else:  # w: the mean; v: the mean
            assert torch.allclose(guide.posterior(name).mean, value, atol=1e-6), name


def test_init_scale_must_be_positive():
    with pytest.raises(ValueError, match="init_scale must be positive"):
        AutoCVI(model, init_scale=0.0)
