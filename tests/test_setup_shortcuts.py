"""Set-up shortcuts that must decide exactly as the longer computations they replace.

* :func:`~pyro_cvi.model.validation.all_finite`: one sum proves a tensor finite; a sum that is
  not finite falls back to the element check (an overflowing sum of finite values is finite);
* the dependency search keeps each site's ``log_prob`` for the density checks, which read and
  drop it: the same value as evaluating it again, the same errors, nothing left on the trace;
* :func:`~pyro_cvi.model.probes.matvec_matrix` reads ``X`` off ``X @ z`` (through a vector's
  view of itself): the first row equals the backward pass, so the random-walk refusal
  (:func:`~pyro_cvi.statespace.detect._spans_steps`) decides as before;
* :func:`~pyro_cvi.model.probes.close` with one finiteness check: the same answers on NaN and
  infinities in either argument.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_cvi.model import probes
from pyro_cvi.model.analysis import Analysis
from pyro_cvi.model.tracing import LOG_PROB_KEY, is_random
from pyro_cvi.model.validation import all_finite, check_analysis, per_index
from pyro_cvi.statespace import detect
from pyro_cvi.statespace.detect import ChainSpec, _spans_steps
from pyro_cvi.statespace.increments import Increments

DTYPES = [torch.float32, torch.float64]
IDS = ["f32", "f64"]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_all_finite_is_the_element_check(dtype):
    big = torch.finfo(dtype).max
    cases = [
        torch.randn(40, 7, generator=torch.Generator().manual_seed(0)).to(dtype),
        torch.tensor([big, big, -big / 2], dtype=dtype),  # the sum overflows, all finite
        torch.tensor([1.0, float("inf"), 2.0], dtype=dtype),
        torch.tensor([1.0, float("-inf"), float("inf")], dtype=dtype),
        torch.tensor([float("nan"), 0.0], dtype=dtype),
        torch.zeros(0, dtype=dtype),
        torch.randn(6, 5, dtype=torch.float64).to(dtype).T,  # not contiguous
    ]
    for a in cases:
        assert all_finite(a) == bool(torch.isfinite(a).all()), a
    assert all_finite(torch.tensor([1, 2, 3]))  # integers
    assert all_finite(torch.tensor([True, False]))


def _glm(dtype, y):
    X = torch.randn(25, 3, generator=torch.Generator().manual_seed(1)).to(dtype)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(3), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model, (X, y)


def _analysis(model, args):
    pyro.clear_param_store()
    proto = pyro.poutine.trace(model).get_trace(*args)
    an = Analysis(model, args, {}, proto)
    nodes = an.structure.nodes.items()
    structure = {n: n not in an.values for n, s in nodes if is_random(s) and not per_index(s)}
    return an, structure


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_the_dependency_search_hands_its_log_prob_to_the_density_checks(dtype):
    y = (torch.arange(25) % 2).to(dtype)
    model, args = _glm(dtype, y)
    an, structure = _analysis(model, args)
    site = an.structure.nodes["y"]
    kept = site[LOG_PROB_KEY]
    assert not kept.requires_grad
    assert torch.equal(kept, site["fn"].log_prob(site["value"]).detach())
    assert an.deps["y"] == {"w"}
    check_analysis(an, structure, args)
    assert not any(LOG_PROB_KEY in s for s in an.structure.nodes.values())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_a_singular_observation_is_still_named(dtype):
    def model(y):
        a = pyro.sample("a", dist.LogNormal(torch.zeros((), dtype=dtype), 1.0))
        with pyro.plate("data", y.shape[0]):
            pyro.sample("y", dist.Beta(a, a), obs=y)

    y = torch.tensor([0.2, 0.5, 1.0], dtype=dtype)  # 1 is on the edge of the Beta's support
    an, structure = _analysis(model, (y,))
    with pytest.raises(ValueError, match="observed site 'y' has log-density"):
        check_analysis(an, structure, (y,))
    assert not any(LOG_PROB_KEY in s for s in an.structure.nodes.values())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_matvec_matrix_reads_x_through_a_vector_view(dtype):
    X = torch.randn(30, 12, generator=torch.Generator().manual_seed(2)).to(dtype)
    z = torch.randn(12, dtype=dtype).requires_grad_(True)
    with torch.enable_grad():
        out = X @ z
        flat = out.reshape(-1)
        assert probes.matvec_matrix(out, z) is X
        assert probes.matvec_matrix(flat, z) is None  # (the view: only when asked)
        assert probes.matvec_matrix(flat, z, views=True) is X
        (g,) = torch.autograd.grad(flat[0], z, retain_graph=True)
        assert torch.equal(X[0], g)
        assert probes.matvec_matrix((2 * X) @ z * 1.0, z, views=True) is None
        assert probes.matvec_matrix(out.reshape(6, 5).reshape(-1), z, views=True) is None
        jac = probes.jacobian(out, z)
        assert torch.equal(jac, X) and jac is not X


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("rows", ["dense", "one step", "cumulative"])
def test_the_walk_refusal_decides_as_the_backward_pass(dtype, rows, monkeypatch):
    T = 15
    inc = Increments(torch.Size([T]), 0)
    spec = ChainSpec(("eps",), inc.state_dim, inc.length, False, increments=inc)
    eps = torch.randn(T, generator=torch.Generator().manual_seed(3)).to(dtype).requires_grad_(True)
    idx = (torch.arange(20) + 5) % T  # (the first row reads x_5, or eps_5 = x_5 - x_4)
    if rows == "dense":
        X = torch.randn(20, T, generator=torch.Generator().manual_seed(4)).to(dtype)
    elif rows == "one step":  # each row reads eps at one index: several steps of the walk
        X = torch.eye(T, dtype=dtype)[idx]
    else:  # row r reads x_t = sum_{s <= t} eps_s: one step each
        X = torch.tril(torch.ones(T, T, dtype=dtype))[idx]
    with torch.enable_grad():
        flat = (X @ eps).reshape(-1)
        fast = _spans_steps(spec, flat, eps)
        monkeypatch.setattr(detect.probes, "matvec_matrix", lambda *a, **k: None)
        slow = _spans_steps(spec, flat, eps)
    assert fast == slow
    assert fast == (rows != "cumulative")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_close_with_one_finiteness_check(dtype):
    def reference(a, b, tol):
        a, b = torch.broadcast_tensors(a, b)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            return False
        return bool(((a - b).abs() <= tol * (1.0 + torch.maximum(a.abs(), b.abs()))).all())

    nan, inf = float("nan"), float("inf")
    values = [0.0, 1.0, 1.0 + 1e-7, -3.0, 1e30, nan, inf, -inf]
    for x in values:
        for y in values:
            a = torch.tensor([0.5, x], dtype=dtype)
            b = torch.tensor([0.5, y], dtype=dtype)
            for tol in (1e-6, 1e-3):
                assert probes.close(a, b, tol) == reference(a, b, tol), (x, y, tol)
    a = torch.tensor([[1.0], [inf]], dtype=dtype)
    assert probes.close(a, torch.ones(3, dtype=dtype), 1e-6) is False
