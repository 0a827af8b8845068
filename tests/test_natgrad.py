"""Natural-gradient steps of Pyro's Gaussian guides by CVI() (pyro_cvi.natgrad).

* exactness: on Bayesian linear regression, ONE step at step_size=1 of the plain natural form
  with the exact ELBO gradient (a closed-form loss of the guide's q) is the exact posterior;
* agreement of the step with an independent computation of the natural gradient (autograd of
  the closed-form ELBO in the mean parameters) and of the low-rank Fisher with a dense one;
* Trace_ELBO (Monte Carlo) runs reach the closed-form posterior within Monte Carlo error.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import (
    AutoDiagonalNormal,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)
from torch.distributions import constraints

from pyro_cvi import CVI
from pyro_cvi.natgrad import chol_grad_to_cov_grad, lowrank_fisher_mv, lowrank_step

SIGMA, TAU = 0.5, 1.0
DTYPES = [torch.float32, torch.float64]


def _data(dtype, N=40, D=3, orthogonal=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    if orthogonal:  # X^T X diagonal: the mean-field family holds the posterior
        X = torch.linalg.qr(X)[0] * torch.tensor([3.0, 2.0, 1.5][:D], dtype=torch.float64)
    w = torch.randn(D, generator=g, dtype=torch.float64)
    y = X @ w + SIGMA * torch.randn(N, generator=g, dtype=torch.float64)
    return X.to(dtype), y.to(dtype)


def _posterior(X, y):
    X, y = X.double(), y.double()
    P = torch.eye(X.shape[1], dtype=X.dtype) / TAU**2 + X.T @ X / SIGMA**2
    S = torch.linalg.inv(P)
    return S @ X.T @ y / SIGMA**2, S


def blr(X, y=None):
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), TAU).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal((X @ w.unsqueeze(-1)).squeeze(-1), SIGMA), obs=y)


def exact_elbo(X, y, m, S):
    """The ELBO of q = N(m, S) for blr, in closed form."""
    D = m.shape[-1]
    r = y - X @ m
    lik = -0.5 * (r @ r + (X @ S * X).sum()) / SIGMA**2 - len(y) * math.log(
        SIGMA * math.sqrt(2 * math.pi)
    )
    prior = -0.5 * (m @ m + S.diagonal().sum()) / TAU**2 - D * math.log(
        TAU * math.sqrt(2 * math.pi)
    )
    ent = 0.5 * torch.logdet(S) + 0.5 * D * (1 + math.log(2 * math.pi))
    return lik + prior + ent


def _q_of(guide):
    """(m, S) of the guide's q with the graph to its params (through pyro.param)."""
    if isinstance(guide, AutoNormal):
        m = guide.locs.w
        s = guide.scales.w
        return m, torch.diag_embed(s * s)
    if isinstance(guide, AutoDiagonalNormal):
        s = guide.scale
        return guide.loc, torch.diag_embed(s * s)
    if callable(getattr(guide, "get_posterior", None)):
        q = guide.get_posterior()
        return q.loc, q.covariance_matrix
    m = pyro.param("w_loc")
    if "w_scale_tril" in pyro.get_param_store():
        L = pyro.param("w_scale_tril")
        return m, L @ L.T
    s = pyro.param("w_scale")
    return m, torch.diag_embed(s * s)


def exact_loss(model, guide, X, y):
    """A Pyro loss callable: the exact -ELBO (so its gradients are exact)."""
    guide(X, y)  # set-up and param capture
    m, S = _q_of(guide)
    return -exact_elbo(X, y, m, S)


def handwritten_mvn(X, y=None):
    D = X.shape[1]
    loc = pyro.param("w_loc", X.new_zeros(D))
    tril = pyro.param(
        "w_scale_tril", 0.3 * torch.eye(D, dtype=X.dtype), constraint=constraints.lower_cholesky
    )
    pyro.sample("w", dist.MultivariateNormal(loc, scale_tril=tril))


def handwritten_normal(X, y=None):
    D = X.shape[1]
    loc = pyro.param("w_loc", X.new_zeros(D))
    scale = pyro.param("w_scale", X.new_full((D,), 0.3), constraint=constraints.positive)
    pyro.sample("w", dist.Normal(loc, scale).to_event(1))


