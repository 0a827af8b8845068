"""The one-draw natural-gradient step of the remainder (``Remainder(step=Horizon())``,
``pyro_cvi.natgrad.horizon``, ``pyro_cvi.gaussian.onedraw``):

* exactness: a model whose posterior is Gaussian in the latent (a Normal prior, read as a
  known prior and added exactly, and a log-normal likelihood linear in the latent): the full
  and the diagonal forms reach the closed-form posterior, in float32 and float64;
* the maths: the one-draw directions are unbiased (their average over many draws is the
  exact natural gradient of a quadratic log joint), and exact at the optimum;
* the loss is the bound: the reported loss agrees with an independent Trace_ELBO estimate of
  the same guide within 3 standard errors on a non-conjugate model, in both dtypes;
* the rule: a cheap small model keeps Price's Hessians, the Horizon step takes a diagonal or
  full form by ``D <= 2 / rho``; a remainder whose latent scales another's prior keeps
  SignalToNoise;
* the schedule, its validation, and a checkpoint round trip of its state.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, Horizon, Remainder, SignalToNoise
from pyro_cvi.gaussian.onedraw import onedraw_diag, onedraw_tril
from pyro_cvi.natgrad.horizon import HorizonControl

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def lognormal_regression(X, y):
    """``log y ~ N(X z + log s, 0.5^2)``, ``z ~ N(0, 4 I)``, ``log s ~ N(0, 1)``: a Gaussian
    posterior over ``(z, log s)`` (the LogNormal latent puts both in the remainder)."""
    z = pyro.sample("z", dist.Normal(X.new_zeros(X.shape[1]), 2.0).to_event(1))
    s = pyro.sample("s", dist.LogNormal(X.new_tensor(0.0), 1.0))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.LogNormal(X @ z + s.log(), 0.5), obs=y)


def _data(dtype):
    g = _gen(0)
    X = torch.randn(30, 2, generator=g, dtype=torch.float64)
    z = torch.tensor([0.8, -0.5], dtype=torch.float64)
    y = torch.exp(X @ z + 0.5 * torch.randn(30, generator=g, dtype=torch.float64))
    return X.to(dtype), y.to(dtype)


def _posterior(X, y):
    """Over ``(z_1, z_2, log s)``."""
    X, ly = X.double(), y.double().log()
    A = torch.cat([X, torch.ones(X.shape[0], 1, dtype=torch.float64)], 1)
    P = torch.diag(torch.tensor([0.25, 0.25, 1.0], dtype=torch.float64)) + A.T @ A / 0.25
    S = torch.linalg.inv(P)
    return S @ (A.T @ ly / 0.25), S


def _fit(model, args, steps, seed=0, **kw):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoCVI(model, **kw)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    losses = [svi.step(*args) for _ in range(steps)]
    return guide, svi, losses


@DTYPES
@pytest.mark.parametrize("form", ["full", "diag"])
def test_horizon_step_reaches_the_exact_gaussian_posterior(dtype, form):
    X, y = _data(dtype)
    # the step decays over the 400 steps run (the horizon), as a user who plans them would
    rule = Remainder(covariance=form, step=Horizon(horizon=400))
    guide, _, losses = _fit(lognormal_regression, (X, y), 400, remainder=rule)
    rem = guide.engine.kinds["remainder"][0]
    assert rem is not None and set(rem.names) == {"z", "s"} and isinstance(rem.rule, Horizon)
    # the Normal(0, 2) prior is known: precision 1/4 on z's coordinates, added exactly
    order = [n for n in rem.names for _ in range(2 if n == "z" else 1)]
    expect = torch.tensor([0.25 if n == "z" else 0.0 for n in order], dtype=torch.float64)
    assert torch.allclose(rem.prior_prec.double(), expect)
    perm = [0, 1, 2] if rem.names[0] == "z" else [1, 2, 0]
    mean, S = _posterior(X, y)
    mean, S = mean[perm], S[perm][:, perm]
    q = rem.joint_unconstrained()
    sd = S.diagonal().sqrt()
    assert torch.all((q.mean.double() - mean).abs() < 0.05 * sd), (q.mean, mean)
    C = q.covariance_matrix.double()
    if form == "full":
        assert torch.allclose(C, S, rtol=0.1, atol=0.1 * float(S.diagonal().min()))
    else:  # the diagonal form's optimum: the conditional variances 1 / P_ii
        cond = 1.0 / torch.linalg.inv(S).diagonal()
        assert torch.allclose(C.diagonal(), cond, rtol=0.1)
    assert all(math.isfinite(v) for v in losses)


@pytest.mark.parametrize("dtype", [torch.float64])
def test_onedraw_directions_are_unbiased_and_exact_at_the_optimum(dtype):
    """For ``f(u) = -(u - c)^T H (u - c) / 2`` with a known prior ``p0``: the average of the
    one-draw ``G`` over many draws is ``P0 + H - P`` (Stein), the mean gradient is
    ``-H (c - m)``'s negative; with ``P = P0 + H`` every single draw gives ``G = 0``."""
    g = _gen(1)
    D = 3
    A = torch.randn(D, D, generator=g, dtype=dtype)
    H = A @ A.T + torch.eye(D, dtype=dtype)
    c = torch.randn(D, generator=g, dtype=dtype)
    p0 = torch.tensor([0.5, 0.0, 2.0], dtype=dtype)
    m = torch.randn(D, generator=g, dtype=dtype)
    P = torch.eye(D, dtype=dtype) * 3.0
    L = torch.linalg.cholesky(torch.linalg.inv(P))
    K = 200_000
    eps = torch.randn(K, D, generator=g, dtype=dtype)
    u = m + eps @ L.T
    grad = -(u - c) @ H
    gm, G = onedraw_tril(L, eps, grad, p0)
    target = torch.diag(p0) + H - P
    assert torch.allclose(G, target, atol=0.05 * float(target.abs().max()))
    assert torch.allclose(gm, -(c - m) @ H, atol=0.05 * float(((c - m) @ H).abs().max()))
    # at the optimum (P = P0 + H) one draw is exact
    P_opt = torch.diag(p0) + H
    L_opt = torch.linalg.cholesky(torch.linalg.inv(P_opt))
    e1 = eps[:1]
    u1 = c + e1 @ L_opt.T
    gm1, G1 = onedraw_tril(L_opt, e1, -(u1 - c) @ H, p0)
    assert G1.abs().max() < 1e-8 and gm1.abs().max() < 1e-8
    # the diagonal form on a diagonal H
    h = torch.tensor([1.0, 2.0, 4.0], dtype=dtype)
    s = (p0 + h).rsqrt()
    u1 = c + s * e1
    gm1, G1 = onedraw_diag(s, e1, -(u1 - c) * h, p0)
    assert G1.abs().max() < 1e-8 and gm1.abs().max() < 1e-8


