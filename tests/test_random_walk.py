"""A vectorised random walk ``x = eps.cumsum(...)`` of Normal increments is fitted as a Markov
chain (Kalman smoother) and equals the dense Gaussian block on the same model; look-alikes
(reversed or partial cumsums) stay dense."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.statespace import random_walk
from pyro_cvi.statespace.increments import Increments


@pytest.fixture(autouse=True)
def _one_newton_step_start(monkeypatch):
    """The Kalman block starts its sites with one Newton step from the prior mean; the dense
    block it is compared with starts the same way (no damped Laplace start)."""
    from pyro_cvi.blocks.gaussian import GaussianBlock

    monkeypatch.setattr(GaussianBlock, "damped_start", lambda self, ctx: False)


D64 = torch.float64
KALMAN = "Markov prior: Kalman smoother, O(T d^3)"


def _counts(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(T, dtype=D64)
    return torch.poisson(torch.exp(torch.sin(t / 15.0) + 0.5), generator=g)


def _walk(T, form="event", obs="poisson", s=0.3):
    """The forecasting-tutorial model: increments, ``cumsum``, observations of ``x_t``."""

    def model(y):
        zero = torch.zeros((), dtype=D64)
        if form == "plate":
            with pyro.plate("time", T):
                eps = pyro.sample("eps", dist.Normal(zero, s))
        else:
            eps = pyro.sample("eps", dist.Normal(zero, s).expand([T]).to_event(1))
        x = {
            "event": lambda e: e.cumsum(-1),
            "plate": lambda e: e.cumsum(-1),
            "reversed": lambda e: e.flip(-1).cumsum(-1).flip(-1),
            "partial": lambda e: torch.cat([e[:5], e[5:].cumsum(-1)]),
        }[form](eps)
        with pyro.plate("obs", T):
            if obs == "poisson":
                pyro.sample("y", dist.Poisson(x.exp()), obs=y)
            else:
                pyro.sample("y", dist.Bernoulli(logits=x + pyro.param("b", zero)), obs=y)

    return model


def _fit(model, y, steps, optim, markov=True, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setattr(random_walk, "RECOGNISE_RANDOM_WALKS", markov)
    pyro.clear_param_store()
    guide = AutoCVI(model)
    svi = SVI(model, guide, optim, loss=CVI_ELBO())
    losses = [svi.step(y) for _ in range(steps)]
    return guide, losses


def _dense_marginals(guide, T):
    """Means and variances of ``eps`` and of ``x = L eps`` from the dense block's joint."""
    q = guide.joint_posterior("eps")
    L = torch.tril(torch.ones(T, T, dtype=D64))
    S = q.covariance_matrix
    return q.loc, S.diagonal(), L @ q.loc, (L @ S @ L.T).diagonal()


def test_increments_layout_is_a_bijection():
    inc = Increments(torch.Size([3, 7, 2]), 1)
    z = torch.randn(5, 42, dtype=D64)
    x = inc.states(z)
    ref = z.reshape(5, 3, 7, 2).cumsum(2).movedim(2, 1).reshape(5, 7, 6)
    assert torch.allclose(x, ref)
    assert torch.allclose(inc.increments(x), z)


