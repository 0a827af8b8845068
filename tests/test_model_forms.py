"""Models as users write them, and AutoCVI as a full Pyro guide.

Model forms: ``pyro.plate`` with ``subsample=``/``subsample_size``, nested and sequential plates,
``obs_mask``, ``pyro.deterministic``, ``pyro.factor``, ``poutine.reparam``, ``pyro.markov``,
``*args``/``**kwargs``, return values. Guide duties: ``Trace_ELBO`` scores it (the loss CVI
reports is the bound of its ``q``), ``Predictive(model, guide=guide)``, ``median()``,
``quantiles()`` and ``AutoGuideList``. Conjugate Gaussian cases are checked against their closed
form posterior (a dense Bayesian linear regression solved here, independently of the library).
"""

import math
import warnings

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import scipy.stats
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal
from pyro.infer.reparam import LocScaleReparam, TransformReparam
from test_loss_is_bound import assert_loss_is_bound

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

F64 = torch.float64
N = 30


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, generator=g, dtype=F64)
    y = 1.0 + 2.0 * x + 0.5 * torch.randn(N, generator=g, dtype=F64)
    return x, y


def _fit(model, *args, step=1.0, steps=10, **kwargs):
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=step), loss=CVI_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(steps):
            svi.step(*args, **kwargs)
    return guide, svi


def _blr(X, y, prior_prec, noise_sd):
    """Closed-form posterior of ``w ~ N(0, diag(1/prior_prec))``, ``y ~ N(X w, noise_sd^2)``."""
    P = torch.diag(prior_prec) + X.T @ X / noise_sd**2
    cov = torch.linalg.inv(P)
    return cov @ (X.T @ y) / noise_sd**2, cov


# --------------------------------------------------------------------------- model forms
def regression_subsample_arg(x, y, idx):
    a = pyro.sample("a", dist.Normal(x.new_tensor(0.0), 10.0))
    b = pyro.sample("b", dist.Normal(x.new_tensor(0.0), 10.0))
    with pyro.plate("data", len(x), subsample=idx) as i:
        pyro.sample("obs", dist.Normal(a + b * x[i], 0.5), obs=y[i])


def test_plate_with_explicit_subsample_is_the_scaled_conjugate_posterior():
    """``pyro.plate(subsample=idx)``: the minibatch likelihood is scaled by N/B; exact."""
    x, y = _data()
    idx = torch.arange(0, N, 3)
    guide, svi = _fit(regression_subsample_arg, x, y, idx, steps=2)
    X = torch.stack([torch.ones_like(x), x], 1)[idx]
    scale = N / len(idx)
    mean, cov = _blr(X, y[idx], torch.full((2,), 0.01, dtype=F64), 0.5 / math.sqrt(scale))
    q = guide.joint_posterior("a", "b")
    assert torch.allclose(q.loc, mean, atol=1e-8)
    assert torch.allclose(q.covariance_matrix, cov, atol=1e-10)
    assert_loss_is_bound(regression_subsample_arg, guide, svi, (x, y, idx), M=50)


def nested_plates(y):
    mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 10.0))
    with pyro.plate("groups", 3, dim=-2):
        g = pyro.sample("g", dist.Normal(mu, 1.0))
        with pyro.plate("data", 10, dim=-1):
            pyro.sample("obs", dist.Normal(g, 0.5), obs=y)


def test_nested_plates_bound_and_predictive_shapes():
    _, y = _data()
    y = y.reshape(3, 10)
    guide, svi = _fit(nested_plates, y, step=0.5, steps=30)
    assert_loss_is_bound(nested_plates, guide, svi, (y,), M=50)
    pred = Predictive(nested_plates, guide=guide, num_samples=7)(y)
    assert pred["g"].shape == (7, 3, 1) and pred["obs"].shape == (7, 3, 10)


def masked_regression(x, y, mask):
    w = pyro.sample("w", dist.Normal(x.new_zeros(2), 10.0).to_event(1))
    with pyro.plate("data", len(x)):
        mean = w[..., :1] + w[..., 1:] * x
        return pyro.sample("obs", dist.Normal(mean, 0.5), obs=y, obs_mask=mask)


