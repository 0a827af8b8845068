"""The fallback family: a Gaussian q on the unconstrained space of any continuous support."""

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from torch.distributions import constraints

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.families.transformed import UnconstrainedGaussian

F64 = torch.float64


def test_family_maps_through_the_bijection():
    fam = UnconstrainedGaussian(constraints.interval(0.0, 10.0))
    nat = fam.natural_at(torch.tensor([2.0, 7.5], dtype=F64))
    q = fam.natural_to_dist(nat)
    z = q.sample((20000,))
    assert bool(((z > 0) & (z < 10)).all())
    torch.testing.assert_close(
        fam.mean_value(nat, fam.natural_to_mean(nat)), z.median(0).values, atol=0.1, rtol=0
    )
    # log q(z) = log N(u) - log|det dT/du|, and the sampler returns that log-determinant
    zs, ladj = fam.sample_with_log_det(nat, torch.Size([5]))
    u = fam.transform.inv(zs)
    base = fam.base.natural_to_dist(nat)
    torch.testing.assert_close(q.log_prob(zs), base.log_prob(u) - ladj)


def test_uniform_noise_scale_is_learned():
    """Pyro's Bayesian regression tutorial: sigma ~ Uniform(0, 10) runs and is recovered."""
    g = torch.Generator().manual_seed(3)
    X = torch.randn(200, 2, generator=g, dtype=F64)
    y = (
        X @ torch.tensor([1.0, -2.0], dtype=F64)
        + 0.5
        + 0.8 * torch.randn(200, generator=g, dtype=F64)
    )

    def model(X, y):
        a = pyro.sample("a", dist.Normal(X.new_tensor(0.0), 10.0))
        w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
        sigma = pyro.sample("sigma", dist.Uniform(X.new_tensor(0.0), 10.0))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Normal(a + X @ w, sigma), obs=y)

    for remainder in ("off", "auto"):  # the mean field's fallback family; the remainder
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoCVI(model, remainder=remainder)
        svi = SVI(model, guide, CVI(step_size=0.2), loss=CVI_ELBO())
        for _ in range(200):
            svi.step(X, y)
        med = guide.median()
        assert 0.7 < float(med["sigma"]) < 0.95
        assert abs(float(med["a"]) - 0.5) < 0.2
        if remainder == "off":
            assert "gaussian (unconstrained)" in guide.explain()
        else:
            # a, w keep their exact block (the likelihood is Gaussian-linear in them given
            # sigma); sigma, whose Uniform prior has no conjugate pattern, is the remainder's
            text = guide.explain()
            assert "unconstrained values of sigma" in text and "# a, w: q = joint gaussian" in text


def test_lkj_cholesky_site_runs_and_its_loss_is_the_bound():
    g = torch.Generator().manual_seed(0)
    L_true = torch.linalg.cholesky(torch.tensor([[1.0, 0.6], [0.6, 1.0]], dtype=F64))
    y = torch.randn(100, 2, generator=g, dtype=F64) @ L_true.T

    def model(y):
        L = pyro.sample("L", dist.LKJCholesky(2, y.new_tensor(1.0)))
        with pyro.plate("data", y.shape[0]):
            pyro.sample("obs", dist.MultivariateNormal(y.new_zeros(2), scale_tril=L), obs=y)

    pyro.set_rng_seed(0)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=0.2), loss=CVI_ELBO())
    for _ in range(100):
        svi.step(y)
    L = guide.median()["L"]
    corr = (L @ L.T)[0, 1]
    assert abs(float(corr) - 0.6) < 0.15
    cvi = torch.tensor([svi.evaluate_loss(y) for _ in range(50)])
    mc = torch.tensor([Trace_ELBO(num_particles=20).loss(model, guide, y) for _ in range(50)])
    se = (cvi.var() / 50 + mc.var() / 50).sqrt()
    assert abs(cvi.mean() - mc.mean()) < 4 * se + 1e-6 * abs(mc.mean())
