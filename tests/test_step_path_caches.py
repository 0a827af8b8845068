"""The per-step path's caches and shortcuts give what they replace, in both dtypes, and fall
back where they do not apply: :func:`model_state` with its skip list of values that name no
data (a fresh scan gives the same key; a global rebound to data is seen); ``sync_parameters``'
look at the last sync's tensors (a store replaced or loaded between steps is seen, and the
guide's module follows it); ``stored`` (the store's own value, a constrained one through its
transform); the ELBO's sum without the leading zero (the same number and dtype, ``-0.0`` made
``+0.0``); the transaction's step counter kept as a number (rolled back exactly); ``unwrap``'s
known plain types; SVI capturing the site parameters (not the counter); no reference cycle
per step."""

import copy
import gc
import types

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks import stored
from pyro_cvi.blocks.constant_terms import elbo_terms
from pyro_cvi.context import StepContext
from pyro_cvi.guide_state import _SYNCED
from pyro_cvi.model import signature
from pyro_cvi.model.signature import model_state
from pyro_cvi.model.tracing import _UNWRAPPED, unwrap
from pyro_cvi.statespace import Matern32, markov_gp
from pyro_cvi.transaction import Transaction

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def _gp(dtype, T=30):
    t = torch.arange(T, dtype=dtype)
    y = torch.poisson(torch.exp(torch.sin(t / 5.0)), generator=torch.Generator().manual_seed(0))

    def model(t, y):
        f = markov_gp("x", t, Matern32(lengthscale=5.0, variance=1.0))
        with pyro.plate("t", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

    return model, (t, y.to(dtype))


def _run(model, data, steps):
    pyro.clear_param_store()
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    return guide, svi, [svi.step(*data) for _ in range(steps)]


# ------------------------------------------------------------------ model_state
def _helper_scale():
    return SCALE


SCALE = torch.ones(3)
Thing = type("Thing", (), {})


def _model(x):
    _helper_scale()
    pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0))
    return len(x), Thing, torch, dist.Normal


@DTYPES
def test_model_state_with_skipped_values_is_a_fresh_scans_key(dtype):
    x = torch.zeros(3, dtype=dtype)
    first = model_state(_model, (x,), {})  # (fills the skip list: modules, classes, builtins)
    assert any(v is Thing for v in signature._INERT.values())
    again = model_state(_model, (x,), {})
    signature._INERT.clear()
    signature._CODE_NAMES.clear()
    fresh = model_state(_model, (x,), {})
    assert first == again == fresh
    assert first.key[0][0][2] == 0 and first.key[1][0] == dtype  # (x: version, dtype)
    x.add_(1.0)  # data changed in place: seen
    assert model_state(_model, (x,), {}) != fresh
    global SCALE
    key, old = model_state(_model, (x,), {}), SCALE
    SCALE = torch.zeros(3, dtype=dtype)  # a global of the model's helper rebound: seen
    try:
        assert model_state(_model, (x,), {}) != key
    finally:
        SCALE = old
    assert model_state(_model, (x,), {}) == key


def test_a_parameter_names_no_data_in_model_state():
    p = torch.nn.Parameter(torch.zeros(2))  # (a global of the helper: skipped, not scanned)
    helper = types.FunctionType(_helper_scale.__code__, {"SCALE": p})
    model = types.FunctionType(_model.__code__, {**_model.__globals__, "_helper_scale": helper})
    key = model_state(model, (torch.zeros(1),), {}).key[0]
    assert [k[0] for k in key] == ["args[0]"]


# ------------------------------------------------------------------ sync_parameters
@DTYPES
def test_a_store_loaded_between_steps_is_seen(dtype):
    model, data = _gp(dtype)
    guide, svi, _ = _run(model, data, 3)
    saved = copy.deepcopy(pyro.get_param_store().get_state())  # (new tensors when loaded)
    more = [svi.step(*data) for _ in range(2)]
    assert guide.__dict__.get(_SYNCED) is not None  # (the look-only path is armed)
    pyro.get_param_store().set_state(saved)
    assert svi.step(*data) == more[0]  # the loaded values are the ones stepped
    store = pyro.get_param_store()
    assert dict(guide.named_parameters())["sites.y"] is store._params["AutoCVI.sites.y"]


