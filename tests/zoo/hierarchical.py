"""Zoo: hierarchical models (eight schools in three forms, baseball, grouped logistic)."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer.reparam import TransformReparam

from . import ZooData, ZooModel
from .heldout import log_predictive_density

# Rubin (1981), Gelman et al. BDA ch. 5: the SAT coaching experiments.
_SCHOOLS_Y = [28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0]
_SCHOOLS_SIGMA = [15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0]


def eight_schools_data(dtype=torch.float64) -> ZooData:
    return ZooData(
        (torch.tensor(_SCHOOLS_SIGMA, dtype=dtype),), {"y": torch.tensor(_SCHOOLS_Y, dtype=dtype)}
    )


def eight_schools_centered(sigma, y=None):
    """Eight schools, centred (Pyro's ``examples/eight_schools``; BDA ch. 5)."""
    mu = pyro.sample("mu", dist.Normal(sigma.new_tensor(0.0), 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(sigma.new_tensor(5.0)))
    with pyro.plate("schools", len(sigma)):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def eight_schools_noncentered(sigma, y=None):
    """Eight schools, non-centred: ``theta = mu + tau * theta_tilde``."""
    mu = pyro.sample("mu", dist.Normal(sigma.new_tensor(0.0), 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(sigma.new_tensor(5.0)))
    with pyro.plate("schools", len(sigma)):
        theta_tilde = pyro.sample("theta_tilde", dist.Normal(sigma.new_tensor(0.0), 1.0))
        theta = pyro.deterministic("theta", mu + tau * theta_tilde)
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def _eight_schools_transformed(sigma, y=None):
    mu = pyro.sample("mu", dist.Normal(sigma.new_tensor(0.0), 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(sigma.new_tensor(5.0)))
    with pyro.plate("schools", len(sigma)):
        theta = pyro.sample(
            "theta",
            dist.TransformedDistribution(
                dist.Normal(sigma.new_tensor(0.0), 1.0),
                dist.transforms.AffineTransform(mu, tau),
            ),
        )
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


# Non-centred by Pyro's reparameterisation handler, as in the "eight schools" tutorial.
eight_schools_reparam = poutine.reparam(
    _eight_schools_transformed, config={"theta": TransformReparam()}
)


# Efron & Morris (1975): hits in the first 45 at-bats of 18 players of the 1970 season.
_HITS = [18, 17, 16, 15, 14, 14, 13, 12, 11, 11, 10, 10, 10, 10, 10, 9, 8, 7]


def baseball_data(dtype=torch.float64) -> ZooData:
    hits = torch.tensor(_HITS, dtype=dtype)
    return ZooData((torch.full_like(hits, 45.0), hits))


def baseball_partially_pooled(at_bats, hits=None):
    """Pyro's ``examples/baseball.py`` ``partially_pooled``: chance of a hit per player,
    ``phi ~ Beta(m kappa, (1 - m) kappa)``, ``m ~ Uniform(0, 1)``, ``kappa ~ Pareto(1, 1.5)``."""
    m = pyro.sample("m", dist.Uniform(at_bats.new_tensor(0.0), 1.0))
    kappa = pyro.sample("kappa", dist.Pareto(at_bats.new_tensor(1.0), 1.5))
    with pyro.plate("players", len(at_bats)):
        phi = pyro.sample("phi", dist.Beta(m * kappa, (1 - m) * kappa))
        return pyro.sample("obs", dist.Binomial(at_bats, probs=phi), obs=hits)


def hierarchical_logistic(group, X, y=None, num_groups: int = 8):
    """Varying-intercept logistic regression (Gelman & Hill ch. 14):
    ``alpha_j ~ N(mu_alpha, sigma_alpha)``, ``y ~ Bernoulli(logits = alpha[g] + X beta)``."""
    mu_a = pyro.sample("mu_alpha", dist.Normal(X.new_tensor(0.0), 2.0))
    sigma_a = pyro.sample("sigma_alpha", dist.HalfNormal(X.new_tensor(1.0)))
    beta = pyro.sample("beta", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    with pyro.plate("groups", num_groups):
        alpha = pyro.sample("alpha", dist.Normal(mu_a, sigma_a))
    with pyro.plate("data", X.shape[0]):
        return pyro.sample("obs", dist.Bernoulli(logits=alpha[group] + X @ beta), obs=y)


def hierarchical_logistic_data(dtype=torch.float64) -> ZooData:
    g = torch.Generator().manual_seed(20)
    n, J = 400, 8
    group = torch.randint(0, J, (n,), generator=g)
    X = torch.randn(n, 2, generator=g, dtype=dtype)
    alpha = 0.3 + 0.8 * torch.randn(J, generator=g, dtype=dtype)
    logits = alpha[group] + X @ torch.tensor([1.0, -0.7], dtype=dtype)
    y = torch.bernoulli(torch.sigmoid(logits), generator=g)
    tr, te = slice(0, 300), slice(300, n)
    return ZooData(
        (group[tr], X[tr], y[tr]), {"num_groups": J}, test_args=(group[te], X[te], y[te])
    )


def _lpd(model, guide, data):
    return log_predictive_density(model, guide, data)


ENTRIES = [
    ZooModel(
        "eight_schools_centered",
        eight_schools_centered,
        eight_schools_data,
        "Pyro examples/eight_schools; Gelman et al. BDA ch. 5",
        steps=200,
    ),
    ZooModel(
        "eight_schools_noncentered",
        eight_schools_noncentered,
        eight_schools_data,
        "Pyro examples/eight_schools (non-centred, pyro.deterministic)",
        steps=150,
    ),
    ZooModel(
        "eight_schools_reparam",
        eight_schools_reparam,
        eight_schools_data,
        "Pyro tutorial: poutine.reparam with TransformReparam",
        steps=150,
    ),
    ZooModel(
        "baseball",
        baseball_partially_pooled,
        baseball_data,
        "Pyro examples/baseball.py (partially pooled); Efron & Morris 1975",
        steps=200,
    ),
    ZooModel(
        "hierarchical_logistic",
        hierarchical_logistic,
        hierarchical_logistic_data,
        "Gelman & Hill ch. 14 (varying intercepts)",
        heldout=_lpd,
        steps=150,
    ),
]
