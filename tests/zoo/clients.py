"""Zoo: client models, written as Pyro users write them from Stan's and NumPyro's examples.

Every model takes its tensors from the data's dtype (``x.new_tensor``), so float32 data gives
a float32 model. Data are synthetic, drawn in float64 with a fixed seed and then cast, so both
dtypes see the same numbers. Sizes are small (a fit takes seconds); ``scripts/
make_nuts_references.py`` writes a long NUTS run of each to ``tests/zoo/references/``.

:data:`CLIENTS` lists the client models in benchmark order: the entries of this module and two
that ``users.py`` already holds (``horseshoe_logistic``, ``ppca``). :data:`CANONICAL` maps a
model whose posterior has exact symmetries (exchangeable mixture components and HMM states,
PPCA's rotations) to a function of posterior draws that removes them, so that means and
standard deviations of different runs are comparable: draws ``{site: (S, *shape)}`` in,
named identifiable quantities ``{name: (S, *shape)}`` out.
"""

from __future__ import annotations

from typing import Callable, Dict

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import config_enumerate

from . import ZooData, ZooModel


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- stochastic volatility
def stochastic_volatility(returns):
    """NumPyro's ``examples/stochastic_volatility.py`` with Normal returns, written the Pyro
    way (Pyro has no ``GaussianRandomWalk``): the log-volatility is the cumulative sum of
    Normal increments whose scale is a latent, ``r_t ~ Normal(0, exp(s_t / 2))``."""
    T = returns.shape[0]
    step_scale = pyro.sample("step_scale", dist.Exponential(returns.new_tensor(10.0)))
    with pyro.plate("steps", T):
        increments = pyro.sample("increments", dist.Normal(returns.new_tensor(0.0), step_scale))
    log_vol = increments.cumsum(-1)
    with pyro.plate("time", T):
        scale = (log_vol / 2).exp()
        pyro.sample("returns", dist.Normal(returns.new_tensor(0.0), scale), obs=returns)


def stochastic_volatility_data(dtype=torch.float64) -> ZooData:
    """150 daily returns whose log-variance walks with step 0.15 from 0."""
    g = _gen(50)
    T = 150
    s = (0.15 * torch.randn(T, generator=g, dtype=torch.float64)).cumsum(0)
    r = (s / 2).exp() * torch.randn(T, generator=g, dtype=torch.float64)
    return ZooData((r.to(dtype),))


# --------------------------------------------------------------------------- ARMA(1, 1)
def arma11(y):
    """Stan User's Guide, "Moving average models": ARMA(1, 1) with the error recursion
    ``nu_t = mu + phi y_{t-1} + theta err_{t-1}``, ``err_t = y_t - nu_t``, and Stan's priors
    (``mu ~ N(0, 10)``, ``phi, theta ~ N(0, 2)``, ``sigma ~ half-Cauchy(0, 5)``)."""
    mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 10.0))
    phi = pyro.sample("phi", dist.Normal(y.new_tensor(0.0), 2.0))
    theta = pyro.sample("theta", dist.Normal(y.new_tensor(0.0), 2.0))
    sigma = pyro.sample("sigma", dist.HalfCauchy(y.new_tensor(5.0)))
    nu = [mu + phi * mu]
    err = y[0] - nu[0]
    for t in range(1, y.shape[0]):
        nu.append(mu + phi * y[t - 1] + theta * err)
        err = y[t] - nu[t]
    with pyro.plate("time", y.shape[0]):
        pyro.sample("y", dist.Normal(torch.stack(nu, -1), sigma), obs=y)


