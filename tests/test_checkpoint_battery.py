"""A battery of bad checkpoints: every file that is not a complete checkpoint of this run is
refused with a CheckpointError naming the file and the problem, the run is untouched and the
guide steps on exactly as if the load had never been tried; Pyro's guides resume bit for bit
with or without a call before loading; an optimizer of another kind is refused."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer import autoguide as ag

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, CheckpointError
from pyro_cvi.checkpoints.checkpoint import load_checkpoint, save_checkpoint

DTYPES = [torch.float32, torch.float64]


def _data(dtype, N=40):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, 3, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(X[:, 0] - X[:, 1]), generator=g)
    return X.to(dtype), y.to(dtype)


def logreg(X, y=None):
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def regression(X, y=None):
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    s = pyro.sample("s", dist.LogNormal(X.new_tensor(0.0), 1.0))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(X @ w, s), obs=y)


def _good(tmp_path, dtype):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide, optim = AutoCVI(logreg), CVI(step_size=0.5)
    svi = SVI(logreg, guide, optim, loss=CVI_ELBO())
    for _ in range(2):
        svi.step(*_data(dtype))
    path = tmp_path / "good.pt"
    save_checkpoint(path, optim, guide)
    return path


def _write(kind, good, tmp_path):
    """A file that is not a complete checkpoint of this run, and the problem to be named."""
    path = tmp_path / f"{kind}.pt"
    raw = good.read_bytes()
    state = torch.load(good, weights_only=True)
    if kind == "truncated-half":
        path.write_bytes(raw[: len(raw) // 2])
        return path, "truncated"
    if kind == "truncated-tail":  # only the last bytes of the archive's end record are cut
        path.write_bytes(raw[:-10])
        return path, "truncated"
    if kind == "empty":
        path.write_bytes(b"")
        return path, "empty, 0 bytes"
    if kind == "directory":
        path.mkdir()
        return path, "it is a directory"
    if kind == "text":
        path.write_text("step,loss\n1,52.3\n")
        return path, "not a torch file"
    if kind == "tensor":
        torch.save(torch.ones(3), path)
        return path, "holds a Tensor without the entry format"
    if kind == "state-dict":
        torch.save(torch.nn.Linear(2, 2).state_dict(), path)
        return path, "holds a OrderedDict without the entry format"
    if kind == "list":
        torch.save([1, 2, 3], path)
        return path, "holds a list without the entry format"
    if kind == "bad-optim":
        torch.save({**state, "optim": {"__cvi__": "seven"}}, path)
        return path, "CVI optimizer state is malformed"
    if kind == "bad-guide":
        torch.save({**state, "guide": {**state["guide"], "sites": {"w": 3}}}, path)
        return path, "site signature is malformed"
    if kind == "bad-rng":
        torch.save({**state, "rng": {**state["rng"], "torch": torch.zeros(3)}}, path)
        return path, "torch RNG state"
    raise AssertionError(kind)


KINDS = [
    "truncated-half",
    "truncated-tail",
    "empty",
    "directory",
    "text",
    "tensor",
    "state-dict",
    "list",
    "bad-optim",
    "bad-guide",
    "bad-rng",
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_file_is_refused_and_the_run_goes_on(kind, dtype, tmp_path):
    good = _good(tmp_path, dtype)
    bad, problem = _write(kind, good, tmp_path)
    data = _data(dtype)

    def run(try_bad):
        pyro.clear_param_store()
        pyro.set_rng_seed(1)
        guide, optim = AutoCVI(logreg), CVI(step_size=0.5)
        svi = SVI(logreg, guide, optim, loss=CVI_ELBO())
        losses = [svi.step(*data)]
        if try_bad:
            with pytest.raises(CheckpointError) as e:
                load_checkpoint(bad, optim, guide)
            assert str(bad) in str(e.value) and problem in str(e.value), str(e.value)
        losses += [svi.step(*data) for _ in range(2)]
        return losses, guide.posterior("w").mean

    (clean, mean), (after, mean_after) = run(False), run(True)
    assert after == clean and torch.equal(mean, mean_after)


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


def _pyro_run(guide_cls, optim_fn, dtype, tmp_path, called, steps=4, save_guide=True):
    """Losses of an uninterrupted run after its checkpoint, and of a fresh process-like
    resume from it (a new guide and optimizer, the param store cleared)."""
    data = _data(dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide, optim = guide_cls(regression), optim_fn()
    svi = SVI(regression, guide, optim, loss=Trace_ELBO())
    for _ in range(steps):
        svi.step(*data)
    save_checkpoint(tmp_path / "run.pt", optim, guide if save_guide else None)
    uninterrupted = [svi.step(*data) for _ in range(steps)]
    final = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    pyro.clear_param_store()
    pyro.set_rng_seed(123)  # the restored generators must replace whatever state is live
    guide, optim = guide_cls(regression), optim_fn()
    if called:
        guide(*data)
    load_checkpoint(tmp_path / "run.pt", optim, guide)
    svi = SVI(regression, guide, optim, loss=Trace_ELBO())
    resumed = [svi.step(*data) for _ in range(steps)]
    now = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    return uninterrupted, resumed, final, now


GUIDES = ["AutoNormal", "AutoDiagonalNormal", "AutoMultivariateNormal"]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("called", [False, True], ids=["fresh", "called"])
@pytest.mark.parametrize("guide_name", GUIDES)
def test_cvi_on_a_pyro_guide_resumes_bit_identically(guide_name, called, dtype, tmp_path):
    """With or without ``guide(...)`` before loading (an ``nn.Parameter`` attribute of a guide
    that ran is pointed at the restored tensor; before: AutoMultivariateNormal's ``loc`` kept
    the fresh value and the losses went another way)."""
    run = _pyro_run(getattr(ag, guide_name), CVI, dtype, tmp_path, called)
    uninterrupted, resumed, final, now = run
    assert resumed == uninterrupted
    assert final.keys() == now.keys() and all(torch.equal(final[k], now[k]) for k in final)


@pytest.mark.parametrize("optim_name", ["Adam", "ClippedAdam"])
def test_a_pyro_optimizer_resumes_bit_identically_too(optim_name, tmp_path):
    optim_fn = lambda: getattr(pyro.optim, optim_name)({"lr": 0.05})  # noqa: E731
    for guide_name in ("AutoNormal", "AutoMultivariateNormal"):
        uninterrupted, resumed, _, _ = _pyro_run(
            getattr(ag, guide_name), optim_fn, torch.float64, tmp_path, True
        )
        assert resumed == uninterrupted, guide_name


@pytest.mark.parametrize(
    "saved, loader, match",
    [
        ("CVI", "Adam", r"written with a CVI optimizer, but got Adam.*CVI\(\.\.\.\)"),
        ("CVI", "SGD", r"written with a CVI optimizer, but got SGD"),
        ("Adam", "CVI", r"written with a Adam optimizer, but got CVI.*pyro\.optim\.Adam"),
        ("Adam", "SGD", r"written with a Adam optimizer, but got SGD"),
        ("SGD", "Adam", r"written with a SGD optimizer, but got Adam"),
    ],
)
def test_an_optimizer_of_another_kind_is_refused(saved, loader, match, tmp_path):
    def make(kind):
        return CVI() if kind == "CVI" else getattr(pyro.optim, kind)({"lr": 0.01})

    data = _data(torch.float64)
    pyro.clear_param_store()
    guide, optim = ag.AutoNormal(regression), make(saved)
    SVI(regression, guide, optim, loss=Trace_ELBO()).step(*data)
    save_checkpoint(tmp_path / "run.pt", optim, guide)
    pyro.clear_param_store()
    guide, optim = ag.AutoNormal(regression), make(loader)
    svi = SVI(regression, guide, optim, loss=Trace_ELBO())
    svi.step(*data)
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(tmp_path / "run.pt", optim, guide)
    assert all(torch.equal(before[k], v) for k, v in pyro.get_param_store().items())
    assert torch.isfinite(torch.tensor(svi.step(*data)))


@pytest.mark.parametrize(
    "saved, loader, match",
    [
        ("AutoNormal", "AutoMultivariateNormal", "holds a AutoNormal guide but got"),
        ("AutoMultivariateNormal", "AutoNormal", "holds a AutoMultivariateNormal guide"),
        ("AutoNormal", "AutoCVI", "holds guide 'AutoNormal' but got AutoCVI"),
        ("AutoCVI", "AutoNormal", "holds an AutoCVI guide 'AutoCVI' but got AutoNormal"),
        ("AutoNormal", "AutoNormal-other-data", r"parameter 'AutoNormal\.locs\.w' has shape"),
    ],
)
def test_a_guide_of_another_kind_or_shape_is_refused(saved, loader, match, tmp_path):
    def make(kind, X):
        if kind == "AutoCVI":
            return AutoCVI(regression), CVI_ELBO()
        return getattr(ag, kind.split("-")[0])(regression), Trace_ELBO()

    X, y = _data(torch.float64)
    pyro.clear_param_store()
    guide, loss = make(saved, X)
    optim = CVI()
    SVI(regression, guide, optim, loss=loss).step(X, y)
    save_checkpoint(tmp_path / "run.pt", optim, guide)
    pyro.clear_param_store()
    X2 = torch.cat([X, X[:, :1]], -1) if loader.endswith("other-data") else X
    guide, loss = make(loader, X2)
    optim = CVI()
    svi = SVI(regression, guide, optim, loss=loss)
    svi.step(X2, y)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(tmp_path / "run.pt", optim, guide)
    assert torch.isfinite(torch.tensor(svi.step(X2, y)))