def test_obs_mask_counts_only_the_observed_points():
    x, y = _data()
    mask = torch.arange(N) % 3 != 0
    y = torch.where(mask, y, torch.full_like(y, float("nan")))  # missing values may be NaN
    guide, svi = _fit(masked_regression, x, y.nan_to_num(), mask, steps=2)
    X = torch.stack([torch.ones_like(x), x], 1)
    mean, cov = _blr(X[mask], y[mask], torch.full((2,), 0.01, dtype=F64), 0.5)
    q = guide.posterior("w")
    assert torch.allclose(q.loc, mean, atol=1e-8)
    assert torch.allclose(q.covariance_matrix, cov, atol=1e-10)
    assert_loss_is_bound(masked_regression, guide, svi, (x, y.nan_to_num(), mask), M=50)


def regression_with_extras(x, y, *args, noise=0.5, **kwargs):
    """``pyro.deterministic``, ``pyro.factor``, ``*args``/``**kwargs`` and a return value."""
    assert args == (7,) and kwargs == {"unused": True}
    w = pyro.sample("w", dist.Normal(x.new_zeros(2), 10.0).to_event(1))
    pyro.factor("ridge", -0.5 * (w**2).sum(-1))  # an extra N(0, 1) prior, unnormalised
    mean = pyro.deterministic("mean", w[..., :1] + w[..., 1:] * x)
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(mean, noise), obs=y)
    return mean


def test_deterministic_factor_kwargs_and_predictive_means():
    x, y = _data()
    args, kwargs = (x, y, 7), {"noise": 0.5, "unused": True}
    guide, svi = _fit(regression_with_extras, *args, steps=2, **kwargs)
    X = torch.stack([torch.ones_like(x), x], 1)
    mean, cov = _blr(X, y, torch.full((2,), 1.01, dtype=F64), 0.5)
    q = guide.posterior("w")
    assert torch.allclose(q.loc, mean, atol=1e-8)
    assert torch.allclose(q.covariance_matrix, cov, atol=1e-10)
    assert_loss_is_bound(regression_with_extras, guide, svi, args, M=50, kwargs=kwargs)
    # posterior predictive (y=None: obs is sampled): "mean" is X w, so its average is X E_q[w]
    S = 500
    pred = Predictive(regression_with_extras, guide=guide, num_samples=S)(x, None, 7, **kwargs)
    assert pred["w"].shape == (S, 1, 2) and pred["obs"].shape == (S, N)
    for site in ("mean", "obs"):
        m = pred[site].reshape(S, N)
        assert ((m.mean(0) - X @ mean).abs() <= 4 * m.std(0) / math.sqrt(S)).all(), site
    # and the spread of "mean" is the guide's: var(X w) = diag(X cov X^T)
    var = (X @ cov * X).sum(1)
    assert torch.allclose(pred["mean"].reshape(S, N).var(0), var, rtol=0.2)


def _hier(y):
    mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(y.new_tensor(2.0)))
    with pyro.plate("groups", len(y)):
        th = pyro.sample("theta", dist.Normal(mu, tau))
        pyro.sample("obs", dist.Normal(th, 1.0), obs=y)


def _hier_transformed(y):
    mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(y.new_tensor(2.0)))
    with pyro.plate("groups", len(y)):
        base = dist.Normal(y.new_tensor(0.0), 1.0)
        affine = dist.transforms.AffineTransform(mu, tau)
        th = pyro.sample("theta", dist.TransformedDistribution(base, affine))
        pyro.sample("obs", dist.Normal(th, 1.0), obs=y)


REPARAMS = {
    "loc_scale": poutine.reparam(_hier, config={"theta": LocScaleReparam(0.0)}),
    "transform": poutine.reparam(_hier_transformed, config={"theta": TransformReparam()}),
}


