"""Linear-predictor sites in a subsampled plate (``pyro.plate(..., subsample_size=B)``).

Every data point of the plate keeps its own site (eq. 13); a step computes the minibatch's
targets at the current ``q`` and moves those sites only, while the natural parameters of all
the others are held in a running sum (the incremental form of Algorithm 1 on minibatches).
Checked:

* a Normal likelihood (its site targets are its exact rows): once every point has been
  visited, ``q`` is the exact posterior, and the running sum equals the sum of all the sites'
  rows recomputed from the data;
* a Bernoulli likelihood: the fixed point is full-batch CVI's (the same ``q``), reached in a few
  passes, and the reported loss is an unbiased estimate of the full-data -ELBO of ``q``;
* float32 and float64; a 20,000-step run (float32; float64 for 2,000) whose running sum stays
  the sum of its sites.
"""

import math

import numpy
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.gaussian.sites import site_to_row

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def data(N, D, dtype, seed=0, kind="bernoulli"):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = torch.randn(D, generator=g, dtype=torch.float64)
    if kind == "normal":
        y = X @ w + 0.5 * torch.randn(N, generator=g, dtype=torch.float64)
    else:
        y = torch.bernoulli(torch.sigmoid(X @ w), generator=g)
    return X.to(dtype), y.to(dtype)


def make_model(N, B, kind):
    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", N, subsample_size=B) as idx:
            if kind == "normal":
                pyro.sample("y", dist.Normal(X[idx] @ w, 0.5), obs=y[idx])
            else:
                pyro.sample("y", dist.Bernoulli(logits=X[idx] @ w), obs=y[idx])

    return model


def sites_and_sum(guide):
    store = pyro.get_param_store()
    sites = store[f"{guide.engine.prefix}.sites.y"].detach()
    total = store[f"{guide.engine.prefix}.site_sums.y"].detach()
    return sites, total


def assert_sum_of_sites(guide, X, rtol, atol):
    """The running sum equals ``(A^T W A, A^T b)`` of every stored site, recomputed from the
    data (``A = X``, no offset); ``atol(expected)`` gives the absolute tolerance."""
    sites, total = sites_and_sum(guide)
    X64 = X.double()
    zero = torch.zeros(X.shape[0], dtype=torch.float64)
    w, b = site_to_row(sites[:, 0].double(), sites[:, 1].double(), zero)
    P, h = X64.T @ (w[:, None] * X64), X64.T @ b
    torch.testing.assert_close(total[:, :-1].double(), P, rtol=rtol, atol=atol(P))
    torch.testing.assert_close(total[:, -1].double(), h, rtol=rtol, atol=atol(h))


