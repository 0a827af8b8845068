"""``pyro_cvi.update``: the one CVI update (eq. 12) and the one validity policy."""

import pytest
import torch

from pyro_cvi.update import (
    MAX_HALVINGS,
    TO_BOUNDARY,
    StepCounts,
    cvi_update,
    damped_step,
    targets_from_grads,
)

DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_update_is_the_convex_combination(dtype):
    old = (torch.tensor([1.0, -2.0], dtype=dtype), torch.tensor([[3.0]], dtype=dtype))
    tgt = (torch.tensor([5.0, 2.0], dtype=dtype), torch.tensor([[-1.0]], dtype=dtype))
    new = cvi_update(old, tgt, 0.25)
    assert torch.allclose(new[0], torch.tensor([2.0, -1.0], dtype=dtype))
    assert torch.allclose(new[1], torch.tensor([[2.0]], dtype=dtype))
    # per-element step sizes broadcast over the trailing dims
    b = torch.tensor([0.0, 1.0], dtype=dtype)
    (row,) = cvi_update((torch.zeros(2, 3, dtype=dtype),), (torch.ones(2, 3, dtype=dtype),), b)
    assert row[0].sum() == 0 and row[1].sum() == 3


def test_targets_are_read_from_grads():
    p = torch.tensor([1.0, 2.0], requires_grad=True)
    assert targets_from_grads([p]) is None
    p.grad = torch.tensor([0.5, -1.0])
    old, target = targets_from_grads([p])
    assert torch.equal(target[0], torch.tensor([1.5, 1.0])) and torch.equal(old[0], p.detach())


@pytest.mark.parametrize("dtype", DTYPES)
def test_invalid_steps_are_halved_per_element_and_counted(dtype):
    # valid: the second natural parameter stays negative (a Gaussian precision)
    old = (torch.tensor([[0.0, -1.0], [0.0, -1.0]], dtype=dtype),)
    target = (torch.tensor([[1.0, -2.0], [1.0, 2.0]], dtype=dtype),)

    def valid(new):
        return new[0][:, 1] < 0

    new, counts = damped_step(old, target, 1.0, valid)
    assert torch.allclose(new[0][0], target[0][0])  # element 0: the full step
    # element 1: -1 + b * 3 < 0 first at b = 1/4 (two halvings)
    assert torch.allclose(new[0][1], torch.tensor([0.25, -0.25], dtype=dtype))
    assert (counts.shrunk, counts.rejected) == (2, 0)


def test_an_element_never_valid_is_rejected_and_keeps_its_value():
    old = (torch.tensor([1.0, 2.0]),)
    new, counts = damped_step(old, (torch.tensor([3.0, 4.0]),), 0.5, lambda n: n[0] < 1.5)
    # element 0 is valid at b = 1/8 (1.25); element 1 never is: rejected after MAX_HALVINGS
    assert torch.equal(new[0], torch.tensor([1.25, 2.0]))
    assert counts.rejected == 1
    assert counts.shrunk == 2 + 2 + (MAX_HALVINGS - 2)  # invalid elements, halving by halving


@pytest.mark.parametrize("dtype", DTYPES)
def test_box_step_stops_half_way_to_the_boundary(dtype):
    # a Gamma-like domain (shape > 0): the target is outside, at -1
    old = (torch.tensor([[2.0]], dtype=dtype),)
    target = (torch.tensor([[-1.0]], dtype=dtype),)
    new, counts = damped_step(old, target, 1.0, None, bounds=[(0.0, None)], param_shapes=[()])
    # the boundary is 2/3 of the step away; the shrunk step covers at most TO_BOUNDARY of it
    assert 0 < float(new[0]) < 2.0 and float(new[0]) >= 2.0 * (1 - TO_BOUNDARY) - 1e-6
    assert counts.shrunk == 1 and counts.rejected == 0
    # inside the domain: the plain convex combination, exact
    new, counts = damped_step(
        old, (torch.tensor([[4.0]], dtype=dtype),), 0.5, None, [(0.0, None)], [()]
    )
    assert float(new[0]) == 3.0 and counts == StepCounts()


@pytest.mark.parametrize("dtype", DTYPES)
def test_halving_returns_the_step_size_it_settled_on(dtype):
    from pyro_cvi.update import halve_until_valid

    p = torch.tensor([1.0, 1.0, 1.0], dtype=dtype)
    g = torch.tensor([1.0, -3.0, -100.0], dtype=dtype)
    new, b, ok, shrunk = halve_until_valid(lambda b: p + b * g, lambda n: n > 0, 1.0, like=p)
    # element 1 valid at b = 1/4; element 2 first at b = 2^-7
    assert b.dtype == dtype and torch.equal(b, torch.tensor([1.0, 0.25, 2.0**-7], dtype=dtype))
    assert bool(ok.all()) and torch.allclose(new, p + b * g)
    assert shrunk == 2 + 2 + 5 * 1