@pytest.mark.parametrize("which", list(REPARAMS))
def test_poutine_reparam_models_run_and_report_their_bound(which):
    _, y = _data()
    model = REPARAMS[which]
    guide, svi = _fit(model, y[:12], step=0.2, steps=15)
    new_site = {"loc_scale": "theta_decentered", "transform": "theta_base"}[which]
    assert "theta" not in guide.median() and new_site in guide.median()
    assert_loss_is_bound(model, guide, svi, (y[:12],), M=30)


def markov_chain(y):
    """A linear-Gaussian state-space model written with ``pyro.markov``."""
    z = pyro.sample("z_0", dist.Normal(y.new_tensor(0.0), 1.0))
    for t in pyro.markov(range(len(y))):
        z = pyro.sample(f"z_{t + 1}", dist.Normal(0.9 * z, 0.5))
        pyro.sample(f"y_{t}", dist.Normal(z, 0.3), obs=y[t])


def test_markov_chain_means_are_exact_and_quantiles_are_the_marginals():
    """The chain's latents depend on each other: a mean-field Gaussian per step, whose means
    converge to the exact posterior means (Gaussian mean field); quantiles are each q's icdf."""
    _, y = _data()
    y = y[:6]
    guide, svi = _fit(markov_chain, y, steps=60)
    T = len(y) + 1

    def log_joint(z):
        lp = dist.Normal(0.0, 1.0).log_prob(z[0])
        lp = lp + dist.Normal(0.9 * z[:-1], 0.5).log_prob(z[1:]).sum()
        return lp + dist.Normal(z[1:], 0.3).log_prob(y).sum()

    z0 = torch.zeros(T, dtype=F64)  # the log joint is quadratic: one Newton step is exact
    H = torch.autograd.functional.hessian(log_joint, z0)
    g = torch.autograd.functional.jacobian(log_joint, z0)
    mean = torch.linalg.solve(-H, g)
    med = guide.median()
    got = torch.stack([med[f"z_{t}"].reshape(()) for t in range(T)])
    assert torch.allclose(got, mean, atol=1e-6), (got, mean)
    ps = [0.05, 0.5, 0.9]
    qs = guide.quantiles(ps)
    for t in range(T):
        q = guide.posterior(f"z_{t}")
        expect = scipy.stats.norm.ppf(ps, q.mean.item(), q.stddev.item())
        assert torch.allclose(qs[f"z_{t}"].reshape(-1), torch.tensor(expect, dtype=F64), atol=1e-6)
    assert_loss_is_bound(markov_chain, guide, svi, (y,), M=30)


def sequential_plate(x, y):
    w = pyro.sample("w", dist.Normal(x.new_zeros(2), 10.0).to_event(1))
    for i in pyro.plate("data", len(x)):
        pyro.sample(f"obs_{i}", dist.Normal(w[0] + w[1] * x[i], 0.5), obs=y[i])


def test_sequential_plate_is_exact():
    x, y = _data()
    guide, _ = _fit(sequential_plate, x, y, steps=2)
    X = torch.stack([torch.ones_like(x), x], 1)
    mean, cov = _blr(X, y, torch.full((2,), 0.01, dtype=F64), 0.5)
    assert torch.allclose(guide.posterior("w").loc, mean, atol=1e-8)
    assert torch.allclose(guide.posterior("w").covariance_matrix, cov, atol=1e-10)


def test_sequential_subsampled_plate_estimates_the_full_bound():
    """``for i in pyro.plate(..., subsample_size=B)``: each step sees a minibatch (site names
    change); the mean loss estimates the full-data bound, as Trace_ELBO's does."""
    x, y = _data()

    def model(x, y):
        w = pyro.sample("w", dist.Normal(x.new_zeros(2), 10.0).to_event(1))
        for i in pyro.plate("data", len(x), subsample_size=6):
            pyro.sample(f"obs_{i}", dist.Normal(w[0] + w[1] * x[i], 0.5), obs=y[i])

    guide, svi = _fit(model, x, y, step=0.3, steps=25)
    X = torch.stack([torch.ones_like(x), x], 1)
    mean, cov = _blr(X, y, torch.full((2,), 0.01, dtype=F64), 0.5)
    q = guide.posterior("w")
    # a stochastic approximation: near the full posterior mean (well within its spread)
    assert ((q.loc - mean).abs() < 3 * cov.diagonal().sqrt()).all(), (q.loc, mean)
    assert_loss_is_bound(model, guide, svi, (x, y), M=40, cvi_repeats=40)


