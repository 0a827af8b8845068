"""``pyro_cvi.autoguide.AutoCVI``: the guide's views of q against closed forms."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive

from pyro_cvi import CVI, CVI_ELBO, AutoCVI


def model(y):
    f = pyro.sample("f", dist.Beta(torch.tensor(2.0, dtype=y.dtype), 3.0))
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=y.dtype), 10.0))
    with pyro.plate("data", len(y)):
        pyro.sample("b", dist.Bernoulli(f), obs=(y > 0).to(y.dtype))
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_posterior_median_quantiles_and_samples_are_the_exact_posterior(dtype):
    y = torch.tensor([0.5, -0.3, 1.2, 2.0, 0.1, -1.0], dtype=dtype)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    svi.step(y)
    n1 = float((y > 0).sum())
    f64 = torch.float64
    beta = dist.Beta(torch.tensor(2.0 + n1, dtype=f64), torch.tensor(3.0 + len(y) - n1, dtype=f64))
    prec = 1 / 100 + len(y)
    normal = dist.Normal(torch.tensor(float(y.sum()) / prec, dtype=f64), prec**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    assert abs(guide.posterior("f").mean.item() - beta.mean.item()) < tol
    assert abs(guide.posterior("mu").variance.item() - normal.variance.item()) < tol
    med = guide.median(y)
    assert abs(med["mu"].item() - normal.mean.item()) < tol
    qs = guide.quantiles([0.1, 0.9], y)
    expected = normal.icdf(torch.tensor([0.1, 0.9], dtype=f64))
    assert torch.allclose(qs["mu"].reshape(-1).double(), expected.double(), atol=1e-4)
    draws = Predictive(model, guide=guide, num_samples=400, return_sites=["f"])(y)["f"]
    assert abs(draws.mean().item() - beta.mean.item()) < 4 * beta.stddev.item() / 400**0.5


def test_explain_names_every_factor_latent_pair():
    y = torch.tensor([0.5, -0.3, 1.2])
    guide = AutoCVI(model)
    guide(y)
    text = guide.explain()
    for pair in ("b", "f"), ("y", "mu"):
        lines = [ln for ln in text.splitlines() if pair[0] in ln and pair[1] in ln]
        assert lines, (pair, text)
    assert "conjugate" in text


def _three_rules(y, counts, X, labels):
    x = pyro.sample("x", dist.Normal(y.new_tensor(1.0), 2.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(3.0 * x - 1.0, 0.5), obs=y)
    rate = pyro.sample("rate", dist.Gamma(y.new_tensor(2.0), 1.0))
    with pyro.plate("counts", len(counts)):
        pyro.sample("c", dist.Poisson(rate), obs=counts)
    w = pyro.sample("w", dist.Normal(y.new_zeros(2), 1.0).to_event(1))
    s = pyro.sample("s", dist.LogNormal(y.new_tensor(0.0), 1.0))
    with pyro.plate("labels", len(labels)):
        pyro.sample("b", dist.Bernoulli(logits=X @ w), obs=labels)
        pyro.sample("t", dist.StudentT(3.0, X[:, 0], s), obs=labels)


def test_explain_prints_each_blocks_message_rules():
    """Per block, the factors by the rule of their message: exact expected (conjugate, closed
    form), Monte Carlo expected, sites (not conjugate)."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(12, 2, generator=g, dtype=torch.float64)
    data = (
        torch.tensor([2.0, 1.5, 2.7], dtype=torch.float64),
        torch.tensor([3.0, 1.0, 4.0], dtype=torch.float64),
        X,
        (X[:, 0] > 0).double(),
    )
    guide = AutoCVI(_three_rules)
    guide(*data)
    lines = guide.explain().splitlines()

    def rules_of(header):
        (i,) = [k for k, ln in enumerate(lines) if ln.startswith(f"# {header}")]
        return lines[i + 1]

    rules = "#   messages: exact expected from {}; Monte Carlo expected from -; sites from {}"
    assert rules_of("x:") == rules.format("x, y", "-")
    assert rules_of("rate:") == rules.format("rate, c", "-")
    assert rules_of("w:") == rules.format("w", "b")
    assert rules_of("remainder:") == rules.format("-", "s, t")