def tanh_regression(X, y):
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    s = pyro.sample("s", dist.LogNormal(X.new_tensor(-0.5), 0.5))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(2.0 * torch.tanh(X @ w), s), obs=y)


@DTYPES
def test_reported_loss_is_the_bound(dtype):
    g = _gen(2)
    X = torch.randn(40, 3, generator=g, dtype=torch.float64)
    y = 2.0 * torch.tanh(X @ torch.tensor([1.0, -0.5, 0.3], dtype=torch.float64))
    y = y + 0.5 * torch.randn(40, generator=g, dtype=torch.float64)
    args = (X.to(dtype), y.to(dtype))
    guide, svi, _ = _fit(tanh_regression, args, 300, remainder=Remainder(step=Horizon()))
    assert isinstance(guide.engine.kinds["remainder"][0].rule, Horizon)
    reported = torch.tensor([svi.evaluate_loss(*args) for _ in range(300)], dtype=torch.float64)
    with torch.no_grad():
        ref = torch.tensor(
            [Trace_ELBO().loss(tanh_regression, guide, *args) for _ in range(300)],
            dtype=torch.float64,
        )
    se = math.hypot(float(reported.std()), float(ref.std())) / math.sqrt(300)
    assert abs(float(reported.mean() - ref.mean())) < 3 * se + 1e-3, (reported.mean(), ref.mean())


def test_the_rule_picks_the_step_and_the_form(monkeypatch):
    import pyro_cvi.blocks.remainder as rem_module

    X, y = _data(torch.float64)
    # a small full form: the default keeps Price's dense Hessians (and, with the rule's verdict
    # replaced, the one-draw step)
    guide, _, _ = _fit(lognormal_regression, (X, y), 2)
    rem = guide.engine.kinds["remainder"][0]
    assert isinstance(rem.rule, SignalToNoise) and rem.form == "full" and rem.hessian
    assert not bool(rem.prior_prec.any())
    monkeypatch.setattr(rem_module, "price_by_default", lambda *a: False)
    guide, _, _ = _fit(lognormal_regression, (X, y), 2)
    rem = guide.engine.kinds["remainder"][0]
    assert isinstance(rem.rule, Horizon) and rem.form == "full" and not rem.hessian
    # asked for: the rule is not consulted; 3 coordinates <= 2 / rho: full
    monkeypatch.setattr(rem_module, "price_by_default", lambda *a: True)
    guide, _, _ = _fit(lognormal_regression, (X, y), 2, remainder=Remainder(step=Horizon()))
    rem = guide.engine.kinds["remainder"][0]
    assert isinstance(rem.rule, Horizon) and rem.form == "full" and not rem.hessian
    assert Remainder().form(41, Horizon()) == "diag" and Remainder().form(40, Horizon()) == "full"
    assert Remainder().form(300, SignalToNoise()) == "lowrank"

    def funnel(y):
        scale = pyro.sample("scale", dist.HalfNormal(y.new_tensor(1.0)))
        with pyro.plate("n", len(y)):
            z = pyro.sample("z", dist.Normal(y.new_tensor(0.0), scale))
            pyro.sample("y", dist.Poisson(z.exp()), obs=y)

    y = torch.tensor([0.0, 2.0, 5.0, 1.0], dtype=torch.float64)
    guide, _, _ = _fit(funnel, (y,), 1)
    assert isinstance(guide.engine.kinds["remainder"][0].rule, SignalToNoise)
    guide, _, _ = _fit(funnel, (y,), 1, remainder=Remainder(step=Horizon(lr=0.05)))
    assert guide.engine.kinds["remainder"][0].rule == Horizon(lr=0.05)


