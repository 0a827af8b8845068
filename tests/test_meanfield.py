"""Mean-field CVI (Algorithm 2): exact conjugate messages, CAVI/VMP equivalence, discrete
latents, non-conjugate Gamma factors (Appendix E.3)."""

import logging
import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.infer.autoguide.initialization import init_to_value

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, step_sizes


def _lbeta(a, b):
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def _gamma_norm(a, b):
    """log of the normaliser ratio a log b - lgamma(a) (Gamma(a, b) density constant)."""
    return a * math.log(b) - math.lgamma(a)


def _mvbeta(alpha):
    return float(torch.lgamma(alpha).sum() - torch.lgamma(alpha.sum()))


# ------------------------------------------------------------------------------------------------
# one-step exactness of the conjugate pairs (step_size = 1)
# ------------------------------------------------------------------------------------------------
def _case(name, dtype):
    t = lambda v: torch.tensor(v, dtype=dtype)  # noqa: E731
    if name == "beta-bernoulli":
        y = t([1.0, 0, 1, 1, 1, 0, 1])
        a, b = 2.0, 3.0

        def model(y):
            z = pyro.sample("z", dist.Beta(t(a), t(b)))
            with pyro.plate("data", len(y)):
                pyro.sample("y", dist.Bernoulli(z), obs=y)

        s = float(y.sum())
        post = (a + s, b + len(y) - s)
        ev = _lbeta(*post) - _lbeta(a, b)
        return model, y, "z", post, ev
    if name == "beta-binomial":
        y, n = t([3.0, 0, 5, 2]), t([5.0, 4, 6, 2])
        a, b = 1.5, 0.7

        def model(y):
            z = pyro.sample("z", dist.Beta(t(a), t(b)))
            with pyro.plate("data", len(y)):
                pyro.sample("y", dist.Binomial(n, probs=z), obs=y)

        post = (a + float(y.sum()), b + float((n - y).sum()))
        comb = float((torch.lgamma(n + 1) - torch.lgamma(y + 1) - torch.lgamma(n - y + 1)).sum())
        return model, y, "z", post, comb + _lbeta(*post) - _lbeta(a, b)
    if name == "beta-geometric":
        y = t([0.0, 3, 1, 7, 2])
        a, b = 2.0, 2.0

        def model(y):
            z = pyro.sample("z", dist.Beta(t(a), t(b)))
            with pyro.plate("data", len(y)):
                pyro.sample("y", dist.Geometric(probs=z), obs=y)

        post = (a + len(y), b + float(y.sum()))
        return model, y, "z", post, _lbeta(*post) - _lbeta(a, b)
    if name == "gamma-poisson":
        y = t([2.0, 5, 3, 0, 4])
        a, b, c = 2.0, 0.5, 3.0

        def model(y):
            z = pyro.sample("z", dist.Gamma(t(a), t(b)))
            with pyro.plate("data", len(y)):
                pyro.sample("y", dist.Poisson(c * z), obs=y)

        post = (a + float(y.sum()), b + c * len(y))
        const = float((y * math.log(c) - torch.lgamma(y + 1)).sum())
        return model, y, "z", post, const + _gamma_norm(a, b) - _gamma_norm(*post)
    if name == "gamma-exponential":
        y = t([0.3, 1.2, 0.05, 2.0])
        a, b = 3.0, 2.0

        def model(y):
            z = pyro.sample("z", dist.Gamma(t(a), t(b)))
            with pyro.plate("data", len(y)):
                pyro.sample("y", dist.Exponential(z), obs=y)

        post = (a + len(y), b + float(y.sum()))
        return model, y, "z", post, _gamma_norm(a, b) - _gamma_norm(*post)
    if name == "gamma-gamma-rate":
        y = t([0.3, 1.2, 0.5, 2.0, 0.9])
        a, b, k = 1.0, 1.0, 2.5

        def model(y):
            z = pyro.sample("z", dist.Gamma(t(a), t(b)))
            with pyro.plate("data", len(y)):
                pyro.sample("y", dist.Gamma(t(k), z), obs=y)

        post = (a + k * len(y), b + float(y.sum()))
        const = float(((k - 1) * y.log()).sum()) - len(y) * math.lgamma(k)
        return model, y, "z", post, const + _gamma_norm(a, b) - _gamma_norm(*post)
    if name == "gamma-normal-precision":
        y = t([0.3, -1.2, 0.5, 2.0, 0.9, -0.4])
        a, b, m = 2.0, 1.0, 0.2

        def model(y):
            tau = pyro.sample("tau", dist.Gamma(t(a), t(b)))
            with pyro.plate("data", len(y)):
                pyro.sample("y", dist.Normal(m, tau.rsqrt()), obs=y)

        post = (a + len(y) / 2, b + 0.5 * float(((y - m) ** 2).sum()))
        const = -0.5 * len(y) * math.log(2 * math.pi)
        return model, y, "tau", post, const + _gamma_norm(a, b) - _gamma_norm(*post)
    if name == "dirichlet-categorical":
        y = torch.tensor([0, 2, 2, 1, 2, 3])
        alpha = t([1.0, 2.0, 3.0, 0.5])

        def model(y):
            pi = pyro.sample("pi", dist.Dirichlet(alpha))
            with pyro.plate("data", len(y)):
                pyro.sample("y", dist.Categorical(pi), obs=y)

        post = alpha + torch.bincount(y, minlength=4).to(dtype)
        return model, y, "pi", (post,), _mvbeta(post) - _mvbeta(alpha)
    if name == "dirichlet-multinomial":
        y = t([[3.0, 0, 2], [1, 1, 1], [0, 4, 0]])
        alpha = t([0.5, 1.0, 2.0])

        def model(y):
            pi = pyro.sample("pi", dist.Dirichlet(alpha))
            with pyro.plate("data", len(y)):
                pyro.sample("y", dist.Multinomial(5, pi), obs=y)

        post = alpha + y.sum(0)
        coef = float((torch.lgamma(y.sum(-1) + 1) - torch.lgamma(y + 1).sum(-1)).sum())
        return model, y, "pi", (post,), coef + _mvbeta(post) - _mvbeta(alpha)
    raise ValueError(name)


