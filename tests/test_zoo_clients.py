"""The zoo's client models (``tests/zoo/clients.py``): each traces in float32 and float64 with
tensors of the data's dtype; the equivalent forms that the NUTS references use have the same
density; the NUTS reference files load and match each model's latent sites and shapes; and
``AutoNormal`` stepped by ``CVI()`` with ``Trace_ELBO`` (``TraceEnum_ELBO`` over enumerated
states) gives finite, falling losses on each."""

import math
import warnings

import pyro
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO, TraceEnum_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.infer.autoguide.initialization import InitMessenger, init_to_median
from zoo import ZOO, clients
from zoo.clients import CANONICAL, CLIENT_ENTRIES, CLIENTS
from zoo.reference import (
    latent_sites,
    load_reference,
    max_plate_nesting,
    reference_path,
    standardised_error,
)

from pyro_cvi import CVI, DivergenceError

F32, F64 = torch.float32, torch.float64
DTYPES = pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
# the markov-loop HMM costs about a second per step: three steps, under slow
SLOW = ("hmm_gaussian",)
#: client models on which CVI() + AutoNormal diverges within its first steps (the loss
#: ``svi.step`` gets grows by orders of magnitude: a DivergenceError at the best q)
DIVERGES = {"stochastic_volatility"}
NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CLIENTS]


def _trace(model, data, at_median=False):
    """One run of ``model``; at the prior median of every latent when ``at_median`` (prior
    draws of the ARMA coefficients overflow its recursion in float32, by design)."""
    if at_median:
        model = InitMessenger(init_to_median())(model)
    with torch.no_grad():
        return poutine.trace(model).get_trace(*data.args, **data.kwargs)


@DTYPES
@pytest.mark.parametrize("name", CLIENTS)
def test_client_model_traces_in_the_data_dtype(name, dtype):
    entry = ZOO[name]
    data = entry.data(dtype)
    model, _ = entry.build(dtype)
    tr = _trace(model, data, at_median=True)
    latents = latent_sites(model, data)
    assert latents, name
    for site in latents:
        assert tr.nodes[site]["value"].dtype == dtype, site
    assert torch.isfinite(tr.log_prob_sum())
    if name not in CLIENT_ENTRIES:  # users.py draws each dtype's data anew
        return
    # the same data in both dtypes (drawn in float64, then cast)
    other = entry.data(F64 if dtype == F32 else F32)
    for a, b in zip(data.args, other.args):
        if torch.is_tensor(a) and a.is_floating_point():
            assert torch.allclose(a.double(), b.double(), rtol=1e-6, atol=1e-6)


def _marginal(model, data, values, nesting):
    """log p(y, values) with every enumerated discrete site summed out."""
    conditioned = poutine.condition(model, data=values)
    elbo = TraceEnum_ELBO(max_plate_nesting=nesting)
    return -elbo.loss(conditioned, lambda *a, **k: None, *data.args, **data.kwargs)


@pytest.mark.parametrize(
    "name, twin",
    [
        ("hmm_gaussian", "hmm_gaussian_discrete"),
        ("exchangeable_mixture", "exchangeable_mixture_msf"),
        ("arma11", "arma11_vectorised"),
    ],
)
def test_the_forms_nuts_runs_have_the_same_density(name, twin):
    """The NUTS references of ``name`` come from ``twin``: same latents, same density at prior
    draws (discrete states summed out by enumeration on one side, inside the distribution or
    by a triangular solve on the other)."""
    entry = ZOO[name]
    data = entry.data(F64)
    other = ZOO[twin].model if twin in ZOO else getattr(clients, twin)
    nesting = max(max_plate_nesting(entry.model, data), 1)
    pyro.set_rng_seed(0)
    for _ in range(3):
        tr = _trace(poutine.block(entry.model, hide_fn=lambda m: m["is_observed"]), data)
        values = {k: tr.nodes[k]["value"] for k in latent_sites(entry.model, data)}
        if name == "arma11":  # moderate coefficients: the prior's tails overflow both forms
            values = {
                k: v.clamp(-0.9, 0.9) if k in ("phi", "theta") else v for k, v in values.items()
            }
        a = _marginal(entry.model, data, values, nesting)
        b = _marginal(other, data, values, nesting)
        assert math.isfinite(a) and a == pytest.approx(b, rel=1e-9, abs=1e-8)


