"""A GPyTorch user changes something between training steps (a noise, a likelihood, a kernel
hyperparameter, a mean constant, train()/eval(), the data, the inducing points, the dtype, the
mll's num_data): every stepper sees it at the next step and fits the new exact q(u) (a Gaussian
likelihood: the optimal sparse q(u) in closed form), or refuses it with an error that names
it. The cases are the table of ``tests/gpytorch_user_changes.py`` (also printed by
``scripts/check_gpytorch_user_changes.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from gpytorch_user_changes import CASES, Run, q_u, run_case, set_lengthscale, set_noise, tolerance

from pyro_cvi.contrib.gpytorch import CVIOptimizer

DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_change_between_steps_is_seen_or_refused_by_name(name, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # GPyTorch's jitter warnings
        row = run_case(name, dtype)
    case = CASES[name]
    if case.error is not None:
        err_type, phrase = case.error
        assert "error" in row, f"{name}: expected {err_type.__name__}, the step ran"
        assert issubclass(row["error_type"], err_type), row["error"]
        assert phrase in row["error"], row["error"]
        return
    assert "error" not in row, row.get("error")
    tol = tolerance(dtype)
    assert row["mean_error"] < tol and row["cov_error"] < tol, row
    assert row["q_dtype"] == str(dtype).replace("torch.", "")
    if not case.dtype_move:  # the change mattered: the old answer is far from the new one
        assert row["old_answer_gap"] > 100 * tol, row


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("stepper", ["loop", "cvi"])
@pytest.mark.parametrize("change", [set_noise, set_lengthscale], ids=lambda f: f.__name__)
def test_default_step_sizes_converge_to_the_new_answer(change, stepper, dtype):
    """With the default step sizes (0.5 in backward, 0.8 in CVIOptimizer) a change by hand is a
    new objective: a step undone by the backtracking test goes back to the last sites and steps
    from there towards the new objective's target, never towards the old one."""
    run = Run(stepper, dtype)
    run.model.variational_strategy.step_size = 0.5
    if run.opt is not None:
        run.opt = CVIOptimizer(run.model, run.likelihood)
    run.step(3)
    change(run)
    run.step(40)
    mean, cov = q_u(run.model)
    exact = run.exact()
    tol = 1e-6 if dtype == torch.float64 else 2e-3
    assert float((mean.double() - exact[0]).abs().max()) < tol
    assert float((cov.double() - exact[1]).abs().max()) < tol
