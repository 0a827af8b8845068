"""Quiet by default: with ``AutoCVI(model)``, ``CVI()`` and ``CVI_ELBO()`` every step event is
shown at most once per (site, kind) in a run, while every occurrence is counted on the guide
(``guide.warning_counts``; shrunk/rejected elements in ``guide.num_shrunk`` /
``guide.num_rejected``, undone steps in ``guide.num_backtracks``). Routine events (shrunk,
undone and rejected steps) are logged at INFO to the ``pyro_cvi`` logger, never warned, so a
suite that turns warnings into errors (Pyro's own) runs; only a site whose step keeps being
rejected (``PERSISTENT`` steps of a run) is a ``RuntimeWarning``."""

import collections
import logging
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from zoo import ZOO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.step_control import PERSISTENT, WarningLog, warn_step_counts
from pyro_cvi.update import StepCounts

# models whose first steps shrink or undo steps on several sites, repeatedly
NOISY = ["hierarchical_logistic", "lda", "eight_schools_centered"]


def _keys(messages):
    """(site, kind) of a step warning, read off its text."""
    out = []
    for m in messages:
        text = str(m)
        if "shrunk from" in text:
            out.append((text.split("'")[1], "step shrunk"))
        elif "rejected for some" in text:
            out.append((text.split("'")[1], "step rejected"))
        elif "it was undone" in text:
            out.append((text.split("[")[1].split("]")[0], "step undone"))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", NOISY)
def test_one_warning_per_site_and_kind(name, dtype, caplog):
    entry = ZOO[name]
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    data = entry.data(dtype)
    model, guide_kwargs = entry.build(dtype)
    guide = AutoCVI(model, **guide_kwargs)
    svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
    with caplog.at_level(logging.INFO, logger="pyro_cvi"):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")  # defeat Python's own once-per-text filter
            for _ in range(15):
                svi.step(*data.args, **data.kwargs)
    warned = [r.message for r in record if str(r.message).startswith("AutoCVI:")]
    assert not _keys(warned), warned  # routine: logged
    logged = [r.message for r in caplog.records if r.message.startswith("AutoCVI:")]
    step_warnings = warned + logged
    shown = collections.Counter(_keys(step_warnings))
    assert len(shown) == len(step_warnings), step_warnings
    assert all(v == 1 for v in shown.values()), shown
    counts = guide.warning_counts
    # every warning shown is counted, and the counts are at least the number shown
    assert len(counts) == len(step_warnings)
    assert sum(counts.values()) >= len(step_warnings)
    if any("shrunk" in k for _, k in counts):
        assert guide.num_shrunk > 0


def test_a_rejected_step_is_logged_and_counted_not_warned(caplog):
    """A rejected step (the step policy keeping q valid) under warnings-as-errors: no error,
    one INFO record per site, every occurrence counted; a site rejected in ``PERSISTENT``
    steps is warned about once."""
    log = WarningLog()
    with caplog.at_level(logging.INFO, logger="pyro_cvi"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(PERSISTENT - 1):
                warn_step_counts("p", "Beta", 0.5, StepCounts(0, 2), stacklevel=2, log=log)
    records = [r.message for r in caplog.records if "rejected for some" in r.message]
    assert len(records) == 1 and "'p'" in records[0]
    assert log.counts == {("p", "step rejected"): PERSISTENT - 1}
    with pytest.warns(RuntimeWarning, match=f"'p' rejected for some elements in {PERSISTENT}"):
        warn_step_counts("p", "Beta", 0.5, StepCounts(0, 2), stacklevel=2, log=log)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        warn_step_counts("p", "Beta", 0.5, StepCounts(0, 2), stacklevel=2, log=log)


def angle():
    """A non-reparameterisable latent (VonMises has no rsample) observed through a Normal: its
    adaptive steps are undone now and then (the step policy at work)."""
    one = torch.ones(())
    a = pyro.sample("a", dist.VonMises(0.0 * one, 2.0 * one))
    pyro.sample("o", dist.Normal(a, one), obs=0.5 * one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_a_non_reparameterisable_site_steps_quietly_under_warnings_as_errors(dtype):
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoCVI(angle)
        svi = SVI(angle, guide, CVI(), loss=CVI_ELBO())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            losses = [svi.step() for _ in range(50)]
    finally:
        torch.set_default_dtype(default)
    assert guide.num_backtracks > 0  # the step policy was at work, quietly
    assert all(torch.isfinite(torch.tensor(losses)))
    assert guide.posterior("a").loc.dtype == dtype
