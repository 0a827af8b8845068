"""Affine Jacobians with at most one non-zero per row, kept as an index and coefficients.

* :class:`~pyro_cvi.gaussian.selection.SelectionJacobian` against its dense matrix: ``A v``,
  ``A^T u``, ``A^2 v``, ``(A^2)^T u`` at random index patterns (duplicate indices, zero rows,
  a batch of vectors), ``A v`` and ``A^2 v`` bit for bit;
* :func:`~pyro_cvi.model.selection_probes.selection_jacobian` against the dense autograd
  Jacobian (:func:`~pyro_cvi.model.probes.jacobian`), bit for bit, on the graphs that select
  (indexing, a plate's broadcast, a scaled gather, an event latent, masked rows); ``None``
  where a row has two non-zeros or sums to zero, or the matrix is small;
* the Gaussian families' ``variance_along`` with a selection against the dense one;
* a hierarchical model: the factor's role holds a selection, and the losses of ten steps are
  bit for bit those of the dense path (three spellings of the group latent); at G = 2000 the
  set-up and a step never form the ``(4G x G)`` matrix; a loc with two groups per row keeps
  the dense Jacobian.
"""

import sys
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.families.gaussian import Gaussian, GaussianDiag
from pyro_cvi.gaussian.selection import SelectionJacobian, dense, square_matvec
from pyro_cvi.messages.expectations import QState
from pyro_cvi.model import selection_probes
from pyro_cvi.model.probes import jacobian
from pyro_cvi.model.selection_probes import selection_jacobian

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from benchmark_prior_messages import many_schools, schools_data  # noqa: E402

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def random_selection(seed, R, D, dtype, zero_rows=0.2):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, D, (R,), generator=g)  # duplicates: R > D
    coef = torch.randn(R, generator=g, dtype=torch.float64)
    coef[torch.rand(R, generator=g) < zero_rows] = 0.0
    return SelectionJacobian(idx, coef.to(dtype), D), g


@DTYPES
@pytest.mark.parametrize("seed", range(4))
def test_products_against_the_dense_matrix(dtype, seed):
    R, D = [(50, 7), (300, 120), (9, 40), (1, 1)][seed]
    A, g = random_selection(seed, R, D, dtype)
    M = A.to_dense()
    assert M.shape == A.shape == (R, D) and M.dtype == dtype
    assert int((M != 0).sum(1).max()) <= 1
    rows = torch.arange(R)
    assert torch.equal(M[rows, A.index], A.coef)
    v = torch.randn(D, generator=g, dtype=torch.float64).to(dtype)
    u = torch.randn(R, generator=g, dtype=torch.float64).to(dtype)
    V = torch.randn(D, 3, generator=g, dtype=torch.float64).to(dtype)
    U = torch.randn(R, 3, generator=g, dtype=torch.float64).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    assert torch.equal(A.matvec(v), M @ v)  # one product plus exact zeros a row
    assert torch.equal(A @ V, M @ V)
    assert torch.equal(A.square().matvec(v), M.square() @ v)
    assert torch.equal(square_matvec(A, v), square_matvec(M, v))
    torch.testing.assert_close(A.rmatvec(u), M.T @ u, **tol)
    torch.testing.assert_close(A.rmatvec(U), M.T @ U, **tol)
    torch.testing.assert_close(A.square().rmatvec(u), M.square().T @ u, **tol)
    assert torch.equal(dense(A), M) and dense(M) is M
    assert A.to(torch.float64).dtype == torch.float64 and not A.detach().requires_grad


def test_bad_shapes_are_refused_with_a_message():
    with pytest.raises(ValueError, match="one entry per row"):
        SelectionJacobian(torch.zeros(3, dtype=torch.long), torch.zeros(4), 5)


