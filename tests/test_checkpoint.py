"""Safe checkpoints: no code runs on load, the file is checked before anything live
is touched, writes are atomic, and resume is bit-identical in a fresh process."""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.checkpoints.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "resume_worker.py"


def _data(N=40, D=3, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(X[:, 0] - X[:, 1]), generator=g)
    return X.to(dtype), y.to(dtype)


def logreg(X, y=None):
    b = pyro.param("b", torch.tensor(0.0, dtype=X.dtype))
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def other(X, y=None):  # other site names, same shapes
    w = pyro.sample("beta", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("obs", dist.Bernoulli(logits=X @ w), obs=y)


def _run(model=logreg, steps=3, data=None, optim=None):
    pyro.clear_param_store()
    data = _data() if data is None else data
    guide = AutoCVI(model)
    optim = CVI(step_size=0.5) if optim is None else optim
    svi = SVI(model, guide, optim, loss=CVI_ELBO())
    for _ in range(steps):
        svi.step(*data)
    return svi, guide, optim, data


def _live():
    store = pyro.get_param_store()
    return {k: store[k].detach().clone() for k in store.keys()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_round_trip_in_process_is_exact(tmp_path, dtype):
    path = tmp_path / "c.pt"
    svi, guide, optim, data = _run(data=_data(dtype=dtype))
    save_checkpoint(path, optim, guide)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]  # atomic: no leftovers
    rng = torch.get_rng_state()
    expected = [svi.step(*data) for _ in range(3)]
    after = _live()
    torch.set_rng_state(rng)
    load_checkpoint(path, optim, guide)  # into the live guide, after it moved on
    again = [svi.step(*data) for _ in range(3)]
    assert again == expected
    assert _same(after, _live())
    assert pyro.param("b").dtype == dtype and pyro.param("b").requires_grad


def test_file_holds_only_tensors_and_plain_values(tmp_path):
    path = tmp_path / "c.pt"
    _, guide, optim, _ = _run()
    save_checkpoint(path, optim, guide)
    state = torch.load(path, weights_only=True)  # would raise on any other object
    assert state["format"] == "pyro-cvi checkpoint" and state["version"] == 2
    assert state["guide"]["sites"] == {"w": [[3], False], "y": [[40], True]}
    assert read_checkpoint(path)["rng"]["numpy"][0] == "MT19937"


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_pickle_runs_no_code_and_leaves_the_run_untouched(tmp_path):
    _, guide, optim, data = _run()
    before = _live()
    marker = tmp_path / "pwned"
    payload = _Payload()
    payload.marker = marker
    bad = tmp_path / "evil.pt"
    torch.save({"format": "pyro-cvi checkpoint", "version": 2, "optim": payload}, bad)
    with pytest.raises(ValueError, match="refused by the safe loader"):
        load_checkpoint(bad, optim, guide)
    with open(tmp_path / "evil.pkl", "wb") as f:  # a plain pickle, not a torch zip
        pickle.dump(payload, f)
    with pytest.raises(ValueError, match=r"evil\.pkl"):
        load_checkpoint(tmp_path / "evil.pkl", optim, guide)
    assert not marker.exists()
    assert _same(before, _live())


@pytest.mark.parametrize(
    "content, match",
    [
        ("truncated", "truncated or not a torch file"),
        ("empty", "truncated or not a torch file"),
        ("version-only", "without the entry format"),
        ("version-1", "format-1 checkpoint of an older pyro-cvi"),
        ("version-9", "format version 9"),
        ("no-rng", "entry 'rng' is missing"),
        ("missing", "does not exist"),
    ],
)
def test_broken_files_give_a_clear_error_and_touch_nothing(tmp_path, content, match):
    good = tmp_path / "good.pt"
    _, guide, optim, data = _run()
    save_checkpoint(good, optim, guide)
    path = tmp_path / "bad.pt"
    raw = good.read_bytes()
    state = torch.load(good, weights_only=True)
    if content == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif content == "empty":
        path.write_bytes(b"")
    elif content == "version-only":
        torch.save({"version": 1}, path)
    elif content == "version-1":
        torch.save({**state, "format": None, "version": 1}, path)
    elif content == "version-9":
        torch.save({**state, "version": 9}, path)
    elif content == "no-rng":
        torch.save({k: v for k, v in state.items() if k != "rng"}, path)
    svi = SVI(logreg, guide, optim, loss=CVI_ELBO())
    svi.step(*data)
    before, t, rng = _live(), optim.t, torch.get_rng_state()
    with pytest.raises(ValueError, match=match) as e:
        load_checkpoint(path, optim, guide)
    assert "bad.pt" in str(e.value)
    assert _same(before, _live()) and optim.t == t and torch.equal(rng, torch.get_rng_state())
    svi.step(*data)  # the run goes on


def test_checkpoint_of_another_model_or_data_is_refused(tmp_path):
    path = tmp_path / "c.pt"
    _, guide, optim, data = _run()
    save_checkpoint(path, optim, guide)
    # the same site names, other data sizes
    _, guide2, optim2, data2 = _run(data=_data(N=25))
    before = _live()
    with pytest.raises(ValueError, match=r"site 'y' has shape \(40,\) in the checkpoint and \(25,"):
        load_checkpoint(path, optim2, guide2)
    assert _same(before, _live())
    # the same shapes, other sites
    _, guide3, optim3, data3 = _run(model=other)
    before = _live()
    with pytest.raises(ValueError, match=r"sites only in the checkpoint: \['w', 'y'\]"):
        load_checkpoint(path, optim3, guide3)
    assert _same(before, _live())


def test_deferred_restore_checks_the_model_at_set_up(tmp_path):
    """A guide that has not seen the model restores at its first step, after the check; a
    refused restore rolls the set-up back and is dropped: the next step trains the guide from
    its own initialisation, and loading again before a step with the right data restores."""
    path = tmp_path / "c.pt"
    _, guide, optim, data = _run()
    save_checkpoint(path, optim, guide)
    saved = _live()
    pyro.clear_param_store()
    guide = AutoCVI(logreg)
    optim = CVI(step_size=0.5)
    load_checkpoint(path, optim, guide)
    svi = SVI(logreg, guide, optim, loss=CVI_ELBO())
    with pytest.raises(CheckpointError, match=r"c\.pt.*site 'y' has shape \(40,\).*dropped"):
        svi.step(*_data(N=25))
    assert guide.prototype_trace is None and len(pyro.get_param_store().keys()) == 0
    assert guide.pending_restore is None and optim.t == 0
    load_checkpoint(path, optim, guide)
    guide(*data)  # the set-up applies the checkpoint
    assert _same(saved, _live())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_guide_steps_normally_after_a_refused_restore(tmp_path, dtype):
    """Other data and another model, refused at load time (a guide that ran) or at set-up (a
    fresh guide): the next steps are exactly those of a run that never loaded the file."""
    path = tmp_path / "c.pt"
    _, guide, optim, data = _run(data=_data(dtype=dtype))
    save_checkpoint(path, optim, guide)
    small = _data(N=25, dtype=dtype)

    def steps(model, data, warm, load):
        pyro.clear_param_store()
        pyro.set_rng_seed(3)
        guide, optim = AutoCVI(model), CVI(step_size=0.5)
        svi = SVI(model, guide, optim, loss=CVI_ELBO())
        losses = [svi.step(*data)] if warm else []
        if load:
            with pytest.raises(CheckpointError, match="another model or other data"):
                load_checkpoint(path, optim, guide)
                svi.step(*data)
        return losses + [svi.step(*data) for _ in range(3)]

    for model, d in ((logreg, small), (other, data)):
        for warm in (False, True):
            assert steps(model, d, warm, True) == steps(model, d, warm, False), (model, warm)


def test_save_refuses_state_that_a_safe_load_could_not_read(tmp_path):
    _, guide, optim, _ = _run()
    state = optim.get_state()
    optim.get_state = lambda: {**state, "scheduler": object()}
    with pytest.raises(TypeError, match="a safe checkpoint holds only tensors"):
        save_checkpoint(tmp_path / "c.pt", optim, guide)
    assert not os.listdir(tmp_path)


def _worker(kind, mode, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    out = tmp_path / f"{kind}.{mode}.pt"
    cmd = [sys.executable, "-W", "ignore", str(WORKER), kind, mode, tmp_path / "c.pt", out]
    subprocess.run(list(map(str, cmd)), check=True, env=env)
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gaussian", "montecarlo", "meanfield", "hybrid"])
def test_resume_in_a_fresh_process_is_bit_identical(kind, tmp_path):
    full = _worker(kind, "full", tmp_path)
    first = _worker(kind, "first", tmp_path)
    half = len(first["losses"])
    for mode in ("resume", "resume-called"):
        resumed = _worker(kind, mode, tmp_path)
        assert torch.equal(resumed["losses"], full["losses"][half:]), mode
        assert full["store"].keys() == resumed["store"].keys()
        for k in full["store"]:
            assert torch.equal(full["store"][k], resumed["store"][k]), (mode, k)
    moved = [k for k in full["store"] if not torch.equal(full["store"][k], first["store"][k])]
    assert moved  # the second half did change things
    if kind == "hybrid":
        assert "shift" in moved  # the learned parameter too
