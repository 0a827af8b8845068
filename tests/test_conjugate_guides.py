"""Hand-written guides on textbook conjugate pairs (``tests/conjugate_guide_cases.py``):
``CVI()`` reaches the analytic posterior, within Pyro's own test tolerances, in at most a tenth
of the steps Pyro's Adam needs (best of lr 0.01-0.05, measured by
``scripts/benchmark_conjugate_guides.py``), in float32 and float64, and stays there: the
errors are within tolerance after every step from that budget to ``STAY_FACTOR`` times it.

The closed forms themselves are checked first: ``log p(theta, y) - log q*(theta)`` is the same
number (``log p(y)``) at every ``theta``, and each guide put at ``q*`` in its own
parameterisation has zero error. Pairs that ``CVI()`` does not reach in that budget when last
measured (none now) are marked ``xfail(strict=True)``.
"""

from __future__ import annotations

import pyro
import pyro.poutine as poutine
import pytest
import torch
from conjugate_guide_cases import BY_NAME, DTYPES, PAIRS, fit, stays
from pyro.infer import Trace_ELBO

from pyro_cvi import CVI

#: steps Pyro's Adam needs to reach the posterior and stay within tolerance for 100 more steps
#: (best lr of the grid, seed 0; ``python scripts/benchmark_conjugate_guides.py``)
ADAM_STEPS = {
    "normal-normal-positive/float32": 208,
    "normal-normal-positive/float64": 208,
    "normal-normal-logscale/float32": 208,
    "normal-normal-logscale/float64": 208,
    "normal-normal-softplus/float32": 219,
    "normal-normal-softplus/float64": 219,
    "mvn-normal-scale_tril/float32": 154,
    "mvn-normal-scale_tril/float64": 154,
    "gamma-poisson-positive/float32": 5939,
    "gamma-poisson-positive/float64": 5939,
    "gamma-poisson-exp/float32": 5939,
    "gamma-exponential-positive/float32": 3181,
    "gamma-exponential-exp/float32": 3181,
    "gamma-exponential-softplus/float32": 6553,
    "gamma-exponential-softplus/float64": 6553,
    "gamma-poisson-exp/float64": 5939,
    "gamma-exponential-positive/float64": 3181,
    "gamma-exponential-exp/float64": 3181,
    "beta-bernoulli-positive/float32": 4810,
    "beta-bernoulli-positive/float64": 4810,
    "beta-bernoulli-exp/float32": 4810,
    "beta-bernoulli-exp/float64": 4810,
    "beta-bernoulli-softplus/float32": 7858,
    "beta-bernoulli-softplus/float64": 7858,
    "lognormal-normal-positive/float32": 1776,
    "lognormal-normal-positive/float64": 1776,
    "lognormal-normal-logscale/float32": 1776,
    "lognormal-normal-logscale/float64": 1776,
    "lognormal-normal-softplus/float32": 1773,
    "lognormal-normal-softplus/float64": 1773,
}

#: lr at which Adam needed ADAM_STEPS
ADAM_LR = {
    "normal-normal-positive/float32": 0.05,
    "normal-normal-positive/float64": 0.05,
    "normal-normal-logscale/float32": 0.05,
    "normal-normal-logscale/float64": 0.05,
    "normal-normal-softplus/float32": 0.05,
    "normal-normal-softplus/float64": 0.05,
    "mvn-normal-scale_tril/float32": 0.05,
    "mvn-normal-scale_tril/float64": 0.05,
    "gamma-poisson-positive/float32": 0.02,
    "gamma-poisson-positive/float64": 0.02,
    "gamma-poisson-exp/float32": 0.02,
    "gamma-exponential-positive/float32": 0.02,
    "gamma-exponential-exp/float32": 0.02,
    "gamma-exponential-softplus/float32": 0.05,
    "gamma-exponential-softplus/float64": 0.05,
    "gamma-poisson-exp/float64": 0.02,
    "gamma-exponential-positive/float64": 0.02,
    "gamma-exponential-exp/float64": 0.02,
    "beta-bernoulli-positive/float32": 0.01,
    "beta-bernoulli-positive/float64": 0.01,
    "beta-bernoulli-exp/float32": 0.01,
    "beta-bernoulli-exp/float64": 0.01,
    "beta-bernoulli-softplus/float32": 0.05,
    "beta-bernoulli-softplus/float64": 0.05,
    "lognormal-normal-positive/float32": 0.02,
    "lognormal-normal-positive/float64": 0.02,
    "lognormal-normal-logscale/float32": 0.02,
    "lognormal-normal-logscale/float64": 0.02,
    "lognormal-normal-softplus/float32": 0.02,
    "lognormal-normal-softplus/float64": 0.02,
}

