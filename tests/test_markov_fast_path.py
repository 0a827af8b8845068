"""The Markov block's short path (``blocks/markov_fast.py``, ``statespace/first_sites.py``) is
the general path's arithmetic, bit for bit: a fit that takes it returns the same losses and
leaves the same sites as one whose block takes the general path (``on_first`` answering no,
every message by ``linear_predictor_message``), step after step, in both dtypes; it is taken
where it applies (counted) and left where it does not (hyperparameters with gradients, a
quadrature message, a random walk's lag-one covariances); a step whose first candidate is not
a valid ``q`` is shrunk as before; a step interrupted inside the short path leaves the guide as
it was. The answer itself: at ``step_size=1`` on a conjugate Normal likelihood one step is the
dense GP posterior and ``-ELBO = -log p(y)``."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

import pyro_cvi.blocks.markov as markov
import pyro_cvi.blocks.markov_fast as markov_fast
import pyro_cvi.statespace.first_sites as first_sites
from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.messages.gaussian import linear_predictor_message
from pyro_cvi.statespace import Matern12, Matern32, markov_gp

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def counts(T, dtype):
    g = torch.Generator().manual_seed(1)
    t = torch.arange(T, dtype=torch.float64)
    y = torch.poisson(torch.exp(torch.sin(t / 9.0) + 0.5 * torch.sin(t / 3.0)), generator=g)
    return t.to(dtype), y.to(dtype)


def gp_model(kernel=Matern32, likelihood="poisson", learn=False):
    def model(t, y):
        if learn:
            pos = dist.constraints.positive
            ls = pyro.param("ls", torch.tensor(6.0, dtype=t.dtype), constraint=pos)
            k = kernel(ls, 1.0)
        else:
            k = kernel(lengthscale=6.0, variance=1.0)
        f = markov_gp("x", t, k)
        with pyro.plate("t", len(t)):
            if likelihood == "poisson":
                pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)
            else:
                pyro.sample("y", dist.Bernoulli(logits=f), obs=(y > 1).to(t.dtype))

    return model


class Counter:
    """Counts the short path's smoother and plan calls (and can switch the short path off)."""

    def __init__(self, monkeypatch, off=False):
        self.solved = self.planned = 0
        solve, message = markov_fast.FastPath.solve, markov_fast.MessagePlan.message

        def counted_solve(fp, prior, sr):
            out = solve(fp, prior, sr)
            self.solved += out is not None
            return out

        def counted_message(plan, *a):
            self.planned += 1
            return message(plan, *a)

        monkeypatch.setattr(markov_fast.FastPath, "solve", counted_solve)
        monkeypatch.setattr(markov_fast.MessagePlan, "message", counted_message)
        if off:
            monkeypatch.setattr(markov, "on_first", lambda *a: False)
            monkeypatch.setattr(
                markov_fast.FastPath,
                "message",
                lambda fp, site, rows, m, v, n, s: linear_predictor_message(site, rows, m, v, n, s),
            )


def run(model, t, y, steps=6, step_size=1.0):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)  # (the analysis draws z_at: the offsets' rounding follows it)
    guide = AutoCVI(model, num_quad_points=10)
    svi = SVI(model, guide, CVI(step_size=step_size), loss=CVI_ELBO())
    out = []
    for _ in range(steps):
        loss = svi.step(t, y)
        sites = {k: v.detach().clone() for k, v in pyro.get_param_store().items() if ".sites." in k}
        out.append((loss, sites))
    return out, guide


def assert_same(a, b):
    for (la, sa), (lb, sb) in zip(a, b):
        assert la == lb
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


@DTYPES
@pytest.mark.parametrize("kernel", [Matern32, Matern12], ids=["d2", "d1"])
@pytest.mark.parametrize("T", [1, 2, 57, 300])
def test_short_path_is_the_general_path_bit_for_bit(monkeypatch, dtype, kernel, T):
    t, y = counts(T, dtype)
    with monkeypatch.context() as m:
        c = Counter(m)
        fast, _ = run(gp_model(kernel), t, y)
        assert c.solved >= 6 and c.planned >= 4  # (every step took it; the plan from the second)
    with monkeypatch.context() as m:
        c = Counter(m, off=True)
        general, _ = run(gp_model(kernel), t, y)
        assert c.solved == 0 and c.planned == 0
    assert_same(fast, general)


@DTYPES
def test_auto_steps_are_the_same_too(monkeypatch, dtype):
    t, y = counts(80, dtype)
    fast, _ = run(gp_model(), t, y, steps=8, step_size="auto")
    with monkeypatch.context() as m:
        Counter(m, off=True)
        general, _ = run(gp_model(), t, y, steps=8, step_size="auto")
    assert_same(fast, general)


