"""State-space (Markov) CVI: Kalman-smoother conjugate computations (App. E.2) against dense
Gaussian computations, SDE kernels against their closed forms, detection of Pyro chains."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from bench.datasets import load_coal
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.statespace import (
    LinearGaussianChain,
    MarkovGP,
    Matern12,
    Matern32,
    Matern52,
    kalman,
    log_normalizer,
    markov_gp,
    predict,
    smooth,
)
from pyro_cvi.statespace.kalman import log_prob_chain


@pytest.fixture(autouse=True)
def _one_newton_step_start(monkeypatch):
    """The Kalman block starts its sites with one Newton step from the prior mean; the dense
    block it is compared with starts the same way (no damped Laplace start)."""
    from pyro_cvi.blocks.gaussian import GaussianBlock

    monkeypatch.setattr(GaussianBlock, "damped_start", lambda self, ctx: False)


D64 = torch.float64


def _dense(chain, T, d):
    """Mean and covariance of the chain's joint, from the Hessian of its log-density."""
    x0 = torch.zeros(T * d, dtype=D64)
    P = -torch.autograd.functional.hessian(lambda x: log_prob_chain(chain, x.reshape(T, d)), x0)
    g = torch.autograd.functional.jacobian(lambda x: log_prob_chain(chain, x.reshape(T, d)), x0)
    cov = torch.linalg.inv(P)
    return cov @ g, cov


def _random_chain(T, d, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=D64)

    def spd(*s):
        M = r(*s, d, d)
        return M @ M.transpose(-1, -2) / d + 0.3 * torch.eye(d, dtype=D64)

    return LinearGaussianChain(r(d), spd(), 0.5 * r(T - 1, d, d), r(T - 1, d), spd(T - 1)), r, spd


@pytest.mark.parametrize("pack_below", [0, 2048], ids=["arrays", "stacked"])
@pytest.mark.parametrize("d", [1, 2, 3])
def test_smoother_equals_dense_gaussian(d, pack_below, monkeypatch):
    """Both storage forms of the reduction (structure of arrays, stacked tensors)."""
    monkeypatch.setattr(kalman, "PACK_BELOW", pack_below)
    T = 9
    chain, r, spd = _random_chain(T, d)
    eta, J = r(T, d), spd(T)
    mu, S = _dense(chain, T, d)
    Jd = torch.block_diag(*J)
    Sinv = torch.linalg.inv(S)
    Pq = Sinv + Jd
    h = Sinv @ mu + eta.reshape(-1)
    log_z = (
        0.5 * h @ torch.linalg.solve(Pq, h)
        - 0.5 * mu @ Sinv @ mu
        - 0.5 * torch.logdet(torch.eye(T * d, dtype=D64) + S @ Jd)
    )
    post = smooth(chain, eta, J)
    mean = torch.linalg.solve(Pq, h).reshape(T, d)
    cov = torch.linalg.inv(Pq)
    blocks = torch.stack([cov[t * d : (t + 1) * d, t * d : (t + 1) * d] for t in range(T)])
    assert float(post.log_z) == pytest.approx(float(log_z), rel=1e-10)
    assert torch.allclose(post.mean, mean, atol=1e-10)
    assert torch.allclose(post.cov, blocks, atol=1e-10)
    assert float(log_normalizer(chain, eta, J)) == pytest.approx(float(log_z), rel=1e-10)


