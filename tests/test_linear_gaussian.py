"""``pyro_cvi.linear_gaussian``: the Gaussian conjugate computation against dense references."""

import pytest
import torch
from torch.distributions import MultivariateNormal, kl_divergence

from pyro_cvi.linear_gaussian import GaussianPrior, NotPositiveDefinite, choose_form, solve

F64 = torch.float64
D = 6


def _spd(n, seed):
    g = torch.Generator().manual_seed(seed)
    B = torch.randn(n, n, generator=g, dtype=F64)
    return B @ B.T / n + 0.5 * torch.eye(n, dtype=F64)


def _prior(kind):
    g = torch.Generator().manual_seed(1)
    loc = torch.randn(D, generator=g, dtype=F64)
    if kind == "diag":
        return GaussianPrior(loc, var=torch.linspace(0.3, 2.0, D, dtype=F64))
    if kind == "cov":
        return GaussianPrior(loc, cov=_spd(D, 2))
    return GaussianPrior(loc, precision=_spd(D, 3))


def _dense_cov(prior):
    if prior.var is not None:
        return torch.diag(prior.var)
    if prior.cov is not None:
        return prior.cov
    return torch.linalg.inv(prior.precision)


def _rows(R, seed=4):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(R, D, generator=g, dtype=F64)
    w = torch.rand(R, generator=g, dtype=F64) * 3 + 0.1
    b = torch.randn(R, generator=g, dtype=F64)
    return A, w, b


def _reference(prior, A, w, b):
    """Dense posterior of N(m0, S0) times exp(b^T A z - z^T A^T W A z / 2)."""
    P0 = torch.linalg.inv(_dense_cov(prior))
    Lam = P0 + A.T @ torch.diag(w) @ A
    V = torch.linalg.inv(Lam)
    V = 0.5 * (V + V.T)
    m = V @ (P0 @ prior.loc + A.T @ b)
    return m, V


def _close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


FORMS = [
    ("diag", "primal"),
    ("diag", "dual"),
    ("cov", "primal"),
    ("cov", "dual"),
    ("precision", "primal"),
]


@pytest.mark.parametrize("R", [3, 9], ids=["fewer-rows", "more-rows"])
@pytest.mark.parametrize("kind,form", FORMS, ids=[f"{k}-{f}" for k, f in FORMS])
def test_solve_matches_dense_posterior(kind, form, R):
    prior = _prior(kind)
    A, w, b = _rows(R)
    post = solve(prior, A, w, b, form=form)
    m, V = _reference(prior, A, w, b)
    assert post.form == form
    _close(post.loc, m)
    _close(post.covariance(), V)
    _close(post.scale_tril() @ post.scale_tril().T, V)
    _close(post.logdet_cov, torch.logdet(V))
    _close(post.f_mean, A @ m)
    _close(post.f_var, torch.diagonal(A @ V @ A.T))


@pytest.mark.parametrize("kind", ["diag", "cov"])
def test_cov_diag_before_and_after_the_full_covariance(kind):
    prior = _prior(kind)
    A, w, b = _rows(4)
    for form in ("primal", "dual"):
        post = solve(prior, A, w, b, form=form)
        _, V = _reference(prior, A, w, b)
        _close(post.cov_diag(), V.diagonal())  # lazily, without forming V
        post.covariance()
        _close(post.cov_diag(), V.diagonal())  # from the cached V


def test_primal_and_dual_agree_with_each_other():
    prior = _prior("diag")
    A, w, b = _rows(4)
    p, d = solve(prior, A, w, b, form="primal"), solve(prior, A, w, b, form="dual")
    for a, c in [(p.loc, d.loc), (p.covariance(), d.covariance()), (p.f_var, d.f_var)]:
        _close(a, c)


def test_dual_identity_rows_are_sites_on_z_itself():
    """A = I (a GP: one site per latent) is detected and solved without forming A S0 A^T."""
    prior = _prior("cov")
    _, w, b = _rows(D)
    A = torch.eye(D, dtype=F64)
    post = solve(prior, A, w, b, form="dual")
    m, V = _reference(prior, A, w, b)
    _close(post.loc, m)
    _close(post.covariance(), V)
    _close(post.f_mean, m)
    _close(post.f_var, V.diagonal())


