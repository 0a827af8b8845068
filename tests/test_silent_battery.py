"""A battery of cases that used to be silently wrong: data the model reads from its closure
(inside containers, as attributes of captured objects, modules or ``nn.Module`` buffers, or of
a method's object) that changes between steps is re-analysed as new arguments would be; a
latent whose shape comes from broadcasting has a posterior of the shape of ``median()``."""

import inspect
import types

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.model.signature import MAX_ITEMS, closure_key

N = 30
DTYPES = [torch.float32, torch.float64]


def _data(dtype):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, 2, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(2 * X[:, 0] - 2 * X[:, 1]), generator=g)
    return X.to(dtype), y.to(dtype)


def _logreg(X, y):
    w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("data", N):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


class _Holder(torch.nn.Module):
    def __init__(self, X):
        super().__init__()
        self.register_buffer("X", X)


class _Data:
    def __init__(self, X):
        self.X = X

    def model(self, y):
        _logreg(self.X, y)


def _captured(kind, X):
    """A model that reads X from its closure in the way ``kind`` names, and ``(get, set)``."""
    box = {"X": X.clone()}
    lst = [X.clone()]
    ns = types.SimpleNamespace(X=X.clone())
    mod = types.ModuleType("captured_data")
    mod.X = X.clone()
    holder = _Holder(X.clone())
    nested = {"runs": [{"X": X.clone()}]}
    obj = _Data(X.clone())
    if kind == "method":
        return obj.model, (lambda: obj.X), (lambda v: setattr(obj, "X", v))
    table = {
        "dict": (lambda: box["X"], lambda v: box.__setitem__("X", v)),
        "list": (lambda: lst[0], lambda v: lst.__setitem__(0, v)),
        "namespace": (lambda: ns.X, lambda v: setattr(ns, "X", v)),
        "module": (lambda: mod.X, lambda v: setattr(mod, "X", v)),
        "buffer": (lambda: holder.X, lambda v: setattr(holder, "X", v)),
        "nested": (lambda: nested["runs"][0]["X"], lambda v: nested["runs"][0].__setitem__("X", v)),
    }

    def model(y):
        X = {
            "dict": box["X"],
            "list": lst[0],
            "namespace": ns.X,
            "module": mod.X,
            "buffer": holder.X,
            "nested": nested["runs"][0]["X"],
        }[kind]
        _logreg(X, y)

    return model, *table[kind]


KINDS = ["dict", "list", "namespace", "module", "buffer", "nested", "method"]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("how", ["rebound", "in-place"])
@pytest.mark.parametrize("kind", KINDS)
def test_closure_data_that_changes_is_seen(kind, how, dtype):
    """The fit after the change is the fit of a guide given the new data from the start (to
    rounding); before: the old data's fit, with the wrong sign of w."""
    X, y = _data(dtype)
    model, get, put = _captured(kind, X)
    pyro.clear_param_store()
    svi = SVI(model, AutoCVI(model), CVI(step_size=1.0), loss=CVI_ELBO())
    for _ in range(3):
        svi.step(y)
    if how == "in-place":
        get().mul_(-1.0)
    else:
        put(-X)
    changed = [svi.step(y) for _ in range(6)]
    w_changed = svi.guide.posterior("w").mean.detach()
    pyro.clear_param_store()
    ref_svi = SVI(_logreg, AutoCVI(_logreg, prefix="ref"), CVI(step_size=1.0), loss=CVI_ELBO())
    ref = [ref_svi.step(-X, y) for _ in range(9)]
    w_ref = ref_svi.guide.posterior("w").mean.detach()
    tol = 1e-4 if dtype == torch.float32 else 1e-9
    assert changed[-1] == pytest.approx(ref[-1], rel=tol)
    torch.testing.assert_close(w_changed, w_ref, rtol=tol, atol=tol)
    assert float(w_changed[0]) < 0 < float(w_changed[1])  # the sign flip was seen


