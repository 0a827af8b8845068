"""The first step of a small model imports no sympy.

Torch imports sympy (0.4-0.5 CPU s, once per process) the first time ``torch.autograd.grad``
is given explicit cotangents or ``torch.broadcast_shapes`` runs: on a small model that is
most of the time to the first answer. The package's own paths avoid both; the numbers are
those of the public calls, bit for bit (checked here against them)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pyro_cvi.gaussian.price import _batched_vjp
from pyro_cvi.gaussian.steps import chol_grad_to_cov_grad

DTYPES = [torch.float32, torch.float64]
ROOT = Path(__file__).resolve().parents[1]

#: models whose first steps take each path: the remainder's Price Hessian (batched
#: cotangents), the Cholesky factor's gradient, a subsampled plate's latent weight, an
#: unconstrained Gaussian family's shapes (an interval's affine map), the bilinear check and
#: its power-of-Gamma law, the remainder's marginal through an affine map, an observation
#: shared with an exact block
MODELS = [
    "eight_schools_centered",
    "stochastic_volatility",
    "subsampled_logistic",
    "bayesian_regression",
    "ppca",
    "linear_regression",
    "eight_schools_noncentered",
]

_CHILD = r"""
import sys, warnings
sys.path.insert(0, {tests!r})
import torch
import pyro
from pyro.infer import SVI
from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from zoo import ZOO
for name in {models!r}:
    for dtype in (torch.float32, torch.float64):
        e = ZOO[name]
        model, kwargs = e.build(dtype)
        data = e.data(dtype)
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            svi = SVI(model, AutoCVI(model, **kwargs), CVI(), CVI_ELBO())
            for _ in range(2):
                svi.step(*data.args, **data.kwargs)
        print(name, dtype, "sympy" in sys.modules)