FULL = {
    "AutoMultivariateNormal": lambda: AutoMultivariateNormal(blr),
    "handwritten_mvn": lambda: handwritten_mvn,
}
DIAG = {
    "AutoNormal": lambda: AutoNormal(blr),
    "AutoDiagonalNormal": lambda: AutoDiagonalNormal(blr),
    "handwritten_normal": lambda: handwritten_normal,
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(FULL) + sorted(DIAG))
def test_one_step_is_exact(name, dtype):
    """One plain natural step at step_size=1 with the exact gradient is the exact posterior
    (the mean-field posterior for diagonal guides, on a design with X^T X diagonal)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    diag = name in DIAG
    X, y = _data(dtype, orthogonal=diag)
    guide = (DIAG if diag else FULL)[name]()
    svi = SVI(blr, guide, CVI(step_size=1.0, gaussian_step="natural"), loss=exact_loss)
    svi.step(X, y)
    m, S = (t.detach().double().clone() for t in _q_of(guide))
    m_post, S_post = _posterior(X, y)
    tol = 1e-4 if dtype == torch.float32 else 1e-9
    assert torch.allclose(m, m_post, atol=tol, rtol=tol)
    assert torch.allclose(S, S_post, atol=tol * S_post.abs().max(), rtol=tol)
    # and it stays there: the optimum is a fixed point of the step
    svi.step(X, y)
    m2 = _q_of(guide)[0].detach().double()
    assert torch.allclose(m2, m_post, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_step_agrees_with_independent_natural_gradient(dtype):
    """The step from AutoMultivariateNormal's own gradients (loc, scale, unit scale_tril, by
    the chain rule) equals the natural-gradient step computed independently: autograd of the
    closed-form ELBO in (m, S), ``P' = P - 2 b dL/dS``, ``m' = m + b S' dL/dm``."""
    pyro.clear_param_store()
    X, y = _data(dtype)
    guide = AutoMultivariateNormal(blr, init_scale=0.2)
    guide(X, y)
    with torch.no_grad():  # move off the initial point so every term is non-trivial
        guide.loc.unconstrained().add_(0.3)
    m0, S0 = (t.detach().double().clone() for t in _q_of(guide))
    beta = 0.3
    SVI(blr, guide, CVI(step_size=beta, gaussian_step="natural"), loss=exact_loss).step(X, y)
    m1, S1 = (t.detach().double().clone() for t in _q_of(guide))
    m = m0.clone().requires_grad_(True)
    S = S0.clone().requires_grad_(True)
    elbo = exact_elbo(X.double(), y.double(), m, 0.5 * (S + S.T))
    gm, gS = torch.autograd.grad(elbo, (m, S))
    P_new = torch.linalg.inv(S0) - 2 * beta * gS
    S_new = torch.linalg.inv(P_new)
    m_new = m0 + beta * S_new @ gm
    tol = 2e-4 if dtype == torch.float32 else 1e-9
    assert torch.allclose(S1, S_new, rtol=tol, atol=tol * S_new.abs().max())
    assert torch.allclose(m1, m_new, rtol=tol, atol=tol)


