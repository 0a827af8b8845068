"""Unit tests for the exponential-family core (``pyro_cvi.families``).

Every family is checked against ``torch.distributions`` built independently from the usual
(shape/rate, mean/covariance, ...) parameters, in float64 and float32.
"""

from __future__ import annotations

import math

import pyro.distributions as pdist
import pytest
import torch
import torch.distributions as td
from pyro.distributions.torch_distribution import TorchDistributionMixin
from torch.distributions import constraints

from pyro_cvi.families import (
    Bernoulli,
    Beta,
    Categorical,
    Dirichlet,
    ExponentialFamily,
    Gamma,
    Gaussian,
    GaussianDiag,
    family_for_support,
    fisher_solve_mean_grad,
    mean_grad_via_autograd,
)
from pyro_cvi.families.base import (
    digamma_diff,
    dirichlet_from_mean_log,
    exclusive_sum,
    inv_log_minus_digamma,
    log_minus_digamma,
    x_trigamma_minus_one,
)

DTYPES = [torch.float64, torch.float32]
BATCH = (3,)


# ------------------------------------------------------------------------------------ fixtures
def _spd(d: int, batch, dtype, gen, cond: float = 30.0) -> torch.Tensor:
    """Random SPD matrices with eigenvalues log-spaced in [1, cond]."""
    q, _ = torch.linalg.qr(torch.randn(batch + (d, d), dtype=torch.float64, generator=gen))
    eig = torch.logspace(0, math.log10(cond), d, dtype=torch.float64)
    return (q * eig) @ q.mT


def _pos(shape, lo, hi, gen):
    """Log-uniform positive numbers in [lo, hi] (float64)."""
    u = torch.rand(shape, dtype=torch.float64, generator=gen)
    return torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))


def make_case(name: str, dtype: torch.dtype, seed: int = 0):
    """(family, reference torch distribution with batch shape BATCH) for a case name."""
    gen = torch.Generator().manual_seed(seed)
    b = BATCH

    def t(x):
        return x.to(dtype)

    if name == "gaussian_scalar":
        ref = td.Normal(t(torch.randn(b, generator=gen)), t(_pos(b, 0.3, 3.0, gen)))
        return Gaussian(()), ref
    if name.startswith("gaussian_full"):
        d = int(name.split("_")[-1])
        cov = _spd(d, b, dtype, gen)
        ref = td.MultivariateNormal(t(torch.randn(b + (d,), generator=gen)), t(cov))
        return Gaussian((d,)), ref
    if name == "gaussian_flat_2x3":
        cov = _spd(6, b, dtype, gen)
        mvn = td.MultivariateNormal(t(torch.randn(b + (6,), generator=gen)), t(cov))
        rt = td.transforms.ReshapeTransform(torch.Size((6,)), torch.Size((2, 3)))
        return Gaussian((2, 3)), td.TransformedDistribution(mvn, [rt])
    if name == "gaussian_diag":
        loc, scale = torch.randn(b + (4,), generator=gen), _pos(b + (4,), 0.2, 5.0, gen)
        return GaussianDiag((4,)), td.Independent(td.Normal(t(loc), t(scale)), 1)
    if name == "gamma":
        conc, rate = _pos(b + (4,), 0.05, 30.0, gen), _pos(b + (4,), 0.1, 10.0, gen)
        return Gamma((4,)), td.Independent(td.Gamma(t(conc), t(rate)), 1)
    if name == "beta":
        a, c = _pos(b + (2,), 0.1, 20.0, gen), _pos(b + (2,), 0.1, 20.0, gen)
        return Beta((2,)), td.Independent(td.Beta(t(a), t(c)), 1)
    if name == "dirichlet":
        return Dirichlet((4,)), td.Dirichlet(t(_pos(b + (4,), 0.1, 20.0, gen)))
    if name == "dirichlet_2x3":
        conc = _pos(b + (2, 3), 0.2, 20.0, gen)
        return Dirichlet((2, 3)), td.Independent(td.Dirichlet(t(conc)), 1)
    if name == "bernoulli":
        logits = 3 * torch.randn(b + (5,), generator=gen)
        return Bernoulli((5,)), td.Independent(td.Bernoulli(logits=t(logits)), 1)
    if name == "categorical":
        logits = 2 * torch.randn(b + (4,), generator=gen)
        return Categorical(4), td.Categorical(logits=t(logits))
    if name == "categorical_event":
        logits = 2 * torch.randn(b + (2, 3), generator=gen)
        return Categorical(3, (2,)), td.Independent(td.Categorical(logits=t(logits)), 1)
    raise KeyError(name)


