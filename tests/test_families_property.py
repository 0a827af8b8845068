"""Property tests: natural <-> mean <-> distribution round trips over wide parameter ranges.

Tolerances are *derived from the conditioning* of each map (machine epsilon times the
amplification factor that is inherent to the parameterisation), so the tests also hold
near the edges of the valid set, where the mean parameters carry little information.
Set ``PYRO_CVI_PROPERTY_EXAMPLES`` to run more examples locally.
"""

from __future__ import annotations

import math
import os

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pyro_cvi.families import Bernoulli, Beta, Categorical, Dirichlet, Gamma, Gaussian
from pyro_cvi.families.base import log_minus_digamma

N = int(os.environ.get("PYRO_CVI_PROPERTY_EXAMPLES", "40"))
SETTINGS = dict(max_examples=N, deadline=None, database=None)

dtypes = st.sampled_from([torch.float64, torch.float32])


def log_uniform(lo: float, hi: float):
    return st.floats(math.log(lo), math.log(hi)).map(math.exp)


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(((a - b).abs() / b.abs()).max())


def assert_nat_dist_nat(fam, nat, tol):
    """``dist_to_natural(natural_to_dist(nat)) == nat`` up to ``tol * (|nat| + 1)``."""
    back = fam.dist_to_natural(fam.natural_to_dist(nat))
    for x, y in zip(back, nat):
        err = (x.double() - y.double()).abs()
        assert bool((err <= tol * (y.double().abs() + 1)).all()), float(err.max())


# ---------------------------------------------------------------------------------------- Gamma
@settings(**SETTINGS)
@given(dtype=dtypes, alpha=log_uniform(1e-3, 1e5), rate=log_uniform(1e-4, 1e4))
def test_gamma_round_trips(dtype, alpha, rate):
    fam = Gamma(())
    a64, r64 = torch.tensor(alpha, dtype=torch.float64), torch.tensor(rate, dtype=torch.float64)
    nat = ((a64 - 1).to(dtype), (-r64).to(dtype))
    assert bool(fam.is_valid(nat))
    assert_nat_dist_nat(fam, nat, 4 * eps(dtype))

    mean = fam.natural_to_mean(nat)
    nat2 = fam.mean_to_natural(mean)
    assert bool(fam.is_valid(nat2))
    # backward stability: the recovered parameters reproduce the mean parameters
    mean2 = fam.natural_to_mean(nat2)
    scale = abs(float(mean[0])) + abs(math.log(float(mean[1]))) + 1
    assert abs(float(mean2[0]) - float(mean[0])) <= 16 * eps(dtype) * scale
    assert rel_err(mean2[1], mean[1]) <= 16 * eps(dtype)
    # forward error: bounded by the conditioning of s = log mu2 - mu1 = log a - digamma(a)
    a_rep = nat[0].double() + 1  # the shape actually represented in ``dtype``
    s = float(log_minus_digamma(a_rep))
    alpha2 = nat2[0].double() + 1
    bound = 16 * eps(dtype) * scale / s + 1e-12
    assert rel_err(alpha2, a_rep) <= bound, (float(alpha2), float(a_rep), bound)
    if dtype == torch.float64 and alpha <= 1e3:
        assert rel_err(alpha2, a_rep) <= 1e-9


# ----------------------------------------------------------------------------- Beta/Dirichlet
def _check_dirichlet_like(fam, conc: torch.Tensor, dtype, to_nat, from_nat):
    """Shared checks; ``conc`` is a float64 vector of concentrations."""
    nat = to_nat(conc.to(dtype))
    assert bool(fam.is_valid(nat).all())
    assert_nat_dist_nat(fam, nat, 4 * eps(dtype))
    mean = fam.natural_to_mean(nat)
    assert all(bool((m < 0).all()) for m in mean)
    nat2 = fam.mean_to_natural(mean)
    assert bool(fam.is_valid(nat2).all())
    mean2 = fam.natural_to_mean(nat2)
    total = float(conc.sum())
    scale = math.log1p(total) + 1
    for m2, m in zip(mean2, mean):
        err = float((m2.double() - m.double()).abs().max())
        assert err <= 32 * eps(dtype) * (float(m.abs().max()) + scale), err
    # forward error grows like eps * sum(alpha) (mean params lose information as alpha -> inf)
    conc2 = from_nat(nat2).double()
    bound = 20 * eps(dtype) * (1 + total) + (1e-12 if dtype == torch.float64 else 1e-6)
    assert rel_err(conc2, conc) <= bound, (conc2.tolist(), conc.tolist(), bound)


@settings(**SETTINGS)
@given(dtype=dtypes, a=log_uniform(1e-2, 1e4), b=log_uniform(1e-2, 1e4))
def test_beta_round_trips(dtype, a, b):
    fam = Beta(())
    conc = torch.tensor([a, b], dtype=torch.float64)
    _check_dirichlet_like(
        fam,
        conc,
        dtype,
        lambda c: (c[0] - 1, c[1] - 1),
        lambda nat: torch.stack([nat[0] + 1, nat[1] + 1]),
    )