# --------------------------------------------------------------------------- guide duties
def gamma_beta_model(counts, flips):
    rate = pyro.sample("rate", dist.Gamma(counts.new_tensor(2.0), 1.0))
    p = pyro.sample("p", dist.Beta(flips.new_tensor(2.0), 2.0))
    with pyro.plate("c", len(counts)):
        pyro.sample("counts", dist.Poisson(rate), obs=counts)
    with pyro.plate("f", len(flips)):
        pyro.sample("flips", dist.Bernoulli(p), obs=flips)


def test_median_and_quantiles_match_the_exact_gamma_and_beta_posteriors():
    counts = torch.tensor([3.0, 1.0, 4.0, 2.0], dtype=F64)
    flips = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0], dtype=F64)
    guide, _ = _fit(gamma_beta_model, counts, flips, steps=2)
    a, b = 2.0 + counts.sum().item(), 1.0 + len(counts)  # Gamma(a, rate b)
    c, d = 2.0 + flips.sum().item(), 2.0 + (1 - flips).sum().item()
    med = guide.median()
    # the median is the 0.5 quantile of each exact posterior (not its mean)
    assert abs(med["rate"].item() - scipy.stats.gamma.ppf(0.5, a, scale=1 / b)) < 1e-6
    assert abs(med["p"].item() - scipy.stats.beta.ppf(0.5, c, d)) < 1e-6
    assert abs(guide.posterior("rate").mean.item() - a / b) < 1e-9
    assert abs(guide.posterior("p").mean.item() - c / (c + d)) < 1e-9
    ps = [0.1, 0.5, 0.9]
    qs = guide.quantiles(ps)
    expect_rate = scipy.stats.gamma.ppf(ps, a, scale=1 / b)
    expect_p = scipy.stats.beta.ppf(ps, c, d)
    # deterministic (a CDF grid on the unconstrained line): near the exact quantiles
    assert torch.allclose(qs["rate"].reshape(-1), torch.tensor(expect_rate, dtype=F64), rtol=1e-5)
    assert torch.allclose(qs["p"].reshape(-1), torch.tensor(expect_p, dtype=F64), rtol=1e-5)
    assert torch.equal(qs["rate"][1], med["rate"]) and torch.equal(qs["p"][1], med["p"])


def two_part_model(y1, y2):
    a = pyro.sample("a", dist.Normal(y1.new_tensor(0.0), 10.0))
    with pyro.plate("one", len(y1)):
        pyro.sample("obs1", dist.Normal(a, 1.0), obs=y1)
    s = pyro.sample("s", dist.LogNormal(y2.new_tensor(0.0), 1.0))
    with pyro.plate("two", len(y2)):
        pyro.sample("obs2", dist.Normal(0.0, s), obs=y2)