CASES = [
    "gaussian_scalar",
    "gaussian_full_1",
    "gaussian_full_3",
    "gaussian_full_8",
    "gaussian_flat_2x3",
    "gaussian_diag",
    "gamma",
    "beta",
    "dirichlet",
    "dirichlet_2x3",
    "bernoulli",
    "categorical",
    "categorical_event",
]


def _tol(dtype):
    return dict(rtol=1e-8, atol=1e-9) if dtype == torch.float64 else dict(rtol=2e-3, atol=2e-4)


def _close(a, b, **kw):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y.to(x.dtype).expand_as(x), **kw)


def _base(d):
    """Strip Independent / Reshape wrappers (for torch's entropy / KL registries)."""
    while isinstance(d, (td.Independent, td.TransformedDistribution)):
        d = d.base_dist
    return d


def _ref_mean(name, fam, ref):
    """Mean parameters from closed forms written independently of the family code."""
    d = _base(ref)
    if isinstance(d, td.MultivariateNormal):
        m = d.loc
        return m, d.covariance_matrix + m.unsqueeze(-1) * m.unsqueeze(-2)
    if isinstance(d, td.Normal):
        return d.loc, d.scale**2 + d.loc**2
    if isinstance(d, td.Gamma):
        return torch.digamma(d.concentration) - torch.log(d.rate), d.concentration / d.rate
    if isinstance(d, td.Beta):
        a, b = d.concentration1, d.concentration0
        return torch.digamma(a) - torch.digamma(a + b), torch.digamma(b) - torch.digamma(a + b)
    if isinstance(d, td.Dirichlet):
        a = d.concentration
        return (torch.digamma(a) - torch.digamma(a.sum(-1, keepdim=True)),)
    if isinstance(d, td.Bernoulli):
        return (d.probs,)
    if isinstance(d, td.Categorical):
        return (d.probs[..., :-1],)
    raise TypeError(type(d))