#: Adam (lr 0.02 and 0.05) was not within tolerance for 100 steps running in this many steps:
#: CVI() gets a tenth of it (``--lrs 0.02 0.05 --max-steps 8000``)
ADAM_NOT_WITHIN = {
    "gamma-poisson-softplus/float32": 8000,
    "gamma-poisson-softplus/float64": 8000,
    "dirichlet-categorical-positive/float32": 8000,
    "dirichlet-categorical-exp/float32": 8000,
    "dirichlet-categorical-softplus/float32": 8000,
    "dirichlet-categorical-positive/float64": 8000,
    "dirichlet-categorical-exp/float64": 8000,
    "dirichlet-categorical-softplus/float64": 8000,
}

#: pairs (name/dtype) where CVI() failed this test when measured (not within tolerance after a
#: tenth of Adam's steps)
FAILING: frozenset = frozenset()

REASON = "CVI() does not (yet) reach this guide's posterior in a tenth of Adam's steps"

#: the guide must stay within tolerance from the budget step to this many times the budget
STAY_FACTOR = 3

KEYS = [(p.name, d) for p in PAIRS for d in DTYPES]


@pytest.mark.parametrize("name", [p.name for p in PAIRS])
def test_the_closed_form_is_the_posterior(name):
    """``log p(theta, y) - log q*(theta)`` is constant (float64) over draws of ``theta``."""
    pair = BY_NAME[name]
    data = pair.data(torch.float64)
    pyro.set_rng_seed(3)
    with torch.no_grad():
        prior = poutine.trace(pair.model).get_trace(*data).nodes[pair.site]["fn"]
        diffs = []
        for _ in range(20):
            theta = prior.sample()
            conditioned = poutine.condition(pair.model, data={pair.site: theta})
            joint = poutine.trace(conditioned).get_trace(*data).log_prob_sum()
            diffs.append(float(joint - pair.posterior_log_prob(theta, *data)))
    diffs = torch.tensor(diffs, dtype=torch.float64)
    assert diffs.std() < 1e-8 * max(1.0, float(diffs.abs().max())), diffs


@pytest.mark.parametrize("name,dtype", KEYS)
def test_a_guide_at_the_posterior_has_no_error(name, dtype):
    """Each parameterisation maps back to the analytic ``q*`` (errors at rounding level)."""
    pair = BY_NAME[name]
    data = pair.data(DTYPES[dtype])
    pair.set_to_posterior(data)
    tiny = 1e-5 if dtype == "float32" else 1e-9  # softplus is the identity above 20
    assert all(e <= tiny for e in pair.errors(data)), pair.errors(data)


def _budget(key):
    return ADAM_STEPS.get(key, ADAM_NOT_WITHIN.get(key))


def test_the_recorded_counts_name_pairs_of_the_table():
    keys = {f"{n}/{d}" for n, d in KEYS}
    assert set(ADAM_STEPS) <= keys and set(ADAM_NOT_WITHIN) <= keys
    assert not set(ADAM_STEPS) & set(ADAM_NOT_WITHIN)
    assert all(s >= 10 for s in ADAM_STEPS.values())
    assert FAILING <= set(ADAM_STEPS) | set(ADAM_NOT_WITHIN)
    assert set(ADAM_LR) == set(ADAM_STEPS)


def _params():
    out = []
    for name, d in KEYS:
        key = f"{name}/{d}"
        marks = [pytest.mark.xfail(strict=True, reason=REASON)] if key in FAILING else []
        if _budget(key) is None:
            marks = [
                pytest.mark.skip(
                    reason="Adam's count not measured yet: "
                    f"scripts/benchmark_conjugate_guides.py -k {name}"
                )
            ]
        elif _budget(key) // 10 > 300:
            marks.append(pytest.mark.slow)
        out.append(pytest.param(name, d, marks=marks, id=key))
    return out


def _assert_stays(name, dtype, seed=0):
    """Within tolerance after every step from the budget (a tenth of Adam's steps) to
    ``STAY_FACTOR`` times it."""
    pair = BY_NAME[name]
    steps = _budget(f"{name}/{dtype}") // 10
    last = STAY_FACTOR * steps
    out, errors = stays(pair, DTYPES[dtype], CVI(), steps, last, seed=seed)
    assert out is None, (
        f"{name} ({dtype}, seed {seed}): outside tolerance {pair.tol} after step {out} "
        f"(budget {steps}, checked to {last}): errors {errors}"
    )