def test_autocvi_composes_inside_autoguidelist():
    """AutoCVI fits its own part (CVI on the model with the other part's sites hidden);
    AutoNormal fits the rest with Trace_ELBO through the list; the list then samples, scores,
    predicts and summarises like any Pyro guide."""
    _, y = _data()
    y1, y2 = y[:15], y[15:] - y[15:].mean()
    cvi_part = poutine.block(two_part_model, hide=["s", "obs2"])
    guide = AutoGuideList(two_part_model)
    guide.append(AutoCVI(cvi_part))
    guide.append(AutoNormal(poutine.block(two_part_model, expose=["s"])))
    guide(y1, y2)  # the list's prototype first (its parts check theirs against it)
    SVI(cvi_part, guide[0], CVI(step_size=1.0), CVI_ELBO()).step(y1, y2)
    svi = SVI(two_part_model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(150):
        svi.step(y1, y2)
    prec = 0.01 + len(y1)
    assert abs(guide[0].posterior("a").loc.item() - y1.sum().item() / prec) < 1e-9
    med = guide.median(y1, y2)
    assert set(med) == {"a", "s"} and abs(med["s"].item() - y2.std().item()) < 0.3
    qs = guide.quantiles([0.25, 0.75], y1, y2)
    assert qs["a"].shape[0] == 2 and bool((qs["a"][0] < qs["a"][1]).all())
    pred = Predictive(two_part_model, guide=guide, num_samples=5)(y1, y2)
    assert pred["obs1"].shape == (5, 15) and pred["a"].shape[0] == 5
    assert math.isfinite(Trace_ELBO(num_particles=20).loss(two_part_model, guide, y1, y2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batch_dims_outside_plates_get_a_joint_q(dtype):
    """``Normal(zeros(3), 1)`` without ``to_event`` and outside any plate: its elements are not
    declared independent, so q is one joint Gaussian (the exact posterior in one step), as
    with ``to_event(1)``; the guide samples it as such (and ``Trace_ELBO`` agrees)."""
    A = torch.tensor([[1.0, 0.9, 0.0], [0.0, 1.0, 0.9], [0.5, 0.0, 1.0], [1.0, 1.0, 1.0]])
    A, y = A.to(dtype), torch.tensor([1.0, 0.5, -0.3, 0.8], dtype=dtype)

    def batched(y):
        z = pyro.sample("z", dist.Normal(y.new_zeros(3), 1.0))
        with pyro.plate("data", 4):
            pyro.sample("y", dist.Normal(A @ z, 0.5), obs=y)

    pyro.clear_param_store()
    guide = AutoCVI(batched)
    svi = SVI(batched, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    svi.step(y)
    loss = svi.step(y)
    P = torch.eye(3, dtype=torch.float64) + A.double().T @ A.double() / 0.25
    cov = torch.linalg.inv(P)
    q = guide.posterior("z")
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    assert torch.allclose(q.covariance_matrix.double(), cov, atol=tol)
    assert guide(y)["z"].shape == (3,)
    with pyro.validation_enabled(False):  # Pyro's shape check wants a plate or to_event here
        ref = torch.tensor(
            [Trace_ELBO().loss(batched, guide, y) for _ in range(2000)], dtype=torch.float64
        )
    assert abs(float(ref.mean()) - loss) < 4 * float(ref.std()) / math.sqrt(len(ref)) + 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_guide_draws_under_a_particles_plate_have_the_models_shapes(dtype):
    """A plate outside the model (vectorised particles, as Pyro's ``vectorize_particles`` and
    ``Predictive(parallel=True)`` add) broadcasts against each site's own plates, for a
    Gaussian block (a conjugate tree) and for the remainder (a Dirichlet in a plate), as
    AutoContinuous unpacks its latent; the replayed model then runs."""
    data = torch.tensor([0.3, -1.2], dtype=dtype)

    def tree(data):
        x = pyro.sample("x", dist.Normal(data.new_zeros(()), 1.0))
        with pyro.plate("data", 2):
            y = pyro.sample("y", dist.Normal(x, 1.0))
            pyro.sample("obs", dist.Normal(y, 1.0), obs=data)
        return x, y

    def simplex(data):
        b = pyro.sample("b", dist.Normal(data.new_zeros(3), 1.0).to_event(1))
        with pyro.plate("i", 2):
            d = pyro.sample("d", dist.Dirichlet(b.exp()))
            pyro.sample("e", dist.Categorical(logits=d), obs=torch.tensor([0, 2]))
        return b, d

    for model, shapes in ((tree, [(7, 1), (7, 2)]), (simplex, [(7, 1, 3), (7, 2, 3)])):
        pyro.clear_param_store()
        guide = AutoCVI(model)
        svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
        svi.step(data)
        with torch.no_grad(), pyro.plate("particles", 7, dim=-2):
            tr = poutine.trace(guide).get_trace(data)
            values = poutine.replay(model, tr)(data)
        assert [tuple(v.shape) for v in values] == shapes, model.__name__
        assert all(bool(torch.isfinite(v).all()) for v in values)
