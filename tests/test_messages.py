"""``pyro_cvi.messages.quadrature``: Gauss-Hermite expectations and the mean-parameter gradients
that become CVI's Gaussian site parameters (Khan & Lin 2017, Appendix B.1, eqs. 29-31)."""

import math

import pytest
import torch
from torch.distributions import Bernoulli, Normal, Poisson

from pyro_cvi.messages.quadrature import (
    expected_log_prob,
    gauss_hermite,
    mean_param_gradients,
    site_natural_params,
)

F64 = torch.float64
MEAN = torch.tensor([-1.5, 0.0, 0.4, 2.0], dtype=F64)
VAR = torch.tensor([0.3, 1.0, 2.5, 0.05], dtype=F64)


def _bernoulli(eta):
    y = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=F64)
    return Bernoulli(logits=eta).log_prob(y)


def _poisson(eta):
    y = torch.tensor([0.0, 3.0, 1.0, 7.0], dtype=F64)
    return Poisson(eta.exp()).log_prob(y)


LIKELIHOODS = {"bernoulli": _bernoulli, "poisson": _poisson}


@pytest.mark.parametrize("name", list(LIKELIHOODS))
def test_gradients_match_finite_differences_of_the_quadrature(name):
    fn = LIKELIHOODS[name]
    f, gm, gv = mean_param_gradients(fn, MEAN, VAR, num_points=32)
    torch.testing.assert_close(f, expected_log_prob(fn, MEAN, VAR, 32), rtol=1e-12, atol=1e-12)
    h = 1e-5
    fd_m = (expected_log_prob(fn, MEAN + h, VAR, 32) - expected_log_prob(fn, MEAN - h, VAR, 32)) / (
        2 * h
    )
    fd_v = (expected_log_prob(fn, MEAN, VAR + h, 32) - expected_log_prob(fn, MEAN, VAR - h, 32)) / (
        2 * h
    )
    torch.testing.assert_close(gm, fd_m, rtol=1e-7, atol=1e-8)
    torch.testing.assert_close(gv, fd_v, rtol=1e-7, atol=1e-8)


def test_bernoulli_gradients_match_monte_carlo():
    """eq. 29: df/dm = E[f'(eta)], df/dv = E[f''(eta)] / 2, estimated from draws."""
    torch.manual_seed(0)
    S = 100_000
    f_q, gm_q, gv_q = mean_param_gradients(_bernoulli, MEAN, VAR)
    f, gm, gv = mean_param_gradients(_bernoulli, MEAN, VAR, num_samples=S)
    torch.testing.assert_close(f, f_q)  # the value is still the quadrature
    # |f'| <= 1 and |f''| / 2 <= 1/8 for Bernoulli logits: four standard errors at most
    assert (gm - gm_q).abs().max() < 4 / math.sqrt(S), (gm, gm_q)
    assert (gv - gv_q).abs().max() < 4 * 0.125 / math.sqrt(S), (gv, gv_q)
    assert gv.max() < 0  # log-concave


def test_gaussian_likelihood_gives_its_own_natural_parameters():
    """For log N(y | eta, s^2) the site is exact: lam1 = y / s^2, lam2 = -1 / (2 s^2)."""
    y = torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=F64)
    s = torch.tensor([0.5, 1.0, 2.0, 0.1], dtype=F64)
    f, gm, gv = mean_param_gradients(lambda eta: Normal(eta, s).log_prob(y), MEAN, VAR, 4)
    torch.testing.assert_close(f, Normal(MEAN, s).log_prob(y) - VAR / (2 * s**2))
    lam1, lam2 = site_natural_params(MEAN, gm, gv)
    torch.testing.assert_close(lam1, y / s**2)
    torch.testing.assert_close(lam2, -0.5 / s**2)


def test_site_natural_params_formula():
    g = torch.Generator().manual_seed(3)
    m, gm, gv = (torch.randn(5, generator=g, dtype=F64) for _ in range(3))
    lam1, lam2 = site_natural_params(m, gm, gv)
    torch.testing.assert_close(lam1, gm - 2 * gv * m, rtol=0, atol=0)
    torch.testing.assert_close(lam2, gv, rtol=0, atol=0)


def test_expected_log_prob_of_polynomials_is_exact():
    a, b, c = 0.7, -1.3, 2.0
    got = expected_log_prob(lambda e: a * e**2 + b * e + c, MEAN, VAR, num_points=2)
    torch.testing.assert_close(got, a * (MEAN**2 + VAR) + b * MEAN + c, rtol=1e-13, atol=1e-13)
    # degree 4 needs 3 points (exact for degree < 2K): E[eta^4] = m^4 + 6 m^2 v + 3 v^2
    want = MEAN**4 + 6 * MEAN**2 * VAR + 3 * VAR**2
    torch.testing.assert_close(expected_log_prob(lambda e: e**4, MEAN, VAR, 3), want)
    assert not torch.allclose(expected_log_prob(lambda e: e**4, MEAN, VAR, 2), want)


def test_gauss_hermite_nodes_and_weights():
    t, w = gauss_hermite(7)
    assert t.dtype == F64 and w.dtype == F64 and t.shape == w.shape == (7,)
    assert w.sum().item() == pytest.approx(1.0, abs=1e-14)
    assert (w * t**2).sum().item() == pytest.approx(1.0, abs=1e-13)  # standard normal moments
    assert gauss_hermite(5, torch.float32)[0].dtype == torch.float32
    with pytest.raises(ValueError, match="num_points"):
        gauss_hermite(0)


def test_value_keeps_its_graph_to_hyperparameters():
    """f depends on tensors the log-density closes over (e.g. a learnable noise scale)."""
    s = torch.tensor(0.8, dtype=F64, requires_grad=True)
    y = torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=F64)
    f, _, _ = mean_param_gradients(lambda eta: Normal(eta, s).log_prob(y), MEAN, VAR, 8)
    f.sum().backward()
    # d/ds sum_n [log N(y_n | m_n, s) - v_n / (2 s^2)]
    r2 = (y - MEAN) ** 2 + VAR
    want = (-1 / s + r2 / s**3).sum()
    assert s.grad.item() == pytest.approx(want.item(), rel=1e-12)


def test_general_gaussian_message_is_exact_for_a_quadratic_log_joint():
    """Bonnet/Price with antithetic pairs: for f(z) = -(z - mu)^T P (z - mu) / 2 the averaged
    gradient and Hessian are exact, so the target is (h, P) = (P mu, P) from any q."""
    from pyro_cvi.messages.gaussian import general_gaussian_message

    torch.manual_seed(0)
    P = torch.tensor([[2.0, 0.3, 0.0], [0.3, 1.0, -0.2], [0.0, -0.2, 0.5]], dtype=F64)
    mu = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
    loc = torch.tensor([0.0, 0.3, -0.4], dtype=F64)
    L = torch.linalg.cholesky(torch.eye(3, dtype=F64) * 0.7 + 0.1)

    def log_joint(z):
        d = z - mu
        f = -0.5 * d @ P @ d
        return f, f

    value, h, prec = general_gaussian_message(log_joint, loc, L, num_samples=400)
    torch.testing.assert_close(prec, P, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, P @ mu, rtol=1e-12, atol=1e-12)
    # the value is a Monte Carlo estimate of E_q[f]
    exact = -0.5 * ((loc - mu) @ P @ (loc - mu) + torch.trace(P @ L @ L.T))
    assert value.detach().item() == pytest.approx(exact.item(), abs=0.15)
