"""Pyro's ``dist.GaussianHMM`` as a latent is a Markov chain of ``(z_t, y_t)`` with the hidden
``z`` summed out (Kalman smoothing, ``pyro_cvi.statespace.hmm``): with Poisson observations
every loss equals the dense path's (the same model with the HMM's marginal prior of ``y`` as
one MultivariateNormal, a dense Gaussian block) to 1e-6, and so do ``q``'s mean, covariance
and log density."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.statespace.hmm import hmm_chain
from pyro_cvi.statespace.posterior import chain_precision

T, H, K = 25, 2, 2


def _hmm(dtype, scale=None):
    M = torch.tensor([[0.9, 0.1], [-0.2, 0.7]], dtype=dtype)
    G = torch.tensor([[1.0, 0.0], [0.5, 1.0]], dtype=dtype)
    s = torch.tensor(0.3, dtype=dtype) if scale is None else scale
    eye = torch.eye(H, dtype=dtype)
    return dist.GaussianHMM(
        dist.MultivariateNormal(torch.zeros(H, dtype=dtype), eye),
        M,
        dist.MultivariateNormal(torch.full((H,), 0.05, dtype=dtype), 0.1 * eye),
        G,
        dist.Normal(torch.zeros(K, dtype=dtype), s).to_event(1),
        duration=T,
    )


def _counts(dtype):
    g = torch.Generator().manual_seed(0)
    return torch.poisson(torch.full((T, K), 2.0), generator=g).to(dtype)


def _marginal(hmm):
    """The HMM's marginal prior of ``y`` (flat ``(T K,)``), from the augmented chain."""
    chain = hmm_chain(hmm)
    D = H + K
    prec = chain_precision(chain, chain.m0.new_zeros(T, D, D))
    cov = torch.cholesky_inverse(torch.linalg.cholesky(prec))
    A, b, _ = chain.all_steps()
    x = [b[0]]
    for t in range(1, T):
        x.append(A[t] @ x[-1] + b[t])
    keep = torch.arange(T * D).reshape(T, D)[:, H:].reshape(-1)
    return torch.stack(x).reshape(-1)[keep], cov[keep][:, keep]


def hmm_model(y):
    f = pyro.sample("f", _hmm(y.dtype))
    with pyro.plate("t", T):
        pyro.sample("y", dist.Poisson(f.exp()).to_event(1), obs=y)


def _dense_model(mu, S):
    def model(y):
        f = pyro.sample("f", dist.MultivariateNormal(mu, S)).reshape(T, K)
        with pyro.plate("t", T):
            pyro.sample("y", dist.Poisson(f.exp()).to_event(1), obs=y)

    return model


def _run(model, y, steps=8):
    pyro.clear_param_store()
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), CVI_ELBO())
    return guide, [svi.step(y) for _ in range(steps)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_marginal_prior_is_pyros_log_prob(dtype):
    hmm = _hmm(dtype)
    mu, S = _marginal(hmm)
    y = torch.randn(T, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = hmm.log_prob(y)
    got = torch.distributions.MultivariateNormal(mu, S).log_prob(y.reshape(-1))
    assert float(got) == pytest.approx(float(ref), rel=1e-10 if dtype == torch.float64 else 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gaussian_hmm_latent_equals_the_dense_path(dtype):
    y = _counts(dtype)
    gh, lh = _run(hmm_model, y)
    assert "GaussianHMM f: chain of (z_t, y_t), hidden z (dim 2) summed out" in gh.explain()
    mu, S = _marginal(_hmm(dtype))
    gd, ld = _run(_dense_model(mu, S), y)
    assert "Markov" not in gd.explain()
    rel = 1e-6 if dtype == torch.float64 else 2e-4
    assert lh == pytest.approx(ld, rel=rel)
    assert abs(lh[-1] - lh[-2]) < 1e-6 * abs(lh[-1])  # converged (both)
    qh, qd = gh.posterior("f"), gd.posterior("f")
    atol = 1e-6 if dtype == torch.float64 else 1e-3
    assert torch.allclose(qh.mean.reshape(-1), qd.mean, atol=atol)
    assert torch.allclose(qh.variance.reshape(-1), qd.variance, atol=atol)
    assert torch.allclose(qh.covariance_matrix, qd.covariance_matrix, atol=atol)
    if dtype == torch.float64:
        draws = qd.sample((3,))
        assert torch.allclose(qh.log_prob(draws.reshape(3, T, K)), qd.log_prob(draws), rtol=1e-8)


def test_gaussian_hmm_hyperparameter_gradient_matches_the_dense_path():
    """A learnable observation scale: one hybrid step (CVI + Adam) moves it the same way."""
    y = _counts(torch.float64)

    def make(dense):
        def model(y):
            s = pyro.param("s", torch.tensor(0.3, dtype=torch.float64), dist.constraints.positive)
            hmm = _hmm(torch.float64, s)
            if dense:
                mu, S = _marginal(hmm)
                f = pyro.sample("f", dist.MultivariateNormal(mu, S)).reshape(T, K)
            else:
                f = pyro.sample("f", hmm)
            with pyro.plate("t", T):
                pyro.sample("y", dist.Poisson(f.exp()).to_event(1), obs=y)

        return model

    out = {}
    for dense in (False, True):
        pyro.clear_param_store()
        model = make(dense)
        guide = AutoCVI(model)
        svi = SVI(model, guide, CVI(step_size=1.0, optim_args={"lr": 0.05}), CVI_ELBO())
        losses = [svi.step(y) for _ in range(4)]
        out[dense] = (losses, float(pyro.param("s")))
    assert out[False][0] == pytest.approx(out[True][0], rel=1e-8)
    assert out[False][1] == pytest.approx(out[True][1], rel=1e-8)
    assert out[False][1] != 0.3
