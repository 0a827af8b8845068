"""The warm start of linear-predictor and softmax sites (``pyro_cvi.messages.warm_start``):
per row, the target at a near point mass at the prior mean or, where the prior is not flat and
gives the row less curvature, the target at the prior's own moments. Checked row by row against
an independent Gauss-Hermite computation of the logistic targets, and by the steps it saves."""

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.messages.gaussian import FLAT_PRIOR_VAR

DTYPES = [torch.float32, torch.float64]


def _logistic_targets(y, m, v, points=32):
    """``(lam1, lam2)`` of eq. 13 for ``f = E_q[log Bernoulli(y | sigmoid(eta))]``, ``q = N(m, v)``,
    by ``AutoCVI``'s default rule (32 probabilists' Hermite points, numpy) and the rule's exact
    derivatives: ``df/dm = sum_k w_k f'(eta_k)``, ``df/dv = sum_k w_k f'(eta_k) t_k / (2 sqrt v)``;
    ``lam2 = df/dv``, ``lam1 = df/dm - 2 lam2 m`` (eqs. 30-31)."""
    t, w = np.polynomial.hermite_e.hermegauss(points)
    w = w / w.sum()
    m, v, y = (a.double().numpy()[:, None] for a in (m, v, y))
    s = 0.5 * (1.0 + np.tanh(0.5 * (m + np.sqrt(v) * t)))  # the sigmoid, without overflow
    d1 = y - s  # f'(eta)
    dm, dv = (w * d1).sum(1), (w * d1 * t).sum(1) / (2 * np.sqrt(v[:, 0]))
    return torch.tensor(dm - 2 * dv * m[:, 0]), torch.tensor(dv)


def _problem(dtype, N=300, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    X[:, 0] = 1.0
    w = 1.5 * torch.randn(D, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(X @ w), generator=g)
    return X.to(dtype), y.to(dtype)


def _logreg(scale):
    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), scale).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model


def _sites(name="y"):
    (p,) = [v for k, v in pyro.get_param_store().items() if k.endswith(f"sites.{name}")]
    return p.detach()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.8, 1e3])  # prior variance 0.64 (not flat), 1e6 (flat)
def test_logistic_warm_start_is_the_per_row_rule(dtype, scale):
    X, y = _problem(dtype)
    model = _logreg(scale)
    guide = AutoCVI(model)
    guide(X, y)
    sites = _sites().double()
    X64, y64 = X.double(), y.double()
    zero = torch.zeros(X.shape[0], dtype=torch.float64)
    prior_var = (X64**2).sum(1) * scale**2
    l1_pm, l2_pm = _logistic_targets(y64, zero, torch.full_like(zero, 1e-4))
    l1_pr, l2_pr = _logistic_targets(y64, zero, prior_var)
    pick = (prior_var <= FLAT_PRIOR_VAR) & (l2_pr.abs() < l2_pm.abs())
    if scale > 1:
        assert not pick.any()  # a flat prior keeps the Newton step from the prior mean
    else:
        assert pick.all()  # at the prior mean 0 a wider q has less curvature on every row
    want = torch.stack([torch.where(pick, l1_pr, l1_pm), torch.where(pick, l2_pr, l2_pm)], -1)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(sites, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_choose_the_prior_target_only_where_it_has_less_curvature(dtype):
    """A prior mean away from 0 (an offset of 4 on half the rows): there the wider q has more
    curvature than the point mass, so those rows keep the point mass."""
    X, y = _problem(dtype, N=200, D=3, seed=1)
    off = torch.where(torch.arange(200) % 2 == 0, 4.0, 0.0).to(dtype)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(3), 1.0).to_event(1))
        with pyro.plate("data", 200):
            pyro.sample("y", dist.Bernoulli(logits=X @ w + off), obs=y)

    AutoCVI(model)(X, y)
    sites = _sites().double()
    mean, v = off.double(), (X.double() ** 2).sum(1)
    l1_pm, l2_pm = _logistic_targets(y.double(), mean, torch.full_like(v, 1e-4))
    l1_pr, l2_pr = _logistic_targets(y.double(), mean, v)
    pick = l2_pr.abs() < l2_pm.abs()
    assert 0 < int(pick.sum()) < 200  # both kinds of row occur
    assert bool(pick[1::2].all()) and not bool(pick[::2].any())
    want = torch.stack([torch.where(pick, l1_pr, l1_pm), torch.where(pick, l2_pr, l2_pm)], -1)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(sites, want, rtol=tol, atol=tol)


