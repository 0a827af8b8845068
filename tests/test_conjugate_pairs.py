"""``pyro_cvi.model.conjugate_pairs``: the probes that confirm a conjugate pattern, and the
registry."""

import pyro.distributions as dist
import pytest
import torch

from pyro_cvi.model.conjugate_pairs import check_monomial, find_identity_index, lookup

F64 = torch.float64
RTOL = 1e-8


# ------------------------------------------------------------------------------------------------
# check_monomial: theta(z) = c * z[e] (or free of z) for a positive latent z
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "theta",
    [
        lambda z: 2.5 * z,
        lambda z: 0.3 * z[[2, 0, 0, 1]],  # c * z[e], entries repeated and reordered
        lambda z: torch.full((4,), 1.7, dtype=F64),  # free of z
        lambda z: z.unsqueeze(-1).expand(3, 5) * torch.linspace(0.1, 1.0, 5, dtype=F64),
    ],
    ids=["c*z", "c*z[idx]", "constant", "broadcast c*z"],
)
def test_check_monomial_accepts(theta):
    assert check_monomial(theta, torch.ones(3, dtype=F64), RTOL) is None


@pytest.mark.parametrize(
    "theta,reason",
    [
        (lambda z: z[0:1] + z[1:2], "is not a monomial"),  # z1 + z2
        (lambda z: z**2, "is not linear"),  # log-affine, not affine
        (lambda z: z[0:1] * z[1:2], "is not linear"),  # z1 * z2
        (lambda z: z + 1.0, "is not a monomial"),  # affine, not log-affine
        (lambda z: -z, "is not positive"),
    ],
    ids=["z1+z2", "z**2", "z1*z2", "z+1", "-z"],
)
def test_check_monomial_rejects(theta, reason):
    got = check_monomial(theta, torch.ones(3, dtype=F64), RTOL)
    assert got is not None and reason in got, got


def test_check_monomial_probes_away_from_the_given_point():
    """A near-zero entry at the prior draw must not make z1 + z2 look like a monomial in z2."""
    z0 = torch.tensor([1e-12, 1.0], dtype=F64)
    assert check_monomial(lambda z: z[0:1] + z[1:2], z0, RTOL) is not None


# ------------------------------------------------------------------------------------------------
# find_identity_index: theta = z.reshape(-1[, K])[idx], found by tagging
# ------------------------------------------------------------------------------------------------
def test_find_identity_index_scalar_entries():
    idx = torch.tensor([[2, 0, 0], [3, 1, 2]])
    shape = torch.Size([4])
    got, reason = find_identity_index(lambda z: z[idx], shape, False, F64, "cpu", RTOL)
    assert reason == ""
    assert torch.equal(got, idx)


def test_find_identity_index_simplex_rows():
    """Dirichlet latents (K = 4 per row): theta picks whole rows, e.g. probs_x[x_prev]."""
    rows = torch.tensor([1, 1, 0, 2, 0])
    shape = torch.Size([3, 4])
    got, reason = find_identity_index(lambda z: z[rows], shape, True, F64, "cpu", RTOL)
    assert reason == ""
    assert torch.equal(got, rows)
    # a batch of two 3 x 4 row stacks, flattened to 6 rows
    shape2 = torch.Size([2, 3, 4])
    got, _ = find_identity_index(lambda z: z[1, rows], shape2, True, F64, "cpu", RTOL)
    assert torch.equal(got, rows + 3)


@pytest.mark.parametrize(
    "theta,reason",
    [
        (lambda z: 0.5 * z, "is not a copy"),
        (lambda z: z**2, "is not a copy"),
        (lambda z: z.sort().values, "selects different entries"),  # depends on the values
    ],
    ids=["scaled", "squared", "sorted"],
)
def test_find_identity_index_rejects(theta, reason):
    got, why = find_identity_index(theta, torch.Size([6]), False, F64, "cpu", RTOL)
    assert got is None and reason in why, why


def test_find_identity_index_rejects_a_mixture_of_rows():
    mix = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.2, 0.8]], dtype=F64)
    got, why = find_identity_index(lambda z: mix @ z, torch.Size([3, 4]), True, F64, "cpu", RTOL)
    assert got is None and "is not a copy" in why


# ------------------------------------------------------------------------------------------------
# the registry
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fn,name",
    [
        (dist.Normal(0.0, 1.0), "Normal"),
        (torch.distributions.Normal(0.0, 1.0), "Normal"),
        (dist.Poisson(2.0), "Poisson"),
        (dist.Gamma(2.0, 1.0), "Gamma"),
        (dist.Bernoulli(probs=0.3), "Bernoulli"),
        (dist.Categorical(probs=torch.ones(3) / 3), "Categorical"),
        (dist.Dirichlet(torch.ones(3)), "Dirichlet"),
    ],
)
def test_lookup_finds_patterns(fn, name):
    assert lookup(fn).name == name


@pytest.mark.parametrize(
    "fn",
    [
        dist.OneHotCategorical(probs=torch.ones(3) / 3),
        dist.StudentT(3.0, 0.0, 1.0),
        dist.LogNormal(0.0, 1.0),
    ],
    ids=["OneHotCategorical", "StudentT", "LogNormal"],
)
def test_lookup_returns_none(fn):
    assert lookup(fn) is None


def test_normal_pattern_reads_precision():
    p = lookup(dist.Normal(0.0, 1.0))
    fn = dist.Normal(torch.zeros(2), torch.tensor([0.5, 2.0]))
    torch.testing.assert_close(p.read(fn, "precision"), torch.tensor([4.0, 0.25]))
    torch.testing.assert_close(p.read(fn, "loc"), torch.zeros(2))
    assert set(p.params) == {"loc", "precision"}
