"""A linear-Gaussian chain whose transition, emission coefficient, offset and noise scales a
global discrete latent selects (``s ~ Categorical(pi)``; ``x_t ~ N(a[s] x_{t-1}, q[s])``;
``y_t ~ N(h[s] x_t + c[s], r[s])``): the chain keeps its Kalman block, whose message is the
expected prior over ``q(s)`` (exact VMP), and ``q(s)`` the expected log-likelihood of each
value (Algorithm 2, eq. 20).

Checked against independent computations: the fixed point and its bound are those of a
brute-force CAVI loop with a dense Gaussian ``q(x)`` (the joint precision of each value of
``s`` written out here) and the exact ``q(s)``; the reported loss is a Trace_ELBO estimate of
the same guide (within 3 SE)."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.ops.indexing import Vindex

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks import RegimeMarkovBlock

DTYPES = [torch.float64, torch.float32]
T = 8
PI = [0.55, 0.45]
PARAMS = {  # per value of s
    "m0": [0.0, 0.1],
    "p0": [1.0, 1.2],
    "a": [0.9, 0.8],
    "q": [0.3, 0.4],
    "h": [1.0, 0.9],
    "c": [0.0, 0.1],
    "r": [0.3, 0.35],
}


def model(y, mark=False):
    p = {k: y.new_tensor(v) for k, v in PARAMS.items()}
    infer = {"enumerate": "parallel"} if mark else {}
    s = pyro.sample("s", dist.Categorical(y.new_tensor(PI)), infer=infer)

    def at(k):
        return Vindex(p[k])[..., s]

    x = pyro.sample("x_0", dist.Normal(at("m0"), at("p0").sqrt()))
    for t in pyro.markov(range(T)):
        if t > 0:
            x = pyro.sample(f"x_{t}", dist.Normal(at("a") * x, at("q").sqrt()))
        pyro.sample(f"y_{t}", dist.Normal(at("h") * x + at("c"), at("r").sqrt()), obs=y[t])


def data(dtype):
    g = torch.Generator().manual_seed(4)
    y = 0.8 * torch.randn(T, generator=g, dtype=torch.float64).cumsum(0) + 0.2
    return y.to(dtype)


# ---------------------------------------------------------------- the brute-force reference
def quadratic(y, k):
    """``log p(x, y | s = k) = -x' L x / 2 + h' x + const``: ``(L, h, const)``, from the
    residuals ``B x - g`` with variances ``v`` of every factor."""
    P = {n: v[k] for n, v in PARAMS.items()}
    B = torch.zeros(2 * T, T, dtype=torch.float64)
    g = torch.zeros(2 * T, dtype=torch.float64)
    v = torch.zeros(2 * T, dtype=torch.float64)
    B[0, 0], g[0], v[0] = 1.0, P["m0"], P["p0"]
    for t in range(1, T):
        B[t, t], B[t, t - 1], v[t] = 1.0, -P["a"], P["q"]
    for t in range(T):
        B[T + t, t], g[T + t], v[T + t] = P["h"], y[t] - P["c"], P["r"]
    L = B.T @ (B / v[:, None])
    h = B.T @ (g / v)
    const = (-0.5 * torch.log(2 * math.pi * v) - 0.5 * g**2 / v).sum()
    return L, h, const


def reference(y, iters=2000):
    """Mean-field CAVI over ``q(s) q(x)``, ``q(x)`` a dense Gaussian: ``(ELBO, q(s), mean)``."""
    y = y.double()
    parts = [quadratic(y, k) for k in range(2)]
    log_pi = torch.tensor(PI, dtype=torch.float64).log()
    qs = torch.tensor(PI, dtype=torch.float64)
    for _ in range(iters):
        L = sum(q * p[0] for q, p in zip(qs, parts))
        S = torch.linalg.inv(L)
        mu = S @ sum(q * p[1] for q, p in zip(qs, parts))
        E = torch.stack(
            [-0.5 * (torch.trace(Lk @ S) + mu @ Lk @ mu) + hk @ mu + ck for Lk, hk, ck in parts]
        )
        new = torch.softmax(log_pi + E, 0)
        if torch.allclose(new, qs, rtol=0, atol=1e-15):
            break
        qs = new
    entropy = 0.5 * torch.logdet(2 * math.pi * math.e * S)
    elbo = (qs * (log_pi - qs.log() + E)).sum() + entropy
    return float(elbo), qs, mu


def fit(y, steps=60, step_size=1.0):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=step_size), loss=CVI_ELBO())
    losses = [svi.step(y) for _ in range(steps)]
    return guide, losses


def _parts(guide):
    (chain,) = [b for b in guide.engine.blocks if isinstance(b, RegimeMarkovBlock)]
    (mf,) = [b for b in guide.engine.blocks if "s" in getattr(b, "names", ())]
    return chain, mf


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_fixed_point_is_the_brute_force_mean_field_optimum(dtype):
    y = data(dtype)
    elbo, qs, mu = reference(y)
    assert 0.05 < float(qs[0]) < 0.95  # (a q(s) that is no point mass: the test has teeth)
    guide, losses = fit(y)
    chain, mf = _parts(guide)
    tol = 1e-8 if dtype == torch.float64 else 2e-4
    assert abs(losses[-1] + elbo) < tol * max(1.0, abs(elbo))
    probs = mf.marginal("s").probs.double()
    assert torch.allclose(probs, qs, atol=tol, rtol=0)
    mean = chain.marginals().mean.reshape(-1).double()
    assert torch.allclose(mean, mu, atol=tol * 10, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_reported_loss_is_trace_elbo_of_the_guide(dtype):
    y = data(dtype)
    guide, losses = fit(y, steps=30)
    pyro.set_rng_seed(1)
    elbo = Trace_ELBO(num_particles=100)
    with torch.no_grad():
        draws = torch.tensor([-elbo.loss(model, guide, y) for _ in range(20)], dtype=torch.float64)
    mean, se = float(draws.mean()), float(draws.std() / 20**0.5)
    assert abs(-losses[-1] - mean) < 3 * se + 1e-3


def test_explain_names_the_messages():
    y = data(torch.float64)
    guide, _ = fit(y, steps=1)
    text = guide.explain()
    assert "x_0..x_7: q = Markov gaussian chain" in text
    assert "transition into x_3 given s: the expected natural parameters" in text
    assert "Normal observation of x_3 given s" in text
    assert "the expected prior over q(s) (eq. 20, exact; the default for a global unmarked" in text
    assert "s: exact expected from s, x_0, y_0, x_1" in text


@pytest.mark.parametrize("how", ["marked", "collapse"])
def test_a_marked_regime_stays_summed_out(how):
    """Marked for enumeration (or ``discrete="collapse"``), ``s`` keeps its exact sum in the
    remainder (the collapsed bound is at least the mean field's, docs/architecture.md)."""
    y = data(torch.float64)
    pyro.clear_param_store()
    guide = AutoCVI(model, discrete="collapse") if how == "collapse" else AutoCVI(model)
    guide(y, mark=how == "marked")
    assert not any(isinstance(b, RegimeMarkovBlock) for b in guide.engine.blocks)
    assert "summed out exactly in the remainder" in guide.explain()


# ---------------------------------------------------------------- other forms of the chain
TV = 10


def poisson_chain(y, obs_reads_s=False):
    """Counts through ``exp``: the transition reads ``s`` (the observations keep their CVI
    sites), or only the observations' offset does (one site per value, weighted by q(s))."""
    a, q, c = y.new_tensor([0.9, 0.6]), y.new_tensor([0.2, 0.5]), y.new_tensor([0.0, 0.5])
    s = pyro.sample("s", dist.Categorical(y.new_tensor([0.5, 0.5])))
    x = pyro.sample("x_0", dist.Normal(y.new_zeros(()), 1.0))
    for t in pyro.markov(range(TV)):
        if t > 0:
            if obs_reads_s:
                x = pyro.sample(f"x_{t}", dist.Normal(0.9 * x, 0.5))
            else:
                x = pyro.sample(
                    f"x_{t}", dist.Normal(Vindex(a)[..., s] * x, Vindex(q)[..., s].sqrt())
                )
        eta = x + Vindex(c)[..., s] if obs_reads_s else x
        pyro.sample(f"y_{t}", dist.Poisson(torch.exp(eta)), obs=y[t])


def vector_chain(y):
    """A 2-d state, ``.to_event(1)``, the transition matrix and the noise selected by ``s``."""
    A = y.new_tensor([[[0.9, 0.1], [0.0, 0.8]], [[0.5, 0.0], [0.2, 0.6]]])
    q = y.new_tensor([[0.2, 0.3], [0.5, 0.4]])
    s = pyro.sample("s", dist.Categorical(y.new_tensor([0.5, 0.5])))
    x = pyro.sample("x_0", dist.Normal(y.new_zeros(2), 1.0).to_event(1))
    for t in pyro.markov(range(TV)):
        if t > 0:
            loc = (Vindex(A)[..., s, :, :] @ x.unsqueeze(-1)).squeeze(-1)
            x = pyro.sample(f"x_{t}", dist.Normal(loc, Vindex(q)[..., s, :].sqrt()).to_event(1))
        pyro.sample(f"y_{t}", dist.Normal(x[..., 0] + x[..., 1], 0.5), obs=y[t])


def _vdata(kind, dtype):
    g = torch.Generator().manual_seed(0)
    if kind == "vector":
        return (0.5 * torch.randn(TV, generator=g, dtype=torch.float64).cumsum(0)).to(dtype)
    return torch.poisson(torch.full((TV,), 2.0, dtype=torch.float64), generator=g).to(dtype)


CASES = {
    "poisson, transition reads s": (lambda y: poisson_chain(y), "poisson"),
    "poisson, offset reads s": (lambda y: poisson_chain(y, True), "poisson"),
    "2-d state": (vector_chain, "vector"),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.slow) if "offset" in c else c  # (a minute each)
        for c in CASES
    ],
)
def test_other_forms_report_the_trace_elbo_of_their_guide(case, dtype):
    model_, kind = CASES[case]
    y = _vdata(kind, dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model_)
    svi = SVI(model_, guide, CVI(), loss=CVI_ELBO())
    losses = [svi.step(y) for _ in range(60)]
    assert any(isinstance(b, RegimeMarkovBlock) for b in guide.engine.blocks)
    assert abs(losses[-1] - losses[-2]) < (1e-6 if dtype == torch.float64 else 1e-3)
    pyro.set_rng_seed(1)
    elbo = Trace_ELBO(num_particles=50)
    with torch.no_grad():
        draws = torch.tensor([-elbo.loss(model_, guide, y) for _ in range(20)], dtype=torch.float64)
    mean, se = float(draws.mean()), float(draws.std() / 20**0.5)
    assert abs(-losses[-1] - mean) < 3 * se + 1e-3


