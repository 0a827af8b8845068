"""Textbook conjugate pairs with hand-written guides in three parameterisations each, their
analytic posteriors, and Pyro's test tolerances (``tests/infer/test_inference.py`` of Pyro).

Pairs (prior, likelihood -> posterior):

* Normal-Normal: ``mu ~ N(m0, s0^2)``, ``y_i ~ N(mu, s^2)``: precision ``1/s0^2 + n/s^2``, mean
  ``(m0/s0^2 + sum y / s^2) / precision``; guides loc + positive scale, loc + log-scale,
  loc + softplus. Plus a 3-dimensional Normal-Normal (Bayesian linear regression with known
  noise) with a ``scale_tril`` MVN guide: precision ``I + X^T X / s^2``.
* Gamma-Poisson: ``Gamma(a0, b0)`` -> ``Gamma(a0 + sum y, b0 + n)``.
* Gamma-Exponential: ``Gamma(a0, b0)`` -> ``Gamma(a0 + n, b0 + sum y)``.
* Beta-Bernoulli: ``Beta(a0, b0)`` -> ``Beta(a0 + sum y, b0 + n - sum y)``.
* Dirichlet-Categorical: ``Dir(alpha0)`` -> ``Dir(alpha0 + counts)``.
* LogNormal likelihood, Normal guide: ``log y_i ~ N(mu, s^2)``, so Normal-Normal in ``log y``.

Gamma, Beta and Dirichlet guides: concentrations positive-constrained, ``exp`` of raw, softplus
of raw. Every guide starts from a generic point (loc 0, scale 1; Gamma(1, 1); Beta(1, 1);
Dir(1, 1, 1)), as a user's guide would.

Tolerances (Pyro's ``NormalNormalTests``, ``PoissonGammaTests``, ``ExponentialGammaTests``,
``BernoulliBetaTests``, ``LogNormalNormalTests``): Normal guides, summed squared error of the
loc and of the log-scale each <= 0.05 (for the MVN: of the loc, and of the Cholesky factor
with its diagonal on the log scale); Gamma, Beta, Dirichlet guides, summed absolute error of
the log-concentrations (log-rate) <= 0.08; the LogNormal pair, absolute error of the log of the
posterior mean and of the log of the posterior precision each <= 0.07.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.distributions import constraints

positive = constraints.positive
SOFTPLUS_ONE = math.log(math.e - 1.0)  # softplus(SOFTPLUS_ONE) = 1


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@dataclass
class Pair:
    """One (conjugate model, guide) pair.

    ``errors(dtype)`` returns the current guide's errors against the analytic posterior, one
    per checked quantity; the pair has reached the posterior when each is within ``tol``.
    """

    name: str
    model: Callable[..., None]
    guide: Callable[..., None]
    data: Callable[[torch.dtype], Tuple[torch.Tensor, ...]]
    errors: Callable[[Tuple[torch.Tensor, ...]], List[float]]
    tol: float
    #: puts the guide's parameters at the analytic posterior (in its own parameterisation)
    set_to_posterior: Callable[[Tuple[torch.Tensor, ...]], None]
    #: ``data -> (log density of the analytic posterior at theta)``, the latent's site name
    posterior_log_prob: Callable[..., torch.Tensor]
    site: str


def _param(name, value, dtype, constraint=None):
    t = torch.as_tensor(value, dtype=dtype)
    return pyro.param(name, t) if constraint is None else pyro.param(name, t, constraint=constraint)


# --------------------------------------------------------------------------- Normal-Normal
NN_M0, NN_S0, NN_S = 0.0, 3.0, 1.0


def nn_data(dtype):
    return ((2.5 + torch.randn(20, generator=_gen(11), dtype=torch.float64)).to(dtype),)


def nn_model(y):
    mu = pyro.sample("mu", dist.Normal(y.new_tensor(NN_M0), NN_S0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mu, NN_S), obs=y)


def nn_posterior(y) -> Tuple[float, float]:
    prec = 1 / NN_S0**2 + len(y) / NN_S**2
    mean = (NN_M0 / NN_S0**2 + float(y.double().sum()) / NN_S**2) / prec
    return mean, prec**-0.5


def normal_q(form: str, dtype) -> dist.Normal:
    """The guide's Normal in parameterisation ``form`` (params named after the form)."""
    loc = _param(f"{form}_loc", 0.0, dtype)
    if form == "positive":
        scale = _param("positive_scale", 1.0, dtype, positive)
    elif form == "logscale":
        scale = _param("logscale_log_scale", 0.0, dtype).exp()
    elif form == "softplus":
        scale = F.softplus(_param("softplus_raw", SOFTPLUS_ONE, dtype))
    else:
        raise ValueError(form)
    return dist.Normal(loc, scale)