@pytest.mark.parametrize(
    "kernel",
    [
        lambda: Matern12(0.7, 1.3),
        lambda: Matern32(0.7, 1.3),
        lambda: Matern52(0.7, 1.3),
        lambda: Matern32(2.0, 0.5) + Matern12(0.3, 0.2),
    ],
    ids=["m12", "m32", "m52", "sum"],
)
def test_markov_gp_has_the_kernel_covariance_at_irregular_inputs(kernel):
    torch.set_default_dtype(D64)
    try:
        kernel = kernel()
        times = torch.tensor([0.0, 0.1, 0.15, 0.9, 1.0, 2.5, 2.6])
        prior = MarkovGP(times, kernel)
        T, d = prior.event_shape
        mu, S = _dense(prior.chain, T, d)
        H = torch.block_diag(*[prior.emission[None]] * T)
        K = kernel.covariance(times, times)
        assert torch.allclose(H @ S @ H.T, K, atol=1e-9)
        assert torch.allclose(mu, torch.zeros_like(mu), atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


def _coal_models(data, kernel):
    binsize = data.binsize

    def markov(t, y):
        f = markov_gp("x", t, kernel())
        with pyro.plate("bins", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f) * binsize), obs=y)

    def dense(t, y):
        K = kernel().covariance(t, t)
        f = pyro.sample("f", dist.MultivariateNormal(t.new_zeros(len(t)), covariance_matrix=K))
        with pyro.plate("bins", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f) * binsize), obs=y)

    return markov, dense


def _fit(model, t, y, steps, optim):
    pyro.clear_param_store()
    guide = AutoCVI(model)
    svi = SVI(model, guide, optim, loss=CVI_ELBO())
    args = (t,) if y is None else (t, y)
    losses = [svi.step(*args) for _ in range(steps)]
    return guide, losses


@pytest.mark.slow
def test_coal_markov_cvi_equals_dense_cvi(shared_data):
    """The Done-means check: T = 200, Matern-3/2 with fixed hyperparameters."""
    data = load_coal(200, shared_data)
    markov, dense = _coal_models(data, lambda: Matern32(lengthscale=10.0, variance=1.0))
    gm, lm = _fit(markov, data.t, data.y, 40, CVI(step_size=1.0))
    gd, ld = _fit(dense, data.t, data.y, 40, CVI(step_size=1.0))
    assert abs(lm[-1] - lm[-2]) < 1e-9 * abs(lm[-1])  # converged
    assert lm[-1] == pytest.approx(ld[-1], rel=1e-6)
    assert "Markov prior: Kalman smoother, O(T d^3)" in gm.explain()
    qm, qd = gm.posterior("x"), gd.posterior("f")
    assert torch.allclose(qm.mean[:, 0], qd.loc, atol=1e-6)
    assert torch.allclose(qm.variance[:, 0], qd.variance, atol=1e-6)
    # predictions at held-out inputs equal the dense GP's predictive of the same q
    t_new = torch.linspace(float(data.t[0]) - 3, float(data.t[-1]) + 3, 37, dtype=D64)
    mean, var = predict(gm, "x", t_new, data.t, data.y)
    k = Matern32(lengthscale=10.0, variance=1.0)
    K, Ks = k.covariance(data.t, data.t), k.covariance(t_new, data.t)
    W = torch.linalg.solve(K, Ks.T).T
    S = gd.joint_posterior("f").covariance_matrix
    ref_var = 1.0 - (W * Ks).sum(-1) + ((W @ S) * W).sum(-1)
    assert torch.allclose(mean, W @ qd.loc, atol=1e-6)
    assert torch.allclose(var, ref_var, atol=1e-6)


@pytest.mark.slow
def test_hyperparameters_follow_the_dense_path_in_the_hybrid_step(shared_data):
    """Lengthscale and variance learned in the same svi.step: the Markov and dense paths take
    the same Adam steps (log Z's graph gives the same hyperparameter gradients)."""
    data = load_coal(60, shared_data)

    def kernel():
        ls = pyro.param("ls", torch.tensor(8.0, dtype=D64), constraint=dist.constraints.positive)
        var = pyro.param("var", torch.tensor(0.8, dtype=D64), constraint=dist.constraints.positive)
        return Matern32(ls, var)

    markov, dense = _coal_models(data, kernel)
    out = []
    for model in (markov, dense):
        _, losses = _fit(model, data.t, data.y, 15, CVI(step_size=1.0, optim_args={"lr": 0.05}))
        out.append((losses, pyro.param("ls").item(), pyro.param("var").item()))
    (lm, ls_m, v_m), (ld, ls_d, v_d) = out
    assert ls_m != pytest.approx(8.0, abs=0.2)  # it moved
    assert ls_m == pytest.approx(ls_d, rel=1e-6)
    assert v_m == pytest.approx(v_d, rel=1e-6)
    assert lm[-1] == pytest.approx(ld[-1], rel=1e-6)


