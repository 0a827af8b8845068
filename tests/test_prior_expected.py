"""The prior of a Gaussian block latent whose scale (and loc) live in the remainder (eq. 20).

``theta_j ~ Normal(mu, tau)`` with ``tau`` in the remainder's joint Gaussian: named
``AutoCVI(families={"theta": "gaussian"})``, the block ``mu, theta`` stays exact beside the
remainder and reads ``theta``'s conditional at ``E_q[1/tau^2]`` (and ``E_q[loc/s^2]``) in closed
form under the remainder's ``q``. Checked against

* Gauss-Hermite quadrature and brute-force averages of the expected natural parameters;
* the block's ``q`` given the remainder's: the conjugate posterior of ``mu, theta`` at the
  expected precision, to rounding;
* the reported loss against ``Trace_ELBO`` of the same guide (within 3 standard errors);
* the default (no override): the classification is unchanged, the joint Gaussian keeps it;
* the remainder's side Rao-Blackwellised over the block's ``q``: quadrature, a brute-force
  average over joint draws of the block, and no spread left from the block's draws.
"""

import math
from types import SimpleNamespace

import numpy
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.messages.prior_expected import (
    block_moments,
    expected_log_prior,
    expected_prior_moments,
)
from pyro_cvi.model.prior_factor import PriorInfo
from pyro_cvi.model.records import CONJUGATE_PRIOR
from pyro_cvi.statespace import random_walk

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
GH_NODES, GH_WEIGHTS = numpy.polynomial.hermite_e.hermegauss(60)
SIGMA = [15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0]
Y = [28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0]


