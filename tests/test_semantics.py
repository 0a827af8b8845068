"""AutoCVI's objective is Trace_ELBO's for the same model and guide, whatever handlers and
primitives the model uses.

Trace_ELBO multiplies every *model* log-density by its site's scale and mask
(``poutine.scale``, ``poutine.mask``, ``MaskedDistribution``, ``pyro.factor``), latent priors
included, and leaves the guide's ``log q`` alone. With prior weights ``c_p`` and likelihood
weights ``c_n`` the ELBO of a conjugate model is then maximised by

    q(z) = p(z)^(c_p) prod_n p(y_n | z)^(c_n) / Z,      where  ELBO(q) = log Z,

a tempered posterior. The models below are built from pieces (how the weight is written, the
latent's shape, the likelihood's form) and every combination is checked in float64 and
float32: q's moments against the closed form and the loss against ``-log Z``; where q cannot be
the exact tempered posterior (a mean-field ``q``), the loss against a Trace_ELBO estimate of the
same guide.
"""

import math
from contextlib import nullcontext

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.nn import PyroModule, PyroSample

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

F64, F32 = torch.float64, torch.float32
DTYPES = [F64, F32]
N, D, SIGMA = 12, 3, 0.7


def _tol(dtype):
    return 1e-6 if dtype == F64 else 2e-3


def _fit(model, args, steps=3, **kw):
    pyro.clear_param_store()
    guide = AutoCVI(model, **kw)
    svi = SVI(model, guide, CVI(step_size=1.0), CVI_ELBO())
    for _ in range(steps):
        svi.step(*args)
    return guide, svi


def _data(dtype, n=N, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=F64)
    y = X @ torch.linspace(-1.0, 2.0, d, dtype=F64) + SIGMA * torch.randn(n, generator=g, dtype=F64)
    return X.to(dtype), y.to(dtype)


def tempered_regression(X, y, cp, cl, prior_scale=1.0):
    """``(mean, cov, log Z)`` of ``N(w | 0, prior_scale^2)^cp prod_n N(y_n | x_n w, s)^cl_n``
    (``cp`` per coordinate, ``cl`` per data point; zeros allowed), in float64."""
    X, y = X.double(), y.double()
    d = X.shape[1]
    cp = torch.as_tensor(cp, dtype=F64).expand(d)
    cl = torch.as_tensor(cl, dtype=F64).expand(len(y))
    v0 = prior_scale**2
    P = torch.diag(cp / v0) + X.T @ (cl[:, None] * X) / SIGMA**2
    b = X.T @ (cl * y) / SIGMA**2
    cov = torch.linalg.inv(P)
    mean = cov @ b
    k = (-0.5 * cp * math.log(2 * math.pi * v0)).sum()
    k = k + (cl * (-0.5 * math.log(2 * math.pi * SIGMA**2) - 0.5 * y**2 / SIGMA**2)).sum()
    log_z = k + 0.5 * b @ mean + 0.5 * d * math.log(2 * math.pi) - 0.5 * torch.logdet(P)
    return mean, cov, float(log_z)


# ------------------------------------------------------------------------------------------------
# how a prior weight and a likelihood weight are written: each returns (model, cp, cl)
# ------------------------------------------------------------------------------------------------
def _likelihood(X, y, w):
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(X @ w, SIGMA), obs=y)


def _prior(X):
    return pyro.sample("w", dist.Normal(X.new_zeros(D), 1.0).to_event(1))


def scale_around_model(X, y):
    def model(X, y):
        _likelihood(X, y, _prior(X))

    return poutine.scale(model, scale=0.5), 0.5, 0.5


def scale_around_prior(X, y):
    def model(X, y):
        with poutine.scale(scale=0.3):
            w = _prior(X)
        _likelihood(X, y, w)

    return model, 0.3, 1.0


def scale_around_likelihood(X, y):
    def model(X, y):
        w = _prior(X)
        with poutine.scale(scale=0.25):
            _likelihood(X, y, w)

    return model, 1.0, 0.25


def tensor_scale_on_data(X, y):
    cl = torch.linspace(0.2, 2.0, len(y), dtype=X.dtype)

    def model(X, y):
        w = _prior(X)
        with pyro.plate("data", len(y)), poutine.scale(scale=cl):
            pyro.sample("obs", dist.Normal(X @ w, SIGMA), obs=y)

    return model, 1.0, cl


def mask_on_data(X, y):
    keep = torch.arange(len(y)) % 3 != 0

    def model(X, y):
        w = _prior(X)
        with pyro.plate("data", len(y)), poutine.mask(mask=keep):
            pyro.sample("obs", dist.Normal(X @ w, SIGMA), obs=y)

    return model, 1.0, keep.double()


def obs_mask(X, y):
    keep = torch.arange(len(y)) % 4 != 0

    def model(X, y):
        w = _prior(X)
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal(X @ w, SIGMA), obs=y, obs_mask=keep)

    return model, 1.0, keep.double()


