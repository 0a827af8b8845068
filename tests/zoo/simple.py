"""Zoo: single-level models (coin, regressions, a Bayesian neural network, subsampling, LKJ)."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroSample

from . import ZooData, ZooModel
from .heldout import log_predictive_density


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- coin fairness
def coin(data):
    """Pyro's SVI Part I tutorial: is the coin fair? ``f ~ Beta(10, 10)``, flips ~ Bernoulli(f)."""
    f = pyro.sample("latent_fairness", dist.Beta(data.new_tensor(10.0), data.new_tensor(10.0)))
    with pyro.plate("flips", len(data)):
        pyro.sample("obs", dist.Bernoulli(f), obs=data)


def coin_data(dtype=torch.float64) -> ZooData:
    return ZooData((torch.tensor([1.0] * 6 + [0.0] * 4, dtype=dtype),))


# --------------------------------------------------------------------------- Bayesian regression
def bayesian_regression(is_cont_africa, ruggedness, log_gdp=None):
    """Pyro's Bayesian regression tutorial (terrain ruggedness and GDP): an interaction model
    with a ``Uniform(0, 10)`` noise scale."""
    a = pyro.sample("a", dist.Normal(ruggedness.new_tensor(0.0), 10.0))
    b_a = pyro.sample("bA", dist.Normal(ruggedness.new_tensor(0.0), 1.0))
    b_r = pyro.sample("bR", dist.Normal(ruggedness.new_tensor(0.0), 1.0))
    b_ar = pyro.sample("bAR", dist.Normal(ruggedness.new_tensor(0.0), 1.0))
    sigma = pyro.sample("sigma", dist.Uniform(ruggedness.new_tensor(0.0), 10.0))
    mean = a + b_a * is_cont_africa + b_r * ruggedness + b_ar * is_cont_africa * ruggedness
    with pyro.plate("data", len(ruggedness)):
        return pyro.sample("obs", dist.Normal(mean, sigma), obs=log_gdp)


def bayesian_regression_data(dtype=torch.float64) -> ZooData:
    """170 synthetic 'countries' (the tutorial's size), 50 more held out."""
    g = _gen(10)
    n = 220
    africa = (torch.rand(n, generator=g) < 0.3).to(dtype)
    rugged = -1.2 * torch.rand(n, generator=g, dtype=dtype).log()
    y = 9.2 - 1.9 * africa - 0.2 * rugged + 0.35 * africa * rugged
    y = y + 0.9 * torch.randn(n, generator=g, dtype=dtype)
    tr, te = slice(0, 170), slice(170, n)
    return ZooData((africa[tr], rugged[tr], y[tr]), test_args=(africa[te], rugged[te], y[te]))


# --------------------------------------------------------------------------- Poisson regression
def poisson_regression(X, y=None):
    """A Poisson GLM with a log link (Gelman & Hill ch. 6): counts ~ Poisson(exp(b + X w))."""
    b = pyro.sample("b", dist.Normal(X.new_tensor(0.0), 2.0))
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        return pyro.sample("obs", dist.Poisson((b + X @ w).exp()), obs=y)


def poisson_regression_data(dtype=torch.float64) -> ZooData:
    g = _gen(11)
    X = torch.randn(250, 4, generator=g, dtype=dtype) * 0.6
    rate = (0.8 + X @ torch.tensor([0.7, -0.4, 0.2, 0.0], dtype=dtype)).exp()
    y = torch.poisson(rate, generator=g)
    return ZooData((X[:200], y[:200]), test_args=(X[200:], y[200:]))


# --------------------------------------------------------------------------- Bayesian NN
class BNN(PyroModule):
    """numpyro's ``examples/bnn.py`` written with ``PyroModule``/``PyroSample``: two tanh
    hidden layers, Normal(0, 1) weights, a Gamma(3, 1) noise precision."""

    def __init__(self, d_in: int = 1, d_hidden: int = 5, dtype=torch.float64):
        super().__init__()
        zero = torch.zeros((), dtype=dtype)

        def normal(*shape):
            return dist.Normal(zero, 1.0).expand(list(shape)).to_event(len(shape))

        self.l1 = PyroModule[torch.nn.Linear](d_in, d_hidden)
        self.l1.weight = PyroSample(normal(d_hidden, d_in))
        self.l1.bias = PyroSample(normal(d_hidden))
        self.l2 = PyroModule[torch.nn.Linear](d_hidden, d_hidden, bias=False)
        self.l2.weight = PyroSample(normal(d_hidden, d_hidden))
        self.l3 = PyroModule[torch.nn.Linear](d_hidden, 1, bias=False)
        self.l3.weight = PyroSample(normal(1, d_hidden))

    def forward(self, x, y=None):
        h = torch.tanh(self.l2(torch.tanh(self.l1(x))))
        mean = self.l3(h).squeeze(-1)
        prec = pyro.sample("prec_obs", dist.Gamma(x.new_tensor(3.0), x.new_tensor(1.0)))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, prec**-0.5), obs=y)
        return mean


