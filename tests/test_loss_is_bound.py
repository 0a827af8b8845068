"""The loss ``svi.step`` reports is the -ELBO of the guide's current ``q``.

For every model below, after a few CVI steps, ``svi.evaluate_loss`` (and the value the next
``svi.step`` returns, which is computed before that step's update) must agree with an
independent Monte Carlo estimate of the same guide's bound: ``pyro.infer.Trace_ELBO`` run on the
model and the very same ``AutoCVI`` object, which samples every latent site from ``q``
(discrete ones included, so plain Trace_ELBO, not TraceEnum_ELBO, is the referee; for the HMM
the guide's states at padded time steps count with their ``log q``, as they do in any guide).

Where CVI's value is itself a Monte Carlo estimate (general factors, minibatches) both sides are
averaged and the tolerance is four combined standard errors.
"""

import math
from dataclasses import dataclass, field
from typing import Callable

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide.initialization import init_to_value

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, step_sizes

F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@dataclass
class Case:
    """A model, its data, how to run CVI on it, and Trace_ELBO's budget: ``M`` calls of ``P``
    particles each."""

    model: Callable
    args: tuple
    guide_kwargs: dict = field(default_factory=dict)
    step_size: object = 1.0
    steps: int = 10
    M: int = 100
    P: int = 10


# ------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------
def two_site_regression():
    g = _gen(0)
    x = torch.randn(100, generator=g, dtype=F64)
    y = 1.0 + 2.0 * x + 0.5 * torch.randn(100, generator=g, dtype=F64)

    def model(x, y):
        a = pyro.sample("a", dist.Normal(x.new_tensor(0.0), 10.0))
        b = pyro.sample("b", dist.Normal(x.new_tensor(0.0), 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Normal(a + b * x, 0.5), obs=y)

    return Case(model, (x, y), steps=5)


def halfnormal_noise_regression():
    g = _gen(1)
    X = torch.randn(50, 3, generator=g, dtype=F64)
    y = X @ torch.tensor([0.5, -1.0, 2.0], dtype=F64) + 0.7 * torch.randn(
        50, generator=g, dtype=F64
    )

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(3), 1.0).to_event(1))
        sigma = pyro.sample("sigma", dist.HalfNormal(X.new_tensor(1.0)))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Normal(X @ w, sigma), obs=y)

    return Case(model, (X, y), step_size=0.5)


def enumerated_hmm_masked():
    """Pyro's examples/hmm.py ``model_1``: binary tones, a hidden Markov state per time step."""
    S, T, D, H = 5, 8, 4, 3
    g = _gen(2)
    lengths = torch.tensor([8, 5, 3, 7, 6])
    seqs = torch.bernoulli(torch.full((S, T, D), 0.4, dtype=F64), generator=g)
    seqs = seqs * (torch.arange(T)[None, :, None] < lengths[:, None, None])

    def model(sequences, lengths):
        probs_x = pyro.sample(
            "probs_x",
            dist.Dirichlet(0.9 * torch.eye(H, dtype=F64) + 0.1).to_event(1),
        )
        probs_y = pyro.sample(
            "probs_y",
            dist.Beta(torch.tensor(0.1, dtype=F64), 0.9).expand([H, D]).to_event(2),
        )
        tones = pyro.plate("tones", D, dim=-1)
        with pyro.plate("sequences", S, dim=-2):
            x = 0
            for t in pyro.markov(range(T)):
                with poutine.mask(mask=(t < lengths).unsqueeze(-1)):
                    x = pyro.sample(
                        f"x_{t}",
                        dist.Categorical(probs_x[x]),
                        infer={"enumerate": "parallel"},
                    )
                    with tones:
                        pyro.sample(
                            f"y_{t}",
                            dist.Bernoulli(probs_y[x.squeeze(-1)]),
                            obs=sequences[:, t],
                        )

    return Case(model, (seqs, lengths), {"schedule": "sequential"}, steps=5, M=50)


def logistic_regression():
    g = _gen(3)
    X = torch.cat([torch.ones(40, 1, dtype=F64), torch.randn(40, 2, generator=g, dtype=F64)], 1)
    y = torch.bernoulli(torch.sigmoid(X @ torch.tensor([0.3, 1.5, -1.0], dtype=F64)), generator=g)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(3), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Bernoulli(logits=X @ w), obs=y)

    return Case(model, (X, y))


