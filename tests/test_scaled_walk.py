"""A random walk written with a plate and ``cumsum`` whose scales are remainder latents.

``eps ~ Normal(b, s(sigma_level))`` in a plate, ``x = eps.cumsum(-1)``,
``y ~ Normal(2 x + 0.3, sigma_obs)`` in a plate is the ``pyro.markov`` loop
``x_t ~ Normal(x_(t-1) + 0.1, sigma_level)``, ``y_t ~ Normal(2 x_t + 0.3, sigma_obs)`` written
the vectorised way; both take the Kalman block beside the scales (``blocks/scaled_walk.py``,
``blocks/scaled_markov.py``). Checked: the two spellings' steps from the same ``q`` (losses and
``q(x)``), the rule and its overrides with ``explain()``'s wording, where it does not apply,
the guide's site ``eps`` in its plate, and (slow) the fit against the exact grid answer and
the Monte Carlo path's reported loss against ``Trace_ELBO``.
"""

import functools
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks.scaled_markov import ScaledMarkovBlock
from pyro_cvi.model.prior_factor import JOINT_MAX_DIM

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def walk(y, start=None):
    """The walk in the plate-and-cumsum spelling (the first increment is the start,
    ``N(0, 1)``, or ``N(0, sigma_level)`` with ``start="latent"``)."""
    T = y.shape[0]
    sl = pyro.sample("sigma_level", dist.HalfNormal(y.new_tensor(1.0)))
    so = pyro.sample("sigma_obs", dist.HalfNormal(y.new_tensor(1.0)))
    loc = torch.cat([y.new_zeros(1), y.new_full((T - 1,), 0.1)])
    first = sl.reshape(1) if start == "latent" else y.new_ones(1)
    with pyro.plate("time", T):
        eps = pyro.sample("eps", dist.Normal(loc, torch.cat([first, sl.expand(T - 1)])))
    with pyro.plate("obs_time", T):
        pyro.sample("y", dist.Normal(2.0 * eps.cumsum(-1) + 0.3, so), obs=y)


def loop(y, start=None):
    """The same density as :func:`walk`, a ``pyro.markov`` loop."""
    sl = pyro.sample("sigma_level", dist.HalfNormal(y.new_tensor(1.0)))
    so = pyro.sample("sigma_obs", dist.HalfNormal(y.new_tensor(1.0)))
    x = pyro.sample("x_0", dist.Normal(y.new_tensor(0.0), sl if start == "latent" else 1.0))
    pyro.sample("y_0", dist.Normal(2.0 * x + 0.3, so), obs=y[0])
    for t in pyro.markov(range(1, len(y))):
        x = pyro.sample(f"x_{t}", dist.Normal(x + 0.1, sl))
        pyro.sample(f"y_{t}", dist.Normal(2.0 * x + 0.3, so), obs=y[t])


def data(T, dtype):
    g = torch.Generator().manual_seed(3)
    x = (0.3 * torch.randn(T, generator=g, dtype=torch.float64)).cumsum(0)
    return (2 * x + 0.5 * torch.randn(T, generator=g, dtype=torch.float64)).to(dtype)


def setup(model, y, families=None):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model, families=families)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    guide(y)
    return guide, svi


def _chain(guide):
    found = [b for b in guide.engine.blocks if isinstance(b, ScaledMarkovBlock)]
    return found[0] if found else None


def steps_from(model, y, families, start, steps):
    """``(guide, loss, start)``: ``steps`` steps of ``model`` from the parameters ``start`` (the
    first set-up's own where ``None``) and random stream 1, then the loss of the ``q`` reached:
    two spellings compared from the same ``q``."""
    guide, svi = setup(model, y, families)
    store = pyro.get_param_store()
    if start is None:
        start = {k: v.detach().clone() for k, v in store.items()}
    for k, v in start.items():
        store[k].data.copy_(v)
    pyro.set_rng_seed(1)
    for _ in range(steps):
        svi.step(y)
    with torch.no_grad():
        loss = svi.evaluate_loss(y)
    return guide, loss, start


