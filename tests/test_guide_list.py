"""An ``AutoGuideList`` holding an ``AutoCVI`` part (Pyro's recipe: each part built on a blocked
model) trains under ``CVI_ELBO``.

The model: ``s ~ LogNormal(0, 1)``, ``w ~ N(0, I)``, ``y ~ N(X w, s^2 I)``; the guide: AutoCVI on
``w``, AutoDelta on ``s``. For a point mass at ``s`` and the exact ``q(w) = p(w | y, s)`` the
bound is ``log p(y | s) + log p(s)`` with ``p(y | s) = N(y; 0, s^2 I + X X^T)``: the fitted ``s``
must be its maximiser (a grid search) and the reported loss that closed form, and
``Trace_ELBO`` over the same guide list must agree with it.
"""

import math
import warnings

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoGuideList, AutoNormal

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.methods.bound_check import check_bound

DTYPES = [torch.float64, torch.float32]


def model(X, y):
    s = pyro.sample("s", dist.LogNormal(X.new_tensor(0.0), 1.0))
    w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("data", len(X)):
        pyro.sample("y", dist.Normal(X @ w, s), obs=y)


def data(dtype):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(30, 2, generator=g, dtype=torch.float64)
    y = X @ torch.tensor([1.0, -2.0], dtype=torch.float64) + 0.5 * torch.randn(
        30, generator=g, dtype=torch.float64
    )
    return X.to(dtype), y.to(dtype)


def log_joint_s(X, y, s):
    """``log p(y | s) + log p(s)`` (float64)."""
    X, y = X.double(), y.double()
    cov = s**2 * torch.eye(len(y), dtype=torch.float64) + X @ X.T
    lp = dist.MultivariateNormal(torch.zeros(len(y), dtype=torch.float64), cov).log_prob(y)
    return float(lp + dist.LogNormal(0.0, 1.0).log_prob(torch.tensor(s, dtype=torch.float64)))


def best_s(X, y):
    """The grid maximiser of ``log p(y | s) + log p(s)`` (the eigenvalues ``e`` of ``X X^T``
    give ``log det`` and the quadratic form of ``s^2 I + X X^T`` at every ``s`` at once)."""
    X, y = X.double(), y.double()
    e, U = torch.linalg.eigh(X @ X.T)
    r2 = (U.T @ y) ** 2
    grid = torch.linspace(0.2, 1.5, 2601, dtype=torch.float64)
    var = grid[:, None] ** 2 + e
    lp = -0.5 * (var.log().sum(-1) + (r2 / var).sum(-1) + len(y) * math.log(2 * math.pi))
    values = lp + dist.LogNormal(0.0, 1.0).log_prob(grid)
    i = int(values.argmax())
    assert values[i] == pytest.approx(log_joint_s(X, y, float(grid[i])), abs=1e-8)
    return float(grid[i]), float(values[i])


