"""Streaming CVI (pyro_cvi.scale.streaming): one pass with the incremental form is the in-memory
step."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from torch.utils.data import DataLoader, TensorDataset

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.scale.streaming import StreamingCVI

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
N, D = 600, 4


def _data(device, dtype):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = torch.tensor([1.5, -1.0, 0.5, 0.0], dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(X @ w), generator=g)
    t = X[:, 0] * 0.5 + 0.2 * torch.randn(N, generator=g, dtype=torch.float64)
    return [a.to(device=device, dtype=dtype) for a in (X, y, t)]


def logistic(X, y):
    w = pyro.sample("w", dist.Normal(X.new_zeros(D), 2.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def linear(X, t):
    w = pyro.sample("w", dist.Normal(X.new_zeros(D), 2.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("t", dist.Normal(X @ w + 0.3, 0.2), obs=t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beta", [1.0, 0.6])
def test_one_pass_is_the_in_memory_step(device, beta):
    """update="pass": after each full pass (5 minibatches, the last one short) q equals the
    in-memory AutoCVI step from the same start (q = prior), to rounding, in float64; the
    pass's ELBO equals the loss svi.step reported for that q."""
    X, y, _ = _data(device, torch.float64)
    pyro.clear_param_store()
    guide = AutoCVI(logistic, init_sites="prior")
    svi = SVI(logistic, guide, CVI(step_size=beta), loss=CVI_ELBO())
    stream = StreamingCVI(logistic, step_size=beta, update="pass", init_sites="prior")
    loader = DataLoader(TensorDataset(X, y), batch_size=128)
    for _ in range(3):
        loss = svi.step(X, y)
        elbo = stream.run_pass(loader)
        q, s = guide.posterior("w"), stream.posterior()
        assert torch.allclose(s.loc, q.loc, atol=1e-10, rtol=0)
        assert torch.allclose(s.covariance_matrix, q.covariance_matrix, atol=1e-10, rtol=0)
        assert elbo == pytest.approx(-loss, rel=1e-10)
    assert s.loc.device.type == device


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batch_updates_reach_the_full_batch_optimum(dtype):
    """update="batch": the incremental form converges to the fixed point of full-batch CVI
    (the ELBO of 30 in-memory steps), and a conjugate model is exact after one pass."""
    X, y, t = _data("cpu", dtype)
    pyro.clear_param_store()
    guide = AutoCVI(logistic)
    svi = SVI(logistic, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    for _ in range(30):
        loss = svi.step(X, y)
    stream = StreamingCVI(logistic)
    loader = DataLoader(TensorDataset(X, y), batch_size=100)
    for _ in range(6):
        stream.run_pass(loader)
    tol = 1e-4 if dtype == torch.float32 else 1e-8
    assert stream.elbo(loader) == pytest.approx(-loss, rel=tol)
    assert torch.allclose(stream.posterior().loc, guide.posterior("w").loc, atol=100 * tol)

    # Bayesian linear regression: the posterior from the closed form, after one pass
    lin = StreamingCVI(linear)
    lin.run_pass(DataLoader(TensorDataset(X, t), batch_size=64))
    X64, t64 = X.double(), t.double()
    prec = torch.eye(D, dtype=torch.float64) / 4 + X64.T @ X64 / 0.04
    mean = torch.linalg.solve(prec, X64.T @ (t64 - 0.3) / 0.04)
    assert torch.allclose(lin.posterior().loc.double(), mean, atol=10 * tol)


def test_a_shuffled_loader_is_refused():
    X, y, _ = _data("cpu", torch.float64)
    stream = StreamingCVI(logistic)
    stream.run_pass(DataLoader(TensorDataset(X, y), batch_size=100))
    shuffled = DataLoader(TensorDataset(X, y), batch_size=100, shuffle=True)
    with pytest.raises(ValueError, match="shuffle=False"):
        stream.run_pass(shuffled)


def test_a_general_factor_is_refused_by_name():
    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(torch.sin(X @ w), 1.0), obs=y)

    X, y, _ = _data("cpu", torch.float64)
    with pytest.raises(ValueError, match="'y'"):
        StreamingCVI(model).run_pass(DataLoader(TensorDataset(X, y), batch_size=100))
