"""Float32 is first-class: the concentration families' entropies and KLs keep their digits at
large concentrations (where ``lgamma`` alone has none left in float32), and their natural
parameters are capped where float32 loses meaning, keeping the mean."""

import pytest
import torch

from pyro_cvi.families.beta import Beta
from pyro_cvi.families.dirichlet import Dirichlet
from pyro_cvi.families.gamma import Gamma
from pyro_cvi.families.special import max_concentration

F32, F64 = torch.float32, torch.float64
CONC = [0.3, 2.0, 40.0, 3e3, 2e5]


def _gamma(dtype, scale=1.0):
    a = torch.tensor(CONC, dtype=dtype) * scale
    return (a - 1, -a / torch.tensor([0.5, 2.0, 3.0, 0.1, 7.0], dtype=dtype))


def _beta(dtype, scale=1.0):
    a = torch.tensor(CONC, dtype=dtype) * scale
    return (a - 1, 0.7 * a - 1)


def _dirichlet(dtype, scale=1.0):
    a = (
        torch.tensor(CONC, dtype=dtype)[:, None]
        * scale
        * torch.tensor([1.0, 0.4, 2.5], dtype=dtype)
    )
    return (a - 1,)


CASES = {
    "gamma": (Gamma(()), _gamma, lambda n: torch.distributions.Gamma(n[0] + 1, -n[1])),
    "beta": (Beta(()), _beta, lambda n: torch.distributions.Beta(n[0] + 1, n[1] + 1)),
    "dirichlet": (Dirichlet((3,)), _dirichlet, lambda n: torch.distributions.Dirichlet(n[0] + 1)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_entropy_and_kl_keep_their_digits_in_float32(name):
    fam, make, torch_dist = CASES[name]
    q32, q64 = make(F32), make(F64)
    prior64 = tuple(torch.zeros_like(t) for t in q64)  # alpha = 1 (rate 1 for the Gamma)
    if name == "gamma":
        prior64 = (prior64[0], prior64[1] - 1)
    prior32 = tuple(t.to(F32) for t in prior64)
    # float64 against torch's closed forms (exact up to round-off at moderate concentrations)
    ref_h = torch_dist(q64).entropy()
    ref_kl = torch.distributions.kl_divergence(torch_dist(q64), torch_dist(prior64))
    assert torch.allclose(fam.entropy(q64)[:3], ref_h[:3], rtol=1e-10, atol=1e-10)
    assert torch.allclose(fam.kl(q64, prior64)[:3], ref_kl[:3], rtol=1e-10, atol=1e-10)
    # float32 against our float64 at every concentration, up to 2e5: absolute 1e-3 nat
    # (torch's float32 entropy is off by about a nat at 2e5)
    h32, h64 = fam.entropy(q32).double(), fam.entropy(q64)
    assert (h32 - h64).abs().max() < 2e-3, h32 - h64
    kl32, kl64 = fam.kl(q32, prior32).double(), fam.kl(q64, prior64)
    assert ((kl32 - kl64).abs() / kl64.abs().clamp(min=1.0)).max() < 1e-5, (kl32, kl64)


@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", list(CASES))
def test_limit_natural_caps_concentration_and_keeps_the_mean(name, dtype):
    fam, make, torch_dist = CASES[name]
    nat = make(dtype, 1e10)  # concentrations up to 2e15
    cap = max_concentration(dtype)
    lim = fam.limit_natural(nat)
    d, d_lim = torch_dist(nat), torch_dist(lim)
    conc = lim[0] + 1
    total = conc.sum(-1) if name == "dirichlet" else (conc + lim[1] + 1 if name == "beta" else conc)
    assert (total <= cap * (1 + 1e-5)).all()
    assert torch.allclose(d.mean, d_lim.mean, rtol=1e-5)
    small = make(dtype, 0.5)  # below the cap: untouched
    assert all(torch.equal(a, b) for a, b in zip(fam.limit_natural(small), small))
    assert fam.is_valid(lim).all()
