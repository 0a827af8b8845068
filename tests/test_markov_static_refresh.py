"""The Markov block's refresh on a static model's trace: again on the trace it last refreshed
from, with the sites it was solved for and nothing with a graph, it returns at once (the same
prior, rows and ``q``). Every loss and site bit for bit as without that return, also after a
site is edited in place between steps; learned hyperparameters never take it."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from test_markov_fast_path import assert_same

import pyro_cvi.blocks.markov as markov
from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.statespace import Matern12, Matern32, markov_gp

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def data(T, dtype):
    g = torch.Generator().manual_seed(2)
    t = torch.arange(T, dtype=torch.float64)
    y = torch.poisson(torch.exp(torch.sin(t / 7.0)), generator=g)
    return t.to(dtype), y.to(dtype)


def gp_model(kernel, learn=False):
    def model(t, y):
        k = kernel(lengthscale=5.0, variance=1.0)
        if learn:
            ls = pyro.param(
                "ls", torch.tensor(5.0, dtype=t.dtype), constraint=dist.constraints.positive
            )
            k = kernel(ls, 1.0)
        f = markov_gp("x", t, k)
        with pyro.plate("t", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

    return model


class Watch:
    """Counts refreshes and full refreshes (those that read the prior off the trace); with
    ``off``, every refresh takes the full path."""

    def __init__(self, monkeypatch, off=False):
        self.calls = self.full = self.priors = 0
        refresh, prior = markov.MarkovBlock.refresh, markov.MarkovBlock._chain_prior

        def counted_refresh(block, ctx):
            self.calls += 1
            if off:
                block._static_from = None
            before = self.priors
            out = refresh(block, ctx)
            self.full += self.priors > before
            return out

        def counted_prior(block, *a):
            self.priors += 1
            return prior(block, *a)

        monkeypatch.setattr(markov.MarkovBlock, "refresh", counted_refresh)
        monkeypatch.setattr(markov.MarkovBlock, "_chain_prior", counted_prior)


def run(model, t, y, steps=8, edit_at=4, step_size=1.0):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model, num_quad_points=10)
    svi = SVI(model, guide, CVI(step_size=step_size), loss=CVI_ELBO())
    out = []
    for i in range(steps):
        if i == edit_at:  # an edit from outside: the next refresh must see it
            name = next(k for k in pyro.get_param_store().keys() if ".sites." in k)
            with torch.no_grad():
                pyro.param(name).mul_(0.5)
        loss = svi.step(t, y)
        store = pyro.get_param_store()
        out.append((loss, {k: v.detach().clone() for k, v in store.items() if ".sites." in k}))
    return out


@DTYPES
@pytest.mark.parametrize("kernel", [Matern32, Matern12], ids=["d2", "d1"])
@pytest.mark.parametrize("step_size", [1.0, "auto"])
def test_a_static_refresh_is_the_full_refresh_bit_for_bit(monkeypatch, dtype, kernel, step_size):
    t, y = data(40, dtype)
    with monkeypatch.context() as m:
        w = Watch(m)
        short = run(gp_model(kernel), t, y, step_size=step_size)
        assert w.full < w.calls  # (taken)
    with monkeypatch.context() as m:
        w = Watch(m, off=True)
        full = run(gp_model(kernel), t, y, step_size=step_size)
        assert w.full == w.calls
    assert_same(short, full)
    without_edit = run(gp_model(kernel), t, y, edit_at=-1)
    assert without_edit[4][0] != short[4][0]  # (the edit moved the loss: it was seen)


@DTYPES
def test_learned_hyperparameters_never_take_it(monkeypatch, dtype):
    t, y = data(30, dtype)
    with monkeypatch.context() as m:
        w = Watch(m)
        short = run(gp_model(Matern32, learn=True), t, y, steps=4, edit_at=-1)
        assert w.full == w.calls
    with monkeypatch.context() as m:
        Watch(m, off=True)
        full = run(gp_model(Matern32, learn=True), t, y, steps=4, edit_at=-1)
    assert_same(short, full)
