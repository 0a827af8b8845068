"""AutoCVI follows Pyro's autoguide conventions, each checked on real numbers:

* a proper ``PyroModule``: its CVI parameters are its ``named_parameters()`` and
  ``state_dict()`` (the same tensors as the param store's), it pickles, ``torch.save``\\ s,
  deep-copies and loads a ``state_dict`` into a fresh process (a subprocess), after which it
  draws, summarises and keeps training exactly as the original does;
* it traces under ``torch.jit`` (the traced guide draws what the guide draws);
* ``median()`` / ``quantiles()`` cover every latent, leaves included, deterministically, and
  the median is the 0.5 quantile (against scipy's quantiles);
* ``posterior(name)`` is a torch Distribution with ``mean`` and ``variance`` (and
  ``covariance_matrix`` for Gaussians) for every latent of every zoo model;
* routine step events (shrunk, undone steps) are counted and logged, never warned, so a suite
  that turns warnings into errors runs; a short last minibatch works;
* a Sphere site gets Pyro's reparameterisation hint.
"""

import copy
import io
import logging
import math
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import scipy.stats
import torch
from guide_models import data, mixed
from pyro.infer import SVI
from zoo import ZOO
from zoo.clients import CLIENT_ENTRIES

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks.marginals import marginal_median, marginal_quantiles

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DTYPES = [torch.float32, torch.float64]


def _fit(model, args, steps=5, **kwargs):
    guide = AutoCVI(model, **kwargs)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    losses = [svi.step(*args) for _ in range(steps)]
    return guide, svi, losses


def _draw(guide, args, seed=0):
    pyro.set_rng_seed(seed)
    return {k: v.detach().clone() for k, v in guide(*args).items()}


# --------------------------------------------------------------------------- the module
@pytest.mark.parametrize("dtype", DTYPES)
def test_parameters_are_the_param_stores_tensors(dtype):
    args = data(dtype)
    guide, _, _ = _fit(mixed, args)
    store = pyro.get_param_store()
    params = dict(guide.named_parameters())
    assert set(params) == {"num_steps", "sites.y", "natural0.s", "natural1.s"}
    for name, p in params.items():
        assert p is store.get_param(f"AutoCVI.{name}").unconstrained()
        assert p.dtype == dtype
    assert float(params["num_steps"]) == 5.0
    assert set(guide.state_dict()) == set(params)
    guide.requires_grad_(False)
    assert not any(p.requires_grad for p in guide.parameters())


@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
def test_round_trip_in_process(how):
    args = data()
    guide, _, _ = _fit(mixed, args)
    if how == "pickle":
        new = pickle.loads(pickle.dumps(guide))
    elif how == "torch.save":
        f = io.BytesIO()
        torch.save(guide, f)
        f.seek(0)
        new = torch.load(f, weights_only=False)
    else:
        new = copy.deepcopy(guide)
    assert guide.model is mixed and new.model is mixed  # the live guide keeps its model
    for (n1, p1), (n2, p2) in zip(guide.named_parameters(), new.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2) and p1 is not p2
    before = _draw(guide, args)
    after = _draw(new, args)
    assert set(before) == {"w", "s", "leaf"}
    for k in before:
        assert torch.equal(before[k], after[k]), k
    m1, m2 = guide.median(*args), new.median(*args)
    assert all(torch.equal(m1[k], m2[k]) for k in m1)


_FRESH = """
import sys, io, torch, pyro
sys.path.insert(0, {tests!r})
from guide_models import data, mixed
from pyro.infer import SVI
from pyro_cvi import AutoCVI, CVI, CVI_ELBO
args = data()
how = {how!r}
saved = torch.load({path!r}, weights_only=False)
if how == "state_dict":
    guide = AutoCVI(mixed)
    guide(*args)  # set up (Pyro's guides need a first call too)
    guide.load_state_dict(saved)
else:
    guide = saved
pyro.set_rng_seed(0)
draw = {{k: v.detach() for k, v in guide(*args).items()}}
med = guide.median(*args)
params = {{k: v.detach().clone() for k, v in guide.named_parameters()}}
svi = SVI(mixed, guide, CVI(step_size=0.5), CVI_ELBO())
pyro.set_rng_seed(5)
loss = svi.step(*args)
torch.save(dict(draw=draw, med=med, params=params, loss=loss), {out!r})
"""


