"""Every zoo model (``tests/zoo``) runs through ``AutoCVI`` + ``CVI`` + ``CVI_ELBO``, and the loss
``svi.step`` returns is the bound of the guide's current ``q``: it matches an independent
large-sample ``Trace_ELBO`` estimate of the same guide within its standard error (the harness of
``test_loss_is_bound.py``; ``TraceEnum_ELBO`` where the guide leaves discrete sites to the
model's enumeration). A few steps suffice: the check holds at any ``q``.
"""

import math
import warnings

import pyro.poutine as poutine
import pytest
from pyro.infer import SVI, Trace_ELBO, TraceEnum_ELBO
from test_loss_is_bound import assert_loss_is_bound
from zoo import ZOO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.tracing import is_random

STEPS = {"coin": 3, "bayesian_regression": 10, "eight_schools_centered": 40}
# a fast selection (exact, Monte Carlo, minibatch, enumerated); the others run under slow
FAST = ("coin", "poisson_regression", "eight_schools_noncentered", "subsampled_logistic", "lda")
CASES = [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in ZOO]


def fit(entry, steps):
    data = entry.data()
    guide = AutoCVI(entry.model, **entry.guide_kwargs)
    svi = SVI(entry.model, guide, CVI(step_size=entry.step_size), loss=CVI_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # shrunk steps are counted, not errors
        losses = [svi.step(*data.args, **data.kwargs) for _ in range(steps)]
    return data, guide, svi, losses


def referee(model, guide, data):
    """Trace_ELBO when the guide samples every latent (discrete ones included), else
    TraceEnum_ELBO over the discrete sites the guide leaves to the model."""
    tr = poutine.trace(guide).get_trace(*data.args, **data.kwargs)
    model_tr = poutine.trace(poutine.replay(model, trace=tr)).get_trace(*data.args, **data.kwargs)
    missing = [
        n
        for n, s in model_tr.nodes.items()
        if is_random(s) and not s["is_observed"] and n not in tr.nodes
    ]
    return Trace_ELBO if not missing else TraceEnum_ELBO


@pytest.mark.parametrize("name", CASES)
def test_zoo_model_runs_and_its_loss_is_the_bound(name):
    entry = ZOO[name]
    data, guide, svi, losses = fit(entry, STEPS.get(name, 4))
    assert all(math.isfinite(v) for v in losses), losses
    elbo = referee(entry.model, guide, data)
    assert elbo is Trace_ELBO or entry.has_discrete
    M = 30 if name in FAST else 60
    assert_loss_is_bound(
        entry.model, guide, svi, data.args, M=M, P=10, kwargs=data.kwargs, referee=elbo
    )
