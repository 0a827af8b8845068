"""A table of model/guide pairs that Pyro's own ``Trace_ELBO`` + Adam trains, for checking that
an optimizer is a drop-in replacement for Adam (``SVI(model, guide, optim, loss)`` and the
hand-written loop ``loss.loss_and_grads(model, guide)``, then ``optim(params)``).

Each :class:`Case` builds ``(model, guide, loss, args)`` in a fresh param store and says what
"trains" means: the -ELBO estimate after ``steps`` optimizer steps is below the estimate before
them by at least ``margin`` nats. The estimate is a many-draw ``Trace_ELBO`` (``TraceEnum_ELBO``
where the model enumerates) drawn with the same seed before and after training (common random
numbers), so its Monte Carlo noise mostly cancels in the difference. Every case starts far
(tens to hundreds of nats) from its optimum, so a working optimizer clears the margin with room.

The constructs covered: hand-written guides in every parameterisation (``constraints.positive``,
log-scale ``.exp()``, softplus, interval / greater-than constraints, squares, ``scale_tril``,
covariance and low-rank MVNs, ``PyroModule`` / ``PyroParam``, ``pyro.module`` networks,
unicode and dotted names), Gamma, Beta, Dirichlet, LogNormal, Exponential guides,
``TransformedDistribution``, ``.to_event``, plates, nested plates, subsampling, enumeration in
the model and in the guide, ``poutine`` handlers (block, scale, mask, condition, reparam),
guides without parameters, Pyro's autoguides and ``AutoGuideList`` mixes, mixed families in one
guide, every Pyro loss, vectorised particles and hand-written loops.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
import torch.nn.functional as F
from pyro.distributions import constraints, transforms
from pyro.infer import (
    SVI,
    JitTrace_ELBO,
    Trace_ELBO,
    TraceEnum_ELBO,
    TraceGraph_ELBO,
    TraceMeanField_ELBO,
)
from pyro.infer.autoguide import (
    AutoDelta,
    AutoDiagonalNormal,
    AutoGuideList,
    AutoIAFNormal,
    AutoLaplaceApproximation,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)
from pyro.infer.reparam import LocScaleReparam
from pyro.infer.util import zero_grads
from pyro.nn import PyroModule, PyroParam
from pyro.ops.indexing import Vindex

positive = constraints.positive


@dataclass
class Built:
    model: Callable[..., Any]
    guide: Callable[..., Any]
    loss: Any
    args: Tuple[Any, ...]


@dataclass
class Case:
    """One model/guide pair.

    :param build: ``() -> Built``, called in an empty param store after seeding.
    :param enum: the model (or guide) enumerates: estimate with ``TraceEnum_ELBO``.
    :param vectorize: the model broadcasts over a leftmost particle dimension.
    :param plates: ``max_plate_nesting`` of the model.
    :param loop: ``"svi"`` (``SVI.step``) or ``"manual"`` (``loss_and_grads`` + ``optim``).
    """

    name: str
    build: Callable[[], Built]
    steps: int = 60
    margin: float = 3.0
    enum: bool = False
    vectorize: bool = True
    plates: int = 1
    loop: str = "svi"
    tags: Tuple[str, ...] = field(default_factory=tuple)
    #: in the fast share of the table (the rest repeats a construct under another loss)
    fast: bool = True


# --------------------------------------------------------------------------- data
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def normal_data(n: int = 20) -> torch.Tensor:
    return 3.0 + torch.randn(n, generator=_gen(1))


def count_data(n: int = 20) -> torch.Tensor:
    return torch.poisson(torch.full((n,), 6.0), generator=_gen(2))


def waiting_data(n: int = 20) -> torch.Tensor:
    return torch.empty(n).exponential_(4.0, generator=_gen(3))


def coin_data(n: int = 100) -> torch.Tensor:
    return (torch.rand(n, generator=_gen(4)) < 0.8).float()


def category_data(n: int = 40) -> torch.Tensor:
    return torch.multinomial(torch.tensor([0.7, 0.2, 0.1]), n, True, generator=_gen(5))


def regression_data(n: int = 30) -> Tuple[torch.Tensor, torch.Tensor]:
    g = _gen(6)
    X = torch.randn(n, 3, generator=g)
    y = 0.5 + X @ torch.tensor([1.0, -2.0, 0.5]) + 0.5 * torch.randn(n, generator=g)
    return X, y


def mixture_data(n: int = 30) -> torch.Tensor:
    g = _gen(7)
    z = torch.rand(n, generator=g) < 0.5
    return torch.where(z, -2.0, 3.0) + 0.5 * torch.randn(n, generator=g)


def group_data(groups: int = 6, per: int = 5) -> torch.Tensor:
    g = _gen(8)
    means = 2.0 + 1.5 * torch.randn(groups, 1, generator=g)
    return means + 0.5 * torch.randn(groups, per, generator=g)


# --------------------------------------------------------------------------- models
def nn_model(y):
    """Normal-Normal: ``mu ~ N(0, 10)``, ``y_i ~ N(mu, 1)``."""
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


def gamma_poisson(y):
    rate = pyro.sample("rate", dist.Gamma(2.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Poisson(rate), obs=y)


def gamma_exponential(y):
    rate = pyro.sample("rate", dist.Gamma(2.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Exponential(rate), obs=y)


def exponential_poisson(y):
    rate = pyro.sample("rate", dist.Exponential(0.2))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Poisson(rate), obs=y)


def beta_bernoulli(y):
    p = pyro.sample("p", dist.Beta(1.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Bernoulli(p), obs=y)


def dirichlet_categorical(y):
    probs = pyro.sample("probs", dist.Dirichlet(torch.ones(3)))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Categorical(probs), obs=y)


def lognormal_likelihood(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.LogNormal(mu, 0.5), obs=y)


def halfnormal_scale(y):
    sigma = pyro.sample("sigma", dist.HalfNormal(5.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(0.0, sigma), obs=y)


def vector_model(X, y):
    """Linear regression with a vector latent ``w`` (``.to_event(1)``), known noise."""
    w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(X @ w, 0.5), obs=y)


def regression(X, y):
    """Linear regression with an intercept and a half-Normal noise scale."""
    b = pyro.sample("b", dist.Normal(0.0, 5.0))
    w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(b + X @ w, sigma), obs=y)


def local_model(y):
    """Hierarchical: ``mu ~ N(0, 10)``, ``z_i ~ N(mu, 1)``, ``y_i ~ N(z_i, 0.5)``."""
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(y)):
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        pyro.sample("obs", dist.Normal(z, 0.5), obs=y)


def nested_model(y):
    """Groups x members: ``mu_g ~ N(0, 10)`` per group, ``y_gj ~ N(mu_g, 0.5)``."""
    with pyro.plate("groups", y.shape[0], dim=-2):
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        with pyro.plate("members", y.shape[1], dim=-1):
            pyro.sample("obs", dist.Normal(mu, 0.5), obs=y)


def nested_local_model(y):
    """Groups x members with latents at both levels."""
    with pyro.plate("groups", y.shape[0], dim=-2):
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        with pyro.plate("members", y.shape[1], dim=-1):
            z = pyro.sample("z", dist.Normal(mu, 1.0))
            pyro.sample("obs", dist.Normal(z, 0.5), obs=y)


def nested_gamma_model(y):
    """A Gamma rate per group, Poisson counts per member."""
    with pyro.plate("groups", y.shape[0], dim=-2):
        rate = pyro.sample("rate", dist.Gamma(2.0, 1.0))
        with pyro.plate("members", y.shape[1], dim=-1):
            pyro.sample("obs", dist.Poisson(rate), obs=y)


SUB = 10


def subsampled_global(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(y), subsample_size=SUB) as ind:
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[ind])


def subsampled_local(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(y), subsample_size=SUB) as ind:
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        pyro.sample("obs", dist.Normal(z, 0.5), obs=y[ind])


def gmm_model(y):
    """Two-component mixture, assignments enumerated in the model."""
    locs = pyro.sample("locs", dist.Normal(torch.zeros(2), 10.0).to_event(1))
    with pyro.plate("data", len(y)):
        z = pyro.sample(
            "z", dist.Categorical(torch.tensor([0.5, 0.5])), infer={"enumerate": "parallel"}
        )
        pyro.sample("obs", dist.Normal(Vindex(locs)[..., z], 0.5), obs=y)


def gmm_weights_model(y):
    """Two-component mixture with Dirichlet weights, assignments enumerated."""
    weights = pyro.sample("weights", dist.Dirichlet(torch.ones(2)))
    locs = pyro.sample("locs", dist.Normal(torch.zeros(2), 10.0).to_event(1))
    with pyro.plate("data", len(y)):
        z = pyro.sample("z", dist.Categorical(weights), infer={"enumerate": "parallel"})
        pyro.sample("obs", dist.Normal(Vindex(locs)[..., z], 0.5), obs=y)


def bernoulli_mixture(y):
    """Bernoulli assignments enumerated in the model; two scalar means."""
    mu0 = pyro.sample("mu0", dist.Normal(0.0, 10.0))
    mu1 = pyro.sample("mu1", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(y)):
        z = pyro.sample("z", dist.Bernoulli(0.5), infer={"enumerate": "parallel"})
        pyro.sample("obs", dist.Normal(mu0 + z * (mu1 - mu0), 0.5), obs=y)


CENTRES = torch.tensor([-3.0, 0.0, 3.0])


def global_discrete(y):
    """A global Categorical ``c`` (enumerated in the guide) shifting a Normal mean."""
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    c = pyro.sample("c", dist.Categorical(torch.ones(3) / 3))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mu + CENTRES[c], 1.0), obs=y)


def hmm_model(y):
    """A two-state HMM with Normal emissions, states enumerated under ``pyro.markov``."""
    locs = pyro.sample("locs", dist.Normal(torch.zeros(2), 10.0).to_event(1))
    trans = torch.tensor([[0.9, 0.1], [0.1, 0.9]])
    x = 0
    for t in pyro.markov(range(len(y))):
        x = pyro.sample(f"x_{t}", dist.Categorical(trans[x]), infer={"enumerate": "parallel"})
        pyro.sample(f"y_{t}", dist.Normal(Vindex(locs)[..., x], 0.5), obs=y[t])


def eight_schools(y):
    sigma = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0]) / 5
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    with pyro.plate("schools", 8):
        theta = pyro.sample("theta", dist.Normal(mu, 2.0))
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def schools_data() -> torch.Tensor:
    return torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0]) / 5


def composite(y, counts, coins, cats):
    """Four families in one model: Normal, Gamma, Beta, Dirichlet latents."""
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    rate = pyro.sample("rate", dist.Gamma(2.0, 1.0))
    p = pyro.sample("p", dist.Beta(1.0, 1.0))
    probs = pyro.sample("probs", dist.Dirichlet(torch.ones(3)))
    with pyro.plate("a", len(y)):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)
    with pyro.plate("b", len(counts)):
        pyro.sample("counts", dist.Poisson(rate), obs=counts)
    with pyro.plate("c", len(coins)):
        pyro.sample("coins", dist.Bernoulli(p), obs=coins)
    with pyro.plate("d", len(cats)):
        pyro.sample("cats", dist.Categorical(probs), obs=cats)


def composite_args():
    return (normal_data(), count_data(), coin_data(), category_data())


# --------------------------------------------------------------------------- guide pieces
def p(name, value, constraint=None):
    """``pyro.param`` of a float32 tensor."""
    t = torch.as_tensor(value, dtype=torch.float32)
    if constraint is None:
        return pyro.param(name, t)
    return pyro.param(name, t, constraint=constraint)


def normal_site(site: str, form: str):
    """A scalar Normal guide distribution for ``site`` in parameterisation ``form``."""
    loc0, one, n = torch.tensor(0.0), torch.tensor(1.0), f"{site}_"
    if form == "positive":
        q = dist.Normal(p(n + "loc", loc0), p(n + "scale", one, positive))
    elif form == "logscale":
        q = dist.Normal(p(n + "loc", loc0), p(n + "log_scale", 0 * one).exp())
    elif form == "softplus":
        q = dist.Normal(p(n + "loc", loc0), F.softplus(p(n + "raw", 0.5413 * one)))
    elif form == "interval":
        q = dist.Normal(p(n + "loc", loc0), p(n + "s", one, constraints.interval(1e-4, 20.0)))
    elif form == "greater":
        q = dist.Normal(p(n + "loc", loc0), p(n + "s", one, constraints.greater_than(1e-3)))
    elif form == "square":
        q = dist.Normal(p(n + "loc", loc0), p(n + "r", one).pow(2) + 1e-4)
    elif form == "odd_names":
        q = dist.Normal(p(n + "q.μ/0", loc0), p(n + "σ-1", one, positive))
    elif form == "stacked":  # loc and log-scale in one tensor
        both = p(n + "theta", torch.stack([loc0, 0 * one]))
        q = dist.Normal(both[0], both[1].exp())
    else:
        raise ValueError(form)
    return q


SCALAR_FORMS = (
    "positive",
    "logscale",
    "softplus",
    "interval",
    "greater",
    "square",
    "odd_names",
    "stacked",
)


def scalar_guide(form: str, site: str = "mu"):
    def guide(*args, **kwargs):
        pyro.sample(site, normal_site(site, form))

    return guide


class ModuleGuide(PyroModule):
    """A ``PyroModule`` guide with ``PyroParam`` attributes (odd names on purpose)."""

    def __init__(self):
        super().__init__()
        self.centre = PyroParam(torch.tensor(0.0))
        self.spread = PyroParam(torch.tensor(1.0), constraint=positive)

    def forward(self, *args, **kwargs):
        return pyro.sample("mu", dist.Normal(self.centre, self.spread))


class RawModuleGuide(PyroModule):
    """A ``PyroModule`` guide holding one ``nn.Parameter`` (loc and log-scale)."""

    def __init__(self):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.tensor([0.0, 0.0]))

    def forward(self, *args, **kwargs):
        return pyro.sample("mu", dist.Normal(self.theta[0], self.theta[1].exp()))


def network_guide():
    """A ``pyro.module`` network from a constant input to loc and log-scale."""
    net = torch.nn.Linear(1, 2)
    torch.nn.init.zeros_(net.weight)
    torch.nn.init.zeros_(net.bias)

    def guide(*args, **kwargs):
        pyro.module("net", net)
        out = net(torch.ones(1))
        pyro.sample("mu", dist.Normal(out[0], out[1].exp()))

    return guide


def delta_guide(*args, **kwargs):
    pyro.sample("mu", dist.Delta(p("mu_map", 0.0)))


# --------------------------------------------------------------------------- losses
def trace():
    return Trace_ELBO()


def meanfield():
    return TraceMeanField_ELBO()


def graph():
    return TraceGraph_ELBO()


def enum(plates: int = 1):
    return TraceEnum_ELBO(max_plate_nesting=plates)


def jit():
    return JitTrace_ELBO()


LOSSES = {"trace": trace, "meanfield": meanfield, "graph": graph, "enum": enum}


# --------------------------------------------------------------------------- the table
CASES: List[Case] = []


def add(name: str, build: Callable[[], Built], **kw: Any) -> None:
    """Append a case; one under a second loss is in the slow share unless ``fast`` is given."""
    assert all(c.name != name for c in CASES), name
    kw.setdefault("fast", not name.endswith(("-graph", "-meanfield", "-enum")))
    CASES.append(Case(name, build, **kw))


# A. a scalar Normal latent, every parameterisation of its guide, under four losses
for _form in SCALAR_FORMS:
    for _lname, _loss in LOSSES.items():
        add(
            f"normal-{_form}-{_lname}",
            lambda f=_form, lo=_loss: Built(nn_model, scalar_guide(f), lo(), (normal_data(),)),
            tags=("normal", "hand"),
            fast=_lname == "trace" or _form == "positive",
        )
for _lname, _loss in (("trace", trace), ("meanfield", meanfield)):
    add(
        f"normal-pyromodule-{_lname}",
        lambda lo=_loss: Built(nn_model, ModuleGuide(), lo(), (normal_data(),)),
        tags=("normal", "module"),
    )
    add(
        f"normal-rawmodule-{_lname}",
        lambda lo=_loss: Built(nn_model, RawModuleGuide(), lo(), (normal_data(),)),
        tags=("normal", "module"),
    )
    add(
        f"normal-network-{_lname}",
        lambda lo=_loss: Built(nn_model, network_guide(), lo(), (normal_data(),)),
        tags=("normal", "module"),
    )
add("normal-delta", lambda: Built(nn_model, delta_guide, trace(), (normal_data(),)))
for _form in ("positive", "logscale", "softplus"):
    add(
        f"normal-{_form}-jit",
        lambda f=_form: Built(nn_model, scalar_guide(f), jit(), (normal_data(),)),
        tags=("normal", "jit"),
        fast=_form == "logscale",
    )


# B. a vector latent (.to_event(1)): diagonal and full-covariance guides
def vector_guide(form: str):
    def guide(X, y):
        loc = p("w_loc", torch.zeros(3))
        if form == "diag-positive":
            q = dist.Normal(loc, p("w_scale", torch.ones(3), positive)).to_event(1)
        elif form == "diag-logscale":
            q = dist.Normal(loc, p("w_log_scale", torch.zeros(3)).exp()).to_event(1)
        elif form == "independent":
            q = dist.Independent(dist.Normal(loc, F.softplus(p("w_raw", torch.zeros(3)))), 1)
        elif form == "tril-constrained":
            q = dist.MultivariateNormal(
                loc, scale_tril=p("w_tril", torch.eye(3), constraints.lower_cholesky)
            )
        elif form == "tril-raw":
            raw = p("w_raw_tril", torch.zeros(3, 3))
            L = raw.tril(-1) + torch.diag_embed(raw.diagonal().exp())
            q = dist.MultivariateNormal(loc, scale_tril=L)
        elif form == "covariance":
            L = p("w_factor", torch.eye(3)).tril()
            q = dist.MultivariateNormal(loc, covariance_matrix=L @ L.T + 1e-3 * torch.eye(3))
        elif form == "lowrank":
            q = dist.LowRankMultivariateNormal(
                loc,
                p("w_cov_factor", torch.full((3, 1), 0.1)),
                p("w_cov_diag", torch.ones(3), positive),
            )
        else:
            raise ValueError(form)
        pyro.sample("w", q)

    return guide


VECTOR_FORMS = (
    "diag-positive",
    "diag-logscale",
    "independent",
    "tril-constrained",
    "tril-raw",
    "covariance",
    "lowrank",
)
for _form in VECTOR_FORMS:
    for _lname, _loss in (("trace", trace), ("meanfield", meanfield)):
        add(
            f"vector-{_form}-{_lname}",
            lambda f=_form, lo=_loss: Built(vector_model, vector_guide(f), lo(), regression_data()),
            vectorize=False,
            tags=("normal", "mvn"),
        )
add(
    "vector-tril-constrained-graph",
    lambda: Built(vector_model, vector_guide("tril-constrained"), graph(), regression_data()),
    vectorize=False,
)


# C. positive and simplex latents: Gamma, Exponential, LogNormal, Beta, Dirichlet guides
def gamma_guide(form: str, site: str = "rate"):
    def guide(y):
        if form == "positive":
            q = dist.Gamma(p("a_q", 1.0, positive), p("b_q", 1.0, positive))
        elif form == "exp":
            q = dist.Gamma(p("log_a", 0.0).exp(), p("log_b", 0.0).exp())
        elif form == "softplus":
            q = dist.Gamma(F.softplus(p("ra", 0.5413)), F.softplus(p("rb", 0.5413)))
        elif form == "lognormal":
            q = dist.LogNormal(p("ln_loc", 0.0), p("ln_scale", 1.0, positive))
        elif form == "transformed":
            base = dist.Normal(p("t_loc", 0.0), p("t_log_scale", 0.0).exp())
            q = dist.TransformedDistribution(base, [transforms.ExpTransform()])
        elif form == "exponential":
            q = dist.Exponential(p("e_rate", 1.0, positive))
        elif form == "mean-shape":  # mean and shape, a common reparameterisation
            mean, shape = p("g_mean", 1.0, positive), p("g_shape", 1.0, positive)
            q = dist.Gamma(shape, shape / mean)
        else:
            raise ValueError(form)
        pyro.sample(site, q)

    return guide


for _form in ("positive", "exp", "softplus", "lognormal", "transformed", "mean-shape"):
    add(
        f"gamma-poisson-{_form}",
        lambda f=_form: Built(gamma_poisson, gamma_guide(f), trace(), (count_data(),)),
        tags=("gamma",),
    )
for _form in ("positive", "exp", "exponential"):
    add(
        f"gamma-exponential-{_form}",
        lambda f=_form: Built(gamma_exponential, gamma_guide(f), trace(), (waiting_data(),)),
        tags=("gamma",),
    )
add(
    "exponential-poisson-gamma",
    lambda: Built(exponential_poisson, gamma_guide("positive"), trace(), (count_data(),)),
)
for _form, _lname, _loss in (
    ("positive", "meanfield", meanfield),
    ("exp", "meanfield", meanfield),
    ("positive", "graph", graph),
):
    add(
        f"gamma-poisson-{_form}-{_lname}",
        lambda f=_form, lo=_loss: Built(gamma_poisson, gamma_guide(f), lo(), (count_data(),)),
        tags=("gamma",),
    )


def beta_guide(form: str):
    def guide(y):
        if form == "positive":
            q = dist.Beta(p("c1", 1.0, positive), p("c0", 1.0, positive))
        elif form == "exp":
            q = dist.Beta(p("log_c1", 0.0).exp(), p("log_c0", 0.0).exp())
        elif form == "softplus":
            q = dist.Beta(F.softplus(p("r1", 0.5413)), F.softplus(p("r0", 0.5413)))
        elif form == "sigmoid-normal":
            base = dist.Normal(p("s_loc", 0.0), p("s_scale", 1.0, positive))
            q = dist.TransformedDistribution(base, [transforms.SigmoidTransform()])
        else:
            raise ValueError(form)
        pyro.sample("p", q)

    return guide


for _form in ("positive", "exp", "softplus", "sigmoid-normal"):
    add(
        f"beta-bernoulli-{_form}",
        lambda f=_form: Built(beta_bernoulli, beta_guide(f), trace(), (coin_data(),)),
        margin=2.0,
        tags=("beta",),
    )
add(
    "beta-bernoulli-positive-meanfield",
    lambda: Built(beta_bernoulli, beta_guide("positive"), meanfield(), (coin_data(),)),
    margin=2.0,
)


def dirichlet_guide(form: str):
    def guide(y):
        if form == "positive":
            q = dist.Dirichlet(p("conc", torch.ones(3), positive))
        elif form == "exp":
            q = dist.Dirichlet(p("log_conc", torch.zeros(3)).exp())
        elif form == "softplus":
            q = dist.Dirichlet(F.softplus(p("raw_conc", torch.full((3,), 0.5413))))
        elif form == "stick":  # a logistic-Normal on the simplex
            base = dist.Normal(p("sb_loc", torch.zeros(2)), p("sb_scale", torch.ones(2), positive))
            q = dist.TransformedDistribution(
                base.to_event(1), [transforms.StickBreakingTransform()]
            )
        else:
            raise ValueError(form)
        pyro.sample("probs", q)

    return guide


for _form in ("positive", "exp", "softplus", "stick"):
    add(
        f"dirichlet-categorical-{_form}",
        lambda f=_form: Built(
            dirichlet_categorical, dirichlet_guide(f), trace(), (category_data(),)
        ),
        margin=2.0,
        tags=("dirichlet",),
    )
add(
    "dirichlet-categorical-positive-meanfield",
    lambda: Built(
        dirichlet_categorical, dirichlet_guide("positive"), meanfield(), (category_data(),)
    ),
    margin=2.0,
)
for _form in ("positive", "logscale"):
    add(
        f"lognormal-likelihood-{_form}",
        lambda f=_form: Built(
            lognormal_likelihood, scalar_guide(f), trace(), (torch.exp(normal_data() / 3),)
        ),
        tags=("normal",),
    )
for _form in ("lognormal", "positive"):
    add(
        f"halfnormal-scale-{_form}",
        lambda f=_form: Built(
            halfnormal_scale, gamma_guide(f, site="sigma"), trace(), (3.0 * normal_data() - 9,)
        ),
    )


# D. plates: local latents, nested plates, subsampling, .to_event inside a plate
def local_guide(form: str = "positive", sub: bool = False):
    def guide(y):
        pyro.sample("mu", normal_site("mu", form))
        zl = p("z_loc", torch.zeros(len(y)))
        zs = p("z_scale", torch.ones(len(y)), positive)
        if sub:
            with pyro.plate("data", len(y), subsample_size=SUB) as ind:
                pyro.sample("z", dist.Normal(zl[ind], zs[ind]))
        else:
            with pyro.plate("data", len(y)):
                pyro.sample("z", dist.Normal(zl, zs))

    return guide


def nested_guide(local: bool = False):
    def guide(y):
        G, M = y.shape
        with pyro.plate("groups", G, dim=-2):
            ml = p("mu_loc", torch.zeros(G, 1))
            pyro.sample("mu", dist.Normal(ml, p("mu_log_scale", torch.zeros(G, 1)).exp()))
            if local:
                with pyro.plate("members", M, dim=-1):
                    zl, zs = p("z_loc", torch.zeros(G, M)), p("z_scale", torch.ones(G, M), positive)
                    pyro.sample("z", dist.Normal(zl, zs))

    return guide


def nested_gamma_guide(y):
    with pyro.plate("groups", y.shape[0], dim=-2):
        a = p("a_q", torch.ones(y.shape[0], 1), positive)
        b = p("b_q", torch.ones(y.shape[0], 1), positive)
        pyro.sample("rate", dist.Gamma(a, b))


def local_event_model(y):
    """A 2-vector latent per data point (``.to_event(1)`` inside a plate)."""
    with pyro.plate("data", y.shape[0]):
        z = pyro.sample("z", dist.Normal(torch.zeros(2), 10.0).to_event(1))
        pyro.sample("obs", dist.Normal(z, 0.5).to_event(1), obs=y)


def local_event_guide(y):
    with pyro.plate("data", y.shape[0]):
        loc = p("z_loc", torch.zeros(y.shape[0], 2))
        scale = p("z_scale", torch.ones(y.shape[0], 2), positive)
        pyro.sample("z", dist.Normal(loc, scale).to_event(1))


def local_mvn_guide(y):
    with pyro.plate("data", y.shape[0]):
        loc = p("z_loc", torch.zeros(y.shape[0], 2))
        tril = p(
            "z_tril", torch.eye(2).expand(y.shape[0], 2, 2).clone(), constraints.lower_cholesky
        )
        pyro.sample("z", dist.MultivariateNormal(loc, scale_tril=tril))


def pair_data() -> torch.Tensor:
    return normal_data(20).reshape(10, 2)


for _lname, _loss in (("trace", trace), ("graph", graph), ("meanfield", meanfield)):
    add(
        f"plate-local-{_lname}",
        lambda lo=_loss: Built(local_model, local_guide(), lo(), (normal_data(),)),
        tags=("plate",),
    )
for _lname, _loss in (("trace", trace), ("graph", graph)):
    add(
        f"nested-global-{_lname}",
        lambda lo=_loss: Built(nested_model, nested_guide(), lo(), (group_data(),)),
        plates=2,
        tags=("plate",),
    )
    add(
        f"nested-local-{_lname}",
        lambda lo=_loss: Built(nested_local_model, nested_guide(True), lo(), (group_data(),)),
        plates=2,
        tags=("plate",),
    )
add(
    "nested-gamma",
    lambda: Built(nested_gamma_model, nested_gamma_guide, trace(), (count_data(30).reshape(6, 5),)),
    plates=2,
)
add(
    "plate-event-diag",
    lambda: Built(local_event_model, local_event_guide, trace(), (pair_data(),)),
)
add(
    "plate-event-mvn",
    lambda: Built(local_event_model, local_mvn_guide, trace(), (pair_data(),)),
)
for _lname, _loss in (("trace", trace), ("graph", graph)):
    add(
        f"subsample-global-{_lname}",
        lambda lo=_loss: Built(
            subsampled_global, scalar_guide("positive"), lo(), (normal_data(40),)
        ),
        tags=("subsample",),
    )
    add(
        f"subsample-local-{_lname}",
        lambda lo=_loss: Built(subsampled_local, local_guide(sub=True), lo(), (normal_data(40),)),
        tags=("subsample",),
    )
add(
    "subsample-global-logscale",
    lambda: Built(subsampled_global, scalar_guide("logscale"), trace(), (normal_data(40),)),
)


# E. enumeration (TraceEnum_ELBO)
def locs_guide(y):
    pyro.sample(
        "locs",
        dist.Normal(p("locs_loc", [-1.0, 1.0]), p("locs_scale", [1.0, 1.0], positive)).to_event(1),
    )


def gmm_weights_guide(y):
    pyro.sample("weights", dist.Dirichlet(p("w_conc", torch.ones(2), positive)))
    locs_guide(y)


def two_means_guide(y):
    pyro.sample("mu0", dist.Normal(p("m0", -1.0), p("s0", 1.0, positive)))
    pyro.sample("mu1", dist.Normal(p("m1", 1.0), p("log_s1", 0.0).exp()))


def global_discrete_guide(y):
    pyro.sample("mu", dist.Normal(p("mu_loc", 0.0), p("mu_scale", 1.0, positive)))
    probs = p("c_probs", torch.ones(3) / 3, constraints.simplex)
    pyro.sample("c", dist.Categorical(probs), infer={"enumerate": "parallel"})


def hmm_data() -> torch.Tensor:
    states = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 0, 1])
    return torch.where(states.bool(), 3.0, -2.0) + 0.5 * torch.randn(10, generator=_gen(9))


add("enum-gmm", lambda: Built(gmm_model, locs_guide, enum(), (mixture_data(),)), enum=True)
add(
    "enum-gmm-weights",
    lambda: Built(gmm_weights_model, gmm_weights_guide, enum(), (mixture_data(),)),
    enum=True,
)
add(
    "enum-bernoulli",
    lambda: Built(bernoulli_mixture, two_means_guide, enum(), (mixture_data(),)),
    enum=True,
)
add(
    "enum-guide-categorical",
    lambda: Built(global_discrete, global_discrete_guide, enum(), (normal_data(),)),
    enum=True,
)
add(
    "enum-hmm",
    lambda: Built(hmm_model, locs_guide, enum(0), (hmm_data(),)),
    enum=True,
    plates=0,
    vectorize=False,
    fast=False,
)
add(
    "enum-gmm-autonormal",
    lambda: Built(
        gmm_model, AutoNormal(poutine.block(gmm_model, hide=["z"])), enum(), (mixture_data(),)
    ),
    enum=True,
)
add(
    "enum-plain-model-traceenum",
    lambda: Built(nn_model, scalar_guide("logscale"), enum(), (normal_data(),)),
    enum=True,
)


# F. poutine handlers around the model or the guide
def blocked_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with poutine.block():  # an internal draw the guide must not see
        jitter = pyro.sample("jitter", dist.Normal(0.0, 0.01))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mu + jitter, 1.0), obs=y)


def guide_with_aux(y):
    pyro.sample("aux", dist.Normal(0.0, 1.0))  # blocked away below
    pyro.sample("mu", normal_site("mu", "positive"))


def scaled_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(y)), poutine.scale(scale=0.5):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


def masked_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    keep = torch.arange(len(y)) % 4 != 0
    with pyro.plate("data", len(y)), poutine.mask(mask=keep):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


def dist_masked_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    keep = torch.arange(len(y)) % 3 != 0
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mu, 1.0).mask(keep), obs=y)


def generative(n):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("data", n):
        pyro.sample("obs", dist.Normal(mu, 1.0))


def conditioned():
    y = normal_data()
    return poutine.condition(generative, data={"obs": y}), (len(y),)


def reparam_schools():
    return poutine.reparam(eight_schools, config={"theta": LocScaleReparam(centered=0.0)})


def decentered_guide(y):
    pyro.sample("mu", normal_site("mu", "positive"))
    with pyro.plate("schools", 8):
        loc = p("th_loc", torch.zeros(8))
        pyro.sample("theta_decentered", dist.Normal(loc, p("th_log_scale", torch.zeros(8)).exp()))


add(
    "poutine-block-model",
    lambda: Built(blocked_model, scalar_guide("positive"), trace(), (normal_data(),)),
    tags=("poutine",),
)
add(
    "poutine-block-guide",
    lambda: Built(nn_model, poutine.block(guide_with_aux, hide=["aux"]), trace(), (normal_data(),)),
    tags=("poutine",),
)
add(
    "poutine-block-guide-expose",
    lambda: Built(
        nn_model,
        poutine.block(guide_with_aux, expose=["mu", "mu_loc", "mu_scale"]),
        trace(),
        (normal_data(),),
    ),
    tags=("poutine",),
)
add(
    "poutine-scale-likelihood",
    lambda: Built(scaled_model, scalar_guide("logscale"), trace(), (normal_data(),)),
    tags=("poutine",),
)
add(
    "poutine-scale-both",
    lambda: Built(
        poutine.scale(nn_model, scale=2.0),
        poutine.scale(scalar_guide("positive"), scale=2.0),
        trace(),
        (normal_data(),),
    ),
    tags=("poutine",),
)
add(
    "poutine-mask",
    lambda: Built(masked_model, scalar_guide("softplus"), trace(), (normal_data(),)),
    tags=("poutine",),
)
add(
    "dist-mask",
    lambda: Built(dist_masked_model, scalar_guide("positive"), trace(), (normal_data(),)),
    tags=("poutine",),
)
add(
    "poutine-condition",
    lambda: Built(conditioned()[0], scalar_guide("positive"), trace(), conditioned()[1]),
    tags=("poutine",),
)
add(
    "poutine-condition-meanfield",
    lambda: Built(conditioned()[0], scalar_guide("logscale"), meanfield(), conditioned()[1]),
    tags=("poutine",),
)
add(
    "poutine-reparam-autonormal",
    lambda: Built(reparam_schools(), AutoNormal(reparam_schools()), trace(), (schools_data(),)),
    margin=2.0,
    tags=("poutine", "auto"),
)
add(
    "poutine-reparam-hand",
    lambda: Built(reparam_schools(), decentered_guide, trace(), (schools_data(),)),
    steps=120,
    margin=1.5,
    tags=("poutine",),
)


# G. parameters only in the model, or none in the guide
def empirical_bayes_model(y):
    """The prior's location is a parameter of the model."""
    prior_loc = pyro.param("prior_loc", torch.tensor(-5.0))
    mu = pyro.sample("mu", dist.Normal(prior_loc, 0.3))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