@settings(**SETTINGS)
@given(dtype=dtypes, conc=st.lists(log_uniform(1e-2, 1e4), min_size=2, max_size=6))
def test_dirichlet_round_trips(dtype, conc):
    fam = Dirichlet((len(conc),))
    c = torch.tensor(conc, dtype=torch.float64)
    _check_dirichlet_like(fam, c, dtype, lambda x: (x - 1,), lambda nat: nat[0] + 1)


# ------------------------------------------------------------------------------------ Gaussian
@st.composite
def gaussians(draw):
    dtype = draw(dtypes)
    dim = draw(st.sampled_from([1, 2, 4]))
    max_cond = 1e6 if dtype == torch.float64 else 1e3
    cond = draw(log_uniform(1.0, max_cond))
    scale = draw(log_uniform(1e-3, 1e3))
    seed = draw(st.integers(0, 2**31 - 1))
    z = draw(st.lists(st.floats(-3, 3), min_size=dim, max_size=dim))
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(dim, dim, dtype=torch.float64, generator=gen))
    eig = scale * torch.logspace(0, math.log10(cond), dim, dtype=torch.float64)
    prec = (q * eig) @ q.T
    prec = 0.5 * (prec + prec.T)
    m = torch.tensor(z, dtype=torch.float64) / math.sqrt(scale)
    return dtype, prec, m


@settings(**SETTINGS)
@given(case=gaussians())
def test_gaussian_round_trips(case):
    dtype, prec, m = case
    dim = prec.shape[-1]
    fam = Gaussian((dim,))
    nat = ((prec @ m).to(dtype), (-0.5 * prec).to(dtype))
    assert bool(fam.is_valid(nat))
    eigs = torch.linalg.eigvalsh(prec)
    cond = float(eigs[-1] / eigs[0])
    rho = 1 + float(m @ m) * float(eigs[-1])  # cancellation in V = mu2 - m m^T
    tol = 64 * dim * eps(dtype) * cond * rho

    def rel(a, b):
        a, b = a.double(), b.double()
        return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))

    def assert_nat_close(n2, n1):
        p1 = -2 * n1[1].double()
        assert rel(-2 * n2[1], p1) <= tol
        err1 = float(torch.linalg.norm(n2[0].double() - n1[0].double()))
        ref1 = float(torch.linalg.norm(n1[0].double()) + torch.linalg.norm(p1) * torch.norm(m))
        assert err1 <= tol * ref1 + 100 * torch.finfo(dtype).tiny

    d = fam.natural_to_dist(nat)
    cov = torch.linalg.inv(prec)
    assert rel(d.covariance_matrix, cov) <= 64 * dim * eps(dtype) * cond
    assert_nat_close(fam.dist_to_natural(d), nat)

    mean = fam.natural_to_mean(nat)
    nat2 = fam.mean_to_natural(mean)
    assert bool(fam.is_valid(nat2))
    assert_nat_close(nat2, nat)
    mean2 = fam.natural_to_mean(nat2)
    assert rel(mean2[1], mean[1]) <= tol


# ------------------------------------------------------------------------------------- discrete
@settings(**SETTINGS)
@given(dtype=dtypes, logits=st.lists(st.floats(-30, 30), min_size=1, max_size=5))
def test_bernoulli_round_trips(dtype, logits):
    fam = Bernoulli((len(logits),))
    eta = torch.tensor(logits, dtype=dtype)
    assert_nat_dist_nat(fam, (eta,), 0.0)
    (p,) = fam.natural_to_mean((eta,))
    (eta2,) = fam.mean_to_natural((p,))
    assert bool(torch.isfinite(eta2).all())
    e = eps(dtype)
    clamp = math.log((1 - e / 2) / (e / 2))
    for x, y, prob in zip(eta2.tolist(), logits, p.tolist()):
        if prob >= 1 - e / 2:  # p rounds to 1: natural parameter is clamped
            assert abs(x - clamp) <= 1e-3 and y >= clamp - 2
        else:  # every representable p keeps its logit (up to rounding of p itself)
            assert abs(x - y) <= 8 * e * (1 + abs(y) + math.exp(y)), (x, y)


@settings(**SETTINGS)
@given(dtype=dtypes, logits=st.lists(st.floats(-20, 20), min_size=2, max_size=6))
@example(dtype=torch.float64, logits=[15.0, -17.0, -16.5])  # round-off of the re-centring
def test_categorical_round_trips(dtype, logits):
    k = len(logits)
    fam = Categorical(k)
    full = torch.tensor(logits, dtype=torch.float64)
    eta = (full[:-1] - full[-1]).to(dtype)
    # logits are re-centred by the largest one: round-off scales with max |eta|, not each |eta_k|
    assert_nat_dist_nat(fam, (eta,), 8 * eps(dtype) * (1 + float(eta.abs().max())))
    (p,) = fam.natural_to_mean((eta,))
    (eta2,) = fam.mean_to_natural((p,))
    assert bool(torch.isfinite(eta2).all())
    probs = torch.softmax(full, -1)
    e = eps(dtype)
    if probs[-1] > 64 * k * e:  # p_K = 1 - sum(p_k) carries an absolute error ~ k * eps
        bound = 8 * e / probs[:-1] + 8 * k * e / probs[-1]
        assert bool(((eta2.double() - eta.double()).abs() <= bound).all())
    else:  # p_K is lost to rounding: clamped at eps / 2, like the Bernoulli
        assert float(eta2.max()) <= math.log(2 / e) + 1e-3
