"""Expected natural parameters (eq. 20): a non-conjugate factor of a natural-form latent in
the factor's own family sends that latent ``E_q[eta(parents)]``, exactly where ``eta`` is
affine in the parents, else averaged over joint draws of ``q``; its other messages stay Monte
Carlo gradients. Checked against closed forms, and the bound against Trace_ELBO."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.messages.expected_natural import EXACT, MONTE_CARLO, expected_natural_rule

DTYPES = [torch.float64, torch.float32]
K, D, N = 3, 8, 30


def _topics_model(x, strength=1.0):
    """Gamma topic weights (mean 2; ``strength`` scales shape and rate), Dirichlet document
    topics with those weights, observed words."""
    with pyro.plate("topics", K):
        alpha = pyro.sample("alpha", dist.Gamma(x.new_tensor(2.0 * strength), strength))
    with pyro.plate("docs", D):
        theta = pyro.sample("theta", dist.Dirichlet(alpha))
        with pyro.plate("words", N):
            pyro.sample("x", dist.Categorical(theta), obs=x)


def _topics_data(dtype):
    g = torch.Generator().manual_seed(5)
    probs = torch.distributions.Dirichlet(torch.full((K,), 0.7)).sample((D,))
    x = torch.multinomial(probs, N, replacement=True, generator=g).T  # (N, D)
    return x.to(dtype)


def _counts(x):
    return torch.nn.functional.one_hot(x.long(), K).sum(0).to(x.dtype)  # (D, K)


def _fit(model, data, steps, **kw):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model, **kw)
    svi = pyro.infer.SVI(model, guide, CVI(), CVI_ELBO())
    for _ in range(steps):
        svi.step(*data)
    return guide


def _gamma_q(guide, name):
    q = guide.engine.block_for(name).marginal(name)
    while hasattr(q, "base_dist"):
        q = q.base_dist
    return q


@pytest.mark.parametrize("dtype", DTYPES)
def test_dirichlet_weights_exact_message(dtype):
    """``theta_d ~ Dirichlet(alpha)``: ``eta = alpha - 1`` is affine in ``alpha``, so the
    message is ``E_q[alpha] - 1`` (Gamma mean) in closed form; with the words' counts the
    target is ``E_q[alpha] - 1 + counts``."""
    x = _topics_data(dtype)
    guide = _fit(_topics_model, (x,), 8)
    an = guide.engine.analysis
    assert expected_natural_rule(an, an.spec("theta"), an.families["theta"]) == EXACT
    assert expected_natural_rule(an, an.spec("alpha"), an.families["alpha"]) is None
    target = guide.engine.natural_targets((x,), {})["theta"][0]
    expected = _gamma_q(guide, "alpha").mean - 1 + _counts(x)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(target, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dirichlet_weights_fixed_point_and_bound(dtype):
    """With ``q(alpha)`` pinned by a strong prior, ``q(theta)`` reaches the VMP fixed point
    ``Dirichlet(E_q[alpha] + counts)`` (a Monte Carlo message from draws of ``alpha`` would
    leave it about ``sd(alpha) / alpha ~ 2%`` off), and the reported bound agrees with
    Trace_ELBO of the same guide within 3 standard errors."""
    x = _topics_data(dtype)
    guide = _fit(_topics_model, (x, 1000.0), 30, num_general_samples=32)
    conc = _gamma_q(guide, "theta").concentration
    expected = _gamma_q(guide, "alpha").mean + _counts(x)
    torch.testing.assert_close(conc, expected, rtol=2e-3, atol=0.0)
    check = guide.check_bound(x, 1000.0, num_particles=300, warn=False)
    assert check.agrees, check


def _rate_model(y):
    """``z_i ~ Gamma(2, b / (u1 + u2))`` with Gamma ``u1, u2``; Poisson counts of ``z_i``."""
    u1 = pyro.sample("u1", dist.Gamma(y.new_tensor(3.0), 2.0))
    u2 = pyro.sample("u2", dist.Gamma(y.new_tensor(4.0), 2.0))
    with pyro.plate("items", y.shape[-1]):
        z = pyro.sample("z", dist.Gamma(y.new_tensor(2.0), 1.5 / (u1 + u2)))
        with pyro.plate("obs", y.shape[0]):
            pyro.sample("y", dist.Poisson(z), obs=y)


def _rate_data(dtype):
    g = torch.Generator().manual_seed(7)
    z = torch.rand(6, generator=g, dtype=torch.float64) * 4 + 1
    return torch.poisson(z.expand(5, 6).contiguous(), generator=g).to(dtype)


def _set_gamma(guide, name, shape, rate):
    block = guide.engine.block_for(name)
    n0, n1 = block.natural[name].param_names() if hasattr(block, "natural") else None
    with torch.no_grad():
        pyro.param(n0).fill_(shape - 1)
        pyro.param(n1).fill_(-rate)
    block.forget()


@pytest.mark.parametrize("dtype", DTYPES)
def test_gamma_rate_monte_carlo_expected_message(dtype):
    """``rate = b / (u1 + u2)`` is not affine: the message ``(1, -b E[1/(u1 + u2)])`` is an
    average over draws. With ``q(u1) = Gamma(3, 2)``, ``q(u2) = Gamma(4, 2)`` the sum is
    ``Gamma(7, 2)`` and ``E[1/(u1 + u2)] = 2 / 6``; the Poisson counts add ``(sum y, -m)``."""
    y = _rate_data(dtype)
    S = 2000
    guide = _fit(_rate_model, (y,), 1, num_general_samples=S, vectorize_particles=True)
    an = guide.engine.analysis
    assert expected_natural_rule(an, an.spec("z"), an.families["z"]) == MONTE_CARLO
    _set_gamma(guide, "u1", 3.0, 2.0)
    _set_gamma(guide, "u2", 4.0, 2.0)
    pyro.set_rng_seed(1)
    t1, t2 = guide.engine.natural_targets((y,), {})["z"]
    m = y.shape[0]
    torch.testing.assert_close(t1, (1.0 + y.sum(0)), rtol=1e-6, atol=1e-6)
    # Var(1/s) for s ~ Gamma(7, 2): r^2 / ((a - 1)^2 (a - 2)); one set of draws for all z_i
    se = 1.5 * (4.0 / (36 * 5)) ** 0.5 / S**0.5
    err = (t2 - (-1.5 * 2.0 / 6.0 - m)).abs()
    assert float(err.max()) < 4 * se, (err, se)
    assert float((t2 - t2[0]).abs().max()) < 1e-4  # the same draws serve every item