def masked_distribution_prior(X, y):
    keep = torch.tensor([True, False, True])

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(D), 1.0).mask(keep).to_event(1))
        _likelihood(X, y, w)

    return model, keep.double(), 1.0


def scaled_mvn_prior(X, y):
    def model(X, y):
        with poutine.scale(scale=0.4):
            w = pyro.sample("w", dist.MultivariateNormal(X.new_zeros(D), torch.eye(D).to(X)))
        _likelihood(X, y, w)

    return model, 0.4, 1.0


def factor_likelihood(X, y):
    def model(X, y):
        w = _prior(X)
        with pyro.plate("data", len(y)), poutine.scale(scale=0.5):
            pyro.factor("lik", dist.Normal(X @ w, SIGMA).log_prob(y))

    return model, 1.0, 0.5


def two_sites_one_scaled(X, y):
    """Two sites in one joint block, one of them tempered."""

    def model(X, y):
        with poutine.scale(scale=0.2):
            a = pyro.sample("a", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
        b = pyro.sample("b", dist.Normal(X.new_zeros(()), 1.0))
        _likelihood(X, y, torch.cat([a, b.unsqueeze(0)]))

    return model, torch.tensor([0.2, 0.2, 1.0]), 1.0


WEIGHTS = [
    scale_around_model,
    scale_around_prior,
    scale_around_likelihood,
    tensor_scale_on_data,
    mask_on_data,
    obs_mask,
    masked_distribution_prior,
    scaled_mvn_prior,
    factor_likelihood,
    two_sites_one_scaled,
]


def _joint(guide, names):
    q = guide.joint_posterior(*names) if len(names) > 1 else guide.posterior(names[0])
    mean = q.mean.reshape(-1)
    cov = q.covariance_matrix if mean.numel() > 1 else q.variance.reshape(1, 1)
    return mean, cov


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("build", WEIGHTS, ids=lambda f: f.__name__)
def test_weighted_regression_is_the_tempered_posterior(build, dtype):
    """q is the tempered posterior and the loss is -log Z (the ELBO at it), to 1e-6 in
    float64."""
    X, y = _data(dtype)
    model, cp, cl = build(X, y)
    guide, svi = _fit(model, (X, y))
    names = ["a", "b"] if build is two_sites_one_scaled else ["w"]
    mean, cov = _joint(guide, names)
    m, V, log_z = tempered_regression(X, y, cp, cl)
    tol = _tol(dtype)
    assert torch.allclose(mean.double(), m, atol=tol, rtol=tol), (mean, m)
    assert torch.allclose(cov.double(), V, atol=tol, rtol=tol), (cov, V)
    assert_loss(svi, (X, y), -log_z, tol)


def assert_loss(svi, args, expected, tol, z=4.0):
    """The reported loss equals ``expected``: exactly where it is a closed form (two calls agree
    bitwise), else (Monte Carlo terms, e.g. a ``pyro.factor``) its mean over 40 calls within
    ``z`` standard errors."""
    first = svi.evaluate_loss(*args)
    if svi.evaluate_loss(*args) == first:
        assert first == pytest.approx(expected, abs=tol * 10, rel=tol)
        return
    v = torch.tensor([first] + [svi.evaluate_loss(*args) for _ in range(39)], dtype=F64)
    se = float(v.std()) / math.sqrt(len(v))
    assert abs(float(v.mean()) - expected) <= z * se + tol * abs(expected), (v.mean(), se)


# ------------------------------------------------------------------------------------------------
# every summary of q agrees, for every latent shape
# ------------------------------------------------------------------------------------------------
class _Inner(PyroModule):
    def __init__(self, dtype):
        super().__init__()
        zero = torch.zeros((), dtype=dtype)
        self.weight = PyroSample(dist.Normal(zero, 1.0).expand([1, 2]).to_event(2))
        self.bias = PyroSample(dist.Normal(zero, 1.0).expand([1]).to_event(1))

    def forward(self, x):
        return x @ self.weight.reshape(2) + self.bias.reshape(())


class _Middle(PyroModule):
    def __init__(self, dtype):
        super().__init__()
        self.inner = _Inner(dtype)


class _ShapesModel(PyroModule):
    """Latents of event dims 0..3, plated batch shapes, positive and unit-interval supports and
    ``PyroSample`` parameters two modules deep (sites ``middle.inner.weight`` / ``.bias``)."""

    def __init__(self, dtype, noise):
        super().__init__()
        self.middle = _Middle(dtype)
        self.noise = noise

    def forward(self, x, y):
        z = x.new_zeros
        a = pyro.sample("a", dist.Normal(z(()), 1.0))
        b = pyro.sample("b", dist.Normal(z(2), 1.0).to_event(1))
        c = pyro.sample("c", dist.Normal(z(2, 2), 1.0).to_event(2))
        d = pyro.sample("d", dist.Normal(z(2, 1, 2), 1.0).to_event(3))
        with pyro.plate("p", 3):
            e = pyro.sample("e", dist.Normal(z(()), 1.0))
            f = pyro.sample("f", dist.Normal(z(2), 1.0).to_event(1))
        s = pyro.sample("s", dist.Gamma(z(()) + 2.0, 2.0))
        r = pyro.sample("r", dist.Beta(z(()) + 2.0, 2.0))
        mu = a + b.sum() + c.sum() + d.sum() + e.sum() + f.sum() + r
        mu = mu + self.middle.inner(x)
        with pyro.plate("data", len(y)):
            if self.noise == "latent":  # s and r in the likelihood: the remainder's joint q
                pyro.sample("obs", dist.Normal(mu, s), obs=y)
            else:  # conjugate: Gaussian blocks, a Gamma and a Beta q
                pyro.sample("obs", dist.Normal(mu, SIGMA), obs=y)
                pyro.sample("count", dist.Poisson(s), obs=(y.abs() * 3).floor())
                pyro.sample("flip", dist.Bernoulli(r), obs=(y > 0).to(y))


@pytest.mark.parametrize("noise", ["fixed", "latent"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_every_summary_agrees_for_every_latent_shape(dtype, noise):
    """``posterior``, ``median``, ``quantiles``, ``get_posterior``, ``sample_latent``, the
    guide's draws and ``Predictive`` describe the same q, site by site."""
    X, y = _data(dtype, n=15, d=2)
    model = _ShapesModel(dtype, noise)
    guide, svi = _fit(model, (X, y), steps=4)
    tr = poutine.trace(model).get_trace(X, y)
    med = guide.median(X, y)
    qs = guide.quantiles([0.25, 0.5, 0.75], X, y)
    packed = guide.get_posterior(X, y)
    draw = guide(X, y)
    S = 1000
    pred = Predictive(model, guide=guide, num_samples=S, return_sites=list(med))(X, y)
    tol = _tol(dtype)
    assert set(med) == set(tr.stochastic_nodes) - {"p", "data"}
    assert "middle.inner.weight" in med
    for name, m in med.items():
        shape = tr.nodes[name]["value"].shape
        q = guide.posterior(name)
        sd = q.variance.reshape(shape).sqrt()
        assert m.shape == shape and draw[name].shape == shape, name
        assert qs[name].shape == (3,) + shape, name
        assert torch.allclose(qs[name][1], m, atol=tol, rtol=tol), name
        assert bool((qs[name][0] < m).all() and (m < qs[name][2]).all()), name
        samples = pred[name].reshape((S,) + shape)
        zscore = (samples.mean(0) - q.mean.reshape(shape)) / (sd / math.sqrt(S))
        assert float(zscore.abs().max()) < 5.0, (name, zscore)
        u = packed.mean[packed.slices[name]]
        if isinstance(q, (dist.Gamma, torch.distributions.Gamma)):  # E log z, closed form
            expect = torch.digamma(q.concentration) - torch.log(q.rate)
            assert torch.allclose(u, expect.reshape(-1), atol=tol, rtol=tol), name
            continue
        if isinstance(q, (dist.Beta, torch.distributions.Beta)):  # E logit z
            expect = torch.digamma(q.concentration1) - torch.digamma(q.concentration0)
            assert torch.allclose(u, expect.reshape(-1), atol=tol, rtol=tol), name
            continue
        if name in ("s", "r"):  # a Gaussian on log s / logit r
            base = q.base_dist
            assert torch.allclose(u, base.mean.reshape(-1), atol=tol, rtol=tol), name
            assert torch.allclose(m, q.transforms[-1](base.mean).reshape(shape), atol=tol), name
            continue
        # a Gaussian q: median and mean agree, quantiles are median +- 0.6745 sd
        assert torch.allclose(m, q.mean.reshape(shape), atol=tol, rtol=tol), name
        half = 0.5 * (qs[name][2] - qs[name][0])
        assert torch.allclose(half, 0.6744897501960817 * sd, atol=tol, rtol=10 * tol), name
        assert torch.allclose(u, q.mean.reshape(-1), atol=tol, rtol=tol), name
        var = packed.variance[packed.slices[name]]
        assert torch.allclose(var, q.variance.reshape(-1), atol=tol, rtol=10 * tol), name
    assert guide.sample_latent(X, y).shape == packed.mean.shape


# ------------------------------------------------------------------------------------------------
# weighted members of linear-Gaussian trees and chains
# ------------------------------------------------------------------------------------------------
def tempered_gaussian(A, t, var, c):
    """``(mean, cov, log Z)`` of ``prod_r N(t_r | A_r z, var_r)^(c_r)`` over ``z`` (float64):
    every density of a linear-Gaussian model as a row, prior rows included."""
    A, t, var, c = (torch.as_tensor(v, dtype=F64) for v in (A, t, var, c))
    P = A.T @ ((c / var)[:, None] * A)
    b = A.T @ (c * t / var)
    cov = torch.linalg.inv(P)
    mean = cov @ b
    k = (c * (-0.5 * torch.log(2 * math.pi * var) - 0.5 * t**2 / var)).sum()
    log_z = k + 0.5 * b @ mean + 0.5 * len(b) * math.log(2 * math.pi) - 0.5 * torch.logdet(P)
    return mean, cov, float(log_z)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_tempered_member_of_a_tree(dtype):
    """``theta_j ~ N(mu, 1)`` under ``poutine.scale(0.5)`` joins ``mu``'s block (a tree): q is
    the tempered joint posterior, the loss ``-log Z``."""
    J = 4
    y = torch.tensor([1.5, -0.3, 0.8, 2.2], dtype=dtype)

    def model(y):
        mu = pyro.sample("mu", dist.Normal(y.new_zeros(()), 2.0))
        with pyro.plate("groups", J), poutine.scale(scale=0.5):
            theta = pyro.sample("theta", dist.Normal(mu, 1.0))
        with pyro.plate("obs_plate", J):
            pyro.sample("y", dist.Normal(theta, 0.5), obs=y)

    guide, svi = _fit(model, (y,))
    eye = torch.eye(J + 1, dtype=F64)
    A = torch.cat([eye[:1], eye[1:] - eye[:1], eye[1:]])
    t = torch.cat([torch.zeros(1 + J, dtype=F64), y.double()])
    var = torch.tensor([4.0] + [1.0] * J + [0.25] * J, dtype=F64)
    c = torch.tensor([1.0] + [0.5] * J + [1.0] * J, dtype=F64)
    m, V, log_z = tempered_gaussian(A, t, var, c)
    q = guide.joint_posterior("mu", "theta")
    tol = _tol(dtype)
    assert torch.allclose(q.mean.double(), m, atol=tol, rtol=tol)
    assert torch.allclose(q.covariance_matrix.double(), V, atol=tol, rtol=tol)
    assert_loss(svi, (y,), -log_z, tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_tempered_transition_of_a_chain(dtype):
    """A ``pyro.markov`` local-level chain with one transition under ``poutine.scale`` and one
    masked out: q is the tempered joint posterior (the Kalman block reads densities unweighted,
    so such a chain is solved as a joint Gaussian), the loss ``-log Z``."""
    T, Q, R = 6, 0.5, 0.3
    y = torch.tensor([0.3, 0.9, 1.4, 0.2, -0.5, 0.1], dtype=dtype)
    weights = {2: 0.4, 4: 0.0}

    def model(y):
        x = pyro.sample("x_0", dist.Normal(y.new_zeros(()), 1.0))
        pyro.sample("y_0", dist.Normal(x, R**0.5), obs=y[0])
        for t in pyro.markov(range(1, T)):
            w = weights.get(t, 1.0)
            with poutine.scale(scale=w) if w else poutine.mask(mask=False):
                x = pyro.sample(f"x_{t}", dist.Normal(0.9 * x, Q**0.5))
            pyro.sample(f"y_{t}", dist.Normal(x, R**0.5), obs=y[t])

    guide, svi = _fit(model, (y,))
    eye = torch.eye(T, dtype=F64)
    A = torch.cat([eye[:1], eye[1:] - 0.9 * eye[:-1], eye])
    t = torch.cat([torch.zeros(T, dtype=F64), y.double()])
    var = torch.tensor([1.0] + [Q] * (T - 1) + [R] * T, dtype=F64)
    c = torch.tensor([1.0] + [weights.get(t, 1.0) for t in range(1, T)] + [1.0] * T, dtype=F64)
    m, V, log_z = tempered_gaussian(A, t, var, c)
    names = [f"x_{t}" for t in range(T)]
    q = guide.joint_posterior(*names)
    tol = _tol(dtype)
    assert torch.allclose(q.mean.double(), m, atol=tol, rtol=tol)
    assert torch.allclose(q.covariance_matrix.double(), V, atol=tol, rtol=tol)
    assert_loss(svi, (y,), -log_z, tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("form", ["scalar", "diagonal", "mvn"])
def test_tempered_transitions_stay_in_the_kalman_block(dtype, form):
    """Positive weights on a ``pyro.markov`` chain's start and transitions (``poutine.scale``,
    one per site; per element for a diagonal Normal): the chain keeps its Kalman block, which
    tempers each density (``N^c = N(S / c)`` times a constant); q is the tempered joint
    posterior and the loss ``-log Z`` (a brute-force joint Gaussian over every density)."""
    from pyro_cvi.blocks.markov import MarkovBlock

    T, Q, R, a = 7, 0.5, 0.3, 0.9
    d = 1 if form == "scalar" else 2
    g = torch.Generator().manual_seed(1)
    y = torch.randn(T, d, generator=g, dtype=F64).to(dtype)
    w = {0: 1.7, 2: 0.4, 3: 2.5, 5: 0.6}
    # a tensor weight with more elements than the site's batch (Trace_ELBO sums log p * weight:
    # a weight of 2.6 on the whole density)
    wide = torch.tensor([0.5, 2.1], dtype=F64)

    def model(y):
        x = None
        for t in pyro.markov(range(T)):
            loc = y.new_zeros(d) if x is None else a * x
            scale = 1.0 if x is None else Q**0.5
            if form == "mvn":
                cov = scale**2 * torch.tensor([[1.0, 0.3], [0.3, 1.0]], dtype=y.dtype)
                fn = dist.MultivariateNormal(loc, covariance_matrix=cov)
            else:
                fn = dist.Normal(loc, scale).to_event(1)
            c = w.get(t, 1.0)
            if form != "scalar" and t == 4:
                with poutine.scale(scale=wide.to(y.dtype)):
                    x = pyro.sample(f"x_{t}", fn)
            else:
                with poutine.scale(scale=c) if c != 1.0 else nullcontext():
                    x = pyro.sample(f"x_{t}", fn)
            pyro.sample(f"y_{t}", dist.Normal(x, R**0.5).to_event(1), obs=y[t])

    guide, svi = _fit(model, (y,))
    assert [type(b) for b in guide.engine.blocks] == [MarkovBlock]
    # the same posterior from every density as a row: z = (x_0, ..., x_{T-1}) flattened
    n = T * d
    base = torch.tensor([[1.0, 0.3], [0.3, 1.0]], dtype=F64) if form == "mvn" else torch.eye(d)
    rows, ts, covs, cs = [], [], [], []
    eye = torch.eye(n, dtype=F64)
    for t in range(T):
        sel = eye[t * d : (t + 1) * d]
        A = sel if t == 0 else sel - a * eye[(t - 1) * d : t * d]
        S = base * (1.0 if t == 0 else Q)
        c = torch.full((d,), w.get(t, 1.0), dtype=F64)
        if form != "scalar" and t == 4:
            c = torch.full((d,), float(wide.sum()), dtype=F64)
        rows.append(A), ts.append(torch.zeros(d, dtype=F64)), covs.append(S), cs.append(c)
    for t in range(T):
        rows.append(eye[t * d : (t + 1) * d]), ts.append(y[t].double())
        covs.append(R * torch.eye(d, dtype=F64)), cs.append(torch.ones(d, dtype=F64))
    # whiten each block of rows by its covariance, so that every row is an independent N(0, 1)
    A_w, t_w, c_w = [], [], []
    for A, t_, S, c in zip(rows, ts, covs, cs):
        L = torch.linalg.cholesky(S)
        A_w.append(torch.linalg.solve_triangular(L, A, upper=False))
        t_w.append(torch.linalg.solve_triangular(L, t_[:, None], upper=False)[:, 0])
        c_w.append(c)
    A_all, t_all, c_all = torch.cat(A_w), torch.cat(t_w), torch.cat(c_w)
    m, V, log_z = tempered_gaussian(A_all, t_all, torch.ones(len(t_all), dtype=F64), c_all)
    # the whitening's Jacobian: c log|L^-1| per block of rows (the row form has unit variances)
    log_z -= sum(float((c * torch.log(torch.diagonal(torch.linalg.cholesky(S)))).sum())
                 for S, c in zip(covs, cs))  # fmt: skip
    q = guide.joint_posterior(*[f"x_{t}" for t in range(T)])
    tol = _tol(dtype)
    assert torch.allclose(q.mean.double(), m, atol=tol, rtol=tol)
    assert torch.allclose(q.covariance_matrix.double(), V, atol=tol, rtol=tol)
    assert_loss(svi, (y,), -log_z, tol)


# ------------------------------------------------------------------------------------------------
# natural-parameter blocks: Beta, Gamma and the mean-field Gaussian
# ------------------------------------------------------------------------------------------------
A0, B0 = 2.0, 3.0
WEIGHT_PAIRS = [(1.0, 1.0), (0.5, 0.5), (0.5, 1.0), (1.0, 0.25)]


def _weighted(cp, cl, prior, likelihood):
    """``prior(y)`` with weight ``cp``, ``likelihood(z, y)`` with weight ``cl``: one
    ``poutine.scale`` around the whole model when they are equal (a tempered posterior as it
    is usually written), else one around each part inside it."""

    def inner(y):
        with poutine.scale(scale=cp) if cp != cl else nullcontext():
            z = prior(y)
        with pyro.plate("n", len(y)):
            with poutine.scale(scale=cl) if cp != cl else nullcontext():
                likelihood(z, y)

    return poutine.scale(inner, scale=cp) if cp == cl else inner


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("cp,cl", WEIGHT_PAIRS)
def test_tempered_beta_bernoulli(cp, cl, dtype):
    y = torch.tensor([1.0, 0, 1, 1, 0, 1, 1, 1, 0, 1], dtype=dtype)
    model = _weighted(
        cp,
        cl,
        lambda y: pyro.sample("p", dist.Beta(y.new_tensor(A0), B0)),
        lambda p, y: pyro.sample("y", dist.Bernoulli(p), obs=y),
    )
    guide, svi = _fit(model, (y,))
    k = float(y.sum())
    a, b = cp * (A0 - 1) + 1 + cl * k, cp * (B0 - 1) + 1 + cl * (len(y) - k)

    def log_beta(a, b):
        return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)

    log_z = -cp * log_beta(A0, B0) + log_beta(a, b)
    q = guide.posterior("p")
    tol = _tol(dtype)
    assert float(q.concentration1) == pytest.approx(a, rel=tol)
    assert float(q.concentration0) == pytest.approx(b, rel=tol)
    assert_loss(svi, (y,), -log_z, tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("cp,cl", WEIGHT_PAIRS)
def test_tempered_gamma_poisson(cp, cl, dtype):
    y = torch.tensor([3.0, 1, 4, 1, 5, 9, 2, 6], dtype=dtype)
    model = _weighted(
        cp,
        cl,
        lambda y: pyro.sample("r", dist.Gamma(y.new_tensor(A0), B0)),
        lambda r, y: pyro.sample("y", dist.Poisson(r), obs=y),
    )
    guide, svi = _fit(model, (y,))
    a, b = cp * (A0 - 1) + 1 + cl * float(y.sum()), cp * B0 + cl * len(y)
    log_z = cp * (A0 * math.log(B0) - math.lgamma(A0)) + math.lgamma(a) - a * math.log(b)
    log_z -= cl * float(torch.lgamma(y.double() + 1).sum())
    q = guide.posterior("r")
    tol = _tol(dtype)
    assert float(q.concentration) == pytest.approx(a, rel=tol)
    assert float(q.rate) == pytest.approx(b, rel=tol)
    assert_loss(svi, (y,), -log_z, tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_tempered_mean_field_gaussian(dtype):
    """A plated latent (mean-field Gaussian q) under ``poutine.scale`` with a masked element:
    the converged q's means are the tempered posterior's (the mean field keeps them exact for a
    Gaussian), its precisions ``c_i + (X^T X)_ii / s^2``, and the loss equals a 10,000-draw
    Trace_ELBO estimate of the same guide within 3 standard errors."""
    X, y = _data(dtype)
    keep = torch.tensor([True, False, True])

    def model(X, y):
        with pyro.plate("d", D), poutine.scale(scale=0.5), poutine.mask(mask=keep):
            w = pyro.sample("w", dist.Normal(X.new_zeros(()), 1.0))
        with pyro.plate("data", len(y)):  # (written to broadcast over vectorised particles)
            pyro.sample("obs", dist.Normal((X * w.unsqueeze(-2)).sum(-1), SIGMA), obs=y)

    guide, svi = _fit(model, (X, y), steps=60)
    cp = 0.5 * keep.double()
    m, _, _ = tempered_regression(X, y, cp, 1.0)
    q = guide.posterior("w")
    tol = _tol(dtype)
    assert torch.allclose(q.mean.double(), m, atol=10 * tol, rtol=10 * tol)
    prec = cp + (X.double() ** 2).sum(0) / SIGMA**2
    assert torch.allclose(q.variance.double(), 1 / prec, atol=tol, rtol=tol)
    loss = svi.evaluate_loss(X, y)
    elbo = Trace_ELBO(num_particles=1000, vectorize_particles=True, max_plate_nesting=1)
    v = torch.tensor([elbo.loss(model, guide, X, y) for _ in range(10)], dtype=F64)
    se = float(v.std()) / math.sqrt(len(v))
    assert abs(loss - float(v.mean())) <= 3 * se + tol * abs(loss), (loss, v.mean(), se)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_tempered_leaf(dtype):
    """A latent nothing depends on, under ``poutine.scale(0.5)``: its q is the tempered prior
    ``N(0, 2^2 / 0.5)`` (not the prior, the q of an unweighted leaf), and the loss adds
    ``-log int N(z | 0, 2^2)^0.5 dz``."""
    X, y = _data(dtype)

    def model(X, y):
        w = _prior(X)
        with poutine.scale(scale=0.5):
            pyro.sample("z", dist.Normal(X.new_zeros(()), 2.0))
        _likelihood(X, y, w)

    guide, svi = _fit(model, (X, y))
    q = guide.posterior("z")
    tol = _tol(dtype)
    assert float(q.mean) == pytest.approx(0.0, abs=tol)
    assert float(q.variance) == pytest.approx(8.0, rel=tol)
    _, _, log_z = tempered_regression(X, y, 1.0, 1.0)
    log_z += -0.25 * math.log(2 * math.pi * 4.0) + 0.5 * math.log(2 * math.pi * 8.0)
    assert_loss(svi, (X, y), -log_z, tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_gradient_of_a_tempered_prior_hyperparameter(dtype):
    """The loss's gradient in a learnable prior scale ``s0`` under ``poutine.scale(c)`` is
    Trace_ELBO's: ``d ELBO / d log s0 = c sum_i (E_q[w_i^2] / s0^2 - 1)`` (at the fixed point,
    where q's own dependence on ``s0`` drops out)."""
    X, y = _data(dtype)
    c = 0.3

    def model(X, y):
        s0 = pyro.param("s0", X.new_tensor(1.5), constraint=dist.constraints.positive)
        with poutine.scale(scale=c):
            w = pyro.sample("w", dist.Normal(X.new_zeros(D), s0).to_event(1))
        _likelihood(X, y, w)

    guide, _ = _fit(model, (X, y))
    elbo = guide.elbo((X, y), {}, graph=True)
    raw = pyro.get_param_store().get_param("s0").unconstrained()
    (grad,) = torch.autograd.grad(elbo, raw)  # constraint positive: raw = log s0
    q = guide.posterior("w")
    s0 = float(pyro.param("s0").detach())
    expect = c * float(((q.variance + q.mean**2).detach() / s0**2 - 1).sum())
    assert float(grad) == pytest.approx(expect, rel=100 * _tol(dtype), abs=_tol(dtype))


def _conjugate_cases(dtype):
    X, y = _data(dtype)
    counts = torch.tensor([3.0, 1, 4, 1, 5, 9, 2, 6], dtype=dtype)
    flips = torch.tensor([1.0, 0, 1, 1, 0, 1, 1, 1, 0, 1], dtype=dtype)

    def regression(X, y):
        _likelihood(X, y, _prior(X))

    def plated_regression(X, y):
        with pyro.plate("d", D):
            w = pyro.sample("w", dist.Normal(X.new_zeros(()), 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal((X * w).sum(-1), SIGMA), obs=y)

    def beta_bernoulli(y):
        p = pyro.sample("p", dist.Beta(y.new_tensor(A0), B0))
        with pyro.plate("n", len(y)):
            pyro.sample("y", dist.Bernoulli(p), obs=y)

    def gamma_poisson(y):
        r = pyro.sample("r", dist.Gamma(y.new_tensor(A0), B0))
        with pyro.plate("n", len(y)):
            pyro.sample("y", dist.Poisson(r), obs=y)

    Xd, yd = X.double(), y.double()
    cov_y = Xd @ Xd.T + SIGMA**2 * torch.eye(len(y), dtype=F64)
    ev_reg = float(dist.MultivariateNormal(torch.zeros_like(yd), cov_y).log_prob(yd))
    k, n = float(flips.sum()), len(flips)
    ev_bb = (math.lgamma(A0 + k) + math.lgamma(B0 + n - k) - math.lgamma(A0 + B0 + n)) - (
        math.lgamma(A0) + math.lgamma(B0) - math.lgamma(A0 + B0)
    )
    a, b = A0 + float(counts.sum()), B0 + len(counts)
    ev_gp = A0 * math.log(B0) - math.lgamma(A0) + math.lgamma(a) - a * math.log(b)
    ev_gp -= float(torch.lgamma(counts.double() + 1).sum())
    return [
        (regression, (X, y), ev_reg),
        (plated_regression, (X, y), ev_reg),
        (beta_bernoulli, (flips,), ev_bb),
        (gamma_poisson, (counts,), ev_gp),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_loss_never_below_minus_log_evidence(dtype):
    """On conjugate models every reported loss along a damped fit is at least ``-log p(y)``
    (a bound), and reaches it where q can be the posterior."""
    tol = _tol(dtype)
    for model, args, log_ev in _conjugate_cases(dtype):
        pyro.clear_param_store()
        guide = AutoCVI(model)
        svi = SVI(model, guide, CVI(step_size=0.3), CVI_ELBO())
        losses = [svi.step(*args) for _ in range(8)]
        losses.append(svi.evaluate_loss(*args))
        assert min(losses) >= -log_ev - tol * abs(log_ev), (model.__name__, losses, -log_ev)
        if model.__name__ != "plated_regression":  # (a mean-field q stays above it)
            _, svi = _fit(model, args, steps=3)
            assert svi.evaluate_loss(*args) == pytest.approx(-log_ev, rel=tol, abs=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_event_dims_under_a_scale(k, dtype):
    """A coefficient latent of event shape ``(2,) * k`` under ``poutine.scale(0.5)`` around
    its prior: q is the tempered posterior over its flattened values, the loss ``-log Z``."""
    shape = (2,) * k
    n = 2**k
    X, y = _data(dtype, d=n, seed=k)

    def model(X, y):
        with poutine.scale(scale=0.5):
            w = pyro.sample("w", dist.Normal(X.new_zeros(shape), 1.0).to_event(k))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal(X @ w.reshape(n), SIGMA), obs=y)

    guide, svi = _fit(model, (X, y))
    q = guide.posterior("w")
    m, V, log_z = tempered_regression(X, y, 0.5, 1.0)
    tol = _tol(dtype)
    assert q.mean.shape == shape
    assert torch.allclose(q.mean.reshape(-1).double(), m, atol=tol, rtol=tol)
    var = q.variance.reshape(-1).double()
    assert torch.allclose(var, V.diagonal(), atol=tol, rtol=tol)
    if k:
        mean, cov = _joint(guide, ["w"])
        assert torch.allclose(cov.double(), V, atol=tol, rtol=tol)
    assert_loss(svi, (X, y), -log_z, tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_a_discrete_latent_first_in_the_model(dtype):
    """The model's first latent is a Categorical (an integer value): the guide's own counters
    take the data's floating dtype (no raw "only floating point tensors can require gradients"
    at set-up), and the loss it reports is the bound of its q (Trace_ELBO of the same guide,
    within 3 standard errors)."""
    y = torch.tensor([0.9, 1.7, 0.2, 1.1, 1.4], dtype=dtype)

    def model(y):
        k = pyro.sample("k", dist.Categorical(logits=y.new_zeros(3)))
        mu = pyro.sample("mu", dist.Normal(y.new_zeros(()), 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal(mu + 0.5 * k.to(y.dtype), 1.0), obs=y)

    pyro.set_rng_seed(0)
    guide, svi = _fit(model, (y,), steps=5)
    counters = [v for n, v in pyro.get_param_store().items() if n.endswith("num_steps")]
    assert counters and all(v.dtype == dtype for v in counters)
    check = guide.check_bound(y, num_particles=600, warn=False)
    assert check.agrees, check


@pytest.mark.parametrize("step_size", [1.0, "auto"], ids=["beta1", "default"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_a_latent_hidden_by_poutine_block(dtype, step_size):
    """``poutine.block(hide=[...])`` around a latent: neither the guide nor Trace_ELBO sees it,
    so each run of the model draws it from its prior. Trace_ELBO's objective is the expectation
    over that draw; here (a Normal offset ``nu ~ N(0, 0.1^2)`` in the loc) it is Gaussian in
    ``mu``: q is the posterior with unit noise (the offset only adds a constant), and the mean
    of the reported losses is that q's exact -ELBO, as is Trace_ELBO's. The analysis sees the
    model draw at fixed latents and averages that factor's messages over the steps, also under
    the default adaptive ``CVI()`` (whose ``beta`` falls to 0.04-0.1 here: the average is not
    damped by it)."""
    g = torch.Generator().manual_seed(0)
    y = (torch.randn(10, generator=g, dtype=F64) + 1.0).to(dtype)
    s_nu, s0 = 0.1, 2.0

    def model(y):
        mu = pyro.sample("mu", dist.Normal(y.new_zeros(()), s0))
        with poutine.block(hide=["nu"]):
            nu = pyro.sample("nu", dist.Normal(y.new_zeros(()), s_nu))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal(mu + nu, 1.0), obs=y)

    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=step_size), CVI_ELBO())
    for _ in range(40):
        svi.step(y)
    assert "reads a draw the guide does not see" in guide.explain()
    yd = y.double()
    prec = 1 / s0**2 + len(y)
    q = guide.posterior("mu")
    m, v = float(q.loc), float(q.scale) ** 2
    assert abs(v - 1 / prec) < 1e-6 * (1 if dtype == F64 else 100) / prec
    assert abs(m - float(yd.sum()) / prec) < 0.05 * prec**-0.5  # Monte Carlo messages
    ll = (-0.5 * math.log(2 * math.pi) - 0.5 * ((yd - m) ** 2 + v + s_nu**2)).sum()
    lp = -0.5 * math.log(2 * math.pi * s0**2) - 0.5 * (m * m + v) / s0**2
    exact = -float(ll + lp + 0.5 * math.log(2 * math.pi * math.e * v))
    reported = torch.tensor([svi.evaluate_loss(y) for _ in range(200)], dtype=F64)
    assert abs(float(reported.mean()) - exact) < 3 * float(reported.std()) / 200**0.5 + 1e-3
    te = torch.tensor([Trace_ELBO().loss(model, guide, y) for _ in range(600)], dtype=F64)
    assert abs(float(te.mean()) - exact) < 3 * float(te.std()) / 600**0.5 + 1e-3