def start(model, seed, **optim):
    """A fresh param store, the seed, and ``(guide, svi)`` with ``CVI(**optim)``."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoCVI(model)
    return guide, SVI(model, guide, CVI(**optim), CVI_ELBO())


def test_explain_names_the_per_point_sites():
    X, y = data(100, 3, torch.float64)
    model = make_model(100, 10, "bernoulli")
    pyro.clear_param_store()
    guide = AutoCVI(model)
    SVI(model, guide, CVI(), CVI_ELBO()).step(X, y)
    text = guide.explain()
    assert "linear-predictor" in text and "subsampled plate 'data'" in text
    assert "100 sites" in text


@DTYPES
def test_a_normal_likelihood_is_exact_once_every_point_is_visited(dtype):
    N, B, D = 60, 7, 3
    X, y = data(N, D, dtype, kind="normal")
    model = make_model(N, B, "normal")
    guide, svi = start(model, 0, step_size=1.0)
    for _ in range(2000):
        svi.step(X, y)
        sites, _ = sites_and_sum(guide)
        if bool((sites[:, 1] != 0).all()):
            break
    assert bool((sites[:, 1] != 0).all()), "some point was never visited"
    X64, y64 = X.double(), y.double()
    P = torch.eye(D, dtype=torch.float64) + X64.T @ X64 / 0.25
    m = torch.linalg.solve(P, X64.T @ y64 / 0.25)
    q = guide.posterior("w")
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    torch.testing.assert_close(q.mean.double(), m, atol=tol, rtol=tol)
    torch.testing.assert_close(
        q.precision_matrix.double(), P, atol=tol * float(P.abs().max()), rtol=tol
    )
    # the running sum is the sum of every stored site's rows
    assert_sum_of_sites(guide, X, rtol=tol * 10, atol=lambda t: tol * 1e3)


_x, _w = numpy.polynomial.hermite_e.hermegauss(40)
GH = torch.tensor(_x), torch.tensor(_w) / math.sqrt(2 * math.pi)


def full_neg_elbo(q, X, y):
    """The full-data -ELBO of ``q(w)`` (Gauss-Hermite per point, closed-form KL), float64."""
    X, y = X.double(), y.double()
    m, S = q.mean.detach().double(), q.covariance_matrix.detach().double()
    fm, fv = X @ m, ((X @ S) * X).sum(-1)
    eta = fm[:, None] + fv.sqrt()[:, None] * GH[0][None]
    ll = (y[:, None] * eta - torch.nn.functional.softplus(eta)) @ GH[1]
    D = X.shape[1]
    prior = dist.MultivariateNormal(
        torch.zeros(D, dtype=torch.float64), torch.eye(D, dtype=torch.float64)
    )
    kl = torch.distributions.kl_divergence(dist.MultivariateNormal(m, S), prior)
    return float(kl - ll.sum())


def full_batch_optimum(X, y):
    N = X.shape[0]

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    pyro.clear_param_store()
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), CVI_ELBO())
    for _ in range(30):
        svi.step(X, y)
    return guide.posterior("w")


@DTYPES
def test_bernoulli_minibatches_reach_the_full_batch_fixed_point(dtype):
    N, B, D = 2000, 50, 4
    X, y = data(N, D, dtype)
    best = full_batch_optimum(X, y)
    model = make_model(N, B, "bernoulli")
    guide, svi = start(model, 1)  # the defaults
    gaps = []
    for _ in range(3):  # three passes over the data
        for _ in range(N // B):
            svi.step(X, y)
        gaps.append(full_neg_elbo(guide.posterior("w"), X, y) - full_neg_elbo(best, X, y))
    assert gaps[-1] < 1.0, gaps
    assert gaps[-1] > -1e-6 if dtype == torch.float64 else gaps[-1] > -1e-2
    for _ in range(10 * N // B):
        svi.step(X, y)
    q = guide.posterior("w")
    sd = best.covariance_matrix.diagonal().sqrt()
    err = ((q.mean - best.mean) / sd).abs().max()
    assert float(err) < (1e-3 if dtype == torch.float64 else 1e-2), err


@DTYPES
def test_the_minibatch_loss_estimates_the_full_bound(dtype):
    N, B, D = 1000, 50, 3
    X, y = data(N, D, dtype, seed=3)
    model = make_model(N, B, "bernoulli")
    guide, svi = start(model, 2)
    for _ in range(60):
        svi.step(X, y)
    losses = torch.tensor([svi.evaluate_loss(X, y) for _ in range(400)], dtype=torch.float64)
    exact = full_neg_elbo(guide.posterior("w"), X, y)
    se = float(losses.std() / math.sqrt(len(losses)))
    assert abs(float(losses.mean()) - exact) < 3 * se + 1e-3, (losses.mean(), exact, se)


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype,steps", [(torch.float32, 20000), (torch.float64, 2000)], ids=["f32", "f64"]
)
def test_long_minibatch_runs_keep_the_running_sum(dtype, steps):
    """20,000 steps (500 passes of 40 minibatches) in float32, where rounding in the running
    sum (one subtraction and one addition of rows per step, never recomputed) accumulates
    fastest; the same path in float64 for 2,000 steps (50 passes), against its tighter
    tolerances. The sum stays the sum of its sites, and ``q`` stays at full-batch CVI's
    fixed point."""
    N, B, D = 1000, 25, 3
    X, y = data(N, D, dtype, seed=4)
    model = make_model(N, B, "bernoulli")
    guide, svi = start(model, 3)
    losses = [svi.step(X, y) for _ in range(steps)]
    assert all(math.isfinite(v) for v in losses)
    rtol = 1e-9 if dtype == torch.float64 else 1e-3
    assert_sum_of_sites(guide, X, rtol=rtol, atol=lambda t: rtol * float(t.abs().max()))
    best = full_batch_optimum(X, y)
    gap = full_neg_elbo(guide.posterior("w"), X, y) - full_neg_elbo(best, X, y)
    assert abs(gap) < (1e-4 if dtype == torch.float64 else 1e-2), gap