def fixed_guide(y):
    pyro.sample("mu", dist.Normal(3.0, 0.3))


def mle_model(y):
    loc = pyro.param("loc_mle", torch.tensor(0.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(loc, 1.0), obs=y)


def empty_guide(y):
    pass


def noise_param_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    s = pyro.param("obs_scale", torch.tensor(2.0), constraint=positive)
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mu, s), obs=y)


add(
    "no-guide-params-model-param",
    lambda: Built(empirical_bayes_model, fixed_guide, trace(), (normal_data(),)),
    steps=100,
    tags=("noparams",),
)
add(
    "empty-guide-mle",
    lambda: Built(mle_model, empty_guide, trace(), (normal_data(),)),
    tags=("noparams",),
)
add(
    "model-hyperparameter",
    lambda: Built(noise_param_model, scalar_guide("positive"), trace(), (normal_data(),)),
    tags=("hyper",),
)
add(
    "model-hyperparameter-logscale-graph",
    lambda: Built(noise_param_model, scalar_guide("logscale"), graph(), (normal_data(),)),
    tags=("hyper",),
)


# H. Pyro's autoguides and AutoGuideList mixes
def mixed_list(model, second: str):
    def make():
        g = AutoGuideList(model)
        g.append(AutoDelta(poutine.block(model, expose=["sigma"])))
        if second == "normal":
            g.append(AutoNormal(poutine.block(model, hide=["sigma"])))
        elif second == "mvn":
            g.append(AutoMultivariateNormal(poutine.block(model, hide=["sigma"])))
        else:
            g.append(AutoLowRankMultivariateNormal(poutine.block(model, hide=["sigma"]), rank=2))
        return g

    return make


