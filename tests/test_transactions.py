"""Transactional steps: a step that fails or is interrupted at any point leaves the
guide as it was, and the next good step is exactly the one an undisturbed run takes.

The fault injection interrupts a step at its k-th executed line of pyro_cvi code (a trace
function that raises), for k spread over the whole step: the first step (set-up included) and
a later one, with a fixed and with the adaptive step size, for a Gaussian block and a mean-field
model. After the fault the param store must hold either exactly the state before the step or
exactly the state after it (never a mix), and the next good step must match the undisturbed
run's step from that state, bit for bit.
"""

import gc
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

import pyro_cvi
from pyro_cvi import CVI, CVI_ELBO, AutoCVI

PKG = str(Path(pyro_cvi.__file__).resolve().parent)


class Injected(Exception):
    pass


class _Fault:
    """A trace function that raises ``exc`` at the k-th line executed in pyro_cvi's code."""

    def __init__(self, k, exc):
        self.k, self.exc, self.n, self.where = k, exc, 0, None

    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(PKG):
            return None
        if event == "line":
            self.n += 1
            if self.n == self.k:
                self.where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
                raise self.exc(f"injected at {self.where}")
        return self


@contextmanager
def _traced(tracer):
    """Run under ``tracer`` with the cyclic garbage collector off (and run just before): the
    lines a step executes must not depend on when the collector runs (it frees guides of
    earlier runs, which ``claim_prefix`` iterates over, and runs weakref callbacks in
    pyro_cvi's code, where an injected fault would be swallowed)."""
    gc.collect()
    gc.disable()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(None)
        gc.enable()


