"""The remainder: one joint Gaussian, on the unconstrained space, for the latents without an
exact message, stepped by natural gradients (``pyro_cvi.blocks.remainder``).

* exactness where the family holds the posterior: log-normal models whose posterior in
  ``log z`` is Gaussian (one latent, and two correlated ones): ``q`` reaches the closed-form
  posterior and the loss reaches ``-log p(y)``;
* the split: exact blocks stay exact beside the remainder (a conjugate part and a
  non-conjugate part of one model), and ``remainder="off"`` keeps the mean field;
* the loss is the bound: an independent ``Trace_ELBO`` estimate of the same guide agrees;
* discrete latents that share a factor with the remainder are summed out (``TraceEnum``);
* every guide method answers for remainder sites (median, quantiles, posterior,
  get_posterior, Predictive, a checkpoint round trip).
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceEnum_ELBO, config_enumerate
from pyro.infer.autoguide import AutoNormal

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, Remainder

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def fit(model, args, steps, seed=0, **kwargs):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoCVI(model, **kwargs)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    losses = [svi.step(*args) for _ in range(steps)]
    return guide, svi, losses


# ------------------------------------------------------------------------------------------------
# exactness: a posterior that is Gaussian in log z
# ------------------------------------------------------------------------------------------------
def lognormal_model(y):
    s = pyro.sample("s", dist.LogNormal(y.new_tensor(0.0), 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.LogNormal(s.log(), 0.5), obs=y)


def lognormal_posterior(y):
    """``u = log s``: ``N(0, 1)`` prior, ``log y_i ~ N(u, 0.5^2)``: a Gaussian posterior."""
    ly = y.double().log()
    prec = 1.0 + len(y) / 0.25
    mean = (ly.sum() / 0.25) / prec
    var = 1.0 / prec
    # log p(y) = log N(log y | 0, 1 + 0.25 I) - sum log y
    cov = torch.eye(len(y), dtype=torch.float64) * 0.25 + 1.0
    lml = dist.MultivariateNormal(torch.zeros(len(y), dtype=torch.float64), cov).log_prob(ly)
    return mean, var, float(lml - ly.sum())


@DTYPES
def test_remainder_reaches_a_gaussian_posterior_in_log_space(dtype):
    y = torch.exp(0.7 + 0.5 * torch.randn(30, generator=_gen(0), dtype=torch.float64)).to(dtype)
    guide, svi, losses = fit(lognormal_model, (y,), 300)
    assert "remainder" in guide.explain()
    mean, var, lml = lognormal_posterior(y)
    q = guide.engine.kinds["remainder"][0].joint_unconstrained()
    assert abs(float(q.mean[0]) - float(mean)) < 0.1 * math.sqrt(var)
    assert abs(float(q.covariance_matrix[0, 0]) / var - 1.0) < 0.15
    # the bound of the exact posterior is log p(y): the last losses average to -log p(y)
    assert abs(sum(losses[-50:]) / 50 + lml) < 0.05
    assert all(math.isfinite(v) for v in losses)


def two_scale_model(y):
    a = pyro.sample("a", dist.LogNormal(y.new_tensor(0.0), 1.0))
    b = pyro.sample("b", dist.LogNormal(y.new_tensor(0.0), 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.LogNormal(a.log() + b.log(), 1.0), obs=y)


@DTYPES
def test_remainder_holds_the_correlation_of_a_joint_posterior(dtype):
    """``log a + log b`` is identified, ``log a - log b`` is not: the exact posterior of
    ``(log a, log b)`` is Gaussian with correlation ``-n / (n + 1)``; the joint q finds it."""
    y = torch.exp(1.0 + torch.randn(20, generator=_gen(1), dtype=torch.float64)).to(dtype)
    guide, _, _ = fit(two_scale_model, (y,), 300)
    n = len(y)
    P = torch.tensor([[1.0 + n, n], [n, 1.0 + n]], dtype=torch.float64)
    S = torch.linalg.inv(P)
    m = S @ torch.full((2,), float(y.double().log().sum()), dtype=torch.float64)
    q = guide.engine.kinds["remainder"][0].joint_unconstrained()
    C = q.covariance_matrix.double()
    assert torch.allclose(q.mean.double(), m, atol=0.1 * float(S[0, 0].sqrt()))
    corr = C[0, 1] / (C[0, 0] * C[1, 1]).sqrt()
    assert abs(float(corr) - float(S[0, 1] / S[0, 0])) < 0.05
    assert torch.allclose(C.diagonal(), S.diagonal(), rtol=0.2)


# ------------------------------------------------------------------------------------------------
# the split between exact blocks and the remainder
# ------------------------------------------------------------------------------------------------
def split_model(X, t, y, z):
    """A Bayesian linear regression (exact) beside a log-normal rate (no exact message)."""
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    rate = pyro.sample("rate", dist.HalfNormal(X.new_tensor(2.0)))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)
    with pyro.plate("times", len(t)):
        pyro.sample("z", dist.Exponential(rate * t), obs=z)


def _split_data(dtype):
    g = _gen(2)
    X = torch.randn(40, 3, generator=g, dtype=torch.float64)
    y = X @ torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64) + 0.5 * torch.randn(
        40, generator=g, dtype=torch.float64
    )
    t = torch.rand(25, generator=g, dtype=torch.float64) + 0.5
    z = torch.distributions.Exponential(1.5 * t).sample()
    return tuple(v.to(dtype) for v in (X, t, y, z))


@DTYPES
def test_exact_blocks_stay_exact_beside_the_remainder(dtype):
    args = _split_data(dtype)
    guide, _, _ = fit(split_model, args, 60)
    text = guide.explain()
    assert "# w: q = gaussian (site form)" in text
    assert guide.engine.kinds["remainder"][0].names == ("rate",)
    # w's q is the exact conjugate posterior (the regression does not touch the remainder)
    X, _, y, _ = (a.double() for a in args)
    P = torch.eye(3, dtype=torch.float64) + X.T @ X / 0.25
    mean = torch.linalg.solve(P, X.T @ y / 0.25)
    q = guide.posterior("w")
    assert torch.allclose(q.mean.double(), mean, atol=1e-4 if dtype == torch.float64 else 1e-3)


def test_remainder_off_keeps_the_mean_field():
    args = _split_data(torch.float64)
    guide, _, _ = fit(split_model, args, 3, remainder="off")
    assert "remainder" not in guide.engine.kinds
    assert "# rate: q = gamma (natural form)" in guide.explain()


def test_remainder_strategy_is_validated():
    with pytest.raises(ValueError, match="covariance"):
        AutoCVI(split_model, remainder="dense")
    with pytest.raises(ValueError, match="particles"):
        Remainder(particles=0)
    with pytest.raises(TypeError, match="remainder"):
        AutoCVI(split_model, remainder=3)


@pytest.mark.parametrize("covariance", ["full", "lowrank", "diag"])
def test_every_covariance_form_fits(covariance):
    y = torch.exp(0.7 + 0.5 * torch.randn(30, generator=_gen(0), dtype=torch.float64))
    guide, _, losses = fit(lognormal_model, (y,), 200, remainder=covariance)
    assert guide.engine.kinds["remainder"][0].form == covariance
    mean, var, lml = lognormal_posterior(y)
    assert abs(float(guide.median()["s"].log()) - float(mean)) < 0.2 * math.sqrt(var)
    assert abs(sum(losses[-50:]) / 50 + lml) < 0.1


# ------------------------------------------------------------------------------------------------
# the loss is the bound
# ------------------------------------------------------------------------------------------------
def _trace_elbo(model, guide, args, n=2000, loss=None):
    loss = loss or Trace_ELBO(num_particles=1, vectorize_particles=False)
    vals = torch.tensor([loss.loss(model, guide, *args) for _ in range(n)], dtype=torch.float64)
    return float(vals.mean()), float(vals.std() / math.sqrt(n))


@DTYPES
def test_reported_loss_is_the_bound(dtype):
    args = _split_data(dtype)
    guide, svi, _ = fit(split_model, args, 40)
    reported = torch.tensor([svi.evaluate_loss(*args) for _ in range(200)], dtype=torch.float64)
    ref, se = _trace_elbo(split_model, guide, args)
    r_mean, r_se = float(reported.mean()), float(reported.std() / math.sqrt(len(reported)))
    assert abs(r_mean - ref) < 4 * math.hypot(se, r_se) + (
        1e-3 * abs(ref) if dtype == torch.float32 else 0
    )


# ------------------------------------------------------------------------------------------------
# discrete latents inside the remainder are summed out
# ------------------------------------------------------------------------------------------------
@config_enumerate
def mixture(data):
    weights = pyro.sample("weights", dist.Dirichlet(data.new_ones(2)))
    scale = pyro.sample("scale", dist.LogNormal(data.new_tensor(0.0), 1.0))
    with pyro.plate("components", 2):
        locs = pyro.sample("locs", dist.Normal(data.new_tensor(0.0), 5.0))
    with pyro.plate("data", len(data)):
        k = pyro.sample("k", dist.Categorical(weights))
        pyro.sample("obs", dist.Normal(locs[k], scale), obs=data)


def test_discrete_latents_of_the_remainder_are_summed_out():
    g = _gen(3)
    data = torch.cat([torch.randn(40, generator=g) - 3.0, torch.randn(60, generator=g) + 2.0])
    data = data.double()
    init = pyro.infer.autoguide.initialization.init_to_value(
        values={"locs": torch.tensor([-1.0, 1.0], dtype=torch.float64)}
    )
    guide, svi, losses = fit(mixture, (data,), 300, init_loc_fn=init)
    assert "summed out: k" in guide.explain()
    locs = guide.median()["locs"].sort().values
    assert torch.allclose(locs, torch.tensor([-3.0, 2.0], dtype=torch.float64), atol=0.4)
    # the bound TraceEnum_ELBO estimates for the same guide (k summed out in the model)
    ref, se = _trace_elbo(mixture, guide, (data,), n=300, loss=TraceEnum_ELBO(max_plate_nesting=1))
    reported = sum(losses[-30:]) / 30
    assert abs(reported - ref) < 6 * se + 2.0


# ------------------------------------------------------------------------------------------------
# the guide's methods
# ------------------------------------------------------------------------------------------------
def test_guide_methods_answer_for_remainder_sites(tmp_path):
    args = _split_data(torch.float64)
    guide, svi, _ = fit(split_model, args, 30)
    med = guide.median()
    assert set(med) == {"w", "rate"} and med["rate"] > 0
    qs = guide.quantiles([0.1, 0.5, 0.9])
    assert torch.allclose(qs["rate"][1], med["rate"])
    assert qs["rate"][0] < qs["rate"][1] < qs["rate"][2]
    q = guide.posterior("rate")
    assert float(q.mean) > 0 and float(q.variance) > 0
    packed = guide.get_posterior()
    assert packed.event_shape == (4,)
    draws = Predictive(split_model, guide=guide, num_samples=50)(*args)
    assert draws["rate"].shape[0] == 50 and bool((draws["rate"] > 0).all())
    # a checkpoint round trip resumes the same q
    path = tmp_path / "guide.pt"
    torch.save(guide.state_dict(), path)
    loc = pyro.param("AutoCVI.remainder.loc").detach().clone()
    svi.step(*args)
    guide.load_state_dict(torch.load(path))
    assert torch.equal(pyro.param("AutoCVI.remainder.loc").detach(), loc)


def test_remainder_beats_the_mean_field_on_a_hierarchical_model():
    """Eight schools (centred): the joint Gaussian's bound is at least the mean field's."""
    y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0], dtype=torch.float64)
    sigma = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0], dtype=torch.float64)

    def model(sigma, y):
        mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 5.0))
        tau = pyro.sample("tau", dist.HalfCauchy(y.new_tensor(5.0)))
        with pyro.plate("schools", len(y)):
            theta = pyro.sample("theta", dist.Normal(mu, tau))
            pyro.sample("obs", dist.Normal(theta, sigma), obs=y)

    guide, _, _ = fit(model, (sigma, y), 300)
    ours, se = _trace_elbo(model, guide, (sigma, y), n=1000)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    normal = AutoNormal(model)
    svi = SVI(model, normal, pyro.optim.Adam({"lr": 0.02}), Trace_ELBO())
    for _ in range(2000):
        svi.step(sigma, y)
    theirs, se2 = _trace_elbo(model, normal, (sigma, y), n=1000)
    assert ours < theirs + max(0.5, 3 * math.hypot(se, se2))


@pytest.mark.slow
@DTYPES
def test_stochastic_volatility_with_the_defaults_fits(dtype):
    """NumPyro's stochastic volatility written the Pyro way (a latent step scale, 150
    increments, returns ``Normal(0, exp(cumsum / 2))``): 151 unconstrained coordinates, so the
    increments keep their exact block beside the step scale's remainder by default (the joint
    would hold more than 64), and a full-covariance remainder where the joint is named. Each
    fits without a divergence, and its bound (Trace_ELBO of the same guide) ends below the 200
    nats where the low-rank form had climbed past 1,000 (and ``CVI()`` on AutoNormal
    overflows)."""
    from zoo import clients

    (returns,) = clients.stochastic_volatility_data(dtype).args
    model = clients.stochastic_volatility
    for families in (None, {"increments": "joint"}):
        pyro.clear_param_store()
        guide = AutoCVI(model, families=families)
        svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
        losses = [svi.step(returns) for _ in range(100)]
        assert all(math.isfinite(v) for v in losses)
        block = guide.engine.block_for("increments")
        assert (getattr(block, "form", None) == "full") == (families is not None)
        assert "step_scale" not in block.names or families is not None
        with torch.no_grad():
            elbo = Trace_ELBO(num_particles=50)
            bound = sum(elbo.loss(model, guide, returns) for _ in range(4)) / 4
        assert bound < 200.0, (families, bound)


# ------------------------------------------------------------------------------------------------
# Price's Hessians: all rows from one batched backward pass
# ------------------------------------------------------------------------------------------------
def _price_test_function(dtype):
    """``f(u) = sum_k [-u_k' A u_k / 2 + c' sin(u_k) + (b' u_k)^3]``: its Hessian at ``u_k`` is
    ``-A - diag(c sin(u_k)) + 6 (b' u_k) b b'`` (a closed form)."""
    g = _gen(3)
    D = 7
    M = torch.randn(D, D, generator=g, dtype=torch.float64)
    A = (M @ M.T + D * torch.eye(D, dtype=torch.float64)).to(dtype)
    b = torch.randn(D, generator=g, dtype=torch.float64).to(dtype)
    c = torch.randn(D, generator=g, dtype=torch.float64).to(dtype)
    u = torch.randn(5, D, generator=g, dtype=torch.float64).to(dtype)

    def f(u):
        return (-0.5 * ((u @ A) * u).sum(-1) + (c * u.sin()).sum(-1) + (u @ b).pow(3)).sum()

    exact = torch.stack(
        [-A - torch.diag(c * uk.sin()) + 6 * (b @ uk) * torch.outer(b, b) for uk in u]
    ).mean(0)
    return f, u, exact


@DTYPES
def test_expected_hessian_is_the_closed_form(dtype):
    from pyro_cvi.gaussian import expected_hessian

    f, u, exact = _price_test_function(dtype)
    u = u.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(u), u, create_graph=True)
    H = expected_hessian(g, u)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert H.dtype == dtype and H.shape == exact.shape
    assert torch.allclose(H, exact, rtol=tol, atol=tol * exact.abs().max())


@DTYPES
def test_expected_hessian_falls_back_to_one_pass_per_row(dtype, monkeypatch):
    """Where the batched backward pass is refused, the loop gives the same Hessian."""
    from pyro_cvi.gaussian import expected_hessian

    f, u, exact = _price_test_function(dtype)
    u = u.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(u), u, create_graph=True)
    from pyro_cvi.gaussian import price

    grad, calls = torch.autograd.grad, []

    def refuse_batched(*args, **kwargs):
        calls.append(True)
        raise RuntimeError("no batching rule")

    def count(*args, **kwargs):
        calls.append(bool(kwargs.get("is_grads_batched", False)))
        return grad(*args, **kwargs)

    monkeypatch.setattr(price, "_batched_vjp", refuse_batched)
    monkeypatch.setattr(torch.autograd, "grad", count)
    H = expected_hessian(g, u)
    assert calls[0] and calls.count(False) == u.shape[1]
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert torch.allclose(H, exact, rtol=tol, atol=tol * exact.abs().max())


def test_expected_hessian_of_a_linear_function_is_zero():
    from pyro_cvi.gaussian import expected_hessian

    u = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64)
    (g,) = torch.autograd.grad((u @ w).sum(), u, create_graph=True)
    assert torch.equal(expected_hessian(g, u), torch.zeros(4, 4, dtype=torch.float64))
