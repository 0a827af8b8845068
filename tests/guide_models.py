"""Module-level models (importable, so that a guide pickles with its model by reference) for
the round trips of ``tests/test_pyro_conventions.py`` into a fresh process."""

import pyro
import pyro.distributions as dist
import torch


def data(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 2, generator=g).to(dtype)
    y = torch.bernoulli(torch.sigmoid(x @ torch.tensor([1.5, -1.0]).to(dtype)), generator=g)
    return x, y


def mixed(x, y):
    """A Gaussian block (logistic weights), a Gamma (natural) site and a leaf with a parent."""
    w = pyro.sample("w", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
    s = pyro.sample("s", dist.Gamma(x.new_tensor(2.0), 1.0))
    pyro.sample("leaf", dist.Normal(w.sum(), 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)
        pyro.sample("z", dist.Normal(0.0, s.rsqrt()), obs=x[:, 1])  # s: a precision
