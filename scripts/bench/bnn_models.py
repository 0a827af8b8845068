"""Models with no exact structure for ``scripts/benchmark_bnn.py``: Bayesian neural networks
(one and two hidden layers), the horseshoe logistic regression, stochastic volatility, and
ODE / recursion models.

Each entry of :data:`MODELS` is ``name -> (model, data(dtype) -> args)``; the data are fixed
(seeded generators), the models written as a Pyro user would.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroSample

__all__ = ["MODELS", "ODE_MODELS", "NETWORKS", "mlp_twin"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- BNN regression
def bnn_regression(X, Y):
    """numpyro's ``examples/bnn.py`` with one hidden layer of 5 tanh units (21 latents)."""
    D_X, D_H = X.shape[1], 5
    w1 = pyro.sample("w1", dist.Normal(X.new_zeros(D_X, D_H), 1.0).to_event(2))
    z1 = torch.tanh(X @ w1)
    w2 = pyro.sample("w2", dist.Normal(X.new_zeros(D_H, 1), 1.0).to_event(2))
    z2 = (z1 @ w2).squeeze(-1)
    prec = pyro.sample("prec_obs", dist.Gamma(X.new_tensor(3.0), X.new_tensor(1.0)))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("Y", dist.Normal(z2, prec.rsqrt()), obs=Y)


def bnn_regression_data(dtype=torch.float64) -> Tuple[torch.Tensor, ...]:
    """numpyro's ``get_data(N=50, D_X=3, sigma_obs=0.05)``: powers of x, a wiggly target."""
    g = _gen(0)
    N, D_X = 50, 3
    x = torch.linspace(-1.0, 1.0, N, dtype=torch.float64)
    X = x[:, None] ** torch.arange(D_X, dtype=torch.float64)
    W = 0.5 * torch.randn(D_X, generator=g, dtype=torch.float64)
    Y = X @ W + 0.5 * (0.5 + x) ** 2 * torch.sin(4.0 * x)
    Y = Y + 0.05 * torch.randn(N, generator=g, dtype=torch.float64)
    Y = (Y - Y.mean()) / Y.std()
    return X.to(dtype), Y.to(dtype)


# --------------------------------------------------------------------------- wine classifier
class WineBNN(PyroModule):
    """A 13-8-3 tanh classifier with ``Normal(0, 1)`` weights and biases (139 latents)."""

    def __init__(self, d_in: int = 13, d_hidden: int = 8, d_out: int = 3):
        super().__init__()
        self.l1 = PyroModule[torch.nn.Linear](d_in, d_hidden)
        self.l1.weight = PyroSample(dist.Normal(0.0, 1.0).expand([d_hidden, d_in]).to_event(2))
        self.l1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([d_hidden]).to_event(1))
        self.l2 = PyroModule[torch.nn.Linear](d_hidden, d_out)
        self.l2.weight = PyroSample(dist.Normal(0.0, 1.0).expand([d_out, d_hidden]).to_event(2))
        self.l2.bias = PyroSample(dist.Normal(0.0, 1.0).expand([d_out]).to_event(1))

    def forward(self, x, y=None):
        logits = self.l2(torch.tanh(self.l1(x)))
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Categorical(logits=logits), obs=y)


class DigitsBNN(PyroModule):
    """A two-hidden-layer 64-16-16-10 tanh classifier with ``Normal(0, 1)`` weights and
    biases (1,482 latents)."""

    def __init__(self, sizes: Tuple[int, ...] = (64, 16, 16, 10)):
        super().__init__()
        self.sizes = sizes
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layer = PyroModule[torch.nn.Linear](a, b)
            layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([b, a]).to_event(2))
            layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([b]).to_event(1))
            setattr(self, f"l{i + 1}", layer)

    def forward(self, x, y=None):
        h = x
        n = len(self.sizes) - 1
        for i in range(n):
            h = getattr(self, f"l{i + 1}")(h)
            if i < n - 1:
                h = torch.tanh(h)
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Categorical(logits=h), obs=y)


def mlp_twin(sizes: Tuple[int, ...]) -> torch.nn.Sequential:
    """The same network as a plain ``nn.Module`` (for IVON): ``Linear``/``Tanh`` layers whose
    ``2 i``-th module is the Pyro network's ``l{i + 1}``."""
    mods: list = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        mods.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            mods.append(torch.nn.Tanh())
    return torch.nn.Sequential(*mods)


def digits_data(dtype=torch.float64) -> Tuple[torch.Tensor, ...]:
    """sklearn's bundled digits (1,797 8x8 images, 10 classes), pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    d = load_digits()
    X = torch.tensor(d.data, dtype=torch.float64) / 16.0
    return X.to(dtype), torch.tensor(d.target)


def wine_data(dtype=torch.float64) -> Tuple[torch.Tensor, ...]:
    """sklearn's wine data (178 x 13, 3 classes), standardised."""
    from sklearn.datasets import load_wine

    d = load_wine()
    X = torch.tensor(d.data, dtype=torch.float64)
    X = (X - X.mean(0)) / X.std(0)
    return X.to(dtype), torch.tensor(d.target)