def test_cholesky_chain_rule_against_autograd():
    g = torch.Generator().manual_seed(1)
    A = torch.randn(4, 4, generator=g, dtype=torch.float64)
    S = A @ A.T + 4 * torch.eye(4, dtype=torch.float64)
    B = torch.randn(4, 4, generator=g, dtype=torch.float64)
    B = B + B.T
    L = torch.linalg.cholesky(S).requires_grad_(True)
    f = (B * (L @ L.T)).sum() + torch.logdet(L @ L.T)
    (gL,) = torch.autograd.grad(f, L)
    expected = B + torch.linalg.inv(S)
    assert torch.allclose(chol_grad_to_cov_grad(L.detach(), gL), expected, atol=1e-10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lowrank_fisher_against_dense_jacobian(dtype):
    """The matrix-free Fisher-vector product of the low-rank family against the dense
    ``1/2 J^T (S^-1 (x) S^-1) J`` by autograd."""
    D, r = 6, 2
    g = torch.Generator().manual_seed(2)
    W = torch.randn(D, r, generator=g, dtype=torch.float64)
    rho = 0.3 * torch.randn(D, generator=g, dtype=torch.float64)

    def cov(th):
        s = th[:D].exp()
        Wt = th[D:].reshape(D, r)
        return s[:, None] * (torch.eye(D, dtype=th.dtype) + Wt @ Wt.T) * s[None, :]

    th = torch.cat([rho, W.reshape(-1)])
    J = torch.autograd.functional.jacobian(cov, th).reshape(D * D, -1)
    Si = torch.linalg.inv(cov(th))
    F = 0.5 * J.T @ torch.kron(Si, Si) @ J
    v = torch.randn(D + D * r, generator=g, dtype=torch.float64)
    f_rho, f_W = lowrank_fisher_mv(W.to(dtype), v[:D].to(dtype), v[D:].reshape(D, r).to(dtype))
    got = torch.cat([f_rho, f_W.reshape(-1)]).double()
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert torch.allclose(got, F @ v, atol=tol * float((F @ v).abs().max()))


@pytest.mark.parametrize("dense", [True, False], ids=["dense-solve", "conjugate-gradients"])
def test_lowrank_step_is_fisher_natural_gradient(dense, monkeypatch):
    """A small low-rank step moves the covariance parameters by ``-b F^-1 g`` (an independent
    dense solve), by the step's exact solve and by its conjugate gradients alike."""
    import pyro_cvi.gaussian.lowrank as steps

    if not dense:
        monkeypatch.setattr(steps, "_DENSE_FISHER", 0)
    D, r = 5, 2
    g = torch.Generator().manual_seed(3)
    m = torch.randn(D, generator=g, dtype=torch.float64)
    s = 0.5 + torch.rand(D, generator=g, dtype=torch.float64)
    W = torch.randn(D, r, generator=g, dtype=torch.float64)
    gm, gs = (
        torch.randn(D, generator=g, dtype=torch.float64),
        torch.randn(D, generator=g, dtype=torch.float64),
    )
    gW = torch.randn(D, r, generator=g, dtype=torch.float64)

    _, s1, W1, _ = lowrank_step(m, s, W, gm, gs, gW, 1e-3, damping=1e-2, cg_iters=200)
    n = D + D * r
    F = torch.stack(
        [
            torch.cat([t.reshape(-1) for t in lowrank_fisher_mv(W, e[:D], e[D:].reshape(D, r))])
            for e in torch.eye(n, dtype=torch.float64)
        ]
    )
    x = torch.linalg.solve(
        F + 1e-2 * torch.eye(n, dtype=torch.float64), torch.cat([gs * s, gW.reshape(-1)])
    )
    assert torch.allclose(torch.log(s1 / s), -1e-3 * x[:D], atol=1e-9)
    assert torch.allclose(W1 - W, -1e-3 * x[D:].reshape(D, r), atol=1e-9)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "make",
    [AutoNormal, AutoMultivariateNormal, AutoLowRankMultivariateNormal],
    ids=lambda c: c.__name__,
)
def test_trace_elbo_reaches_posterior_within_mc_error(make, dtype):
    """CVI() (adaptive step) with a one-particle Trace_ELBO: the mean of q ends within a few
    posterior standard deviations of the exact posterior mean (the optimum of every family:
    Gaussian posterior means are exact for mean-field and low rank too)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    X, y = _data(dtype)
    guide = make(blr)
    svi = SVI(blr, guide, CVI(), loss=Trace_ELBO())
    for _ in range(300):
        svi.step(X, y)
    m_post, S_post = _posterior(X, y)
    m = _q_of(guide)[0].detach().double()
    z = (m - m_post) / S_post.diagonal().sqrt()
    assert float(z.abs().max()) < 1.0, z


def test_adaptive_state_survives_get_state_set_state():
    """The adaptive step of the Gaussians is part of CVI's state (exact resume)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    X, y = _data(torch.float64)
    guide = AutoNormal(blr)
    cvi = CVI()
    svi = SVI(blr, guide, cvi, loss=Trace_ELBO())
    for _ in range(7):
        svi.step(X, y)
    fresh = CVI()
    fresh.set_state(cvi.get_state())
    SVI(blr, guide, fresh, loss=Trace_ELBO()).step(X, y)  # loads the saved controls
    resumed = fresh.gaussians.controls["AutoNormal.locs.w"]
    assert resumed.t == cvi.gaussians.controls["AutoNormal.locs.w"].t + 1


