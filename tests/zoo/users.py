"""Zoo: models as new users write them: float32 tensors, latent prior scales,
non-centred hierarchies, neural networks with ``PyroModule``, random walks with ``cumsum``
and sequential minibatch plates, each unmodified from the form of its source."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroSample

from . import ZooData, ZooModel
from .heldout import log_predictive_density


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _lpd(model, guide, data):
    return log_predictive_density(model, guide, data)


# --------------------------------------------------------------------------- horseshoe
def horseshoe_logistic(X, y=None):
    """Sparse logistic regression with a horseshoe prior (Carvalho, Polson & Scott 2010):
    ``beta_j ~ Normal(0, tau * lambda_j)``, half-Cauchy global and local scales."""
    D = X.shape[1]
    tau = pyro.sample("tau", dist.HalfCauchy(X.new_tensor(1.0)))
    with pyro.plate("features", D):
        lam = pyro.sample("lambda", dist.HalfCauchy(X.new_tensor(1.0)))
        beta = pyro.sample("beta", dist.Normal(X.new_tensor(0.0), tau * lam))
    b = pyro.sample("b", dist.Normal(X.new_tensor(0.0), 5.0))
    with pyro.plate("data", X.shape[0]):
        return pyro.sample("obs", dist.Bernoulli(logits=b + X @ beta), obs=y)


def horseshoe_data(dtype=torch.float64) -> ZooData:
    """200 training and 100 test points, 20 features of which 3 matter."""
    g = _gen(40)
    X = torch.randn(300, 20, generator=g, dtype=dtype)
    w = torch.zeros(20, dtype=dtype)
    w[:3] = torch.tensor([2.0, -1.5, 1.0], dtype=dtype)
    y = torch.bernoulli(torch.sigmoid(0.3 + X @ w), generator=g)
    return ZooData((X[:200], y[:200]), test_args=(X[200:], y[200:]))


# --------------------------------------------------------------------------- varying intercepts
def varying_intercept_poisson(group, x, num_groups: int, y=None):
    """Varying-intercept Poisson regression (Gelman & Hill ch. 15) with a latent group scale:
    ``a_j ~ Normal(mu_a, sigma_a)``, ``y ~ Poisson(exp(a_group + b x))``."""
    mu_a = pyro.sample("mu_a", dist.Normal(x.new_tensor(0.0), 5.0))
    sigma_a = pyro.sample("sigma_a", dist.HalfNormal(x.new_tensor(1.0)))
    with pyro.plate("groups", num_groups):
        a = pyro.sample("a", dist.Normal(mu_a, sigma_a))
    b = pyro.sample("b", dist.Normal(x.new_tensor(0.0), 1.0))
    with pyro.plate("data", len(x)):
        return pyro.sample("obs", dist.Poisson((a[group] + b * x).exp()), obs=y)


def varying_intercept_data(dtype=torch.float64) -> ZooData:
    g = _gen(41)
    J, n = 12, 240
    a = 0.5 + 0.6 * torch.randn(J, generator=g, dtype=dtype)
    group = torch.randint(0, J, (n,), generator=g)
    x = torch.randn(n, generator=g, dtype=dtype)
    y = torch.poisson((a[group] + 0.4 * x).exp(), generator=g)
    return ZooData((group[:200], x[:200], J, y[:200]), test_args=(group[200:], x[200:], J, y[200:]))


# --------------------------------------------------------------------------- probabilistic PCA
def ppca(X, k: int = 2):
    """Probabilistic PCA (Tipping & Bishop 1999): ``X ~ Normal(z @ W + mu, sigma)``."""
    n, d = X.shape
    W = pyro.sample("W", dist.Normal(X.new_zeros(k, d), 1.0).to_event(2))
    mu = pyro.sample("mu", dist.Normal(X.new_zeros(d), 3.0).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(X.new_tensor(1.0)))
    with pyro.plate("data", n):
        z = pyro.sample("z", dist.Normal(X.new_zeros(k), 1.0).to_event(1))
        pyro.sample("obs", dist.Normal(z @ W + mu, sigma).to_event(1), obs=X)


def ppca_data(dtype=torch.float64) -> ZooData:
    g = _gen(42)
    n, d, k = 60, 5, 2
    W = torch.randn(k, d, generator=g, dtype=dtype)
    z = torch.randn(n, k, generator=g, dtype=dtype)
    X = z @ W + 1.0 + 0.3 * torch.randn(n, d, generator=g, dtype=dtype)
    return ZooData((X,))


# --------------------------------------------------------------------------- BNN classifier
class BNNClassifier(PyroModule):
    """A Bayesian neural network classifier written with ``PyroModule``/``PyroSample`` (Pyro's
    Bayesian-NN tutorials): one tanh hidden layer, Normal(0, 1) weights, Bernoulli logits."""

    def __init__(self, d_in: int = 2, d_hidden: int = 6, dtype=torch.float64):
        super().__init__()
        zero = torch.zeros((), dtype=dtype)

        def normal(*shape):
            return dist.Normal(zero, 1.0).expand(list(shape)).to_event(len(shape))

        self.hidden = PyroModule[torch.nn.Linear](d_in, d_hidden)
        self.hidden.weight = PyroSample(normal(d_hidden, d_in))
        self.hidden.bias = PyroSample(normal(d_hidden))
        self.out = PyroModule[torch.nn.Linear](d_hidden, 1)
        self.out.weight = PyroSample(normal(1, d_hidden))
        self.out.bias = PyroSample(normal(1))

    def forward(self, x, y=None):
        logits = self.out(torch.tanh(self.hidden(x))).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Bernoulli(logits=logits), obs=y)
        return logits


def bnn_classifier_data(dtype=torch.float64) -> ZooData:
    """Two interleaved half-moons-like classes, 80 training and 80 test points."""
    g = _gen(43)
    n = 160
    t = torch.rand(n, generator=g, dtype=dtype) * 3.14159
    c = torch.rand(n, generator=g) < 0.5
    x = torch.stack([torch.cos(t), torch.sin(t)], -1)
    x = torch.where(c[:, None], x, 1.0 - x * torch.tensor([1.0, 1.0], dtype=dtype) - 0.5)
    x = x + 0.15 * torch.randn(n, 2, generator=g, dtype=dtype)
    y = c.to(dtype)
    return ZooData((x[:80], y[:80]), test_args=(x[80:], y[80:]))


BNN_CLASSIFIERS = {
    torch.float64: BNNClassifier(),
    torch.float32: BNNClassifier(dtype=torch.float32),
}


# --------------------------------------------------------------------------- local level
def local_level(y):
    """A local-level (random walk plus noise) model written as forecasters write it: a latent
    drift scale, ``x = cumsum(eps)``, and a latent observation scale."""
    T = y.shape[0]
    drift_scale = pyro.sample("drift_scale", dist.LogNormal(y.new_tensor(-2.0), 1.0))
    obs_scale = pyro.sample("obs_scale", dist.LogNormal(y.new_tensor(-1.0), 1.0))
    with pyro.plate("time", T):
        eps = pyro.sample("eps", dist.Normal(y.new_tensor(0.0), drift_scale))
    level = eps.cumsum(-1)
    with pyro.plate("obs_time", T):
        pyro.sample("obs", dist.Normal(level, obs_scale), obs=y)


def local_level_data(dtype=torch.float64) -> ZooData:
    g = _gen(44)
    T = 60
    level = (0.15 * torch.randn(T, generator=g, dtype=dtype)).cumsum(0)
    return ZooData((level + 0.3 * torch.randn(T, generator=g, dtype=dtype),))


# --------------------------------------------------------------------------- SVI Part II coin
def coin_sequential(data):
    """Pyro's SVI Part II tutorial: the coin with a sequential minibatch plate whose site
    names carry the data index (``obs_{i}``)."""
    f = pyro.sample("latent_fairness", dist.Beta(data.new_tensor(10.0), data.new_tensor(10.0)))
    for i in pyro.plate("data_loop", len(data), subsample_size=5):
        pyro.sample(f"obs_{i}", dist.Bernoulli(f), obs=data[i])


def coin_sequential_data(dtype=torch.float64) -> ZooData:
    return ZooData((torch.tensor([1.0] * 6 + [0.0] * 4, dtype=dtype),))


ENTRIES = [
    ZooModel(
        "horseshoe_logistic",
        horseshoe_logistic,
        horseshoe_data,
        "sparse logistic regression, horseshoe prior (Carvalho et al. 2010)",
        heldout=_lpd,
        steps=200,
    ),
    ZooModel(
        "varying_intercept_poisson",
        varying_intercept_poisson,
        varying_intercept_data,
        "Gelman & Hill ch. 15: varying intercepts, latent group scale",
        heldout=_lpd,
        steps=150,
    ),
    ZooModel("ppca", ppca, ppca_data, "probabilistic PCA (Tipping & Bishop 1999)", steps=150),
    ZooModel(
        "bnn_classifier",
        BNN_CLASSIFIERS[torch.float64],
        bnn_classifier_data,
        "Pyro Bayesian NN tutorials: a PyroModule classifier",
        heldout=_lpd,
        steps=100,
        for_dtype=lambda dtype: (BNN_CLASSIFIERS[dtype], {}),
    ),
    ZooModel(
        "local_level",
        local_level,
        local_level_data,
        "forecasting: local level with latent drift and noise scales (cumsum form)",
        steps=150,
    ),
    ZooModel(
        "coin_sequential",
        coin_sequential,
        coin_sequential_data,
        "Pyro tutorial: SVI Part II (sequential minibatch plate)",
        steps=200,
        subsampled=True,
    ),
]
