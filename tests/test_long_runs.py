"""Long runs of every stepping path (``scripts/bench/long_runs.py``): every loss finite and no
drift. Each test takes 600 steps, moves every step counter of the path on by 20,000 steps
(the warm-up exponents, moving averages and schedules that depend on the step number: an
unbounded ``grow ** t`` overflowed at step 1,751), and takes 600 more; the mean loss of the
last 500 steps must be within 1 nat of the lowest mean of any 500 consecutive steps. The full
matrix (every path, both models, both dtypes, 20,000 real steps each) is
``scripts/check_long_runs.py`` (``results/check_long_runs.json``)."""

import math

import pytest
import torch
from bench.long_runs import PATHS, run

# one (model, dtype) per path, so that both models and both dtypes are covered by CI
CASES = [
    (path, ("regression", "logistic")[i % 2], (torch.float32, torch.float64)[(i // 2) % 2])
    for i, path in enumerate(PATHS)
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "path,kind,dtype", CASES, ids=[f"{p}-{k}-{str(d)[-7:]}" for p, k, d in CASES]
)
def test_long_run_is_finite_and_does_not_drift(path, kind, dtype):
    r = run(path, kind, dtype, steps=1200, advance_at=600, advance_by=20_000, window=500)
    assert r["error"] is None, r["error"]
    assert len(r["losses"]) == 1200 and r["finite"]
    assert r["gap"] <= 1.0, (r["last"], r["best"])
    assert math.isfinite(r["last"])


def test_the_advance_moves_the_counters():
    """The fast-forward reaches the state it claims to (else the slow tests prove nothing)."""
    from bench.long_runs import _autocvi, _svi
    from pyro.infer import Trace_ELBO
    from pyro.infer.autoguide import AutoNormal

    stepper = _svi(AutoNormal, Trace_ELBO)("logistic", torch.float64)
    for _ in range(3):
        stepper.step()
    stepper.advance(20_000)
    counters = stepper._counters()
    assert counters[0][0].t == 20_003
    control = next(iter(counters[0][0].gaussians.controls.values()))
    assert control.t == 20_003 and control.prec.t == 20_003
    assert math.isfinite(stepper.step())
    stepper = _autocvi("logistic", torch.float64)
    stepper.step()
    stepper.step()
    stepper.advance(20_000)
    engine = next(iter(stepper._counters()[0][0]._live()))
    assert engine.control.t >= 20_000
    assert math.isfinite(stepper.step())