def _steps_to_within(model, args, optimum, step_size, init_sites="laplace", max_steps=40):
    pyro.clear_param_store()
    guide = AutoCVI(model, init_sites=init_sites)
    svi = SVI(model, guide, CVI(step_size=step_size), loss=CVI_ELBO())
    for t in range(1, max_steps + 1):
        if svi.step(*args) <= optimum + 0.5:
            return t
    return None


def test_warm_start_saves_steps_at_a_fixed_step_where_the_prior_is_informative(monkeypatch):
    """A problem shaped like a1a (prior variance 5 per weight, sparse binary features): at step
    0.4 the rule reaches within 0.5 nat of the optimum in fewer steps than the point mass alone
    (every prior taken as flat), whose curvature overstates the precision."""
    import pyro_cvi.messages.gaussian as messages

    g = torch.Generator().manual_seed(3)
    N, D = 800, 40
    X = (torch.rand(N, D, generator=g) < 0.1).double()
    X[:, 0] = 1.0
    w = torch.randn(D, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(X @ w - 1.0), generator=g)
    model = _logreg(5**0.5)
    pyro.clear_param_store()
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    optimum = min(svi.step(X, y) for _ in range(30))
    rule = _steps_to_within(model, (X, y), optimum, 0.4)
    monkeypatch.setattr(messages, "FLAT_PRIOR_VAR", -1.0)
    point_mass = _steps_to_within(model, (X, y), optimum, 0.4)
    assert rule is not None and point_mass is not None
    assert rule < point_mass, (rule, point_mass)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_warm_start_is_the_same_rule(dtype):
    """K = 3 softmax regression: per data point the target at the prior's logit covariance
    where its trace of -lam2 is smaller than the point mass's (the point-mass and prior
    targets recomputed here by the package's own cubature, the choice independently)."""
    from pyro_cvi.messages.softmax import lse_expectations, site_targets

    g = torch.Generator().manual_seed(0)
    N, D, K = 60, 3, 3
    X = torch.randn(N, D, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randint(0, K, (N,), generator=g)

    b = (X[:, 0] > 0).to(dtype)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(D, K), 0.7).to_event(2))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Categorical(logits=X @ w), obs=y)
            # a second likelihood factor: softmax factors alone start at the Laplace
            # approximation instead (tests/test_softmax_start.py)
            pyro.sample("b", dist.Bernoulli(logits=(X @ w)[:, 0]), obs=b)

    AutoCVI(model)(X, y)
    sites = _sites().double()
    X64 = X.double()
    Y = torch.nn.functional.one_hot(y, K).double()
    C = torch.eye(K, dtype=torch.float64) - 1.0 / K  # centred logits: eta_c = C W^T x
    cov_pr = 0.49 * (X64**2).sum(1)[:, None, None] * (C @ C.T)
    cov_pm = 5e-5 * torch.eye(K, dtype=torch.float64).expand(N, K, K)
    mean = torch.zeros(N, K, dtype=torch.float64)
    one, n = torch.ones(N, dtype=torch.float64), torch.ones(N, dtype=torch.float64)

    def target(cov):
        _, l1, l2 = site_targets(Y, n, one, mean, lse_expectations(mean, cov, "cubature"))
        return torch.cat([l1.unsqueeze(-1), l2], -1)

    t_pm, t_pr = target(cov_pm), target(cov_pr)
    tr = lambda t: torch.diagonal(t[..., 1:], dim1=-2, dim2=-1).sum(-1).abs()  # noqa: E731
    pick = tr(t_pr) < tr(t_pm)
    assert pick.any()
    want = torch.where(pick[:, None, None], t_pr, t_pm)
    tol = 1e-4 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(sites, want, rtol=tol, atol=tol)


