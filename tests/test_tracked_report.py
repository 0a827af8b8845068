"""The remainder's reported loss tracked with common random numbers
(:class:`pyro_cvi.natgrad.report.TrackedReport`): the one-draw step on the 13-8-3 wine
classifier (139 latents, diagonal; ``Horizon(report_pairs=16)``) and Price's Hessians on
numpyro's BNN regression (21 latents, full; ``SignalToNoise(report_pairs=64)``):

* the recursion ``R_t = (1 - b)(R_{t-1} + D_t) + b F_t`` by hand, its restarts (another key,
  a value that is not finite) and its weight ``b`` read from earlier steps only;
* the step is the same: the report's pairs come from the block's own generator and are rows
  of the draw's batched model run that the gradient does not read, so ``q`` after 20 steps
  (and the backtracks) equal
  those without a report, bit for bit;
* unbiased for the current ``q`` at several step counts: over runs that share the trajectory
  (the report's seed changed, the step's draws not), the mean report equals an independent
  estimate of the bound of the ``q`` it was evaluated at within 3 standard errors
  (``Trace_ELBO`` at the end), with a spread below the same pairs' untracked mean's and
  below a tenth of one draw's (measured at step 150: 0.22 against 0.35 under Price's
  Hessians, f32);
* a run resumed from a checkpoint reports what the uninterrupted one does: bit for bit on the
  one-draw step; under Price's Hessians to rounding, as its steps themselves resume.
"""

import math
import types

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, Horizon, Remainder, SignalToNoise
from pyro_cvi.checkpoints.checkpoint import load_checkpoint, save_checkpoint
from pyro_cvi.natgrad import joint
from pyro_cvi.natgrad.report import TrackedReport

pytest.importorskip("sklearn")
from bench.bnn_models import (  # noqa: E402
    WineBNN,
    bnn_regression,
    bnn_regression_data,
    wine_data,
)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


@pytest.fixture(autouse=True)
def _default_dtype(request):
    """The network's ``Normal(0, 1)`` priors take torch's default dtype: the test's."""
    old = torch.get_default_dtype()
    spec = getattr(request.node, "callspec", None)
    torch.set_default_dtype(spec.params.get("dtype", old) if spec else old)
    yield
    torch.set_default_dtype(old)