def list_with_callable():
    g = AutoGuideList(regression)
    g.append(AutoNormal(poutine.block(regression, hide=["sigma"])))

    def sigma_guide(X, y):
        pyro.sample("sigma", dist.LogNormal(p("ls_loc", 0.0), p("ls_scale", 1.0, positive)))

    g.append(sigma_guide)
    return g


AUTOS: Dict[str, Callable[[Any], Any]] = {
    "AutoNormal": lambda m: AutoNormal(m),
    "AutoDiagonalNormal": lambda m: AutoDiagonalNormal(m),
    "AutoMultivariateNormal": lambda m: AutoMultivariateNormal(m),
    "AutoLowRankMultivariateNormal": lambda m: AutoLowRankMultivariateNormal(m, rank=2),
    "AutoDelta": lambda m: AutoDelta(m),
    "AutoLaplaceApproximation": lambda m: AutoLaplaceApproximation(m),
    "AutoIAFNormal": lambda m: AutoIAFNormal(m, hidden_dim=[8], num_transforms=1),
}
for _gname, _make in AUTOS.items():
    add(
        f"regression-{_gname}",
        lambda mk=_make: Built(regression, mk(regression), trace(), regression_data()),
        vectorize=False,
        tags=("auto",),
    )
for _second in ("normal", "mvn", "lowrank"):
    add(
        f"regression-AutoGuideList-delta-{_second}",
        lambda s=_second: Built(
            regression, mixed_list(regression, s)(), trace(), regression_data()
        ),
        vectorize=False,
        tags=("auto",),
    )