def graphs(dtype):
    """``name -> (out, z)``: quantities that select one coordinate of ``z`` per element."""
    g = torch.Generator().manual_seed(0)
    G = 300

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()

    z = leaf(G)
    idx = torch.randint(0, G, (2000,), generator=g)
    c = torch.randn(2000, generator=g, dtype=torch.float64).to(dtype)
    mask = (torch.rand(2000, generator=g) < 0.7).to(dtype)
    ze = leaf(G, 3)
    zb = leaf(G)
    onehot = torch.zeros(2000, G, dtype=dtype)
    onehot[torch.arange(2000), idx] = c * mask
    return {
        "one-hot design": (onehot @ z, z),
        "broadcast": (zb.expand(4, G) * 1.0, zb),
        "scaled gather": (z[idx] * c + 2.0, z),
        "zero rows": (z[idx] * mask, z),
        "batch shape": ((2.5 * z)[idx].reshape(4, 5, 100), z),
        "event latent": (ze[idx, idx % 3] * c, ze),
        "index_select": (torch.index_select(z, 0, idx) - 1.0, z),
    }


@DTYPES
@pytest.mark.parametrize(
    "name",
    [
        "one-hot design",
        "broadcast",
        "scaled gather",
        "zero rows",
        "batch shape",
        "event latent",
        "index_select",
    ],
)
def test_the_probe_reads_the_dense_jacobian_bit_for_bit(dtype, name):
    out, z = graphs(dtype)[name]
    A = selection_jacobian(out, z, min_entries=0)
    assert isinstance(A, SelectionJacobian)
    M = jacobian(out, z)
    assert A.shape == M.shape
    assert torch.equal(A.to_dense(), M)