@DTYPES
def test_a_quadrature_message_keeps_the_general_message(monkeypatch, dtype):
    """Bernoulli has no closed form: no plan, the general message; the smoother's short path
    still applies, and the fit is the general one."""
    t, y = counts(60, dtype)
    with monkeypatch.context() as m:
        c = Counter(m)
        fast, _ = run(gp_model(likelihood="bernoulli"), t, y)
        assert c.solved >= 6 and c.planned == 0
    with monkeypatch.context() as m:
        Counter(m, off=True)
        general, _ = run(gp_model(likelihood="bernoulli"), t, y)
    assert_same(fast, general)


@DTYPES
def test_learned_hyperparameters_take_the_general_path(monkeypatch, dtype):
    """A prior with a graph to a learned lengthscale: no step takes the short smoother or the
    plan (the prior moves; only the set-up's solve, under ``no_grad``, has a prior without a
    graph), and the fit is the general one."""
    t, y = counts(50, dtype)
    with monkeypatch.context() as m:
        c = Counter(m)
        fast, _ = run(gp_model(learn=True), t, y)
        assert c.solved <= 1 and c.planned == 0
    with monkeypatch.context() as m:
        Counter(m, off=True)
        general, _ = run(gp_model(learn=True), t, y)
    assert_same(fast, general)


@DTYPES
def test_two_chains_each_take_the_short_path(monkeypatch, dtype):
    t, y = counts(40, dtype)

    def model(t, y):
        f = markov_gp("f", t, Matern32(lengthscale=6.0, variance=1.0))
        g = markov_gp("g", t, Matern32(lengthscale=3.0, variance=0.5))
        with pyro.plate("t", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)
            pyro.sample("z", dist.Poisson(torch.exp(g)), obs=y.flip(0))

    with monkeypatch.context() as m:
        c = Counter(m)
        fast, guide = run(model, t, y)
        assert len(guide.engine.blocks) == 2 and c.solved >= 12
    with monkeypatch.context() as m:
        Counter(m, off=True)
        general, _ = run(model, t, y)
    assert_same(fast, general)


