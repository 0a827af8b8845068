"""A local linear trend written with two cumsums whose scales are remainder latents.

``eta ~ Normal(0, sigma_slope)``, ``eps ~ Normal(0, sigma_level)`` in one plate,
``level = (eta.cumsum(-1) + eps).cumsum(-1)``, ``y ~ Normal(level, sigma_obs)``: the chain of
``x_t = (slope_t, level_t - slope_t)``, ``x_t = [[1, 0], [1, 1]] x_(t-1) + (eta_t, eps_t)``
(``statespace.increments.NestedIncrements``), takes the Kalman block beside the three scales
(``blocks/scaled_walk.py``). Checked: the steps from the same ``q`` against the same density
written as a two-state ``pyro.markov`` loop, the guide's sites ``eta`` and ``eps`` in their
plate, the rule's wording, where it does not apply, and the fit against the exact answer (a
Kalman filter on a grid of the three scales) and against ``Trace_ELBO``.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
import trend_models as tm
from pyro.infer import Trace_ELBO
from test_scaled_walk import _chain, setup, steps_from

from pyro_cvi.model.prior_factor import JOINT_MAX_DIM
from pyro_cvi.statespace.posterior import conditional_entropy

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


_scales = tm.latent_scales
trend, trend_loop = tm.trend(_scales), tm.trend_loop(_scales)


def data(T, dtype):
    return tm.simulate(T, dtype)


@DTYPES
def test_the_two_cumsums_step_as_the_two_state_loop(dtype):
    """From the same remainder ``q`` and random stream, three steps of the trend's block and of
    the loop's give the same losses and ``q(x)``; the guide samples ``eta`` and ``eps`` in their
    plate, and their marginals' means are the increments of ``q(x)``'s."""
    T, steps = 12, 3
    y = data(T, dtype)
    out, start = {}, None
    for name, model, families in (
        ("trend", trend, {"eta": "gaussian"}),
        ("loop", trend_loop, {"x_3": "gaussian"}),
    ):
        guide, loss, start = steps_from(model, y, families, start, steps)
        block = _chain(guide)
        assert block is not None
        assert guide.engine.analysis.remainder == ["sigma_level", "sigma_slope", "sigma_obs"]
        out[name] = (loss, block.post.mean, block.post.cov, guide)
    tol = 1e-9 if dtype == torch.float64 else 2e-3
    (lt, mt, vt, gt), (ll, ml, vl, _) = out["trend"], out["loop"]
    assert abs(lt - ll) < tol * max(1.0, abs(ll)), (lt, ll)
    assert torch.allclose(mt, ml, rtol=tol, atol=tol) and torch.allclose(vt, vl, rtol=tol, atol=tol)
    tm.check_guide_sites(gt, gt.engine.blocks[0], y, mt, tol)


def reversed_trend(y):
    """The slope's increments sampled second: the finder tries the sites' orders."""
    sl, ss, so = _scales(y)
    with pyro.plate("time", y.shape[0]):
        eps = pyro.sample("eps", dist.Normal(y.new_tensor(0.0), sl))
        eta = pyro.sample("eta", dist.Normal(y.new_tensor(0.0), ss))
    level = (eta.cumsum(-1) + eps).cumsum(-1)
    with pyro.plate("obs_time", y.shape[0]):
        pyro.sample("y", dist.Normal(0.5 * level + 1.0, so), obs=y)


@DTYPES
def test_the_rule_and_the_site_order(dtype):
    """``2 T + 3`` coordinates: the joint at ``JOINT_MAX_DIM``, the block one beyond, with the
    walk's wording; sites sampled in the other order (and an affine loc) are found too."""
    T = (JOINT_MAX_DIM - 3) // 2 + 1  # (2 T + 3 = 65)
    at, _ = setup(trend, data(T - 1, dtype))
    assert _chain(at) is None and "eta" in at.engine.analysis.remainder
    beyond, _ = setup(trend, data(T, dtype))
    block = _chain(beyond)
    assert block is not None and block.names == ("eta", "eps")
    text = beyond.explain()
    assert f"the joint would hold {2 * T + 3} coordinates, more than {JOINT_MAX_DIM}" in text
    for site in ("eta", "eps"):
        assert f"transition into {site} given sigma_level, sigma_slope, sigma_obs" in text
    flipped, _ = setup(reversed_trend, data(T, dtype))
    assert _chain(flipped) is not None and _chain(flipped).names == ("eta", "eps")
    joint, _ = setup(trend, data(T + 5, dtype), {"eps": "joint"})
    assert _chain(joint) is None and "eps" in joint.engine.analysis.remainder


def counts(y):
    """A Poisson observation of the trend: not Gaussian in the states."""
    sl, ss, _ = _scales(y)
    with pyro.plate("time", y.shape[0]):
        eta = pyro.sample("eta", dist.Normal(y.new_tensor(0.0), ss))
        eps = pyro.sample("eps", dist.Normal(y.new_tensor(0.0), sl))
        pyro.sample("y", dist.Poisson((eta.cumsum(-1) + eps).cumsum(-1).exp()), obs=y)


shifted, parallel = tm.beside(_scales, "shifted"), tm.beside(_scales, "parallel")