"""


def test_the_first_steps_import_no_sympy():
    """One fresh process (sympy, once imported, stays): each model in both dtypes."""
    code = _CHILD.format(tests=str(ROOT / "tests"), models=MODELS)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 * len(MODELS), out.stdout + out.stderr
    assert all(line.endswith("False") for line in lines), out.stdout


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,D", [(1, 1), (5, 7), (64, 3), (8, 40)])
def test_the_batched_hessian_rows_are_the_public_calls(K, D, dtype):
    g0 = torch.Generator().manual_seed(K * 100 + D)
    u = torch.randn(K, D, dtype=dtype, generator=g0).requires_grad_(True)
    W = torch.randn(D, D, dtype=dtype, generator=g0)
    f = (torch.tanh(u @ W) ** 2).sum() + (u.exp() * u.sin()).sum()
    (g,) = torch.autograd.grad(f, u, create_graph=True)
    E = torch.eye(D, dtype=dtype)[:, None, :].expand(D, K, D)
    (ours,) = _batched_vjp(g, u, E)
    (public,) = torch.autograd.grad(
        g, u, E, retain_graph=True, is_grads_batched=True, allow_unused=True
    )
    assert torch.equal(ours, public)
    # and the rows are the Hessian: the brute-force second derivatives, row by row
    brute = torch.stack(
        [torch.autograd.grad(g[:, i].sum(), u, retain_graph=True)[0] for i in range(D)]
    )
    torch.testing.assert_close(ours, brute, rtol=1e-12 if dtype == torch.float64 else 1e-5, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_another_torchs_private_signature_falls_back_to_the_public_call(dtype, monkeypatch):
    import torch.autograd.graph as graph

    def changed(*args, **kwargs):
        raise TypeError("_engine_run_backward() got an unexpected keyword argument")

    monkeypatch.setattr(graph, "_engine_run_backward", changed)
    u = torch.randn(4, 3, dtype=dtype, generator=torch.Generator().manual_seed(1))
    u.requires_grad_(True)
    (g,) = torch.autograd.grad((u.sin() * u).sum(), u, create_graph=True)
    E = torch.eye(3, dtype=dtype)[:, None, :].expand(3, 4, 3)
    (ours,) = _batched_vjp(g, u, E)
    (public,) = torch.autograd.grad(
        g, u, E, retain_graph=True, is_grads_batched=True, allow_unused=True
    )
    assert torch.equal(ours, public)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_cholesky_gradient_is_the_public_call(dtype):
    g0 = torch.Generator().manual_seed(3)
    A = torch.randn(6, 6, dtype=torch.float64, generator=g0)
    S = (A @ A.T + 6 * torch.eye(6, dtype=torch.float64)).to(dtype)
    L = torch.linalg.cholesky(S)
    gL = torch.randn(6, 6, dtype=torch.float64, generator=g0).to(dtype)
    ours = chol_grad_to_cov_grad(L, gL)
    with torch.enable_grad():
        S2 = (L @ L.T).detach().requires_grad_(True)
        (gS,) = torch.autograd.grad(torch.linalg.cholesky(S2), S2, gL.tril())
    assert torch.equal(ours, 0.5 * (gS + gS.T))


def _hmm_runs(dtype, draw=None):
    """Model runs of ``AutoCVI``'s set-up on the zoo's HMM (12 steps, Dirichlet and Beta rows
    selected by the hidden state), the first loss and the analysis; with ``draw``, every run
    also calls ``draw(())`` (a random value the model does not use)."""
    import pyro
    from pyro.infer import SVI

    sys.path.insert(0, str(ROOT / "tests"))
    from zoo import ZOO

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI

    e = ZOO["hmm"]
    model, kwargs = e.build(dtype)
    data = e.data(dtype)
    calls = [0]

    def counted(*args, **kw):
        calls[0] += 1
        if draw is not None:
            draw(())
        return model(*args, **kw)

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(counted, **kwargs)
    loss = SVI(counted, guide, CVI(), CVI_ELBO()).step(*data.args, **data.kwargs)
    return calls[0], loss, guide.engine.analysis


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_identity_probes_share_their_tagged_runs(dtype, monkeypatch):
    """Every factor of the HMM reads ``probs_x[x]`` or ``probs_y[x]``: the identity probes tag
    each Dirichlet / Beta latent twice, and those runs are shared by all its factors (4 runs,
    not 2 per factor): the same classification and the same first loss, bit for bit, as with
    every factor running its own."""
    from pyro_cvi.model import factor_roles

    runs, loss, an = _hmm_runs(dtype)

    def own_runs(an, site, pattern, name, p):
        return lambda z: factor_roles._param_reader(an, site, pattern, name)({p: z})

    monkeypatch.setattr(factor_roles, "_tagged_reader", own_runs)
    runs_own, loss_own, an_own = _hmm_runs(dtype)
    factors = sum(1 for n in an.structure.nodes if n.startswith(("x_", "y_")))
    assert runs_own - runs >= 2 * factors - 4
    assert an.explain() == an_own.explain()
    assert loss == loss_own


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tagged_run_that_draws_is_not_reused(dtype, monkeypatch):
    """A model that draws from torch's random stream (a value it does not use) runs once per
    tag and factor, as with every factor running its own: the same runs, the same loss."""
    from pyro_cvi.model import factor_roles

    draw = torch.rand
    runs, loss, _ = _hmm_runs(dtype, draw)

    def own_runs(an, site, pattern, name, p):
        return lambda z: factor_roles._param_reader(an, site, pattern, name)({p: z})

    monkeypatch.setattr(factor_roles, "_tagged_reader", own_runs)
    runs_own, loss_own, _ = _hmm_runs(dtype, draw)
    assert runs == runs_own
    assert loss == loss_own


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_a_gaussian_blocks_draw_is_the_multivariate_normals_bit_for_bit(dtype):
    """``mvn_draw`` (no distribution built: no sympy) takes the same draws from torch's stream
    as ``MultivariateNormal(loc, scale_tril=L).sample()``."""
    import pyro.distributions as dist

    from pyro_cvi.gaussian import mvn_draw

    g = torch.Generator().manual_seed(1)
    A = torch.randn(6, 6, generator=g, dtype=torch.float64)
    L = torch.linalg.cholesky(A @ A.T + 6 * torch.eye(6, dtype=torch.float64)).to(dtype)
    m = torch.randn(6, generator=g, dtype=torch.float64).to(dtype)
    torch.manual_seed(7)
    want = dist.MultivariateNormal(m, scale_tril=L).sample()
    torch.manual_seed(7)
    assert torch.equal(mvn_draw(m, L), want)


def _transforms(dtype):
    """Maps whose shape arithmetic torch does by ``torch.broadcast_shapes``, alone, composed,
    made independent, and ones without it (returned as they are)."""
    from torch.distributions import biject_to, constraints
    from torch.distributions import transforms as T

    loc = torch.tensor([0.5, -1.0, 2.0], dtype=dtype)
    scale = torch.tensor([2.0, 0.5, 3.0], dtype=dtype)
    return [
        biject_to(constraints.interval(-1.0, 3.0)),
        biject_to(constraints.greater_than(2.0)),
        T.AffineTransform(loc, scale),
        T.AffineTransform(loc, scale, event_dim=1),
        T.PowerTransform(torch.tensor(0.5, dtype=dtype)),
        T.IndependentTransform(T.AffineTransform(loc, scale), 1),
        T.ComposeTransform([T.ExpTransform(), T.AffineTransform(loc[:, None], 2.0)]),
        biject_to(constraints.positive),
        biject_to(constraints.simplex),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (3,), (4, 3), (2, 1, 3)])
def test_the_sympy_free_maps_are_torchs(shape, dtype):
    from torch.distributions import transforms as T

    from pyro_cvi.families.shapes import broadcast_shapes, sympy_free

    g = torch.Generator().manual_seed(len(shape))
    for t in _transforms(dtype):
        ours = sympy_free(t)
        if isinstance(t, T.IndependentTransform):  # (no __eq__ of its own: its map's)
            assert ours.base_transform == t.base_transform
        else:
            assert ours == t
        try:
            want = t.forward_shape(torch.Size(shape))
        except (RuntimeError, ValueError):
            with pytest.raises((RuntimeError, ValueError)):
                ours.forward_shape(torch.Size(shape))
            continue
        assert ours.forward_shape(torch.Size(shape)) == want
        assert ours.inverse_shape(want) == t.inverse_shape(want)
        same = dict(rtol=0, atol=0, equal_nan=True)  # (bit for bit)
        x = torch.rand(want if want else (), generator=g, dtype=dtype) + 0.5
        u = torch.randn(shape, generator=g, dtype=dtype) if not t.domain.event_dim else None
        if u is not None and tuple(u.shape) == tuple(t.inverse_shape(want)):
            torch.testing.assert_close(ours(u), t(u), **same)
            ld = ours.log_abs_det_jacobian(u, t(u))
            torch.testing.assert_close(ld, t.log_abs_det_jacobian(u, t(u)), **same)
        torch.testing.assert_close(ours.inv(x), t.inv(x), **same)
        assert ours.with_cache(1).forward_shape(torch.Size(shape)) == want
    for a, b in [((), (3,)), ((4, 1), (3,)), ((2, 1, 3), (4, 1)), ((5,), (1,))]:
        assert broadcast_shapes(a, b) == torch.broadcast_shapes(a, b)
    with pytest.raises(ValueError):
        broadcast_shapes((2,), (3,))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_transformed_distribution_on_the_sympy_free_map_is_torchs(dtype):
    import pyro.distributions as dist
    from torch.distributions import biject_to, constraints

    from pyro_cvi.families.shapes import sympy_free

    t = biject_to(constraints.interval(-1.0, 3.0))
    base = dist.Normal(torch.zeros(4, dtype=dtype), torch.ones(4, dtype=dtype))
    a, b = (
        dist.TransformedDistribution(base, [t]),
        dist.TransformedDistribution(base, [sympy_free(t)]),
    )
    assert a.batch_shape == b.batch_shape and a.event_shape == b.event_shape
    x = torch.tensor([-0.5, 0.0, 1.0, 2.5], dtype=dtype)
    assert torch.equal(a.log_prob(x), b.log_prob(x))