CASES = [
    "beta-bernoulli",
    "beta-binomial",
    "beta-geometric",
    "gamma-poisson",
    "gamma-exponential",
    "gamma-gamma-rate",
    "gamma-normal-precision",
    "dirichlet-categorical",
    "dirichlet-multinomial",
]


def _params(q):
    if isinstance(q, torch.distributions.Dirichlet):
        return (q.concentration,)
    if isinstance(q, torch.distributions.Beta):
        return (q.concentration1, q.concentration0)
    return (q.concentration, q.rate)


@pytest.mark.parametrize("name", CASES)
def test_conjugate_pair_is_exact_in_one_step(name):
    model, y, site, post, log_evidence = _case(name, torch.float64)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    svi.step(y)
    got = _params(guide.posterior(site))
    for g, p in zip(got, post):
        assert torch.allclose(g, torch.as_tensor(p, dtype=g.dtype), rtol=1e-6, atol=1e-9), name
    # at the exact posterior the ELBO is the log evidence (exact, no Monte Carlo)
    assert svi.evaluate_loss(y) == pytest.approx(-log_evidence, rel=1e-6, abs=1e-6)
    line = [ln for ln in guide.explain().splitlines() if ln.strip().startswith(("y ->",))][0]
    assert "conjugate" in line and "probed" in line, guide.explain()


@pytest.mark.parametrize("name", ["gamma-poisson", "beta-bernoulli", "dirichlet-categorical"])
def test_conjugate_pair_float32(name):
    model, y, site, post, log_evidence = _case(name, torch.float32)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    svi.step(y)
    for g, p in zip(_params(guide.posterior(site)), post):
        assert g.dtype == torch.float32
        assert torch.allclose(g, torch.as_tensor(p, dtype=g.dtype), rtol=1e-5)
    assert svi.evaluate_loss(y) == pytest.approx(-log_evidence, rel=1e-4)