# --------------------------------------------------------------------------- horseshoe
def horseshoe_logistic(X, y):
    """Sparse logistic regression, horseshoe prior (as the zoo's ``horseshoe_logistic``)."""
    D = X.shape[1]
    tau = pyro.sample("tau", dist.HalfCauchy(X.new_tensor(1.0)))
    with pyro.plate("features", D):
        lam = pyro.sample("lambda", dist.HalfCauchy(X.new_tensor(1.0)))
        beta = pyro.sample("beta", dist.Normal(X.new_tensor(0.0), tau * lam))
    b = pyro.sample("b", dist.Normal(X.new_tensor(0.0), 5.0))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("obs", dist.Bernoulli(logits=b + X @ beta), obs=y)


def horseshoe_data(dtype=torch.float64) -> Tuple[torch.Tensor, ...]:
    g = _gen(40)
    X = torch.randn(300, 20, generator=g, dtype=dtype)
    w = torch.zeros(20, dtype=dtype)
    w[:3] = torch.tensor([2.0, -1.5, 1.0], dtype=dtype)
    y = torch.bernoulli(torch.sigmoid(0.3 + X @ w), generator=g)
    return X[:200], y[:200]


# --------------------------------------------------------------------------- stochastic volatility
def stochastic_volatility(returns):
    """numpyro's stochastic volatility, the Pyro way: a latent step scale, Normal increments,
    ``r_t ~ Normal(0, exp(cumsum / 2))`` (151 latents)."""
    T = returns.shape[0]
    step_scale = pyro.sample("step_scale", dist.Exponential(returns.new_tensor(10.0)))
    with pyro.plate("steps", T):
        increments = pyro.sample("increments", dist.Normal(returns.new_tensor(0.0), step_scale))
    log_vol = increments.cumsum(-1)
    with pyro.plate("time", T):
        pyro.sample("returns", dist.Normal(0.0, (log_vol / 2).exp()), obs=returns)


def stochastic_volatility_data(dtype=torch.float64) -> Tuple[torch.Tensor, ...]:
    g = _gen(50)
    T = 150
    s = (0.15 * torch.randn(T, generator=g, dtype=torch.float64)).cumsum(0)
    r = (s / 2).exp() * torch.randn(T, generator=g, dtype=torch.float64)
    return (r.to(dtype),)


# --------------------------------------------------------------------------- ODE / recursions
def _rk4(f, y0, dt: float, steps: int):
    ys, y = [y0], y0
    for _ in range(steps):
        k1 = f(y)
        k2 = f(y + 0.5 * dt * k1)
        k3 = f(y + 0.5 * dt * k2)
        k4 = f(y + dt * k3)
        y = y + dt / 6.0 * (k1 + 2 * k2 + 2 * k3 + k4)
        ys.append(y)
    return torch.stack(ys, -2)


def lotka_volterra(obs):
    """Lotka-Volterra (Stan's case study), RK4 in torch: 4 rates, 2 initial populations,
    2 noise scales (8 latents); log-normal observations every unit of time."""
    T = obs.shape[0]
    rates = pyro.sample(
        "theta", dist.LogNormal(obs.new_tensor([0.0, -3.0, 0.0, -3.0]), 0.5).to_event(1)
    )
    z0 = pyro.sample("z0", dist.LogNormal(obs.new_tensor(3.4), 1.0).expand([2]).to_event(1))
    sigma = pyro.sample("sigma", dist.LogNormal(obs.new_tensor(-1.0), 1.0).expand([2]).to_event(1))
    a, b, c, d = rates.unbind(-1)

    def f(z):
        u, v = z.unbind(-1)
        return torch.stack([(a - b * v) * u, (-c + d * u) * v], -1)

    sub = 4  # RK4 sub-steps per unit of time
    path = _rk4(f, z0, 1.0 / sub, (T - 1) * sub)[..., ::sub, :]
    with pyro.plate("time", T):
        pyro.sample("obs", dist.LogNormal(path.clamp_min(1e-6).log(), sigma).to_event(1), obs=obs)


def lotka_volterra_data(dtype=torch.float64) -> Tuple[torch.Tensor, ...]:
    g = _gen(7)
    rates = torch.tensor([0.55, 0.028, 0.8, 0.024], dtype=torch.float64)
    a, b, c, d = rates

    def f(z):
        u, v = z.unbind(-1)
        return torch.stack([(a - b * v) * u, (-c + d * u) * v], -1)

    T, sub = 20, 4
    path = _rk4(f, torch.tensor([33.0, 6.0], dtype=torch.float64), 1.0 / sub, (T - 1) * sub)
    path = path[::sub]
    obs = path * torch.exp(0.25 * torch.randn(path.shape, generator=g, dtype=torch.float64))
    return (obs.to(dtype),)