add(
    "regression-AutoGuideList-callable",
    lambda: Built(regression, list_with_callable(), trace(), regression_data()),
    vectorize=False,
    tags=("auto",),
)
for _model, _data, _mname in (
    (gamma_poisson, count_data, "gamma-poisson"),
    (beta_bernoulli, coin_data, "beta-bernoulli"),
    (dirichlet_categorical, category_data, "dirichlet-categorical"),
    (local_model, normal_data, "plate-local"),
):
    for _gname in ("AutoNormal", "AutoMultivariateNormal", "AutoDelta"):
        add(
            f"{_mname}-{_gname}",
            lambda m=_model, d=_data, g=_gname: Built(m, AUTOS[g](m), trace(), (d(),)),
            margin=2.0,
            tags=("auto",),
            fast=_gname != "AutoMultivariateNormal",
        )
add(
    "regression-AutoNormal-meanfield",
    lambda: Built(regression, AutoNormal(regression), meanfield(), regression_data()),
    vectorize=False,
)
add(
    "regression-AutoMultivariateNormal-graph",
    lambda: Built(regression, AutoMultivariateNormal(regression), graph(), regression_data()),
    vectorize=False,
)
add(
    "schools-AutoNormal-jit",
    lambda: Built(eight_schools, AutoNormal(eight_schools), jit(), (schools_data(),)),
    margin=2.0,
)