def _ar1(T, a=0.9, b=0.1, q=0.3):
    one = torch.ones((), dtype=D64)

    def loop(y):
        x = pyro.sample("x_0", dist.Normal(0 * one, one))
        for t in pyro.markov(range(T)):
            if t > 0:
                x = pyro.sample(f"x_{t}", dist.Normal(a * x + b, q * one))
            pyro.sample(f"y_{t}", dist.Poisson(torch.exp(x)), obs=y[t])

    # the same prior as one MVN (its joint from the Hessian of the chain's density)
    chain = LinearGaussianChain(
        torch.zeros(1, dtype=D64),
        torch.ones(1, 1, dtype=D64),
        torch.full((T - 1, 1, 1), a, dtype=D64),
        torch.full((T - 1, 1), b, dtype=D64),
        torch.full((T - 1, 1, 1), q**2, dtype=D64),
    )
    mu, S = _dense(chain, T, 1)

    def dense(y):
        x = pyro.sample("x", dist.MultivariateNormal(mu, covariance_matrix=S))
        with pyro.plate("t", T):
            pyro.sample("y", dist.Poisson(torch.exp(x)), obs=y)

    return loop, dense


@pytest.mark.slow
def test_pyro_markov_loop_is_fitted_by_plain_autocvi():
    T = 25
    g = torch.Generator().manual_seed(1)
    y = torch.poisson(torch.full((T,), 2.0, dtype=D64), generator=g)
    loop, dense = _ar1(T)
    pyro.clear_param_store()
    guide = AutoCVI(loop)
    svi = SVI(loop, guide, CVI(), loss=CVI_ELBO())
    losses = [svi.step(y) for _ in range(30)]
    text = guide.explain()
    assert "Markov prior: Kalman smoother, O(T d^3)" in text
    assert "linear-predictor" in text
    gd = AutoCVI(dense, prefix="dense")
    svi_d = SVI(dense, gd, CVI(), loss=CVI_ELBO())
    ld = [svi_d.step(y) for _ in range(30)]
    assert losses[-1] == pytest.approx(ld[-1], rel=1e-6)
    means = torch.stack([guide.posterior(f"x_{t}").mean for t in range(T)])
    assert torch.allclose(means, gd.posterior("x").mean, atol=1e-6)


@pytest.mark.slow
def test_vector_state_loop_equals_dense_cvi():
    """A ``pyro.markov`` loop of 2-d states (``.to_event(1)``), the Poisson log-rate a
    combination of both components: Kalman-smoother CVI equals dense CVI on the same joint."""
    T = 8
    A = torch.tensor([[0.9, 0.1], [-0.2, 0.8]], dtype=D64)
    h = torch.tensor([1.0, 0.5], dtype=D64)
    y = torch.poisson(torch.full((T,), 2.0, dtype=D64), generator=torch.Generator().manual_seed(2))

    def loop(y):
        x = pyro.sample("x_0", dist.Normal(torch.zeros(2, dtype=D64), 1.0).to_event(1))
        for t in pyro.markov(range(T)):
            if t > 0:
                x = pyro.sample(f"x_{t}", dist.Normal(A @ x + 0.1, 0.3).to_event(1))
            pyro.sample(f"y_{t}", dist.Poisson(torch.exp(h @ x)), obs=y[t])

    eye = torch.eye(2, dtype=D64)
    chain = LinearGaussianChain(
        torch.zeros(2, dtype=D64),
        eye,
        A.expand(T - 1, 2, 2),
        torch.full((T - 1, 2), 0.1, dtype=D64),
        (0.09 * eye).expand(T - 1, 2, 2),
    )
    mu, S = _dense(chain, T, 2)

    def dense(y):
        x = pyro.sample("x", dist.MultivariateNormal(mu, covariance_matrix=S)).reshape(T, 2)
        with pyro.plate("t", T):
            pyro.sample("y", dist.Poisson(torch.exp(x @ h)), obs=y)

    gl, ll = _fit(loop, y, None, 15, CVI())
    gd, ld = _fit(dense, y, None, 15, CVI())
    assert "(T=8, d=2)" in gl.explain()
    assert ll[-1] == pytest.approx(ld[-1], rel=1e-8)
    q = gl.posterior("x_5")
    assert torch.allclose(q.mean, gd.posterior("x").mean.reshape(T, 2)[5], atol=1e-6)