@DTYPES
def test_rows_with_two_non_zeros_or_a_zero_sum_keep_the_dense_path(dtype):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(300, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    i = torch.randint(0, 300, (2000,), generator=g)
    j = (i + 1 + torch.randint(0, 299, (2000,), generator=g)) % 300  # j != i
    X = torch.randn(50, 300, generator=g, dtype=torch.float64).to(dtype)
    two = z[i] + 0.5 * z[j]
    assert selection_jacobian(two, z, min_entries=0) is None
    assert selection_jacobian(z[i] - z[j], z, min_entries=0) is None  # A 1 = 0, A v != 0
    assert selection_jacobian(X @ z, z, min_entries=0) is None
    one = z[i] + 0.0 * z[j]  # a zero second entry: still a selection
    assert isinstance(selection_jacobian(one, z, min_entries=0), SelectionJacobian)
    # below the size the dense matrix is cheap: kept dense
    assert selection_jacobian(z[i], z, min_entries=2000 * 300 + 1) is None
    assert isinstance(selection_jacobian(z[i], z, min_entries=2000 * 300), SelectionJacobian)
    assert selection_jacobian(torch.ones(5, 5, dtype=dtype), z, min_entries=0) is None


@DTYPES
def test_variance_along_a_selection_equals_the_dense_variance(dtype):
    A, g = random_selection(5, 80, 40, dtype)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    m = torch.randn(40, generator=g, dtype=torch.float64).to(dtype)
    v = torch.rand(40, generator=g, dtype=torch.float64).to(dtype) + 0.1
    mean = (m, v + m.square())
    for fam in (GaussianDiag(), Gaussian()):
        assert torch.equal(fam.variance_along(mean, A), fam.variance_along(mean, A.to_dense()))
        torch.testing.assert_close(fam.variance_along(mean, A), A.to_dense().square() @ v)
    # an event latent (10 x 4): the selection reads the covariance's diagonal
    L = torch.randn(10, 4, 4, generator=g, dtype=torch.float64).to(dtype)
    cov = L @ L.mT + torch.eye(4, dtype=dtype)
    mu = torch.randn(10, 4, generator=g, dtype=torch.float64).to(dtype)
    mean = (mu, cov + mu.unsqueeze(-1) * mu.unsqueeze(-2))
    fam = Gaussian((4,))
    want = fam.variance_along(mean, A.to_dense())
    expected = A.coef.square() * cov.diagonal(dim1=-2, dim2=-1).reshape(-1)[A.index]
    torch.testing.assert_close(want, expected, **tol)
    torch.testing.assert_close(fam.variance_along(mean, A), want, **tol)


def fit(G, dtype, families, steps):
    args, _ = schools_data(G)(dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(many_schools, families=families)
    svi = SVI(many_schools, guide, CVI(), CVI_ELBO())
    losses = [svi.step(*args) for _ in range(steps)]
    return guide, losses


@pytest.fixture
def seen(monkeypatch):
    """The Jacobians the mean field's variances are asked along (their types)."""
    kinds = []
    variance = QState.variance

    def record(self, jacobians):
        kinds.extend(type(A) for A in jacobians.values())
        return variance(self, jacobians)

    monkeypatch.setattr(QState, "variance", record)
    return kinds


@DTYPES
@pytest.mark.parametrize("families", [None, {"theta": "gaussian_diag"}, {"theta": "gaussian"}])
def test_a_hierarchical_fit_is_bit_for_bit_the_dense_one(monkeypatch, seen, dtype, families):
    monkeypatch.setattr(selection_probes, "SELECTION_MIN_ENTRIES", 1 << 60)
    guide, dense_losses = fit(40, dtype, families, 10)
    assert isinstance(guide.engine.analysis.spec("obs").jacobians["theta"], torch.Tensor)
    assert SelectionJacobian not in seen
    monkeypatch.setattr(selection_probes, "SELECTION_MIN_ENTRIES", 0)
    guide, losses = fit(40, dtype, families, 10)
    spec = guide.engine.analysis.spec("obs")
    A = spec.jacobians["theta"]
    assert isinstance(A, SelectionJacobian) and A.shape == (160, 40)
    assert torch.equal(A.coef, torch.ones(160, dtype=dtype))
    assert torch.equal(A.index, torch.arange(40).repeat(4))  # obs (4, G): row k G + j reads j
    if families is not None and families["theta"] == "gaussian_diag":
        assert SelectionJacobian in seen  # the mean field's variance along the selection
    assert [float(x).hex() for x in losses] == [float(x).hex() for x in dense_losses]


@DTYPES
def test_many_groups_never_form_the_dense_jacobian(seen, dtype):
    G = 2000
    guide, losses = fit(G, dtype, None, 3)
    an = guide.engine.analysis
    assert "theta" not in an.remainder
    A = an.spec("obs").jacobians["theta"]
    assert isinstance(A, SelectionJacobian) and A.shape == (4 * G, G)
    assert seen and all(k is SelectionJacobian for k in seen)
    assert all(torch.isfinite(torch.tensor(v)) for v in losses)
    assert losses[-1] < losses[0]


def pairs(sigma, y):
    """Each observation averages two groups: two non-zeros per row of the loc's Jacobian."""
    G = y.shape[0]
    mu = pyro.sample("mu", dist.Normal(sigma.new_tensor(0.0), 5.0))
    with pyro.plate("groups", G):
        theta = pyro.sample("theta", dist.Normal(mu, 1.0))
    other = (torch.arange(G) + 1) % G
    with pyro.plate("obs_per_group", y.shape[1], dim=-2), pyro.plate("g", G, dim=-1):
        pyro.sample("obs", dist.Normal(0.5 * (theta + theta[other]), sigma), obs=y.T)


@DTYPES
def test_a_loc_of_two_groups_keeps_the_dense_jacobian(dtype):
    G = 300  # 1200 x 300 entries: above the size where selections are read
    args, _ = schools_data(G)(dtype)
    pyro.clear_param_store()
    guide = AutoCVI(pairs, families={"theta": "gaussian_diag"})
    svi = SVI(pairs, guide, CVI(), CVI_ELBO())
    loss = svi.step(*args)
    A = guide.engine.analysis.spec("obs").jacobians["theta"]
    assert isinstance(A, torch.Tensor) and A.shape == (4 * G, G)
    assert torch.equal((A != 0).sum(1), torch.full((4 * G,), 2))
    assert torch.isfinite(torch.tensor(loss))
