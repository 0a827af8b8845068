"""Property: no natural-gradient step of CVI() at any step size in (0, 1] makes a covariance
invalid, whatever the gradient (Lin, Schmidt & Khan 2020: ``P + b G + b^2/2 G S G`` is
positive definite for every symmetric ``G``); float32 and float64."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pyro_cvi.natgrad import diag_step, lowrank_step, tril_step

DTYPES = [torch.float32, torch.float64]
betas = st.floats(min_value=1e-6, max_value=1.0, exclude_min=False)
scales = st.floats(min_value=-6.0, max_value=6.0)  # log10 of the gradient magnitude


def _rand(seed, *shape, dtype):
    return torch.randn(
        *shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    ).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    beta=betas,
    log_g=scales,
    form=st.sampled_from(["retraction", "natural"]),
)
def test_diag_step_keeps_scale_valid(dtype, seed, beta, log_g, form):
    m = _rand(seed, 7, dtype=dtype)
    s = _rand(seed + 1, 7, dtype=dtype).exp()
    gm = _rand(seed + 2, 7, dtype=dtype) * 10**log_g
    gs = _rand(seed + 3, 7, dtype=dtype) * 10**log_g
    m2, s2, _ = diag_step(m, s, gm, gs, beta, retraction=form == "retraction")
    assert bool(torch.isfinite(s2).all()) and bool((s2 > 0).all())
    assert bool(torch.isfinite(m2).all())
    assert s2.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    beta=betas,
    log_g=scales,
    D=st.integers(1, 6),
    form=st.sampled_from(["retraction", "natural"]),
)
@example(seed=5, beta=0.790091016862044, log_g=4.873046875, D=5, form="retraction")
def test_tril_step_keeps_covariance_positive_definite(dtype, seed, beta, log_g, D, form):
    A = _rand(seed, D, D, dtype=torch.float64)
    L = torch.linalg.cholesky(A @ A.T + 0.1 * torch.eye(D, dtype=torch.float64)).to(dtype)
    m = _rand(seed + 1, D, dtype=dtype)
    gm = _rand(seed + 2, D, dtype=dtype) * 10**log_g
    gL = (_rand(seed + 3, D, D, dtype=dtype) * 10**log_g).tril()  # any gradient, indefinite G
    m2, L2, _ = tril_step(m, L, gm, gL, beta, retraction=form == "retraction")
    assert L2.dtype == dtype
    assert bool(torch.isfinite(L2).all()) and bool(torch.isfinite(m2).all())
    assert bool((L2.diagonal() > 0).all()) and torch.equal(L2, L2.tril())
    # (the product in float64: a float32 product of a valid L rounds a condition number of 1e8
    # to a negative eigenvalue)
    S2 = L2.double() @ L2.double().T
    assert float(torch.linalg.eigvalsh(S2).min()) > 0


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), beta=betas, log_g=st.floats(-6.0, 3.0), adaptive=st.booleans())
def test_lowrank_step_keeps_covariance_valid(dtype, seed, beta, log_g, adaptive):
    D, r = 6, 2
    m = _rand(seed, D, dtype=dtype)
    s = _rand(seed + 1, D, dtype=dtype).exp()
    W = _rand(seed + 2, D, r, dtype=dtype)
    gm, gs = (
        _rand(seed + 3, D, dtype=dtype) * 10**log_g,
        _rand(seed + 4, D, dtype=dtype) * 10**log_g,
    )
    gW = _rand(seed + 5, D, r, dtype=dtype) * 10**log_g
    m2, s2, W2, _ = lowrank_step(m, s, W, gm, gs, gW, beta, max_rel=1.0 if adaptive else None)
    assert (
        bool(torch.isfinite(W2).all()) and bool((s2 > 0).all()) and bool(torch.isfinite(s2).all())
    )
