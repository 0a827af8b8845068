"""Collapsed discrete latents: ``AutoCVI(discrete="collapse")`` (pyro_cvi/messages/collapsed.py).

* the collapsed group's value is ``log sum_z p``: checked against brute-force sums (a mixture)
  and a hand-written forward algorithm with masking (the HMM of examples/hmm.py);
* its gradient is the responsibility-weighted gradient ``E_{p(z | x, theta)}[grad log p]``;
* the loss ``svi.step`` reports is the bound TraceEnum_ELBO estimates for the same guide;
* the collapsed bound is tighter than the mean-field one, and posterior draws of the collapsed
  latents have the exact responsibilities as frequencies.
"""

import math

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import SVI, Predictive, TraceEnum_ELBO, config_enumerate
from pyro.infer.autoguide.initialization import init_to_value
from pyro.ops.indexing import Vindex
from pyro.poutine.util import site_is_subsample
from test_loss_is_bound import (
    F64,
    Case,
    _fit,
    _gen,
    _mean_se,
    assert_loss_is_bound,
    enumerated_hmm_masked,
    gaussian_mixture,
    subsampled_mixture,
)

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, step_sizes
from pyro_cvi.messages.collapsed import collapsed_log_prob, sample_posterior
from pyro_cvi.model.tracing import run_model

DATA = torch.tensor([0.0, 1.0, 10.0, 11.0, 12.0], dtype=F64)


@config_enumerate
def tutorial_gmm(data):
    """Pyro's Gaussian mixture tutorial, K = 2."""
    weights = pyro.sample("weights", dist.Dirichlet(0.5 * data.new_ones(2)))
    scale = pyro.sample("scale", dist.LogNormal(data.new_tensor(0.0), 2.0))
    with pyro.plate("components", 2):
        locs = pyro.sample("locs", dist.Normal(data.new_tensor(0.0), 10.0))
    with pyro.plate("data", len(data)):
        assignment = pyro.sample("assignment", dist.Categorical(weights))
        pyro.sample("obs", dist.Normal(locs[assignment], scale), obs=data)


THETA = {
    "weights": torch.tensor([0.3, 0.7], dtype=F64),
    "scale": torch.tensor(2.5, dtype=F64),
    "locs": torch.tensor([1.0, 9.0], dtype=F64),
}


def test_mixture_contraction_is_the_brute_force_sum_and_its_gradient_the_responsibilities():
    locs = THETA["locs"].clone().requires_grad_(True)
    tr = run_model(tutorial_gmm, {**THETA, "locs": locs}, (DATA,), {}, 1)
    value = collapsed_log_prob(tr, ["assignment", "obs"])
    w, s = THETA["weights"], THETA["scale"]
    joint = w.log() + dist.Normal(locs, s).log_prob(DATA[:, None])  # (N, K)
    expected = torch.logsumexp(joint, -1).sum()
    assert torch.allclose(value, expected, rtol=1e-12)
    (grad,) = torch.autograd.grad(value, locs)
    r = torch.softmax(joint.detach(), -1)
    by_hand = (r * (DATA[:, None] - locs.detach()) / s**2).sum(0)
    assert torch.allclose(grad, by_hand, rtol=1e-10)


def test_masked_hmm_contraction_is_the_forward_algorithm():
    case = enumerated_hmm_masked()
    seqs, lengths = case.args
    g = _gen(9)
    px = dist.Dirichlet(torch.ones(3, 3, dtype=F64)).sample()
    py = torch.rand(3, 4, generator=g, dtype=F64) * 0.8 + 0.1
    tr = run_model(case.model, {"probs_x": px, "probs_y": py}, case.args, {}, 2)
    sites = [n for n in tr.nodes if n[:2] in ("x_", "y_")]
    value = collapsed_log_prob(tr, sites)
    total = 0.0
    for s in range(len(lengths)):
        alpha = torch.log(px[0])  # x_{-1} = 0
        for t in range(int(lengths[s])):
            emit = dist.Bernoulli(py).log_prob(seqs[s, t]).sum(-1)  # (H,)
            if t > 0:
                alpha = torch.logsumexp(alpha[:, None] + px.log(), 0)
            alpha = alpha + emit
        total += float(torch.logsumexp(alpha, 0))
    assert math.isclose(float(value), total, rel_tol=1e-10)


def tutorial_case():
    init = init_to_value(values={"locs": torch.tensor([0.5, 11.0], dtype=F64)})
    step = step_sizes.robbins_monro(0.5, 10.0, 0.7)
    return Case(tutorial_gmm, (DATA,), {"init_loc_fn": init}, step, steps=10, M=20, P=10)


def vectorized_mixture():
    """A mixture written to broadcast over a particle dim (Vindex): vectorize_particles=True
    scores all Monte Carlo draws in one contraction (the particle plate is one more plate)."""
    g = _gen(5)
    x = torch.where(torch.rand(30, generator=g) < 0.4, -2.0, 2.0).to(F64)
    x = x + torch.randn(30, generator=g, dtype=F64)

    def model(x):
        mu = pyro.sample("mu", dist.Normal(x.new_zeros(2), 3.0).to_event(1))
        with pyro.plate("data", len(x)):
            z = pyro.sample("z", dist.Categorical(x.new_ones(2) / 2))
            pyro.sample("obs", dist.Normal(Vindex(mu)[..., z], 1.0), obs=x)

    init = init_to_value(values={"mu": torch.tensor([-1.0, 1.0], dtype=F64)})
    kw = {"init_loc_fn": init, "vectorize_particles": True}
    return Case(model, (x,), kw, step_sizes.robbins_monro(0.5, 10.0, 0.7), steps=10, M=20)