def normal_guide(form: str, site: str = "mu"):
    def guide(y):
        pyro.sample(site, normal_q(form, y.dtype))

    return guide


def current_normal(form: str, dtype=torch.float64) -> Tuple[float, float]:
    with torch.no_grad():
        q = normal_q(form, dtype)
    return float(q.loc.detach()), float(q.scale.detach())


def normal_errors(form: str, posterior: Callable):
    def errors(data):
        mean, sd = posterior(*data)
        loc, scale = current_normal(form, data[0].dtype)
        return [(loc - mean) ** 2, (math.log(scale) - math.log(sd)) ** 2]

    return errors


# --------------------------------------------------------------------------- multivariate
MV_S = 1.0


def mv_data(dtype):
    g = _gen(12)
    X = torch.randn(20, 3, generator=g, dtype=torch.float64)
    y = X @ torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    y = y + MV_S * torch.randn(20, generator=g, dtype=torch.float64)
    return X.to(dtype), y.to(dtype)


def mv_model(X, y):
    w = pyro.sample("w", dist.MultivariateNormal(X.new_zeros(3), torch.eye(3, dtype=X.dtype)))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(X @ w, MV_S), obs=y)


def mv_guide(X, y):
    loc = _param("w_loc", torch.zeros(3), X.dtype)
    L = _param("w_scale_tril", torch.eye(3), X.dtype, constraints.lower_cholesky)
    pyro.sample("w", dist.MultivariateNormal(loc, scale_tril=L))


def mv_posterior(X, y) -> Tuple[torch.Tensor, torch.Tensor]:
    X, y = X.double(), y.double()
    prec = torch.eye(3, dtype=torch.float64) + X.T @ X / MV_S**2
    cov = torch.linalg.inv(prec)
    return cov @ (X.T @ y) / MV_S**2, torch.linalg.cholesky(cov)


def _log_diag(L: torch.Tensor) -> torch.Tensor:
    return L.tril(-1) + torch.diag_embed(L.diagonal(dim1=-2, dim2=-1).log())


def mv_errors(data):
    mean, L = mv_posterior(*data)
    with torch.no_grad():
        loc = pyro.param("w_loc").double()
        Lq = pyro.param("w_scale_tril").double()
    return [float((loc - mean).pow(2).sum()), float((_log_diag(Lq) - _log_diag(L)).pow(2).sum())]


# --------------------------------------------------------------------------- Gamma
G_A0, G_B0 = 1.0, 1.0


def poisson_data(dtype):
    return (
        torch.poisson(torch.full((10,), 3.0, dtype=torch.float64), generator=_gen(13)).to(dtype),
    )


def exponential_data(dtype):
    return (torch.empty(10, dtype=torch.float64).exponential_(2.0, generator=_gen(14)).to(dtype),)