def linear_regression_unknown_precision():
    g = _gen(4)
    X = torch.randn(40, 3, generator=g, dtype=F64)
    y = X @ torch.tensor([1.0, -0.5, 0.2], dtype=F64) + 0.4 * torch.randn(
        40, generator=g, dtype=F64
    )

    def model(X, y):
        tau = pyro.sample("tau", dist.Gamma(X.new_tensor(2.0), 2.0))
        w = pyro.sample("w", dist.Normal(X.new_zeros(3), 1.5).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Normal(X @ w, tau**-0.5), obs=y)

    return Case(model, (X, y))


def beta_bernoulli():
    y = torch.tensor([1.0, 0, 1, 1, 1, 0, 1, 1, 0, 1], dtype=F64)

    def model(y):
        p = pyro.sample("p", dist.Beta(y.new_tensor(2.0), 3.0))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Bernoulli(p), obs=y)

    return Case(model, (y,), step_size=0.5, steps=5)


def gamma_poisson():
    y = torch.tensor([2.0, 5, 3, 0, 4, 1], dtype=F64)

    def model(y):
        rate = pyro.sample("rate", dist.Gamma(y.new_tensor(2.0), 0.5))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Poisson(rate), obs=y)

    return Case(model, (y,), step_size=0.5, steps=5)


def dirichlet_categorical():
    y = torch.tensor([0, 2, 2, 1, 2, 3, 0, 2])

    def model(y):
        pi = pyro.sample("pi", dist.Dirichlet(torch.tensor([1.0, 2.0, 3.0, 0.5], dtype=F64)))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Categorical(pi), obs=y)

    return Case(model, (y,), step_size=0.5, steps=5)


def gaussian_mixture():
    g = _gen(5)
    c = torch.rand(30, generator=g) < 0.4
    x = torch.where(c, -2.0, 2.0).to(F64) + torch.randn(30, generator=g, dtype=F64)

    def model(x):
        with pyro.plate("components", 2):
            mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 3.0))
        with pyro.plate("data", len(x)):
            z = pyro.sample("z", dist.Categorical(x.new_ones(2) / 2))
            pyro.sample("obs", dist.Normal(mu[z], 1.0), obs=x)

    init = init_to_value(values={"mu": torch.tensor([-1.0, 1.0], dtype=F64)})
    return Case(model, (x,), {"init_loc_fn": init})


def studentt_prior_logistic_regression():
    """A StudentT prior on a Gaussian q is not conjugate: a general (Monte Carlo) factor."""
    g = _gen(6)
    X = torch.randn(30, 2, generator=g, dtype=F64)
    y = torch.bernoulli(torch.sigmoid(X @ torch.tensor([1.0, -2.0], dtype=F64)), generator=g)

    def model(X, y):
        w = pyro.sample("w", dist.StudentT(3.0, X.new_zeros(2), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Bernoulli(logits=X @ w), obs=y)

    step = step_sizes.robbins_monro(0.5, 1.0, 0.7)
    return Case(model, (X, y), {"num_general_samples": 16}, step, steps=20)


def subsampled_mixture():
    g = _gen(7)
    centers = torch.tensor([-4.0, 0.0, 5.0], dtype=F64)
    x = centers[torch.randint(0, 3, (60,), generator=g)] + torch.randn(60, generator=g, dtype=F64)

    def model(x):
        with pyro.plate("components", 3):
            mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 5.0))
        with pyro.plate("data", len(x), subsample_size=15) as ind:
            c = pyro.sample("c", dist.Categorical(x.new_ones(3) / 3))
            pyro.sample("obs", dist.Normal(mu[c], 1.0), obs=x[ind])

    init = init_to_value(values={"mu": torch.tensor([-1.0, 0.5, 2.0], dtype=F64)})
    step = step_sizes.robbins_monro(1.0, 1.0, 0.7)
    return Case(model, (x,), {"init_loc_fn": init}, step, steps=20, P=5)


# ------------------------------------------------------------------------------------------------
# the comparison
# ------------------------------------------------------------------------------------------------
def _mean_se(values):
    v = torch.tensor(values, dtype=F64)
    if len(v) < 2:
        return float(v.mean()), 0.0, 0.0
    return float(v.mean()), float(v.std() / math.sqrt(len(v))), float(v.std())