def test_non_conjugate_pattern_is_general():
    """Poisson(rate = sum_k w_k z_k) and Gamma(concentration = z) are not conjugate."""

    def model(y):
        z = pyro.sample("z", dist.Gamma(torch.ones(2), 1.0).to_event(1))
        s = pyro.sample("s", dist.Gamma(2.0, 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Poisson(z.sum(-1)), obs=y)
            pyro.sample("y2", dist.Gamma(s, 1.0), obs=y + 1)

    guide = AutoCVI(model, remainder="off", num_general_samples=2)
    guide(torch.tensor([1.0, 2.0]))
    lines = {ln.split("->")[0].strip(): ln for ln in guide.explain().splitlines() if "->" in ln}
    assert "general" in lines["y"] and "monomial" in lines["y"]
    assert "general" in lines["y2"] and "concentration" in lines["y2"]


# ------------------------------------------------------------------------------------------------
# Bayesian linear regression with unknown noise precision vs closed-form mean-field VB
# ------------------------------------------------------------------------------------------------
def _blr_unknown_noise(N=60, D=4):
    g = torch.Generator().manual_seed(3)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = torch.randn(D, generator=g, dtype=torch.float64)
    y = X @ w + 0.4 * torch.randn(N, generator=g, dtype=torch.float64)
    a0, b0, s0 = 2.0, 1.0, 1.5

    def model(X, y):
        tau = pyro.sample("tau", dist.Gamma(torch.tensor(a0, dtype=X.dtype), b0))
        w = pyro.sample("w", dist.Normal(X.new_zeros(D), s0).to_event(1))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Normal(X @ w, tau**-0.5), obs=y)

    return model, X, y, a0, b0, s0


def _mfvb_blr(X, y, a0, b0, s0, iters=500):
    """Closed-form CAVI for q(w) q(tau) (Bishop 10.3), to convergence; returns the ELBO."""
    N, D = X.shape
    a, b = a0, b0
    for _ in range(iters):
        Etau = a / b
        S = torch.linalg.inv(torch.eye(D, dtype=X.dtype) / s0**2 + Etau * X.T @ X)
        m = S @ (Etau * X.T @ y)
        a = a0 + N / 2
        b = b0 + 0.5 * float(((y - X @ m) ** 2).sum() + torch.trace(X @ S @ X.T))
    Etau, Elogtau = a / b, math.digamma(a) - math.log(b) if hasattr(math, "digamma") else None
    Elogtau = float(torch.digamma(torch.tensor(a))) - math.log(b)
    sq = float(((y - X @ m) ** 2).sum() + torch.trace(X @ S @ X.T))
    ell = N / 2 * (Elogtau - math.log(2 * math.pi)) - 0.5 * Etau * sq
    klw = 0.5 * float(
        torch.trace(S) / s0**2 + m @ m / s0**2 - D - torch.logdet(S) + 2 * D * math.log(s0)
    )
    klt = float(
        torch.distributions.kl_divergence(
            dist.Gamma(torch.tensor(a), torch.tensor(b)), dist.Gamma(torch.tensor(a0), b0)
        )
    )
    return ell - klw - klt, m, S, a, b


@pytest.mark.parametrize("schedule", ["parallel", "sequential"])
def test_blr_unknown_noise_matches_closed_form_mfvb(schedule):
    model, X, y, a0, b0, s0 = _blr_unknown_noise()
    guide = AutoCVI(model, schedule=schedule)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    losses = [svi.step(X, y) for _ in range(25)]
    elbo, m, S, a, b = _mfvb_blr(X, y, a0, b0, s0)
    assert -losses[-1] == pytest.approx(elbo, rel=1e-4)
    assert svi.evaluate_loss(X, y) == pytest.approx(-elbo, rel=1e-6)
    assert all(l1 <= l0 + 1e-9 for l0, l1 in zip(losses, losses[1:]))  # never decreases
    q_tau = guide.posterior("tau")
    assert q_tau.concentration.item() == pytest.approx(a, rel=1e-8)
    assert q_tau.rate.item() == pytest.approx(b, rel=1e-6)
    assert torch.allclose(guide.posterior("w").loc, m, rtol=1e-6)
    text = guide.explain()
    assert "given tau" in text and "precision = c*tau" in text


# ------------------------------------------------------------------------------------------------
# Gaussian mixture (Blei et al. 2017, section 3): CAVI fixed point, monotone ELBO
# ------------------------------------------------------------------------------------------------
def _gmm_data(N=240, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.tensor([-6.0, 0.0, 7.0], dtype=torch.float64)
    c = torch.randint(0, 3, (N,), generator=g)
    return centers[c] + torch.randn(N, generator=g, dtype=torch.float64)


def _gmm_model(K, sigma):
    def model(x):
        with pyro.plate("components", K):
            mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), sigma))
        with pyro.plate("data", len(x)):
            c = pyro.sample("c", dist.Categorical(x.new_ones(K) / K))
            pyro.sample("x", dist.Normal(mu[c], 1.0), obs=x)

    return model