@DTYPES
def test_a_value_changed_in_place_between_steps_is_used(dtype):
    model, data = _gp(dtype)
    guide, svi, _ = _run(model, data, 3)
    saved = copy.deepcopy(pyro.get_param_store().get_state())
    svi.step(*data)
    with torch.no_grad():  # (the same tensor, other values: no sync needed, and none done)
        pyro.param("AutoCVI.sites.y").copy_(saved["params"]["AutoCVI.sites.y"])
        pyro.param("AutoCVI.num_steps").copy_(saved["params"]["AutoCVI.num_steps"])
    again = svi.step(*data)
    pyro.get_param_store().set_state(saved)  # (new tensors: a full sync)
    assert svi.step(*data) == again


# ------------------------------------------------------------------ stored, unwrap
@DTYPES
def test_stored_is_the_stores_value(dtype):
    pyro.clear_param_store()
    pyro.param("u", torch.arange(3, dtype=dtype))
    pyro.param("p", torch.ones(3, dtype=dtype), constraint=dist.constraints.positive)
    store = pyro.get_param_store()
    assert stored("u") is store._params["u"] and stored("u").unconstrained() is stored("u")
    assert torch.equal(stored("p"), store["p"]) and stored("p") is not store._params["p"]
    store._params["u"].__dict__.pop("unconstrained")  # (never handed out: the store's path)
    assert stored("u") is store._params["u"] and stored("u").unconstrained() is stored("u")
    with pytest.raises(KeyError):
        stored("missing")


def test_unwrap_of_a_known_plain_type_and_of_wrappers():
    base = dist.Normal(torch.zeros(3), 1.0)
    assert unwrap(base) == (base, None, 0) and type(base) in _UNWRAPPED
    assert unwrap(base) == (base, None, 0)
    mask = torch.tensor([True, False, True])
    fn, m, nd = unwrap(base.mask(mask).to_event(1))
    assert fn is base and torch.equal(m, mask) and nd == 1
    assert dist.Independent not in _UNWRAPPED and dist.MaskedDistribution not in _UNWRAPPED


# ------------------------------------------------------------------ the ELBO's sum
class _Terms:
    def __init__(self, value):
        self.value = value

    def messages(self, ctx):
        return self.value


class _Analysis:
    owner = {"y": "x"}  # (no constant factor)


def _ctx():
    return StepContext(model=None, args=(), kwargs={})


@pytest.mark.parametrize(
    "terms,default",
    [
        ((1.5, -2.25), torch.float32),
        ((-0.0, -0.0), torch.float32),  # (0 + -0.0 is +0.0)
        ((0.0, -0.0), torch.float64),
        ((1e-30, 3.0), torch.float64),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_elbo_terms_are_the_sum_from_zero(terms, default, dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        blocks = [_Terms(torch.tensor(v, dtype=dtype)) for v in terms]
        want = torch.zeros(())
        for b in blocks:
            want = want + b.messages(None)
        ctx = _ctx()
        got = elbo_terms(_Analysis(), ctx, blocks)
    finally:
        torch.set_default_dtype(old)
    assert got.dtype == want.dtype
    assert torch.equal(got, want) and str(float(got)) == str(float(want))  # (the zero's sign)
    assert str(ctx.elbo) == str(float(want))


# ------------------------------------------------------------------ the transaction
@DTYPES
def test_the_step_counter_is_rolled_back_exactly(dtype):
    model, data = _gp(dtype)
    guide, svi, _ = _run(model, data, 2)
    store = pyro.get_param_store()
    before = {k: store._params[k].detach().clone() for k in store.keys()}
    txn = Transaction(guide)
    assert isinstance(txn.params["AutoCVI.num_steps"], float)
    with torch.no_grad():
        for k in store.keys():
            store._params[k].add_(0.25)
    txn.rollback()
    for k in store.keys():
        assert store._params[k].dtype == before[k].dtype
        assert torch.equal(store._params[k], before[k])


# ------------------------------------------------------------------ SVI's capture, cycles
@DTYPES
def test_svi_captures_the_site_parameters_and_no_context_cycle(dtype):
    model, data = _gp(dtype)
    guide, svi, _ = _run(model, data, 2)
    with pyro.poutine.trace(param_only=True) as tr:
        CVI_ELBO().loss_and_grads(model, guide, *data)
    assert set(tr.trace.nodes) == {"AutoCVI.sites.y"}
    svi.optim([pyro.param("AutoCVI.sites.y").unconstrained()])  # (the pending step)
    gc.collect()
    flags = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(3):
            svi.step(*data)
        gc.collect()
        cycles = [o for o in gc.garbage if isinstance(o, StepContext)]
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
    assert cycles == []