# I. mixed families in one guide
def composite_guide(y, counts, coins, cats):
    pyro.sample("mu", dist.Normal(p("mu_loc", 0.0), p("mu_log_scale", 0.0).exp()))
    pyro.sample("rate", dist.Gamma(p("rate_a", 1.0, positive), p("rate_b", 1.0, positive)))
    pyro.sample("p", dist.Beta(p("p_a", 1.0, positive), p("p_b", 1.0, positive)))
    pyro.sample("probs", dist.Dirichlet(p("probs_c", torch.ones(3), positive)))


def composite_delta_guide(y, counts, coins, cats):
    pyro.sample("mu", dist.Normal(p("mu_loc", 0.0), F.softplus(p("mu_raw", 0.5413))))
    pyro.sample("rate", dist.Delta(p("rate_map", 1.0, positive)))
    pyro.sample("p", dist.Beta(p("p_a", 1.0).exp(), p("p_b", 1.0).exp()))
    pyro.sample(
        "probs", dist.Delta(p("probs_map", torch.ones(3) / 3, constraints.simplex), event_dim=1)
    )


def amortised_local_guide():
    """A ``pyro.module`` encoder from each datum to its local ``z``'s loc and log-scale."""
    net = torch.nn.Linear(1, 2)
    torch.nn.init.zeros_(net.weight)
    torch.nn.init.zeros_(net.bias)

    def guide(y):
        pyro.module("encoder", net)
        pyro.sample("mu", normal_site("mu", "positive"))
        out = net(y.unsqueeze(-1))
        with pyro.plate("data", len(y)):
            pyro.sample("z", dist.Normal(out[..., 0], out[..., 1].exp()))

    return guide