def guide_list(parts="delta"):
    guide = AutoGuideList(model)
    guide.append(AutoCVI(poutine.block(model, hide=["s"])))
    other = AutoDelta if parts == "delta" else AutoNormal
    guide.append(other(poutine.block(model, expose=["s"])))
    return guide


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_cvi_part_with_a_delta_part_reaches_the_exact_optimum(dtype):
    X, y = data(dtype)
    guide = guide_list()
    svi = SVI(model, guide, CVI(optim_args={"lr": 0.05}), CVI_ELBO())
    for _ in range(400):
        loss = svi.step(X, y)
    s_star, best = best_s(X, y)
    s = float(guide.median(X, y)["s"])
    assert s == pytest.approx(s_star, abs=2e-3)
    # the reported loss is the closed-form bound at the fitted s (q(w) exact given s)
    tol = 1e-8 if dtype == torch.float64 else 2e-3
    now = CVI_ELBO().loss(model, guide, X, y)
    assert now == pytest.approx(-log_joint_s(X, y, s), abs=tol * max(1, abs(now)))
    assert loss == pytest.approx(now, abs=1e-3)  # (the last step: s moved by < 1e-3)
    # q(w) is the exact posterior given s
    Xd, yd = X.double(), y.double()
    prec = torch.eye(2, dtype=torch.float64) + Xd.T @ Xd / s**2
    mean = torch.linalg.solve(prec, Xd.T @ yd / s**2)
    q = guide[0].posterior("w")
    assert torch.allclose(q.mean.double(), mean, atol=1e-9 if dtype == torch.float64 else 1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", ["delta", "normal"])
def test_reported_loss_is_trace_elbo_of_the_same_guide_list(dtype, parts):
    X, y = data(dtype)
    guide = guide_list(parts)
    svi = SVI(model, guide, CVI(optim_args={"lr": 0.05}), CVI_ELBO())
    for _ in range(30):
        svi.step(X, y)

    def reported():
        return CVI_ELBO().loss(model, guide, X, y)

    result = check_bound(model, guide, reported, (X, y), num_particles=400, warn=False)
    assert result.agrees, result
    if parts == "delta":
        assert result.reported_se == 0.0  # a point mass and an exact q(w): no noise


@pytest.mark.parametrize("dtype", DTYPES)
def test_guide_list_draws_and_predicts(dtype):
    X, y = data(dtype)
    guide = guide_list()
    svi = SVI(model, guide, CVI(optim_args={"lr": 0.05}), CVI_ELBO())
    for _ in range(20):
        svi.step(X, y)
    tr = poutine.trace(guide).get_trace(X, y)
    assert set(tr.stochastic_nodes) == {"s", "w"}
    assert tr.nodes["w"]["value"].dtype == dtype
    pred = Predictive(model, guide=guide, num_samples=7, return_sites=["y"])(X, None)
    assert pred["y"].shape == (7, 30)


def test_guide_list_called_before_training_then_trained():
    """Pyro's habit: ``guide(*args)`` once before the first step."""
    X, y = data(torch.float64)
    guide = guide_list()
    guide(X, y)
    svi = SVI(model, guide, CVI(optim_args={"lr": 0.05}), CVI_ELBO())
    for _ in range(5):
        assert torch.isfinite(torch.tensor(svi.step(X, y)))


def test_two_cvi_parts_are_refused_by_name():
    guide = AutoGuideList(model)
    guide.append(AutoCVI(poutine.block(model, expose=["w"])))
    guide.append(AutoCVI(poutine.block(model, expose=["s"]), prefix="AutoCVI_s"))
    X, y = data(torch.float64)
    with pytest.raises(TypeError, match="2 AutoCVI parts"):
        SVI(model, guide, CVI(), CVI_ELBO()).step(X, y)


def test_trace_elbo_gives_the_same_bound_estimate():
    """Not a training path: Pyro's Trace_ELBO evaluates the trained guide list."""
    X, y = data(torch.float64)
    guide = guide_list()
    svi = SVI(model, guide, CVI(optim_args={"lr": 0.05}), CVI_ELBO())
    for _ in range(20):
        svi.step(X, y)
    reported = CVI_ELBO().loss(model, guide, X, y)
    estimates = torch.tensor(
        [Trace_ELBO(num_particles=100).loss(model, guide, X, y) for _ in range(10)],
        dtype=torch.float64,
    )
    se = float(estimates.std() / 10**0.5)
    assert abs(float(estimates.mean()) - reported) <= 3 * se + 1e-9


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_delta_part_gets_the_gradient_of_the_bound(dtype):
    """``d(-ELBO)/d log s`` from CVI_ELBO against central differences of the closed form."""
    X, y = data(dtype)
    guide = guide_list()
    svi = SVI(model, guide, CVI(optim_args={"lr": 0.05}), CVI_ELBO())
    for _ in range(3):
        svi.step(X, y)
    loss = CVI_ELBO().differentiable_loss(model, guide, X, y)
    (raw,) = [v for k, v in pyro.get_param_store().named_parameters() if k.endswith(".s")]
    (grad,) = torch.autograd.grad(loss, raw)
    s, h = float(guide.median(X, y)["s"]), 1e-5
    fd = (log_joint_s(X, y, s * math.exp(-h)) - log_joint_s(X, y, s * math.exp(h))) / (2 * h)
    assert float(grad) == pytest.approx(fd, rel=1e-2)


def exact_q_w(X, y, s):
    """``p(w | y, s)``: its mean and covariance (float64)."""
    Xd, yd = X.double(), y.double()
    prec = torch.eye(2, dtype=torch.float64) + Xd.T @ Xd / s**2
    return torch.linalg.solve(prec, Xd.T @ yd / s**2), torch.linalg.inv(prec)


def trace_elbo_optim(kind, lr):
    if kind == "cvi":
        return CVI(optim_args={"lr": lr})
    return pyro.optim.Adam({"lr": lr})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("optim", ["cvi", "adam"])
def test_trace_elbo_trains_the_guide_list(dtype, optim):
    """Under Trace_ELBO the CVI part takes CVI's step inside each ``svi.step`` (at one draw of
    the other parts) and the delta part follows Trace_ELBO's gradient: ``s`` reaches the
    maximiser of ``log p(y | s) + log p(s)``, ``q(w)`` is the exact ``p(w | y, s)``, and the
    reported losses are Trace_ELBO's estimates of the joint guide's bound (its closed form)."""
    pyro.set_rng_seed(1)
    X, y = data(dtype)
    guide = guide_list()
    svi = SVI(model, guide, trace_elbo_optim(optim, 0.05), Trace_ELBO())
    for _ in range(100):
        svi.step(X, y)
    # the last steps with the delta part held (lr 0): q(w) and the losses at a fixed s
    frozen = SVI(model, guide, trace_elbo_optim(optim, 0.0), Trace_ELBO())
    losses = torch.tensor([frozen.step(X, y) for _ in range(20)], dtype=torch.float64)
    s_star, _ = best_s(X, y)
    s = float(guide.median(X, y)["s"])
    assert s == pytest.approx(s_star, abs=0.03)
    mean, cov = exact_q_w(X, y, s)
    q = guide[0].posterior("w")
    tol = 1e-9 if dtype == torch.float64 else 1e-4
    assert torch.allclose(q.mean.double(), mean, atol=tol)
    assert torch.allclose(q.covariance_matrix.double(), cov, atol=tol)
    # the reported losses against the closed form, and against an independent Trace_ELBO
    # (for an exact q(w) and a point mass the estimates have no variance: exact to rounding)
    rounding = tol * 25 * 1e2
    se = float(losses.std() / len(losses) ** 0.5)
    assert abs(float(losses.mean()) + log_joint_s(X, y, s)) <= 3 * se + rounding
    other = torch.tensor(
        [Trace_ELBO(num_particles=20).loss(model, guide, X, y) for _ in range(10)],
        dtype=torch.float64,
    )
    se_other = float(other.std() / len(other) ** 0.5)
    assert abs(float(losses.mean() - other.mean())) <= 3 * (se**2 + se_other**2) ** 0.5 + rounding


def num_steps(guide):
    return int(pyro.param(guide[0].engine.steps_name).detach())


@pytest.mark.parametrize("dtype", DTYPES)
def test_trace_elbo_steps_the_cvi_part_once_per_svi_step(dtype):
    """With ``num_particles=3`` the guide list runs three times per ``svi.step``: one CVI step.
    ``Trace_ELBO().loss`` outside ``SVI.step`` only draws."""
    X, y = data(dtype)
    guide = guide_list("normal")
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO(num_particles=3))
    for _ in range(4):
        assert math.isfinite(svi.step(X, y))
    assert num_steps(guide) == 4
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    Trace_ELBO(num_particles=5).loss(model, guide, X, y)
    assert all(torch.equal(v, pyro.param(k).detach()) for k, v in before.items())
    # the CVI part's parameters are CVI's: the user's optimizer never sees them
    assert {n for n in before if n.startswith("AutoGuideList.0.")} == set(
        guide[0].engine.param_names() + [guide[0].engine.steps_name]
    )
    svi.step(X, y)
    assert all(p.grad is None for n, p in pyro.get_param_store().named_parameters() if ".0." in n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_trace_elbo_then_cvi_elbo(dtype):
    """A guide list trained under Trace_ELBO goes on under CVI_ELBO (and back): the bound
    check agrees with the reported loss."""
    X, y = data(dtype)
    guide = guide_list()
    SVI(model, guide, CVI(optim_args={"lr": 0.05}), Trace_ELBO()).step(X, y)
    svi = SVI(model, guide, CVI(optim_args={"lr": 0.05}), CVI_ELBO())
    for _ in range(30):
        svi.step(X, y)
    SVI(model, guide, CVI(optim_args={"lr": 0.05}), Trace_ELBO()).step(X, y)
    assert num_steps(guide) == 32

    def reported():
        return CVI_ELBO().loss(model, guide, X, y)

    result = check_bound(model, guide, reported, (X, y), num_particles=400, warn=False)
    assert result.agrees, result


def test_a_failed_trace_elbo_step_leaves_the_cvi_part_as_it_was():
    X, y = data(torch.float64)
    guide = guide_list()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(3):
        svi.step(X, y)
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    with pytest.raises(ValueError):
        svi.step(X, y[:-1])  # the model's shapes disagree
    after = {k: v.detach() for k, v in pyro.get_param_store().items()}
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    svi.step(X, y)
    assert num_steps(guide) == 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["differentiable_loss", "loss_and_grads"])