def test_schedule_and_validation():
    c = HorizonControl(Horizon(lr=0.2, rho=0.1, horizon=100, final=0.1, warmup=10))
    rho, lr = c.step_sizes()
    assert rho == pytest.approx(0.1) and lr == pytest.approx(0.2 * 0.1)  # warm-up: 1/10
    c.t = 50  # half-way: (1 + cos(pi / 2)) / 2 = 0.5 of the way down
    assert c.step_sizes()[0] == pytest.approx(0.1 * (0.1 + 0.9 * 0.5))
    for t in (100, 20_000):
        c.t = t
        assert c.step_sizes() == pytest.approx((0.01, 0.02))
    c.ceiling = 0.005
    assert c.step_sizes() == (0.005, 0.005)
    for bad in (dict(lr=0.0), dict(rho=2.0), dict(momentum=1.0), dict(horizon=0)):
        with pytest.raises(ValueError, match="Horizon"):
            Horizon(**bad)
    with pytest.raises(TypeError, match="Remainder\\(step="):
        Remainder(step="ivon")


def test_default_schedule_ends_where_the_earlier_one_did():
    """The default mean step starts at 0.2 of a Newton step and ends at 0.01 (the earlier
    default's 0.1 x 0.1), the precision's rate 0.05 -> 0.0025; the plateau test's halvings
    stop at the same floor."""
    c = HorizonControl(Horizon())
    assert c.step_sizes() == pytest.approx((0.05, 0.2))
    c.t = 2000
    assert c.step_sizes() == pytest.approx((0.0025, 0.01))
    c.t, c.factor = 10, 1e-6
    c.losses = [0.0] * 100
    c._plateau()
    assert c.factor == pytest.approx(0.05) and c.step_sizes()[1] == pytest.approx(0.01)


def test_momentum_restarts_against_a_reversed_gradient():
    c = HorizonControl(Horizon(momentum=0.9))
    g = torch.tensor([1.0, 0.0])
    first = c.direction(g)
    c.observe()
    assert torch.allclose(first, g)  # bias-corrected: the first direction is the gradient
    same = c.direction(g, lambda x: x)
    c.observe()
    assert torch.allclose(same, g)
    back = c.direction(-g, lambda x: x)  # cos = -1: the average restarts from -g
    assert torch.allclose(back, -g)


def test_horizon_state_survives_a_checkpoint():
    """The step's clock and momentum go into the guide's extra state and come back."""
    X, y = _data(torch.float64)
    guide, svi, _ = _fit(lognormal_regression, (X, y), 30, remainder=Remainder(step=Horizon()))
    rem = guide.engine.kinds["remainder"][0]
    state = rem.extra_state()
    t, gbar = rem.control.t, rem.control.gbar.clone()
    svi.step(X, y)
    assert rem.control.t == t + 1
    rem.load_extra_state(state)
    assert rem.control.t == t and torch.equal(rem.control.gbar, gbar)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_diagonal_precision_follows_an_increase_at_once(dtype):
    """The diagonal step's caps, from the retraction ``h + b G + (b G)^2 / (2 h)`` in closed
    form: a large positive ``G`` moves ``h`` by ``b G = MAX_REL_UP h`` (to ``2.5 h``), a large
    negative one by ``b G = -MAX_REL h`` (to ``0.82 h``), a small one by ``b = rho``."""
    from pyro_cvi.gaussian.onedraw import MAX_REL, MAX_REL_UP, onedraw_diag_step

    p0 = torch.tensor([1.0, 1.0, 1.0], dtype=dtype)
    h = torch.tensor([4.0, 4.0, 4.0], dtype=dtype)
    s = (p0 + h).rsqrt()
    G = torch.tensor([1e4, -1e4, 2.0], dtype=dtype)
    rho = 0.05
    _, s2, _ = onedraw_diag_step(torch.zeros_like(s), s, torch.zeros_like(s), G, p0, rho, 0.1)
    bg = torch.tensor([MAX_REL_UP * 4.0, -MAX_REL * 4.0, rho * 2.0], dtype=torch.float64)
    want = 1.0 + 4.0 + bg + bg**2 / 8.0
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert torch.allclose(s2.double().pow(-2), want, rtol=tol)
    assert float(want[0]) == pytest.approx(1.0 + 2.5 * 4.0)
