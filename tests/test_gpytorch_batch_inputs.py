"""GPyTorch's batch conventions for inputs with ``CVIVariationalStrategy``: a ``[*batch, n, D]``
batch of test point sets gives, set by set, what each set gives alone (one GP, every form;
``batch_shape`` models, with the sets broadcast against the model's batch), and inputs that do
not follow the convention get an error that names the shapes and the fix."""

from __future__ import annotations

import warnings

import gpytorch
import pytest
import torch
from gpytorch_user_changes import Run
from test_gpytorch_users import svgp

from pyro_cvi.contrib.gpytorch import CVIVariationalStrategy

DTYPES = [torch.float32, torch.float64]
IDS = ["float32", "float64"]


def _tol(dtype):
    return 1e-12 if dtype == torch.float64 else 2e-5


def _close(a, b, dtype):
    assert a.shape == b.shape
    assert float((a - b).abs().max()) <= _tol(dtype) * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("stepper", ["loop", "cvi", "sites"])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_a_batch_of_test_sets_equals_the_sets_one_by_one(stepper, mode, dtype):
    run = Run(stepper, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        run.step(3)
    getattr(run.model, mode)()
    getattr(run.likelihood, mode)()
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(3, 5, 1, generator=g, dtype=torch.float64) * 3).to(dtype)
    with torch.no_grad():
        out = run.model(x)
        sets = [run.model(x[i]) for i in range(3)]
        pred = run.likelihood(run.model(x))
    assert out.mean.shape == (3, 5) and pred.mean.shape == (3, 5)
    _close(out.mean, torch.stack([s.mean for s in sets]), dtype)
    _close(out.variance, torch.stack([s.variance for s in sets]), dtype)
    if mode == "eval":  # the full covariance of each set
        cov = torch.stack([s.covariance_matrix for s in sets])
        _close(out.covariance_matrix, cov, dtype)
        _close(pred.variance, out.variance + run.likelihood.noise, dtype)


def _batch_model(dtype):
    g = torch.Generator().manual_seed(0)
    Z = torch.rand(2, 6, 1, generator=g, dtype=torch.float64).to(dtype)
    model = svgp(CVIVariationalStrategy, Z, batch_shape=torch.Size([2]), step_size=1.0)
    X = torch.rand(30, 1, generator=g, dtype=torch.float64).to(dtype)
    y = torch.stack([torch.sin(3 * X[:, 0]), torch.cos(3 * X[:, 0])])
    lik = gpytorch.likelihoods.GaussianLikelihood(batch_shape=torch.Size([2])).to(dtype)
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=30)
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(2):
            model.zero_grad()
            (-mll(model(X), y)).sum().backward()
    model.eval()
    return model


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_batch_shape_models_broadcast_test_sets_as_gpytorch_does(dtype):
    """A model of 2 GPs: x [5, D] goes to both; x [2, 5, D] gives GP i the set i; x [3, 1, 5, D]
    gives every GP each of 3 sets; each equals the sets (and GPs) computed one at a time."""
    model = _batch_model(dtype)
    g = torch.Generator().manual_seed(4)
    x = torch.rand(3, 2, 5, 1, generator=g, dtype=torch.float64).to(dtype)
    with torch.no_grad():
        one = model(x[0, 0])
        assert one.mean.shape == (2, 5)
        per_gp = model(x[0])  # [2, 5, D]: set i under GP i
        for i in range(2):
            _close(per_gp.mean[i], model(x[0, i]).mean[i], dtype)
            _close(per_gp.covariance_matrix[i], model(x[0, i]).covariance_matrix[i], dtype)
        every = model(x[:, :1])  # [3, 1, 5, D]: each set under both GPs
        assert every.mean.shape == (3, 2, 5)
        for k in range(3):
            ref = model(x[k, 0])
            _close(every.mean[k], ref.mean, dtype)
            _close(every.covariance_matrix[k], ref.covariance_matrix, dtype)
        full = model(x)  # [3, 2, 5, D]
        _close(full.mean[1], model(x[1]).mean, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_inputs_off_the_convention_are_refused_by_name(dtype):
    run = Run("cvi", dtype)
    run.step(1)
    run.model.eval()
    with pytest.raises(ValueError, match=r"have 5 features .* x\.unsqueeze\(-1\)"):
        run.model(torch.rand(3, 5, dtype=dtype))
    sites = Run("sites", dtype)
    sites.step(1)
    sites.model.eval()
    with pytest.raises(ValueError, match=r"have 5 features"):
        sites.model(torch.rand(3, 5, dtype=dtype))
    model = _batch_model(dtype)
    with pytest.raises(ValueError, match=r"batch shape \(3,\).*model's batch shape \(2,\)"):
        model(torch.rand(3, 5, 1, dtype=dtype))
