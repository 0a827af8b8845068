"""``AutoCVI(init_loc_fn=...)``: q starts at the given values, as Pyro's autoguides do.

A Gaussian site block starts with the offset ``h0 = Lambda (m_init - m)`` added to its natural
location (its precision unchanged); no factor sends the offset a message, so eq. 12 shrinks it
by ``1 - beta`` each step and the fit reaches the same optimum. A leaf with a Gaussian prior
gets a block of its own (its q would otherwise be its prior, with nothing to place)."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.infer.autoguide.initialization import init_to_value

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

DTYPES = [torch.float64, torch.float32]


def _tol(dtype):
    return 1e-10 if dtype == torch.float64 else 2e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_leaves_start_at_the_values(dtype):
    """Pyro's ``test_init_loc_fn``: two leaves, one scalar Normal and one MVN."""

    def model():
        pyro.sample("x", dist.Normal(torch.tensor(0.0, dtype=dtype), 1.0))
        pyro.sample(
            "y", dist.MultivariateNormal(torch.zeros(5, dtype=dtype), torch.eye(5, dtype=dtype))
        )

    g = torch.Generator().manual_seed(3)
    inits = {"x": torch.randn((), generator=g), "y": torch.randn(5, generator=g)}
    inits = {k: v.to(dtype) for k, v in inits.items()}
    pyro.clear_param_store()
    guide = AutoCVI(model, init_loc_fn=lambda site: inits[site["name"]])
    guide()
    median = guide.median()
    for k in inits:
        assert median[k].dtype == dtype
        assert torch.allclose(median[k], inits[k], atol=_tol(dtype), rtol=0), (k, median[k])
    # a leaf's exact q is its prior: the steps take it there
    svi = SVI(model, guide, CVI(step_size=1.0), CVI_ELBO())
    for _ in range(2):
        svi.step()
    median = guide.median()
    assert median["x"].abs().item() < 10 * _tol(dtype)
    assert median["y"].abs().max().item() < 10 * _tol(dtype)


def _conjugate(dtype):
    data = DATA.to(dtype)

    def model():
        z = pyro.sample(
            "z", dist.MultivariateNormal(torch.zeros(2, dtype=dtype), torch.eye(2, dtype=dtype))
        )
        with pyro.plate("n", 4):
            loc = z[..., 0] + 0.5 * z[..., 1]  # (vectorised particles on the left)
            pyro.sample("o", dist.Normal(loc.unsqueeze(-1), 0.8), obs=data)

    # exact posterior: precision I + A^T A / s^2, mean Sigma A^T y / s^2
    A = torch.tensor([[1.0, 0.5]] * 4, dtype=torch.float64)
    prec = torch.eye(2, dtype=torch.float64) + A.T @ A / 0.64
    mean = torch.linalg.solve(prec, A.T @ data.double() / 0.64)
    return model, mean, prec


DATA = torch.tensor([0.3, -1.2, 2.0, 0.7], dtype=torch.float64)
ROW = torch.tensor([1.0, 0.5], dtype=torch.float64)


def _neg_elbo(m, cov, s2=0.64):
    """``-E_q log p(y | z) + KL(q || N(0, I))`` for ``q = N(m, cov)``, in closed form."""
    f_mean, f_var = ROW @ m, ROW @ cov @ ROW
    n = DATA.numel()
    loglik = -0.5 * n * torch.log(2 * torch.pi * torch.tensor(s2, dtype=torch.float64))
    loglik = loglik - (((DATA - f_mean) ** 2).sum() + n * f_var) / (2 * s2)
    kl = 0.5 * (cov.trace() + m @ m - m.numel() - torch.logdet(cov))
    return float(kl - loglik)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gaussian_block_starts_at_the_values_and_reaches_the_closed_form(dtype):
    model, mean, prec = _conjugate(dtype)
    start = torch.tensor([2.5, -3.0], dtype=dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model, init_loc_fn=init_to_value(values={"z": start}))
    guide()
    q = guide.posterior("z")
    assert torch.allclose(q.mean, start, atol=10 * _tol(dtype), rtol=0)
    # only the mean moved: the precision is the exact posterior's (a conjugate block)
    assert torch.allclose(q.precision_matrix.double(), prec, atol=1e3 * _tol(dtype), rtol=1e-4)
    # the reported loss is the bound of this shifted q: its closed-form -ELBO
    reported = CVI_ELBO().loss(model, guide)
    exact = _neg_elbo(start.double(), torch.linalg.inv(prec))
    assert abs(reported - exact) < 1e3 * _tol(dtype) * (1 + abs(exact)), (reported, exact)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    losses = [svi.step() for _ in range(3)]
    q = guide.posterior("z")
    assert torch.allclose(q.mean.double(), mean, atol=1e3 * _tol(dtype), rtol=0)
    # the -ELBO at the start exceeds the optimum's by KL(q_start || q*) = d^T Lambda d / 2
    d = start.double() - mean
    gap = reported - losses[-1]
    assert abs(gap - 0.5 * float(d @ prec @ d)) < 1e-6 * (1 + gap) + 1e3 * _tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_without_init_loc_fn_the_start_is_unchanged(dtype):
    """No ``init_loc_fn``: no offset parameter (the block starts as before)."""
    model, _, _ = _conjugate(dtype)
    pyro.clear_param_store()
    guide = AutoCVI(model)
    guide()
    assert not any(".init_h." in k for k in pyro.get_param_store().keys())
    assert guide.engine.blocks[0].init_name is None