def _laplace_neg_elbo(X, y, s0):
    """-ELBO of the Laplace approximation ``N(m*, H^-1)`` of a Poisson regression
    ``y ~ Poisson(exp(X w))``, ``w ~ N(0, s0^2 I)``, in float64: the mode by Newton's method
    with backtracking, then the closed form ``E[exp(x^T w)] = exp(x^T m + x^T S x / 2)``."""
    X, y = X.double(), y.double()
    D = X.shape[1]

    def log_joint(w):
        return (y * (X @ w) - torch.exp(X @ w)).sum() - 0.5 * (w @ w) / s0**2

    w = torch.zeros(D, dtype=torch.float64)
    for _ in range(200):
        rate = torch.exp(X @ w)
        g = X.T @ (y - rate) - w / s0**2
        H = X.T @ (rate[:, None] * X) + torch.eye(D, dtype=torch.float64) / s0**2
        step, t = torch.linalg.solve(H, g), 1.0
        while log_joint(w + t * step) < log_joint(w):
            t /= 2
        w = w + t * step
        if float(g.abs().max()) < 1e-10:
            break
    rate = torch.exp(X @ w)
    S = torch.linalg.inv(X.T @ (rate[:, None] * X) + torch.eye(D, dtype=torch.float64) / s0**2)
    eta_m, eta_v = X @ w, ((X @ S) * X).sum(-1)
    like = (y * eta_m - torch.exp(eta_m + eta_v / 2) - torch.lgamma(y + 1)).sum()
    kl = 0.5 * (torch.trace(S) / s0**2 + (w @ w) / s0**2 - D + D * math.log(s0**2))
    kl = kl - 0.5 * torch.logdet(S)
    return float(kl - like)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_newton_step_that_overshoots_becomes_the_laplace_start(dtype):
    """Counts in the hundreds under a vague prior (sd 10): one Newton step from the prior
    mean overshoots (``exp(X w)`` of 1e40), so the sites start at the mode of the log joint
    (damped Newton): the first loss is the -ELBO of the Laplace approximation, computed
    independently, and CVI() improves on it from there."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(50, 3, generator=g, dtype=torch.float64)
    y = torch.poisson(torch.exp(X @ torch.full((3,), 1.5, dtype=torch.float64)), generator=g)
    s0 = 10.0

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(3), s0).to_event(1))
        with pyro.plate("data", 50):
            pyro.sample("y", dist.Poisson(torch.exp(X @ w)), obs=y)

    pyro.clear_param_store()
    svi = SVI(model, AutoCVI(model), CVI(), loss=CVI_ELBO())
    X, y = X.to(dtype), y.to(dtype)
    losses = [svi.step(X, y) for _ in range(10)]
    reference = _laplace_neg_elbo(X, y, s0)
    assert losses[0] == pytest.approx(reference, rel=1e-4 if dtype == torch.float32 else 1e-6)
    assert min(losses) <= losses[0] + 1e-6 and max(losses) <= losses[0] * (1 + 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["bernoulli", "poisson", "binomial"])
def test_the_laplace_start_reads_the_likelihood_at_a_point(dtype, family):
    """The Laplace start's log joint reads each factor at a point, once: the sum of the site's
    weighted ``log_prob`` at ``eta = f + c`` (computed here with the distribution itself, a
    mask and a scale included), and what the zero-variance quadrature gave."""
    from pyro_cvi.messages.gaussian import (
        RowBlock,
        linear_predictor_point_value,
        linear_predictor_value,
    )

    g = torch.Generator().manual_seed(1)
    N, D = 40, 3
    X = torch.randn(N, D, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(D, generator=g, dtype=torch.float64).to(dtype)
    c = 0.3 * torch.randn(N, generator=g, dtype=torch.float64).to(dtype)
    mask = torch.arange(N) % 5 != 0
    make = {
        "bernoulli": lambda eta: dist.Bernoulli(logits=eta),
        "poisson": lambda eta: dist.Poisson(torch.exp(eta)),
        "binomial": lambda eta: dist.Binomial(total_count=7, logits=eta),
    }[family]
    y = make(X @ w + c).sample()

    def model():
        with pyro.plate("data", N), pyro.poutine.scale(scale=2.5), pyro.poutine.mask(mask=mask):
            pyro.sample("y", make(X @ w + c), obs=y)

    site = pyro.poutine.trace(model).get_trace().nodes["y"]
    zero = torch.zeros(N, dtype=dtype)
    rows = RowBlock(X, zero, zero, c)
    m = 0.5 * torch.randn(D, generator=g, dtype=torch.float64).to(dtype)
    f = X @ m
    expected = 2.5 * (make(f + c).log_prob(y) * mask).sum()
    got = linear_predictor_point_value(site, rows, f)
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    assert float(got) == pytest.approx(float(expected), rel=rtol)
    quad = linear_predictor_value(site, rows, f, torch.zeros_like(f))
    assert float(got) == pytest.approx(float(quad), rel=rtol)
