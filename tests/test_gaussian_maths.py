"""``pyro_cvi.gaussian``: each formula against an independent computation, in float32 and
float64.

* conversions: the gradient of the log-partition (by autograd) is the mean parameter;
  inverses by dense ``torch.linalg.inv``;
* site/row maps: the Hessian and gradient of the log-site in ``z`` (by autograd) are the
  regression's ``-A^T W A`` and ``A^T b``;
* Bonnet/Price and eqs. 30-31: closed-form expectations ``E[-exp(a^T z)]`` differentiated by
  autograd in the mean parameters, quadrature, Monte Carlo;
* the retraction: positive definite for indefinite ``G`` and any step, equal to its formula.
"""

import math

import pytest
import torch

from pyro_cvi import gaussian as g
from pyro_cvi.linalg import NotPositiveDefinite, cholesky

DTYPES = [torch.float32, torch.float64]
IDS = ["f32", "f64"]


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)


def _spd(D, dtype, seed=0, shift=1.0):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(D, D, generator=gen, dtype=torch.float64)
    return (X @ X.T / D + shift * torch.eye(D, dtype=torch.float64)).to(dtype)


def _vec(D, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(D, generator=gen, dtype=torch.float64).to(dtype)


# ------------------------------------------------------------------------------------------------
# conversions
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_log_partition_gradient_is_the_mean_parameter(dtype):
    """``grad_eta A(eta) = mu``: autograd of :func:`log_partition` in ``(eta1, eta2)`` (with
    ``P = -2 sym(eta2)``) against :func:`mean_params` of :func:`moments_from_natural`."""
    D = 4
    P, eta1 = _spd(D, dtype), _vec(D, dtype)
    eta2 = (-0.5 * P).clone().requires_grad_(True)
    e1 = eta1.clone().requires_grad_(True)
    prec = -(eta2 + eta2.mT)
    A = g.log_partition(e1, torch.linalg.cholesky(prec))
    d1, d2 = torch.autograd.grad(A, (e1, eta2))
    mu1, mu2 = g.mean_params(*g.moments_from_natural(eta1, torch.linalg.cholesky(P)))
    torch.testing.assert_close(d1, mu1, **_tol(dtype))
    torch.testing.assert_close(d2, mu2, **_tol(dtype))
    # and the moments themselves, by dense inverses
    S = torch.linalg.inv(P.double())
    torch.testing.assert_close(mu1.double(), S @ eta1.double(), **_tol(dtype))
    assert torch.equal(g.loc_from_natural(eta1, torch.linalg.cholesky(P)), mu1)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_natural_mean_moment_round_trips(dtype):
    D = 3
    S, m = _spd(D, dtype, seed=2), _vec(D, dtype, seed=3)
    eta1, P = g.natural_from_moments(m, torch.linalg.cholesky(S))
    torch.testing.assert_close(P.double(), torch.linalg.inv(S.double()), **_tol(dtype))
    torch.testing.assert_close(eta1.double(), P.double() @ m.double(), **_tol(dtype))
    m2, S2 = g.moments_from_mean_params(*g.mean_params(m, S))
    torch.testing.assert_close(m2, m)
    torch.testing.assert_close(S2, S, **_tol(dtype))
    m3, S3 = g.moments_from_natural(eta1, torch.linalg.cholesky(P))
    torch.testing.assert_close(m3, m, **_tol(dtype))
    torch.testing.assert_close(S3, S, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_cholesky_factor_maps(dtype):
    """``scale_tril_from_precision(P)`` is lower triangular with ``L L^T = P^-1``;
    ``precision_from_scale_tril(L) = (L L^T)^-1`` (batched)."""
    P = torch.stack([_spd(4, dtype, seed=s) for s in range(3)])
    L = g.scale_tril_from_precision(P)
    assert torch.equal(L, L.tril())
    S = torch.linalg.inv(P.double())
    torch.testing.assert_close((L @ L.mT).double(), S, **_tol(dtype))
    torch.testing.assert_close(g.precision_from_scale_tril(L).double(), P.double(), **_tol(dtype))
    X = torch.randn(4, 4, dtype=dtype)
    torch.testing.assert_close(g.symmetrise(X), (X + X.T) / 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_diagonal_conversions_agree_with_the_full_ones(dtype):
    v = torch.tensor([0.5, 2.0, 3.0], dtype=dtype)
    m = torch.tensor([-1.0, 0.25, 4.0], dtype=dtype)
    e1, e2 = g.diagonal_natural_from_moments(m, v)
    full = g.natural_from_moments(m, torch.linalg.cholesky(torch.diag(v)))
    torch.testing.assert_close(e1, full[0], **_tol(dtype))
    torch.testing.assert_close(torch.diag(-2 * e2), full[1], **_tol(dtype))
    m2, v2 = g.diagonal_moments_from_natural(e1, e2)
    torch.testing.assert_close(m2, m, **_tol(dtype))
    torch.testing.assert_close(v2, v, **_tol(dtype))


# ------------------------------------------------------------------------------------------------
# sites and rows
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_site_to_row_is_the_log_site_in_z(dtype):
    """``sum_n lam1_n eta_n + lam2_n eta_n^2`` with ``eta = A z + c`` has Hessian ``-A^T W A``
    and gradient ``A^T b`` at ``z = 0`` (autograd), ``(w, b) = site_to_row(lam1, lam2, c)``."""
    N, D = 5, 3
    gen = torch.Generator().manual_seed(4)
    A = torch.randn(N, D, generator=gen, dtype=torch.float64).to(dtype)
    c = torch.randn(N, generator=gen, dtype=torch.float64).to(dtype)
    lam1 = torch.randn(N, generator=gen, dtype=torch.float64).to(dtype)
    lam2 = -torch.rand(N, generator=gen, dtype=torch.float64).to(dtype)

    def log_site(z):
        eta = A @ z + c
        return (lam1 * eta + lam2 * eta**2).sum()

    z0 = torch.zeros(D, dtype=dtype)
    H = torch.autograd.functional.hessian(log_site, z0)
    grad = torch.autograd.functional.jacobian(log_site, z0)
    w, b = g.site_to_row(lam1, lam2, c)
    torch.testing.assert_close(-(A.T * w) @ A, H, **_tol(dtype))
    torch.testing.assert_close(A.T @ b, grad, **_tol(dtype))
    back = g.row_to_site(w, b, c)
    torch.testing.assert_close(back[0], lam1, **_tol(dtype))
    torch.testing.assert_close(back[1], lam2, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_multivariate_site_to_row_is_the_log_site_in_f(dtype):
    """A K-variate site ``lam1^T eta + eta^T lam2 eta`` on ``eta = f + c`` (``lam2``
    symmetric): Hessian ``-W`` and gradient ``b`` at ``f = 0`` (autograd), batched over N."""
    N, K = 3, 4
    gen = torch.Generator().manual_seed(5)
    lam1 = torch.randn(N, K, generator=gen, dtype=torch.float64).to(dtype)
    lam2 = torch.randn(N, K, K, generator=gen, dtype=torch.float64).to(dtype)
    lam2 = lam2 + lam2.mT
    c = torch.randn(N, K, generator=gen, dtype=torch.float64).to(dtype)
    W, b = g.site_to_row_multivariate(lam1, lam2, c)
    for n in range(N):

        def log_site(f, n=n):
            eta = f + c[n]
            return lam1[n] @ eta + eta @ lam2[n] @ eta

        f0 = torch.zeros(K, dtype=dtype)
        H = torch.autograd.functional.hessian(log_site, f0)
        grad = torch.autograd.functional.jacobian(log_site, f0)
        torch.testing.assert_close(-W[n], H, **_tol(dtype))
        torch.testing.assert_close(b[n], grad, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_pseudo_observations_are_the_sites_gaussian(dtype):
    """``N(y | f, noise)`` has the site's ``f``-dependence: ``-f^2 / (2 noise) + y f / noise``
    equals ``lam2 f^2 + lam1 f``; an empty site (``lam2 = 0``) has infinite noise."""
    lam1 = torch.tensor([0.3, -1.0, 0.7], dtype=dtype)
    lam2 = torch.tensor([-0.5, -2.0, 0.0], dtype=dtype)
    y, noise = g.pseudo_observations(lam1, lam2)
    torch.testing.assert_close(-0.5 / noise[:2], lam2[:2], **_tol(dtype))
    torch.testing.assert_close(y[:2] / noise[:2], lam1[:2], **_tol(dtype))
    assert noise[2] == float("inf") and y[2] == 0


# ------------------------------------------------------------------------------------------------
# Bonnet and Price, eqs. 29-31
# ------------------------------------------------------------------------------------------------
def _exp_expectation(a, m, S):
    """``E[-exp(a^T z)]`` for ``z ~ N(m, S)``, in closed form."""
    return -torch.exp(a @ m + 0.5 * a @ S @ a)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_site_natural_params_are_the_mean_parameter_gradient(dtype):
    """Eqs. 30-31: for ``F = E[-exp(eta)]``, ``eta ~ N(m, v)``, written as a function of
    ``mu1 = m``, ``mu2 = v + m^2`` and differentiated by autograd."""
    m = torch.tensor([0.3, -0.7], dtype=dtype)
    v = torch.tensor([0.4, 1.5], dtype=dtype)
    mu1 = m.clone().requires_grad_(True)
    mu2 = (v + m**2).clone().requires_grad_(True)
    F = -torch.exp(mu1 + 0.5 * (mu2 - mu1**2))
    d1, d2 = torch.autograd.grad(F.sum(), (mu1, mu2))
    e = torch.exp(m + 0.5 * v)
    lam1, lam2 = g.site_natural_params(m, -e, -0.5 * e)  # dF/dm, dF/dv in closed form
    torch.testing.assert_close(lam1, d1, **_tol(dtype))
    torch.testing.assert_close(lam2, d2, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_multivariate_site_natural_params_are_the_mean_parameter_gradient(dtype):
    """Eqs. 30-31 in K dimensions, by autograd of ``F(mu1, mu2)`` with ``S = mu2 - mu1 mu1^T``;
    Price's ``dF/dS = E[hess f] / 2`` and Bonnet's ``dF/dm = E[grad f]`` in closed form."""
    K = 3
    a = torch.tensor([0.5, -0.25, 0.3], dtype=dtype)
    m, S = _vec(K, dtype, seed=6) * 0.3, _spd(K, dtype, seed=7, shift=0.2) * 0.5
    mu1 = m.clone().requires_grad_(True)
    mu2 = (S + torch.outer(m, m)).clone().requires_grad_(True)
    F = _exp_expectation(a, mu1, mu2 - torch.outer(mu1, mu1))
    d1, d2 = torch.autograd.grad(F, (mu1, mu2))
    Ef = _exp_expectation(a, m, S)
    dm, dS = Ef * a, 0.5 * Ef * torch.outer(a, a)  # E[grad f], E[hess f] / 2
    lam1, lam2 = g.site_natural_params_multivariate(m, dm, dS)
    torch.testing.assert_close(lam1, d1, **_tol(dtype))
    torch.testing.assert_close(lam2, d2, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_mean_param_gradients_by_quadrature_and_monte_carlo(dtype):
    """Eq. 29, ``(E[f'], E[f''] / 2)`` for ``f = -exp``: exact derivatives of the Gauss-Hermite
    value (closed form to round-off) and Monte Carlo (within 5 standard errors)."""
    m = torch.tensor([0.2, -1.0], dtype=dtype)
    v = torch.tensor([0.3, 0.8], dtype=dtype)
    e = torch.exp(m + 0.5 * v)
    f, gm, gv = g.mean_param_gradients(lambda eta: -torch.exp(eta), m, v, num_points=30)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(f, -e, **tol)
    torch.testing.assert_close(gm, -e, **tol)
    torch.testing.assert_close(gv, -0.5 * e, **tol)
    torch.manual_seed(0)
    S = 200_000
    _, gm_mc, gv_mc = g.mean_param_gradients(lambda eta: -torch.exp(eta), m, v, 30, S)
    sd = torch.exp(2 * m + 2 * v).sub(e**2).sqrt()  # sd of exp(eta)
    assert bool(((gm_mc + e).abs() < 5 * sd / math.sqrt(S)).all())
    assert bool(((gv_mc + 0.5 * e).abs() < 5 * 0.5 * sd / math.sqrt(S)).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_price_target_of_a_gaussian_factor_is_its_natural_parameter(dtype):
    """``f = log N(z | mu, P*^-1)``: ``E_q[grad f] = -P* (m - mu)``, ``E[hess f] = -P*`` at any
    ``q``, and the target ``(h, P) = (P* mu, P*)``, the factor's own natural parameters."""
    D = 3
    Pstar, mu, m = _spd(D, dtype, seed=8), _vec(D, dtype, seed=9), _vec(D, dtype, seed=10)
    h, P = g.price_target(-Pstar @ (m - mu), -Pstar, m)
    torch.testing.assert_close(P, Pstar, **_tol(dtype))
    torch.testing.assert_close(h, Pstar @ mu, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_price_precision_gradient_and_bonnet_mean_gradient(dtype):
    """``G = -2 dL/dS`` and ``dL/dm`` of ``L = E[-exp(a^T z)] + log|S| / 2`` by autograd of the
    closed form, against :func:`price_precision_gradient` (exact ``E[hess f]``) and
    :func:`bonnet_mean_gradient` (Monte Carlo, within 5 standard errors)."""
    D = 3
    a = torch.tensor([0.4, -0.3, 0.2], dtype=dtype)
    m, S = _vec(D, dtype, seed=11) * 0.3, _spd(D, dtype, seed=12, shift=0.3) * 0.5
    mm, SS = m.clone().requires_grad_(True), S.clone().requires_grad_(True)
    L = _exp_expectation(a, mm, SS) + 0.5 * torch.logdet(SS)
    dm, dS = torch.autograd.grad(L, (mm, SS))
    dS = 0.5 * (dS + dS.mT)
    Ef = _exp_expectation(a, m, S)
    P = torch.linalg.inv(S)
    G = g.price_precision_gradient(Ef * torch.outer(a, a), P)
    torch.testing.assert_close(G, -2 * dS, **_tol(dtype))
    torch.manual_seed(1)
    K = 100_000
    u = m + torch.randn(K, D, dtype=dtype) @ torch.linalg.cholesky(S).mT
    grads = -torch.exp(u @ a)[:, None] * a
    est = g.bonnet_mean_gradient(grads, u, m, P)
    sd = (grads + (u - m) @ P).std(0)
    assert bool(((est - dm).abs() < 5 * sd / math.sqrt(K) + 1e-6).all()), (est, dm)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_bonnet_control_variate_is_exact_at_the_posterior(dtype):
    """Where ``f`` is a Gaussian log-density with ``q``'s precision, every draw gives the same
    ``g + P (u - m) = P (mu - m)``: the estimate is exact from two draws."""
    D = 3
    P, mu, m = _spd(D, dtype, seed=13), _vec(D, dtype, seed=14), _vec(D, dtype, seed=15)
    u = m + torch.randn(2, D, dtype=dtype)
    grads = -(u - mu) @ P
    torch.testing.assert_close(g.bonnet_mean_gradient(grads, u, m, P), P @ (mu - m), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_stein_hessian(dtype):
    """Stein's lemma from gradients only: exact for a quadratic ``f`` once the control variate
    is (antithetic draws), and within Monte Carlo error of Price's ``E[hess f]`` for
    ``f = -exp(a^T z)`` (closed form)."""
    D = 3
    Hstar = -_spd(D, dtype, seed=16)
    m, mu = _vec(D, dtype, seed=17), _vec(D, dtype, seed=18)
    L = torch.linalg.cholesky(_spd(D, dtype, seed=19, shift=0.5))
    torch.manual_seed(2)
    half = torch.randn(4, D, dtype=dtype)
    eps = torch.cat([half, -half])
    dz = eps @ L.T
    grads = (m + dz - mu) @ Hstar
    H = g.stein_hessian(eps, dz, L, grads, Hstar)
    torch.testing.assert_close(H, Hstar, **_tol(dtype))
    # a non-quadratic f, no control variate
    a = torch.tensor([0.3, -0.2, 0.25], dtype=dtype)
    S = L @ L.T
    half = torch.randn(100_000, D, dtype=dtype)
    eps = torch.cat([half, -half])
    dz = eps @ L.T
    grads = -torch.exp((m + dz) @ a)[:, None] * a
    H = g.stein_hessian(eps, dz, L, grads, torch.zeros(D, D, dtype=dtype))
    exact = _exp_expectation(a, m, S) * torch.outer(a, a)
    assert float((H - exact).abs().max()) < 0.02 * float(exact.abs().max())


# ------------------------------------------------------------------------------------------------
# quadrature
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_gauss_hermite_moments_and_expectations(dtype):
    """``E[x^k]`` of ``N(0, 1)`` exact for ``k < 2K``; ``E[exp(eta)] = exp(m + v / 2)``."""
    t, w = g.gauss_hermite(6, dtype)
    assert t.dtype == dtype and w.dtype == dtype
    moments = [1.0, 0.0, 1.0, 0.0, 3.0, 0.0, 15.0, 0.0, 105.0]
    for k, exact in enumerate(moments):
        torch.testing.assert_close(
            (w * t**k).sum().double(), torch.tensor(exact).double(), **_tol(dtype)
        )
    m = torch.tensor([0.1, -0.4], dtype=dtype)
    v = torch.tensor([0.2, 0.6], dtype=dtype)
    torch.testing.assert_close(
        g.expected_log_prob(torch.exp, m, v, 20), torch.exp(m + 0.5 * v), **_tol(dtype)
    )


# ------------------------------------------------------------------------------------------------
# the retraction and the steps
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_retraction_is_positive_definite_for_indefinite_G(dtype):
    """``P + b G + (b^2 / 2) G S G`` (dense algebra) for an indefinite ``G`` with a large
    negative eigenvalue: the plain step ``P + b G`` is invalid, the retraction is not."""
    D = 4
    P = _spd(D, dtype, seed=20)
    S = torch.linalg.inv(P)
    G = torch.diag(torch.tensor([-50.0, 3.0, -0.5, 10.0], dtype=dtype))
    for b in (0.1, 0.5, 1.0, 10.0):
        bt = torch.tensor(b, dtype=dtype)
        new = g.retract(P, G, S, bt)
        torch.testing.assert_close(new, P + b * G + 0.5 * b * b * G @ S @ G, **_tol(dtype))
        assert bool(torch.linalg.eigvalsh(0.5 * (new + new.mT)).min() > 0)
    assert bool(torch.linalg.eigvalsh(P + G).min() < 0)
    p = torch.tensor([1.0, 0.1, 4.0], dtype=dtype)
    gd = torch.tensor([-30.0, -1.0, 2.0], dtype=dtype)
    for b in (0.1, 1.0, 5.0):
        new = g.retract_diagonal(p, gd, torch.tensor(b, dtype=dtype))
        torch.testing.assert_close(new, p + b * gd + 0.5 * (b * gd) ** 2 / p, **_tol(dtype))
        assert bool((new > 0).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_retraction_target_makes_the_plain_step_the_retraction(dtype):
    """``x + beta (target' - x)`` with :func:`retraction_target` is the retraction at
    ``b = beta`` (precision and ``h``), and stays positive definite for every ``b <= beta``."""
    D = 3
    P_old = _spd(D, dtype, seed=21)
    S = torch.linalg.inv(P_old)
    m = _vec(D, dtype, seed=22)
    P_t = torch.diag(torch.tensor([-20.0, 0.5, 3.0], dtype=dtype))  # an indefinite target
    h_t = _vec(D, dtype, seed=23)
    beta = 0.8
    h2, P2 = g.retraction_target((P_old @ m, P_old), (h_t, P_t), m, S, beta)
    new = P_old + beta * (P2 - P_old)
    G = P_t - P_old
    expected = g.retract(P_old, G, S, torch.tensor(beta, dtype=dtype))
    torch.testing.assert_close(new, expected, **_tol(dtype))
    C = 0.5 * beta * G @ S @ G
    torch.testing.assert_close(h2, h_t + C @ m, **_tol(dtype))
    for b in (beta, beta / 2, beta / 16):
        step = P_old + b * (P2 - P_old)
        assert bool(torch.linalg.eigvalsh(0.5 * (step + step.mT)).min() > 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("retraction", [True, False], ids=["retraction", "halved"])
def test_full_step_stays_valid_and_is_exact_on_a_conjugate_target(dtype, retraction):
    """:func:`tril_step` with ``G = P_post - P`` and ``dl/dm = -P_post (m_post - m)`` at
    ``b = 1`` gives the posterior (eq. 12 on a Gaussian); with an indefinite ``G`` the
    retraction and the halved plain step both return a valid Cholesky factor."""
    D = 3
    P, P_post = _spd(D, dtype, seed=24), _spd(D, dtype, seed=25, shift=2.0)
    m, m_post = _vec(D, dtype, seed=26), _vec(D, dtype, seed=27)
    L = torch.linalg.cholesky(torch.linalg.inv(P))
    gm = -P_post @ (m_post - m)
    m2, L2, _ = g.tril_step(m, L, gm, None, 1.0, retraction, G=P_post - P)
    if not retraction:  # the plain step lands on the posterior
        torch.testing.assert_close(m2, m_post, **_tol(dtype))
        torch.testing.assert_close(g.precision_from_scale_tril(L2), P_post, **_tol(dtype))
    G = torch.diag(torch.tensor([-40.0, 1.0, 2.0], dtype=dtype))
    m3, L3, _ = g.tril_step(m, L, gm, None, 1.0, retraction, G=G)
    assert bool(torch.isfinite(m3).all())
    assert bool((L3.diagonal() > 0).all()) and torch.equal(L3, L3.tril())


def test_halving_stops_at_the_one_limit():
    """An element that never becomes valid is halved :data:`MAX_HALVINGS` times."""
    p = torch.tensor([1.0, 1.0], dtype=torch.float64)
    gr = torch.tensor([-1.5, -float("inf")], dtype=torch.float64)
    _, b, ok, _ = g.halve_until_valid(lambda b: p + b * gr, lambda n: n > 0, 1.0, like=p)
    assert ok.tolist() == [True, False]
    assert b[0] == 0.5 and b[1] == 2.0**-g.MAX_HALVINGS


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_eps_jitter_policy_factorises_a_singular_covariance(dtype):
    """``jitter="eps"`` adds ``10 eps max|diag|`` always: a rank-one covariance factorises and
    ``L L^T`` is that jitter away from it; an indefinite one raises."""
    v = torch.tensor([1.0, 2.0, -1.0], dtype=dtype)
    C = torch.outer(v, v)
    L = cholesky(C, jitter="eps", what="chain step covariance")
    jitter = 10 * torch.finfo(dtype).eps * 4.0
    torch.testing.assert_close(L @ L.mT, C + jitter * torch.eye(3, dtype=dtype))
    with pytest.raises(NotPositiveDefinite, match="chain step covariance"):
        cholesky(-C, jitter="eps", what="chain step covariance")