def _cavi_gmm(x, m, s2, sigma, iters):
    """Algorithm 2 of Blei et al. (2017), by hand; returns the ELBO trace and the optimum."""
    K = len(m)
    elbos = []
    for _ in range(iters):
        logits = x[:, None] * m - 0.5 * (m**2 + s2)
        phi = torch.softmax(logits, -1)
        s2 = 1 / (1 / sigma**2 + phi.sum(0))
        m = s2 * (phi * x[:, None]).sum(0)
        ell = (phi * (-0.5 * math.log(2 * math.pi) - 0.5 * ((x[:, None] - m) ** 2 + s2))).sum()
        prior = (-0.5 * math.log(2 * math.pi * sigma**2) - 0.5 * (m**2 + s2) / sigma**2).sum()
        ent_mu = (0.5 * torch.log(2 * math.pi * math.e * s2)).sum()
        ent_c = -(phi * torch.log(phi.clamp_min(1e-300))).sum()
        elbos.append(float(ell + prior + ent_mu + ent_c - len(x) * math.log(K)))
    return elbos, m, s2, phi


def test_gaussian_mixture_reaches_the_cavi_fixed_point_monotonically():
    x = _gmm_data()
    K, sigma = 3, 5.0
    init = torch.tensor([-1.0, 0.5, 2.0], dtype=x.dtype)
    model = _gmm_model(K, sigma)
    guide = AutoCVI(model, schedule="sequential", init_loc_fn=init_to_value(values={"mu": init}))
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    losses = [svi.step(x) for _ in range(25)]
    elbos, m, s2, phi = _cavi_gmm(x, init, torch.full((K,), sigma**2, dtype=x.dtype), sigma, 200)
    # monotone, and the same fixed point and ELBO as hand-written CAVI
    assert all(l1 <= l0 + 1e-8 for l0, l1 in zip(losses, losses[1:]))
    assert -losses[-1] == pytest.approx(elbos[-1], rel=1e-9)
    q = guide.posterior("mu")
    assert torch.allclose(q.loc, m, atol=1e-8)
    assert torch.allclose(q.scale**2, s2, rtol=1e-8)
    assert torch.allclose(guide.posterior("c").probs, phi, atol=1e-8)
    # the first sweep of CVI (c then mu) is the first iteration of CAVI
    text = guide.explain()
    assert "enumerated over c" in text and "categorical message" in text


def test_full_bayesian_mixture_sequential_is_monotone_and_stationary():
    """Dirichlet weights, Gamma precisions, Normal-Gamma means, Categorical labels."""
    x = _gmm_data(150, seed=1)
    K = 3

    def model(x):
        pi = pyro.sample("pi", dist.Dirichlet(x.new_ones(K)))
        with pyro.plate("components", K):
            tau = pyro.sample("tau", dist.Gamma(x.new_tensor(1.0), 1.0))
            mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), (0.1 * tau).rsqrt()))
        with pyro.plate("data", len(x)):
            c = pyro.sample("c", dist.Categorical(pi))
            pyro.sample("x", dist.Normal(mu[c], tau[c].rsqrt()), obs=x)

    init = {"mu": x.new_tensor([-3.0, 0.5, 3.0]), "tau": x.new_ones(K), "pi": x.new_ones(K) / K}
    guide = AutoCVI(model, schedule="sequential", init_loc_fn=init_to_value(values=init))
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    losses = [svi.step(x) for _ in range(40)]
    assert all(l1 <= l0 + 1e-8 for l0, l1 in zip(losses, losses[1:]))
    before = {k: v.detach().clone() for k, v in guide.natural_params().items()}
    svi.step(x)
    for k, v in guide.natural_params().items():
        assert torch.allclose(v, before[k], rtol=1e-6, atol=1e-6), k
    assert torch.allclose(
        guide.posterior("mu").loc.sort().values, x.new_tensor([-6.0, 0.0, 7.0]), atol=0.4
    )
    text = guide.explain()
    for pair in ("c -> pi", "mu -> tau", "x -> tau", "x -> mu", "x -> c"):
        line = [ln for ln in text.splitlines() if pair in ln][0]
        assert "conjugate" in line and "general" not in line, text


