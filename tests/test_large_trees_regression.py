"""A varying-intercept regression whose tree is too large for one joint block.

``a_j ~ Normal(mu, tau)`` over ``G`` groups, ``obs ~ Normal(a[group] + b x, sigma)`` with a common
slope ``b`` and a latent noise scale ``sigma``: beyond ``gaussian_tree.MAX_JOINT_DIM``
coordinates (lowered by monkeypatch so that 30 groups exceed it) ``a`` keeps an exact
mean-field block beside the remainder ``(mu, tau, b, sigma)``; its prior sends
``(E[loc/s^2], -E[1/s^2]/2)`` and the observations ``(A' E[(y - b x)/sigma^2],
-(A*A)' E[1/sigma^2]/2)`` in closed form under the remainder's ``q`` (eq. 20). Checked against

* the Algorithm 2 target of ``a`` by 2-d Gauss-Hermite quadrature over the remainder's
  marginals of ``(mu, log tau)`` and ``(b, log sigma)``;
* the remainder's term of ``obs`` against a brute-force average over ``q(a)``, the same for two
  draws of ``a``;
* the reported loss against ``Trace_ELBO`` of the same guide, the bound against the dense
  tree's (``families={"a": "gaussian"}``);
* a noise scale whose log is not affine in the remainder (``sigma + 0.1``): as before.
"""

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.messages.prior_expected import block_moments, expected_log_prior
from pyro_cvi.model import gaussian_tree
from pyro_cvi.model.records import CONJUGATE_PRIOR, CONJUGATE_SCALE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from benchmark_prior_messages import grouped_data, grouped_regression  # noqa: E402
from test_large_trees import GROUPS, LIMIT  # noqa: E402
from test_large_trees import bound as tree_bound  # noqa: E402
from test_large_trees import fit as fit_tree  # noqa: E402

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
GH_NODES, GH_WEIGHTS = numpy.polynomial.hermite_e.hermegauss(40)


@pytest.fixture
def small_limit(monkeypatch):
    """Trees over ``LIMIT`` coordinates are too large (30 groups: 32 coordinates)."""
    monkeypatch.setattr(gaussian_tree, "MAX_JOINT_DIM", LIMIT)


def shifted_scale(group, x, y, num_groups: int):
    """The regression with noise scale ``sigma + 0.1``: its log is not affine in ``log sigma``."""
    mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(x.new_tensor(1.0)))
    b = pyro.sample("b", dist.Normal(x.new_tensor(0.0), 2.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(x.new_tensor(1.0)))
    with pyro.plate("groups", num_groups):
        a = pyro.sample("a", dist.Normal(mu, tau))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Normal(a[group] + b * x, sigma + 0.1), obs=y)


def fit(dtype, steps, families=None, model=grouped_regression, groups=GROUPS):
    return fit_tree(dtype, steps, families, model, groups, grouped_data)


def bound(model, guide, args, particles=100, repeats=5):
    """``-ELBO`` by ``Trace_ELBO`` (particles in a loop: ``a[group]`` indexes the plate)."""
    return tree_bound(model, guide, args, particles, repeats, vectorize=False)


def remainder_marginal(guide, names):
    """``(mean, covariance)`` (float64) of the remainder's joint over ``names``' unconstrained
    values."""
    rem = guide.engine.block_for(names[0])
    with torch.no_grad():
        m = pyro.param(rem.loc_name).detach().double()
        S = rem.covariance().detach().double()
    starts = {s.name: s.start for s in rem.sites}
    idx = torch.tensor([starts[n] for n in names])
    return m[idx], S[idx][:, idx]


def gauss_hermite_2d(m, S):
    """Nodes ``(2, K)`` and weights ``(K,)`` of a 2-d Gauss-Hermite rule for ``N(m, S)``."""
    L = torch.linalg.cholesky(S)
    x = torch.tensor(GH_NODES, dtype=torch.float64)
    w = torch.tensor(GH_WEIGHTS, dtype=torch.float64) / math.sqrt(2 * math.pi)
    p, r = torch.meshgrid(x, x, indexing="ij")
    pts = m[:, None] + L @ torch.stack([p.reshape(-1), r.reshape(-1)])
    return pts, (w[:, None] * w[None, :]).reshape(-1)


@DTYPES
def test_intercepts_keep_an_exact_block_beside_a_small_remainder(small_limit, dtype):
    guide, _, _ = fit(dtype, 1)
    an = guide.engine.analysis
    assert list(an.remainder) == ["mu", "tau", "b", "sigma"]
    assert an.latents["a"].form == "natural"
    assert an.observed_beside == {"obs": "a"}
    factors = {f.site: f for f in an.latents["a"].factors}
    assert factors["a"].kind == CONJUGATE_PRIOR and factors["obs"].kind == CONJUGATE_SCALE
    assert tuple(factors["obs"].scale.A.shape) == (10 * GROUPS, GROUPS)
    text = guide.explain()
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("obs -> a"))
    assert "conjugate (E 1/s^2)" in line
    assert "log scale affine in the unconstrained b, sigma" in line
    assert "(A' E[(y - c)/s^2], -(A*A)' E[1/s^2]/2) in closed form" in line