def arma11_vectorised(y):
    """:func:`arma11` with the error recursion solved as one triangular system,
    ``err_t + theta err_{t-1} = y_t - mu - phi y_{t-1}``: the same density (the tests check it)
    at a fraction of the cost per gradient, for long NUTS runs."""
    mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 10.0))
    phi = pyro.sample("phi", dist.Normal(y.new_tensor(0.0), 2.0))
    theta = pyro.sample("theta", dist.Normal(y.new_tensor(0.0), 2.0))
    sigma = pyro.sample("sigma", dist.HalfCauchy(y.new_tensor(5.0)))
    T = y.shape[0]
    previous = torch.cat([mu.reshape(1), y[:-1]])
    c = y - mu - phi * previous
    lower = torch.eye(T, dtype=y.dtype, device=y.device)
    lower = lower + theta * torch.diag(y.new_ones(T - 1), -1)
    err = torch.linalg.solve_triangular(lower, c.unsqueeze(-1), upper=False).squeeze(-1)
    with pyro.plate("time", T):
        pyro.sample("y", dist.Normal(y - err, sigma), obs=y)


def arma11_data(dtype=torch.float64) -> ZooData:
    """100 points of ARMA(1, 1) with mu 1, phi 0.6, theta 0.3, sigma 0.5."""
    g = _gen(51)
    T, mu, phi, theta, sigma = 100, 1.0, 0.6, 0.3, 0.5
    e = sigma * torch.randn(T, generator=g, dtype=torch.float64)
    y = torch.zeros(T, dtype=torch.float64)
    y[0] = mu + phi * mu + e[0]
    for t in range(1, T):
        y[t] = mu + phi * y[t - 1] + theta * e[t - 1] + e[t]
    return ZooData((y.to(dtype),))


# --------------------------------------------------------------------------- exchangeable mixture
@config_enumerate
def exchangeable_mixture(data):
    """A two-component Gaussian mixture whose component means share one prior (Stan User's
    Guide, "Finite mixtures"; Pyro's GMM tutorial), an enumerated assignment per point."""
    weights = pyro.sample("weights", dist.Dirichlet(data.new_ones(2)))
    scale = pyro.sample("scale", dist.HalfNormal(data.new_tensor(2.0)))
    with pyro.plate("components", 2):
        locs = pyro.sample("locs", dist.Normal(data.new_tensor(0.0), 5.0))
    with pyro.plate("data", data.shape[0]):
        z = pyro.sample("z", dist.Categorical(weights))
        pyro.sample("obs", dist.Normal(locs[z], scale), obs=data)


def exchangeable_mixture_msf(data):
    """The same mixture written with ``MixtureSameFamily`` (the assignments summed inside the
    distribution, as NumPyro's and Stan's ``log_mix`` users write it)."""
    weights = pyro.sample("weights", dist.Dirichlet(data.new_ones(2)))
    scale = pyro.sample("scale", dist.HalfNormal(data.new_tensor(2.0)))
    with pyro.plate("components", 2):
        locs = pyro.sample("locs", dist.Normal(data.new_tensor(0.0), 5.0))
    mix = dist.MixtureSameFamily(dist.Categorical(weights), dist.Normal(locs, scale))
    with pyro.plate("data", data.shape[0]):
        pyro.sample("obs", mix, obs=data)


def exchangeable_mixture_data(dtype=torch.float64) -> ZooData:
    """300 points: 40% around -2, 60% around 2.5, unit scale."""
    g = _gen(52)
    n = 300
    c = torch.rand(n, generator=g, dtype=torch.float64) < 0.4
    x = torch.where(c, -2.0, 2.5) + torch.randn(n, generator=g, dtype=torch.float64)
    return ZooData((x.to(dtype),))


def _sort_components(draws):
    """Components ordered by their means in each draw (the mixture is exchangeable)."""
    order = draws["locs"].argsort(-1)
    out = {"locs": draws["locs"].gather(-1, order), "scale": draws["scale"]}
    out["weights"] = draws["weights"].gather(-1, order)
    return out