@DTYPES
@pytest.mark.parametrize("first", ["fixed", "latent"])
def test_the_cumsum_spelling_steps_as_the_markov_loop(first, dtype):
    """From the same remainder ``q`` and the same random stream, three steps of the walk's block
    and of the loop's give the same losses and the same ``q(x)``; the guide samples ``eps`` in
    its plate (``q(eps)``: the increments of ``q(x)``). ``first``: the start's scale fixed, or
    ``sigma_level`` (the loop's first prior then shared with the remainder too)."""
    T, steps = 12, 3
    y = data(T, dtype)
    out = {}
    start = None
    spellings = (("walk", walk, {"eps": "gaussian"}), ("loop", loop, None))
    for name, model, families in spellings:
        model = functools.partial(model, start=first)
        guide, loss, start = steps_from(model, y, families or {"x_3": "gaussian"}, start, steps)
        block = _chain(guide)
        assert block is not None and guide.engine.analysis.remainder == [
            "sigma_level",
            "sigma_obs",
        ]
        out[name] = (loss, block.post.mean[:, 0], block.post.cov[:, 0, 0], guide)
    tol = 1e-10 if dtype == torch.float64 else 1e-3
    (lw, mw, vw, gw), (ll, ml, vl, _) = out["walk"], out["loop"]
    assert abs(lw - ll) < tol * max(1.0, abs(ll)), (lw, ll)
    assert torch.allclose(mw, ml, rtol=tol, atol=tol) and torch.allclose(vw, vl, rtol=tol, atol=tol)
    tr = pyro.poutine.trace(gw).get_trace(y)
    site = tr.nodes["eps"]
    assert site["value"].shape == (T,) and site["value"].dtype == dtype
    assert [f.name for f in site["cond_indep_stack"]] == ["time"]
    q = gw.engine.blocks[0].marginal("eps")
    assert torch.allclose(q.mean, torch.cat([mw[:1], mw.diff()]), rtol=tol, atol=tol)


@DTYPES
def test_the_rule_and_the_overrides(dtype):
    """``T + 2`` coordinates: the joint at ``JOINT_MAX_DIM``, the block one beyond, with the
    loop's wording; ``families`` on ``eps`` forces either side."""
    T = JOINT_MAX_DIM - 2
    at, _ = setup(walk, data(T, dtype))
    assert _chain(at) is None and "eps" in at.engine.analysis.remainder
    beyond, _ = setup(walk, data(T + 1, dtype))
    assert _chain(beyond) is not None and beyond.engine.analysis.remainder == [
        "sigma_level",
        "sigma_obs",
    ]
    text = beyond.explain()
    assert f"the joint would hold {T + 3} coordinates, more than {JOINT_MAX_DIM}" in text
    assert "transition into eps given sigma_level, sigma_obs: N(a x_(t-1) + b, 1 / E[1/s^2])" in (
        text
    )
    assert "the expected row (h, E[1/s^2], E[1/s^2] (y - c))" in text
    named, _ = setup(walk, data(10, dtype), {"eps": "gaussian"})
    assert _chain(named) is not None
    assert "named families={...: 'gaussian'} on a chain site" in named.explain()
    joint, _ = setup(walk, data(T + 10, dtype), {"eps": "joint"})
    assert _chain(joint) is None and "eps" in joint.engine.analysis.remainder


def volatility(r):
    """Stochastic volatility: the walk's states read by the observations' scale."""
    s = pyro.sample("step_scale", dist.Exponential(r.new_tensor(10.0)))
    with pyro.plate("steps", r.shape[0]):
        inc = pyro.sample("inc", dist.Normal(r.new_tensor(0.0), s))
    with pyro.plate("time", r.shape[0]):
        pyro.sample("r", dist.Normal(r.new_tensor(0.0), (inc.cumsum(-1) / 2).exp()), obs=r)


def counts(y):
    """A Poisson observation of the walk: not Gaussian in the states."""
    s = pyro.sample("s", dist.HalfNormal(y.new_tensor(1.0)))
    with pyro.plate("time", y.shape[0]):
        eps = pyro.sample("eps", dist.Normal(y.new_tensor(0.0), s))
        pyro.sample("y", dist.Poisson(eps.cumsum(-1).exp()), obs=y)


def shifted(y):
    """The observation's loc reads another latent beside the walk."""
    s = pyro.sample("s", dist.HalfNormal(y.new_tensor(1.0)))
    mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 1.0))
    with pyro.plate("time", y.shape[0]):
        eps = pyro.sample("eps", dist.Normal(y.new_tensor(0.0), s))
        pyro.sample("y", dist.Normal(eps.cumsum(-1) + mu, 0.5), obs=y)


