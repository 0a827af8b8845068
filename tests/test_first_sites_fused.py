"""The short path's fused filter-smoother for one repeated transition row
(:func:`~pyro_cvi.statespace.first_sites._smooth_repeated`) is the two-pass form it stands in
for (:func:`~pyro_cvi.statespace.sequential._forward_2_first`, then
:func:`~pyro_cvi.statespace.first_sites._backward`) bit for bit: the same ``log Z`` and the same
smoothed means and covariances, on sites of widely spread magnitudes, with masked (zero) sites,
from rows in either dtype's values, and it fails (:class:`_Fail`) where the two-pass form does."""

import array
import math

import pytest
import torch

from pyro_cvi.statespace.first_sites import _backward, _smooth_repeated
from pyro_cvi.statespace.sequential import (
    OnFirst,
    _backward_2,
    _Fail,
    _forward_2_first,
    _Repeated,
    doubles,
    packed,
)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def _two_pass(m0, P0, row, es, js):
    trans = _Repeated(row, len(es) - 1)
    return _backward(*_forward_2_first(m0, P0, trans, OnFirst(es, js)))


def _rows(dtype, lengthscale=20.0):
    # a Matern-3/2 step of one unit (lam = sqrt(3) / lengthscale: A = exp(-lam) [[1 + lam, 1],
    # [-lam^2, 1 - lam]], P_inf = diag(1, lam^2), Q = P_inf - A P_inf A'), the rows a Markov GP
    # on regular inputs gives, read through ``dtype`` as the short path reads a chain of it
    lam = math.sqrt(3.0) / lengthscale
    A = math.exp(-lam) * torch.tensor([[1 + lam, 1.0], [-(lam**2), 1 - lam]], dtype=torch.float64)
    Pinf = torch.diag(torch.tensor([1.0, lam**2], dtype=torch.float64))
    Q = Pinf - A @ Pinf @ A.T
    row = torch.cat([A.reshape(-1), torch.zeros(2, dtype=torch.float64), Q.reshape(-1)])
    as_read = [x.to(dtype).to(torch.float64) for x in (row, Pinf.reshape(-1))]
    return [0.0, 0.0], as_read[1].tolist(), as_read[0].tolist()


@DTYPES
@pytest.mark.parametrize("T", [2, 3, 200])
def test_fused_pass_is_the_two_pass_form_bit_for_bit(dtype, T):
    g = torch.Generator().manual_seed(T)
    m0, P0, row = _rows(dtype)
    scale = 10.0 ** torch.randint(-3, 3, (2, T), generator=g)
    e = torch.randn(T, generator=g, dtype=torch.float64) * scale[0]
    j = torch.rand(T, generator=g, dtype=torch.float64) * scale[1]
    e[::7], j[::7] = 0.0, 0.0  # (masked steps)
    es, js = e.to(dtype).to(torch.float64).tolist(), j.to(dtype).to(torch.float64).tolist()
    log_z, flat = _smooth_repeated(m0, P0, row, es, js)
    log_z0, flat0 = _two_pass(m0, P0, row, es, js)
    assert math.isfinite(log_z) and log_z == log_z0
    assert len(flat) == 6 * T and flat.tobytes() == flat0.tobytes()


@DTYPES
@pytest.mark.parametrize("T", [1, 2, 200])
def test_backward_is_the_general_smoother_bit_for_bit(dtype, T):
    # the short path's smoother (its gains by ``-q``, its steps packed as it goes) against the
    # general pass's (``sequential._backward_2``: ten floats per step, last step first), on
    # the same filter output: the same means and covariances, every bit
    g = torch.Generator().manual_seed(T + 7)
    m0, P0, row = _rows(dtype, lengthscale=3.0)
    scale = 10.0 ** torch.randint(-3, 3, (2, T), generator=g)
    e = torch.randn(T, generator=g, dtype=torch.float64) * scale[0]
    j = torch.rand(T, generator=g, dtype=torch.float64) * scale[1]
    e[::5], j[::5] = 0.0, 0.0
    es, js = e.to(dtype).to(torch.float64).tolist(), j.to(dtype).to(torch.float64).tolist()
    filtered = _forward_2_first(m0, P0, _Repeated(row, T - 1), OnFirst(es, js))
    log_z, flat = _backward(*filtered)
    log_z0, flat0 = _backward_2(*filtered, False)
    want = torch.frombuffer(flat0, dtype=torch.float64).view(T, 10).flip(0)[:, :6]
    got = torch.frombuffer(flat, dtype=torch.float64).view(T, 6)
    assert log_z == log_z0 and math.isfinite(log_z)
    assert torch.equal(got.view(torch.int64), want.contiguous().view(torch.int64))
    assert bool((got[:, 2] > 0).all()) and bool((got[:, 5] > 0).all())  # (variances)


def test_fused_pass_fails_where_the_two_pass_form_does():
    m0, P0, row = _rows(torch.float64)
    es, js = [1.0, 0.5, -0.2, 0.3], [0.5, 2.0, 1.0, 0.1]
    for bad_j in (-1e6, math.nan):  # (1 + p00 j not positive in the filter)
        for t in (1, 3):  # (inside the loop and at the last step)
            j2 = list(js)
            j2[t] = bad_j
            with pytest.raises(_Fail):
                _two_pass(m0, P0, row, es, j2)
            with pytest.raises(_Fail):
                _smooth_repeated(m0, P0, row, es, j2)


@DTYPES
def test_doubles_are_torch_tensor_bit_for_bit(dtype):
    # the passes' lists of Python floats, packed in one C pass: the same bits as
    # ``torch.tensor`` (and the same narrowing to float32 after), signed zeros, subnormals,
    # infinities and NaN payloads included; an empty list too
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(997, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(
        -320, 309, (997,), generator=g
    ).to(torch.float64)
    values = wide.tolist() + [0.0, -0.0, 5e-324, -5e-324, math.inf, -math.inf, math.nan, 1, -3]
    for vals in (values, values[:1], []):
        assert packed(vals).tobytes() == array.array("d", vals).tobytes()
        got = doubles(vals).to(dtype)
        want = torch.tensor(vals, dtype=torch.float64).to(dtype)
        assert got.dtype == dtype and got.shape == (len(vals),)
        bits = torch.int64 if dtype == torch.float64 else torch.int32
        assert torch.equal(got.view(bits), want.view(bits))
        assert torch.equal(got.view(bits), torch.tensor(vals, dtype=dtype).view(bits))