def test_bernoulli_latent_mixture_matches_hand_cavi():
    """Two-component mixture with known components: z_n ~ Bernoulli(p), p ~ Beta."""
    g = torch.Generator().manual_seed(5)
    z = torch.rand(80, generator=g) < 0.3
    x = torch.where(z, 2.0, -1.0).double() + torch.randn(80, generator=g).double()

    def model(x):
        p = pyro.sample("p", dist.Beta(x.new_tensor(1.0), 1.0))
        with pyro.plate("data", len(x)):
            zz = pyro.sample("z", dist.Bernoulli(p))
            pyro.sample("x", dist.Normal(3.0 * zz - 1.0, 1.0), obs=x)

    guide = AutoCVI(model, schedule="sequential")
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    losses = [svi.step(x) for _ in range(60)]
    a, b = 1.0, 1.0
    for _ in range(200):
        Elp = float(torch.digamma(x.new_tensor(a)) - torch.digamma(x.new_tensor(a + b)))
        El1p = float(torch.digamma(x.new_tensor(b)) - torch.digamma(x.new_tensor(a + b)))
        logit = Elp - El1p + dist.Normal(2.0, 1.0).log_prob(x) - dist.Normal(-1.0, 1.0).log_prob(x)
        r = torch.sigmoid(logit)
        a, b = 1.0 + float(r.sum()), 1.0 + float((1 - r).sum())
    assert all(l1 <= l0 + 1e-8 for l0, l1 in zip(losses, losses[1:]))
    q = guide.posterior("p")
    assert q.concentration1.item() == pytest.approx(a, rel=1e-8)
    assert q.concentration0.item() == pytest.approx(b, rel=1e-8)
    assert torch.allclose(guide.posterior("z").probs, r, atol=1e-8)


def test_hierarchical_gamma_rates_are_conditionally_conjugate():
    """z_j ~ Gamma(a, rate=b), b ~ Gamma: the rate of a Gamma is a conjugate Gamma pair."""
    y = torch.tensor([[1.0, 3, 0], [4, 6, 5], [0, 1, 1], [2, 2, 9]], dtype=torch.float64)

    def model(y):
        b = pyro.sample("b", dist.Gamma(y.new_tensor(2.0), 1.0))
        with pyro.plate("groups", 3):
            z = pyro.sample("z", dist.Gamma(1.5, b))
            with pyro.plate("data", 4):
                pyro.sample("y", dist.Poisson(z), obs=y)

    guide = AutoCVI(model, schedule="sequential")
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    losses = [svi.step(y) for _ in range(60)]
    # hand CAVI
    ab, bb = 2.0, 1.0
    for _ in range(500):
        az = 1.5 + y.sum(0)
        bz = ab / bb + 4.0
        ab, bb = 2.0 + 3 * 1.5, 1.0 + float((az / bz).sum())
    assert all(l1 <= l0 + 1e-8 for l0, l1 in zip(losses, losses[1:]))
    qz, qb = guide.posterior("z"), guide.posterior("b")
    assert torch.allclose(qz.concentration, az, rtol=1e-8)
    assert torch.allclose(qz.rate, torch.full_like(qz.rate, bz), rtol=1e-7)
    assert qb.rate.item() == pytest.approx(bb, rel=1e-7)
    assert "z -> b" in guide.explain()


# ------------------------------------------------------------------------------------------------
# non-conjugate factors of non-Gaussian q: Appendix E.3
# ------------------------------------------------------------------------------------------------
def _gamma_shape_elbo(alpha, beta, y, a, b, n=6000):
    """ELBO of q = Gamma(alpha, beta) for p(y, z) = prod Ga(y | z, 1) Ga(z | a, b), by
    trapezoid quadrature on a log grid (independent of the CVI code)."""
    q = dist.Gamma(alpha, beta)
    z = torch.logspace(-8, 2.5, n, dtype=torch.float64)
    f = (
        dist.Gamma(z[:, None], 1.0).log_prob(y).sum(-1)
        + dist.Gamma(a, b).log_prob(z)
        - q.log_prob(z)
    )
    g = q.log_prob(z).exp() * f
    return ((g[1:] + g[:-1]) / 2 * torch.diff(z)).sum()