def test_no_rows_and_extra_natural_parameters():
    prior = _prior("diag")
    none = torch.zeros(0, dtype=F64)
    for form in ("primal", "dual"):
        empty = solve(prior, torch.zeros(0, D, dtype=F64), none, none, form=form)
        _close(empty.loc, prior.loc)
        _close(empty.covariance(), _dense_cov(prior))
        _close(empty.logdet_cov, prior.var.log().sum())
    # extra (h, Lambda) messages add to the natural parameters (primal form)
    A, w, b = _rows(3)
    h, P = torch.linspace(-1, 1, D, dtype=F64), _spd(D, 7)
    post = solve(prior, A, w, b, extra_h=h, extra_prec=P, form="auto")
    P0 = torch.diag(prior.var.reciprocal())
    Lam = P0 + A.T @ torch.diag(w) @ A + P
    V = torch.linalg.inv(Lam)
    _close(post.covariance(), 0.5 * (V + V.T))
    _close(post.loc, V @ (P0 @ prior.loc + A.T @ b + h))
    assert post.form == "primal"


@pytest.mark.parametrize("kind", ["diag", "cov", "precision"])
def test_kl_to_prior_equals_torch_kl(kind):
    prior = _prior(kind)
    A, w, b = _rows(5)
    post = solve(prior, A, w, b, form="primal")
    q = MultivariateNormal(post.loc, post.covariance())
    for p in (prior, _prior("cov"), _prior("diag")):  # its own prior, and other ones
        want = kl_divergence(q, MultivariateNormal(p.loc, _dense_cov(p)))
        _close(post.kl_to(p), want, 1e-9)


def test_kl_to_is_differentiable_in_the_prior():
    prior = _prior("diag")
    A, w, b = _rows(5)
    post = solve(prior, A, w, b)
    var = prior.var.clone().requires_grad_(True)
    post.kl_to(GaussianPrior(prior.loc, var=var)).backward()
    var2 = prior.var.clone().requires_grad_(True)
    q = MultivariateNormal(post.loc, post.covariance())
    kl_divergence(q, MultivariateNormal(prior.loc, torch.diag(var2))).backward()
    _close(var.grad, var2.grad, 1e-9)


def test_indefinite_update_raises():
    prior = _prior("diag")
    A, w, b = _rows(9)
    with pytest.raises(NotPositiveDefinite):
        solve(prior, A, -10 * w, b, form="primal")
    with pytest.raises(NotPositiveDefinite):
        solve(prior, A, -10 * w, b)  # "auto" picks primal for negative weights
    # an indefinite extra precision too
    with pytest.raises(NotPositiveDefinite):
        solve(prior, A, w, b, extra_prec=-100 * torch.eye(D, dtype=F64))


def test_choose_form():
    diag, cov, prec = _prior("diag"), _prior("cov"), _prior("precision")
    w = torch.ones(3, dtype=F64)
    assert choose_form(diag, 3, D, False, w) == "dual"
    assert choose_form(cov, 3, D, False, w) == "dual"
    assert choose_form(diag, 9, D, False, None) == "primal"
    assert choose_form(prec, 3, D, False, w) == "primal"
    assert choose_form(diag, 3, D, True, w) == "primal"
    assert choose_form(diag, 3, D, False, -w) == "primal"
    assert choose_form(cov, D, D, False, None) == "dual"  # a GP: sites on every latent
    assert choose_form(diag, D, D, False, None) == "primal"


def test_prior_helpers():
    cov = _prior("cov")
    _close(cov.precision_matrix(), torch.linalg.inv(cov.cov))
    assert cov.cov_cholesky() is cov.cov_cholesky()  # memoised
    diag = _prior("diag")
    _close(diag.precision_matrix(), torch.diag(diag.var.reciprocal()))
    assert diag.detach() is diag  # no graph: the same object
    loc = diag.loc.clone().requires_grad_(True)
    d2 = GaussianPrior(loc, var=diag.var).detach()
    assert not d2.loc.requires_grad and d2.equal(diag)
    assert not diag.equal(cov) and not diag.equal(GaussianPrior(diag.loc, var=2 * diag.var))