def test_declared_gaussian_for_unconventional_names():
    """A hand-written guide whose names follow no convention: found at its sample site (the
    guide's trace), or declared with CVI(gaussians=...); either way the exact posterior in one
    step."""

    def guide(X, y=None):
        a = pyro.param("alpha", X.new_zeros(X.shape[1]))
        b = pyro.param("beta", X.new_full((X.shape[1],), 0.3), constraint=constraints.positive)
        pyro.sample("w", dist.Normal(a, b).to_event(1))

    X, y = _data(torch.float64, orthogonal=True)
    m_post, S_post = _posterior(X, y)
    for declared in (None, {"w": ("alpha", "beta")}):
        pyro.clear_param_store()
        cvi = CVI(step_size=1.0, gaussian_step="natural", gaussians=declared)
        SVI(blr, guide, cvi, loss=exact_loss_named).step(X, y)
        assert torch.allclose(pyro.param("alpha").detach(), m_post, atol=1e-9)
        assert torch.allclose(pyro.param("beta").detach() ** 2, S_post.diagonal(), rtol=1e-9)
        where = {r["param"]: r["where"] for r in cvi.explain(print_table=False)}
        assert where["alpha"] == ("by name" if declared else "site 'w'")


def exact_loss_named(model, guide, X, y):
    guide(X, y)
    s = pyro.param("beta")
    return -exact_elbo(X, y, pyro.param("alpha"), torch.diag_embed(s * s))


def test_step_size_control_is_finite_after_any_number_of_steps():
    """The warm-up ``start * grow ** t`` saturates at the ceiling: no overflow at any ``t``
    (``1.5 ** 1751`` is past float range: every step from 1,751 on used to raise)."""
    from pyro_cvi.natgrad.control import NoiseControl

    control = NoiseControl()
    d = (torch.ones(3), torch.ones(3))
    for _ in range(10):
        control.observe(d)
    early = control.step_sizes()
    control.t = 10**7
    assert control.step_sizes() == early == (control.ceiling, control.ceiling)


def test_the_decayed_ceiling_recovers_once_a_direction_persists():
    """Noise alone decays the ceiling to its floor and keeps it there (2,000 more steps); a
    direction that persists (``q`` is off its optimum again) brings it back to 1 within 20
    steps, where the step sizes were 0.015 (the floor times ``min_ratio``)."""
    from pyro_cvi.natgrad.control import NoiseControl

    g = torch.Generator().manual_seed(0)
    for dim in (1, 3):
        control = NoiseControl()
        for _ in range(400):
            control.observe((torch.randn(dim, generator=g), torch.randn(dim, generator=g)))
        assert control.decayed == control.min_ceiling
        low = control.step_sizes()
        assert max(low) == pytest.approx(control.min_ceiling * control.min_ratio)
        highest = 0.0
        for _ in range(2000):
            control.observe((torch.randn(dim, generator=g), torch.randn(dim, generator=g)))
            highest = max(highest, control.decayed)
        assert highest <= 2 * control.min_ceiling
        for _ in range(20):
            signal = 2.0 * torch.ones(dim)
            control.observe((signal + torch.randn(dim, generator=g), signal))
        assert control.decayed == 1.0
        assert min(control.step_sizes()) > 0.5


@pytest.mark.slow
def test_cvi_follows_the_posterior_when_the_data_move():
    """A Normal guide fitted for 400 steps (the ceiling decayed at the optimum), then the data
    shifted by 4 (18 posterior deviations): ``CVI()`` is within Pyro's tolerance of the new
    posterior, and stays there, within 60 steps (measured 16-33 over seeds 0-2 and both dtypes;
    63-85 without the recovery)."""
    from conjugate_guide_cases import BY_NAME, within

    pair = BY_NAME["normal-normal-positive"]
    for dtype in DTYPES:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        data = pair.data(dtype)
        svi = SVI(pair.model, pair.guide, CVI(), Trace_ELBO())
        for _ in range(400):
            svi.step(*data)
        moved = (data[0] + 4.0,)
        assert not within(pair, moved)
        first = None
        for t in range(1, 111):
            svi.step(*moved)
            first = (first or t) if within(pair, moved) else None
        assert first is not None and first <= 60, (dtype, first)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_autonormal_with_cvi_runs_past_the_old_overflow(dtype):
    """2,500 steps of the drop-in path (past step 1,751, where ``grow ** t`` overflowed)."""
    X, y = _data(dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(blr)
    svi = SVI(blr, guide, CVI(), Trace_ELBO())
    losses = [svi.step(X, y) for _ in range(2500)]
    assert all(math.isfinite(v) for v in losses)
    m, S = _posterior(X, y)
    assert torch.allclose(guide.locs.w.detach().double(), m, atol=0.1)
