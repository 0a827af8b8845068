"""The last ``CVI()`` garbage-collected in the middle of a model run changes no site: the
observer at the bottom of Pyro's stack goes idle and leaves the stack only once nothing is
above it (removing it while ``apply_stack`` walks the stack shifts the walk, and the handler
being processed - a plate - runs twice: two frames at one dim, Pyro's "dim collision")."""

import gc

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.poutine.runtime import _PYRO_STACK
from pyro.util import check_site_shape

from pyro_cvi import CVI
from pyro_cvi.natgrad import observe

DTYPES = [torch.float32, torch.float64]


class CollectingPlate(pyro.plate):
    """A plate during whose message handling a garbage collection runs (as one may at any
    allocation)."""

    def _process_message(self, msg):
        gc.collect()
        return super()._process_message(msg)


def _unreachable_cvi():
    """The only ``CVI()`` alive, reachable only through a reference cycle (freed by the next
    collection, not at once)."""
    gc.collect()
    opt = CVI()
    cycle = [opt]
    opt._cycle = cycle
    assert observe._STATE["users"] == 1


def _model(y):
    loc = pyro.sample("loc", dist.Normal(y.new_zeros(()), 1.0))
    with CollectingPlate("data", len(y)):
        pyro.sample("y", dist.Normal(loc, 1.0), obs=y)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_a_cvi_collected_inside_a_plate_adds_its_frame_once(dtype):
    y = torch.tensor([0.3, -1.2, 2.0], dtype=dtype)
    _unreachable_cvi()
    trace = poutine.trace(_model).get_trace(y)
    assert observe._STATE["users"] == 0  # the collection did run inside the plate
    site = trace.nodes["y"]
    assert [f.name for f in site["cond_indep_stack"]] == ["data"]
    trace.compute_log_prob()
    check_site_shape(site, max_plate_nesting=1)
    exact = dist.Normal(trace.nodes["loc"]["value"], 1.0).log_prob(y).sum()
    assert torch.equal(site["log_prob_sum"], exact)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_the_idle_observer_leaves_the_stack_and_a_new_cvi_trains(dtype):
    y = torch.tensor([0.3, -1.2, 2.0], dtype=dtype)
    _unreachable_cvi()
    poutine.trace(_model).get_trace(y)
    assert all(type(m).__name__ == "SiteObserver" for m in _PYRO_STACK)
    pyro.sample("bare", dist.Normal(torch.zeros((), dtype=dtype), 1.0))  # nothing above it
    assert not any(type(m).__name__ == "SiteObserver" for m in _PYRO_STACK)
    # a new CVI() puts it back and steps exactly as Adam's loss sees it: the conjugate
    # posterior of loc (prior N(0, 1), three unit-variance observations)
    pyro.clear_param_store()

    def model(y):
        loc = pyro.sample("loc", dist.Normal(y.new_zeros(()), 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal(loc, 1.0), obs=y)

    guide = AutoNormal(model)
    svi = SVI(model, guide, CVI(), Trace_ELBO())
    for _ in range(300):
        svi.step(y)
    assert any(type(m).__name__ == "SiteObserver" for m in _PYRO_STACK)
    mean, sd = float(y.sum() / 4), 0.5
    loc, scale = guide.locs.loc.item(), guide.scales.loc.item()
    assert abs(loc - mean) < 0.05 and abs(scale - sd) < 0.05