# --------------------------------------------------------------------------- GP Poisson regression
def gp_poisson(x, y):
    """Stan User's Guide, "Gaussian processes: latent variable GP with a Poisson likelihood":
    a squared-exponential kernel whose lengthscale and amplitude are latents, the GP values a
    latent ``MultivariateNormal``, counts ``y ~ Poisson(exp(f))``."""
    lengthscale = pyro.sample("lengthscale", dist.LogNormal(x.new_tensor(0.0), 1.0))
    amplitude = pyro.sample("amplitude", dist.HalfNormal(x.new_tensor(2.0)))
    d2 = (x[:, None] - x[None, :]).pow(2)
    n = x.shape[0]
    eye = torch.eye(n, dtype=x.dtype, device=x.device)
    cov = amplitude.pow(2) * (-0.5 * d2 / lengthscale.pow(2)).exp() + 1e-3 * eye
    f = pyro.sample("f", dist.MultivariateNormal(x.new_zeros(n), covariance_matrix=cov))
    with pyro.plate("data", n):
        pyro.sample("y", dist.Poisson(f.exp()), obs=y)


def gp_poisson_data(dtype=torch.float64) -> ZooData:
    """16 counts on [0, 10] with rate exp(1 + sin(x))."""
    g = _gen(53)
    x = torch.linspace(0.0, 10.0, 16, dtype=torch.float64)
    y = torch.poisson((1.0 + x.sin()).exp(), generator=g)
    return ZooData((x.to(dtype), y.to(dtype)))


# --------------------------------------------------------------------------- Gaussian HMM
def hmm_gaussian(y):
    """A two-state HMM with Normal emissions whose means are latent, the states enumerated in
    a ``pyro.markov`` loop (Pyro's ``examples/hmm.py`` style; Stan User's Guide, "Hidden
    Markov models"). The first state is drawn from the mean row of the transition matrix
    (the chain starts in a uniformly drawn state), as in :func:`hmm_gaussian_discrete`."""
    K = 2
    trans = pyro.sample("trans", dist.Dirichlet(y.new_ones(K, K)).to_event(1))
    locs = pyro.sample("locs", dist.Normal(y.new_zeros(K), 5.0).to_event(1))
    scale = pyro.sample("scale", dist.HalfNormal(y.new_tensor(2.0)))
    probs = trans.mean(0)
    for t in pyro.markov(range(y.shape[0])):
        x = pyro.sample(f"x_{t}", dist.Categorical(probs), infer={"enumerate": "parallel"})
        pyro.sample(f"y_{t}", dist.Normal(locs[x], scale), obs=y[t])
        probs = trans[x]


def hmm_gaussian_discrete(y):
    """The same HMM written with ``dist.DiscreteHMM`` (uniform initial logits: the state
    before the first is uniform), the states summed inside the distribution."""
    K = 2
    trans = pyro.sample("trans", dist.Dirichlet(y.new_ones(K, K)).to_event(1))
    locs = pyro.sample("locs", dist.Normal(y.new_zeros(K), 5.0).to_event(1))
    scale = pyro.sample("scale", dist.HalfNormal(y.new_tensor(2.0)))
    hmm = dist.DiscreteHMM(y.new_zeros(K), trans.log(), dist.Normal(locs, scale))
    pyro.sample("y", hmm, obs=y)


def hmm_gaussian_data(dtype=torch.float64) -> ZooData:
    """40 observations of a sticky two-state chain (stay 0.9) with means -1.5 and 1.5."""
    g = _gen(54)
    T = 40
    state, ys = 0, []
    for _ in range(T):
        if torch.rand((), generator=g) > 0.9:
            state = 1 - state
        ys.append((-1.5 if state == 0 else 1.5) + float(torch.randn((), generator=g)))
    return ZooData((torch.tensor(ys, dtype=torch.float64).to(dtype),))


def _sort_states(draws):
    """States ordered by their emission means in each draw; the transition matrix's rows and
    columns permuted alike (the HMM is exchangeable in its states)."""
    order = draws["locs"].argsort(-1)
    trans = draws["trans"]
    rows = order[..., :, None].expand(trans.shape)
    cols = order[..., None, :].expand(trans.shape)
    trans = trans.gather(-2, rows).gather(-1, cols)
    return {"locs": draws["locs"].gather(-1, order), "trans": trans, "scale": draws["scale"]}


# --------------------------------------------------------------------------- linear regression
def linear_regression(X, y):
    """Stan User's Guide, "Linear regression", with a half-Normal noise scale."""
    b = pyro.sample("b", dist.Normal(X.new_tensor(0.0), 10.0))
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(X.new_tensor(1.0)))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(b + X @ w, sigma), obs=y)