@DTYPES
def test_intercept_target_is_the_conditional_posterior(small_limit, dtype):
    """Algorithm 2's target of ``a`` at the current ``q``: ``sum_i [g_i = j] (E[(y_i - b
    x_i)/sigma^2], -E[1/sigma^2]/2)`` plus ``(E[mu/tau^2], -E[1/tau^2]/2)``, by quadrature
    over the remainder's marginals (independent of the closed form)."""
    guide, args, _ = fit(dtype, 5)
    group, x, y, _ = args
    target = guide.engine.natural_targets(args, {})["a"]
    pts, ww = gauss_hermite_2d(*remainder_marginal(guide, ["mu", "tau"]))
    e_tau = (ww * torch.exp(-2 * pts[1])).sum()
    e_mu = (ww * pts[0] * torch.exp(-2 * pts[1])).sum()
    pts, ww = gauss_hermite_2d(*remainder_marginal(guide, ["b", "sigma"]))
    prec = torch.exp(-2 * pts[1])  # (K,)
    e_sig = (ww * prec).sum()
    resid = y.double()[:, None] - x.double()[:, None] * pts[0][None]  # (N, K)
    e_res = (ww * resid * prec).sum(1)
    A = torch.zeros(GROUPS, y.numel(), dtype=torch.float64)
    A[group, torch.arange(y.numel())] = 1.0
    eta1 = A @ e_res + e_mu
    eta2 = -0.5 * A.sum(1) * e_sig - 0.5 * e_tau
    rtol = 1e-9 if dtype == torch.float64 else 2e-4
    assert torch.allclose(target[0].double(), eta1, rtol=rtol, atol=rtol)
    assert torch.allclose(target[1].double(), eta2, rtol=rtol, atol=rtol)


@DTYPES
def test_the_remainder_reads_the_observations_free_of_the_intercept_draw(small_limit, dtype):
    """The remainder's term of ``obs`` at fixed ``(b, sigma)``: the same for two draws of ``a``
    and equal to the brute-force average of ``log N(y; a[g] + b x, sigma)`` over ``q(a)``."""
    guide, args, _ = fit(dtype, 20)
    group, x, y, J = args
    engine = guide.engine
    ctx = SimpleNamespace(block_for=engine.block_for, trace=None)
    b, sigma = torch.tensor(0.7, dtype=dtype), torch.tensor(0.5, dtype=dtype)
    qa = engine.block_for("a")
    qa = qa.natural["a"] if hasattr(qa, "natural") else qa
    eta1, eta2 = (t.detach() for t in qa.natural({}))
    var = -0.5 / eta2
    m, s = eta1 * var, var.sqrt()

    def term(a):
        cond = pyro.poutine.condition(grouped_regression, {"b": b, "sigma": sigma, "a": a})
        tr = pyro.poutine.trace(cond).get_trace(*args)
        mo = block_moments(engine.analysis, ctx, ["obs"], {"a": a})
        return expected_log_prior(tr.nodes["obs"]["fn"], *mo["obs"]).sum()

    with torch.no_grad():
        one = term(m + s * torch.randn_like(m))
        two = term(m + s * torch.randn_like(m))
        many = m.double() + s.double() * torch.randn(20_000, J, dtype=torch.float64)
        loc = many[:, group] + b.double() * x.double()
        lp = dist.Normal(loc, sigma.double()).log_prob(y.double()).sum(-1)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert abs(float(one - two)) < tol * abs(float(one))
    se = float(lp.std() / math.sqrt(lp.numel()))
    assert abs(float(one) - float(lp.mean())) < 4 * se + tol * abs(float(one))


@DTYPES
def test_reported_loss_is_trace_elbo_of_the_same_guide(small_limit, dtype):
    guide, args, losses = fit(dtype, 100)
    reported = torch.tensor(losses[-20:], dtype=torch.float64)
    est, se = bound(grouped_regression, guide, args, particles=200)
    spread = float(reported.std())
    assert abs(float(reported.mean()) - est) < 4 * se + 2 * spread / math.sqrt(20) + 0.05


@DTYPES
def test_bound_is_near_the_dense_tree(small_limit, dtype):
    """The default within 0.3 nat of the dense tree (``{"a": "gaussian"}``: ``(mu, b, a)`` in
    one joint block, which keeps their correlation; measured 0.11 nat lower, float64)."""
    guide, args, _ = fit(dtype, 200)
    ours = bound(grouped_regression, guide, args)
    tree, args, _ = fit(dtype, 200, {"a": "gaussian"})
    assert not getattr(tree.engine.analysis, "observed_beside", {})
    joint = bound(grouped_regression, tree, args)
    assert ours[0] >= joint[0] - 4 * (ours[1] + joint[1])  # (the tree is a richer q)
    assert ours[0] - joint[0] < 0.3 + 4 * (ours[1] + joint[1])


def test_a_scale_not_log_affine_in_the_remainder_keeps_the_joint(small_limit):
    """``obs ~ Normal(a[g] + b x, sigma + 0.1)``: no closed form of ``E[1/s^2]`` in the
    remainder's coordinates, so ``a`` stays in the remainder's joint Gaussian, as before."""
    guide, args, losses = fit(torch.float64, 3, model=shifted_scale)
    an = guide.engine.analysis
    assert "a" in an.remainder and "sigma" in an.remainder
    assert not an.prior_beside and not an.observed_beside
    assert all(math.isfinite(v) for v in losses)


@pytest.mark.slow
def test_long_run_stays_at_the_bound(small_limit):
    """20,000 steps of the rule with both messages beside the remainder (the prior's and the
    observations'; ``tests/test_large_trees.py`` has no long run of its own, the prior's message
    being the same code): the loss stays finite and the bound where it was after 200 steps."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    args, _ = grouped_data(25)(torch.float64)
    guide = AutoCVI(grouped_regression)
    svi = SVI(grouped_regression, guide, CVI(), CVI_ELBO())
    losses = [svi.step(*args) for _ in range(200)]
    early = bound(grouped_regression, guide, args)
    losses += [svi.step(*args) for _ in range(19800)]
    assert all(math.isfinite(v) for v in losses)
    late = bound(grouped_regression, guide, args)
    assert abs(late[0] - early[0]) < 0.1 + 4 * (late[1] + early[1])
