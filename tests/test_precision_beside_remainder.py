"""A Gamma noise precision beside the remainder keeps its Gamma ``q`` (Algorithm 2, eq. 20).

The zoo's Bayesian neural network, ``obs ~ Normal(f(w, x), prec^-1/2)`` with ``prec ~ Gamma``:
the network's weights go to the remainder (no closed-form message), while ``obs`` is conjugate
to ``prec`` given them. Its message is the expected natural parameter
``(N / 2, -E_q[sum_n (y_n - f(w, x_n))^2] / 2)``, the expectation over the remainder's draws.
Checked: the Gamma's shape is the prior's plus ``N / 2`` exactly after full steps, the rate's
message is half the expected squared residual (against an independent average over many draws
of the guide's ``q``), and the reported loss agrees with Pyro's ``Trace_ELBO`` estimate of
the same guide.
"""

import sys
from pathlib import Path

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.messages.precision import precision_messages

sys.path.insert(0, str(Path(__file__).parent))
from zoo.simple import BNN, bnn_data  # noqa: E402

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def fit(dtype, steps, step_size=None):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, data = BNN(dtype=dtype), bnn_data(dtype)
    guide = AutoCVI(model)
    optim = CVI() if step_size is None else CVI(step_size=step_size)
    svi = SVI(model, guide, optim, CVI_ELBO())
    for _ in range(steps):
        svi.step(*data.args)
    return model, guide, data


@DTYPES
def test_the_precision_keeps_a_gamma_q(dtype):
    model, guide, data = fit(dtype, 3, step_size=1.0)
    text = guide.explain()
    assert "obs -> prec_obs     conjugate (MC)" in text
    assert "Monte Carlo expected from obs" in text
    assert "prec_obs" not in guide.engine.analysis.remainder
    q = guide.engine.block_for("prec_obs").marginal("prec_obs")
    assert isinstance(q, torch.distributions.Gamma)
    N = data.args[1].shape[0]
    # the shape's message is exact: the prior's 3 plus N / 2 (step size 1)
    assert float(q.concentration) == pytest.approx(3.0 + N / 2, rel=1e-6)


@pytest.mark.slow
@DTYPES
def test_the_rate_is_the_expected_squared_residual(dtype):
    model, guide, data = fit(dtype, 10)
    x, y = data.args
    engine = guide.engine
    nb = engine.block_for("prec_obs").natural["prec_obs"]
    torch.manual_seed(1)
    S = 4000
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for _ in range(S):
            values = engine.sample_q({})
            tr = pyro.poutine.trace(pyro.poutine.condition(model, values)).get_trace(x, y)
            loc = tr.nodes["obs"]["fn"].loc
            total = total + ((y - loc) ** 2).sum().double()
    expected = float(total) / S
    # the message from the current q: (N / 2, -expected / 2)
    ctx = engine.context((x, y), {}, {}, grads=False)
    a, b = precision_messages(ctx, engine.analysis, "prec_obs", ["obs"], 2000)
    assert float(a) == pytest.approx(x.shape[0] / 2, rel=1e-5)
    tol = 0.05 if dtype == torch.float32 else 0.03
    assert -2 * float(b) == pytest.approx(expected, rel=tol)
    assert nb.valid()


@pytest.mark.slow
@DTYPES
def test_the_loss_agrees_with_trace_elbo(dtype):
    model, guide, data = fit(dtype, 30)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    reported = torch.tensor(
        [svi.evaluate_loss(*data.args) for _ in range(200)], dtype=torch.float64
    )
    trace = torch.tensor(
        [Trace_ELBO().loss(model, guide, *data.args) for _ in range(1000)], dtype=torch.float64
    )
    se = float((reported.var() / len(reported) + trace.var() / len(trace)).sqrt())
    assert abs(float(reported.mean() - trace.mean())) < 3 * se, (
        reported.mean(),
        trace.mean(),
        se,
    )


@DTYPES
def test_the_jensen_gap_is_the_gamma_closed_form(dtype):
    from pyro_cvi.messages.precision import jensen_gap

    conc = torch.tensor([2.5, 40.0], dtype=dtype)
    rate = torch.tensor([1.5, 3.0], dtype=dtype)
    a = torch.tensor([20.0, 0.5], dtype=dtype)
    geo = torch.exp(torch.digamma(conc) - rate.log())
    got = jensen_gap(a, conc / rate, geo)
    # E[log tau] - log E[tau] = digamma(alpha) - log(alpha), independent of the rate
    want = (a.double() * (torch.digamma(conc.double()) - conc.double().log())).sum()
    assert float(got) == pytest.approx(float(want), rel=1e-5 if dtype == torch.float32 else 1e-12)
    assert float(got) < 0  # (Jensen: E[log tau] < log E[tau])


@pytest.mark.parametrize(
    "a, b", [((), (40,)), ((3, 1), (1, 5)), ((2, 1, 4), (7, 1)), ((40,), (40,)), ((1,), ())]
)
def test_shapes_broadcast_as_torch_broadcasts_them(a, b):
    from pyro_cvi.messages.precision import _broadcast

    assert _broadcast(torch.Size(a), torch.Size(b)) == torch.broadcast_shapes(a, b)


def test_shapes_that_do_not_broadcast_are_refused():
    from pyro_cvi.messages.precision import _broadcast

    with pytest.raises(ValueError, match="do not broadcast"):
        _broadcast(torch.Size((3,)), torch.Size((4,)))