CASES = [tutorial_case, gaussian_mixture, enumerated_hmm_masked, vectorized_mixture]


@pytest.mark.parametrize("make", CASES, ids=[c.__name__ for c in CASES])
def test_collapsed_loss_is_the_traceenum_bound(make):
    pyro.set_rng_seed(0)
    case = make()
    case.guide_kwargs["discrete"] = "collapse"
    case.M = min(case.M, 20)
    if make is enumerated_hmm_masked:
        case.steps, case.M = 2, 10
    guide, svi = _fit(case)
    assert "x_0" not in poutine.trace(guide).get_trace(*case.args).nodes
    referee = TraceEnum_ELBO(max_plate_nesting=2, num_particles=case.P)
    model = config_enumerate(case.model, default="parallel")
    assert_loss_is_bound(
        model, guide, svi, case.args, M=case.M, P=case.P, cvi_repeats=10, referee=referee
    )


def test_subsampled_collapsed_loss_is_unbiased():
    """Minibatches: both CVI's loss and TraceEnum_ELBO's (whose guide draws the minibatch) are
    unbiased estimates of the same full-data bound."""
    pyro.set_rng_seed(0)
    case = subsampled_mixture()
    case.guide_kwargs["discrete"] = "collapse"
    case.steps = 10
    guide, svi = _fit(case)
    (x,) = case.args
    cvi, cvi_se, _ = _mean_se([svi.evaluate_loss(x) for _ in range(60)])
    elbo = TraceEnum_ELBO(max_plate_nesting=1, num_particles=5)
    model = config_enumerate(case.model, default="parallel")
    mc, mc_se, _ = _mean_se([elbo.loss(model, guide, x) for _ in range(60)])
    assert abs(cvi - mc) <= 4 * math.hypot(cvi_se, mc_se), (cvi, cvi_se, mc, mc_se)


@pytest.mark.slow
def test_collapsed_bound_is_tighter_than_mean_field():
    """For any q(theta) q(z), the mean-field bound is below the collapsed one; after fitting,
    the collapsed guide's bound (TraceEnum_ELBO, both guides) is the better one."""
    out = {}
    for mode in ("mean_field", "collapse"):
        pyro.set_rng_seed(0)
        pyro.clear_param_store()
        case = gaussian_mixture()
        case.guide_kwargs.update(discrete=mode, schedule="sequential")
        case.step_size, case.steps = step_sizes.robbins_monro(0.5, 10.0, 0.7), 15
        guide, _ = _fit(case)
        elbo = TraceEnum_ELBO(max_plate_nesting=1, num_particles=50)
        model = config_enumerate(case.model, default="parallel")
        out[mode] = _mean_se([elbo.loss(model, guide, *case.args) for _ in range(6)])
    (mf, mf_se, _), (col, col_se, _) = out["mean_field"], out["collapse"]
    assert col + 4 * math.hypot(mf_se, col_se) < mf, out


def test_posterior_draws_of_the_collapsed_latents():
    draws = torch.stack(
        [
            sample_posterior(tutorial_gmm, THETA, 1, (DATA,), {}).nodes["assignment"]["value"]
            for _ in range(200)
        ]
    )
    joint = THETA["weights"].log() + dist.Normal(THETA["locs"], THETA["scale"]).log_prob(
        DATA[:, None]
    )
    r1 = torch.softmax(joint, -1)[:, 1]
    freq = draws.to(F64).mean(0)
    se = (r1 * (1 - r1) / len(draws)).sqrt()
    assert ((freq - r1).abs() <= 4 * se + 1e-12).all(), (freq, r1)


def test_guide_without_discrete_sites_and_predictive():
    pyro.set_rng_seed(0)
    guide = AutoCVI(tutorial_gmm, discrete="collapse")
    svi = SVI(tutorial_gmm, guide, CVI(step_size=0.2), loss=CVI_ELBO())
    svi.step(DATA)
    tr = poutine.trace(guide).get_trace(DATA)
    latent = {
        n
        for n, s in tr.iter_stochastic_nodes()
        if not site_is_subsample(s) and not s["infer"].get("is_auxiliary")
    }
    assert latent == {"weights", "scale", "locs"}
    with pytest.raises(ValueError, match="'assignment' is summed out"):
        guide.posterior("assignment")
    assert "assignment: no q, summed out exactly" in guide.explain()
    assert "remainder" in guide.explain()  # (its scale has no exact message)
    pred = Predictive(tutorial_gmm, guide=guide, num_samples=7)(DATA)
    assert pred["assignment"].shape == (7, len(DATA))
    draw = guide.sample_discrete(DATA)
    assert draw["assignment"].shape == (len(DATA),) and set(draw) >= {"locs", "assignment"}
