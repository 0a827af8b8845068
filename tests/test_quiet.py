"""Quiet by default: with ``AutoCVI(model)``, ``CVI()`` and ``CVI_ELBO()`` every step event is
shown at most once per (site, kind) in a run, while every occurrence is counted on the guide
(``guide.warning_counts``; shrunk/rejected elements in ``guide.num_shrunk`` /
``guide.num_rejected``, undone steps in ``guide.num_backtracks``). Routine events (shrunk and
undone steps) are logged at INFO to the ``pyro_cvi`` logger, never warned; only rejected steps
are ``RuntimeWarning`` warnings."""

import collections
import logging
import warnings

import pyro
import pytest
import torch
from pyro.infer import SVI
from zoo import ZOO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

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
    assert not [k for k in _keys(warned) if k[1] != "step rejected"], warned  # routine: logged
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
