"""Plain ``CVI()`` recognises a ``pyro.contrib.gp`` variational GP by its class and gives the GP's
hyperparameters the inner Adam rate ``HYPER_LR``; everything else keeps Pyro's 0.01, and given
``optim_args`` apply to every parameter. The rate is checked on Adam's first step, which moves a
raw parameter by exactly ``-lr * g / (|g| + eps)``."""

import copy

import pyro
import pyro.contrib.gp as gp
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO

from pyro_cvi import CVI
from pyro_cvi.contrib import pyro_gp
from pyro_cvi.natgrad.gp_models import HYPER_LR

DTYPES = [torch.float32, torch.float64]


def data(dtype, n=24):
    g = torch.Generator().manual_seed(3)
    X = torch.rand(n, 2, generator=g, dtype=torch.float64) * 4 - 2
    y = (torch.sin(2 * X[:, 0]) + X[:, 1] > 0).double()
    return X.to(dtype), y.to(dtype)


def sparse(dtype, likelihood=None, cls=gp.models.VariationalSparseGP):
    pyro.clear_param_store()
    X, y = data(dtype)
    kernel = gp.kernels.RBF(2, variance=torch.tensor(2.0), lengthscale=torch.tensor(0.8))
    lik = likelihood if likelihood is not None else pyro_gp.Binary()
    return cls(X, y, kernel, Xu=X[:6].clone(), likelihood=lik, whiten=True, jitter=1e-6).to(dtype)


def full(dtype):
    pyro.clear_param_store()
    X, y = data(dtype, n=12)
    kernel = gp.kernels.RBF(2, variance=torch.tensor(2.0), lengthscale=torch.tensor(0.8))
    return gp.models.VariationalGP(
        X, y, kernel, likelihood=pyro_gp.Binary(), whiten=True, jitter=1e-6
    ).to(dtype)


def one_step(model, guide, optim, loss=None):
    """A hand-written step: the raw parameters and their gradients before ``optim`` runs, and
    the raw parameters after it, by param-store name."""
    loss = loss or TraceMeanField_ELBO()
    loss.loss_and_grads(model, guide)
    store = pyro.get_param_store()
    params = [store._params[n] for n in store.keys()]
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in zip(store.keys(), params)}
    optim(params)
    after = {n: store._params[n].detach().clone() for n in store.keys()}
    return before, after


def adam_first_move(value, grad, lr):
    return value - lr * grad / (grad.abs() + 1e-8)


HYPERS = ("kernel.variance", "kernel.lengthscale", "Xu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make", [sparse, full], ids=["sparse", "full"])
def test_plain_cvi_steps_the_gp_hyperparameters_at_hyper_lr(make, dtype):
    gpc = make(dtype)
    optim = CVI()
    before, after = one_step(gpc.model, gpc.guide, optim)
    hypers = [n for n in HYPERS if n in before]
    assert len(hypers) == (3 if make is sparse else 2)
    for name in hypers:
        value, grad = before[name]
        torch.testing.assert_close(after[name], adam_first_move(value, grad, HYPER_LR))
    rules = {r["param"]: r["rule"] for r in optim.explain(print_table=False)}
    loc = "u_loc" if make is sparse else "f_loc"
    assert rules[loc].startswith("natural gradient")
    assert all(rules[n] == f"inner (lr {HYPER_LR:g})" for n in hypers)


@pytest.mark.parametrize("dtype", DTYPES)
def test_given_optim_args_apply_to_every_parameter(dtype):
    gpc = sparse(dtype)
    before, after = one_step(gpc.model, gpc.guide, CVI(optim_args={"lr": 0.01}))
    for name in HYPERS:
        value, grad = before[name]
        torch.testing.assert_close(after[name], adam_first_move(value, grad, 0.01))


@pytest.mark.parametrize("dtype", DTYPES)
def test_another_optimizer_class_keeps_its_own_defaults(dtype):
    gpc = sparse(dtype)
    before, after = one_step(gpc.model, gpc.guide, CVI(optim=torch.optim.SGD))
    value, grad = before["kernel.variance"]
    torch.testing.assert_close(after["kernel.variance"], value - 0.01 * grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_subclass_and_a_wrapping_guide_are_recognised(dtype):
    class MyGP(gp.models.VariationalSparseGP):
        pass

    gpc = sparse(dtype, cls=MyGP)
    w = pyro.param("w_extra", torch.tensor(0.5, dtype=dtype))  # not the GP's: Pyro's 0.01

    def model():
        gpc.model()
        pyro.sample("z", dist.Normal(w, 1.0), obs=torch.tensor(1.0, dtype=dtype))

    def guide():
        gpc.guide()

    before, after = one_step(model, guide, CVI())
    value, grad = before["kernel.lengthscale"]
    torch.testing.assert_close(after["kernel.lengthscale"], adam_first_move(value, grad, HYPER_LR))
    value, grad = before["w_extra"]
    torch.testing.assert_close(after["w_extra"], adam_first_move(value, grad, 0.01))


@pytest.mark.parametrize("dtype", DTYPES)
def test_hyperparameters_of_a_non_gp_guide_keep_pyros_rate(dtype):
    pyro.clear_param_store()
    x = torch.tensor([0.3, -1.2, 0.8], dtype=dtype)

    def model():
        s = pyro.param("s", torch.tensor(1.0, dtype=dtype), constraint=dist.constraints.positive)
        z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=dtype), s))
        with pyro.plate("n", 3):
            pyro.sample("x", dist.Normal(z, 1.0), obs=x)

    def guide():
        loc = pyro.param("z_loc", torch.tensor(0.0, dtype=dtype))
        scale = pyro.param(
            "z_scale", torch.tensor(1.0, dtype=dtype), constraint=dist.constraints.positive
        )
        pyro.sample("z", dist.Normal(loc, scale))

    before, after = one_step(model, guide, CVI(), Trace_ELBO())
    value, grad = before["s"]
    torch.testing.assert_close(after["s"], adam_first_move(value, grad, 0.01))


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_cvi_is_pyro_gp_optimizer_on_a_gp(dtype):
    """Every inner parameter is the GP's, so plain ``CVI()`` and ``pyro_gp.optimizer()`` (the
    inner rate 0.03 for everything) take the same steps; after a checkpoint (the optimizer's
    state and the param store) a fresh ``CVI()`` resumes at the same rate."""
    runs = []
    for make_optim in (CVI, pyro_gp.optimizer):
        gpc = sparse(dtype)
        svi = SVI(gpc.model, gpc.guide, make_optim(), TraceMeanField_ELBO())
        losses = [svi.step() for _ in range(8)]
        runs.append((losses, gpc.kernel.lengthscale.detach().clone()))
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=0)

    gpc = sparse(dtype)
    optim = CVI()
    svi = SVI(gpc.model, gpc.guide, optim, TraceMeanField_ELBO())
    for _ in range(4):
        svi.step()
    state = copy.deepcopy(optim.get_state())
    store = pyro.get_param_store()
    saved = {n: store._params[n].detach().clone() for n in store.keys()}
    ref = [svi.step() for _ in range(4)]
    with torch.no_grad():  # the checkpoint's values back into the GP's own parameters
        for n, v in saved.items():
            store._params[n].copy_(v)
    resumed = CVI()
    resumed.set_state(state)
    svi = SVI(gpc.model, gpc.guide, resumed, TraceMeanField_ELBO())
    got = [svi.step() for _ in range(4)]
    assert any(r.param_groups[0]["lr"] == HYPER_LR for r in resumed.optim_objs.values())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-6, atol=1e-6)