@pytest.mark.slow
def test_markov_posterior_log_prob_and_samples_match_the_dense_q():
    """``q`` as a distribution: exact log-density against the dense Gaussian, and draws (by
    perturbation) with the right mean and covariance."""
    from pyro_cvi.statespace.kalman import smooth as _smooth
    from pyro_cvi.statespace.posterior import MarkovPosterior, SiteRows

    T, d = 5, 2
    chain, r, _ = _random_chain(T, d, seed=3)
    g = torch.Generator().manual_seed(4)
    H = torch.randn(T, d, generator=g, dtype=D64)
    rows = SiteRows(torch.arange(T), H, torch.rand(T, generator=g, dtype=D64) + 0.5, r(T), T)
    eta, J = rows.information()
    q = MarkovPosterior(chain, rows, _smooth(chain, eta, J), torch.Size([T, d]))
    mu, S = _dense(chain, T, d)
    P = torch.linalg.inv(S) + torch.block_diag(*J)
    cov = torch.linalg.inv(P)
    mean = cov @ (torch.linalg.solve(S, mu) + eta.reshape(-1))
    ref = dist.MultivariateNormal(mean, covariance_matrix=cov)
    x = ref.sample((3,))
    assert torch.allclose(q.log_prob(x.reshape(3, T, d)), ref.log_prob(x), atol=1e-9)
    torch.manual_seed(0)
    n = 200
    xs = q.sample((n,)).reshape(n, -1)
    se = cov.diagonal().sqrt() / n**0.5
    assert ((xs.mean(0) - mean).abs() < 5 * se).all()
    assert torch.allclose(torch.cov(xs.T), cov, atol=0.4 * float(cov.diagonal().max()))


def test_a_fixed_kernel_prior_is_built_once_per_inputs_and_equals_a_fresh_one():
    """A model rebuilding ``MarkovGP(t, Matern32(20.0, 1.0))`` every step gets the cached
    transitions for the same (unmodified) ``t``: the same numbers as a fresh computation; new
    numbers when ``t`` changes in place; no cache for tensor hyperparameters (their graph)."""
    t = torch.cumsum(torch.rand(50, dtype=torch.float64) + 0.1, 0)
    a, b = MarkovGP(t, Matern32(20.0, 1.0)), MarkovGP(t, Matern32(20.0, 1.0))
    assert b.A is a.A and b.Q is a.Q
    fresh_A, fresh_Q = Matern32(20.0, 1.0).transitions(t[1:] - t[:-1])
    torch.testing.assert_close(a.A, fresh_A, rtol=0, atol=0)
    torch.testing.assert_close(a.Q, fresh_Q, rtol=0, atol=0)
    assert MarkovGP(t, Matern32(10.0, 1.0)).A is not a.A  # other hyperparameters
    assert MarkovGP(t.clone(), Matern32(20.0, 1.0)).A is not a.A  # other inputs
    t.mul_(2.0)
    c = MarkovGP(t, Matern32(20.0, 1.0))
    torch.testing.assert_close(c.A, Matern32(20.0, 1.0).transitions(t[1:] - t[:-1])[0])
    assert not torch.allclose(c.A, a.A)
    ls = torch.tensor(20.0, dtype=torch.float64, requires_grad=True)
    d = MarkovGP(t, Matern32(ls, 1.0))
    assert d.A.requires_grad and MarkovGP(t, Matern32(ls, 1.0)).A is not d.A
    with pytest.raises(ValueError, match="strictly increasing"):
        MarkovGP(t.flip(0), Matern32(20.0, 1.0))