def linear_regression_data(dtype=torch.float64) -> ZooData:
    g = _gen(55)
    X = torch.randn(100, 3, generator=g, dtype=torch.float64)
    y = 0.5 + X @ torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    y = y + 0.4 * torch.randn(100, generator=g, dtype=torch.float64)
    return ZooData((X.to(dtype), y.to(dtype)))


# --------------------------------------------------------------------------- logistic, latent scale
def logistic_latent_scale(X, y):
    """NumPyro's ``examples/ucbadmit``-style logistic regression with a latent prior scale
    on the weights (Stan User's Guide, "Logistic regression", with a hierarchical prior)."""
    scale = pyro.sample("scale", dist.HalfNormal(X.new_tensor(1.0)))
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), scale).to_event(1))
    b = pyro.sample("b", dist.Normal(X.new_tensor(0.0), 2.0))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=b + X @ w), obs=y)


def logistic_latent_scale_data(dtype=torch.float64) -> ZooData:
    g = _gen(56)
    X = torch.randn(150, 5, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, -0.8, 0.5, 0.0, 0.3], dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(-0.3 + X @ w), generator=g)
    return ZooData((X.to(dtype), y.to(dtype)))


# --------------------------------------------------------------------------- change point
@config_enumerate
def poisson_changepoint(counts):
    """Stan User's Guide, "Change point models" (the coal-mining disasters): Exponential early
    and late rates, the switch year an enumerated uniform Categorical."""
    T = counts.shape[0]
    early = pyro.sample("early_rate", dist.Exponential(counts.new_tensor(1.0 / 3.0)))
    late = pyro.sample("late_rate", dist.Exponential(counts.new_tensor(1.0 / 3.0)))
    switch = pyro.sample("switch", dist.Categorical(logits=counts.new_zeros(T)))
    years = torch.arange(T, device=counts.device)
    rate = torch.where(years < switch, early, late)
    with pyro.plate("years", T):
        pyro.sample("counts", dist.Poisson(rate), obs=counts)


def poisson_changepoint_data(dtype=torch.float64) -> ZooData:
    """60 yearly counts, rate 3 before year 25 and 1 after."""
    g = _gen(57)
    rate = torch.where(torch.arange(60) < 25, 3.0, 1.0).to(torch.float64)
    return ZooData((torch.poisson(rate, generator=g).to(dtype),))


# --------------------------------------------------------------------------- radon varying slopes
def radon_varying_slope(county, floor, num_counties: int, log_radon):
    """Gelman & Hill ch. 13 (Stan's and NumPyro's radon examples): varying intercepts and
    slopes per county, centred, with latent population means and scales."""
    zero = floor.new_tensor(0.0)
    mu_a = pyro.sample("mu_a", dist.Normal(zero, 10.0))
    mu_b = pyro.sample("mu_b", dist.Normal(zero, 10.0))
    sigma_a = pyro.sample("sigma_a", dist.HalfNormal(floor.new_tensor(1.0)))
    sigma_b = pyro.sample("sigma_b", dist.HalfNormal(floor.new_tensor(1.0)))
    with pyro.plate("counties", num_counties):
        a = pyro.sample("a", dist.Normal(mu_a, sigma_a))
        b = pyro.sample("b", dist.Normal(mu_b, sigma_b))
    sigma_y = pyro.sample("sigma_y", dist.HalfNormal(floor.new_tensor(1.0)))
    with pyro.plate("houses", floor.shape[0]):
        mean = a[county] + b[county] * floor
        pyro.sample("log_radon", dist.Normal(mean, sigma_y), obs=log_radon)