def test_random_walk_equals_dense_cvi(monkeypatch):
    """The main check, T = 200, fixed step size: every reported loss equals the dense
    block's -ELBO to 1e-6 relative; marginals of x = cumsum(eps) and of eps agree to 1e-6."""
    T = 200
    y = _counts(T)
    model = _walk(T)
    gm, lm = _fit(model, y, 12, CVI(step_size=1.0), True, monkeypatch)
    gd, ld = _fit(model, y, 12, CVI(step_size=1.0), False, monkeypatch)
    assert KALMAN in gm.explain() and "cumsum(eps, dim=0)" in gm.explain()
    assert KALMAN not in gd.explain() and "joint" not in gd.explain()
    assert lm == pytest.approx(ld, rel=1e-6)
    assert abs(lm[-1] - lm[-2]) < 1e-8 * lm[-1]  # converged, not just equal
    eps_mean, eps_var, x_mean, x_var = _dense_marginals(gd, T)
    post = gm.engine.block_of("eps").marginals()
    assert torch.allclose(post.mean[:, 0], x_mean, atol=1e-6)
    assert torch.allclose(post.cov[:, 0, 0], x_var, atol=1e-6)
    q = gm.posterior("eps")
    assert torch.allclose(q.mean, eps_mean, atol=1e-6)
    assert torch.allclose(q.variance, eps_var, atol=1e-6)
    assert torch.allclose(gm.median()["eps"], eps_mean, atol=1e-6)
    # the plate form (eps in pyro.plate, mean field before) is the same Markov q
    gp, lp = _fit(_walk(T, "plate"), y, 12, CVI(step_size=1.0), True, monkeypatch)
    assert KALMAN in gp.explain()
    assert lp == pytest.approx(ld, rel=1e-6)


def test_random_walk_converges_to_the_dense_q(monkeypatch):
    """Default CVI (adaptive step) on a Poisson random walk: the same fixed point."""
    T = 120
    y = _counts(T, seed=1)
    model = _walk(T)
    gm, lm = _fit(model, y, 25, CVI(), True, monkeypatch)
    gd, ld = _fit(model, y, 25, CVI(), False, monkeypatch)
    assert lm[-1] == pytest.approx(ld[-1], rel=1e-8)
    eps_mean, eps_var, _, _ = _dense_marginals(gd, T)
    q = gm.posterior("eps")
    assert torch.allclose(q.mean, eps_mean, atol=1e-6)
    assert torch.allclose(q.variance, eps_var, atol=1e-6)


@pytest.mark.parametrize("form", ["reversed", "partial"])
def test_look_alikes_stay_dense(form, monkeypatch):
    """A reversed cumsum (each element sees two steps of x) or a cumsum of part of eps is not
    a chain: detection falls back to the dense block, which gives the same loss as with the
    detection off."""
    T = 30
    y = _counts(T)
    model = _walk(T, form)
    g, losses = _fit(model, y, 6, CVI(step_size=1.0), True, monkeypatch)
    assert "Markov" not in g.explain()
    assert "linear-predictor  Poisson log(rate) = A z + c" in g.explain()
    _, ld = _fit(model, y, 6, CVI(step_size=1.0), False, monkeypatch)
    assert losses == pytest.approx(ld, rel=1e-12)


def test_vector_increments_equal_dense_cvi(monkeypatch):
    """Increments ``(T, 2)`` in a time plate, cumsum over the time dim, rate ``exp(h' x_t)``;
    a drift and per-step scales (``Q_t`` varies)."""
    T = 40
    y = _counts(T, seed=2)
    h = torch.tensor([1.0, -0.6], dtype=D64)
    scale = 0.1 + 0.3 * torch.rand(T, 2, generator=torch.Generator().manual_seed(4), dtype=D64)
    drift = torch.tensor([0.02, -0.01], dtype=D64)

    def model(y):
        with pyro.plate("time", T, dim=-1):
            eps = pyro.sample("eps", dist.Normal(drift, scale).to_event(1))
        x = eps.cumsum(-2)
        with pyro.plate("obs", T):
            pyro.sample("y", dist.Poisson(torch.exp(x @ h)), obs=y)

    gm, lm = _fit(model, y, 8, CVI(step_size=1.0), True, monkeypatch)
    assert "(T=40, d=2)" in gm.explain()

    def flat(y):  # the same prior written as one (2T,)-vector: the dense block
        eps = pyro.sample("eps", dist.Normal(drift.expand(T, 2), scale).to_event(2))
        with pyro.plate("obs", T):
            pyro.sample("y", dist.Poisson(torch.exp(eps.cumsum(-2) @ h)), obs=y)

    gd, ld = _fit(flat, y, 8, CVI(step_size=1.0), False, monkeypatch)
    assert lm == pytest.approx(ld, rel=1e-6)
    q, qd = gm.posterior("eps"), gd.joint_posterior("eps")
    assert torch.allclose(q.mean.reshape(-1), qd.loc, atol=1e-6)
    assert torch.allclose(q.variance.reshape(-1), qd.covariance_matrix.diagonal(), atol=1e-6)