@DTYPES
@pytest.mark.parametrize("model", [volatility, counts, shifted])
def test_where_the_walk_block_does_not_apply(model, dtype):
    """A scale that reads the states, a Poisson observation, a loc reading another latent: no
    walk block (the site stays where it was), even named ``'gaussian'``."""
    y = data(JOINT_MAX_DIM + 2, dtype).abs().round()
    guide, _ = setup(model, y)
    assert _chain(guide) is None
    named, _ = setup(model, y, {"inc" if model is volatility else "eps": "gaussian"})
    assert _chain(named) is None


def exact_walk(y: torch.Tensor, n: int = 120) -> float:
    """``-log p(y)`` of :func:`walk` on a grid of ``(log sigma_level, log sigma_obs)``, each
    point's ``log p(y | scales)`` by a Kalman filter."""
    y = y.double()
    a = torch.linspace(-5.0, 1.5, n, dtype=torch.float64)
    la, lb = (v.reshape(-1) for v in torch.meshgrid(a, a, indexing="ij"))
    q, r = torch.exp(2 * la), torch.exp(2 * lb)
    m, P, ll = torch.zeros_like(q), torch.ones_like(q), torch.zeros_like(q)
    for t in range(len(y)):
        if t > 0:
            m, P = m + 0.1, P + q
        S = 4.0 * P + r
        ll = ll - 0.5 * (torch.log(2 * math.pi * S) + (y[t] - 2.0 * m - 0.3) ** 2 / S)
        K = 2.0 * P / S
        m, P = m + K * (y[t] - 2.0 * m - 0.3), (1 - 2.0 * K) * P
    half = dist.HalfNormal(torch.tensor(1.0, dtype=torch.float64))
    logp = ll + half.log_prob(la.exp()) + la + half.log_prob(lb.exp()) + lb
    h = float(a[1] - a[0])
    return float(-(torch.logsumexp(logp, 0) + 2 * math.log(h)))


def _bound(model, guide, y, n=6, particles=40):
    with torch.no_grad():
        v = torch.tensor(
            [Trace_ELBO(num_particles=particles).loss(model, guide, y) for _ in range(n)],
            dtype=torch.float64,
        )
    return float(v.mean()), float(v.std() / math.sqrt(n))


@pytest.mark.slow
@DTYPES
def test_the_fit_against_the_exact_grid_answer(dtype):
    """T = 70 (the rule's default), 150 steps: the bound (``Trace_ELBO``) between ``-log p(y)``
    less 3 SE and ``-log p(y) + 3`` nats (mean field between the walk and its scales), and the
    reported loss within 3 SE (+ 0.05) of it."""
    T = 70
    y = data(T, dtype)
    guide, svi = setup(walk, y)
    assert _chain(guide) is not None
    for _ in range(150):
        svi.step(y)
    bound, se = _bound(walk, guide, y)
    exact = exact_walk(y)
    assert exact - 3 * se - 0.05 < bound < exact + 3.0, (bound, se, exact)
    with torch.no_grad():
        reported = torch.tensor([svi.evaluate_loss(y) for _ in range(10)], dtype=torch.float64)
    assert abs(float(reported.mean()) - bound) < 3 * se + 0.05, (reported.mean(), bound, se)


def shifted_scale(y):
    """Every increment's scale ``sigma_level + 1`` (``log s`` not affine in the unconstrained
    value; the model broadcasts over a particle plate)."""
    sl = pyro.sample("sigma_level", dist.HalfNormal(y.new_tensor(1.0)))
    so = pyro.sample("sigma_obs", dist.HalfNormal(y.new_tensor(1.0)))
    with pyro.plate("time", y.shape[0]):
        eps = pyro.sample("eps", dist.Normal(0.1, sl + 1.0))
    with pyro.plate("obs_time", y.shape[0]):
        pyro.sample("y", dist.Normal(2.0 * eps.cumsum(-1) + 0.3, so), obs=y)


