"""Structured SVI (Hoffman & Blei 2015): exact local conditionals and the global step (eq. 7-8)."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_cvi import step_sizes
from pyro_cvi.families import family_for_support
from pyro_cvi.methods import structured
from pyro_cvi.methods.structured import StructuredSVI, ssvi_target

D = torch.float64
S0 = 3.0  # prior sd of the global mean


def hierarchical(Y):
    """mu ~ N(0, S0^2); theta_n | mu ~ N(mu, 1); y_nj | theta_n ~ N(theta_n, 1)."""
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=D), S0))
    with pyro.plate("groups", Y.shape[0], dim=-2):
        theta = pyro.sample("theta", dist.Normal(mu, 1.0))
        with pyro.plate("obs", Y.shape[1], dim=-1):
            pyro.sample("y", dist.Normal(theta, 1.0), obs=Y)


MEANS = torch.tensor([-3.0, 0.5, 4.0], dtype=D)


def mixture_weights(x):
    """w ~ Dirichlet(1); z_n | w ~ Cat(w); x_n | z_n ~ N(MEANS[z_n], 1): one global, w."""
    w = pyro.sample("w", dist.Dirichlet(torch.ones(3, dtype=D)))
    with pyro.plate("data", x.shape[0]):
        z = pyro.sample("z", dist.Categorical(w))
        pyro.sample("x", dist.Normal(MEANS[z], 1.0), obs=x)


def _groups(N=6, J=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    theta = 2.0 + torch.randn(N, 1, generator=g, dtype=D)
    return theta + torch.randn(N, J, generator=g, dtype=D)


def test_continuous_local_conditional_is_exact():
    """p(theta_n | y_n, mu) = N((mu + sum_j y_nj) / (1 + J), 1 / (1 + J)), and the locals
    integrate out to log p(y | mu) = sum_n log N(y_n; mu 1, I + 1 1^T)."""
    Y = _groups()
    N, J = Y.shape
    ssvi = StructuredSVI(hierarchical)
    mu = torch.tensor(0.7, dtype=D)
    q = ssvi.local_conditional("theta", {"mu": mu}, Y)
    loc = (mu + Y.sum(1, keepdim=True)) / (1 + J)
    assert torch.allclose(q.mean.reshape(N), loc.reshape(N), atol=1e-10)
    assert torch.allclose(q.variance.reshape(N), torch.full((N,), 1 / (1 + J), dtype=D))
    cov = torch.eye(J, dtype=D) + torch.ones(J, J, dtype=D)
    marginal = dist.MultivariateNormal(mu.expand(J), cov).log_prob(Y).sum()
    assert math.isclose(float(ssvi.local_log_lik({"mu": mu}, Y)), float(marginal), rel_tol=1e-10)


def test_discrete_local_conditional_is_exact():
    """p(z_n = k | x_n, w) = w_k N(x_n; m_k, 1) / sum_j w_j N(x_n; m_j, 1) (enumerated)."""
    x = torch.tensor([-2.5, 0.1, 1.9, 3.7, -0.4], dtype=D)
    w = torch.tensor([0.2, 0.5, 0.3], dtype=D)
    ssvi = StructuredSVI(mixture_weights)
    q = ssvi.local_conditional("z", {"w": w}, x)
    joint = w.log() + dist.Normal(MEANS, 1.0).log_prob(x[:, None])
    assert torch.allclose(q.probs, (joint - joint.logsumexp(-1, keepdim=True)).exp(), atol=1e-12)
    value = float(ssvi.local_log_lik({"w": w}, x).detach())
    assert math.isclose(value, float(joint.logsumexp(-1).sum()), rel_tol=1e-12)


def test_non_conjugate_local_is_refused_with_the_site_name():
    def model(y):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        with pyro.plate("data", y.shape[0]):
            f = pyro.sample("f", dist.Normal(mu, 1.0))
            pyro.sample("y", dist.Bernoulli(logits=f), obs=y)

    ssvi = StructuredSVI(model)
    with pytest.raises(ValueError, match="'f' is not conditionally conjugate"):
        ssvi.step(torch.tensor([1.0, 0.0, 1.0], dtype=D))


def _hoffman_blei_update(lam, eps, prior, Y, rho):
    """Eq. 7 with V from eq. 8 written out for a Normal q(mu) (natural lam = (l1, l2), t(mu) =
    (mu, mu^2)), R(u) = m + s Phi^-1(u) = m + s eps, and eta^_n = E[eta_n(y_n, theta_n) | mu] =
    (E[theta_n | y_n, mu], -1/2) from the exact local conditional."""
    l1, l2 = lam
    var = -0.5 / l2
    m, s = l1 * var, var.sqrt()
    beta = m + s * eps
    J = Y.shape[1]
    e_theta = (beta + Y.sum(1)) / (1 + J)
    eta_hat = torch.stack([e_theta.sum(), torch.tensor(-0.5 * Y.shape[0], dtype=D)])
    grad_t = torch.stack([torch.ones((), dtype=D), 2 * beta])  # nabla_beta t(beta)
    grad_R = torch.stack([var, l1 / (2 * l2**2) + eps * (-2 * l2) ** -1.5])  # nabla_lam R
    fisher = torch.stack(
        [torch.stack([var, 2 * m * var]), torch.stack([2 * m * var, 4 * m**2 * var + 2 * var**2])]
    )
    V = torch.linalg.solve(fisher, torch.outer(grad_R, grad_t))  # eq. 8
    target = prior + V @ eta_hat
    return (1 - rho) * torch.stack([l1, l2]) + rho * target, beta


def test_global_step_equals_hoffman_blei_eq_7(monkeypatch):
    """Three SSVI steps of the library against eq. 7-8 evaluated by hand, to 1e-10 (the
    reparameterised estimator, which a small Gaussian global leaves for Price's)."""
    monkeypatch.setattr(structured, "PRICE_MAX_ELEMENTS", 0)
    Y = _groups(N=8, J=3, seed=1)
    schedule = step_sizes.robbins_monro(0.8, 1.0, 0.75)
    ssvi = StructuredSVI(hierarchical, step_size=schedule)
    prior = torch.tensor([0.0, -0.5 / S0**2], dtype=D)
    for t in range(1, 4):
        before = tuple(p.clone() for p in ssvi.lam["mu"]) if ssvi.lam else None
        ssvi.step(Y)
        if before is None:
            before = tuple(prior.unbind())
        beta = ssvi.last_beta["mu"]
        var = -0.5 / before[1]
        eps = (beta - before[0] * var) / var.sqrt()
        expected, beta_hb = _hoffman_blei_update(before, eps, prior, Y, schedule(t))
        assert torch.allclose(beta_hb, beta, atol=1e-12)
        got = torch.stack([p.reshape(()) for p in ssvi.lam["mu"]])
        assert torch.allclose(got, expected, rtol=1e-10, atol=1e-10), (t, got, expected)


def _exact_posterior(Y):
    """p(mu | y): the locals integrate out, ybar_n ~ N(mu, 1 + 1/J)."""
    N, J = Y.shape
    s2 = 1 + 1 / J
    prec = 1 / S0**2 + N / s2
    return Y.mean(1).sum() / s2 / prec, torch.tensor(1 / prec, dtype=D)


def test_exact_posterior_is_the_fixed_point_of_the_expected_step():
    """The natural gradient (eq. 21) vanishes in expectation at the exact marginal p(mu | y):
    E_u[eta + V(R(u), lam*) sum_n eta^_n] = lam* (20,000 draws of u, in one batch)."""
    pyro.set_rng_seed(4)
    Y = _groups(N=10, J=4, seed=2)
    N, J = Y.shape
    mean, var = _exact_posterior(Y)
    fam = family_for_support(dist.constraints.real, torch.Size())
    lam = tuple(p.expand(20000) for p in fam.dist_to_natural(dist.Normal(mean, var.sqrt())))
    prior = tuple(
        p.expand(20000)
        for p in fam.dist_to_natural(dist.Normal(0.0 * mean, torch.tensor(S0, dtype=D)))
    )
    cov = torch.eye(J, dtype=D) + torch.ones(J, J, dtype=D)

    def log_lik(beta):  # sum_n log p(y_n | beta), batched over the draws
        return dist.MultivariateNormal(beta[:, None, None].expand(-1, 1, J), cov).log_prob(Y).sum()

    target, _, _ = ssvi_target(fam, lam, prior, log_lik)
    for t, l in zip(target, lam):
        se = t.std() / math.sqrt(t.numel())
        assert abs(float(t.mean() - l[0])) < 4 * float(se), (t.mean(), l[0], se)
        assert float(se) < 0.02 * abs(float(l[0])) + 0.02  # the test has power


def test_ssvi_run_finds_the_exact_posterior_mean():
    pyro.set_rng_seed(3)
    Y = _groups(N=10, J=4, seed=2)
    ssvi = StructuredSVI(hierarchical, step_size=step_sizes.robbins_monro(1.0, 0.0, 0.75))
    for _ in range(60):
        ssvi.step(Y)
    mean, var = _exact_posterior(Y)
    q = ssvi.posterior("mu")
    assert abs(float(q.mean - mean)) < 0.4 * float(
        var.sqrt()
    )  # a noisy 60-step run; the sharp check is above
    assert abs(float(q.variance / var) - 1) < 0.3


def _hierarchical_of(dtype):
    one = torch.ones((), dtype=dtype)

    def model(Y):
        mu = pyro.sample("mu", dist.Normal(0.0 * one, S0 * one))
        with pyro.plate("groups", Y.shape[0], dim=-2):
            theta = pyro.sample("theta", dist.Normal(mu, one))
            with pyro.plate("obs", Y.shape[1], dim=-1):
                pyro.sample("y", dist.Normal(theta, one), obs=Y)

    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("as_guide", [False, True], ids=["StructuredSVI", "AutoStructuredCVI"])
def test_a_robbins_monro_run_of_a_gaussian_global_converges(as_guide, dtype):
    """A run whose reparameterised precision target went negative at step 2 (damped into a
    near-zero precision, the mean then at -279,031): with Price's target the precision is
    exact at every draw and q(mu) reaches p(mu | y)."""
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO, AutoStructuredCVI

    g = torch.Generator().manual_seed(0)
    Y = 2.0 + torch.randn(50, 1, generator=g, dtype=D) + torch.randn(50, 10, generator=g, dtype=D)
    Y = Y.to(dtype)
    mean, var = _exact_posterior(Y.double())
    schedule = step_sizes.robbins_monro(0.5, 10.0, 0.7)
    model = _hierarchical_of(dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    if as_guide:
        guide = AutoStructuredCVI(model, step_size=schedule)
        svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
        for _ in range(200):
            svi.step(Y)
        q = guide.posterior("mu")
    else:
        ssvi = StructuredSVI(model, step_size=schedule)
        for _ in range(200):
            ssvi.step(Y)
        q = ssvi.posterior("mu")
    sd = float(var.sqrt())
    assert q.mean.dtype == dtype
    assert abs(float(q.mean) - float(mean)) < 0.5 * sd, (float(q.mean), float(mean))
    # the precision converges deterministically to (1 - prod (1 - rho_t)) of the exact one
    assert float(q.stddev) == pytest.approx(sd, rel=0.03)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_price_target_of_a_quadratic_likelihood_is_exact_at_every_draw(dtype):
    """l(mu) = sum_n log N(y_n; mu 1, I + 1 1'): its curvature -N J / (1 + J) is the
    likelihood's precision, whatever the draw; the mean part is unbiased (its average over
    draws is the exact target)."""
    Y = _groups(N=10, J=4, seed=2).to(dtype)
    N, J = Y.shape
    fam = family_for_support(dist.constraints.real, torch.Size())
    prior = fam.dist_to_natural(dist.Normal(torch.tensor(0.0, dtype=dtype), S0))
    lam = fam.dist_to_natural(dist.Normal(torch.tensor(-1.0, dtype=dtype), 2.0))
    cov = (torch.eye(J) + torch.ones(J, J)).to(dtype)

    def log_lik(mu):
        return dist.MultivariateNormal(mu.expand(J), cov).log_prob(Y).sum()

    pyro.set_rng_seed(0)
    firsts = []
    for _ in range(400):
        target, _, _ = ssvi_target(fam, lam, prior, log_lik)
        assert float(target[1]) == pytest.approx(float(prior[1]) - N * J / (1 + J) / 2, rel=1e-5)
        firsts.append(float(target[0]))
    exact_first = float(prior[0]) + float(Y.sum()) / (1 + J)
    t = torch.tensor(firsts, dtype=torch.float64)
    assert abs(float(t.mean()) - exact_first) < 4 * float(t.std()) / 20
    assert float(t.std()) > 0  # one draw is noisy in the mean part: the test has power