@pytest.mark.slow
def test_offset_through_a_link_matches_the_joint_gaussian_block():
    """Only the observations read ``s`` (``Poisson(exp(x_t + c[s]))``): the Kalman block's
    fixed point is the mean-field optimum that a dense joint Gaussian over the states with the
    same sites reaches (the chain's factors given to a Gaussian block by hand: the prior written
    as one MVN site)."""
    y = _vdata("poisson", torch.float64)

    def dense(y):
        c = y.new_tensor([0.0, 0.5])
        s = pyro.sample("s", dist.Categorical(y.new_tensor([0.5, 0.5])))
        L = torch.zeros(TV, TV, dtype=y.dtype)  # x_t = 0.9 x_{t-1} + e_t: x = L e
        for t in range(TV):
            for u in range(t + 1):
                L[t, u] = 0.9 ** (t - u)
        var = torch.full((TV,), 0.25, dtype=y.dtype)
        var[0] = 1.0
        cov = L @ torch.diag(var) @ L.T
        x = pyro.sample("x", dist.MultivariateNormal(y.new_zeros(TV), cov))
        eta = x + Vindex(c)[..., s].unsqueeze(-1)
        pyro.sample("y", dist.Poisson(torch.exp(eta)).to_event(1), obs=y)

    runs = {}
    for name, m in (("chain", lambda y: poisson_chain(y, True)), ("dense", dense)):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoCVI(m)
        svi = SVI(m, guide, CVI(), loss=CVI_ELBO())
        runs[name] = ([svi.step(y) for _ in range(100)][-1], guide)
    assert any(isinstance(b, RegimeMarkovBlock) for b in runs["chain"][1].engine.blocks)
    assert abs(runs["chain"][0] - runs["dense"][0]) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_long_run_is_finite_and_does_not_drift(dtype):
    """The adaptive ``CVI()`` on the regime chain: 600 steps, every step counter moved on by
    20,000 (``bench.long_runs``), 600 more; the last 500 steps' mean loss within 1 nat of the
    best 500 consecutive steps'."""
    from bench.long_runs import Stepper, _svi_counters, verdict

    y = data(dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
    stepper = Stepper(lambda: svi.step(y), lambda: _svi_counters(svi), lambda: 0.0)
    losses = [stepper.step() for _ in range(600)]
    stepper.advance(20_000)
    losses += [stepper.step() for _ in range(600)]
    r = verdict(losses, window=500)
    assert r["finite"] and r["gap"] <= 1.0, r


def test_a_nonlinear_transition_given_s_is_refused_with_advice():
    def bent(y):
        a = y.new_tensor([0.9, 0.5])
        s = pyro.sample("s", dist.Categorical(y.new_tensor(PI)))
        x = pyro.sample("x_0", dist.Normal(y.new_zeros(()), 1.0))
        for t in pyro.markov(range(T)):
            if t > 0:
                x = pyro.sample(f"x_{t}", dist.Normal(Vindex(a)[..., s] * torch.sin(x), 0.5))
            pyro.sample(f"y_{t}", dist.Normal(x, 0.5), obs=y[t])

    pyro.clear_param_store()
    with pytest.raises(ValueError, match="site 'x_1'.*enumerate"):
        AutoCVI(bent)(data(torch.float64))


def test_learnable_parameters_of_a_step_without_s_are_refused_with_advice():
    def learned(y):
        a = pyro.param("a", y.new_tensor(0.8))
        c = y.new_tensor([0.0, 0.5])
        s = pyro.sample("s", dist.Categorical(y.new_tensor(PI)))
        x = pyro.sample("x_0", dist.Normal(y.new_zeros(()), 1.0))
        for t in pyro.markov(range(T)):
            if t > 0:
                x = pyro.sample(f"x_{t}", dist.Normal(a * x, 0.5))
            pyro.sample(f"y_{t}", dist.Normal(x + Vindex(c)[..., s], 0.5), obs=y[t])

    pyro.clear_param_store()
    guide = AutoCVI(learned)
    svi = SVI(learned, guide, CVI(), loss=CVI_ELBO())
    with pytest.raises(ValueError, match="site 'x_1'.*learnable parameters"):
        svi.step(data(torch.float64))
