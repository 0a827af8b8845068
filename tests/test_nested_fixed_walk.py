"""A local linear trend written with two cumsums whose scales are fixed numbers.

``eta ~ Normal(0, 0.02)``, ``eps ~ Normal(0, 0.1)`` in one plate, ``level = (eta.cumsum(-1) +
eps).cumsum(-1)``, ``y ~ Normal(level, 0.5)``: the chain of ``x_t = (slope_t, level_t -
slope_t)``, ``x_t = [[1, 0], [1, 1]] x_(t-1) + (eta_t, eps_t)``
(``statespace.increments.NestedIncrements``), found by the plain random-walk finder
(``statespace/random_walk.py``) and fitted by the Markov block with no remainder. Checked: the
steps from the same ``q`` against the same density written as a two-state ``pyro.markov``
loop, the bound against the exact evidence (a Kalman filter), the guide's sites in their
plate, the float32 loss of the float64 fit's ``q``, and where it does not apply.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
import trend_models as tm
from test_markov_float32 import _same_q_losses
from test_scaled_walk import steps_from

from pyro_cvi.blocks.markov import MarkovBlock
from pyro_cvi.statespace.increments import NestedIncrements

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
SLOPE, LEVEL, OBS = 0.02, 0.1, 0.5
FIXED = tm.fixed_scales(LEVEL, SLOPE, OBS)
trend, trend_loop = tm.trend(FIXED), tm.trend_loop(FIXED)


def data(T, dtype, obs=OBS, offset=0.0):
    return tm.simulate(T, dtype, level=LEVEL, obs=obs, offset=offset, slope=SLOPE)


def _chain(guide):
    found = [b for b in guide.engine.blocks if isinstance(b, MarkovBlock)]
    return found[0] if len(found) == 1 and len(guide.engine.blocks) == 1 else None


def exact_neg_log_evidence(y: torch.Tensor, obs: float = OBS) -> float:
    """``-log p(y)`` by a Kalman filter on ``(slope, level)`` (``x_(-1) = 0``)."""
    return tm.neg_log_evidence(y, LEVEL, SLOPE, obs)


@DTYPES
def test_the_two_cumsums_step_as_the_two_state_loop(dtype):
    """From each one's set-up and the same random stream, three steps of the trend's block
    and of the loop's give the same losses and ``q(x)``, at the exact ``-log p(y)``; the
    guide samples ``eta`` and ``eps`` in their plate, their marginals the increments of
    ``q(x)``'s means."""
    T, steps = 12, 3
    y = data(T, dtype)
    out = {}
    for name, model in (("loop", trend_loop), ("trend", trend)):  # (the trend's guide kept)
        guide, loss, _ = steps_from(model, y, None, None, steps)
        block = _chain(guide)
        assert block is not None and not guide.engine.analysis.remainder
        out[name] = (loss, block.post.mean, block.post.cov, guide)
    (lt, mt, vt, gt), (ll, ml, vl, _) = out["trend"], out["loop"]
    assert isinstance(_chain(gt).chain.increments, NestedIncrements)
    assert _chain(gt).names == ("eta", "eps")
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    assert abs(lt - ll) < tol * max(1.0, abs(ll)), (lt, ll)
    assert torch.allclose(mt, ml, rtol=tol, atol=tol) and torch.allclose(vt, vl, rtol=tol, atol=tol)
    exact = exact_neg_log_evidence(y)
    assert abs(lt - exact) < (1e-8 if dtype == torch.float64 else 1e-3) * abs(exact), (lt, exact)
    tm.check_guide_sites(gt, _chain(gt), y, mt, tol)


@DTYPES
def test_the_explain_wording_and_the_long_chain(dtype):
    """``explain()`` names the nested walk; at T = 1,000 observed with sd 0.05 near 20 the
    float32 loss of the float64 fit's ``q`` is within 0.02 of float64's, both at the exact
    ``-log p(y)``."""
    T, obs = 1000, 0.05
    y64 = data(T, torch.float64, obs=obs, offset=20.0)
    model = tm.trend(tm.fixed_scales(LEVEL, SLOPE, obs))

    g64, l64, _ = steps_from(model, y64, None, None, 2)
    text = g64.explain()
    assert "nested random walk of (eta, eps)" in text and "transition into eps" in text
    exact = exact_neg_log_evidence(y64, obs)
    assert abs(l64 - exact) < 1e-6 * abs(exact), (l64, exact)
    ref, loss = _same_q_losses(model, (y64,), dtype, 2, "MarkovBlock")
    assert abs(ref - l64) < 1e-6 * abs(l64)
    tol = 1e-8 * abs(ref) if dtype == torch.float64 else 0.02
    assert abs(loss - ref) < tol, (loss, ref)


parallel, shifted = tm.beside(FIXED, "parallel"), tm.beside(FIXED, "shifted")


def prior_reads(y):
    """The second site's prior loc reads the first: not independent increments."""
    with pyro.plate("time", y.shape[0]):
        eta = pyro.sample("eta", dist.Normal(y.new_tensor(0.0), SLOPE))
        eps = pyro.sample("eps", dist.Normal(0.5 * eta, LEVEL))
        pyro.sample("y", dist.Normal((eta.cumsum(-1) + eps).cumsum(-1), OBS), obs=y)


@DTYPES
@pytest.mark.parametrize("model", [parallel, shifted, prior_reads])
def test_where_the_fixed_nested_walk_does_not_apply(model, dtype):
    """Walks side by side, a loc reading another latent, a prior reading the other site: no
    nested-walk block."""
    y = data(20, dtype)
    guide, _, _ = steps_from(model, y, None, None, 1)
    assert not any(
        isinstance(getattr(getattr(b, "chain", None), "increments", None), NestedIncrements)
        for b in guide.engine.blocks
    )