def bnn_data(dtype=torch.float64) -> ZooData:
    """numpyro's toy data: a cubic-ish curve with noise, 40 training and 40 test points."""
    g = _gen(12)
    x = torch.linspace(-1.0, 1.0, 80, dtype=dtype)
    y = 1.5 * x**3 - 0.8 * x + 0.15 * torch.randn(80, generator=g, dtype=dtype)
    perm = torch.randperm(80, generator=g)
    tr, te = perm[:40], perm[40:]
    return ZooData((x[tr, None], y[tr]), test_args=(x[te, None], y[te]))


# --------------------------------------------------------------------------- subsampling
def subsampled_logistic(X, y, batch_size: int = 50):
    """Minibatch logistic regression: ``pyro.plate(..., subsample_size=B)`` (Pyro's SVI Part II
    tutorial's data subsampling)."""
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0], subsample_size=batch_size) as ind:
        pyro.sample("obs", dist.Bernoulli(logits=X[ind] @ w), obs=y[ind])


def subsampled_logistic_sequential(X, y, batch_size: int = 10):
    """The same with a sequential plate: ``for i in pyro.plate(..., subsample_size=B)``."""
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    for i in pyro.plate("data", X.shape[0], subsample_size=batch_size):
        pyro.sample(f"obs_{i}", dist.Bernoulli(logits=X[i] @ w), obs=y[i])


def _logistic_data(n: int, seed: int, dtype) -> ZooData:
    g = _gen(seed)
    X = torch.cat([torch.ones(n, 1, dtype=dtype), torch.randn(n, 3, generator=g, dtype=dtype)], 1)
    w = torch.tensor([-0.5, 1.2, -0.8, 0.3], dtype=dtype)
    y = torch.bernoulli(torch.sigmoid(X @ w), generator=g)
    return ZooData((X, y))


def subsampled_logistic_data(dtype=torch.float64) -> ZooData:
    return _logistic_data(500, 13, dtype)


def subsampled_logistic_sequential_data(dtype=torch.float64) -> ZooData:
    return _logistic_data(60, 14, dtype)


# --------------------------------------------------------------------------- LKJ
def lkj_mvn(y):
    """Pyro's ``examples/lkj.py``: a multivariate normal with HalfCauchy scales and an
    ``LKJCholesky`` correlation prior."""
    d = y.shape[1]
    theta = pyro.sample("theta", dist.HalfCauchy(y.new_ones(d)).to_event(1))
    L_omega = pyro.sample("L_omega", dist.LKJCholesky(d, y.new_tensor(1.0)))
    L = theta.sqrt().unsqueeze(-1) * L_omega
    with pyro.plate("observations", y.shape[0]):
        pyro.sample("obs", dist.MultivariateNormal(y.new_zeros(d), scale_tril=L), obs=y)


def lkj_data(dtype=torch.float64) -> ZooData:
    g = _gen(15)
    cov = torch.tensor([[1.0, 0.6, -0.3], [0.6, 2.0, 0.2], [-0.3, 0.2, 0.5]], dtype=dtype)
    L = torch.linalg.cholesky(cov)
    y = torch.randn(150, 3, generator=g, dtype=dtype) @ L.T
    return ZooData((y[:100],), test_args=(y[100:],))


def _lpd(model, guide, data):
    return log_predictive_density(model, guide, data)


BNN_MODELS = {torch.float64: BNN(), torch.float32: BNN(dtype=torch.float32)}
BNN_MODEL = BNN_MODELS[torch.float64]

ENTRIES = [
    ZooModel("coin", coin, coin_data, "Pyro tutorial: SVI Part I", steps=3),
    ZooModel(
        "bayesian_regression",
        bayesian_regression,
        bayesian_regression_data,
        "Pyro tutorial: Bayesian regression (Part I)",
        heldout=_lpd,
        steps=80,
    ),
    ZooModel(
        "poisson_regression",
        poisson_regression,
        poisson_regression_data,
        "Gelman & Hill, ch. 6 (Poisson GLM)",
        heldout=_lpd,
        steps=20,
    ),
    ZooModel(
        "bnn",
        BNN_MODEL,
        bnn_data,
        "numpyro examples/bnn.py, with PyroModule/PyroSample",
        heldout=_lpd,
        steps=100,
        for_dtype=lambda dtype: (BNN_MODELS[dtype], {}),
    ),
    ZooModel(
        "subsampled_logistic",
        subsampled_logistic,
        subsampled_logistic_data,
        "Pyro tutorial: SVI Part II (subsampling)",
        steps=60,
        subsampled=True,
    ),
    ZooModel(
        "subsampled_logistic_sequential",
        subsampled_logistic_sequential,
        subsampled_logistic_sequential_data,
        "Pyro tutorial: SVI Part II (sequential plate)",
        steps=60,
        subsampled=True,
    ),
    ZooModel(
        "lkj_mvn",
        lkj_mvn,
        lkj_data,
        "Pyro examples/lkj.py",
        heldout=_lpd,
        steps=200,
    ),
]
