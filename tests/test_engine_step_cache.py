"""What a step keeps from the last one is dropped by what a user can change between steps.

A Markov block keeps its site rows, their gathered form (steps, coefficients, ``w``, ``b``) and
the marginals while the trace, the sites' tensors and their versions and the offsets are the
same; a block with per-point sites of a subsampled plate keeps the running sum less the
minibatch's rows for the step. Each change below must give the loss (and ``q``) a guide
computes from scratch for the same site values and data: an edited site parameter (in place),
new data, data edited in place, another value of a model argument (a hyperparameter), and a
learnable hyperparameter stepped by the inner optimizer. Float32 and float64.
"""

import itertools

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.gaussian.sites import site_to_row
from pyro_cvi.statespace import Matern32, markov_gp

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
_PREFIXES = itertools.count()


def rtol(dtype):
    return 1e-10 if dtype == torch.float64 else 2e-4


def counts(T, dtype):
    g = torch.Generator().manual_seed(0)
    t = torch.arange(T, dtype=torch.float64)
    y = torch.poisson(torch.exp(torch.sin(t / 9.0)), generator=g)
    return t.to(dtype), y.to(dtype)


def gp_model(t, y, lengthscale=8.0):
    f = markov_gp("x", t, Matern32(lengthscale=lengthscale, variance=1.0))
    with pyro.plate("t", len(t)):
        pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)


def learnable_gp_model(t, y):
    ls = pyro.param("ls", lambda: torch.tensor(8.0, dtype=t.dtype), dist.constraints.positive)
    f = markov_gp("x", t, Matern32(lengthscale=ls, variance=1.0))
    with pyro.plate("t", len(t)):
        pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)


def fresh_loss(model, guide, args, kwargs):
    """``(-ELBO, q's means)`` of a new guide given ``guide``'s site values, at ``args``."""
    ref = AutoCVI(model, num_quad_points=10, prefix=f"ref{next(_PREFIXES)}")
    CVI_ELBO().loss(model, ref, *args, **kwargs)  # (its set-up)
    store = pyro.get_param_store()
    with torch.no_grad():
        for name in guide.engine.param_names():
            theirs = ref.param_prefix + name[len(guide.param_prefix) :]
            store[theirs].unconstrained().copy_(store[name].unconstrained())
    loss = CVI_ELBO().loss(model, ref, *args, **kwargs)
    return loss, ref.posterior("x").mean


def assert_close(a, b, dtype):
    torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=rtol(dtype), atol=0)


def edit_site(guide, t, y, kwargs):
    with torch.no_grad():
        pyro.get_param_store()[f"{guide.param_prefix}.sites.y"].unconstrained().mul_(0.8)
    return (t, y), kwargs


def new_data(guide, t, y, kwargs):
    return (t, y + 1), kwargs


def data_in_place(guide, t, y, kwargs):
    y.add_(2)
    return (t, y), kwargs


def new_argument(guide, t, y, kwargs):
    return (t, y), {"lengthscale": 5.0}


@DTYPES
@pytest.mark.parametrize(
    "change",
    [None, edit_site, new_data, data_in_place, new_argument],
    ids=["none", "site-edited", "new-data", "data-in-place", "new-argument"],
)
def test_markov_step_after_a_change_is_a_fresh_guides(dtype, change):
    pyro.clear_param_store()
    t, y = counts(60, dtype)
    guide = AutoCVI(gp_model, num_quad_points=10)
    svi = SVI(gp_model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    kwargs = {}
    for _ in range(4):
        svi.step(t, y)
    block = guide.engine.blocks[0]
    builds = block.offset_builds
    if change is not None:
        (t, y), kwargs = change(guide, t, y, kwargs)
    expected, _ = fresh_loss(gp_model, guide, (t, y), kwargs)
    assert_close(svi.step(t, y, **kwargs), expected, dtype)  # (the loss before the step)
    expected, mean = fresh_loss(gp_model, guide, (t, y), kwargs)  # (at the new sites)
    assert_close(svi.evaluate_loss(t, y, **kwargs), expected, dtype)
    assert_close(guide.posterior("x").mean, mean, dtype)
    if change is None:  # nothing the offsets read changed
        assert block.offset_builds == builds
    elif change is edit_site:  # sites set from outside: every block afresh, offsets once
        assert block.offset_builds == builds + 1


@DTYPES
def test_markov_step_with_a_stepped_hyperparameter_is_a_fresh_guides(dtype):
    pyro.clear_param_store()
    t, y = counts(60, dtype)
    guide = AutoCVI(learnable_gp_model, num_quad_points=10)
    svi = SVI(learnable_gp_model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    for _ in range(4):
        svi.step(t, y)
    ls = float(pyro.param("ls").detach())
    expected, _ = fresh_loss(learnable_gp_model, guide, (t, y), {})
    assert_close(svi.step(t, y), expected, dtype)
    assert float(pyro.param("ls").detach()) != ls  # (the inner optimizer moved it)
    expected, mean = fresh_loss(learnable_gp_model, guide, (t, y), {})
    assert_close(svi.evaluate_loss(t, y), expected, dtype)
    assert_close(guide.posterior("x").mean, mean, dtype)


def minibatch_model(X, y):
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0], subsample_size=10) as idx:
        pyro.sample("y", dist.Bernoulli(logits=X[idx] @ w), obs=y[idx])


@DTYPES
def test_plate_sums_less_the_minibatch_follow_the_sites(dtype):
    """The running sum less this minibatch's stored rows, kept for the step, is recomputed
    when the sites or the sum are edited in place, and for the next minibatch."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(100, 3, generator=g, dtype=torch.float64).to(dtype)
    y = torch.bernoulli(torch.sigmoid(X @ torch.ones(3, dtype=dtype)), generator=g)
    guide = AutoCVI(minibatch_model)
    svi = SVI(minibatch_model, guide, CVI(), loss=CVI_ELBO())
    for _ in range(5):
        svi.step(X, y)
    block = guide.engine.blocks[0]
    store = pyro.get_param_store()
    sites, total = (store[f"{guide.param_prefix}.{k}.y"] for k in ("sites", "site_sums"))

    def expected():
        idx, A, c = block._batch["y"]
        s = sites.detach()[idx]
        w, b = site_to_row(s[:, 0], s[:, 1], c)
        t = total.detach()
        return t[:, -1] - A.T @ b, t[:, :-1] - A.T @ (w[:, None] * A)

    for edit in (None, lambda: sites.mul_(0.5), lambda: total.add_(1.0), "next"):
        if edit == "next":
            svi.step(X, y)  # (a new minibatch)
        elif edit is not None:
            with torch.no_grad():
                edit()
        got = block.plate_extras()[0]
        for a, b in zip(got, expected()):
            torch.testing.assert_close(a, b, rtol=rtol(dtype), atol=rtol(dtype))