@pytest.mark.parametrize("how", ["torch.save", "state_dict"])
def test_round_trip_into_a_fresh_process(how, tmp_path):
    """Saved here, loaded in a new Python process (empty param store, new engine): the same
    parameters, the same draws under the same seed, the same medians and the same next
    training step (a fixed step size: the adaptive control's history is not module state)."""
    args = data()
    guide, _, _ = _fit(mixed, args)
    path, out = tmp_path / "guide.pt", tmp_path / "out.pt"
    torch.save(guide if how == "torch.save" else guide.state_dict(), path)
    expect_params = {k: v.detach().clone() for k, v in guide.named_parameters()}
    draw = _draw(guide, args)
    med = guide.median(*args)
    svi = SVI(mixed, guide, CVI(step_size=0.5), CVI_ELBO())
    pyro.set_rng_seed(5)
    loss = svi.step(*args)
    code = _FRESH.format(tests=str(TESTS), how=how, path=str(path), out=str(out))
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=1200
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = torch.load(out, weights_only=False)
    assert set(got["params"]) == set(expect_params)
    for k, v in expect_params.items():
        assert torch.equal(got["params"][k], v), (k, got["params"][k], v)
    for k in draw:
        assert torch.equal(got["draw"][k], draw[k]), k
    for k in med:
        assert torch.allclose(got["med"][k], med[k], rtol=0, atol=1e-12), k
    assert got["loss"] == pytest.approx(loss, rel=1e-10)


def test_unpicklable_model_is_dropped_with_a_clear_error():
    x, y = data()

    def local_model(x, y):  # a local function does not pickle
        mixed(x, y)

    guide, _, _ = _fit(local_model, (x, y), steps=1)
    new = pickle.loads(pickle.dumps(guide))
    assert new.model is None and guide.model is local_model
    with pytest.raises(ValueError, match="pickled without its model"):
        new(x, y)
    new.model = local_model
    assert torch.equal(_draw(new, (x, y))["w"], _draw(guide, (x, y))["w"])


def test_cleared_param_store_restarts_a_live_guide_but_not_a_restored_one():
    """``pyro.clear_param_store()`` under a live guide starts it afresh (as a new guide); a
    guide restored from a pickle puts its own parameters into the empty store."""
    args = data()
    guide, _, _ = _fit(mixed, args)
    saved = pickle.dumps(guide)
    trained = _draw(guide, args)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    fresh = AutoCVI(mixed)
    fresh_draw = _draw(fresh, args)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    restarted = _draw(guide, args)
    assert all(torch.equal(restarted[k], fresh_draw[k]) for k in trained)
    assert not torch.equal(restarted["w"], trained["w"])
    assert float(dict(guide.named_parameters())["num_steps"]) == 0.0
    pyro.clear_param_store()
    restored = pickle.loads(saved)
    again = _draw(restored, args)
    assert all(torch.equal(again[k], trained[k]) for k in trained)
    assert (
        pyro.get_param_store().get_param("AutoCVI.sites.y").unconstrained()
        is dict(restored.named_parameters())["sites.y"]
    )