def regression_mixed_guide(X, y):
    pyro.sample("b", dist.Normal(p("b_loc", 0.0), p("b_scale", 1.0, positive)))
    L = p("w_tril", torch.eye(3), constraints.lower_cholesky)
    pyro.sample("w", dist.MultivariateNormal(p("w_loc", torch.zeros(3)), scale_tril=L))
    pyro.sample("sigma", dist.Gamma(p("s_a", 1.0, positive), p("s_b", 1.0, positive)))


for _lname, _loss in (("trace", trace), ("meanfield", meanfield), ("graph", graph)):
    add(
        f"mixed-four-families-{_lname}",
        lambda lo=_loss: Built(composite, composite_guide, lo(), composite_args()),
        tags=("mixed",),
    )
add(
    "mixed-with-deltas",
    lambda: Built(composite, composite_delta_guide, trace(), composite_args()),
    tags=("mixed",),
)
add(
    "mixed-amortised-local",
    lambda: Built(local_model, amortised_local_guide(), trace(), (normal_data(),)),
    tags=("mixed", "module"),
)
add(
    "mixed-regression-mvn-gamma",
    lambda: Built(regression, regression_mixed_guide, trace(), regression_data()),
    vectorize=False,
    tags=("mixed",),
)


# J. vectorised particles in the training loss
def vec(n: int = 8, plates: int = 1):
    return Trace_ELBO(num_particles=n, vectorize_particles=True, max_plate_nesting=plates)


