"""The bilinear block (PPCA / factor analysis with Gamma noise precisions): detection, the
closed-form bound against Trace_ELBO, one step against an independent CAVI sweep, and the
fixed point against a plain CAVI loop."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks import BilinearBlock

N, D, K = 40, 6, 2


def ppca(X, per_column=False, transposed=False, extra=False, offset=0.0):
    n, d = X.shape
    shape = (d, K) if transposed else (K, d)
    W = pyro.sample("W", dist.Normal(X.new_zeros(shape), 0.8).to_event(2))
    s = (d,) if per_column else ()
    tau = pyro.sample("tau", dist.Gamma(2.0 * X.new_ones(s), X.new_ones(s)).to_event(len(s)))
    if extra:  # a second factor on W: no longer a bilinear block
        pyro.sample("w_obs", dist.Normal(W.sum(), 1.0), obs=X.new_tensor(0.3))
    with pyro.plate("data", n):
        z = pyro.sample("z", dist.Normal(X.new_zeros(K) + 0.1, 1.5).to_event(1))
        loc = z @ (W.T if transposed else W) + offset
        pyro.sample("obs", dist.Normal(loc, (2.0 * tau) ** -0.5).to_event(1), obs=X)


def data(dtype, per_column=False):
    g = torch.Generator().manual_seed(3)
    W = torch.randn(K, D, generator=g, dtype=torch.float64)
    z = torch.randn(N, K, generator=g, dtype=torch.float64)
    sd = 0.3 + 0.5 * torch.rand(D, generator=g, dtype=torch.float64) if per_column else 0.4
    return (z @ W + sd * torch.randn(N, D, generator=g, dtype=torch.float64)).to(dtype)


def fit(model, X, steps, optim=None):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model)
    svi = SVI(model, guide, optim or CVI(), CVI_ELBO())
    losses = [svi.step(X) for _ in range(steps)]
    return guide, svi, losses


def _block(guide):
    (b,) = [b for b in guide.engine.blocks if isinstance(b, BilinearBlock)]
    return b


@pytest.mark.parametrize(
    "kw", [{}, {"per_column": True}, {"transposed": True}, {"offset": 0.5}], ids=str
)
def test_bilinear_factor_is_one_block(kw):
    X = data(torch.float64, kw.get("per_column", False))
    guide, _, _ = fit(lambda X: ppca(X, **kw), X, 1)
    b = _block(guide)
    assert set(b.names) == {"W", "tau", "z"}
    text = guide.explain()
    assert "bilinear Normal given" in text and "remainder" not in text


def test_a_latent_with_another_factor_is_not_taken():
    X = data(torch.float64)
    guide, _, _ = fit(lambda X: ppca(X, extra=True), X, 1)
    assert not [b for b in guide.engine.blocks if isinstance(b, BilinearBlock)]


def _cavi_sweep(X, c, m, prior):
    """One independent CAVI sweep z -> W -> tau (Bishop 2006, 10.1 / 12.2.4), columns of W."""
    mz, Sz, mw, Sw, a, b = m
    mz0, pz0, mw0, pw0, a0, b0 = prior
    n, d = X.shape
    outer = lambda m, S: S + torch.einsum("...k,...l->...kl", m, m)  # noqa: E731
    et = (a / b).expand(d)
    r = c * et
    Pz = torch.diag(pz0) + torch.einsum("d,dkl->kl", r, outer(mw, Sw))
    Sz = torch.linalg.inv(Pz).expand(n, K, K)
    mz = torch.linalg.solve(Pz, (pz0 * mz0 + (r * X) @ mw).T).T
    Pw = torch.diag(pw0) + torch.einsum("d,kl->dkl", r, outer(mz, Sz).sum(0))
    Sw = torch.linalg.inv(Pw)
    mw = torch.einsum("dkl,dl->dk", Sw, pw0 * mw0 + (r * X).T @ mz)
    sq = X**2 - 2 * X * (mz @ mw.T) + torch.einsum("nkl,dkl->nd", outer(mz, Sz), outer(mw, Sw))
    if a0.dim():
        a, b = a0 + 0.5 * n, b0 + 0.5 * (c * sq).sum(0)
    else:
        a, b = a0 + 0.5 * n * d, b0 + 0.5 * (c * sq).sum()
    return mz, Sz, mw, Sw, a, b


def _moments(b):
    return [t.detach().double() for t in b._moments()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("per_column", [False, True])
def test_one_step_of_size_one_is_a_cavi_sweep(dtype, per_column):
    X = data(dtype, per_column)
    model = lambda X: ppca(X, per_column=per_column)  # noqa: E731
    guide, svi, _ = fit(model, X, 3, CVI(step_size=1.0))
    b = _block(guide)
    b.sweeps_per_step = 1
    before = _moments(b)
    svi.step(X)
    after = _moments(b)
    s = (D,) if per_column else ()
    prior = (
        torch.full((K,), 0.1, dtype=torch.float64),
        torch.full((K,), 1.5**-2, dtype=torch.float64),
        torch.zeros(K, dtype=torch.float64),
        torch.full((K,), 0.8**-2, dtype=torch.float64),
        torch.full(s, 2.0, dtype=torch.float64),
        torch.full(s, 1.0, dtype=torch.float64),
    )
    expect = _cavi_sweep(X.double(), 2.0, before, prior)
    rtol = 1e-4 if dtype == torch.float32 else 1e-10
    for got, want in zip(after, expect):
        assert torch.allclose(got, want.expand_as(got), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("per_column", [False, True])
def test_the_reported_loss_is_the_bound_of_the_guide(dtype, per_column):
    X = data(dtype, per_column)
    model = lambda X: ppca(X, per_column=per_column)  # noqa: E731
    guide, svi, _ = fit(model, X, 15)
    loss = svi.evaluate_loss(X)
    pyro.set_rng_seed(1)
    with torch.no_grad():
        draws = torch.tensor(
            [Trace_ELBO(num_particles=50).loss(model, guide, X) for _ in range(8)],
            dtype=torch.float64,
        )
    se = float(draws.std() / math.sqrt(len(draws)))
    assert abs(float(draws.mean()) - loss) < 4 * se + 1e-3 * abs(loss)
    assert se < 2.0  # (the check has teeth: a wrong entropy or KL moves the bound by more)


def _elbo(X, c, m, prior):
    """The closed-form ELBO of ``q(z) q(W) q(tau)`` (independent of the block's code)."""
    mz, Sz, mw, Sw, a, b = m
    mz0, pz0, mw0, pw0, a0, b0 = prior
    n, d = X.shape
    outer = lambda m, S: S + torch.einsum("...k,...l->...kl", m, m)  # noqa: E731
    sq = X**2 - 2 * X * (mz @ mw.T) + torch.einsum("nkl,dkl->nd", outer(mz, Sz), outer(mw, Sw))
    et, elt = (a / b).expand(d), (torch.digamma(a) - b.log()).expand(d)
    ll = 0.5 * (n * d * math.log(c / (2 * math.pi)) + n * elt.sum() - c * (et * sq).sum())

    def kl(m, S, m0, p0):
        q = torch.distributions.MultivariateNormal(m, S)
        p = torch.distributions.MultivariateNormal(m0.expand_as(m), torch.diag(1 / p0))
        return torch.distributions.kl_divergence(q, p).sum()

    G = torch.distributions.Gamma
    kl_t = torch.distributions.kl_divergence(G(a, b), G(a0.expand_as(a), b0.expand_as(b))).sum()
    return float(ll - kl(mz, Sz, mz0, pz0) - kl(mw, Sw, mw0, pw0) - kl_t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_bound_is_the_cavi_optimum(dtype):
    X = data(dtype)
    guide, svi, losses = fit(ppca, X, 150)
    b = _block(guide)
    m = _moments(b)
    prior = (
        torch.full((K,), 0.1, dtype=torch.float64),
        torch.full((K,), 1.5**-2, dtype=torch.float64),
        torch.zeros(K, dtype=torch.float64),
        torch.full((K,), 0.8**-2, dtype=torch.float64),
        torch.tensor(2.0, dtype=torch.float64),
        torch.tensor(1.0, dtype=torch.float64),
    )
    X64 = X.double()
    value = _elbo(X64, 2.0, m, prior)
    rtol = 1e-5 if dtype == torch.float32 else 1e-10
    assert svi.evaluate_loss(X) == pytest.approx(-value, rel=rtol)
    for _ in range(3000):  # an independent CAVI loop from there gains (almost) nothing
        m = _cavi_sweep(X64, 2.0, m, prior)
    assert 0 <= _elbo(X64, 2.0, m, prior) - value < 0.1  # (CAVI creeps along rotations)
    assert all(b2 <= b1 + 1e-3 * abs(b1) for b1, b2 in zip(losses[5:], losses[6:]))


def test_the_guide_methods_read_the_block():
    X = data(torch.float32, True)
    model = lambda X: ppca(X, per_column=True)  # noqa: E731
    guide, _, _ = fit(model, X, 5)
    b = _block(guide)
    med, qs = guide.median(X), guide.quantiles([0.1, 0.9], X)
    mz, Sz, mw, Sw, a, bb = b._moments()
    assert torch.allclose(med["W"], mw.T) and torch.allclose(med["z"], mz)
    sd_w = Sw.diagonal(dim1=-2, dim2=-1).sqrt().T
    lo = med["W"] + torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(0.1)) * sd_w
    assert torch.allclose(qs["W"][0], lo, atol=0.05 * float(sd_w.max()))  # (by sampling)
    sd_z = Sz.diagonal(dim1=-2, dim2=-1).sqrt()
    assert torch.allclose(qs["z"][1], mz + 1.2815516 * sd_z, rtol=1e-5, atol=1e-5)
    draws = pyro.infer.Predictive(model, guide=guide, num_samples=4)(X)
    assert draws["W"].shape[-2:] == (K, D) and draws["z"].shape == (4, N, K)


def test_naming_a_family_keeps_the_joint_gaussian():
    X = data(torch.float64)
    pyro.clear_param_store()
    guide = AutoCVI(ppca, families={"W": "gaussian"})
    SVI(ppca, guide, CVI(), CVI_ELBO()).step(X)
    assert not [b for b in guide.engine.blocks if isinstance(b, BilinearBlock)]
    assert {"W", "z"} <= set(guide.engine.analysis.remainder)


# ---------------------------------------------------------------- a mean and a non-conjugate noise
C = 4.0  # the model's noise is v-derived sd / 2: precision c tau with c = 4


def ppca_mean(X, noise="scale"):
    """PPCA with a mean ``mu`` and a noise scale (HalfNormal) or variance (InverseGamma)."""
    n, d = X.shape
    W = pyro.sample("W", dist.Normal(X.new_zeros(K, d), 0.8).to_event(2))
    mu = pyro.sample("mu", dist.Normal(X.new_zeros(d) + 0.2, 2.0).to_event(1))
    if noise == "scale":
        sd = pyro.sample("sigma", dist.HalfNormal(X.new_tensor(1.0)))
    elif noise == "column_scales":  # one LogNormal scale per column (factor analysis)
        sd = pyro.sample("sigma", dist.LogNormal(X.new_zeros(d) - 1.0, 1.0).to_event(1))
    else:
        sd = pyro.sample("v", dist.InverseGamma(X.new_tensor(3.0), X.new_tensor(0.5))).sqrt()
    with pyro.plate("data", n):
        z = pyro.sample("z", dist.Normal(X.new_zeros(K) + 0.1, 1.5).to_event(1))
        pyro.sample("obs", dist.Normal(z @ W + mu, sd / 2).to_event(1), obs=X)


def data_mean(dtype):
    g = torch.Generator().manual_seed(5)
    W = torch.randn(K, D, generator=g, dtype=torch.float64)
    z = torch.randn(N, K, generator=g, dtype=torch.float64)
    noise = 0.2 * torch.randn(N, D, generator=g, dtype=torch.float64)
    return (z @ W + 1.0 + noise).to(dtype)


_PRIOR_MEAN = {  # z: (m0, p0); columns (w_d, mu_d): (m0, p0)
    "z": (
        torch.full((K,), 0.1, dtype=torch.float64),
        torch.full((K,), 1.5**-2, dtype=torch.float64),
    ),
    "u": (
        torch.tensor([0.0] * K + [0.2], dtype=torch.float64),
        torch.tensor([0.8**-2] * K + [0.25], dtype=torch.float64),
    ),
}
_HALF_NORMAL_CONST = math.log(2.0) - 0.5 * math.log(2 * math.pi) + math.log(0.5)


def _noise_term(noise, a, b):
    """``E_q[log p(tau)] + H[q(tau)]`` in closed form: for a HalfNormal(1) scale
    ``log p(tau) = const - 1/(2 tau) - 3/2 log tau`` (``E[1/tau] = b / (a - 1)``); for an
    InverseGamma(3, 0.5) variance ``p(tau)`` is Gamma(3, 0.5)."""
    G = torch.distributions.Gamma
    if noise == "scale":
        e_log = torch.digamma(a) - b.log()
        return _HALF_NORMAL_CONST - 0.5 * b / (a - 1) - 1.5 * e_log + G(a, b).entropy()
    return -torch.distributions.kl_divergence(G(a, b), G(a.new_tensor(3.0), a.new_tensor(0.5)))


def _mean_moments(X, m):
    mz, Sz, mu_, Su, a, b = m
    za = torch.cat([mz, torch.ones(len(mz), 1, dtype=mz.dtype)], 1)
    Ezz = torch.nn.functional.pad(Sz, (0, 1, 0, 1)) + za[:, :, None] * za[:, None, :]
    Euu = Su + mu_[:, :, None] * mu_[:, None, :]
    sq = X**2 - 2 * X * (za @ mu_.T) + torch.einsum("nkl,dkl->nd", Ezz, Euu)
    return za, Ezz, Euu, sq


def _mean_elbo(X, noise, m):
    """The ELBO of ``q(z) q(W, mu) q(tau)`` in closed form (independent of the block)."""
    mz, Sz, mu_, Su, a, b = m
    n, d = X.shape
    _, _, _, sq = _mean_moments(X, m)
    ll = 0.5 * (n * d * math.log(C / (2 * math.pi)) + n * d * (torch.digamma(a) - b.log()))
    ll = ll - 0.5 * C * (a / b) * sq.sum()

    def kl(m_, S, m0, p0):
        q = torch.distributions.MultivariateNormal(m_, S)
        p = torch.distributions.MultivariateNormal(m0.expand_as(m_), torch.diag(1 / p0))
        return torch.distributions.kl_divergence(q, p).sum()

    return float(
        ll
        - kl(mz, Sz, *_PRIOR_MEAN["z"])
        - kl(mu_, Su, *_PRIOR_MEAN["u"])
        + _noise_term(noise, a, b)
    )


def _mean_cavi_sweep(X, noise, m):
    """One CAVI sweep z -> (W, mu) columns -> tau (plain torch). For the HalfNormal scale the
    tau update is the CVI fixed point ``lambda = conjugate part + grad_m E_q[f]`` with
    ``E_q[f]`` in closed form and ``J = d m / d(a, b)`` by autograd."""
    mz, Sz, mu_, Su, a, b = m
    n, d = X.shape
    (m0z, p0z), (m0u, p0u) = _PRIOR_MEAN["z"], _PRIOR_MEAN["u"]
    r = C * a / b
    Euu = Su + mu_[:, :, None] * mu_[:, None, :]
    Pz = torch.diag(p0z) + r * Euu[:, :K, :K].sum(0)
    eta = p0z * m0z + r * (X @ mu_[:, :K] - Euu[:, :K, K].sum(0))
    Sz = torch.linalg.inv(Pz).expand(n, K, K)
    mz = torch.linalg.solve(Pz, eta.T).T
    za, Ezz, _, _ = _mean_moments(X, (mz, Sz, mu_, Su, a, b))
    Pu = torch.diag(p0u) + r * Ezz.sum(0)
    Su = torch.linalg.inv(Pu).expand(d, K + 1, K + 1)
    mu_ = torch.linalg.solve(Pu, (p0u * m0u + r * X.T @ za).T).T
    _, _, _, sq = _mean_moments(X, (mz, Sz, mu_, Su, a, b))
    a1, b1 = a.new_tensor(1 + 0.5 * n * d), 0.5 * C * sq.sum()
    if noise == "variance":
        return mz, Sz, mu_, Su, a1 + 2.0, b1 + 0.5
    ab = torch.stack([a, b])

    def f(ab):
        a_, b_ = ab
        return 0.5 * b_ / (a_ - 1) * -1 - 1.5 * (torch.digamma(a_) - b_.log())

    def means(ab):
        a_, b_ = ab
        return torch.stack([torch.digamma(a_) - b_.log(), a_ / b_])

    J = torch.autograd.functional.jacobian(means, ab)
    g = torch.linalg.solve(J.T, torch.autograd.functional.jacobian(f, ab))
    return mz, Sz, mu_, Su, a1 + g[0], b1 - g[1]


@pytest.mark.parametrize("noise", ["scale", "variance", "column_scales"])
def test_a_mean_and_a_noise_scale_join_the_block(noise):
    X = data_mean(torch.float64)
    guide, _, _ = fit(lambda X: ppca_mean(X, noise), X, 1)
    b = _block(guide)
    v = "v" if noise == "variance" else "sigma"
    assert set(b.names) == {"W", "mu", v, "z"} and not guide.engine.analysis.remainder
    assert b.spec.power == (-1.0 if noise == "variance" else -2.0) and not b.spec.conjugate
    assert b.marginal(v).event_shape == ((D,) if noise == "column_scales" else ())
    assert torch.allclose(b.spec.weight, torch.full((N, D), C, dtype=torch.float64))
    text = guide.explain()
    assert "a CVI site on q(tau)" in text and "remainder" not in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("noise", ["scale", "variance"])
def test_the_mean_models_bound_is_the_cavi_optimum(dtype, noise):
    X = data_mean(dtype)
    model = lambda X: ppca_mean(X, noise)  # noqa: E731
    guide, svi, losses = fit(model, X, 100)
    m = _moments(_block(guide))
    X64 = X.double()
    value = _mean_elbo(X64, noise, m)
    rtol = 1e-5 if dtype == torch.float32 else 1e-9
    assert svi.evaluate_loss(X) == pytest.approx(-value, rel=rtol)
    # the fixed point: an independent CAVI loop from there moves q(tau) by nothing and gains
    # (almost) nothing (it creeps along rotations of z, W)
    start = m
    for _ in range(400):
        m = _mean_cavi_sweep(X64, noise, m)
    assert 0 <= _mean_elbo(X64, noise, m) - value < 0.05
    for got, want in zip(start[4:], m[4:]):
        assert float(got) == pytest.approx(float(want), rel=1e-3)
    assert all(b2 <= b1 + 1e-3 * abs(b1) for b1, b2 in zip(losses[5:], losses[6:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("noise", ["scale", "variance", "column_scales"])
def test_the_mean_models_loss_is_the_bound_of_the_guide(dtype, noise):
    X = data_mean(dtype)
    model = lambda X: ppca_mean(X, noise)  # noqa: E731
    guide, svi, _ = fit(model, X, 15)
    loss = svi.evaluate_loss(X)
    pyro.set_rng_seed(1)
    with torch.no_grad():
        draws = torch.tensor(
            [Trace_ELBO(num_particles=50).loss(model, guide, X) for _ in range(8)],
            dtype=torch.float64,
        )
    se = float(draws.std() / math.sqrt(len(draws)))
    assert abs(float(draws.mean()) - loss) < 3 * se + 1e-3 * abs(loss)
    assert se < 2.0  # (a wrong entropy, KL or column draw moves the bound by more)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_noise_sites_message_is_exact_for_a_conjugate_prior(dtype):
    """An InverseGamma(alpha, beta) variance is a Gamma(alpha, beta) precision: its CVI message
    by quadrature is exactly ``(alpha - 1, -beta)``; a HalfNormal(1) scale's ``E_q[f]`` and
    message against the closed form."""
    from pyro_cvi.messages.noise_prior import NoisePrior

    # (a float32 prior evaluates f in float32: its rounding limits the fit at larger shapes)
    a = torch.tensor([0.3, 0.7, 3.0, 150.0, 2000.0, 1e5], dtype=dtype)
    b = torch.tensor([0.1, 0.3, 2.0, 11.0, 40.0, 3.0], dtype=dtype)
    if dtype == torch.float32:
        a, b = a[:-1], b[:-1]
    inv = NoisePrior(dist.InverseGamma(torch.tensor(3.0, dtype=dtype), 0.5), -1.0, dtype)
    g_log, g_tau = inv.message(a, b)
    # (to the precision of the natural parameters it joins: a - 1 and b of that size)
    tol = 1e-7 if dtype == torch.float32 else 1e-12
    assert bool(((g_log - 2.0).abs() <= tol * (1 + a)).all()), g_log
    assert bool(((g_tau + 0.5).abs() <= tol * (1 + b)).all()), g_tau
    half = NoisePrior(dist.HalfNormal(torch.tensor(1.0, dtype=dtype)), -2.0, dtype)
    a, b = a[2:].double(), b[2:].double()
    want = _HALF_NORMAL_CONST - 0.5 * b / (a - 1) - 1.5 * (torch.digamma(a) - b.log())
    assert torch.allclose(half.expected(a, b), want, rtol=1e-8, atol=1e-8)
    # the message: the mean-parameter gradient of the closed form, through autograd's J
    for ai, bi in zip(a, b):
        ab = torch.stack([ai, bi])
        e = lambda ab: -0.5 * ab[1] / (ab[0] - 1) - 1.5 * (torch.digamma(ab[0]) - ab[1].log())  # noqa: E731
        m = lambda ab: torch.stack([torch.digamma(ab[0]) - ab[1].log(), ab[0] / ab[1]])  # noqa: E731
        J = torch.autograd.functional.jacobian(m, ab)
        want = torch.linalg.solve(J.T, torch.autograd.functional.jacobian(e, ab))
        got = torch.stack(half.message(ai.reshape(1), bi.reshape(1))).reshape(2)
        assert torch.allclose(got, want, rtol=1e-7, atol=1e-12)


def test_the_guide_methods_read_the_mean_and_the_scale():
    X = data_mean(torch.float32)
    model = lambda X: ppca_mean(X, "scale")  # noqa: E731
    guide, _, _ = fit(model, X, 10)
    b = _block(guide)
    mz, Sz, mu_, Su, a, bb = b._moments()
    med = guide.median(X)
    assert torch.allclose(med["mu"], mu_[:, K]) and torch.allclose(med["W"], mu_[:, :K].T)
    q_tau = torch.distributions.Gamma(a.double(), bb.double())
    tau = q_tau.sample((20000,))
    assert float(med["sigma"]) == pytest.approx(float(tau.median() ** -0.5), rel=3e-3)
    sig = tau**-0.5
    assert float(b.mean_values()["sigma"]) == pytest.approx(float(sig.mean()), rel=3e-3)
    assert float(b.marginal("sigma").variance) == pytest.approx(float(sig.var()), rel=0.05)
    qs = guide.quantiles([0.1, 0.9], X)["sigma"].double()
    want = torch.quantile(sig, torch.tensor([0.1, 0.9], dtype=torch.float64))
    assert torch.allclose(qs, want, rtol=3e-3)
    draws = pyro.infer.Predictive(model, guide=guide, num_samples=4)(X)
    assert draws["W"].shape[-2:] == (K, D) and draws["mu"].shape[-1] == D
    assert draws["sigma"].shape[0] == 4 and bool((draws["sigma"] > 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("noise", ["scale", "variance"])
def test_one_step_of_the_mean_model_is_a_cavi_sweep(dtype, noise):
    """One step of size 1 (one sweep) against the plain-torch sweep: the columns ``(w_d, mu_d)``
    joint, ``q(tau)`` by the quadrature message (exact for the InverseGamma variance)."""
    X = data_mean(dtype)
    guide, svi, _ = fit(lambda X: ppca_mean(X, noise), X, 3, CVI(step_size=1.0))
    b = _block(guide)
    b.sweeps_per_step = 1
    before = _moments(b)
    svi.step(X)
    after = _moments(b)
    expect = _mean_cavi_sweep(X.double(), noise, before)
    rtol = 1e-4 if dtype == torch.float32 else 1e-7
    for got, want in zip(after, expect):
        assert torch.allclose(got, want.expand_as(got), rtol=rtol, atol=rtol)


def test_a_noise_prior_with_a_learnable_parameter_is_not_taken():
    """The block reads the priors as constants: a learnable scale inside the HalfNormal (a
    parameter of a transformed law) keeps the factor out of it."""

    def model(X):
        s0 = pyro.param("s0", torch.tensor(1.0, dtype=X.dtype))
        W = pyro.sample("W", dist.Normal(X.new_zeros(K, X.shape[1]), 1.0).to_event(2))
        sigma = pyro.sample("sigma", dist.HalfNormal(s0))
        with pyro.plate("data", X.shape[0]):
            z = pyro.sample("z", dist.Normal(X.new_zeros(K), 1.0).to_event(1))
            pyro.sample("obs", dist.Normal(z @ W, sigma).to_event(1), obs=X)

    X = data(torch.float64)
    pyro.clear_param_store()
    guide = AutoCVI(model)
    guide(X)
    assert not [b for b in guide.engine.blocks if isinstance(b, BilinearBlock)]
    pyro.clear_param_store()
    guide = AutoCVI(ppca_mean)  # (the same model with a constant scale is taken)
    guide(data_mean(torch.float64))
    assert [b for b in guide.engine.blocks if isinstance(b, BilinearBlock)]