def pk_one_compartment(t, dose, conc):
    """A one-compartment pharmacokinetic model with first-order absorption, written as an ODE
    and integrated by RK4: ``dA_g/dt = -ka A_g``, ``dA_c/dt = ka A_g - (CL / V) A_c``,
    ``conc = A_c / V`` observed log-normally (4 latents)."""
    ka = pyro.sample("ka", dist.LogNormal(t.new_tensor(0.0), 0.5))
    CL = pyro.sample("CL", dist.LogNormal(t.new_tensor(1.0), 0.5))
    V = pyro.sample("V", dist.LogNormal(t.new_tensor(3.0), 0.5))
    sigma = pyro.sample("sigma", dist.HalfNormal(t.new_tensor(0.5)))

    def f(A):
        ag, ac = A.unbind(-1)
        return torch.stack([-ka * ag, ka * ag - CL / V * ac], -1)

    steps_per_unit = 4
    steps = int(float(t[-1]) * steps_per_unit)
    A0 = torch.stack([dose * torch.ones_like(ka), torch.zeros_like(ka)], -1)
    path = _rk4(f, A0, 1.0 / steps_per_unit, steps)
    idx = (t * steps_per_unit).round().long()
    mean = (path[..., idx, 1] / V.unsqueeze(-1)).clamp_min(1e-8)
    with pyro.plate("obs", t.shape[0]):
        pyro.sample("conc", dist.LogNormal(mean.log(), sigma.unsqueeze(-1)), obs=conc)


def pk_data(dtype=torch.float64) -> Tuple[torch.Tensor, ...]:
    g = _gen(11)
    t = torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0], dtype=torch.float64)
    ka, CL, V, dose = 1.2, 2.5, 20.0, 100.0
    k = CL / V
    c = dose * ka / (V * (ka - k)) * (torch.exp(-k * t) - torch.exp(-ka * t))
    conc = c * torch.exp(0.15 * torch.randn(10, generator=g, dtype=torch.float64))
    return t.to(dtype), torch.tensor(dose, dtype=dtype), conc.to(dtype)


def garch11(r):
    """GARCH(1, 1): ``sigma2_t = omega + alpha r_{t-1}^2 + beta sigma2_{t-1}``, a Python
    recursion over time (Stan User's Guide), 3 latents."""
    omega = pyro.sample("omega", dist.HalfNormal(r.new_tensor(1.0)))
    alpha = pyro.sample("alpha", dist.Beta(r.new_tensor(2.0), 5.0))
    beta = pyro.sample("beta", dist.Beta(r.new_tensor(5.0), 2.0))
    s2 = [omega / (1.0 - alpha - beta).clamp_min(1e-3)]
    for t in range(1, r.shape[-1]):
        s2.append(omega + alpha * r[t - 1] ** 2 + beta * s2[-1])
    with pyro.plate("time", r.shape[-1]):
        pyro.sample("r", dist.Normal(0.0, torch.stack(s2, -1).sqrt()), obs=r)


def garch_data(dtype=torch.float64) -> Tuple[torch.Tensor, ...]:
    g = _gen(13)
    T, omega, alpha, beta = 200, 0.1, 0.15, 0.75
    r, s2 = [], omega / (1 - alpha - beta)
    for _ in range(T):
        x = float(torch.randn((), generator=g, dtype=torch.float64)) * s2**0.5
        r.append(x)
        s2 = omega + alpha * x * x + beta * s2
    return (torch.tensor(r, dtype=dtype),)


def _wine_model() -> Callable:
    return WineBNN()


MODELS: Dict[str, Tuple[Callable[[], Callable], Callable]] = {
    "bnn_regression": (lambda: bnn_regression, bnn_regression_data),
    "bnn_wine": (_wine_model, wine_data),
    "bnn_digits": (lambda: DigitsBNN(), digits_data),
    "horseshoe_logistic": (lambda: horseshoe_logistic, horseshoe_data),
    "stochastic_volatility": (lambda: stochastic_volatility, stochastic_volatility_data),
}

#: the networks whose latents all have ``Normal(0, 1)`` priors (IVON's Bayesian posterior):
#: name -> layer sizes
NETWORKS: Dict[str, Tuple[int, ...]] = {"bnn_wine": (13, 8, 3), "bnn_digits": (64, 16, 16, 10)}

ODE_MODELS: Dict[str, Tuple[Callable[[], Callable], Callable]] = {
    "lotka_volterra": (lambda: lotka_volterra, lotka_volterra_data),
    "pk_one_compartment": (lambda: pk_one_compartment, pk_data),
    "garch11": (lambda: garch11, garch_data),
}