# ------------------------------------------------------------------------------ core identities
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("name", CASES)
def test_round_trips(name, dtype):
    fam, ref = make_case(name, dtype)
    nat = fam.dist_to_natural(ref)
    assert all(p.dtype == dtype for p in nat)
    assert fam.batch_shape(nat) == torch.Size(BATCH)
    for p, s in zip(nat, fam.param_shapes):
        assert p.shape == BATCH + s
    mean = fam.natural_to_mean(nat)
    assert all(m.dtype == dtype and m.shape == p.shape for m, p in zip(mean, nat))
    _close(fam.mean_to_natural(mean), nat, **_tol(dtype))
    d = fam.natural_to_dist(nat)
    assert d.event_shape == fam.event_shape
    assert d.batch_shape == torch.Size(BATCH)
    assert isinstance(d, TorchDistributionMixin), "must be usable as a Pyro guide dist"
    _close(fam.dist_to_natural(d), nat, **_tol(dtype))
    _close(fam.unflatten(fam.flatten(nat)), nat, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("name", CASES)
def test_log_prob_matches_torch(name, dtype):
    """``log h + <lam, phi(x)> - A(lam)`` equals torch's log density (checks ``A`` and ``h``)."""
    fam, ref = make_case(name, dtype, seed=1)
    nat = fam.dist_to_natural(ref)
    torch.manual_seed(0)
    x = ref.sample((5,))
    expected = ref.log_prob(x)
    manual = fam.base_log_measure(x) + fam.inner(nat, fam.sufficient_stats(x))
    manual = manual - fam.log_partition(nat)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(manual, expected, **tol)
    torch.testing.assert_close(fam.log_prob(nat, x), expected, **tol)
    torch.testing.assert_close(fam.natural_to_dist(nat).log_prob(x), expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("name", CASES)
def test_mean_params_closed_form_and_monte_carlo(name, dtype):
    fam, ref = make_case(name, dtype, seed=2)
    nat = fam.dist_to_natural(ref)
    mean = fam.natural_to_mean(nat)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    _close(mean, _ref_mean(name, fam, ref), **tol)

    # Monte Carlo with torch's own sampler, in float64 to keep the test about the means.
    fam64, ref64 = make_case(name, torch.float64, seed=2)
    torch.manual_seed(3)
    n = 20000
    stats = fam64.sufficient_stats(ref64.sample((n,)))
    for s, m in zip(stats, mean):
        avg, se = s.mean(0), s.std(0) / math.sqrt(n)
        z = (avg - m.double()).abs() / (se + 1e-12)
        assert float(z.max()) < 5.0, f"MC mean off by {float(z.max()):.1f} standard errors"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("name", CASES)
def test_log_partition_gradient_is_mean(name, dtype):
    fam, ref = make_case(name, dtype, seed=4)
    nat = tuple(p.detach().requires_grad_(True) for p in fam.dist_to_natural(ref))
    grads = torch.autograd.grad(fam.log_partition(nat).sum(), nat)
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    _close(grads, fam.natural_to_mean(tuple(p.detach() for p in nat)), **tol)


@pytest.mark.parametrize("name", CASES)
def test_log_partition_finite_differences(name):
    fam, ref = make_case(name, torch.float64, seed=5)
    nat = fam.dist_to_natural(ref)
    gen = torch.Generator().manual_seed(6)
    direction = fam.symmetrize(
        tuple(torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in nat)
    )
    h = 1e-6
    plus = fam.log_partition(tuple(p + h * v for p, v in zip(nat, direction)))
    minus = fam.log_partition(tuple(p - h * v for p, v in zip(nat, direction)))
    fd = (plus - minus) / (2 * h)
    expected = fam.inner(fam.natural_to_mean(nat), direction)
    torch.testing.assert_close(fd, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("name", CASES)
def test_entropy_and_kl_match_torch(name, dtype):
    fam, ref_q = make_case(name, dtype, seed=7)
    _, ref_p = make_case(name, dtype, seed=8)
    nat_q, nat_p = fam.dist_to_natural(ref_q), fam.dist_to_natural(ref_p)
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=5e-4)
    base_q, base_p = _base(ref_q), _base(ref_p)
    extra = fam.event_dim - len(base_q.event_shape)
    if isinstance(ref_q, td.TransformedDistribution):
        extra = 0
    ent = base_q.entropy()
    kl = td.kl_divergence(base_q, base_p)
    if extra > 0:
        ent, kl = ent.flatten(-extra).sum(-1), kl.flatten(-extra).sum(-1)
    torch.testing.assert_close(fam.entropy(nat_q), ent, **tol)
    torch.testing.assert_close(fam.kl(nat_q, nat_p), kl, **tol)
    torch.testing.assert_close(fam.kl(nat_q, nat_q), torch.zeros_like(kl), **tol)
    # the generic Bregman divergence agrees with the specialised closed forms
    generic = ExponentialFamily.kl(fam, nat_q, nat_p)
    torch.testing.assert_close(generic, kl, rtol=tol["rtol"] * 10, atol=tol["atol"] * 10)


# ------------------------------------------------------------------------------------- validity
def _invalid_examples(name, dtype):
    """(family, natural params of batch (3,) whose entry 1 is invalid)."""
    fam, ref = make_case(name, dtype, seed=9)
    nat = [p.clone(memory_format=torch.contiguous_format) for p in fam.dist_to_natural(ref)]
    bad = []
    nan = float("nan")
    if isinstance(fam, Gaussian) and fam.event_dim >= 1:
        # indefinite precision: flip the sign of one eigen-direction
        lam = -2 * nat[1][1]
        eigval, eigvec = torch.linalg.eigh(lam)
        eigval = eigval.clone()
        eigval[0] = -eigval[0] - 0.1
        eta2 = -0.5 * (eigvec * eigval) @ eigvec.mT
        bad.append((nat[0], torch.stack([nat[1][0], eta2, nat[1][2]])))
    elif isinstance(fam, (Gaussian, GaussianDiag)):
        e2 = nat[1].clone()
        e2[1] = 0.3 if e2[1].dim() == 0 else e2[1].abs()
        bad.append((nat[0], e2))
        e2 = nat[1].clone()
        e2[1] = 0.0
        bad.append((nat[0], e2))
    elif isinstance(fam, Gamma):
        e1 = nat[0].clone()
        e1[1, 0] = -1.0  # alpha = 0
        bad.append((e1, nat[1]))
        e2 = nat[1].clone()
        e2[1, 2] = 0.0  # rate = 0
        bad.append((nat[0], e2))
    elif isinstance(fam, (Beta, Dirichlet)):
        e = nat[-1].clone()
        e.view(3, -1)[1, -1] = -1.5
        bad.append(tuple(nat[:-1]) + (e,))
    for idx in range(len(nat)):
        for val in (nan, float("inf"), -float("inf")):
            p = nat[idx].clone(memory_format=torch.contiguous_format)
            p.view(3, -1)[1, 0] = val
            bad.append(tuple(nat[:idx]) + (p,) + tuple(nat[idx + 1 :]))
    return fam, tuple(nat), bad


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("name", CASES)
def test_is_valid_and_validate(name, dtype):
    fam, good, bad_list = _invalid_examples(name, dtype)
    valid = fam.is_valid(good)
    assert valid.shape == torch.Size(BATCH) and bool(valid.all())
    fam.validate(good, "z")
    assert len(bad_list) >= 3
    for bad in bad_list:
        assert fam.is_valid(bad).tolist() == [True, False, True]
        with pytest.raises(ValueError, match=r"site 'my_site'.*batch index \(1,\)"):
            fam.validate(bad, "my_site")


def test_gaussian_singular_precision_jitter_only_in_float32():
    fam = Gaussian((2,))
    nat64 = (torch.zeros(2, dtype=torch.float64), -0.5 * torch.ones(2, 2, dtype=torch.float64))
    assert not bool(fam.is_valid(nat64))
    with pytest.raises(ValueError, match="not positive definite"):
        fam.natural_to_dist(nat64)
    nat32 = tuple(p.float() for p in nat64)
    d = fam.natural_to_dist(nat32)  # Cholesky fails, retried with a tiny jitter
    assert torch.isfinite(d.scale_tril).all()


def test_gaussian_scale_tril_is_accurate_for_ill_conditioned_precision():
    gen = torch.Generator().manual_seed(0)
    prec = _spd(6, (2,), torch.float64, gen, cond=1e5)
    m = torch.randn(2, 6, dtype=torch.float64, generator=gen)
    fam = Gaussian((6,))
    nat64 = ((prec @ m.unsqueeze(-1)).squeeze(-1), -0.5 * prec)
    d64 = fam.natural_to_dist(nat64)
    cov = torch.linalg.inv(prec)
    torch.testing.assert_close(d64.covariance_matrix, cov, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(d64.loc, m, rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(d64.precision_matrix, prec, rtol=1e-7, atol=1e-9)


# --------------------------------------------------------------------------- support -> family
@pytest.mark.parametrize(
    "support, event_shape, kwargs, cls, name",
    [
        (constraints.real, (), {}, Gaussian, "gaussian"),
        (constraints.real_vector, (5,), {}, Gaussian, "gaussian"),
        (constraints.real_vector, (5,), {"covariance": "diag"}, GaussianDiag, "gaussian_diag"),
        (constraints.independent(constraints.real, 2), (2, 3), {}, Gaussian, "gaussian"),
        (constraints.positive, (3,), {}, Gamma, "gamma"),
        (constraints.independent(constraints.positive, 1), (3,), {}, Gamma, "gamma"),
        (constraints.nonnegative, (), {}, Gamma, "gamma"),
        (constraints.unit_interval, (), {}, Beta, "beta"),
        (constraints.simplex, (4,), {}, Dirichlet, "dirichlet"),
        (constraints.boolean, (2,), {}, Bernoulli, "bernoulli"),
        (constraints.integer_interval(0, 4), (), {}, Categorical, "categorical"),
    ],
)
def test_family_for_support(support, event_shape, kwargs, cls, name):
    fam = family_for_support(support, torch.Size(event_shape), **kwargs)
    assert type(fam) is cls and fam.name == name
    assert fam.event_shape == torch.Size(event_shape)
    if cls is Categorical:
        assert fam.num_categories == 5


def test_family_for_support_matches_pyro_distributions():
    cases = [
        (pdist.Normal(0.0, 1.0), "gaussian"),
        (pdist.MultivariateNormal(torch.zeros(3), torch.eye(3)), "gaussian"),
        (pdist.Gamma(2.0, 1.0).expand([4]).to_event(1), "gamma"),
        (pdist.Beta(2.0, 3.0), "beta"),
        (pdist.Dirichlet(torch.ones(3)), "dirichlet"),
        (pdist.Bernoulli(0.3), "bernoulli"),
        (pdist.Categorical(logits=torch.zeros(6)), "categorical"),
    ]
    for d, name in cases:
        fam = family_for_support(d.support, d.event_shape)
        assert fam.name == name
        nat = fam.dist_to_natural(d)
        assert bool(fam.is_valid(nat).all())
        x = d.sample()
        torch.testing.assert_close(fam.log_prob(nat, x), d.log_prob(x))


@pytest.mark.parametrize(
    "support, event_shape",
    [
        (constraints.nonnegative_integer, ()),
        (constraints.interval(-1.0, 2.0), ()),
        (constraints.lower_cholesky, (3, 3)),
        (constraints.positive_definite, (3, 3)),
        (constraints.greater_than(1.0), ()),
        (constraints.integer_interval(1, 4), ()),
        (constraints.simplex, ()),
    ],
)
def test_family_for_support_rejects_with_helpful_message(support, event_shape):
    with pytest.raises(ValueError) as info:
        family_for_support(support, torch.Size(event_shape))
    msg = str(info.value)
    assert str(support) in msg
    assert "AutoNormal" in msg and "reparameterize" in msg


def test_family_for_support_bad_covariance_option():
    with pytest.raises(ValueError, match="covariance"):
        family_for_support(constraints.real, (), covariance="lowrank")


# ------------------------------------------------------------------------- Fisher solve (App. F)
def _test_function(fam):
    """A nonlinear f(mu) (symmetric in a matrix-valued mu2)."""

    def f(mean):
        mean = fam.symmetrize(mean)
        out = 0.0
        for i, m in enumerate(mean):
            w = torch.linspace(0.5, 1.5, m.numel() // m.shape[0], dtype=m.dtype)
            flat = m.reshape(m.shape[0], -1)
            out = out + (i + 1) * (w * flat).sum(-1) + 0.1 * (flat.sum(-1)) ** 2
        return out

    return f


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize(
    "name",
    ["gaussian_scalar", "gaussian_full_3", "gaussian_diag", "gamma", "beta", "dirichlet"]
    + ["bernoulli", "categorical"],
)
def test_mean_grad_via_fisher_solve_equals_direct_gradient(name, dtype):
    fam, ref = make_case(name, dtype, seed=10)
    nat = fam.dist_to_natural(ref)
    f = _test_function(fam)
    mean = tuple(m.detach().requires_grad_(True) for m in fam.natural_to_mean(nat))
    direct = torch.autograd.grad(f(mean).sum(), mean)
    via_fisher = mean_grad_via_autograd(fam, nat, f)
    tol = dict(rtol=1e-7, atol=1e-7) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    _close(via_fisher, direct, **tol)
    # f given as a function of the natural parameters gives the same answer
    via_nat = mean_grad_via_autograd(fam, nat, lambda lam: f(fam.natural_to_mean(lam)), "natural")
    _close(via_nat, direct, **tol)


def test_fisher_solve_of_fisher_times_vector_is_identity():
    fam, ref = make_case("gaussian_full_3", torch.float64, seed=11)
    nat = fam.dist_to_natural(ref)
    gen = torch.Generator().manual_seed(0)
    v = fam.symmetrize(tuple(torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in nat))
    # F v = d/dt mu(lam + t v) at t = 0, by forward differences of the exact map
    h = 1e-6
    plus = fam.natural_to_mean(tuple(p + h * q for p, q in zip(nat, v)))
    minus = fam.natural_to_mean(tuple(p - h * q for p, q in zip(nat, v)))
    fv = tuple((a - b) / (2 * h) for a, b in zip(plus, minus))
    _close(fisher_solve_mean_grad(fam, nat, fv), v, rtol=1e-5, atol=1e-6)


def test_gaussian_mean_grad_matches_opper_archambeau():
    """``f = E_q[a^T z - z^T B z / 2] = a^T mu1 - tr(B mu2) / 2`` has ``df/dmu = (a, -B/2)``."""
    fam, ref = make_case("gaussian_full_3", torch.float64, seed=12)
    nat = fam.dist_to_natural(ref)
    a = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64)
    b = torch.tensor([[2.0, 0.5, 0.0], [0.5, 1.0, -0.2], [0.0, -0.2, 3.0]], dtype=torch.float64)

    def expected_g(lam):  # E[a^T z - z^T B z / 2] as a function of natural params
        m, mu2 = fam.natural_to_mean(lam)
        return (m * a).sum(-1) - 0.5 * (b * mu2).sum((-2, -1))

    g1, g2 = mean_grad_via_autograd(fam, nat, expected_g, wrt="natural")
    torch.testing.assert_close(g1, a.expand_as(g1), rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(g2, (-0.5 * b).expand_as(g2), rtol=1e-8, atol=1e-8)


# --------------------------------------------------------------------------- special functions
def test_log_minus_digamma_and_trigamma_helpers():
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 30
    xs = [1e-3, 0.1, 1.0, 3.0, 7.9, 8.0, 20.0, 1e3, 1e6]
    x = torch.tensor(xs, dtype=torch.float64)
    ref1 = torch.tensor([float(mpmath.log(v) - mpmath.digamma(v)) for v in xs], dtype=x.dtype)
    ref2 = torch.tensor([float(v * mpmath.psi(1, v) - 1) for v in xs], dtype=x.dtype)
    torch.testing.assert_close(log_minus_digamma(x), ref1, rtol=1e-13, atol=0)
    torch.testing.assert_close(x_trigamma_minus_one(x), ref2, rtol=1e-8, atol=0)
    torch.testing.assert_close(log_minus_digamma(x.float()), ref1.float(), rtol=2e-6, atol=0)


def test_digamma_diff_has_no_cancellation():
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    pairs = [(1e-3, 1e-8), (0.5, 2.0), (5.0, 1e-3), (1e4, 1e-2), (1e6, 1.0), (3.0, 1e5)]
    x = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    d = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    ref = torch.tensor(
        [float(mpmath.digamma(a) - mpmath.digamma(mpmath.mpf(a) + b)) for a, b in pairs],
        dtype=torch.float64,
    )
    torch.testing.assert_close(digamma_diff(x, d), ref, rtol=1e-13, atol=0)
    torch.testing.assert_close(digamma_diff(x.float(), d.float()), ref.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_gamma_digamma_inversion_accuracy(dtype, rtol):
    alpha = torch.logspace(-3, 6, 400, dtype=torch.float64)
    s = log_minus_digamma(alpha)  # accurate forward map (checked above)
    est = inv_log_minus_digamma(s.to(dtype))
    assert est.dtype == dtype
    torch.testing.assert_close(est.double(), alpha, rtol=rtol, atol=0)
    assert torch.isnan(inv_log_minus_digamma(torch.tensor([-1.0, 0.0], dtype=dtype))).all()


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-9), (torch.float32, 5e-3)])
def test_dirichlet_inversion_accuracy(dtype, rtol):
    gen = torch.Generator().manual_seed(0)
    alpha = _pos((300, 3), 1e-2, 1e4, gen)
    mu = digamma_diff(alpha, exclusive_sum(alpha))
    est = dirichlet_from_mean_log(mu.to(dtype))
    torch.testing.assert_close(est.double(), alpha, rtol=rtol, atol=0)
    back = digamma_diff(est, exclusive_sum(est)).double()
    torch.testing.assert_close(back, mu, rtol=4 * torch.finfo(dtype).eps * 10, atol=0)
    invalid = torch.tensor([[0.1, -1.0], [-0.1, -0.1]], dtype=dtype)  # mu >= 0 / sum exp >= 1
    assert torch.isnan(dirichlet_from_mean_log(invalid)).all()


def test_zero_natural_and_dtype_following():
    fam = Gaussian((3,))
    z = fam.zero_natural((2, 5), dtype=torch.float32)
    assert [p.shape for p in z] == [torch.Size((2, 5, 3)), torch.Size((2, 5, 3, 3))]
    assert all(p.dtype == torch.float32 and not p.any() for p in z)
    like = Categorical(4).zeros_like_natural((torch.ones(2, 3, dtype=torch.float64),))
    assert like[0].dtype == torch.float64 and like[0].shape == (2, 3)
    x = torch.tensor([0, 3, 1])
    (stat,) = Categorical(4).sufficient_stats(x)
    assert stat.tolist() == [[1, 0, 0], [0, 0, 0], [0, 1, 0]]


def test_dist_to_natural_rejects_wrong_distribution():
    with pytest.raises(TypeError):
        Gamma(()).dist_to_natural(td.Normal(0.0, 1.0))
    with pytest.raises(TypeError):
        Categorical(3).dist_to_natural(td.Bernoulli(0.2))


# --------------------------------------------------------------------- CVI helpers per family
CONTINUOUS = [c for c in CASES if not c.startswith(("bernoulli", "categorical"))]
GAUSSIAN_CASES = [c for c in CASES if c.startswith("gaussian")]
DISCRETE_CASES = ["bernoulli", "categorical", "categorical_event"]
BOX_FAMILIES = {"gamma", "beta", "dirichlet", "dirichlet_2x3"}


def _random_like(params, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(p.shape, dtype=torch.float64, generator=gen).to(p) for p in params)


def _dist_mean(d, shape):
    """``E z`` of a family's distribution, reshaped like a value (handles the Reshape wrapper)."""
    if isinstance(d, td.TransformedDistribution):
        d = d.base_dist
    return d.mean.reshape(shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(
    "name", ["gaussian_scalar", "gaussian_diag", "gamma", "beta", "dirichlet", "gaussian_full_1"]
)
def test_mean_grad_closed_forms_equal_fisher_solve(name, dtype):
    fam, ref = make_case(name, torch.float64, seed=20)
    nat = fam.dist_to_natural(ref)
    grad = _random_like(nat, seed=1)
    generic = fisher_solve_mean_grad(fam, nat, grad)  # in float64: the reference
    closed = fam.mean_grad(tuple(p.to(dtype) for p in nat), tuple(g.to(dtype) for g in grad))
    assert [c.shape for c in closed] == [g.shape for g in generic]
    assert all(c.dtype == dtype for c in closed)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    for c, g in zip(closed, generic):
        torch.testing.assert_close(c.double(), g, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["gaussian_full_3", "bernoulli", "categorical"])
def test_mean_grad_default_is_the_fisher_solve(name):
    fam, ref = make_case(name, torch.float64, seed=21)
    nat = fam.dist_to_natural(ref)
    grad = fam.symmetrize(_random_like(nat, seed=2))
    for c, g in zip(fam.mean_grad(nat, grad), fisher_solve_mean_grad(fam, nat, grad)):
        assert torch.equal(c, g)


@pytest.mark.parametrize("with_prior", [True, False], ids=["prior", "no_prior"])
@pytest.mark.parametrize("name", CONTINUOUS)
def test_natural_at_gives_a_q_with_that_mean(name, with_prior):
    fam, ref = make_case(name, torch.float64, seed=22)
    _, other = make_case(name, torch.float64, seed=23)
    value = _dist_mean(ref, ref.sample().shape)
    prior = fam.dist_to_natural(other) if with_prior else None
    nat = fam.natural_at(value, prior)
    assert bool(fam.is_valid(nat).all())
    got = _dist_mean(fam.natural_to_dist(nat), value.shape)
    torch.testing.assert_close(got, value, rtol=1e-10, atol=1e-12)
    if with_prior and fam.is_gaussian:  # the spread is the prior's
        torch.testing.assert_close(nat[1], prior[1].expand_as(nat[1]), rtol=1e-14, atol=0)
    # integer values are cast to the default dtype
    assert fam.natural_at(value.round().clamp(min=1).long())[0].dtype == torch.get_default_dtype()


@pytest.mark.parametrize("name", DISCRETE_CASES)
def test_natural_at_fallback_is_the_prior_else_zero(name):
    fam, ref = make_case(name, torch.float64, seed=24)
    prior = fam.dist_to_natural(ref)
    value = ref.sample()
    assert fam.natural_at(value, prior) is prior
    zero = fam.natural_at(value)
    assert [z.shape for z in zero] == [p.shape for p in prior]
    dtype = value.dtype if value.is_floating_point() else torch.get_default_dtype()
    assert all(z.dtype == dtype and not z.any() for z in zero)


@pytest.mark.parametrize("name", CASES)
def test_mean_value_and_geometric_mean(name):
    fam, ref = make_case(name, torch.float64, seed=25)
    nat = fam.dist_to_natural(ref)
    mean = fam.natural_to_mean(nat)
    value = fam.mean_value(nat, mean)
    geo = fam.geometric_mean(nat, mean)
    if fam.is_discrete:
        assert value is None and geo is None
        return
    shape = ref.sample().shape
    torch.testing.assert_close(value, _dist_mean(ref, shape), rtol=1e-10, atol=1e-12)
    if isinstance(fam, Gamma):
        d = _base(ref)
        expected = torch.exp(torch.digamma(d.concentration) - torch.log(d.rate))
        torch.testing.assert_close(geo, expected, rtol=1e-12, atol=0)
    else:
        assert geo is None
    # differentiable w.r.t. the mean parameters where the value is a function of them
    if fam.is_gaussian or isinstance(fam, Gamma):
        leaves = tuple(m.detach().requires_grad_(True) for m in mean)
        assert fam.mean_value(nat, leaves).requires_grad


@pytest.mark.parametrize("name", DISCRETE_CASES)
def test_probs_of_discrete_families(name):
    fam, ref = make_case(name, torch.float64, seed=26)
    assert fam.is_discrete and not fam.is_gaussian
    mean = tuple(m.requires_grad_(True) for m in fam.natural_to_mean(fam.dist_to_natural(ref)))
    probs = fam.probs(mean)
    assert probs.shape[-1] == fam.num_values
    assert probs.shape[:-1] == ref.sample().shape
    assert bool((probs >= 0).all())
    torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs[..., 0]), rtol=0, atol=1e-12)
    d = _base(ref)
    expected = torch.stack([1 - d.probs, d.probs], -1) if isinstance(fam, Bernoulli) else d.probs
    torch.testing.assert_close(probs, expected, rtol=1e-10, atol=1e-12)
    assert probs.requires_grad  # differentiable in the mean parameters


def test_discrete_attributes():
    assert Bernoulli((3,)).num_values == 2 and Categorical(5, (2,)).num_values == 5
    for fam in (Gaussian((2,)), GaussianDiag(()), Gamma(()), Beta(()), Dirichlet((3,))):
        assert not fam.is_discrete and fam.num_values is None
        with pytest.raises(NotImplementedError):
            fam.probs(fam.zero_natural())
    assert Gaussian((2,)).is_gaussian and GaussianDiag((2,)).is_gaussian
    assert not any(f.is_gaussian for f in (Gamma(()), Beta(()), Dirichlet((3,)), Bernoulli()))
    assert Dirichlet((2, 3)).vector_valued and Gaussian((3,)).vector_valued
    assert not any(f.vector_valued for f in (Gaussian(()), GaussianDiag((3,)), Beta((2,))))


@pytest.mark.parametrize("name", GAUSSIAN_CASES)
def test_variance_along_and_marginal_variance_match_torch(name):
    fam, ref = make_case(name, torch.float64, seed=27)
    nat = fam.dist_to_natural(ref)
    mean = fam.natural_to_mean(nat)
    d = _base(ref)
    if isinstance(d, td.MultivariateNormal):
        blocks = list(d.covariance_matrix)
    else:  # Normal: independent entries
        blocks = [torch.diag(v.reshape(-1)) for v in d.variance.reshape(BATCH[0], -1)]
    cov = torch.block_diag(*blocks)  # Cov of the flattened batched latent
    gen = torch.Generator().manual_seed(3)
    A = torch.randn(5, cov.shape[0], dtype=torch.float64, generator=gen)
    torch.testing.assert_close(
        fam.variance_along(mean, A), (A @ cov @ A.mT).diagonal(), rtol=1e-10, atol=1e-10
    )
    var = fam.marginal_variance(mean)
    assert var.shape == mean[0].shape
    expected = torch.stack([b.diagonal() for b in blocks]).reshape(var.shape)
    torch.testing.assert_close(var, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["gamma", "beta", "dirichlet"])
def test_non_gaussian_families_have_no_variance_along(name):
    fam, ref = make_case(name, torch.float64)
    mean = fam.natural_to_mean(fam.dist_to_natural(ref))
    with pytest.raises(NotImplementedError):
        fam.variance_along(mean, torch.ones(1, 12, dtype=torch.float64))
    with pytest.raises(NotImplementedError):
        fam.marginal_variance(mean)


@pytest.mark.parametrize("name", CASES)
def test_natural_bounds_agree_with_is_valid(name):
    fam, ref = make_case(name, torch.float64, seed=28)
    nat = fam.dist_to_natural(ref)
    if name not in BOX_FAMILIES:
        assert fam.natural_bounds is None
        return
    bounds = fam.natural_bounds
    assert len(bounds) == len(fam.param_shapes)
    for i, (lo, hi) in enumerate(bounds):
        for bound, inside in ((lo, 1.0), (hi, -1.0)):
            if bound is None:
                continue
            for offset, ok in ((0.0, False), (1e-9 * inside, True), (-0.5 * inside, False)):
                p = nat[i].clone()
                p.reshape(BATCH[0], -1)[1, 0] = bound + offset
                valid = fam.is_valid(nat[:i] + (p,) + nat[i + 1 :])
                assert valid.tolist() == [True, ok, True], (i, bound, offset)
    # on random points the domain is exactly the box
    gen = torch.Generator().manual_seed(4)
    pts = tuple(
        4 * torch.randn((200,) + s, dtype=torch.float64, generator=gen) for s in fam.param_shapes
    )
    box = torch.ones(200, dtype=torch.bool)
    for p, (lo, hi) in zip(pts, bounds):
        ok = torch.ones_like(p, dtype=torch.bool)
        ok = ok & (p > lo) if lo is not None else ok
        ok = ok & (p < hi) if hi is not None else ok
        box = box & ok.reshape(200, -1).all(-1)
    assert 0 < int(box.sum()) < 200
    assert torch.equal(fam.is_valid(pts), box)