def gamma_poisson(y):
    rate = pyro.sample("rate", dist.Gamma(y.new_tensor(G_A0), G_B0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Poisson(rate), obs=y)


def gamma_exponential(y):
    rate = pyro.sample("rate", dist.Gamma(y.new_tensor(G_A0), G_B0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Exponential(rate), obs=y)


def gamma_poisson_posterior(y):
    return torch.tensor([G_A0 + float(y.double().sum()), G_B0 + len(y)], dtype=torch.float64)


def gamma_exponential_posterior(y):
    return torch.tensor([G_A0 + len(y), G_B0 + float(y.double().sum())], dtype=torch.float64)


def concentrations(form: str, prefix: str, init: torch.Tensor, dtype) -> torch.Tensor:
    """Positive parameters in parameterisation ``form`` (all start at ``init``)."""
    if form == "positive":
        return _param(f"{prefix}_pos", init, dtype, positive)
    if form == "exp":
        return _param(f"{prefix}_log", init.log(), dtype).exp()
    if form == "softplus":
        raw = init + torch.log(-torch.expm1(-init))  # softplus^{-1}
        return F.softplus(_param(f"{prefix}_raw", raw, dtype))
    raise ValueError(form)


def gamma_guide(form: str):
    def guide(y):
        ab = concentrations(form, "gamma", torch.ones(2, dtype=torch.float64), y.dtype)
        pyro.sample("rate", dist.Gamma(ab[0], ab[1]))

    return guide


def beta_guide(form: str):
    def guide(y):
        ab = concentrations(form, "beta", torch.ones(2, dtype=torch.float64), y.dtype)
        pyro.sample("p", dist.Beta(ab[0], ab[1]))

    return guide


def dirichlet_guide(form: str):
    def guide(y):
        conc = concentrations(form, "dir", torch.ones(3, dtype=torch.float64), y.dtype)
        pyro.sample("probs", dist.Dirichlet(conc))

    return guide


def concentration_errors(form: str, prefix: str, posterior: Callable):
    def errors(data):
        target = posterior(*data)
        with torch.no_grad():
            current = concentrations(form, prefix, target, data[0].dtype).double()
        return [float((current.log() - target.log()).abs().sum())]

    return errors


B_A0, B_B0 = 1.0, 1.0


def coin_data(dtype):
    return ((torch.rand(20, generator=_gen(15), dtype=torch.float64) < 0.75).to(dtype),)


def beta_bernoulli(y):
    p = pyro.sample("p", dist.Beta(y.new_tensor(B_A0), B_B0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Bernoulli(p), obs=y)


def beta_posterior(y):
    k = float(y.double().sum())
    return torch.tensor([B_A0 + k, B_B0 + len(y) - k], dtype=torch.float64)


def category_data(dtype):
    y = torch.multinomial(torch.tensor([0.6, 0.3, 0.1]), 30, True, generator=_gen(16))
    return (y.to(dtype),)


def dirichlet_categorical(y):
    probs = pyro.sample("probs", dist.Dirichlet(y.new_ones(3)))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Categorical(probs), obs=y.long())


def dirichlet_posterior(y):
    counts = torch.bincount(y.long(), minlength=3).double()
    return 1.0 + counts


# --------------------------------------------------------------------------- LogNormal
LN_M0, LN_S0, LN_S = 0.0, 1.0, 0.5


def lognormal_data(dtype):
    return (
        torch.exp(1.2 + LN_S * torch.randn(10, generator=_gen(17), dtype=torch.float64)).to(dtype),
    )


def lognormal_model(y):
    mu = pyro.sample("mu", dist.Normal(y.new_tensor(LN_M0), LN_S0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.LogNormal(mu, LN_S), obs=y)


def lognormal_posterior(y) -> Tuple[float, float]:
    prec = 1 / LN_S0**2 + len(y) / LN_S**2
    mean = (LN_M0 / LN_S0**2 + float(y.double().log().sum()) / LN_S**2) / prec
    return mean, prec**-0.5


def lognormal_errors(form: str):
    """Pyro's LogNormalNormalTests: |log mean error| and |log precision error|."""

    def errors(data):
        mean, sd = lognormal_posterior(*data)
        loc, scale = current_normal(form, data[0].dtype)
        if loc <= 0:
            return [math.inf, math.inf]
        return [abs(math.log(loc) - math.log(mean)), abs(2 * math.log(sd) - 2 * math.log(scale))]

    return errors


# --------------------------------------------------------------------------- at the posterior
def _softplus_inv(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


def _store(name: str, value: torch.Tensor) -> None:
    """Overwrite a param's constrained value (its constraint kept)."""
    store = pyro.get_param_store()
    constraint = store._constraints[name]
    del store[name]
    pyro.param(name, value.detach().clone(), constraint=constraint)


def set_normal(form: str, posterior: Callable):
    def put(data):
        mean, sd = posterior(*data)
        dtype = data[0].dtype
        normal_q(form, dtype)  # create the params
        sd_t = torch.tensor(sd, dtype=dtype)
        _store(f"{form}_loc", torch.tensor(mean, dtype=dtype))
        if form == "positive":
            _store("positive_scale", sd_t)
        elif form == "logscale":
            _store("logscale_log_scale", sd_t.log())
        else:
            _store("softplus_raw", _softplus_inv(sd_t))

    return put


def set_concentrations(form: str, prefix: str, posterior: Callable):
    def put(data):
        target = posterior(*data).to(data[0].dtype)
        concentrations(form, prefix, target, data[0].dtype)
        if form == "positive":
            _store(f"{prefix}_pos", target)
        elif form == "exp":
            _store(f"{prefix}_log", target.log())
        else:
            _store(f"{prefix}_raw", _softplus_inv(target))

    return put


def set_mv(data):
    mean, L = mv_posterior(*data)
    mv_guide(*data)
    _store("w_loc", mean.to(data[0].dtype))
    _store("w_scale_tril", L.to(data[0].dtype))


def normal_density(posterior: Callable):
    def log_prob(theta, *data):
        mean, sd = posterior(*data)
        return dist.Normal(theta.new_tensor(mean), theta.new_tensor(sd)).log_prob(theta)

    return log_prob


def gamma_density(posterior: Callable):
    def log_prob(theta, *data):
        a, b = posterior(*data)
        return dist.Gamma(a, b).log_prob(theta)

    return log_prob


def beta_density(theta, *data):
    a, b = beta_posterior(*data)
    return dist.Beta(a, b).log_prob(theta)


def dirichlet_density(theta, *data):
    return dist.Dirichlet(dirichlet_posterior(*data)).log_prob(theta)


def mv_density(theta, *data):
    mean, L = mv_posterior(*data)
    return dist.MultivariateNormal(mean, scale_tril=L).log_prob(theta)


# --------------------------------------------------------------------------- the table
FORMS_NORMAL = ("positive", "logscale", "softplus")
FORMS_POSITIVE = ("positive", "exp", "softplus")


def _pairs() -> List[Pair]:
    out: List[Pair] = []
    for f in FORMS_NORMAL:
        out.append(
            Pair(
                f"normal-normal-{f}",
                nn_model,
                normal_guide(f),
                nn_data,
                normal_errors(f, nn_posterior),
                0.05,
                set_normal(f, nn_posterior),
                normal_density(nn_posterior),
                "mu",
            )
        )
    out.append(
        Pair(
            "mvn-normal-scale_tril",
            mv_model,
            mv_guide,
            mv_data,
            mv_errors,
            0.05,
            set_mv,
            mv_density,
            "w",
        )
    )
    for name, model, data, post in (
        ("gamma-poisson", gamma_poisson, poisson_data, gamma_poisson_posterior),
        ("gamma-exponential", gamma_exponential, exponential_data, gamma_exponential_posterior),
    ):
        for f in FORMS_POSITIVE:
            out.append(
                Pair(
                    f"{name}-{f}",
                    model,
                    gamma_guide(f),
                    data,
                    concentration_errors(f, "gamma", post),
                    0.08,
                    set_concentrations(f, "gamma", post),
                    gamma_density(post),
                    "rate",
                )
            )
    for f in FORMS_POSITIVE:
        out.append(
            Pair(
                f"beta-bernoulli-{f}",
                beta_bernoulli,
                beta_guide(f),
                coin_data,
                concentration_errors(f, "beta", beta_posterior),
                0.08,
                set_concentrations(f, "beta", beta_posterior),
                beta_density,
                "p",
            )
        )
    for f in FORMS_POSITIVE:
        out.append(
            Pair(
                f"dirichlet-categorical-{f}",
                dirichlet_categorical,
                dirichlet_guide(f),
                category_data,
                concentration_errors(f, "dir", dirichlet_posterior),
                0.08,
                set_concentrations(f, "dir", dirichlet_posterior),
                dirichlet_density,
                "probs",
            )
        )
    for f in FORMS_NORMAL:
        out.append(
            Pair(
                f"lognormal-normal-{f}",
                lognormal_model,
                normal_guide(f),
                lognormal_data,
                lognormal_errors(f),
                0.07,
                set_normal(f, lognormal_posterior),
                normal_density(lognormal_posterior),
                "mu",
            )
        )
    return out


PAIRS: List[Pair] = _pairs()
BY_NAME: Dict[str, Pair] = {p.name: p for p in PAIRS}
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def within(pair: Pair, data) -> bool:
    return all(e <= pair.tol for e in pair.errors(data))


def fit(
    pair: Pair,
    dtype,
    optim,
    steps: int,
    seed: int = 0,
    stay: int = 100,
    seen: Optional[Dict[int, List[float]]] = None,
):
    """Train up to ``steps`` steps of ``Trace_ELBO`` (one draw, as Pyro's tests).

    Returns ``(first, errors)``: the first step after which the guide is within tolerance and
    stays so for ``stay`` more steps (``None`` if never within ``steps``; training stops there),
    and the errors after the last step. ``seen``: a dict whose keys are step numbers; the
    errors after each of those steps that training reaches are stored under it (the same
    numbers as ``train(pair, dtype, optim, step, seed)``, without a second run).
    """
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    data = pair.data(dtype)
    svi = pyro.infer.SVI(pair.model, pair.guide, optim, pyro.infer.Trace_ELBO())
    first = None
    for t in range(1, steps + 1):
        svi.step(*data)
        if seen is not None and t in seen:
            seen[t] = pair.errors(data)
        if within(pair, data):
            first = t if first is None else first
            if t - first >= stay:
                break
        else:
            first = None
    if first is not None and steps - first < stay and t == steps:
        first = None  # not yet seen to stay
    return first, pair.errors(data)


def train(pair: Pair, dtype, optim, steps: int, seed: int = 0) -> List[float]:
    """The errors after exactly ``steps`` steps of ``Trace_ELBO`` (one draw)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    data = pair.data(dtype)
    svi = pyro.infer.SVI(pair.model, pair.guide, optim, pyro.infer.Trace_ELBO())
    for _ in range(steps):
        svi.step(*data)
    return pair.errors(data)


def stays(
    pair: Pair, dtype, optim, first: int, last: int, seed: int = 0
) -> Tuple[Optional[int], List[float]]:
    """Train ``last`` steps of ``Trace_ELBO`` (one draw); ``(the first step in [first, last]
    after which the guide is outside tolerance, its errors)``, or ``(None, the errors after
    the last step)`` when it is within tolerance after every one of those steps."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    data = pair.data(dtype)
    svi = pyro.infer.SVI(pair.model, pair.guide, optim, pyro.infer.Trace_ELBO())
    for t in range(1, last + 1):
        svi.step(*data)
        if t >= first and not within(pair, data):
            return t, pair.errors(data)
    return None, pair.errors(data)
