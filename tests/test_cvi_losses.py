"""``CVI()`` under every Pyro loss that gives gradients, vectorised and sequential particles,
and ``poutine`` handlers around the model and guide: the guide's sites are found (the
observer sits below every handler, pyro_cvi.natgrad.observe) and stepped by natural
gradients, and the fit reaches the analytic posterior of a conjugate regression."""

import warnings

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import (
    SVI,
    JitTrace_ELBO,
    JitTraceGraph_ELBO,
    JitTraceMeanField_ELBO,
    Trace_ELBO,
    TraceEnum_ELBO,
    TraceGraph_ELBO,
    TraceMeanField_ELBO,
)
from torch.distributions import constraints

from pyro_cvi import CVI

DTYPES = [torch.float32, torch.float64]
SIGMA = 0.5


def _design(dtype):
    X = torch.zeros(4, 2, dtype=dtype)
    X[:2, 0], X[2:, 1] = 1.0, 1.0
    return X, torch.tensor([1.0, 1.4, -0.3, -0.7], dtype=dtype)


def _posterior(X, y):
    P = torch.eye(2, dtype=X.dtype) + X.T @ X / SIGMA**2
    S = torch.linalg.inv(P)
    return S @ X.T @ y / SIGMA**2, S.diagonal().sqrt()


def model(X, y):
    w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        # (vectorised particles: w is [particles, 1, 2], X * w is [particles, N, 2])
        pyro.sample("y", dist.Normal((X * w).sum(-1), SIGMA), obs=y)


def guide(X, y):
    m = pyro.param("m", X.new_zeros(2))
    s = pyro.param("s", X.new_ones(2), constraint=constraints.positive)
    pyro.sample("w", dist.Normal(m, s).to_event(1))


LOSSES = {
    "Trace": lambda: Trace_ELBO(),
    "MeanField": lambda: TraceMeanField_ELBO(),
    "Graph": lambda: TraceGraph_ELBO(),
    "Enum": lambda: TraceEnum_ELBO(max_plate_nesting=1),
    "JitTrace": lambda: JitTrace_ELBO(),
    "JitMeanField": lambda: JitTraceMeanField_ELBO(),
    "JitGraph": lambda: JitTraceGraph_ELBO(),
    "vectorised": lambda: Trace_ELBO(
        num_particles=8, vectorize_particles=True, max_plate_nesting=1
    ),
    "particles": lambda: Trace_ELBO(num_particles=4),
}


def _fit(loss, dtype, steps, wrap=None):
    X, y = _design(dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    cvi = CVI()
    m, g = (model, guide) if wrap is None else (wrap(model), wrap(guide))
    svi = SVI(m, g, cvi, loss=loss)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the jit's tracer warnings)
        for _ in range(steps):
            svi.step(X, y)
    return cvi, pyro.param("m").detach(), pyro.param("s").detach(), X, y


def _marked(name):
    jit = name.startswith("Jit")  # (compiling is slow)
    return pytest.param(name, marks=pytest.mark.slow) if jit else name


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("name", [_marked(n) for n in sorted(LOSSES)])
def test_every_loss_reaches_the_posterior(name, dtype):
    cvi, m, s, X, y = _fit(LOSSES[name](), dtype, 150)
    m_post, s_post = _posterior(X, y)
    assert torch.allclose(m, m_post, atol=0.1)
    assert torch.allclose(s, s_post, atol=0.1)
    rules = {r["param"]: r["rule"] for r in cvi.explain(print_table=False)}
    assert rules == {"m": "natural gradient (diag loc)", "s": "natural gradient (diag scale)"}


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_the_jit_compiled_loss_is_stepped(dtype):
    """Under JitTrace_ELBO the guide runs in Python only while compiling: what the observer
    saw then is kept, and every later step is still a natural-gradient step."""
    cvi, m, s, X, y = _fit(JitTrace_ELBO(), dtype, 30)
    assert set(cvi.gaussians.controls) == {"m"} and cvi.gaussians.controls["m"].t == 30


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_a_scale_around_model_and_guide_leaves_the_steps_unchanged(dtype):
    """``poutine.scale(c)`` on both doubles every gradient and leaves the posterior as it
    was: the step divides by the guide site's scale, so q moves exactly as without it."""
    plain = _fit(Trace_ELBO(), dtype, 20)
    scaled = _fit(Trace_ELBO(), dtype, 20, wrap=lambda f: poutine.scale(f, scale=2.0))
    assert torch.equal(plain[1], scaled[1]) and torch.equal(plain[2], scaled[2])


def test_a_blocked_guide_site_is_not_seen():
    """``poutine.block`` hides a site from the loss: it is hidden from CVI() too, and its
    parameters go to the inner optimizer."""
    X, y = _design(torch.float64)
    pyro.clear_param_store()

    def hidden(X, y):
        guide(X, y)
        with poutine.block():
            a = pyro.param("a", X.new_zeros(()))
            pyro.sample("aux", dist.Normal(a, 1.0))

    cvi = CVI()
    SVI(model, hidden, cvi, loss=Trace_ELBO()).step(X, y)
    rules = {r["param"]: r["rule"] for r in cvi.explain(print_table=False)}
    assert rules["m"].startswith("natural") and "a" not in rules
