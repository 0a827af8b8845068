"""A learned parameter of a linear-predictor likelihood other than its linear one (a
Student-t scale, degrees of freedom) gets the gradient of the reported -ELBO at fixed q.

It used to get none: the quadrature value was detached when the offset had no graph, so a
hybrid CVI + Adam run never moved the scale (a silent wrong answer). The reference is a
central finite difference of ``CVI_ELBO().loss`` (deterministic: Gauss-Hermite)."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI


def _data(dtype):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(80, 3, generator=g, dtype=dtype)
    w = torch.tensor([1.0, -2.0, 0.5], dtype=dtype)
    y = X @ w + 0.3 * torch.randn(80, generator=g, dtype=dtype)
    return X, y


def regression(X, y):
    log_s = pyro.param("log_s", torch.tensor(1.0, dtype=X.dtype))
    df = pyro.param("df", torch.tensor(4.0, dtype=X.dtype), dist.constraints.positive)
    w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("data", len(X)):
        pyro.sample("y", dist.StudentT(df, X @ w, log_s.exp()), obs=y)


def _grads(model, guide, args):
    with pyro.poutine.trace(param_only=True) as tr:
        CVI_ELBO().loss_and_grads(model, guide, *args)
    out = {}
    for name in ("log_s", "df"):
        p = tr.trace.nodes[name]["value"].unconstrained()
        out[name] = float(p.grad)
        p.grad = None
    return out


def _fd(model, guide, args, name, h=1e-5):
    p = pyro.param(name).unconstrained()
    with torch.no_grad():
        p.add_(h)
    up = CVI_ELBO().loss(model, guide, *args)
    with torch.no_grad():
        p.sub_(2 * h)
    down = CVI_ELBO().loss(model, guide, *args)
    with torch.no_grad():
        p.add_(h)
    return (up - down) / (2 * h)


def test_student_t_scale_and_df_get_the_gradient_of_the_reported_loss():
    X, y = _data(torch.float64)
    guide = AutoCVI(regression)
    svi = SVI(regression, guide, CVI(step_size=0.5), loss=CVI_ELBO())
    for _ in range(5):
        svi.step(X, y)
    grads = _grads(regression, guide, (X, y))
    for name in ("log_s", "df"):
        fd = _fd(regression, guide, (X, y), name)
        assert abs(fd) > 1.0, (name, fd)  # a gradient worth having
        assert grads[name] == pytest.approx(fd, rel=1e-5), (name, grads[name], fd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hybrid_learning_moves_the_scale_towards_the_noise(dtype):
    X, y = _data(dtype)
    guide = AutoCVI(regression)
    svi = SVI(regression, guide, CVI(optim_args={"lr": 0.05}), loss=CVI_ELBO())
    losses = [svi.step(X, y) for _ in range(80)]
    # the noise is 0.3 (a t with large df, about Normal): the scale falls from e^1 towards it
    assert pyro.param("log_s").exp().item() < 1.0
    assert losses[-1] < losses[0] - 50


T = 30


def chain(y):
    log_s = pyro.param("log_s", torch.tensor(1.0, dtype=y.dtype))
    x = pyro.sample("x_0", dist.Normal(torch.zeros((), dtype=y.dtype), 1.0))
    for t in pyro.markov(range(T)):
        if t > 0:
            x = pyro.sample(f"x_{t}", dist.Normal(0.9 * x, 0.3))
        pyro.sample(f"y_{t}", dist.StudentT(4.0, x, log_s.exp()), obs=y[t])


def test_a_markov_block_s_student_t_scale_gets_the_gradient_too():
    y = torch.sin(torch.arange(T, dtype=torch.float64) / 3)
    guide = AutoCVI(chain)
    svi = SVI(chain, guide, CVI(step_size=0.5), loss=CVI_ELBO())
    for _ in range(5):
        svi.step(y)
    with pyro.poutine.trace(param_only=True) as tr:
        CVI_ELBO().loss_and_grads(chain, guide, y)
    p = tr.trace.nodes["log_s"]["value"].unconstrained()
    grad, p.grad = float(p.grad), None
    fd = _fd(chain, guide, (y,), "log_s")
    assert abs(fd) > 1.0 and grad == pytest.approx(fd, rel=1e-5)
