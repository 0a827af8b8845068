"""A conjugate linear-Gaussian regression is solved exactly by one CVI step (step size 1),
however the model writes its coefficients: one site per coefficient, one vector site, or a
``PyroModule[nn.Linear]`` with ``PyroSample`` priors.

After one ``svi.step`` the guide's joint ``q`` over all coefficients must be the exact
posterior (mean and full covariance, 1e-6), and the loss must be ``-log p(y)``: at the exact
posterior the ELBO equals the log evidence.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.nn import PyroModule, PyroSample

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

F64 = torch.float64
SIGMA = 0.3
N = 40
# prior of (intercept, slope 1, slope 2): different locations and scales
M0 = torch.tensor([0.5, 0.0, -0.3], dtype=F64)
S0 = torch.tensor([2.0, 1.0, 0.5], dtype=F64)


def _data():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(N, 2, generator=g, dtype=F64)
    y = (
        0.7
        + x @ torch.tensor([1.2, -0.8], dtype=F64)
        + SIGMA * torch.randn(N, generator=g, dtype=F64)
    )
    return x, y


def _exact(Z, y, m0, s0):
    """Posterior mean, covariance and log evidence of y = Z w + noise, w ~ N(m0, diag(s0^2))."""
    prior_prec = torch.diag(s0**-2)
    V = torch.linalg.inv(prior_prec + Z.T @ Z / SIGMA**2)
    V = 0.5 * (V + V.T)
    m = V @ (prior_prec @ m0 + Z.T @ y / SIGMA**2)
    cov_y = Z @ torch.diag(s0**2) @ Z.T + SIGMA**2 * torch.eye(len(y), dtype=F64)
    log_evidence = dist.MultivariateNormal(Z @ m0, cov_y).log_prob(y)
    return m, V, float(log_evidence)


def _design(x):
    return torch.cat([torch.ones(len(x), 1, dtype=F64), x], 1)


def three_sites(x, y):
    a = pyro.sample("a", dist.Normal(M0[0], S0[0]))
    b = pyro.sample("b", dist.Normal(M0[1], S0[1]))
    c = pyro.sample("c", dist.Normal(M0[2], S0[2]))
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(a + b * x[:, 0] + c * x[:, 1], SIGMA), obs=y)


def vector_site(x, y):
    w = pyro.sample("w", dist.Normal(M0, S0).to_event(1))
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(_design(x) @ w, SIGMA), obs=y)


class LinearModule(PyroModule):
    """``nn.Linear(2, 1)`` with priors on ``weight`` (1, 2) and ``bias`` (1,)."""

    def __init__(self):
        super().__init__()
        self.linear = PyroModule[torch.nn.Linear](2, 1)
        self.linear.weight = PyroSample(dist.Normal(M0[1:], S0[1:]).expand([1, 2]).to_event(2))
        self.linear.bias = PyroSample(dist.Normal(M0[:1], S0[:1]).expand([1]).to_event(1))

    def forward(self, x, y):
        mean = self.linear(x).squeeze(-1)
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Normal(mean, SIGMA), obs=y)


def _one_step(model, x, y):
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    svi.step(x, y)  # the loss of the initial q; the update makes q exact
    return guide, svi


def _check_loss(svi, x, y, log_evidence):
    loss = svi.evaluate_loss(x, y)
    assert loss == pytest.approx(-log_evidence, rel=1e-6), (loss, -log_evidence)
    again = svi.step(x, y)  # computed before this step's update: q is still the exact posterior
    assert again == pytest.approx(loss, rel=1e-9), (again, loss)


def _check_joint(q, m, V):
    assert isinstance(q, torch.distributions.MultivariateNormal), type(q)
    assert q.event_shape == (3,)
    torch.testing.assert_close(q.loc, m, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(q.covariance_matrix, V, rtol=1e-6, atol=1e-8)


def test_three_scalar_sites_one_step_exact():
    x, y = _data()
    m, V, log_evidence = _exact(_design(x), y, M0, S0)
    guide, svi = _one_step(three_sites, x, y)
    # marginals first (posterior() exists today), then the joint, then the loss
    got = [(guide.posterior(n).mean.item(), guide.posterior(n).variance.item()) for n in "abc"]
    msg = f"q marginals (mean, var) {got}; exact means {m.tolist()}, vars {V.diagonal().tolist()}"
    for i in range(3):
        assert got[i][0] == pytest.approx(m[i].item(), rel=1e-6, abs=1e-8), msg
        assert got[i][1] == pytest.approx(V[i, i].item(), rel=1e-6), msg
    _check_joint(guide.joint_posterior("a", "b", "c"), m, V)
    _check_loss(svi, x, y, log_evidence)


def test_vector_site_one_step_exact():
    x, y = _data()
    m, V, log_evidence = _exact(_design(x), y, M0, S0)
    guide, svi = _one_step(vector_site, x, y)
    _check_joint(guide.posterior("w"), m, V)
    _check_loss(svi, x, y, log_evidence)


def test_vector_site_joint_posterior_is_its_posterior():
    x, y = _data()
    m, V, _ = _exact(_design(x), y, M0, S0)
    guide, _ = _one_step(vector_site, x, y)
    _check_joint(guide.joint_posterior("w"), m, V)


def test_pyro_module_linear_one_step_exact():
    x, y = _data()
    # the joint is over (weight[0, 0], weight[0, 1], bias[0]): reorder the design to match
    Z = torch.cat([x, torch.ones(N, 1, dtype=F64)], 1)
    order = [1, 2, 0]
    m, V, log_evidence = _exact(Z, y, M0[order], S0[order])
    model = LinearModule()
    guide, svi = _one_step(model, x, y)
    names = list(guide.median(x, y))
    assert sorted(names) == ["linear.bias", "linear.weight"], names
    _check_joint(guide.joint_posterior("linear.weight", "linear.bias"), m, V)
    _check_loss(svi, x, y, log_evidence)