def test_a_hand_written_loop_warns_once_that_the_cvi_part_is_not_stepped(dtype, method):
    """A Pyro ELBO differentiating the guide list outside ``SVI.step`` in a loop (a third time)
    trains the delta part but cannot step the CVI part: one RuntimeWarning per part, naming
    the method, and ``q(w)`` indeed stays at its prior. Drawing (``Trace_ELBO().loss``) and
    ``SVI.step`` do not warn, nor does a loop over a part that CVI already fitted."""
    X, y = data(dtype)
    guide = guide_list()
    elbo = Trace_ELBO()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        elbo.loss(model, guide, X, y)  # draws only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        elbo.loss_and_grads(model, guide, X, y)  # one gradient (Pyro's own tests) is no loop
    params = [p.unconstrained() for _, p in pyro.get_param_store().items()]
    opt = torch.optim.Adam(params, lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            opt.zero_grad()
            if method == "differentiable_loss":
                elbo.differentiable_loss(model, guide, X, y).backward()
            else:
                elbo.loss_and_grads(model, guide, X, y)
            opt.step()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert f"Trace_ELBO.{method} outside SVI.step" in messages[0]
    assert "SVI(model, guide_list, CVI(), loss=CVI_ELBO())" in messages[0]
    q = guide[0].posterior("w")
    assert torch.equal(q.mean, torch.zeros(2, dtype=dtype))  # the prior's: never stepped
    # a part that CVI has fitted is drawn as it is (a two-stage fit): no warning
    guide = guide_list()
    svi = SVI(model, guide, CVI(optim_args={"lr": 0.05}), CVI_ELBO())
    for _ in range(3):
        svi.step(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        elbo.differentiable_loss(model, guide, X, y).backward()
        SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO()).step(X, y)
