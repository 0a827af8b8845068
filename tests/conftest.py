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
    """Every test starts from an empty param store, a fixed seed and Pyro's effect stack and plate
    dimensions as they were (a handler a test left entered would run in every later model; a
    plate dimension left allocated moves every later plate); a leak is reported in
    ``$PYRO_CVI_STACK_LEAKS`` when that names a file."""
    from pyro.poutine.runtime import _DIM_ALLOCATOR, _PYRO_STACK

    # a handler left by something outside any test (a fixture's teardown, a finalizer) goes too
    foreign = [m for m in _PYRO_STACK if type(m).__name__ != "SiteObserver"]
    if foreign:
        _report_leak(f"before {request.node.nodeid}", foreign)
        for m in foreign:
            _PYRO_STACK.remove(m)
    if any(n is not None for n in _DIM_ALLOCATOR._stack):
        _report_leak(f"before {request.node.nodeid}: plate dims {_DIM_ALLOCATOR._stack}", [])
        _DIM_ALLOCATOR._stack.clear()
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
    if any(n is not None for n in _DIM_ALLOCATOR._stack):
        _report_leak(f"{request.node.nodeid}: plate dims {_DIM_ALLOCATOR._stack}", [])
        _DIM_ALLOCATOR._stack.clear()


def _report_leak(where, handlers):
    path = os.environ.get("PYRO_CVI_STACK_LEAKS")
    if path:
        with open(path, "a") as f:
            f.write(f"{where}: {[type(m).__name__ for m in handlers]}\n")


def _watch_plate_exits():
    """With ``$PYRO_CVI_STACK_LEAKS`` set: a plate that leaves Pyro's effect stack at its exit
    without being popped (its dimension freed, its frame still added to every later site) is
    reported with the call stack that exited it."""
    import traceback

    from pyro.poutine.indep_messenger import IndepMessenger
    from pyro.poutine.runtime import _PYRO_STACK

    exit_ = IndepMessenger.__exit__

    def __exit__(self, *args):
        try:
            return exit_(self, *args)
        finally:
            if self in _PYRO_STACK:
                where = "".join(traceback.format_stack(limit=25))
                _report_leak(f"plate {self.name!r} still on the stack after its exit\n{where}", [])

    IndepMessenger.__exit__ = __exit__


if os.environ.get("PYRO_CVI_STACK_LEAKS"):
    _watch_plate_exits()


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