def _setup(dtype, rule, seed: int = 0):
    """The wine classifier under a :class:`Horizon` rule, numpyro's BNN regression (21
    latents, Price's Hessians) under a :class:`SignalToNoise` one."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    if isinstance(rule, Horizon):
        X, y = wine_data(dtype)
        model = WineBNN().to(dtype)
    else:
        model, (X, y) = bnn_regression, bnn_regression_data(dtype)
    guide = AutoCVI(model, remainder=Remainder(step=rule))
    optim = CVI()
    return model, guide, optim, SVI(model, guide, optim, CVI_ELBO()), (X, y)


def _block(guide):
    (block,) = [b for b in guide.engine.blocks if b.kind == "remainder"]
    return block


def _bound(guide, args, params=None, pairs: int = 4000):
    """``(-ELBO, its se, one pair's sd, one draw's sd)`` of the block's ``q`` at ``params``
    (default: its current values) from ``pairs`` antithetic pairs through the block's batched
    log joint (the global stream's draws)."""
    block = _block(guide)
    ctx = guide.engine.context(args, {}, {}, False, False)
    p = block._values() if params is None else params
    m, sc = p[block.loc_name], p[block.role_names[0]]
    full = block.form == "full"
    with torch.no_grad():
        e = torch.randn(pairs, block.dim, dtype=m.dtype)
        e = torch.cat([e, -e])
        u = m + (e @ sc.tril().mT if full else sc * e)
        logdet = (sc.diagonal() if full else sc).abs().log().sum()
        log_q = -0.5 * e.pow(2).sum(-1) - logdet - 0.5 * block.dim * math.log(2 * math.pi)
        per = (block._log_joint(ctx, u, {}) - log_q).double()
    pair = 0.5 * (per[:pairs] + per[pairs:])
    return (
        float(-pair.mean()),
        float(pair.std() / math.sqrt(pairs)),
        float(pair.std()),
        float(per.std()),
    )


def test_the_recursion_by_hand():
    r = TrackedReport()
    q0, q1 = {"m": torch.zeros(2)}, {"m": torch.ones(2)}
    assert r.previous("k") is None
    f0 = torch.tensor([1.0, 3.0, 2.0])
    assert r.update("k", q0, f0, None) == pytest.approx(2.0)  # R_0 = F_0
    assert torch.equal(r.previous("k")["m"], q0["m"])
    assert r.previous("other data") is None  # another log joint: restart
    # no variance of D yet: b = 1, the fresh mean
    f1, before = torch.tensor([2.0, 4.0, 6.0]), torch.tensor([1.9, 4.2, 5.8])
    assert r.update("k", q1, f1, before) == pytest.approx(4.0)
    var_f = 1.0 + 0.1 * (4.0 - 1.0)  # the running variances of earlier steps
    b = math.sqrt(float((f1 - before).var()) / var_f)
    assert 0.1 < b < 0.3
    f2, before2 = torch.tensor([5.0, 4.0, 3.0]), torch.tensor([4.0, 4.5, 3.5])
    want = (1 - b) * (4.0 + float((f2 - before2).mean())) + b * 4.0
    assert r.update("k", q1, f2, before2) == pytest.approx(want)
    # a value that is not finite restarts it
    assert r.update("k", q1, torch.tensor([1.0, math.inf, 2.0]), before2) == math.inf
    assert r.previous("k") is None
    # a loaded state continues on the data of the first evaluation after the load
    s = TrackedReport()
    s.update("k", q0, f0, None)
    t = TrackedReport()
    t.load(s.state())
    assert torch.equal(t.previous("new process")["m"], q0["m"])
    assert t.previous("yet other data") is None


def test_the_key_sees_the_data_the_model_parameters_and_a_minibatch():
    """The tracked report restarts where the log joint may have changed: another data tensor
    or one written in place, a model parameter moved; never for the guide's own parameters."""
    from types import SimpleNamespace

    pyro.clear_param_store()
    x = torch.zeros(3)

    def model(x):
        return pyro.param("w", torch.ones(1))

    block = SimpleNamespace(loc_name="AutoCVI.remainder.loc")
    ctx = SimpleNamespace(subsample={}, args=(x,), kwargs={}, model=model)
    pyro.param("AutoCVI.remainder.loc", torch.zeros(2))
    model(x)
    key = joint.report_key(block, ctx)
    assert key is not None and joint.report_key(block, ctx) == key
    with torch.no_grad():  # the guide's own parameters move every step
        pyro.param("AutoCVI.remainder.loc").unconstrained().add_(1.0)
    assert joint.report_key(block, ctx) == key
    with torch.no_grad():
        pyro.param("w").unconstrained().add_(1.0)  # a model parameter moved
    moved = joint.report_key(block, ctx)
    assert moved != key
    x.add_(1.0)  # the data written in place
    assert joint.report_key(block, ctx) != moved
    other = SimpleNamespace(subsample={}, args=(x.clone(),), kwargs={}, model=model)
    assert joint.report_key(block, other) != joint.report_key(block, ctx)
    minibatch = SimpleNamespace(subsample={"N": torch.arange(2)}, args=(x,), kwargs={})
    assert joint.report_key(block, minibatch) is None


def test_the_weight_on_the_fresh_estimate_is_small_where_q_stays():
    """At a fixed ``q`` (``D = 0``) ``b`` falls to its floor: the report averages over steps,
    and its spread over many steps is that of about ``2 / B_MIN`` fresh estimates."""
    gen = torch.Generator().manual_seed(0)
    q = {"m": torch.zeros(1)}
    values = []
    for _ in range(200):
        r = TrackedReport()
        f = torch.randn(4, generator=gen, dtype=torch.float64)
        r.update("k", q, f, None)
        for _ in range(150):
            f = torch.randn(4, generator=gen, dtype=torch.float64)
            v = r.update("k", q, f, f.clone())
        values.append(v)
    v = torch.tensor(values)
    # one fresh mean of 4 has sd 0.5; the tracked report's is near sqrt(b / (2 - b)) of it
    b = TrackedReport.B_MIN
    assert abs(float(v.mean())) < 3 * float(v.std()) / math.sqrt(200)
    assert float(v.std()) < 0.5 * math.sqrt(b / (2 - b)) * 1.6, float(v.std())


RULES = pytest.mark.parametrize(
    "rule,none",
    [
        (Horizon(report_pairs=16), Horizon(report_pairs=0)),
        (SignalToNoise(), SignalToNoise(report_pairs=0)),
    ],
    ids=["horizon", "price"],
)


@RULES
@DTYPES
def test_the_tracked_report_leaves_the_steps_as_they_were(dtype, rule, none):
    *_, guide, _, svi, args = _setup(dtype, rule)
    tracked = [float(svi.step(*args)) for _ in range(20)]
    assert _block(guide).control.tracked.var_d is not None
    a = {n: v.detach().clone() for n, v in pyro.get_param_store().items()}
    backtracks = guide.num_backtracks
    *_, guide, _, svi, args = _setup(dtype, none)
    without = [float(svi.step(*args)) for _ in range(20)]
    assert guide.num_backtracks == backtracks
    b = dict(pyro.get_param_store().items())
    for n in a:
        assert torch.equal(a[n], b[n].detach()), n
    assert tracked[-1] != without[-1]


@DTYPES
def test_the_pairs_are_rows_of_the_draws_own_batched_run(dtype):
    """After the first step (the batched run checked on the draw alone, the pairs run after
    it), each step runs the model once: the draw's row, the tracked pairs' ``2 n`` rows at the
    current ``q`` and ``2 n`` at the previous one."""
    n = 4
    *_, guide, _, svi, args = _setup(dtype, Horizon(report_pairs=n))
    svi.step(*args)
    block = _block(guide)
    assert block.vectorise
    rows = []
    log_joint = block._log_joint

    def counted(ctx, u, others):
        rows.append(u.shape[0])
        return log_joint(ctx, u, others)

    block._log_joint = counted
    for _ in range(3):
        rows.append("step")
        svi.step(*args)
    assert rows == ["step", 1 + 4 * n] * 3
    assert block.control.tracked.var_d is not None


@RULES
@DTYPES
def test_a_resumed_run_reports_what_the_uninterrupted_one_does(dtype, rule, none, tmp_path):
    model, guide, optim, svi, args = _setup(dtype, rule)
    for _ in range(6):
        svi.step(*args)
    assert _block(guide).control.tracked.value is not None
    save_checkpoint(tmp_path / "run.pt", optim, guide)
    uninterrupted = [svi.step(*args) for _ in range(6)]
    model, guide, optim, svi, args = _setup(dtype, rule, seed=123)
    load_checkpoint(tmp_path / "run.pt", optim, guide)
    svi = SVI(model, guide, optim, CVI_ELBO())
    resumed = [svi.step(*args) for _ in range(6)]
    if isinstance(rule, Horizon):
        assert resumed == uninterrupted
    else:  # Price's steps themselves resume to rounding (the first step's checked batched run)
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        assert resumed == pytest.approx(uninterrupted, rel=tol)
        assert resumed[0] == uninterrupted[0]
    assert len(set(uninterrupted)) > 1


def _reports(dtype, rule, runs: int, at):
    """The reported loss at the step counts ``at`` over ``runs`` runs that share the
    trajectory (only the report's seed differs); the bound of the ``q`` each report is of
    (the tracked report's own ``q``: the step control may have undone the step before it
    reported), and whether the last report's ``q`` is the one before the last step."""
    out = torch.zeros(runs, len(at), dtype=torch.float64)
    bounds, plain = [], False
    seed = joint.REPORT_SEED
    try:
        for r in range(runs):
            joint.REPORT_SEED = seed + 7919 * r
            model, guide, _, svi, args = _setup(dtype, rule)
            for t in range(1, max(at) + 1):
                if t == max(at) and r == 0:
                    loc = _block(guide)._values()[_block(guide).loc_name].detach().clone()
                loss = float(svi.step(*args))
                if t in at:
                    out[r, at.index(t)] = loss
                    if r == 0:
                        q = _block(guide).control.tracked.params
                        state = torch.get_rng_state()  # (the runs' streams stay the same)
                        bounds.append(_bound(guide, args, q))
                        torch.set_rng_state(state)
            if r == 0:
                plain = torch.equal(q[_block(guide).loc_name], loc)
    finally:
        joint.REPORT_SEED = seed
    return out, bounds, plain


@pytest.mark.slow
@RULES
@DTYPES
def test_the_tracked_report_is_the_current_bound_with_a_small_spread(dtype, rule, none):
    at = [10, 60, 150]
    runs = 16
    pairs = rule.report_pairs
    reports, bounds, plain = _reports(dtype, rule, runs, at)
    for j, (bound, se, *_) in enumerate(bounds):
        col = reports[:, j]
        err = math.sqrt(float(col.var()) / runs + se**2)
        assert abs(float(col.mean()) - bound) < 3 * err, (at[j], float(col.mean()), bound, err)
    last = reports[:, -1]
    if plain:  # at the end, against Trace_ELBO of the q before the last step (no undo)
        model, guide, _, svi, args = _setup(dtype, none)  # the same trajectory
        for _ in range(max(at) - 1):
            svi.step(*args)
        with torch.no_grad():
            est = torch.tensor(
                [Trace_ELBO(num_particles=10).loss(model, guide, *args) for _ in range(60)],
                dtype=torch.float64,
            )
        se = math.sqrt(float(last.var()) / runs + float(est.var()) / 60)
        assert abs(float(last.mean() - est.mean())) < 3 * se, (last.mean(), est.mean(), se)
    # the spread: below the same pairs' untracked mean's, far below one draw's
    _, _, pair_sd, draw_sd = bounds[-1]
    untracked = pair_sd / math.sqrt(pairs)
    assert float(last.std()) < untracked, (float(last.std()), untracked)
    assert float(last.std()) < 0.1 * draw_sd, (float(last.std()), draw_sd)


def test_no_tracking_where_another_block_is_in_the_log_joint():
    """A remainder beside another block reads that block's draws: its log joint moves with
    the other ``q`` between steps, so its report is not tracked."""
    import pyro.distributions as dist

    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
        with pyro.plate("N", len(y)):
            pyro.sample("y", dist.Normal(x @ w, s), obs=y)

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x = torch.randn(20, 2)
    y = x @ torch.tensor([1.0, -1.0]) + 0.3 * torch.randn(20)
    guide = AutoCVI(model, remainder=Remainder(step=Horizon(report_pairs=4)))
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    for _ in range(3):
        svi.step(x, y)
    block = _block(guide)
    assert len(guide.engine.blocks) > 1 and list(block.names) == ["s"]
    stepping = types.SimpleNamespace(grads=True)
    assert joint.tracked_report(block, stepping) is None and block.control.tracked.value is None


@DTYPES
def test_an_evaluation_outside_a_step_reports_fresh_pairs_and_leaves_the_tracker(dtype):
    """``svi.evaluate_loss`` at a fixed ``q``: independent fresh estimates (their spread that of
    the pairs, not the tracker's), the tracker untouched."""
    _, guide, _, svi, args = _setup(dtype, Horizon(report_pairs=16))
    for _ in range(5):
        svi.step(*args)
    tracked = _block(guide).control.tracked
    before = (tracked.value, tracked.var_f, tracked.var_d)
    values = [svi.evaluate_loss(*args) for _ in range(12)]
    assert (tracked.value, tracked.var_f, tracked.var_d) == before
    assert len(set(values)) == len(values)
    assert joint.tracked_report(_block(guide), types.SimpleNamespace(grads=False)) is None
