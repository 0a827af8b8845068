"""``SiteRows`` (the Markov block's sites on the steps): one row per step in order takes no
gather or scatter, with the same numbers as rows in another order, several rows on a step or
steps without a row (both dtypes)."""

import pytest
import torch

from pyro_cvi.statespace.posterior import SiteRows


def _rows(T, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    H = torch.randn(T, d, generator=g, dtype=torch.float64).to(dtype)
    w = torch.rand(T, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(T, generator=g, dtype=torch.float64).to(dtype)
    A = torch.randn(T, d, d, generator=g, dtype=torch.float64)
    cov = (A @ A.mT + torch.eye(d, dtype=torch.float64)).to(dtype)
    return H, w, b, torch.randn(T, d, generator=g, dtype=torch.float64).to(dtype), cov


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("d", [1, 2, 3])
def test_one_row_per_step_equals_the_scattered_rows(d, dtype):
    T = 23
    H, w, b, mean, cov = _rows(T, d, dtype, seed=d)
    ordered = SiteRows(torch.arange(T), H, w, b, T)
    assert ordered.one_per_step()
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(7))
    shuffled = SiteRows(perm, H[perm], w[perm], b[perm], T)  # row r on step perm[r]
    assert not shuffled.one_per_step()
    eta, J = ordered.information()
    eta_s, J_s = shuffled.information()
    assert torch.equal(eta, eta_s) and torch.equal(J, J_s)
    torch.testing.assert_close(J, w[:, None, None] * H[:, :, None] * H[:, None, :])
    m, v = ordered.moments(mean, cov)
    m_s, v_s = shuffled.moments(mean, cov)
    torch.testing.assert_close(m_s, m[perm])
    torch.testing.assert_close(v_s, v[perm])
    ref = torch.einsum("ri,rij,rj->r", H.double(), cov.double(), H.double())
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v.double(), ref, **tol)


def test_two_rows_on_a_step_and_a_step_without_add_up():
    """Steps ``0, 2, 2``: step 2 sums both rows, step 1 has no information."""
    H, w, b, mean, cov = _rows(3, 2, torch.float64, seed=3)
    rows = SiteRows(torch.tensor([0, 2, 2]), H, w, b, 3)
    assert not rows.one_per_step()
    eta, J = rows.information()
    outer = w[:, None, None] * H[:, :, None] * H[:, None, :]
    torch.testing.assert_close(J[2], outer[1] + outer[2], rtol=1e-14, atol=1e-14)
    assert not J[1].any() and not eta[1].any()
    torch.testing.assert_close(eta[2], b[1] * H[1] + b[2] * H[2], rtol=1e-14, atol=1e-14)
    m, _ = rows.moments(mean, cov)
    torch.testing.assert_close(m, (H * mean[[0, 2, 2]]).sum(-1), rtol=1e-14, atol=1e-14)