def assert_loss_is_bound(
    model, guide, svi, args, M=200, P=10, cvi_repeats=30, kwargs=None, referee=None, z=4.0
):
    """CVI's -ELBO of the current ``q`` against Trace_ELBO's Monte Carlo estimate of it
    (or ``referee``'s: an ELBO instance, or a Pyro ELBO class made with ``P`` particles, e.g.
    TraceEnum_ELBO for a guide with collapsed or model-enumerated discrete latents).

    ``evaluate_loss`` is called twice: when both agree bitwise CVI's value is exact
    (closed forms and quadrature), and the next ``svi.step`` must return it exactly; otherwise
    it is averaged over ``cvi_repeats`` calls and its standard error joins the tolerance of
    ``z`` combined standard errors. Returns ``(cvi, mc_mean, mc_se)``.
    """
    kwargs = kwargs or {}
    first = svi.evaluate_loss(*args, **kwargs)
    exact = svi.evaluate_loss(*args, **kwargs) == first
    if exact:
        cvi, cvi_se, cvi_sd = first, 0.0, 0.0
    else:
        cvi, cvi_se, cvi_sd = _mean_se(
            [first] + [svi.evaluate_loss(*args, **kwargs) for _ in range(cvi_repeats - 1)]
        )
    if referee is None:
        referee = Trace_ELBO
    elbo = referee(num_particles=P) if isinstance(referee, type) else referee
    mc, mc_se, _ = _mean_se([elbo.loss(model, guide, *args, **kwargs) for _ in range(M)])
    se = math.sqrt(mc_se**2 + cvi_se**2)
    msg = (
        f"CVI -ELBO {cvi:.6g} (se {cvi_se:.3g}, exact={exact}) vs {type(elbo).__name__} "
        f"{mc:.6g} (se {mc_se:.3g}, M={M}, P={P}): difference {cvi - mc:.4g} = "
        f"{(cvi - mc) / max(se, 1e-300):.1f} se"
    )
    assert abs(cvi - mc) <= z * se + 1e-6 * abs(mc), msg
    # the next step reports the same value (computed before its update), unless the adaptive
    # step undid the last step there (then it reports the restored q's value)
    backtracks = getattr(guide, "num_backtracks", 0)
    reported = svi.step(*args, **kwargs)
    if getattr(guide, "num_backtracks", 0) != backtracks:
        return cvi, mc, mc_se
    if exact:
        assert reported == cvi, f"svi.step returned {reported!r}, evaluate_loss {cvi!r}"
    else:
        # one draw of a heavy-tailed estimate (a minibatch's scaled sum): z + 2 of its sds
        tol = (z + 2) * math.sqrt(cvi_sd**2 + mc_se**2) + 1e-6 * abs(mc)
        assert abs(reported - cvi) <= tol, f"svi.step returned {reported}, {msg}"
    return cvi, mc, mc_se


def uniform_noise_regression():
    """Pyro's Bayesian regression tutorial shape: ``sigma ~ Uniform(0, 10)`` (an interval
    support: a Gaussian q on the unconstrained space)."""
    g = _gen(11)
    X = torch.randn(40, 2, generator=g, dtype=F64)
    y = X @ torch.tensor([1.0, -2.0], dtype=F64) + 0.8 * torch.randn(40, generator=g, dtype=F64)

    def model(X, y):
        a = pyro.sample("a", dist.Normal(X.new_tensor(0.0), 10.0))
        w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
        sigma = pyro.sample("sigma", dist.Uniform(X.new_tensor(0.0), 10.0))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Normal(a + X @ w, sigma), obs=y)

    return Case(model, (X, y), step_size=0.2, steps=40)


def pareto_hierarchical_binomial():
    """examples/baseball.py's shape: ``kappa ~ Pareto(1, 1.5)`` (support ``>= 1``)."""
    at_bats = torch.tensor([45.0, 40.0, 50.0, 38.0, 44.0], dtype=F64)
    hits = torch.tensor([18.0, 9.0, 15.0, 12.0, 20.0], dtype=F64)

    def model(at_bats, hits):
        phi = pyro.sample("phi", dist.Uniform(at_bats.new_tensor(0.0), 1.0))
        kappa = pyro.sample("kappa", dist.Pareto(at_bats.new_tensor(1.0), 1.5))
        with pyro.plate("players", len(at_bats)):
            theta = pyro.sample("theta", dist.Beta(phi * kappa, (1 - phi) * kappa))
            pyro.sample("obs", dist.Binomial(at_bats, theta), obs=hits)

    return Case(model, (at_bats, hits), step_size=0.2, steps=40)