def schools(sigma, y):
    mu = pyro.sample("mu", dist.Normal(sigma.new_tensor(0.0), 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(sigma.new_tensor(5.0)))
    with pyro.plate("schools", len(sigma)):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def data(dtype):
    return torch.tensor(SIGMA, dtype=dtype), torch.tensor(Y, dtype=dtype)


def fit(model, dtype, steps, families=None):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    sigma, y = data(dtype)
    guide = AutoCVI(model, families=families)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    losses = [svi.step(sigma, y) for _ in range(steps)]
    return guide, svi, losses


def _info(dtype):
    """A prior ``loc = 1 + 2 u_0 - u_1``, ``log s = 0.5 - 1.5 u_1`` over two unconstrained
    coordinates (two rows, the second with other coefficients)."""
    t = dict(dtype=dtype)
    return PriorInfo(
        ("a", "b"),
        {"a": torch.tensor([0.2], **t), "b": torch.tensor([-0.1], **t)},
        torch.tensor([1.0, -0.5], **t),
        torch.tensor([0.5, 0.0], **t),
        {"a": torch.tensor([[2.0], [0.5]], **t), "b": torch.tensor([[-1.0], [0.0]], **t)},
        {"a": torch.tensor([[0.0], [0.3]], **t), "b": torch.tensor([[-1.5], [0.7]], **t)},
    )


def _moments_by_quadrature(info, m, S):
    """``E[1/s^2]`` and ``E[loc/s^2]`` per row by 2-d Gauss-Hermite quadrature (float64)."""
    m, S = m.double(), S.double()
    L = torch.linalg.cholesky(S)
    x = torch.from_numpy(GH_NODES)
    w = torch.from_numpy(GH_WEIGHTS) / math.sqrt(2 * math.pi)
    e = torch.stack(torch.meshgrid(x, x, indexing="ij"), -1).reshape(-1, 2)
    ww = (w[:, None] * w[None, :]).reshape(-1)
    u = m + e @ L.T
    u0 = torch.cat([info.u0[n] for n in info.given]).double()
    G = torch.cat([info.G[n] for n in info.given], 1).double()
    H = torch.cat([info.H[n] for n in info.given], 1).double()
    loc = info.loc0.double() + (u - u0) @ G.T
    prec = torch.exp(-2 * (info.log_scale0.double() + (u - u0) @ H.T))
    return (ww[:, None] * prec).sum(0), (ww[:, None] * prec * loc).sum(0)


@DTYPES
def test_expected_moments_against_quadrature_and_draws(dtype):
    info = _info(dtype)
    m = torch.tensor([0.3, -0.4], dtype=dtype)
    S = torch.tensor([[0.5, -0.2], [-0.2, 0.3]], dtype=dtype)
    e_prec, e_loc = expected_prior_moments(info, m, S)
    q_prec, q_loc = _moments_by_quadrature(info, m, S)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert torch.allclose(e_prec.double(), q_prec, rtol=tol)
    assert torch.allclose(e_loc.double(), q_loc, rtol=tol)
    # a brute-force average over 400,000 draws (within 4 standard errors)
    g = torch.Generator().manual_seed(1)
    u = m.double() + torch.randn(400_000, 2, generator=g, dtype=torch.float64) @ (
        torch.linalg.cholesky(S.double()).T
    )
    u0 = torch.cat([info.u0[n] for n in info.given]).double()
    G = torch.cat([info.G[n] for n in info.given], 1).double()
    H = torch.cat([info.H[n] for n in info.given], 1).double()
    prec = torch.exp(-2 * (info.log_scale0.double() + (u - u0) @ H.T))
    loc = info.loc0.double() + (u - u0) @ G.T
    for draws, exact in ((prec, e_prec), (prec * loc, e_loc)):
        se = draws.std(0) / math.sqrt(len(draws))
        assert ((draws.mean(0) - exact.double()).abs() < 4 * se).all()


def _conjugate_posterior(sigma, y, e_prec):
    """The exact ``q(mu, theta)`` given ``E[1/tau^2]``: ``mu ~ N(0, 25)``, ``theta_j | mu ~
    N(mu, 1/e_prec)``, ``y_j ~ N(theta_j, sigma_j)`` (precision ``P``, mean ``P^-1 h``)."""
    J = len(sigma)
    P = torch.zeros(J + 1, J + 1, dtype=torch.float64)
    P[0, 0] = 1 / 25 + J * e_prec
    P[0, 1:] = P[1:, 0] = -e_prec
    P[1:, 1:] = torch.diag(e_prec + sigma.double() ** -2)
    h = torch.cat([torch.zeros(1, dtype=torch.float64), y.double() / sigma.double() ** 2])
    return torch.linalg.solve(P, h), torch.linalg.inv(P)


def _refreshed(guide, sigma, y):
    """The block of ``theta`` refreshed at the remainder's current ``q`` (one context, as a
    step's), and that ``q``'s mean and covariance on the remainder's coordinates."""
    engine = guide.engine
    block = engine.block_for("theta")
    ctx = engine.context((sigma, y), {}, {}, grads=False)
    if ctx.trace is None:
        ctx.trace = engine._trace(ctx)
    block.refresh(ctx)
    q = engine.block_for("tau").joint_unconstrained()
    return block, q.loc.double(), q.covariance_matrix.double()


@DTYPES
def test_the_block_is_the_conjugate_posterior_given_the_remainder(dtype):
    guide, svi, _ = fit(schools, dtype, 30, {"theta": "gaussian"})
    sigma, y = data(dtype)
    assert guide.engine.analysis.remainder == ["tau"]
    block, m, S = _refreshed(guide, sigma, y)
    assert any(f.kind == CONJUGATE_PRIOR and f.site == "theta" for f in block.spec.factors)
    mean, cov = _conjugate_posterior(sigma, y, math.exp(-2 * float(m[0]) + 2 * float(S[0, 0])))
    joint = block.joint(["mu", "theta"])
    tol = 1e-9 if dtype == torch.float64 else 1e-4
    assert torch.allclose(joint.loc.double(), mean, rtol=tol, atol=tol)
    assert torch.allclose(joint.covariance_matrix.double(), cov, rtol=tol, atol=tol)


@DTYPES
def test_the_loss_against_trace_elbo(dtype):
    guide, svi, _ = fit(schools, dtype, 100, {"theta": "gaussian"})
    sigma, y = data(dtype)
    with torch.no_grad():
        reported = torch.tensor(
            [svi.evaluate_loss(sigma, y) for _ in range(400)], dtype=torch.float64
        )
        trace = torch.tensor(
            [Trace_ELBO(num_particles=200).loss(schools, guide, sigma, y) for _ in range(10)],
            dtype=torch.float64,
        )
    se = math.hypot(reported.std() / math.sqrt(400), trace.std() / math.sqrt(10))
    assert abs(float(reported.mean() - trace.mean())) < 3 * se + 1e-3, (reported.mean(), se)


@DTYPES
def test_the_default_keeps_the_joint_and_the_override_takes_the_block(dtype):
    guide, _, _ = fit(schools, dtype, 2)
    assert guide.engine.analysis.remainder == ["mu", "tau", "theta"]
    assert CONJUGATE_PRIOR not in guide.explain()
    guide, _, _ = fit(schools, dtype, 2, {"theta": "gaussian"})
    text = guide.explain()
    assert guide.engine.analysis.remainder == ["tau"]
    assert "theta -> mu, theta    conjugate (E prior)" in text
    assert "exact expected from mu, theta, obs" in text


def _fitted_bound(guide, model, dtype):
    sigma, y = data(dtype)
    with torch.no_grad():
        v = [Trace_ELBO(num_particles=500).loss(model, guide, sigma, y) for _ in range(4)]
    return sum(v) / len(v)


@pytest.mark.slow
def test_a_long_run_stays_at_its_bound():
    """300 steps, every step counter moved on by 20,000 (``bench.long_runs``), 300 more:
    finite, no drift (the last 200 steps' mean loss within 1 nat of the best 200's), and the
    bound where it was."""
    from bench.long_runs import Stepper, _svi_counters, verdict

    guide, svi, losses = fit(schools, torch.float64, 300, {"theta": "gaussian"})
    before = _fitted_bound(guide, schools, torch.float64)
    sigma, y = data(torch.float64)
    stepper = Stepper(lambda: svi.step(sigma, y), lambda: _svi_counters(svi), lambda: 0.0)
    stepper.advance(20_000)
    losses += [stepper.step() for _ in range(300)]
    r = verdict(losses, window=200)
    assert r["finite"] and r["gap"] <= 1.0, r
    assert abs(_fitted_bound(guide, schools, torch.float64) - before) < 0.3


# ------------------------------------------------ the remainder's side, Rao-Blackwellised
@DTYPES
def test_expected_log_prior_against_quadrature(dtype):
    """``E[log N(theta; loc, s)]`` under ``theta ~ N(m, v)`` per coordinate (a masked coordinate
    adds nothing), summed over the event dims as the site's ``log_prob``, against 60-point
    Gauss-Hermite quadrature."""
    t = dict(dtype=dtype)
    loc = torch.tensor([[0.3, -1.0, 2.0], [0.0, 0.5, -0.2]], **t)
    s = torch.tensor([[0.7, 1.3, 0.4], [2.0, 0.9, 1.1]], **t)
    m = torch.tensor([[0.1, -0.4, 1.5], [0.8, 0.2, 0.0]], **t)
    v = torch.tensor([[0.2, 0.05, 0.3], [1.5, 0.4, 0.01]], **t)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    fn = dist.Normal(loc, s).mask(mask).to_event(1)
    got = expected_log_prior(fn, m, v)
    x = torch.tensor(GH_NODES, **t)
    w = torch.tensor(GH_WEIGHTS / math.sqrt(2 * math.pi), **t)
    draws = m + v.sqrt() * x[:, None, None]
    quad = (dist.Normal(loc, s).log_prob(draws) * mask * w[:, None, None]).sum(0).sum(-1)
    assert got.shape == (2,)
    assert torch.allclose(got, quad, rtol=1e-5 if dtype == torch.float32 else 1e-10)


@DTYPES
def test_the_remainder_reads_the_prior_free_of_the_block_draw(dtype):
    """The remainder's term of ``theta ~ Normal(mu, tau)`` (``mu, theta`` in the block, a tree
    member: ``loc = mu``) at a fixed ``tau``: the same for two draws of the block, and equal to
    the brute-force average of ``log N(theta; mu, tau)`` over joint draws of ``q(mu, theta)``."""
    guide, _, _ = fit(schools, dtype, 30, {"theta": "gaussian"})
    sigma, y = data(dtype)
    engine = guide.engine
    ctx = SimpleNamespace(block_for=engine.block_for)
    block = engine.block_for("theta")
    tau = torch.tensor(3.0, dtype=dtype)

    def term(draw):
        cond = pyro.poutine.condition(schools, {"tau": tau, **draw})
        tr = pyro.poutine.trace(cond).get_trace(sigma, y)
        mo = block_moments(engine.analysis, ctx, ["tau", "theta"], draw)
        fn = tr.nodes["theta"]["fn"]
        return expected_log_prior(fn, *mo["theta"]).sum(), fn

    q = block.joint(["theta", "mu"])
    with torch.no_grad():
        draws = q.sample((2,))
        a, _ = term({"theta": draws[0, :8], "mu": draws[1, 8]})
        b, _ = term({"theta": draws[1, :8], "mu": draws[0, 8]})
        many = q.sample((40_000,)).to(torch.float64)
        lp = dist.Normal(many[:, 8:9], tau.double()).log_prob(many[:, :8]).sum(-1)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert abs(float(a - b)) < tol * abs(float(a))
    se = float(lp.std() / math.sqrt(lp.numel()))
    assert abs(float(a) - float(lp.mean())) < 4 * se + tol * abs(float(a)), (a, lp.mean(), se)


@DTYPES
def test_the_reported_loss_has_no_variance_from_the_prior_draws(dtype):
    """With only ``tau`` left in the remainder and ``theta``'s prior read in expectation, the
    reported loss varies only through ``tau``'s draw: its spread across evaluations is below
    the spread of the same guide's single-particle ``Trace_ELBO``."""
    guide, svi, _ = fit(schools, dtype, 100, {"theta": "gaussian"})
    sigma, y = data(dtype)
    with torch.no_grad():
        reported = torch.tensor([svi.evaluate_loss(sigma, y) for _ in range(200)])
        trace = torch.tensor([Trace_ELBO().loss(schools, guide, sigma, y) for _ in range(200)])
    assert float(reported.std()) < 0.5 * float(trace.std()), (reported.std(), trace.std())


def walk(sigma, y):
    """A random walk with a latent step scale, ``x = cumsum(eps)`` (the prior's loc free of
    the block: the remainder reads ``eps``' marginal moments)."""
    step = pyro.sample("step", dist.LogNormal(y.new_tensor(-1.0), 1.0))
    with pyro.plate("time", y.shape[0]):
        eps = pyro.sample("eps", dist.Normal(y.new_tensor(0.0), step))
    with pyro.plate("obs_time", y.shape[0]):
        pyro.sample("obs", dist.Normal(eps.cumsum(-1), sigma), obs=y)


@DTYPES
def test_a_walk_loss_against_trace_elbo(dtype, monkeypatch):
    """The reported loss of the random walk (``eps`` named, its step scale in the remainder)
    against ``Trace_ELBO`` of the same guide, within 3 standard errors. (With walks recognised,
    the walk takes the Kalman block beside its scale: ``tests/test_scaled_walk.py``; here the
    dense block at the expected prior.)"""
    monkeypatch.setattr(random_walk, "RECOGNISE_RANDOM_WALKS", False)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    g = torch.Generator().manual_seed(5)
    y = (0.3 * torch.randn(20, generator=g, dtype=torch.float64)).cumsum(0).to(dtype)
    sigma = torch.tensor(0.4, dtype=dtype)
    guide = AutoCVI(walk, families={"eps": "gaussian"})
    svi = SVI(walk, guide, CVI(), CVI_ELBO())
    for _ in range(60):
        svi.step(sigma, y)
    assert CONJUGATE_PRIOR in guide.explain()
    assert guide.engine.analysis.remainder == ["step"]
    with torch.no_grad():
        reported = torch.tensor(
            [svi.evaluate_loss(sigma, y) for _ in range(400)], dtype=torch.float64
        )
        trace = torch.tensor(
            [Trace_ELBO(num_particles=200).loss(walk, guide, sigma, y) for _ in range(10)],
            dtype=torch.float64,
        )
    se = math.hypot(reported.std() / math.sqrt(400), trace.std() / math.sqrt(10))
    assert abs(float(reported.mean() - trace.mean())) < 3 * se + 1e-3, (reported.mean(), se)