def radon_data(dtype=torch.float64) -> ZooData:
    """200 houses in 10 counties; basement (0) or first floor (1)."""
    g = _gen(58)
    J, n = 10, 200
    a = 1.5 + 0.4 * torch.randn(J, generator=g, dtype=torch.float64)
    b = -0.6 + 0.3 * torch.randn(J, generator=g, dtype=torch.float64)
    county = torch.randint(0, J, (n,), generator=g)
    floor = (torch.rand(n, generator=g, dtype=torch.float64) < 0.3).to(torch.float64)
    y = a[county] + b[county] * floor + 0.7 * torch.randn(n, generator=g, dtype=torch.float64)
    return ZooData((county, floor.to(dtype), J, y.to(dtype)))


# --------------------------------------------------------------------------- PPCA (users.py)
def _ppca_invariants(draws):
    """PPCA is invariant to ``z -> z R``, ``W -> R^T W`` for orthogonal ``R``: compare
    ``W^T W``, the fitted means ``z W`` and ``mu``, ``sigma``."""
    W, z = draws["W"], draws["z"]
    return {
        "WtW": W.transpose(-1, -2) @ W,
        "zW": z @ W,
        "mu": draws["mu"],
        "sigma": draws["sigma"],
    }


#: Symmetry-free functions of posterior draws, by model (see the module docstring).
CANONICAL: Dict[str, Callable] = {
    "exchangeable_mixture": _sort_components,
    "exchangeable_mixture_msf": _sort_components,
    "hmm_gaussian": _sort_states,
    "hmm_gaussian_discrete": _sort_states,
    "ppca": _ppca_invariants,
}

ENTRIES = [
    ZooModel(
        "stochastic_volatility",
        stochastic_volatility,
        stochastic_volatility_data,
        "NumPyro examples/stochastic_volatility.py (Normal returns, latent step scale)",
        steps=300,
    ),
    ZooModel("arma11", arma11, arma11_data, "Stan User's Guide: ARMA(1, 1)", steps=300),
    ZooModel(
        "exchangeable_mixture",
        exchangeable_mixture,
        exchangeable_mixture_data,
        "Stan User's Guide: finite mixtures (exchangeable components, config_enumerate)",
        has_discrete=True,
        steps=300,
    ),
    ZooModel(
        "exchangeable_mixture_msf",
        exchangeable_mixture_msf,
        exchangeable_mixture_data,
        "Stan User's Guide: finite mixtures, written with MixtureSameFamily",
        steps=300,
    ),
    ZooModel(
        "gp_poisson",
        gp_poisson,
        gp_poisson_data,
        "Stan User's Guide: latent-variable GP, Poisson likelihood, latent kernel parameters",
        steps=300,
    ),
    ZooModel(
        "hmm_gaussian",
        hmm_gaussian,
        hmm_gaussian_data,
        "Stan User's Guide: HMM, Normal emissions (pyro.markov, enumerated states)",
        has_discrete=True,
        steps=300,
    ),
    ZooModel(
        "hmm_gaussian_discrete",
        hmm_gaussian_discrete,
        hmm_gaussian_data,
        "Stan User's Guide: HMM, Normal emissions, written with dist.DiscreteHMM",
        steps=300,
    ),
    ZooModel(
        "linear_regression",
        linear_regression,
        linear_regression_data,
        "Stan User's Guide: linear regression, half-Normal noise scale",
        steps=300,
    ),
    ZooModel(
        "logistic_latent_scale",
        logistic_latent_scale,
        logistic_latent_scale_data,
        "Stan User's Guide: logistic regression with a latent prior scale",
        steps=300,
    ),
    ZooModel(
        "poisson_changepoint",
        poisson_changepoint,
        poisson_changepoint_data,
        "Stan User's Guide: change point (coal mining), enumerated switch year",
        has_discrete=True,
        steps=300,
    ),
    ZooModel(
        "radon_varying_slope",
        radon_varying_slope,
        radon_data,
        "Gelman & Hill ch. 13 / Stan and NumPyro radon: varying intercepts and slopes",
        steps=300,
    ),
]

#: The entries this module defines.
CLIENT_ENTRIES = tuple(e.name for e in ENTRIES)
#: The client models in benchmark order (two of them defined in ``users.py``).
CLIENTS = CLIENT_ENTRIES + ("horseshoe_logistic", "ppca")
