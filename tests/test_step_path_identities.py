"""The per-step path's shortcuts are the same numbers as what they replace, bit for bit, in
both dtypes: the Markov short path's expected log-sites (``f * f`` for ``f**2``, a 0-dim
``0.5``) and site rows (``2 lam2`` once), ``log Z`` as a scalar tensor (float64; a narrower
dtype that rounds it to ``inf`` still fails as before), the smoother's backward pass failing
where a smoothed variance is not positive (the general path then decides), the step counter's
0-dim increment; and after ``svi.step`` an ``AutoCVI`` parameter's gradient has been consumed
(``None``), while a model parameter is still learned by the inner optimizer."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks.markov_fast import expected_log_sites, site_rows
from pyro_cvi.gaussian.sites import site_to_row
from pyro_cvi.statespace import Matern32, markov_gp
from pyro_cvi.statespace.first_sites import _backward
from pyro_cvi.statespace.kalman import NotPositiveDefinite
from pyro_cvi.statespace.posterior import SiteRows
from pyro_cvi.statespace.sequential import _Fail, _log_z

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def _wide(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(
        -6, 7, (n,), generator=g
    )).to(dtype)  # fmt: skip


@DTYPES
def test_expected_log_sites_is_the_site_rows_method_bit_for_bit(dtype):
    T = 1000
    b, w, m, v = (_wide(T, dtype, s) for s in range(4))
    sr = SiteRows(torch.arange(T), torch.ones(T, 1, dtype=dtype), w, b.abs(), T)
    want = sr.expected_log_sites(m, v.abs())
    got = expected_log_sites(sr, m, v.abs())
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want)


@DTYPES
def test_site_rows_are_site_to_row_bit_for_bit(dtype):
    T = 1000
    sites = torch.stack([_wide(T, dtype, 5), -_wide(T, dtype, 6).abs()], -1)
    c = _wide(T, dtype, 7)
    w, b = site_rows(sites, c)
    w0, b0 = site_to_row(sites[:, 0], sites[:, 1], c)
    assert w.dtype == b.dtype == dtype
    assert torch.equal(w, w0) and torch.equal(b, b0)
    assert torch.equal(w, -2 * sites[:, 1])  # (-2 x is -(2 x))


@DTYPES
def test_log_z_as_a_scalar_tensor(dtype):
    for x in (0.0, -1e-300, 123.456789012345, -7.5e15, 1e300 if dtype == torch.float64 else 3e38):
        got = _log_z(x, dict(dtype=dtype, device=torch.device("cpu")))
        want = torch.tensor(x, dtype=dtype)
        assert got.shape == () and got.dtype == dtype and torch.equal(got, want)
    with pytest.raises(NotPositiveDefinite):
        _log_z(math.inf, dict(dtype=dtype, device=torch.device("cpu")))
    if dtype == torch.float32:  # (rounds to inf in float32: the check of before)
        with pytest.raises(NotPositiveDefinite):
            _log_z(1e300, dict(dtype=dtype, device=torch.device("cpu")))


def _filtered_step():
    # one filtered step of a 2-state chain (m, P^f, C = A P^f, the next predicted m, P)
    m0, m1, p00, p01, p11 = 0.1, -0.2, 0.5, 0.1, 0.8
    a00, a01, a10, a11, q00, q01, q11 = 0.9, 0.1, -0.2, 0.8, 0.3, 0.0, 0.2
    c00, c01 = a00 * p00 + a01 * p01, a00 * p01 + a01 * p11
    c10, c11 = a10 * p00 + a11 * p01, a10 * p01 + a11 * p11
    n0, n1 = a00 * m0 + a01 * m1, a10 * m0 + a11 * m1
    n00 = c00 * a00 + c01 * a01 + q00
    n01 = c00 * a10 + c01 * a11 + q01
    n11 = c10 * a10 + c11 * a11 + q11
    return (m0, m1, p00, p01, p11, c00, c01, c10, c11, n0, n1, n00, n01, n11)


def test_backward_pass_fails_where_a_smoothed_variance_is_not_positive():
    step = _filtered_step()
    n0, n1, n00, n01, n11 = step[9:]
    log_z, flat = _backward(1.5, [step], (n0, n1, n00, n01, n11))  # (smoothed = prior: fine)
    assert log_z == 1.5 and len(flat) == 12 and min(flat[2], flat[5], flat[8], flat[11]) > 0
    for last in ((n0, n1, -n00, n01, n11), (n0, n1, n00, n01, 0.0), (n0, n1, math.nan, n01, n11)):
        with pytest.raises(_Fail):
            _backward(0.0, [step], last)
    # a last state with positive variances (not a covariance: |p01| > sqrt(p00 p11)) whose
    # smoothed step before has a negative variance: the loop's check
    bad = (n0, n1, n00, -3.0, n11)
    with pytest.raises(_Fail):
        _backward(0.0, [step], bad)


def _gp_fit(dtype, learn=False, steps=4):
    pyro.clear_param_store()
    T = 60
    t = torch.arange(T, dtype=dtype)
    y = torch.poisson(torch.exp(torch.sin(t / 7.0)), generator=torch.Generator().manual_seed(0))

    def model(t, y):
        if learn:
            ls = pyro.param(
                "ls", torch.tensor(5.0, dtype=dtype), constraint=dist.constraints.positive
            )
            kernel = Matern32(ls, 1.0)
        else:
            kernel = Matern32(lengthscale=5.0, variance=1.0)
        f = markov_gp("x", t, kernel)
        with pyro.plate("t", T):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0 if learn else 0.7), loss=CVI_ELBO())
    losses = [svi.step(t, y) for _ in range(steps)]
    return guide, losses


@DTYPES
@pytest.mark.parametrize("learn", [False, True], ids=["fixed", "learned"])
def test_autocvi_gradients_are_consumed_by_the_step(dtype, learn):
    guide, losses = _gp_fit(dtype, learn)
    store = pyro.get_param_store()
    names = list(guide.natural_params())
    assert names and all(store[n].unconstrained().grad is None for n in names)
    assert float(store[guide.engine.steps_name].detach()) == 4.0  # (the 0-dim increment)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    if learn:  # the inner optimizer still moved the model's parameter
        assert float(store["ls"]) != pytest.approx(5.0, abs=1e-6)
