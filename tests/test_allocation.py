"""A Poisson over a sum of products of Gamma latents (Poisson factorisation) sends both
latents exact messages through multinomial allocations (:mod:`pyro_cvi.messages.allocation`).
The fixed point is a plain-torch CAVI loop's, and the reported bound is the augmented
``-ELBO`` of the same ``q`` (an independent Monte Carlo estimate, with the allocations drawn),
above the plain ``-ELBO`` (Trace_ELBO)."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.messages.allocation import PoissonAllocation
from pyro_cvi.messages.augmented import (
    register_augmented_kind,
    registered_augmented_kinds,
    unregister_augmented_kind,
)

DTYPES = [torch.float64, torch.float32]
TOL = {torch.float64: 1e-6, torch.float32: 1e-3}
N, D, K = 6, 5, 2
A_W, B_W, A_Z, B_Z = 0.5, 1.0, 1.0, 1.0


@pytest.fixture(autouse=True)
def allocation_kind():
    """The kind is opt-in (its module docstring): registered for these tests only."""
    kind = PoissonAllocation()
    register_augmented_kind(kind)
    yield kind
    unregister_augmented_kind(kind)


def test_the_kind_is_opt_in(allocation_kind):
    unregister_augmented_kind(allocation_kind)
    assert not any(isinstance(k, PoissonAllocation) for k in registered_augmented_kinds())
    y = _data(torch.float64)
    pyro.clear_param_store()
    guide = AutoCVI(_model)
    SVI(_model, guide, CVI(), CVI_ELBO()).step(y)
    assert "alloc" not in guide.explain()
    register_augmented_kind(allocation_kind)


def _model(y, mask=None):
    with pyro.plate("k", K, dim=-2), pyro.plate("d", D, dim=-1):
        w = pyro.sample("w", dist.Gamma(y.new_tensor(A_W), y.new_tensor(B_W)))
    with pyro.plate("n", N, dim=-2), pyro.plate("k2", K, dim=-1):
        z = pyro.sample("z", dist.Gamma(y.new_tensor(A_Z), y.new_tensor(B_Z)))
    with pyro.plate("n2", N, dim=-2), pyro.plate("d2", D, dim=-1):
        like = dist.Poisson(z @ w)
        pyro.sample("y", like if mask is None else like.mask(mask), obs=y)


def _data(dtype):
    g = torch.Generator().manual_seed(0)
    u = torch.rand(N, K, generator=g, dtype=torch.float64)
    v = torch.rand(K, D, generator=g, dtype=torch.float64)
    return torch.poisson(3.0 * u @ v, generator=g).to(dtype)


def _fit(y, steps, mask=None):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(_model, schedule="sequential")
    svi = SVI(_model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    losses = [svi.step(y, mask) for _ in range(steps)]
    return guide, losses


def _cavi_sweep(y, z, w, mask=None):
    """One plain CAVI sweep of Poisson factorisation on (shape, rate) pairs, in the sequential
    schedule's order (reverse model order: z, then w)."""

    def elog(q):
        return torch.digamma(q[0]) - torch.log(q[1])

    def phi(z, w):
        a = elog(z)[:, :, None] + elog(w)[None, :, :]  # (N, K, D)
        return torch.softmax(a, dim=1)

    m = torch.ones_like(y) if mask is None else mask.to(y)
    y = y * m
    p = phi(z, w)
    z = (A_Z + (y[:, None, :] * p).sum(2), B_Z + m @ (w[0] / w[1]).T)
    p = phi(z, w)
    w = (A_W + (y[:, None, :] * p).sum(0), B_W + (z[0] / z[1]).T @ m)
    return z, w


def _q(guide, name):
    q = guide.posterior(name)
    return q.concentration.detach().double(), q.rate.detach().double()