# --------------------------------------------------------------------------- JIT
def test_jit_traced_guide_draws_what_the_guide_draws():
    args = data()
    guide, _, _ = _fit(mixed, args)
    pyro.set_rng_seed(1)
    expected = guide.call(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace_module(guide, {"call": args}, check_trace=False)
        f = io.BytesIO()
        torch.jit.save(traced, f)
    f.seek(0)
    loaded = torch.jit.load(f)
    pyro.set_rng_seed(1)
    actual = loaded.call(*args)
    assert len(actual) == len(expected) == 3
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


def test_jit_traced_beta_leaf():
    """A Beta leaf (drawn through torch's Dirichlet sampler) traces and draws the same."""

    def model():
        pyro.sample("z", dist.Beta(torch.tensor(2.0), 3.0))

    guide = AutoCVI(model)
    guide()
    pyro.set_rng_seed(3)
    expected = guide.call()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace_module(guide, {"call": ()}, check_trace=False)
    pyro.set_rng_seed(3)
    assert torch.equal(traced.call()[0], expected[0])


# --------------------------------------------------------------------------- median, quantiles
@pytest.mark.parametrize("dtype", DTYPES)
def test_leaves_have_exact_medians_and_quantiles(dtype):
    """A model of leaves only (q = prior): scipy's quantiles; the median is the 0.5 one."""

    def model():
        pyro.sample("y", dist.LogNormal(torch.tensor(0.0, dtype=dtype), 1.0))
        pyro.sample("z", dist.Beta(torch.tensor(2.0, dtype=dtype), 5.0).expand([2]).to_event(1))
        pyro.sample("g", dist.Gamma(torch.tensor(0.7, dtype=dtype), 2.0))
        pyro.sample("x", dist.Normal(torch.tensor(1.0, dtype=dtype), 3.0))

    guide, _, _ = _fit(model, (), steps=2)
    ps = [0.1, 0.5, 0.9]
    qs, med = guide.quantiles(ps), guide.median()
    expect = {
        "y": scipy.stats.lognorm.ppf(ps, 1.0),
        "z": scipy.stats.beta.ppf(ps, 2.0, 5.0),
        "g": scipy.stats.gamma.ppf(ps, 0.7, scale=0.5),
        "x": scipy.stats.norm.ppf(ps, 1.0, 3.0),
    }
    rtol = (
        3e-4  # the CDF grid's accuracy (float64 and float32 alike), see pyro_cvi.blocks.marginals
    )
    for name, ref in expect.items():
        got = qs[name].reshape(3, -1)
        assert got.dtype == dtype
        ref = torch.tensor(ref, dtype=torch.float64)[:, None].expand_as(got)
        assert torch.allclose(got.double(), ref, rtol=rtol), name
        assert torch.equal(qs[name][1], med[name])
        assert not qs[name].requires_grad


def test_leaf_with_a_parent_is_its_conditional_prior_at_the_parents_mean():
    args = data()
    guide, _, _ = _fit(mixed, args)
    w = guide.posterior("w").mean
    q = guide.posterior("leaf")
    assert torch.allclose(q.mean, w.sum()) and torch.allclose(q.variance, torch.ones(()).double())
    assert torch.allclose(guide.median(*args)["leaf"], w.sum())


def test_marginal_quantiles_against_scipy():
    ps = [0.01, 0.3, 0.5, 0.99]
    a = torch.tensor([0.3, 2.0, 50.0, 1e4], dtype=torch.float64)
    b = torch.tensor([0.2, 3.0, 7.0, 3e4], dtype=torch.float64)
    got = marginal_quantiles(dist.Beta(a, b), ps)
    ref = torch.tensor([scipy.stats.beta.ppf(p, a, b) for p in ps])
    assert torch.allclose(got, ref, rtol=3e-4)
    got = marginal_quantiles(dist.Gamma(a, b), ps)
    ref = torch.tensor([scipy.stats.gamma.ppf(p, a, scale=1 / b) for p in ps])
    assert torch.allclose(got, ref, rtol=1e-3)
    d = dist.Dirichlet(torch.tensor([2.0, 3.0, 5.0], dtype=torch.float64))
    ref = scipy.stats.beta.ppf(0.5, [2.0, 3.0, 5.0], [8.0, 7.0, 5.0])
    assert torch.allclose(marginal_median(d), torch.tensor(ref), rtol=1e-5)
    cat = dist.Categorical(torch.tensor([0.2, 0.3, 0.5]))
    assert marginal_quantiles(cat, [0.1, 0.4, 0.6]).tolist() == [0.0, 1.0, 2.0]


# --------------------------------------------------------------------------- posterior(name)
ZOO_FAST = [
    n
    for n in ZOO
    if n not in ("bnn", "sparse_gamma_def", "subsampled_logistic_sequential") + CLIENT_ENTRIES
]


@pytest.mark.parametrize("name", ZOO_FAST)
def test_every_zoo_posterior_is_a_standard_distribution(name):
    """``mean`` and ``variance`` with the site's shape for every latent; Gaussians also have a
    ``covariance_matrix`` whose diagonal is the variance; continuous means agree with the
    mean of 4000 draws of ``q`` (within 5 standard errors)."""
    entry = ZOO[name]
    d = entry.data()
    guide = AutoCVI(entry.model, **entry.guide_kwargs)
    SVI(entry.model, guide, CVI(), CVI_ELBO()).step(*d.args, **d.kwargs)
    med = guide.median(*d.args, **d.kwargs)
    assert med
    for site in med:
        q = guide.posterior(site)
        assert isinstance(q, torch.distributions.Distribution)
        if isinstance(q, dist.Categorical):  # a label: torch's mean and variance are NaN
            assert torch.allclose(q.probs.sum(-1), torch.ones(()).to(q.probs))
            continue
        mean, var = q.mean, q.variance
        assert mean.shape == var.shape == q.batch_shape + q.event_shape
        assert bool(torch.isfinite(mean).all() and (var >= 0).all()), site
        gaussian = isinstance(q, (dist.Normal, dist.MultivariateNormal)) or (
            isinstance(q, dist.Independent) and isinstance(q.base_dist, dist.Normal)
        )
        if gaussian:
            cov = q.covariance_matrix
            assert torch.allclose(cov.diagonal(dim1=-2, dim2=-1).reshape(var.shape), var)
        if not q.support.is_discrete and q.has_rsample or isinstance(q, dist.Normal):
            pyro.set_rng_seed(0)
            draws = q.sample((4000,))
            se = (var / 4000).sqrt()
            assert bool(((draws.mean(0) - mean).abs() <= 5 * se + 1e-6).all()), site


def _walk_model(T):
    def model(y):
        zero = torch.zeros((), dtype=torch.float64)
        eps = pyro.sample("eps", dist.Normal(zero, 0.3).expand([T]).to_event(1))
        with pyro.plate("obs", T):
            pyro.sample("y", dist.Poisson(eps.cumsum(-1).exp()), obs=y)

    return model


def test_random_walk_posterior_covariance_equals_the_dense_blocks(monkeypatch):
    """The random walk's ``IncrementPosterior`` (Kalman) has the dense block's full
    covariance over the increments (and its mean and variance) to 1e-8."""
    from pyro_cvi.statespace import random_walk

    T = 25
    g = torch.Generator().manual_seed(0)
    y = torch.poisson(torch.full((T,), 2.0, dtype=torch.float64), generator=g)
    out = {}
    for markov in (True, False):
        monkeypatch.setattr(random_walk, "RECOGNISE_RANDOM_WALKS", markov)
        pyro.clear_param_store()
        guide = AutoCVI(_walk_model(T))
        svi = SVI(guide.model, guide, CVI(step_size=1.0), CVI_ELBO())
        for _ in range(10):
            svi.step(y)
        out[markov] = guide
    qm, qd = out[True].posterior("eps"), out[False].joint_posterior("eps")
    assert type(qm).__name__ == "IncrementPosterior"
    assert torch.allclose(qm.mean, qd.mean, atol=1e-8)
    assert torch.allclose(qm.covariance_matrix, qd.covariance_matrix, atol=1e-8)
    assert torch.allclose(qm.covariance_matrix.diagonal(), qm.variance, atol=1e-10)


# --------------------------------------------------------------------------- get_posterior
def test_get_posterior_is_q_over_the_packed_unconstrained_latent():
    """Model order ``w (2), s, leaf``: the Gaussian block's mean and covariance, the Gamma's
    ``log s`` moments in closed form, the leaf's conditional prior; draws agree with the
    moments; ``log_prob`` is each factor's density with its Jacobian."""
    args = data()
    guide, _, _ = _fit(mixed, args)
    p = guide.get_posterior(*args)
    assert p.event_shape == (4,)
    qw, qs, ql = guide.joint_posterior("w"), guide.posterior("s"), guide.posterior("leaf")
    a, b = qs.concentration, qs.rate
    assert torch.allclose(p.mean[:2], qw.mean) and torch.allclose(p.mean[3], ql.mean)
    assert torch.allclose(p.mean[2], torch.digamma(a) - b.log())
    assert torch.allclose(p.variance[2], torch.polygamma(1, a))
    assert torch.allclose(p.covariance_matrix[:2, :2], qw.covariance_matrix)
    assert float(p.covariance_matrix[:2, 2:].abs().max()) == 0.0
    pyro.set_rng_seed(0)
    u = p.sample((20000,))
    se = (p.variance / 20000).sqrt()
    assert bool(((u.mean(0) - p.mean).abs() < 5 * se).all())
    lp = p.log_prob(u[:2])
    s = u[:2, 2].exp()
    ref = qw.log_prob(u[:2, :2]) + qs.log_prob(s) + u[:2, 2] + ql.log_prob(u[:2, 3])
    assert torch.allclose(lp, ref)
    pyro.set_rng_seed(0)
    tr = pyro.poutine.trace(guide.sample_latent).get_trace(*args)
    node = tr.nodes["_AutoCVI_latent"]
    assert node["infer"]["is_auxiliary"] and node["value"].shape == (4,)


# --------------------------------------------------------------------------- minibatches, warnings
def _easyguide_model(batch, subsample, full_size):
    """Pyro's easyguide tutorial model: a drift and 4 local states per data point."""
    drift = pyro.sample("drift", dist.LogNormal(torch.tensor(-1.0), 0.5))
    with pyro.plate("data", full_size, subsample=subsample):
        z = 0.0
        for t in range(len(batch)):
            z = pyro.sample(f"state_{t}", dist.Normal(z, drift))
            pyro.sample(f"obs_{t}", dist.Bernoulli(logits=z), obs=batch[t])


def test_short_last_minibatch_updates_only_its_rows(caplog):
    """Minibatches of 20, 20 and 10 of 50 points; the short one steps its own rows of the
    local natural parameters and leaves the others; no warning is raised on the way."""
    g = torch.Generator().manual_seed(0)
    data = torch.bernoulli(torch.full((4, 50), 0.4), generator=g)
    guide = AutoCVI(
        _easyguide_model,
        create_plates=lambda b, s, n: pyro.plate("data", n, subsample=s),
    )
    svi = SVI(_easyguide_model, guide, CVI(), CVI_ELBO())
    losses = []
    with caplog.at_level(logging.INFO, logger="pyro_cvi"), warnings.catch_warnings():
        warnings.simplefilter("error")
        for beg in (0, 20, 40, 0, 20):
            idx = torch.arange(beg, min(beg + 20, 50))
            losses.append(svi.step(data[:, idx], idx, 50))
        before = {k: v.detach().clone() for k, v in guide.named_parameters()}
        idx = torch.arange(40, 50)
        losses.append(svi.step(data[:, idx], idx, 50))
    assert all(math.isfinite(v) for v in losses)
    local = [k for k in before if k.startswith("natural") and "state_" in k]
    assert local
    after = dict(guide.named_parameters())
    for k in local:
        assert torch.equal(after[k][:40], before[k][:40]), k
    assert any(not torch.equal(after[k][40:], before[k][40:]) for k in local)


def test_routine_step_events_do_not_warn(caplog):
    """Pyro's ``test_subsample_model``: shrunk steps happen and are counted and logged once
    per site, under warnings-as-errors."""

    def model(x, y=None, batch_size=None):
        loc = pyro.param("loc", lambda: torch.tensor(0.0))
        scale = pyro.param("scale", lambda: torch.tensor(1.0), constraint=dist.constraints.positive)
        with pyro.plate("batch", len(x), subsample_size=batch_size):
            bx = pyro.subsample(x, event_dim=0)
            by = pyro.subsample(y, event_dim=0) if y is not None else None
            sigma = pyro.sample("sigma", dist.LogNormal(0.0, 1.0))
            return pyro.sample("obs", dist.Normal(loc + scale * bx, sigma), obs=by)

    pyro.set_rng_seed(123456789)
    x = torch.randn(50)
    with torch.no_grad():
        y = model(x)
    pyro.clear_param_store()
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    with caplog.at_level(logging.INFO, logger="pyro_cvi"), warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            assert math.isfinite(svi.step(x, y, batch_size=20))
    shrunk = [r for r in caplog.records if "shrunk" in r.message]
    assert guide.num_shrunk > len(shrunk) >= 1  # many shrunk elements, one record per site
    assert len({r.message.split("'")[1] for r in shrunk}) == len(shrunk)  # once per site


def test_sphere_site_gets_pyros_reparam_hint():
    def model():
        x = pyro.sample("x", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        y = pyro.sample("y", dist.ProjectedNormal(x))
        pyro.sample("obs", dist.Normal(y, 1), obs=torch.tensor([1.0, 0.0]))

    with pytest.raises(ValueError, match="latent site 'y'.*ProjectedNormalReparam"):
        AutoCVI(model)()
