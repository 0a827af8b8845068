"""A Normal factor with a discrete parent in its loc sends a Gaussian block its exact expected
message (eq. 20): rows per enumerated value weighted by ``q`` of the value
(:mod:`pyro_cvi.messages.enumerated`). The fixed point is a brute-force CAVI loop's (closed
form), and the reported bound is Trace_ELBO's for the same guide."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.ops.indexing import Vindex

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

Y = [0.3, 1.2, 2.1, -0.4, 0.9, 3.0, 2.6, -1.1]
#: three clusters: the mixture's fixed point separates them
Y3 = [-5.0, -4.6, -5.3, 0.2, -0.3, 0.4, 5.1, 4.7, 5.5]
DTYPES = [torch.float64, torch.float32]
TOL = {torch.float64: 1e-6, torch.float32: 2e-4}


def _fit(model, y, steps):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model, schedule="sequential")
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    losses = [svi.step(y) for _ in range(steps)]
    return guide, losses


def _trace_elbo(model, guide, y, batches=20, particles=500):
    """Trace_ELBO of the guide: the mean and standard error of ``batches`` estimates of
    ``particles`` vectorised draws each."""
    pyro.set_rng_seed(1)
    elbo = Trace_ELBO(num_particles=particles, vectorize_particles=True, max_plate_nesting=1)
    est = torch.tensor([-elbo.loss(model, guide, y) for _ in range(batches)], dtype=torch.float64)
    return float(est.mean()), float(est.std() / batches**0.5)


# ---------------------------------------------------------------- a global indicator: mu + s
def _shift(y):
    mu = pyro.sample("mu", dist.Normal(y.new_zeros(()), 2.0))
    s = pyro.sample("s", dist.Bernoulli(y.new_tensor(0.4)))
    with pyro.plate("n", len(y)):
        pyro.sample("y", dist.Normal(mu + s, 1.0), obs=y)


def _cavi_shift(y, iters=500):
    N, r = len(y), torch.tensor(0.5, dtype=y.dtype)
    prec = 0.25 + N
    for _ in range(iters):
        m = (y - r).sum() / prec
        logit = torch.logit(y.new_tensor(0.4)) + (0.5 * (y - m) ** 2 - 0.5 * (y - m - 1) ** 2).sum()
        r = torch.sigmoid(logit)
    return m, 1 / prec, r


# ---------------------------------------------------------------- locs[s] (a Gaussian mixture)
K = 3


def _mixture(y):
    locs = pyro.sample("locs", dist.Normal(y.new_zeros(K), 2.0).to_event(1))
    w = pyro.sample("w", dist.Dirichlet(y.new_ones(K)))
    with pyro.plate("n", len(y)):
        s = pyro.sample("s", dist.Categorical(w))
        pyro.sample("y", dist.Normal(locs[s], 1.0), obs=y)


def _mixture_vindex(y):
    """The same model with ``Vindex`` (it broadcasts over Trace_ELBO's particle dim)."""
    locs = pyro.sample("locs", dist.Normal(y.new_zeros(K), 2.0).to_event(1))
    w = pyro.sample("w", dist.Dirichlet(y.new_ones(K)))
    with pyro.plate("n", len(y)):
        s = pyro.sample("s", dist.Categorical(w))
        pyro.sample("y", dist.Normal(Vindex(locs)[..., s], 1.0), obs=y)


def _cavi_mixture(y, phi, iters=3000):
    for _ in range(iters):
        prec = 0.25 + phi.sum(0)
        m = (phi * y[:, None]).sum(0) / prec
        v = 1 / prec
        alpha = 1 + phi.sum(0)
        elog_w = torch.digamma(alpha) - torch.digamma(alpha.sum())
        logits = elog_w - 0.5 * ((y[:, None] - m) ** 2 + v)
        phi = torch.softmax(logits, -1)
    return m, v, alpha, phi


# ---------------------------------------------------------------- an indicator times a coefficient
def _coefficient(y):
    mu = pyro.sample("mu", dist.Normal(y.new_zeros(()), 2.0))
    beta = pyro.sample("beta", dist.Normal(y.new_zeros(()), 2.0))
    with pyro.plate("n", len(y)):
        s = pyro.sample("s", dist.Bernoulli(y.new_full((len(y),), 0.4)))
        pyro.sample("y", dist.Normal(mu + beta * s, 1.0), obs=y)


def _cavi_coefficient(y, r, iters=3000):
    """Mean field q(mu) q(beta) prod q(s_n), as AutoCVI's blocks (one per Gaussian latent)."""
    N, mb, vb = len(y), y.new_tensor(0.0), y.new_tensor(4.0)
    for _ in range(iters):
        pm = 0.25 + N
        mm, vm = (y - mb * r).sum() / pm, 1 / pm
        pb = 0.25 + r.sum()
        mb, vb = (r * (y - mm)).sum() / pb, 1 / pb
        gain = -0.5 * ((y - mm - mb) ** 2 + vb - (y - mm) ** 2)
        r = torch.sigmoid(torch.logit(y.new_tensor(0.4)) + gain)
    return mm, vm, mb, vb, r


def _assert_bound(model, guide, y, losses, **kw):
    mean, se = _trace_elbo(model, guide, y, **kw)
    floor = (1e-6 if y.dtype == torch.float64 else 1e-5) * max(1.0, abs(mean))  # (rounding)
    assert abs(-losses[-1] - mean) < 3 * se + floor, (-losses[-1], mean, se)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_global_indicator_in_the_loc_reaches_the_cavi_fixed_point(dtype):
    y = torch.tensor(Y, dtype=dtype)
    guide, losses = _fit(_shift, y, 30)
    assert "conjugate (enumerated)" in guide.explain()
    assert "sites from -" in guide.explain().split("# block mu:")[1]
    m, v, r = _cavi_shift(y.double())
    tol = TOL[dtype]
    q = guide.posterior("mu")
    assert float(q.loc) == pytest.approx(float(m), abs=tol)
    assert float(q.scale**2) == pytest.approx(float(v), abs=tol)
    assert float(guide.posterior("s").probs) == pytest.approx(float(r), abs=tol)
    assert all(l1 <= l0 + 1e-6 * abs(l0) for l0, l1 in zip(losses, losses[1:]))
    _assert_bound(_shift, guide, y, losses)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_index_into_a_vector_of_means_reaches_the_cavi_fixed_point(dtype):
    y = torch.tensor(Y3, dtype=dtype)
    guide, losses = _fit(_mixture, y, 40)
    assert "y -> locs         conjugate (enumerated)" in guide.explain()
    phi = guide.posterior("s").probs.detach().double()
    # the CAVI loop started from AutoCVI's responsibilities: the same fixed point (a mixture
    # has several; the test is that AutoCVI stands at one)
    m, v, alpha, phi_cavi = _cavi_mixture(y.double(), phi)
    tol = TOL[dtype]
    q = guide.posterior("locs")
    assert torch.allclose(q.loc.double(), m, atol=tol)
    assert torch.allclose(q.covariance_matrix.double().diagonal(), v, atol=tol)
    assert torch.allclose(guide.posterior("w").concentration.double(), alpha, atol=10 * tol)
    assert torch.allclose(phi, phi_cavi, atol=tol)
    _assert_bound(_mixture_vindex, guide, y, losses)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_indicator_times_a_coefficient_reaches_the_cavi_fixed_point(dtype):
    y = torch.tensor(Y, dtype=dtype)
    guide, losses = _fit(_coefficient, y, 120)
    text = guide.explain()
    assert "y -> mu           conjugate (enumerated)" in text
    assert "y -> beta         conjugate (enumerated)" in text
    r = guide.posterior("s").probs.detach().double()
    mm, vm, mb, vb, r_cavi = _cavi_coefficient(y.double(), r)
    tol = TOL[dtype]
    assert float(guide.posterior("mu").loc) == pytest.approx(float(mm), abs=tol)
    assert float(guide.posterior("mu").scale ** 2) == pytest.approx(float(vm), abs=tol)
    assert float(guide.posterior("beta").loc) == pytest.approx(float(mb), abs=tol)
    assert float(guide.posterior("beta").scale ** 2) == pytest.approx(float(vb), abs=tol)
    assert torch.allclose(r, r_cavi, atol=tol)
    _assert_bound(_coefficient, guide, y, losses)


# ---------------------------------------------------------------- a discrete in a GLM predictor
X = [
    [1.0, 0.3],
    [1.0, -1.2],
    [1.0, 0.8],
    [1.0, 2.0],
    [1.0, -0.5],
    [1.0, 1.1],
    [1.0, 0.0],
    [1.0, -2.0],
]


def _glm(y):
    """A Normal regression whose predictor has a Bernoulli shift (``(x * w).sum(-1)``, not
    ``x @ w``: it broadcasts over Trace_ELBO's particle dim)."""
    x = y.new_tensor(X)
    w = pyro.sample("w", dist.Normal(y.new_zeros(2), 2.0).to_event(1))
    with pyro.plate("n", len(y)):
        s = pyro.sample("s", dist.Bernoulli(y.new_full((len(y),), 0.4)))
        pyro.sample("y", dist.Normal((x * w).sum(-1) + 2.0 * s, 1.0), obs=y)


def _cavi_glm(y, iters=500):
    x = y.new_tensor(X)
    P = torch.eye(2, dtype=y.dtype) / 4 + x.T @ x
    r = torch.full_like(y, 0.5)
    for _ in range(iters):
        m = torch.linalg.solve(P, x.T @ (y - 2.0 * r))
        f = x @ m
        r = torch.sigmoid(torch.logit(y.new_tensor(0.4)) - 0.5 * ((y - f - 2) ** 2 - (y - f) ** 2))
    return m, torch.linalg.inv(P), r


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_discrete_in_a_glm_predictor_reaches_the_cavi_fixed_point(dtype):
    y = torch.tensor(Y, dtype=dtype)
    guide, losses = _fit(_glm, y, 30)
    assert "y -> w            conjugate (enumerated)" in guide.explain()
    m, S, r = _cavi_glm(y.double())
    tol = TOL[dtype]
    q = guide.posterior("w")
    assert torch.allclose(q.loc.double(), m, atol=tol)
    assert torch.allclose(q.covariance_matrix.double(), S, atol=tol)
    assert torch.allclose(guide.posterior("s").probs.double(), r, atol=tol)
    assert all(l1 <= l0 + 1e-6 * abs(l0) for l0, l1 in zip(losses, losses[1:]))
    _assert_bound(_glm, guide, y, losses)


# ---------------------------------------------------------------- a random walk (to_event) + s
T_WALK = 12


def _walk(y):
    s = pyro.sample("s", dist.Bernoulli(y.new_tensor(0.4)))
    inc = pyro.sample("inc", dist.Normal(y.new_zeros(T_WALK), 1.0).to_event(1))
    pyro.sample("y", dist.Normal(inc.cumsum(-1) + s.unsqueeze(-1), 0.5).to_event(1), obs=y)


def _cavi_walk(y, r, iters=500):
    L = torch.tril(torch.ones(T_WALK, T_WALK, dtype=y.dtype))
    P = torch.eye(T_WALK, dtype=y.dtype) + 4 * L.T @ L
    for _ in range(iters):
        m = torch.linalg.solve(P, 4 * L.T @ (y - r))
        f = L @ m
        gain = -2.0 * ((y - f - 1) ** 2 - (y - f) ** 2).sum()
        r = torch.sigmoid(torch.logit(y.new_tensor(0.4)) + gain)
    return m, torch.linalg.inv(P), r


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_random_walk_observed_with_a_discrete_shift_is_an_exact_block(dtype):
    """(The factor is ``to_event``: q(s) weighs whole rows of the event.)"""
    g = torch.Generator().manual_seed(3)
    y = (torch.randn(T_WALK, generator=g, dtype=torch.float64).cumsum(0) + 0.7).to(dtype)
    guide, losses = _fit(_walk, y, 30)
    assert "y -> inc          conjugate (enumerated)" in guide.explain()
    # (s and inc[0] trade off: the loop starts from AutoCVI's q(s), at the same fixed point)
    m, S, r = _cavi_walk(y.double(), guide.posterior("s").probs.detach().double())
    tol = TOL[dtype]
    q = guide.posterior("inc")
    assert torch.allclose(q.loc.double(), m, atol=tol)
    assert torch.allclose(q.covariance_matrix.double(), S, atol=tol)
    assert float(guide.posterior("s").probs) == pytest.approx(float(r), abs=tol)
    _assert_bound(_walk, guide, y, losses)