@pytest.mark.parametrize("name", CLIENTS)
def test_nuts_reference_matches_the_model(name):
    """The reference file exists, names exactly the model's continuous latent sites with their
    shapes, holds finite means and positive sds, converged chains (R-hat < 1.1 on the compared
    quantities), and a guide's draws at the reference means score 0 against it."""
    ref = load_reference(name)
    if ref is None:
        pytest.xfail(
            f"no reference at {reference_path(name)} yet: "
            f"python scripts/make_nuts_references.py --models {name}"
        )
    entry = ZOO[name]
    data = entry.data(F64)
    sites = latent_sites(entry.model, data)
    assert set(ref["sites"]) == set(sites)
    for k, shape in sites.items():
        r = ref["sites"][k]
        assert tuple(r["shape"]) == shape, k
        mean, sd = torch.tensor(r["mean"]), torch.tensor(r["sd"])
        assert mean.shape == sd.shape == shape
        assert torch.isfinite(mean).all() and (sd > 0).all(), k
    assert ("canonical" in ref) == (name in CANONICAL)
    assert ref["summary"]["r_hat_max"] < 1.1, ref["summary"]
    assert ref["settings"]["dtype"] == "float64" and ref["settings"]["chains"] >= 4
    # draws equal to the means (raw sites; canonical quantities recomputed from them) score
    # 0 for a model without symmetries
    if name not in CANONICAL:
        means = {k: torch.tensor(ref["sites"][k]["mean"], dtype=F64) for k in sites}
        draws = {k: v.expand(4, *sites[k]) for k, v in means.items()}
        assert standardised_error(name, draws, ref)["mean"] == pytest.approx(0.0, abs=1e-12)


def test_canonical_forms_remove_the_symmetries():
    """Swapping the mixture's components (or the HMM's states, or rotating PPCA's factors)
    leaves the canonical quantities unchanged."""
    g = torch.Generator().manual_seed(0)
    w = torch.rand(5, 2, generator=g)
    d = {"locs": torch.randn(5, 2, generator=g), "weights": w / w.sum(-1, True)}
    d["scale"] = torch.rand(5, generator=g)
    swapped = {"locs": d["locs"].flip(-1), "weights": d["weights"].flip(-1), "scale": d["scale"]}
    for k, v in CANONICAL["exchangeable_mixture"](d).items():
        assert torch.equal(v, CANONICAL["exchangeable_mixture"](swapped)[k])
    t = torch.rand(5, 2, 2, generator=g)
    h = {"locs": d["locs"], "trans": t / t.sum(-1, True), "scale": d["scale"]}
    hs = {"locs": h["locs"].flip(-1), "trans": h["trans"].flip(-1).flip(-2), "scale": h["scale"]}
    for k, v in CANONICAL["hmm_gaussian"](h).items():
        assert torch.equal(v, CANONICAL["hmm_gaussian"](hs)[k])
    W, z = torch.randn(5, 2, 4, generator=g), torch.randn(5, 6, 2, generator=g)
    R = torch.linalg.qr(torch.randn(2, 2, generator=g))[0]
    p = {"W": W, "z": z, "mu": torch.zeros(5, 4), "sigma": torch.ones(5)}
    pr = {**p, "W": R.T @ W, "z": z @ R}
    for k, v in CANONICAL["ppca"](p).items():
        assert torch.allclose(v, CANONICAL["ppca"](pr)[k], atol=1e-5)


@DTYPES
@pytest.mark.parametrize("name", NAMES)
def test_autonormal_with_cvi_runs_on_every_client_model(name, dtype):
    """Five ``CVI()`` steps on ``AutoNormal`` (three on the slow HMM): finite losses and finite
    medians in the data's dtype. (The first steps need not descend: ``CVI()``'s warm-up
    overshoots on some of these models, e.g. stochastic volatility, before it settles.)"""
    entry = ZOO[name]
    data = entry.data(dtype)
    model, _ = entry.build(dtype)
    hidden = model
    if entry.has_discrete:
        hidden = poutine.block(
            model, hide_fn=lambda m: m["type"] == "sample" and "enumerate" in m["infer"]
        )
        loss = TraceEnum_ELBO(max_plate_nesting=max(max_plate_nesting(model, data), 1))
    else:
        loss = Trace_ELBO()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(hidden)
    svi = SVI(model, guide, CVI(), loss)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            for _ in range(3 if name in SLOW else 5):
                losses.append(svi.step(*data.args, **data.kwargs))
        except DivergenceError:
            # stochastic volatility: CVI()'s first steps overshoot and the loss grows by orders
            # of magnitude (8e8 at step 5 in float64, 1e66 by step 56 if nothing stops it);
            # the fit is stopped and the Gaussians are put back to their best q
            assert name in DIVERGES, name
    assert all(math.isfinite(v) for v in losses), losses
    for v in guide.median(*data.args, **data.kwargs).values():
        assert torch.isfinite(v).all() and v.dtype == dtype
