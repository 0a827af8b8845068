"""Mean field or a joint Gaussian: the rule (docs/architecture.md, "Mean field or a joint
Gaussian") and the per-site override ``AutoCVI(families={site: "gaussian_diag"})``, measured
against closed forms: the joint block reaches the exact posterior (its bound is the log
evidence), the overridden sites reach the mean-field CAVI fixed point and its bound."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

TOL = {torch.float64: 1e-6, torch.float32: 2e-3}


def _data(dtype):
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(20, generator=g, dtype=torch.float64)
    x2 = 0.8 * x1 + 0.6 * torch.randn(20, generator=g, dtype=torch.float64)  # correlated
    y = 1.5 * x1 - 0.5 * x2 + 0.5 * torch.randn(20, generator=g, dtype=torch.float64)
    return x1.to(dtype), x2.to(dtype), y.to(dtype)


def _model(x1, x2, y):
    w1 = pyro.sample("w1", dist.Normal(y.new_zeros(()), 1.0))
    w2 = pyro.sample("w2", dist.Normal(y.new_zeros(()), 1.0))
    with pyro.plate("n", len(y)):
        pyro.sample("y", dist.Normal(w1 * x1 + w2 * x2, 0.5), obs=y)


def _fit(families, data, steps):
    pyro.clear_param_store()
    guide = AutoCVI(_model, schedule="sequential", families=families)
    svi = SVI(_model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    losses = [svi.step(*data) for _ in range(steps)]
    return guide, losses


def _closed_forms(x1, x2, y):
    """The log evidence, and the mean-field CAVI fixed point with its bound."""
    X = torch.stack([x1, x2], 1)
    tau = 4.0
    P = torch.eye(2, dtype=X.dtype) + tau * X.T @ X
    C = torch.eye(len(y), dtype=X.dtype) / tau + X @ X.T
    log_evidence = torch.distributions.MultivariateNormal(y.new_zeros(len(y)), C).log_prob(y)
    h = tau * X.T @ y
    m = torch.zeros(2, dtype=X.dtype)
    for _ in range(2000):  # CAVI: q(w1) q(w2), each Gaussian with precision P_ii
        for i in range(2):
            m[i] = (h[i] - P[i, 1 - i] * m[1 - i]) / P[i, i]
    v = 1 / P.diagonal()
    r = y - X @ m
    ell = -0.5 * len(y) * math.log(2 * math.pi / tau) - 0.5 * tau * (r @ r + (X**2 @ v).sum())
    kl = 0.5 * (v + m**2 - 1 - v.log()).sum()
    return float(log_evidence), m, v, float(ell - kl)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_joint_block_by_default_and_mean_field_per_site(dtype):
    data = _data(dtype)
    log_z, m, v, mf_bound = _closed_forms(*[t.double() for t in data])
    tol = TOL[dtype]
    # by default: w1 and w2 share a factor, so one joint Gaussian block (exact posterior)
    guide, losses = _fit(None, data, 3)
    assert "# w1, w2: q = joint gaussian, D=2 (site form)" in guide.explain()
    assert -losses[-1] == pytest.approx(log_z, abs=tol * abs(log_z))
    # families={...: "gaussian_diag"}: those sites keep their own (mean-field) Gaussian
    guide, losses = _fit({"w1": "gaussian_diag", "w2": "gaussian_diag"}, data, 60)
    text = guide.explain()
    assert "w1: q = gaussian_diag (natural form)" in text
    assert "w2: q = gaussian_diag (natural form)" in text
    assert -losses[-1] == pytest.approx(mf_bound, abs=tol * abs(mf_bound))
    for i, name in enumerate(("w1", "w2")):
        q = guide.posterior(name)
        assert float(q.loc) == pytest.approx(float(m[i]), abs=tol)
        assert float(q.scale**2) == pytest.approx(float(v[i]), abs=tol)
    # the measured price of the mean field here: the joint bound is higher by the gap
    assert log_z - mf_bound > 0.5


def test_gaussian_diag_on_a_positive_site_is_refused_by_name():
    def model():
        pyro.sample("s", dist.Gamma(2.0, 1.0))
        pyro.sample(
            "y", dist.Poisson(pyro.sample("r", dist.Gamma(2.0, 1.0))), obs=torch.tensor(3.0)
        )

    with pytest.raises(ValueError, match="'s'.*gaussian_diag"):
        AutoCVI(model, families={"s": "gaussian_diag"})()
