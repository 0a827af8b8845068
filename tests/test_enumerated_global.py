"""A discrete latent the model marks for enumeration is summed out by default, as
``TraceEnum_ELBO`` sums it for a guide with no site for it (the rule:
``pyro_cvi/model/collapsed_group.py``); an unmarked one keeps its mean-field ``q``.

* a global switch beside a conjugate Normal mean: ``q(mu)`` is the exact posterior and the
  reported loss the exact ``-log p(y)`` (closed form, a brute-force sum over the switch);
* a changepoint whose switch moves the means: the reported bound equals TraceEnum_ELBO's
  estimate of the same guide and the brute-force ``-log p(y)``;
* a marked site inside a plate keeps a mean-field ``q`` by default and is summed out with
  ``discrete="collapse"`` (markers set by ``config_enumerate`` / ``infer_config`` /
  ``"sequential"``); an unmarked site sharing a factor with a marked one; ``explain()``.
"""

import math

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import SVI, TraceEnum_ELBO, config_enumerate

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

DTYPES = [torch.float64, torch.float32]
IDS = ["f64", "f32"]


def _switch_model(dtype, marker=True):
    """``mu ~ N(0, 2^2)``, ``y1_i ~ N(mu, 1)``; a global switch ``s`` (3 values) shifts ``y2``."""
    t = lambda v: torch.tensor(v, dtype=dtype)  # noqa: E731
    shift, prior = t([-2.0, 0.0, 3.0]), t([0.3, 0.3, 0.4])
    y1, y2 = t([0.3, 1.1, -0.2, 0.8]), t([2.5, 3.4, 2.9])
    infer = {"enumerate": "parallel"} if marker else {}

    def model():
        mu = pyro.sample("mu", dist.Normal(t(0.0), 2.0))
        s = pyro.sample("s", dist.Categorical(prior), infer=infer)
        with pyro.plate("a", 4):
            pyro.sample("y1", dist.Normal(mu, 1.0), obs=y1)
        with pyro.plate("b", 3):
            pyro.sample("y2", dist.Normal(shift[s], 1.0), obs=y2)

    def exact():
        var = 1.0 / (1.0 / 4.0 + 4.0)
        cov = torch.eye(4, dtype=torch.float64) + 4.0
        lz1 = dist.MultivariateNormal(torch.zeros(4, dtype=torch.float64), cov).log_prob(
            y1.double()
        )
        per = [dist.Normal(shift[k].double(), 1.0).log_prob(y2.double()).sum() for k in range(3)]
        lz2 = torch.logsumexp(prior.double().log() + torch.stack(per), 0)
        return var * float(y1.double().sum()), var, -float(lz1 + lz2)

    return model, exact


def _fit(model, steps, **kw):
    pyro.clear_param_store()
    guide = AutoCVI(model, **kw)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    losses = [svi.step() for _ in range(steps)]
    return guide, losses


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_a_marked_global_switch_is_summed_out_exactly(dtype):
    pyro.set_rng_seed(0)
    model, exact = _switch_model(dtype)
    guide, losses = _fit(model, 3)
    mean, var, neg_log_z = exact()
    q = guide.posterior("mu")
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    assert abs(float(q.mean) - mean) < tol * 10 and abs(float(q.variance) - var) < tol * 10
    assert abs(losses[-1] - neg_log_z) < tol * 100, (losses[-1], neg_log_z)
    assert guide.engine.analysis.collapsed == {"s"}
    assert "s" not in poutine.trace(guide).get_trace().nodes
    text = guide.explain()
    assert "# s: no q, summed out exactly as TraceEnum_ELBO does" in text
    assert "the model marks it infer={'enumerate': 'parallel'}" in text
    with pytest.raises(ValueError, match="'s' is summed out"):
        guide.posterior("s")
    # the same guide under TraceEnum_ELBO: its estimate is the reported bound
    elbo = TraceEnum_ELBO(max_plate_nesting=1, num_particles=500, vectorize_particles=True)
    with torch.no_grad():
        v = torch.tensor([elbo.loss(model, guide) for _ in range(5)], dtype=torch.float64)
    se = float(v.std()) / math.sqrt(5)
    assert abs(float(v.mean()) - losses[-1]) <= 3 * se + tol * 100, (v, losses[-1])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_an_unmarked_switch_keeps_its_mean_field_q(dtype):
    """The same model without the marker (or with ``discrete="mean_field"``): the switch gets
    a Categorical ``q``, the CAVI optimum ``q(s) ~ p(s) p(y2 | s)`` (exact here: ``s`` and
    ``mu`` share no factor)."""
    for marker, kw in ((False, {}), (True, {"discrete": "mean_field"})):
        pyro.set_rng_seed(0)
        model, exact = _switch_model(dtype, marker)
        guide, losses = _fit(model, 3, **kw)
        assert not guide.engine.analysis.collapsed
        q = guide.posterior("s")
        assert isinstance(q, dist.Categorical) or "Categorical" in type(q).__name__
        assert "# s: q = categorical" in guide.explain()
        # exact: s and mu are independent given y, so mean field loses nothing
        assert abs(losses[-1] - exact()[2]) < (1e-6 if dtype == torch.float64 else 1e-3)