def _logistic():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(30, 3, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(X[:, 0] - X[:, 2]), generator=g)

    def model(X, y=None):
        b = pyro.param("b", torch.tensor(0.1, dtype=X.dtype))
        w = pyro.sample("w", dist.Normal(X.new_zeros(3), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)

    return model, (X, y)


def _gamma_poisson():
    g = torch.Generator().manual_seed(1)
    X = torch.poisson(torch.rand(6, 4, generator=g, dtype=torch.float64) * 3, generator=g)

    def model(X):
        prior = dist.Gamma(X.new_tensor(0.5), X.new_tensor(0.5))
        W = pyro.sample("W", prior.expand([2, 4]).to_event(2))
        with pyro.plate("rows", 6):
            Z = pyro.sample("Z", prior.expand([2]).to_event(1))
            pyro.sample("X", dist.Poisson(Z @ W).to_event(1), obs=X)

    return model, (X,)


CASES = {
    "gaussian-fixed": (_logistic, lambda: CVI(step_size=0.7, optim_args={"lr": 0.05})),
    "gaussian-auto": (_logistic, lambda: CVI(optim_args={"lr": 0.05})),
    "meanfield-auto": (_gamma_poisson, CVI),
}


def _start(case, pre):
    """A run after ``pre`` good steps (seeded): ``(svi, guide, optim, data)``."""
    make, make_optim = CASES[case]
    model, data = make()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide, optim = AutoCVI(model), make_optim()
    svi = SVI(model, guide, optim, loss=CVI_ELBO())
    for _ in range(pre):
        svi.step(*data)
    return svi, guide, optim, data


def _state():
    store = pyro.get_param_store()
    return {k: store[k].detach().clone() for k in store.keys()}


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _step(svi, data, seed):
    pyro.set_rng_seed(seed)
    return svi.step(*data)


@pytest.mark.parametrize("pre", [0, 2], ids=["first-step", "later-step"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_interrupted_step_leaves_the_guide_as_it_was(case, pre):
    warnings.simplefilter("ignore", RuntimeWarning)
    # the undisturbed runs: from S0, the next step (seed 6); and S0 -> S1 (seed 5) -> step (6)
    svi, *_, data = _start(case, pre)
    before = _state()
    next_from_before = (_step(svi, data, 6), _state())
    svi, *_, data = _start(case, pre)
    _step(svi, data, 5)
    after = _state()
    next_from_after = (_step(svi, data, 6), _state())
    # how many lines of pyro_cvi a step runs
    svi, *_, data = _start(case, pre)
    counter = _Fault(float("inf"), Injected)
    with _traced(counter):
        _step(svi, data, 5)
    total = counter.n
    assert total > 200
    points = sorted({int(total * i / 24) + 1 for i in range(24)} | {total})
    seen = {"before": 0, "after": 0}
    for k in points:
        # a run may execute a few lines less than the counting run (claim_prefix looks at each
        # guide under the prefix that is still alive, which depends on what holds the earlier
        # runs' guides): a point past the end of this run moves back until its fault happens
        for at in range(k, max(k - 16, 0), -1):
            svi, guide, optim, data = _start(case, pre)
            exc = KeyboardInterrupt if k % 2 else Injected
            fault = _Fault(at, exc)
            pyro.set_rng_seed(5)
            try:
                with _traced(fault):
                    svi.step(*data)
                raised = False
            except (KeyboardInterrupt, Injected):
                raised = True
            if raised:
                break
        assert raised, f"no fault at line {k} of {total} (nor at the 15 lines before it)"
        assert torch.is_grad_enabled(), fault.where  # (a fault before a with's __exit__)
        now = _state()
        if _equal(now, before):
            seen["before"] += 1
            expected = next_from_before
        else:
            assert _equal(now, after), f"a half-done step after a fault at {fault.where}"
            seen["after"] += 1
            expected = next_from_after
        loss = _step(svi, data, 6)  # the next good step
        assert loss == expected[0], fault.where
        assert _equal(_state(), expected[1]), fault.where
    assert seen["before"] >= len(points) - 2  # (only a fault in the final bookkeeping commits)


class _AtLine:
    """A trace function that raises ``KeyboardInterrupt`` the first time line ``lineno`` of
    pyro_cvi's file ``name`` runs."""

    def __init__(self, name, lineno):
        self.name, self.lineno, self.where = name, lineno, None

    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(PKG):
            return None
        code = frame.f_code.co_filename
        if event == "line" and self.where is None and code.endswith(self.name):
            if frame.f_lineno == self.lineno:
                self.where = f"{self.name}:{self.lineno}"
                raise KeyboardInterrupt(f"injected at {self.where}")
        return self


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_a_step_interrupted_after_its_backward_pass_leaks_no_gradient(dtype):
    """An interrupt right after ``loss.backward()`` in CVI_ELBO: the model's parameter ``b``
    has its gradient then; the step is rolled back (its gradient dropped), and the next good
    step is the undisturbed run's, so that gradient must not add to the next one's."""
    source = (Path(PKG) / "elbo.py").read_text().splitlines()
    after = next(i for i, line in enumerate(source, 1) if line.strip() == "loss.backward()") + 1
    model, (X, y) = _logistic()
    data = (X.to(dtype), y.to(dtype))
    runs = []
    for fault in (None, _AtLine("elbo.py", after)):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        svi = SVI(model, AutoCVI(model), CVI(step_size=0.7, optim_args={"lr": 0.05}), CVI_ELBO())
        svi.step(*data)
        if fault is not None:
            before = _state()
            with pytest.raises(KeyboardInterrupt), _traced(fault):
                svi.step(*data)
            assert fault.where is not None and _equal(_state(), before)
            assert pyro.get_param_store()._params["b"].grad is None
        runs.append((svi.step(*data), _state()))
    assert runs[1][0] == runs[0][0] and _equal(runs[1][1], runs[0][1])


def test_failed_first_step_with_inf_in_x_then_a_good_step():
    model, (X, y) = _logistic()
    pyro.clear_param_store()
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=0.5), loss=CVI_ELBO())
    bad = X.clone()
    bad[4, 1] = float("inf")
    with pytest.raises(ValueError, match=r"site 'y'.* -?inf at index \[4\]"):
        svi.step(bad, y)
    assert guide.prototype_trace is None and not list(pyro.get_param_store().keys())
    pyro.set_rng_seed(0)  # (the failed set-up drew from the RNG)
    loss = svi.step(X, y)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    fresh = SVI(model, AutoCVI(model), CVI(step_size=0.5), loss=CVI_ELBO()).step(X, y)
    assert loss == fresh