@DTYPES
def test_an_invalid_first_candidate_is_shrunk_as_before(monkeypatch, dtype):
    """Gradients whose full step makes a site's precision very negative: the first candidate
    fails, the general halving takes over, and both paths shrink alike to a valid q."""
    t, y = counts(40, dtype)
    before = torch.zeros(40, 2, dtype=dtype)

    def shrunk(off):
        with monkeypatch.context() as m:
            Counter(m, off=off)
            _, guide = run(gp_model(), t, y, steps=2)
            before[:] = pyro.param("AutoCVI.sites.y").detach()
            svi = SVI(guide.model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
            engine = guide.engine
            engine.loss((t, y), {}, {}, True)
            p = pyro.param("AutoCVI.sites.y").unconstrained()
            p.grad = torch.zeros_like(p)
            p.grad[10, 1] = 10.0  # (lam2 + 10: w - 20 at one step, beyond 1 / Var_q)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the shrink's warning)
                svi.optim([p])
            return p.detach().clone(), guide.num_shrunk, engine.blocks[0].post.cov

    a, na, cov = shrunk(False)
    b, nb, _ = shrunk(True)
    assert na == nb >= 1 and torch.equal(a, b)
    assert 0 < float(a[10, 1] - before[10, 1]) < 10.0
    assert bool((cov.diagonal(dim1=-2, dim2=-1) > 0).all())


@DTYPES
def test_an_interrupt_inside_the_short_path_leaves_the_guide_as_it_was(monkeypatch, dtype):
    t, y = counts(40, dtype)
    _, guide = run(gp_model(), t, y, steps=3)
    svi = SVI(guide.model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    before = pyro.param("AutoCVI.sites.y").detach().clone()
    post = guide.engine.blocks[0].post
    real = first_sites.marginals

    def interrupted(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(first_sites, "marginals", interrupted)
    with pytest.raises(KeyboardInterrupt):
        svi.step(t, y)
    assert torch.equal(pyro.param("AutoCVI.sites.y").detach(), before)
    assert guide.engine.blocks[0].post is post
    monkeypatch.setattr(first_sites, "marginals", real)
    loss = svi.step(t, y)  # (and the next step goes on from there)
    assert torch.isfinite(torch.tensor(loss))


@DTYPES
def test_one_conjugate_step_is_the_dense_posterior(dtype):
    """A Normal likelihood (conjugate) through the short smoother: at ``step_size=1`` one step
    is the exact GP posterior."""
    T, noise = 35, 0.4
    t = torch.arange(T, dtype=dtype)
    y = torch.sin(t / 4)

    def model(t, y):
        f = markov_gp("x", t, Matern32(lengthscale=5.0, variance=1.0))
        with pyro.plate("t", len(t)):
            pyro.sample("y", dist.Normal(f, noise), obs=y)

    out, guide = run(model, t, y, steps=2)
    K = Matern32(lengthscale=5.0, variance=1.0).covariance(t.double(), t.double())
    S = K + noise**2 * torch.eye(T, dtype=torch.float64)
    mean = K @ torch.linalg.solve(S, y.double())
    var = (K - K @ torch.linalg.solve(S, K)).diagonal()
    q = guide.posterior("x")
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    assert torch.allclose(q.mean[:, 0].double(), mean, rtol=0, atol=tol)
    assert torch.allclose(q.variance[:, 0].double(), var, rtol=0, atol=tol)
    evidence = dist.MultivariateNormal(torch.zeros(T, dtype=torch.float64), S).log_prob(y.double())
    assert abs(out[-1][0] + evidence.item()) < (1e-8 if dtype == torch.float64 else 2e-3)


@DTYPES
def test_a_start_offset_keeps_the_general_path(monkeypatch, dtype):
    """``init_loc_fn`` gives the block a start offset (extra rows): the smoother's short path
    and the whole-rows read are left, and the fit is the general one."""
    from pyro.infer.autoguide.initialization import init_to_value

    t, y = counts(30, dtype)
    init = init_to_value(values={"x": torch.full((30, 2), 0.1, dtype=dtype)})

    def fit(off):
        with monkeypatch.context() as m:
            c = Counter(m, off=off)
            pyro.clear_param_store()
            pyro.set_rng_seed(0)
            model = gp_model()
            guide = AutoCVI(model, init_loc_fn=init)
            svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
            losses = [svi.step(t, y) for _ in range(5)]
            return losses, pyro.param("AutoCVI.sites.y").detach().clone(), c.solved

    a, sa, _ = fit(False)
    b, sb, _ = fit(True)
    assert a == b and torch.equal(sa, sb)
    assert torch.isfinite(torch.tensor(a)).all()


@DTYPES
@pytest.mark.parametrize("kernel,d", [(Matern32, 2), (Matern12, 1)], ids=["d2", "d1"])
def test_the_short_path_runs_to_its_own_length_limit(monkeypatch, dtype, kernel, d):
    """``kalman.FIRST_SITES_MAX_T`` (not the general pass's ``SEQUENTIAL_MAX_T``) bounds the
    short path: at the limit it is taken, bit for bit the general path through the scalar pass
    (there: the tree with a scalar top, equal to 1e-10); one step longer it is not."""
    from pyro_cvi.statespace import kalman

    T = kalman.FIRST_SITES_MAX_T[d]
    t, y = counts(T, dtype)
    with monkeypatch.context() as m:
        c = Counter(m)
        fast, _ = run(gp_model(kernel), t, y, steps=3)
        assert c.solved >= 3
    with monkeypatch.context() as m:  # the general path through the scalar pass
        c = Counter(m, off=True)
        m.setitem(kalman.SEQUENTIAL_MAX_T, d, T)
        general, _ = run(gp_model(kernel), t, y, steps=3)
        assert c.solved == 0
    assert_same(fast, general)
    if dtype == torch.float64:  # the general path as the rule has it (the tree past its pass)
        with monkeypatch.context() as m:
            c = Counter(m, off=True)
            tree, _ = run(gp_model(kernel), t, y, steps=3)
        for (la, sa), (lb, sb) in zip(fast, tree):
            assert abs(la - lb) <= 1e-10 * abs(lb)
            for k in sa:
                torch.testing.assert_close(sa[k], sb[k], rtol=1e-10, atol=1e-10)
    t, y = counts(T + 1, dtype)
    with monkeypatch.context() as m:
        c = Counter(m)
        run(gp_model(kernel), t, y, steps=2)
        assert c.solved == 0


def scalar_loop(y):
    """A ``pyro.markov`` loop of one scalar Poisson count per step: each factor's message plan
    reads 0-dim moments."""
    x = pyro.sample("x_0", dist.Normal(y.new_tensor(0.0), 1.0))
    pyro.sample("y_0", dist.Poisson(x.exp()), obs=y[0])
    for t in pyro.markov(range(1, len(y))):
        x = pyro.sample(f"x_{t}", dist.Normal(x, 0.3))
        pyro.sample(f"y_{t}", dist.Poisson(x.exp()), obs=y[t])


def test_scalar_factors_keep_the_datas_dtype():
    """From the second step on, the messages come from the plans (0-dim moments): in float32
    they stay float32 (a float64 constant promoted them, and setting ``.grad`` then raised),
    and the losses follow float64's."""
    losses = {}
    for dtype in (torch.float32, torch.float64):
        _, y = counts(12, dtype)
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        svi = SVI(scalar_loop, AutoCVI(scalar_loop), CVI(), CVI_ELBO())
        losses[dtype] = torch.tensor([svi.step(y) for _ in range(6)], dtype=torch.float64)
    assert float(losses[torch.float64][-1]) < 0.7 * float(losses[torch.float64][0])
    assert torch.allclose(losses[torch.float32], losses[torch.float64], rtol=1e-4)