def poisson_random_walk_cumsum():
    """The forecasting tutorials' random walk, ``x = eps.cumsum(-1)`` of plated Normal
    increments: a Markov block whose guide samples ``eps = diff(x)`` from the chain's ``q``."""
    T = 15
    y = torch.poisson(torch.full((T,), 3.0, dtype=F64), generator=_gen(12))

    def model(y):
        with pyro.plate("time", T):
            eps = pyro.sample("eps", dist.Normal(y.new_tensor(0.0), 0.3))
        with pyro.plate("obs", T):
            pyro.sample("y", dist.Poisson(eps.cumsum(-1).exp()), obs=y)

    return Case(model, (y,), M=20, P=5)


MODELS = [
    poisson_random_walk_cumsum,
    two_site_regression,
    uniform_noise_regression,
    pareto_hierarchical_binomial,
    halfnormal_noise_regression,
    enumerated_hmm_masked,
    logistic_regression,
    linear_regression_unknown_precision,
    beta_bernoulli,
    gamma_poisson,
    dirichlet_categorical,
    gaussian_mixture,
    studentt_prior_logistic_regression,
]


def _fit(case):
    guide = AutoCVI(case.model, **case.guide_kwargs)
    svi = SVI(case.model, guide, CVI(step_size=case.step_size), loss=CVI_ELBO())
    for _ in range(case.steps):
        svi.step(*case.args)
    return guide, svi


@pytest.mark.parametrize("make", MODELS, ids=[m.__name__ for m in MODELS])
def test_reported_loss_is_the_bound_of_the_current_q(make):
    case = make()
    guide, svi = _fit(case)
    cvi, mc, se = assert_loss_is_bound(case.model, guide, svi, case.args, M=case.M, P=case.P)
    if make is enumerated_hmm_masked:
        # -ELBO >= -log p(y) >= 0 for binary observations. (A bound that also counts the guide's
        # entropy of the 11 padded states can be lower by at most 11 log 3 = 12.1 nats, far less
        # than the likelihood terms here.)
        assert cvi >= 0, f"a -ELBO of binary data must be >= 0, got {cvi}"


def _mixture_full_data_loss(x, guide):
    """Closed-form full-data -ELBO of the subsampled mixture's q (q(c) of every point)."""
    qm, phi = guide.posterior("mu"), guide.posterior("c").probs
    m, s2 = qm.loc, qm.scale**2
    ell = (phi * (-0.5 * math.log(2 * math.pi) - 0.5 * ((x[:, None] - m) ** 2 + s2))).sum()
    prior = (dist.Normal(0.0, 5.0).log_prob(m) - 0.5 * s2 / 25.0).sum()
    ent = (0.5 * torch.log(2 * math.pi * math.e * s2)).sum()
    ent = ent - (phi * phi.clamp_min(1e-300).log()).sum()
    return -float(ell + prior + ent - len(x) * math.log(3))


def test_subsampled_loss_is_an_unbiased_estimate_of_the_full_bound():
    """With ``pyro.plate(subsample_size=B)`` each ``evaluate_loss`` sees one minibatch, so the
    loss at a fixed minibatch is not comparable; instead its average over many calls and
    Trace_ELBO's average (whose guide draws the minibatch) estimate the same full-data bound,
    which is also available in closed form here."""
    case = subsampled_mixture()
    guide, svi = _fit(case)
    (x,) = case.args
    cvi, cvi_se, _ = _mean_se([svi.evaluate_loss(x) for _ in range(200)])
    elbo = Trace_ELBO(num_particles=case.P)
    mc, mc_se, _ = _mean_se([elbo.loss(case.model, guide, x) for _ in range(case.M)])
    exact = _mixture_full_data_loss(x, guide)
    se = math.sqrt(cvi_se**2 + mc_se**2)
    msg = (
        f"CVI -ELBO {cvi:.6g} (se {cvi_se:.3g}) vs Trace_ELBO {mc:.6g} (se {mc_se:.3g}); "
        f"closed form {exact:.6g}"
    )
    assert abs(mc - exact) <= 4 * mc_se + 1e-6 * abs(exact), msg  # the referee itself
    assert abs(cvi - mc) <= 4 * se + 1e-6 * abs(mc), msg
    assert abs(cvi - exact) <= 4 * cvi_se + 1e-6 * abs(exact), msg