def test_the_closure_scan_is_bounded_and_skips_parameters():
    X = torch.zeros(3, 2)
    many = [torch.zeros(2) for _ in range(10 * MAX_ITEMS)]
    deep = {"a": {"b": {"c": {"d": {"e": X}}}}}
    layer = torch.nn.Linear(2, 2)

    def model():
        return many, deep, layer.weight

    key = closure_key(model)
    assert 0 < len(key) <= MAX_ITEMS  # bounded
    assert not any(path.startswith("deep") for path, *_ in key)  # deeper than MAX_DEPTH
    assert not any(path.startswith("layer") for path, *_ in key)  # a parameter is not data


def test_a_property_of_a_captured_object_is_not_run():
    calls = []

    class Lazy:
        @property
        def X(self):
            calls.append(1)
            return torch.zeros(2)

    lazy = Lazy()

    def model():
        return lazy.X

    closure_key(model)
    assert not calls


def test_a_captured_module_is_read_as_getattr_static_reads_it():
    """A module's attributes (and a module-level ``__getattr__``, which is not run) give the
    key that ``inspect.getattr_static`` gives, also for a module subclass."""
    calls = []

    class Sub(types.ModuleType):
        pass

    plain, sub = types.ModuleType("plain_data"), Sub("sub_data")
    for i, mod in enumerate((plain, sub)):
        mod.X = torch.full((2,), float(i))
        mod.__getattr__ = lambda name: calls.append(name)

    def model():
        return plain.X, plain.Y, sub.X, sub.Y

    key = closure_key(model)
    assert not calls
    want = [
        (f"{n}.X", id(inspect.getattr_static(m, "X")), 0, (2,))
        for n, m in (("plain", plain), ("sub", sub))
    ]
    assert [k for k in key if k[0].endswith(".X")] == want
    assert not any(k[0].endswith(".Y") for k in key)
    plain.X = torch.zeros(3)
    assert closure_key(model) != key


# ------------------------------------------------------------------ broadcast latent shapes
def _shapes_model(kind):
    def model(X, y):
        one = X.new_ones(())
        if kind == "to-event":
            z = pyro.sample("z", dist.Normal(X.new_zeros(3, 1), X.new_ones(2)).to_event(2))
        elif kind == "batch":
            z = pyro.sample("z", dist.Normal(X.new_zeros(3, 1), X.new_ones(2)))
        elif kind == "in-plate":
            with pyro.plate("p", 3, dim=-2):
                z = pyro.sample("z", dist.Normal(X.new_zeros(1, 1), X.new_ones(2)))
        elif kind == "plate-last":
            with pyro.plate("p", 3, dim=-1):
                z = pyro.sample("z", dist.Normal(X.new_zeros(2, 1), one))
        elif kind == "gamma":
            z = pyro.sample("z", dist.Gamma(X.new_ones(2, 1), X.new_ones(3)).to_event(2))
        elif kind == "expand":
            z = pyro.sample("z", dist.Normal(X.new_zeros(3, 1), one).expand([3, 2]))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Normal(X[:, 0] * z.mean(), one), obs=y)

    return model


SHAPES = {
    "to-event": (3, 2),
    "batch": (3, 2),
    "in-plate": (3, 2),
    "plate-last": (2, 3),
    "gamma": (2, 3),
    "expand": (3, 2),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_a_broadcast_latent_has_a_posterior_of_the_median_shape(kind, dtype):
    X, _ = _data(dtype)
    y = X[:, 0] + 0.1
    model = _shapes_model(kind)
    pyro.clear_param_store()
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
    for _ in range(2):
        svi.step(X, y)
    q = guide.posterior("z")
    median = guide.median(X, y)["z"]
    assert tuple(median.shape) == SHAPES[kind]
    assert tuple(q.shape()) == tuple(q.mean.shape) == tuple(q.sample().shape) == SHAPES[kind]
    if kind != "gamma":  # (a Gaussian's median is its mean)
        torch.testing.assert_close(q.mean, median)
