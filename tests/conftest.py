import os

import pyro
import pytest
import torch
import torch.distributed as tdist
from bench.datasets import data_dir


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Small linear algebra is faster on one thread, and timings stay stable on shared cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _clean_param_store(request):
    """Every test starts from an empty param store, a fixed seed and Pyro's effect stack as it
    was (a handler a test left entered would run in every later model); a leak is reported in
    ``$PYRO_CVI_STACK_LEAKS`` when that names a file."""
    from pyro.poutine.runtime import _PYRO_STACK

    # a handler left by something outside any test (a fixture's teardown, a finalizer) goes too
    foreign = [m for m in _PYRO_STACK if type(m).__name__ != "SiteObserver"]
    if foreign:
        _report_leak(f"before {request.node.nodeid}", foreign)
        for m in foreign:
            _PYRO_STACK.remove(m)
    before = list(_PYRO_STACK)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    yield
    pyro.clear_param_store()
    leaked = [m for m in _PYRO_STACK if m not in before and type(m).__name__ != "SiteObserver"]
    if leaked:
        _report_leak(request.node.nodeid, leaked)
        for m in leaked:
            _PYRO_STACK.remove(m)


def _report_leak(where, handlers):
    path = os.environ.get("PYRO_CVI_STACK_LEAKS")
    if path:
        with open(path, "a") as f:
            f.write(f"{where}: {[type(m).__name__ for m in handlers]}\n")


@pytest.fixture(scope="session")
def shared_data():
    """The benchmark data folder; tests that need it are skipped when it is absent."""
    try:
        return data_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture
def one_rank_group(tmp_path):
    """A 1-process gloo group (the collectives run for real, with R = 1)."""
    store = tdist.FileStore(str(tmp_path / "store"), 1)
    tdist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    tdist.destroy_process_group()
