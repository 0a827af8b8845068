"""The early refusal of a chain reading (:func:`pyro_cvi.statespace.detect._spans_steps`): an
observation whose first element clearly depends on two steps is refused after one backward
pass; one that reads a single step, or a second step below the tolerance, goes on to the full
check; and the full check of :func:`observation_rows` agrees with it on both sides."""

import pytest
import torch

from pyro_cvi.statespace.detect import ChainSpec, _spans_steps, observation_rows
from pyro_cvi.statespace.increments import Increments

F64 = torch.float64


def _walk(dtype, T=12):
    inc = Increments(torch.Size([T]), 0)
    spec = ChainSpec(("eps",), inc.state_dim, inc.length, False, increments=inc)
    eps = torch.randn(T, generator=torch.Generator().manual_seed(0), dtype=F64).to(dtype)
    return spec, eps.requires_grad_(True)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_a_regression_on_the_increments_is_refused_at_once(dtype):
    spec, eps = _walk(dtype)
    X = torch.randn(30, eps.numel(), generator=torch.Generator().manual_seed(1), dtype=F64)
    with torch.enable_grad():
        eta = X.to(dtype) @ eps  # every element reads every step
        assert _spans_steps(spec, eta, eps)
        with pytest.raises(ValueError, match="more than one step"):
            observation_rows(spec, eta, {"eps": eps})


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_a_random_walk_observation_goes_on_to_the_full_check(dtype):
    spec, eps = _walk(dtype)
    with torch.enable_grad():
        x = eps.cumsum(0)
        eta = 2.0 * x + 1.0  # each element reads one step
        assert not _spans_steps(spec, eta, eps)
        t, H = observation_rows(spec, eta, {"eps": eps})
        assert torch.equal(t, torch.arange(eps.numel()))
        torch.testing.assert_close(H.reshape(-1), torch.full_like(eta, 2.0))
        # a second step read below the margin over the tolerance is left to the full check
        tiny = 1e-3 * (1e-6 if dtype == F64 else 1e-3)
        assert not _spans_steps(spec, eta + tiny * x[-1], eps)