def test_learned_scale_and_offset_follow_the_dense_path(monkeypatch):
    """Bernoulli logits ``cumsum(eps) + b`` with the increments' scale and ``b`` as
    ``pyro.param``: the hybrid step (CVI for q, Adam for both) takes the same trajectory."""
    T = 60
    y = (_counts(T) > 2).to(D64)

    def model(y):
        s = pyro.param("s", torch.tensor(0.3, dtype=D64), constraint=dist.constraints.positive)
        with pyro.plate("time", T):
            eps = pyro.sample("eps", dist.Normal(torch.zeros((), dtype=D64), s))
        b = pyro.param("b", torch.tensor(0.0, dtype=D64))
        with pyro.plate("obs", T):
            pyro.sample("y", dist.Bernoulli(logits=eps.cumsum(-1) + b), obs=y)

    def flat(y):
        s = pyro.param("s", torch.tensor(0.3, dtype=D64), constraint=dist.constraints.positive)
        eps = pyro.sample("eps", dist.Normal(torch.zeros(T, dtype=D64), s).to_event(1))
        b = pyro.param("b", torch.tensor(0.0, dtype=D64))
        with pyro.plate("obs", T):
            pyro.sample("y", dist.Bernoulli(logits=eps.cumsum(-1) + b), obs=y)

    out = []
    for m, markov in ((model, True), (flat, False)):
        optim = CVI(step_size=1.0, optim_args={"lr": 0.05})
        g, losses = _fit(m, y, 10, optim, markov, monkeypatch)
        out.append((g, losses, pyro.param("s").item(), pyro.param("b").item()))
    (gm, lm, s_m, b_m), (_, ld, s_d, b_d) = out
    assert KALMAN in gm.explain()
    assert s_m != pytest.approx(0.3, abs=0.1) and b_m != pytest.approx(0.0, abs=0.1)
    assert s_m == pytest.approx(s_d, rel=1e-6) and b_m == pytest.approx(b_d, rel=1e-6)
    assert lm == pytest.approx(ld, rel=1e-6)


@pytest.mark.slow
def test_guide_draws_are_the_image_of_the_chain_posterior(monkeypatch):
    """``guide()``, ``Predictive`` and ``log_prob`` of q(eps): exact log-density against the
    dense block's MVN at the same q, and draws with its mean and covariance."""
    T = 12
    y = _counts(T)
    model = _walk(T, "plate")
    gm, _ = _fit(model, y, 8, CVI(step_size=1.0), True, monkeypatch)
    gd, _ = _fit(_walk(T), y, 8, CVI(step_size=1.0), False, monkeypatch)
    ref = gd.joint_posterior("eps")
    q = gm.engine.block_of("eps").joint()
    e = ref.sample((4,))
    assert torch.allclose(q.log_prob(e), ref.log_prob(e), atol=1e-9)
    tr = pyro.poutine.trace(gm).get_trace(y)
    assert tr.nodes["eps"]["value"].shape == (T,)
    torch.manual_seed(0)
    n = 300
    draws = Predictive(model, guide=gm, num_samples=n)(y)["eps"].reshape(n, T)
    se = ref.covariance_matrix.diagonal().sqrt() / n**0.5
    assert ((draws.mean(0) - ref.loc).abs() < 5 * se).all()
    cov = ref.covariance_matrix
    assert torch.allclose(torch.cov(draws.T), cov, atol=0.3 * float(cov.diagonal().max()))