def _changepoint(dtype):
    """Ten points; a global switch picks the changepoint (3, 4 or 6) between two means."""
    y = torch.tensor([0.1, -0.4, 0.5, 0.2, 2.9, 3.3, 2.6, 3.1, 3.4, 2.8], dtype=dtype)
    cps, T = torch.tensor([3, 4, 6]), torch.arange(10)

    def model():
        mu1 = pyro.sample("mu1", dist.Normal(torch.tensor(0.0, dtype=dtype), 3.0))
        mu2 = pyro.sample("mu2", dist.Normal(torch.tensor(0.0, dtype=dtype), 3.0))
        s = pyro.sample("s", dist.Categorical(torch.ones(3, dtype=dtype) / 3))
        with pyro.plate("t", 10):
            pyro.sample("y", dist.Normal(torch.where(T < cps[s], mu1, mu2), 0.7), obs=y)

    lz = []
    for k in range(3):
        A = torch.zeros(10, 2, dtype=torch.float64)
        A[T < cps[k], 0], A[T >= cps[k], 1] = 1.0, 1.0
        cov = 9.0 * A @ A.T + 0.49 * torch.eye(10, dtype=torch.float64)
        mvn = dist.MultivariateNormal(torch.zeros(10, dtype=torch.float64), cov)
        lz.append(math.log(1 / 3) + mvn.log_prob(y.double()))
    return config_enumerate(model), -float(torch.logsumexp(torch.stack(lz), 0))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_a_changepoint_switch_reports_the_traceenum_bound(dtype):
    pyro.set_rng_seed(0)
    model, neg_log_z = _changepoint(dtype)
    guide, losses = _fit(model, 60)
    assert guide.engine.analysis.collapsed == {"s"}
    reported = torch.tensor(losses[-10:], dtype=torch.float64)
    r_mean, r_se = float(reported.mean()), float(reported.std()) / math.sqrt(10)
    elbo = TraceEnum_ELBO(max_plate_nesting=1, num_particles=1000, vectorize_particles=True)
    with torch.no_grad():
        v = torch.tensor([elbo.loss(model, guide) for _ in range(5)], dtype=torch.float64)
    v_mean, v_se = float(v.mean()), float(v.std()) / math.sqrt(5)
    assert abs(r_mean - v_mean) <= 3 * math.hypot(r_se, v_se) + 1e-5, (r_mean, v_mean)
    # a bound on -log p(y) (brute force over s, Gaussian integrals over the means), and
    # tight: p(s | y) is concentrated, so the posterior of the means is nearly Gaussian
    assert v_mean >= neg_log_z - 3 * v_se - 1e-5, (v_mean, neg_log_z)
    assert v_mean - neg_log_z < 5e-3, (v_mean, neg_log_z)


def _mixture(dtype, wrap):
    """Two components with known unit scale; the assignments are plate-local."""
    data = torch.tensor([-2.1, -1.7, -2.5, 1.9, 2.2, 2.4], dtype=dtype)

    def model():
        locs = pyro.sample("locs", dist.Normal(torch.zeros(2, dtype=dtype), 3.0).to_event(1))
        with pyro.plate("data", 6):
            z = pyro.sample("z", dist.Categorical(torch.ones(2, dtype=dtype) / 2))
            pyro.sample("x", dist.Normal(locs[z], 1.0), obs=data)

    return wrap(model)