@pytest.mark.slow
@DTYPES
def test_the_monte_carlo_walk_against_trace_elbo(dtype):
    """``s = sigma_level + 1``: the walk's block with ``E[1/s^2]`` by Monte Carlo over
    ``q(u)``; the reported loss within 3 SE of ``Trace_ELBO``."""
    T = 30
    y = data(T, dtype)
    model = shifted_scale
    guide, svi = setup(model, y, {"eps": "gaussian"})
    assert _chain(guide) is not None and "E[1/s^2] by Monte Carlo" in guide.explain()
    for _ in range(20):
        svi.step(y)
    bound, se = _bound(model, guide, y)
    with torch.no_grad():
        reported = torch.tensor([svi.evaluate_loss(y) for _ in range(10)], dtype=torch.float64)
    tol = 3 * math.hypot(se, float(reported.std()) / math.sqrt(10)) + 0.05
    assert abs(float(reported.mean()) - bound) < tol, (reported.mean(), bound, se)


@DTYPES
@pytest.mark.parametrize("weight", ["ones", "weights"])
def test_a_tensor_weighted_observation(weight, dtype):
    """``poutine.scale`` with a tensor on the walk's observations: all ones is no weight (the
    walk block); other weights tempered sites, which the block does not read (not taken), and
    no error either way."""
    T = JOINT_MAX_DIM + 6
    y = data(T, dtype)
    w = torch.ones(T, dtype=dtype) if weight == "ones" else torch.linspace(0.5, 1.5, T, dtype=dtype)

    def weighted(y):
        with pyro.poutine.scale(scale=w):
            walk(y)

    guide, svi = setup(weighted, y)
    assert (_chain(guide) is not None) == (weight == "ones")
    assert math.isfinite(svi.step(y))


K_SERIES = 3


def batched(y):
    """``K`` walks in a plate left of the time plate, ``x = eps.cumsum(-1)`` (time last)."""
    sl = pyro.sample("sigma_level", dist.HalfNormal(y.new_tensor(1.0)))
    so = pyro.sample("sigma_obs", dist.HalfNormal(y.new_tensor(1.0)))
    with pyro.plate("series", y.shape[0], dim=-2), pyro.plate("time", y.shape[1], dim=-1):
        eps = pyro.sample("eps", dist.Normal(y.new_tensor(0.1), sl))
        pyro.sample("y", dist.Normal(2.0 * eps.cumsum(-1) + 0.3, so), obs=y)


def time_first(y):
    """:func:`batched` with the time plate first (``y`` transposed)."""
    sl = pyro.sample("sigma_level", dist.HalfNormal(y.new_tensor(1.0)))
    so = pyro.sample("sigma_obs", dist.HalfNormal(y.new_tensor(1.0)))
    with pyro.plate("time", y.shape[0], dim=-2), pyro.plate("series", y.shape[1], dim=-1):
        eps = pyro.sample("eps", dist.Normal(y.new_tensor(0.1), sl))
        pyro.sample("y", dist.Normal(2.0 * eps.cumsum(0) + 0.3, so), obs=y)


@DTYPES
def test_a_batched_walk_with_time_last_steps_as_time_first(dtype):
    """``K`` walks whose time dim is the last: the block takes them with the time dim found
    (a state of ``K``), and from the same ``q`` it steps as the time-first spelling."""
    T, steps = 25, 3
    y = torch.stack([data(T, dtype) + k for k in range(K_SERIES)])  # (K, T)
    out, start = {}, None
    for name, model, obs in (("last", batched, y), ("first", time_first, y.T.contiguous())):
        guide, loss, start = steps_from(model, obs, None, start, steps)
        block = _chain(guide)
        assert block is not None and block.chain.state_dim == K_SERIES
        out[name] = (loss, block.post.mean, guide)
    tol = 1e-9 if dtype == torch.float64 else 1e-3
    (la, ma, ga), (lb, mb, _) = out["last"], out["first"]
    assert abs(la - lb) < tol * max(1.0, abs(lb)), (la, lb)
    assert torch.allclose(ma, mb, rtol=tol, atol=tol)
    assert ga.engine.blocks[0].chain.increments.dim == 1
    q = ga.engine.blocks[0].marginal("eps")
    assert q.mean.shape == (K_SERIES, T)
    assert torch.allclose(q.mean.T.cumsum(0), mb, rtol=tol, atol=tol)
