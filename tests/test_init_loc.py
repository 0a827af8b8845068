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


def _local_level(dtype):
    """A local-level chain (``pyro.markov``, 12 steps, Normal observations): a Markov block;
    its exact posterior is the dense Gaussian one (``tests/test_block_markov.py``)."""
    from test_block_markov import T, dense_posterior, local_level

    y = torch.sin(torch.arange(T, dtype=dtype) / 2) + 0.1 * torch.arange(T, dtype=dtype) / T
    g = torch.Generator().manual_seed(5)
    values = {f"x_{t}": (2 * torch.randn((), generator=g)).to(dtype) for t in range(T)}
    mean, cov = dense_posterior(y)
    return local_level, y, values, mean, cov


@pytest.mark.parametrize("dtype", DTYPES)
def test_markov_block_starts_at_the_values_and_reaches_the_same_fit(dtype):
    from pyro_cvi.blocks import MarkovBlock

    model, y, values, mean, cov = _local_level(dtype)
    T = len(values)
    start = torch.stack([values[f"x_{t}"] for t in range(T)]).double()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model, init_loc_fn=init_to_value(values=values))
    guide(y)
    (block,) = guide.engine.blocks
    assert isinstance(block, MarkovBlock) and block.init_name is not None
    median = guide.median(y)
    for k, v in values.items():
        assert median[k].dtype == dtype
        assert torch.allclose(median[k], v, atol=10 * _tol(dtype), rtol=0), (k, median[k], v)
    # only the means moved: the marginal variances are the exact posterior's (conjugate)
    var = torch.stack([block.marginal(f"x_{t}").variance for t in range(T)]).double()
    assert torch.allclose(var, cov.diagonal(), atol=1e3 * _tol(dtype), rtol=0)
    # the reported loss is the bound of this shifted q: -log p(y) + KL(q_start || q*)
    evidence = _evidence(y, mean, cov)
    d = start - mean
    exact = -evidence + 0.5 * float(d @ torch.linalg.inv(cov) @ d)
    reported = CVI_ELBO().loss(model, guide, y)
    assert reported == pytest.approx(exact, abs=1e3 * _tol(dtype) * (1 + abs(exact)))
    # q's draws are centred at the values too (300 draws, every step within 4.5 SE)
    draws = torch.stack(
        [torch.stack([v for _, v in sorted(guide(y).items(), key=_step)]) for _ in range(300)]
    ).double()
    z = (draws.mean(0) - start) / (cov.diagonal() / 300).sqrt()
    assert z.abs().max() < 4.5, z
    # the fit is the one without init_loc_fn: the exact posterior, and the loss -log p(y)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    for _ in range(30):
        loss = svi.step(y)
    median = guide.median(y)
    fitted = torch.stack([median[f"x_{t}"] for t in range(T)]).double()
    assert torch.allclose(fitted, mean, atol=1e3 * _tol(dtype), rtol=0)
    assert loss == pytest.approx(-evidence, abs=1e3 * _tol(dtype) * (1 + abs(evidence)))


def _step(item):
    return int(item[0].split("_")[1])


def _evidence(y, mean, cov):
    """``log p(y)`` of the local-level model, its prior covariance recovered from ``cov``."""
    from test_block_markov import R

    T = len(y)
    eye = torch.eye(T, dtype=torch.float64)
    K = torch.linalg.inv(torch.linalg.inv(cov) - eye / R)
    return float(
        dist.MultivariateNormal(torch.zeros(T, dtype=torch.float64), K + R * eye).log_prob(
            y.double()
        )
    )


def test_random_walk_starts_at_the_values_and_reaches_the_same_fit():
    """A vectorised random walk (``x = eps.cumsum(-1)``, Poisson counts): a Markov block over
    the states whose ``z`` are the increments. The offset is set in the states' coordinates;
    ``q``'s increments start at the values, and 40 steps give the fit without the offset."""
    from test_random_walk import _counts, _walk

    T = 30
    model, y = _walk(T), _counts(T)
    start = 0.1 * torch.randn(T, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    pyro.clear_param_store()
    guide = AutoCVI(model, init_loc_fn=init_to_value(values={"eps": start}))
    guide(y)
    assert guide.engine.blocks[0].init_name is not None
    assert torch.allclose(guide.median(y)["eps"], start, atol=1e-12, rtol=0)
    ref = AutoCVI(model, prefix="reference")
    losses = []
    for g in (guide, ref):
        svi = SVI(model, g, CVI(), CVI_ELBO())
        for _ in range(40):
            loss = svi.step(y)
        losses.append(loss)
    assert losses[0] == pytest.approx(losses[1], abs=1e-8)
    assert torch.allclose(guide.median(y)["eps"], ref.median(y)["eps"], atol=1e-8, rtol=0)