for _form in ("positive", "logscale", "softplus"):
    add(
        f"vectorized-normal-{_form}",
        lambda f=_form: Built(nn_model, scalar_guide(f), vec(), (normal_data(),)),
        tags=("vectorized",),
    )
add(
    "vectorized-gamma",
    lambda: Built(gamma_poisson, gamma_guide("positive"), vec(), (count_data(),)),
    tags=("vectorized",),
)
add(
    "vectorized-beta",
    lambda: Built(beta_bernoulli, beta_guide("exp"), vec(), (coin_data(),)),
    margin=2.0,
    tags=("vectorized",),
)
add(
    "vectorized-dirichlet",
    lambda: Built(dirichlet_categorical, dirichlet_guide("positive"), vec(), (category_data(),)),
    margin=2.0,
    tags=("vectorized",),
)
add(
    "vectorized-plate-local",
    lambda: Built(local_model, local_guide(), vec(), (normal_data(),)),
    tags=("vectorized",),
)
add(
    "vectorized-schools-AutoNormal",
    lambda: Built(eight_schools, AutoNormal(eight_schools), vec(), (schools_data(),)),
    margin=2.0,
    tags=("vectorized",),
)
add(
    "vectorized-enum-gmm",
    lambda: Built(
        gmm_model,
        locs_guide,
        TraceEnum_ELBO(num_particles=4, vectorize_particles=True, max_plate_nesting=1),
        (mixture_data(),),
    ),
    enum=True,
    tags=("vectorized",),
)
add(
    "particles-sequential",
    lambda: Built(
        nn_model, scalar_guide("positive"), Trace_ELBO(num_particles=3), (normal_data(),)
    ),
)