@pytest.mark.parametrize("name,dtype", _params())
def test_cvi_reaches_the_posterior_in_a_tenth_of_adams_steps_and_stays(name, dtype):
    _assert_stays(name, dtype)


#: the pairs with the smallest budgets (15-21 steps), checked on more draws
TIGHT = ("normal-normal-positive", "normal-normal-logscale", "normal-normal-softplus")


#: guides on which Adam takes bit-identical steps to another guide's: Pyro keeps a
#: ``constraints.positive`` param as the log of its value and exponentiates it
#: (``biject_to(positive)`` is ``exp``), which is what the ``exp`` guides (and the Normal's
#: ``logscale`` guide) do by hand from the same starting point (log 1 = 0). Their Adam baseline
#: is the twin's run (checked step by step below), so it is run once per twin.
ADAM_SAME_AS = {
    "gamma-poisson-exp": "gamma-poisson-positive",
    "gamma-exponential-exp": "gamma-exponential-positive",
    "beta-bernoulli-exp": "beta-bernoulli-positive",
    "normal-normal-logscale": "normal-normal-positive",
    "lognormal-normal-logscale": "lognormal-normal-positive",
}


def _adam_trajectory(name, dtype, lr, steps):
    """Per step: the loss, the errors, and the unconstrained params (by position)."""
    pair = BY_NAME[name]
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    data = pair.data(DTYPES[dtype])
    svi = pyro.infer.SVI(pair.model, pair.guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())
    out = []
    for _ in range(steps):
        loss = svi.step(*data)
        raw = [p.detach().clone() for _, p in pyro.get_param_store().named_parameters()]
        out.append((loss, pair.errors(data), raw))
    return out


@pytest.mark.parametrize("twin", list(ADAM_SAME_AS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_adam_steps_the_twin_guides_identically(twin, dtype):
    """100 Adam steps of a guide of ``ADAM_SAME_AS`` and of its twin give the same losses,
    errors and unconstrained params bit for bit (so the same run: one Adam baseline for both),
    and the table records the same count and lr for both."""
    key, twin_key = f"{ADAM_SAME_AS[twin]}/{dtype}", f"{twin}/{dtype}"
    assert ADAM_STEPS[twin_key] == ADAM_STEPS[key] and ADAM_LR[twin_key] == ADAM_LR[key]
    ours = _adam_trajectory(twin, dtype, ADAM_LR[key], 100)
    theirs = _adam_trajectory(ADAM_SAME_AS[twin], dtype, ADAM_LR[key], 100)
    for t, ((l1, e1, p1), (l2, e2, p2)) in enumerate(zip(ours, theirs), 1):
        assert l1 == l2 and e1 == e2, (t, l1, l2, e1, e2)
        assert len(p1) == len(p2) and all(torch.equal(a, b) for a, b in zip(p1, p2)), t
    assert ours[-1][1] != ours[0][1]  # Adam moved the guide


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,dtype",
    [(n, d) for n, d in KEYS if f"{n}/{d}" in ADAM_STEPS and n not in ADAM_SAME_AS],
)
def test_adam_needs_the_recorded_steps(name, dtype):
    """The baseline: Adam at its recorded lr reaches the posterior, and not in a tenth of the
    recorded steps (so the bar for CVI() is not trivially low); the errors after that tenth
    are read off the same run. Also the baseline of the ``ADAM_SAME_AS`` twin guides."""
    pair = BY_NAME[name]
    key = f"{name}/{dtype}"
    steps = ADAM_STEPS[key]
    seen: dict = {steps // 10: None}
    optim = pyro.optim.Adam({"lr": ADAM_LR[key]})
    first, _ = fit(pair, DTYPES[dtype], optim, steps + 150, seen=seen)
    assert first is not None and first <= steps + 50, first
    errors = seen[steps // 10]
    assert errors is not None and not all(e <= pair.tol for e in errors), errors


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", ("mvn-normal-scale_tril",) + TIGHT)
def test_the_tightest_budgets_on_other_seeds(name, dtype, seed):
    """The full-covariance site (15 steps) and the Normal guides (20-21) have the fewest steps
    of the table: other draws too."""
    _assert_stays(name, dtype, seed)