def test_gamma_shape_model_reaches_the_best_gamma_q():
    """Appendix E.3: Gamma observations with a Gamma prior on the *shape* (non-conjugate)."""
    a, b = 2.0, 1.0
    y = torch.tensor([2.3, 0.7, 1.5], dtype=torch.float64)

    def model(y):
        z = pyro.sample("z", dist.Gamma(y.new_tensor(a), b))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Gamma(z, 1.0), obs=y)

    # the best Gamma q, by direct numerical optimisation of the ELBO
    p = torch.tensor([1.0, 1.0], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS(
        [p],
        max_iter=200,
        tolerance_grad=1e-12,
        tolerance_change=1e-15,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        loss = -_gamma_shape_elbo(p[0].exp(), p[1].exp(), y, a, b)
        loss.backward()
        return loss

    opt.step(closure)
    best = -float(closure().detach())

    guide = AutoCVI(model, remainder="off", num_general_samples=16)
    svi = SVI(model, guide, CVI(step_size=step_sizes.robbins_monro(1.0, 1.0, 0.8)), loss=CVI_ELBO())
    avg = None
    for t in range(200):
        svi.step(y)
        if t >= 150:  # average the last natural parameters (Polyak averaging)
            nat = [v.detach().clone() for v in guide.natural_params().values()]
            avg = nat if avg is None else [u + v for u, v in zip(avg, nat)]
    alpha, beta = avg[0] / 50 + 1, -avg[1] / 50
    got = float(_gamma_shape_elbo(alpha, beta, y, a, b))
    assert got == pytest.approx(best, abs=1e-3)
    q = guide.posterior("z")
    assert float(_gamma_shape_elbo(q.concentration, q.rate, y, a, b)) == pytest.approx(
        best, abs=1e-2
    )
    assert "Fisher solve" in guide.explain()


def test_invalid_steps_are_shrunk_and_counted(caplog):
    """A large Monte Carlo step that would make the Gamma shape negative is shrunk."""
    y = torch.tensor([0.01, 0.02, 50.0], dtype=torch.float64)

    def model(y):
        z = pyro.sample("z", dist.Gamma(y.new_tensor(0.5), 0.5))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Gamma(z, 1.0), obs=y)

    guide = AutoCVI(model, remainder="off", num_general_samples=1)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    with caplog.at_level(logging.INFO, logger="pyro_cvi"), warnings.catch_warnings():
        warnings.simplefilter("error")  # routine: counted and logged once, not warned
        for _ in range(30):
            svi.step(y)
    assert guide.num_shrunk > 1
    assert len([r for r in caplog.records if "shrunk" in r.message]) == 1
    q = guide.posterior("z")
    assert q.concentration.item() > 0 and q.rate.item() > 0


def test_non_conjugate_factor_of_gaussian_latents_in_a_plate():
    """Gaussian latents with batch dims (natural form) and a Poisson(exp(z)) likelihood: the
    Monte Carlo messages reach the best Gaussian q (closed-form ELBO, E[exp z] = exp(m + v/2))."""
    g = torch.Generator().manual_seed(0)
    K, N = 4, 10
    z0 = torch.randn(K, generator=g, dtype=torch.float64)
    y = torch.poisson(torch.exp(z0)[:, None].expand(K, N), generator=g)

    def model(y):
        with pyro.plate("groups", K, dim=-2):
            z = pyro.sample("z", dist.Normal(y.new_zeros(()), 1.0))
            with pyro.plate("obs", N, dim=-1):
                pyro.sample("y", dist.Poisson(torch.exp(z)), obs=y)

    guide = AutoCVI(model, remainder="off", num_general_samples=8)
    svi = SVI(model, guide, CVI(step_size=step_sizes.robbins_monro(1.0, 1.0, 0.7)), loss=CVI_ELBO())
    for _ in range(200):
        svi.step(y)
    m = torch.zeros(K, dtype=y.dtype, requires_grad=True)
    lv = torch.zeros(K, dtype=y.dtype, requires_grad=True)
    opt = torch.optim.LBFGS([m, lv], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        v = lv.exp()
        elbo = (y.sum(1) * m - N * torch.exp(m + v / 2) - 0.5 * (m**2 + v) + 0.5 * lv).sum()
        (-elbo).backward()
        return -elbo

    opt.step(closure)
    q = guide.posterior("z")
    assert torch.allclose(q.loc.flatten(), m.detach(), atol=0.05)
    assert torch.allclose(q.scale.flatten(), lv.detach().exp().sqrt(), rtol=0.1)
    line = [ln for ln in guide.explain().splitlines() if "y -> z" in ln][0]
    assert "general" in line and "Fisher solve" in line
