"""Resume is bit-identical with or without ``guide=``: a checkpoint saved and loaded with only
the optimizer (``save_checkpoint(path, optim)`` / ``load_checkpoint(path, optim)``) continues
on exactly the trajectory of the uninterrupted run for Pyro's autoguides, ``AutoCVI`` and a
hand-written guide, under ``CVI()`` and under Adam, whether the fresh guide was called before
loading or not; the same with ``guide=`` given at either end."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.distributions import constraints
from pyro.infer import SVI, Trace_ELBO
from pyro.infer import autoguide as ag

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.checkpoints.checkpoint import load_checkpoint, save_checkpoint

DTYPES = [torch.float32, torch.float64]
STEPS = 10


def _data(dtype):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(40, 3, generator=g, dtype=torch.float64)
    y = X @ torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    y = y + 0.3 * torch.randn(40, generator=g, dtype=torch.float64)
    return X.to(dtype), y.to(dtype)


def regression(X, y=None):
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    s = pyro.sample("s", dist.LogNormal(X.new_tensor(0.0), 1.0))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(X @ w, s), obs=y)


def handwritten(X, y=None):
    """A guide written by hand: Gaussian ``w``, LogNormal ``s``, each of pyro.param."""
    w_loc = pyro.param("w_loc", lambda: X.new_zeros(X.shape[1]))
    w_scale = pyro.param("w_scale", lambda: X.new_full((X.shape[1],), 0.1), constraints.positive)
    pyro.sample("w", dist.Normal(w_loc, w_scale).to_event(1))
    s_loc = pyro.param("s_loc", lambda: X.new_tensor(0.0))
    s_scale = pyro.param("s_scale", lambda: X.new_tensor(0.1), constraints.positive)
    pyro.sample("s", dist.LogNormal(s_loc, s_scale))


def _guide(name):
    if name == "AutoCVI":
        return AutoCVI(regression)
    if name == "handwritten":
        return handwritten
    return getattr(ag, name)(regression)


def _optim(name):
    return CVI() if name == "CVI" else pyro.optim.Adam({"lr": 0.05})


def _store():
    return {k: v.detach().clone() for k, v in pyro.get_param_store().items()}


CASES = [
    ("AutoNormal", "CVI"),
    ("AutoNormal", "Adam"),
    ("AutoMultivariateNormal", "CVI"),
    ("AutoMultivariateNormal", "Adam"),
    ("AutoDelta", "Adam"),
    ("AutoCVI", "CVI"),
    ("handwritten", "CVI"),
    ("handwritten", "Adam"),
]
# (guide= at save, guide= at load, the fresh guide called before loading)
MODES = {
    "none": (False, False, False),
    "none-called": (False, False, True),
    "load-only": (False, True, False),
    "save-only": (True, False, False),
    "both-called": (True, True, True),
}


def _resume(guide_name, optim_name, dtype, mode, tmp_path):
    with_save, with_load, called = MODES[mode]
    data = _data(dtype)
    loss = CVI_ELBO() if guide_name == "AutoCVI" else Trace_ELBO()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide, optim = _guide(guide_name), _optim(optim_name)
    svi = SVI(regression, guide, optim, loss=loss)
    for _ in range(4):
        svi.step(*data)
    save_checkpoint(tmp_path / "run.pt", optim, guide if with_save else None)
    uninterrupted = [svi.step(*data) for _ in range(STEPS)]
    final = _store()
    del svi, guide, optim
    pyro.clear_param_store()
    pyro.set_rng_seed(123)  # the restored generators must replace whatever state is live
    guide, optim = _guide(guide_name), _optim(optim_name)
    if called:
        with pyro.poutine.block():
            guide(*data)
    load_checkpoint(tmp_path / "run.pt", optim, guide if with_load else None)
    svi = SVI(regression, guide, optim, loss=loss)
    resumed = [svi.step(*data) for _ in range(STEPS)]
    return uninterrupted, resumed, final, _store()


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("guide_name,optim_name", CASES, ids=[f"{g}-{o}" for g, o in CASES])
def test_resume_is_bit_identical_with_or_without_the_guide(
    guide_name, optim_name, mode, dtype, tmp_path
):
    uninterrupted, resumed, final, now = _resume(guide_name, optim_name, dtype, mode, tmp_path)
    assert resumed == uninterrupted
    assert final.keys() == now.keys()
    assert all(torch.equal(final[k], now[k]) for k in final), [
        k for k in final if not torch.equal(final[k], now[k])
    ]
    assert len(set(uninterrupted)) > 1  # the run moved on: the comparison is not vacuous


def test_an_unfinished_load_does_not_touch_a_later_run(tmp_path):
    """A checkpoint loaded without ``guide=`` whose guide never ran: once the param store has
    moved on (cleared), a new guide sets itself up as in a run that never loaded anything."""
    data = _data(torch.float64)

    def first_loss():
        pyro.set_rng_seed(7)
        guide, optim = ag.AutoNormal(regression), _optim("Adam")
        return SVI(regression, guide, optim, loss=Trace_ELBO()).step(*data)

    pyro.clear_param_store()
    clean = first_loss()
    pyro.clear_param_store()
    guide, optim = ag.AutoNormal(regression), _optim("Adam")
    SVI(regression, guide, optim, loss=Trace_ELBO()).step(*data)
    save_checkpoint(tmp_path / "run.pt", optim)
    pyro.clear_param_store()
    load_checkpoint(tmp_path / "run.pt", _optim("Adam"))  # no guide ever runs on it
    pyro.clear_param_store()
    assert first_loss() == clean