def _augmented_elbo(y, z, w, draws=5000, batches=10):
    """Monte Carlo ``-ELBO`` of the augmented ``q``: ``q(z) q(w) Multinomial(y, phi)``, the
    allocations drawn (independent of the engine's closed form)."""
    g = torch.Generator().manual_seed(5)
    est = []
    for _ in range(batches):
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
        qz, qw = dist.Gamma(*z), dist.Gamma(*w)
        zs, ws = qz.sample((draws,)), qw.sample((draws,))
        ez = torch.digamma(z[0]) - torch.log(z[1])
        ew = torch.digamma(w[0]) - torch.log(w[1])
        p = torch.softmax(ez[:, :, None] + ew[None, :, :], dim=1).permute(0, 2, 1)  # (N, D, K)
        # K = 2: the allocation of y_nd to the first term is Binomial(y_nd, phi_nd1)
        split = dist.Binomial(y.expand(draws, N, D), probs=p[..., 0])
        s1 = split.sample()
        s = torch.stack([s1, y - s1], -1)
        rates = zs[:, :, None, :] * ws.permute(0, 2, 1)[:, None, :, :]  # (S, N, D, K)
        log_p = dist.Poisson(rates).log_prob(s).sum((1, 2, 3))
        log_q_s = split.log_prob(s1).sum((1, 2))
        log_prior = dist.Gamma(torch.tensor(A_Z, dtype=torch.float64), B_Z).log_prob(zs).sum(
            (1, 2)
        ) + dist.Gamma(torch.tensor(A_W, dtype=torch.float64), B_W).log_prob(ws).sum((1, 2))
        log_q = qz.log_prob(zs).sum((1, 2)) + qw.log_prob(ws).sum((1, 2))
        est.append(float(-(log_p + log_prior - log_q_s - log_q).mean()))
    t = torch.tensor(est, dtype=torch.float64)
    return float(t.mean()), float(t.std() / batches**0.5)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_poisson_factorisation_sweep_is_cavi(dtype, masked):
    """One sequential sweep with ``step_size=1`` is one CAVI sweep (z, then w); a mask
    weights the counts and the rates alike."""
    y = _data(dtype)
    mask = (torch.arange(N * D).reshape(N, D) % 3 != 0) if masked else None
    guide, losses = _fit(y, 20, mask)
    text = guide.explain()
    for name in ("w", "z"):
        line = (
            f"#   {name}: exact expected from {name}, y; Monte Carlo expected from -; sites from -"
        )
        assert line in text
        assert f"y -> {name}            conjugate (alloc) Poisson rate = sum of 60 products" in text
    # CAVI: every step's bound no worse than the last (up to rounding)
    assert all(b <= a + 1e-5 * abs(a) for a, b in zip(losses, losses[1:]))
    z, w = _q(guide, "z"), _q(guide, "w")
    want_z, want_w = _cavi_sweep(y.double(), z, w, mask)
    SVI(_model, guide, CVI(step_size=1.0), loss=CVI_ELBO()).step(y, mask)
    tol = TOL[dtype]
    got = _q(guide, "z") + _q(guide, "w")
    for a, b in zip(got, want_z + want_w):
        assert torch.allclose(a, b, rtol=tol, atol=tol), (a - b).abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_poisson_factorisation_fixed_point_is_cavi(dtype):
    y = _data(dtype)
    guide, _ = _fit(y, 400)
    z, w = _q(guide, "z"), _q(guide, "w")
    z2, w2 = z, w
    for _ in range(200):  # the plain CAVI loop, from the engine's fixed point: it stays
        z2, w2 = _cavi_sweep(y.double(), z2, w2)
    tol = TOL[dtype]
    for a, b in zip(z + w, z2 + w2):
        assert torch.allclose(a, b, rtol=tol, atol=tol), (a - b).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_poisson_factorisation_bound_is_augmented_elbo(dtype):
    y = _data(dtype)
    guide, losses = _fit(y, 60)
    z, w = _q(guide, "z"), _q(guide, "w")
    loss = float(svi_loss(guide, y))
    mc, se = _augmented_elbo(y.double(), z, w)
    assert abs(loss - mc) < 3 * se + (1e-2 if dtype == torch.float32 else 0.0), (loss, mc, se)
    # the augmented -ELBO is above the plain -ELBO of the same q (Jensen), hence above -log Z
    pyro.set_rng_seed(1)
    plain = Trace_ELBO(num_particles=4000, vectorize_particles=True, max_plate_nesting=2)
    ests = torch.tensor([plain.loss(_model, guide, y) for _ in range(10)], dtype=torch.float64)
    assert loss > float(ests.mean()) - 3 * float(ests.std() / 10**0.5)


def svi_loss(guide, y) -> float:
    """The CVI bound at the guide's current q (one step of size 0 does not move q)."""
    svi = SVI(_model, guide, CVI(step_size=1e-300), loss=CVI_ELBO())
    return svi.evaluate_loss(y)


@pytest.mark.parametrize("offset", [0.5, None])
def test_not_a_sum_of_products_is_not_claimed(offset):
    """A rate with another term (an offset) or through a nonlinearity keeps the Monte Carlo
    gradient: the allocations would be a wrong answer there."""

    def model(y):
        with pyro.plate("k", K, dim=-2), pyro.plate("d", D, dim=-1):
            w = pyro.sample("w", dist.Gamma(y.new_tensor(A_W), y.new_tensor(B_W)))
        with pyro.plate("n", N, dim=-2), pyro.plate("k2", K, dim=-1):
            z = pyro.sample("z", dist.Gamma(y.new_tensor(A_Z), y.new_tensor(B_Z)))
        rate = z @ w + offset if offset is not None else (z @ w).sqrt()
        with pyro.plate("n2", N, dim=-2), pyro.plate("d2", D, dim=-1):
            pyro.sample("y", dist.Poisson(rate), obs=y)

    y = _data(torch.float64)
    pyro.clear_param_store()
    guide = AutoCVI(model)
    SVI(model, guide, CVI(), loss=CVI_ELBO()).step(y)
    text = guide.explain()
    assert "conjugate (alloc)" not in text
    assert "#   z: exact expected from z; Monte Carlo expected from -; sites from y" in text