def _infer_config(model):
    def config(msg):
        return {"enumerate": "sequential"} if msg["name"] == "z" else {}

    return poutine.infer_config(model, config)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("wrap", [config_enumerate, _infer_config], ids=["config", "infer"])
def test_a_marked_plate_local_site(dtype, wrap):
    """By default a marked site inside a plate keeps a mean-field ``q`` (the measured rule);
    ``discrete="collapse"`` sums it out (a ``"sequential"`` marker too), and the reported
    bound is TraceEnum_ELBO's estimate of the same guide."""
    model = _mixture(dtype, wrap)
    init = {"locs": torch.tensor([-1.0, 1.0], dtype=dtype)}
    kw = dict(init_loc_fn=lambda site: init[site["name"]], init_scale=0.1)
    pyro.set_rng_seed(0)
    guide, _ = _fit(model, 1, **kw)
    assert not guide.engine.analysis.collapsed
    assert "# z: q = categorical" in guide.explain()
    assert "marked for enumeration but plate-local: mean field by default" in guide.explain()
    pyro.set_rng_seed(0)
    guide, losses = _fit(model, 15, discrete="collapse", **kw)
    assert guide.engine.analysis.collapsed == {"z"}
    assert "z" not in poutine.trace(guide).get_trace().nodes
    reported = torch.tensor(losses[-10:], dtype=torch.float64)
    r_mean, r_se = float(reported.mean()), float(reported.std()) / math.sqrt(10)
    elbo = TraceEnum_ELBO(max_plate_nesting=1, num_particles=100)
    enumerated = config_enumerate(_mixture(dtype, lambda m: m))
    with torch.no_grad():
        v = torch.tensor([elbo.loss(enumerated, guide) for _ in range(5)], dtype=torch.float64)
    v_mean, v_se = float(v.mean()), float(v.std()) / math.sqrt(5)
    assert abs(r_mean - v_mean) <= 3 * math.hypot(r_se, v_se) + 1e-5, (r_mean, v_mean)
    # the components are found: q of the locations near the two clusters
    m = guide.posterior("locs").mean
    assert float(m[0]) < -1.5 and float(m[1]) > 1.5, m


def test_an_unmarked_site_sharing_a_factor_with_a_marked_one_is_summed_with_it():
    data = torch.tensor([0.2, 2.9, 3.1], dtype=torch.float64)

    def model():
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 3.0))
        a = pyro.sample("a", dist.Bernoulli(torch.tensor(0.5, dtype=torch.float64)))
        b = pyro.sample(
            "b",
            dist.Bernoulli(torch.tensor(0.5, dtype=torch.float64)),
            infer={"enumerate": "parallel"},
        )
        with pyro.plate("n", 3):
            pyro.sample("y", dist.Normal(mu + a + 2 * b, 1.0), obs=data)

    pyro.set_rng_seed(0)
    guide, _ = _fit(model, 2)
    assert guide.engine.analysis.collapsed == {"a", "b"}
    text = guide.explain()
    assert "# a: no q, summed out exactly" in text
    assert "(shares factor 'y' with a summed-out site)" in text


def test_posterior_draws_of_a_summed_out_switch():
    """``sample_discrete`` draws the switch from ``p(s | y, mu)`` (``infer_discrete``); here
    ``s`` and ``mu`` share no factor, so the frequencies are ``p(s | y2)``."""
    dtype = torch.float64
    pyro.set_rng_seed(0)
    model, _ = _switch_model(dtype)
    guide, _ = _fit(model, 2)
    shift, prior = torch.tensor([-2.0, 0.0, 3.0], dtype=dtype), torch.tensor([0.3, 0.3, 0.4])
    y2 = torch.tensor([2.5, 3.4, 2.9], dtype=dtype)
    logits = prior.double().log() + dist.Normal(shift[:, None], 1.0).log_prob(y2).sum(-1)
    exact = torch.softmax(logits, 0)
    draws = torch.stack([guide.sample_discrete()["s"] for _ in range(300)])
    freq = torch.stack([(draws == k).double().mean() for k in range(3)])
    se = (exact * (1 - exact) / 300).sqrt()
    assert ((freq - exact).abs() <= 4 * se + 1e-3).all(), (freq, exact)
    assert float(exact[2]) > 0.9  # (the data favour the shift 3)