@DTYPES
@pytest.mark.parametrize("model", [counts, shifted, parallel])
def test_where_the_nested_walk_does_not_apply(model, dtype):
    """A Poisson observation, a loc reading another latent, two walks that are not nested: no
    walk block, even named ``'gaussian'``."""
    y = data(JOINT_MAX_DIM + 2, dtype).abs().round()
    guide, svi = setup(model, y)
    assert _chain(guide) is None
    named, _ = setup(model, y, {"eta": "gaussian"})
    assert _chain(named) is None


def exact_trend(y: torch.Tensor, n: int = 40) -> float:
    """``-log p(y)`` of :func:`trend` on an ``n^3`` grid of the log scales."""
    return tm.grid_neg_log_evidence(y, n, ((-5, 1), (-9, 0.5), (-4, 1)))


def test_the_grid_answer_is_converged():
    """The grid's ``-log p(y)`` at 40 and 56 points a side agree within 0.02."""
    y = data(30, torch.float64)
    dense = exact_trend(y, 40)
    finer = exact_trend(y, 56)
    assert abs(dense - finer) < 0.02, (dense, finer)


@DTYPES
def test_the_fit_against_the_exact_grid_answer(dtype):
    """T = 30, named ``'gaussian'``, 60 steps: the bound (``Trace_ELBO``) above ``-log p(y)``
    less 3 SE and within 4.5 nats of it (the mean field between the states and the scales costs
    ~3.5 nats here), and the reported loss within 3 SE (+ 0.1) of ``Trace_ELBO``."""
    T = 30
    y = data(T, dtype)
    guide, svi = setup(trend, y, {"eta": "gaussian"})
    assert _chain(guide) is not None
    for _ in range(60):
        svi.step(y)
    with torch.no_grad():
        v = torch.tensor(
            [Trace_ELBO(num_particles=25).loss(trend, guide, y) for _ in range(4)],
            dtype=torch.float64,
        )
        reported = torch.tensor([svi.evaluate_loss(y) for _ in range(5)], dtype=torch.float64)
    bound, se = float(v.mean()), float(v.std() / 2)
    exact = exact_trend(y)
    assert exact - 3 * se - 0.05 < bound < exact + 4.5, (bound, se, exact)
    tol = 3 * math.hypot(se, float(reported.std()) / math.sqrt(5)) + 0.1
    assert abs(float(reported.mean()) - bound) < tol, (reported.mean(), bound, se)


@DTYPES
def test_q_log_prob_and_entropy_against_the_dense_gaussian(dtype):
    """``q(eta, eps)``'s ``log_prob`` (by the chain's conditionals) and its entropy (the block's
    ELBO reads it) against the dense Gaussian of the same ``q``."""
    T = 12
    y = data(T, dtype)
    guide, svi = setup(trend, y, {"eta": "gaussian"})
    for _ in range(3):
        svi.step(y)
    block = _chain(guide)
    q = block.joint()
    with torch.no_grad():
        draws = q.sample((3,))
        dense = torch.distributions.MultivariateNormal(
            q.mean.double(), covariance_matrix=q.covariance_matrix.double()
        )
        found = q.log_prob(draws)
        entropy = conditional_entropy(block.post)
    tol = 1e-8 if dtype == torch.float64 else 1e-3
    assert found.shape == (3,) and found.dtype == dtype
    assert torch.allclose(found.double(), dense.log_prob(draws.double()), rtol=tol, atol=tol)
    assert abs(float(entropy) - float(dense.entropy())) < tol * (1 + abs(float(entropy)))


def shifted_scales(y):
    """``eps``' scale ``sigma_level + 1``: ``log s`` not affine in the unconstrained value, so
    ``E[1/s^2]`` by Monte Carlo over ``q(u)`` and the remainder reads the shared sites one by one
    (the model broadcasts over a particle plate)."""
    sl, ss, so = _scales(y)
    with pyro.plate("time", y.shape[0]):
        eta = pyro.sample("eta", dist.Normal(0.0, ss))
        eps = pyro.sample("eps", dist.Normal(0.0, sl + 1.0))
    level = (eta.cumsum(-1) + eps).cumsum(-1)
    with pyro.plate("obs_time", y.shape[0]):
        pyro.sample("y", dist.Normal(level, so), obs=y)


@pytest.mark.slow
@DTYPES
def test_the_monte_carlo_nested_walk_against_trace_elbo(dtype):
    """The nested walk with ``E[1/s^2]`` by Monte Carlo: the reported loss within 3 SE of
    ``Trace_ELBO``."""
    T = 30
    y = data(T, dtype)
    guide, svi = setup(shifted_scales, y, {"eta": "gaussian"})
    assert _chain(guide) is not None and "E[1/s^2] by Monte Carlo" in guide.explain()
    for _ in range(20):
        svi.step(y)
    with torch.no_grad():
        v = torch.tensor(
            [Trace_ELBO(num_particles=50).loss(shifted_scales, guide, y) for _ in range(6)],
            dtype=torch.float64,
        )
        reported = torch.tensor([svi.evaluate_loss(y) for _ in range(10)], dtype=torch.float64)
    bound, se = float(v.mean()), float(v.std() / math.sqrt(6))
    tol = 3 * math.hypot(se, float(reported.std()) / math.sqrt(10)) + 0.05
    assert abs(float(reported.mean()) - bound) < tol, (reported.mean(), bound, se)