# K. hand-written training loops: loss.loss_and_grads(model, guide), then optim(params)
for _name, _build in (
    (
        "normal-positive",
        lambda: Built(nn_model, scalar_guide("positive"), trace(), (normal_data(),)),
    ),
    (
        "normal-logscale",
        lambda: Built(nn_model, scalar_guide("logscale"), trace(), (normal_data(),)),
    ),
    (
        "normal-softplus-meanfield",
        lambda: Built(nn_model, scalar_guide("softplus"), meanfield(), (normal_data(),)),
    ),
    (
        "gamma-poisson",
        lambda: Built(gamma_poisson, gamma_guide("positive"), trace(), (count_data(),)),
    ),
    (
        "dirichlet",
        lambda: Built(dirichlet_categorical, dirichlet_guide("exp"), trace(), (category_data(),)),
    ),
    ("beta", lambda: Built(beta_bernoulli, beta_guide("positive"), trace(), (coin_data(),))),
    (
        "mvn-tril",
        lambda: Built(vector_model, vector_guide("tril-constrained"), trace(), regression_data()),
    ),
    ("AutoNormal", lambda: Built(regression, AutoNormal(regression), trace(), regression_data())),
    ("enum-gmm", lambda: Built(gmm_model, locs_guide, enum(), (mixture_data(),))),
    ("mixed", lambda: Built(composite, composite_guide, trace(), composite_args())),
):
    add(
        f"manual-{_name}",
        _build,
        loop="manual",
        vectorize=not any(k in _name for k in ("mvn", "AutoNormal")),
        enum="enum" in _name,
        margin=2.0,
        tags=("manual",),
    )


# --------------------------------------------------------------------------- running a case
EVAL_DRAWS_VECTORIZED = 256
EVAL_DRAWS_SEQUENTIAL = 32


def estimate(case: Case, built: Built, seed: int = 1234) -> float:
    """A many-draw -ELBO estimate of the current guide (fixed seed: common random numbers)."""
    vectorize = case.vectorize
    draws = EVAL_DRAWS_VECTORIZED if vectorize else EVAL_DRAWS_SEQUENTIAL
    cls = TraceEnum_ELBO if case.enum else Trace_ELBO
    loss = cls(num_particles=draws, vectorize_particles=vectorize, max_plate_nesting=case.plates)
    state = torch.get_rng_state()
    pyro.set_rng_seed(seed)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return float(loss.loss(built.model, built.guide, *built.args))
    finally:
        torch.set_rng_state(state)


@dataclass
class Result:
    name: str
    runs: bool
    trains: bool
    start: float
    end: float
    seconds: float
    error: Optional[str] = None

    def row(self) -> Dict[str, Any]:
        return {
            "case": self.name,
            "runs": self.runs,
            "trains": self.trains,
            "start": self.start,
            "end": self.end,
            "drop": self.start - self.end,
            "seconds": self.seconds,
            "error": self.error,
        }


def _manual_step(built: Built, optim: Any) -> float:
    with poutine.trace(param_only=True) as param_capture:
        loss = built.loss.loss_and_grads(built.model, built.guide, *built.args)
    params = {site["value"].unconstrained() for site in param_capture.trace.nodes.values()}
    optim(params)
    zero_grads(params)
    return float(loss)


def run_case(
    case: Case, make_optim: Callable[[], Any], steps: Optional[int] = None, seed: int = 0
) -> Result:
    """Train ``case`` with a fresh ``make_optim()`` and judge it (never raises)."""
    steps = case.steps if steps is None else steps
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    start = end = math.nan
    t0 = time.process_time()
    try:
        built = case.build()
        start = estimate(case, built)  # also creates the guide's parameters
    except Exception as e:  # the case itself is broken: report it as such
        return Result(case.name, False, False, start, end, 0.0, f"build: {e!r}"[:300])
    try:
        optim = make_optim()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if case.loop == "svi":
                svi = SVI(built.model, built.guide, optim, built.loss)
                for _ in range(steps):
                    svi.step(*built.args)
            else:
                for _ in range(steps):
                    _manual_step(built, optim)
    except Exception as e:
        return Result(case.name, False, False, start, end, time.process_time() - t0, repr(e)[:300])
    end = estimate(case, built)
    trains = math.isfinite(end) and end < start - case.margin
    return Result(case.name, True, trains, start, end, time.process_time() - t0)


def adam() -> Any:
    """The ground truth: Pyro's Adam at the learning rate ``CVI()`` gives its inner optimizer."""
    return pyro.optim.Adam({"lr": 0.01})


CASE_NAMES = [c.name for c in CASES]
BY_NAME = {c.name: c for c in CASES}
