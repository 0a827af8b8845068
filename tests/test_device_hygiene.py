"""The library follows the data's device: no tensor of more than one element is made on the
default device, and the engine's trial runs of a model cannot trip a GPU's device-side assert.

A GPU check (``scripts/check_device.py`` on a machine with one) found both kinds of fault; these
tests keep them out on a machine without a GPU: a ``TorchFunctionMode`` records every factory
call made from ``pyro_cvi`` without a ``device`` (a CPU tensor beside CUDA data), and the
trial runs' index guard is forced on so that its fallback is exercised on the CPU."""

import sys

import pyro
import pytest
import torch
from pyro.infer import SVI
from torch.overrides import TorchFunctionMode
from zoo import ZOO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks import remainder_joint
from pyro_cvi.model.index_guard import TrialIndexError, checked_indexing

FACTORIES = {
    torch.tensor, torch.zeros, torch.ones, torch.eye, torch.arange, torch.full, torch.empty,
    torch.linspace, torch.randn, torch.rand, torch.randint, torch.randperm, torch.as_tensor,
}  # fmt: skip


class _FactoryAudit(TorchFunctionMode):
    """Records ``file:line`` of ``pyro_cvi`` factory calls without a device whose result has
    more than one element (a 0-dim CPU tensor is a scalar to every device's operations)."""

    def __init__(self):
        super().__init__()
        self.hits = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in FACTORIES and kwargs.get("device") is None and torch.is_tensor(out):
            copy_of_tensor = func is torch.as_tensor and args and torch.is_tensor(args[0])
            if out.dim() > 0 and not copy_of_tensor:
                f = sys._getframe(1)
                while f is not None and "/torch/" in f.f_code.co_filename:
                    f = f.f_back
                if f is not None and "pyro_cvi" in f.f_code.co_filename:
                    self.hits.add(f"{f.f_code.co_filename.split('pyro_cvi')[-1]}:{f.f_lineno}")
        return out


#: one model of each block kind (conjugate pairs, GLM sites, natural-form Monte Carlo blocks,
#: mixtures, Markov and scaled chains, bilinear, the remainder under Price and one draw, ...)
MODELS = [
    ("coin", torch.float64), ("bayesian_regression", torch.float32), ("bnn", torch.float64),
    ("eight_schools_noncentered", torch.float32), ("baseball", torch.float64),
    ("gaussian_mixture", torch.float64), ("lda", torch.float32), ("hmm", torch.float64),
    ("sparse_gamma_def", torch.float32), ("ppca", torch.float64), ("local_level", torch.float32),
    ("stochastic_volatility", torch.float64), ("exchangeable_mixture", torch.float32),
    ("hmm_gaussian", torch.float64), ("linear_regression", torch.float32),
    ("poisson_changepoint", torch.float64), ("radon_varying_slope", torch.float32),
]  # fmt: skip


def _fit(name, dtype, steps):
    entry = ZOO[name]
    model, kwargs = entry.build(dtype)
    data = entry.data(dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model, **kwargs)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    return [svi.step(*data.args, **data.kwargs) for _ in range(steps)]


@pytest.mark.parametrize("name,dtype", MODELS, ids=[m for m, _ in MODELS])
def test_no_tensor_on_the_default_device(name, dtype):
    audit = _FactoryAudit()
    with audit:
        _fit(name, dtype, 2)
    assert not audit.hits, f"{name}: tensors made without a device at {sorted(audit.hits)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_checked_indexing_raises_before_the_operation(dtype):
    x = torch.arange(12, dtype=dtype).reshape(4, 3)
    with checked_indexing(torch.device("cpu"), always=True):
        assert x[torch.tensor([0, 3])].shape == (2, 3)
        assert x[..., torch.tensor([2])].shape == (4, 1)
        assert x[:, None, torch.tensor([1])].shape == (4, 1, 1)
        assert x[torch.tensor([True, False, True, False])].shape == (2, 3)
        for bad in (
            lambda: x[torch.tensor([4])],
            lambda: x[..., torch.tensor([3])],
            lambda: x[torch.tensor([-5])],
            lambda: x.index_select(1, torch.tensor([5])),
            lambda: x.gather(0, torch.tensor([[7]])),
            lambda: x.take(torch.tensor([12])),
        ):
            with pytest.raises(TrialIndexError, match="out of range"):
                bad()
    with checked_indexing(torch.device("cpu")):  # (off on the CPU: the native error)
        with pytest.raises(IndexError) as info:
            x[torch.tensor([4])]
        assert not isinstance(info.value, TrialIndexError)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_trial_that_indexes_out_of_range_falls_back_as_on_the_cpu(monkeypatch, dtype):
    """radon's batched trial run indexes a latent by county along the particle dimension: out
    of range. With the guard forced on (as on a GPU) the trial raises before the operation and
    the fit is the same as with the native error, bit for bit."""
    plain = _fit("radon_varying_slope", dtype, 3)
    raised = []

    def forced(device, trial=True, always=False):
        guard = checked_indexing(device, trial=trial, always=trial)

        class _Spy:
            def __enter__(self):
                return guard.__enter__()

            def __exit__(self, *exc):
                if exc[0] is not None and issubclass(exc[0], TrialIndexError):
                    raised.append(exc[1])
                return guard.__exit__(*exc)

        return _Spy()

    monkeypatch.setattr(remainder_joint, "checked_indexing", forced)
    guarded = _fit("radon_varying_slope", dtype, 3)
    assert raised, "the guard did not see the out-of-range trial"
    assert guarded == plain


@pytest.mark.parametrize("spelling", ["cumsum", "loop"])
def test_no_tensor_on_the_default_device_in_the_kalman_chains(spelling):
    """The scaled chain's two finders (a plate-and-cumsum walk and a ``pyro.markov`` loop
    beside latent scales, past the joint's 64 coordinates), with their set-up probes."""
    import test_scaled_walk as walks

    y = walks.data(70, torch.float32 if spelling == "cumsum" else torch.float64)
    model = walks.walk if spelling == "cumsum" else walks.loop
    audit = _FactoryAudit()
    with audit:
        guide, svi = walks.setup(model, y)
        svi.step(y)
        svi.step(y)
    assert walks._chain(guide) is not None  # (the Kalman block, not the joint)
    assert not audit.hits, f"{spelling}: tensors made without a device at {sorted(audit.hits)}"
