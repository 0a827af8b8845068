"""The block protocol (``pyro_cvi/blocks/base.py``) and the worked example of
docs/architecture.md: a new kind of block is one class (here, in this test file) plus one
registration line; the engine, the guide and the optimizer need no edit.

``ConjugateScalarBlock`` is the whole of Algorithm 1 for a scalar Gaussian latent whose factors
are its Normal prior and Normal likelihoods with a mean affine in it: the target is the exact
posterior's natural parameters ``(m0/s0^2 + sum_r a_r (y_r - c_r)/sigma_r^2,
-1/(2 s0^2) - sum_r a_r^2/(2 sigma_r^2))`` (eq. 2), and its ELBO is closed form.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks import (
    Block,
    BlockInit,
    GaussianBlock,
    MarkovBlock,
    MeanFieldBlock,
    NaturalBlock,
    SiteFormBlock,
    StepReport,
    register_block_kind,
    unregister_block_kind,
)
from pyro_cvi.model.records import CONJUGATE
from pyro_cvi.update import damped_step, targets_from_grads


class ConjugateScalarBlock(Block):
    """A toy block kind: one scalar Gaussian latent, exact conjugate messages only."""

    kind = "toy"

    def __init__(self, spec, prefix, owned, options):
        self.spec, self.names, self.owned = spec, spec.names, set(owned)
        self.param = f"{prefix}.toy.{spec.names[0]}"
        self.z_at = None

    def param_names(self):
        return [self.param]

    def setup(self, init: BlockInit):
        self.z_at = init.values[self.names[0]].detach()
        pyro.param(self.param, lambda: torch.stack([self.z_at * 0, self.z_at * 0 - 0.5]))

    def _target(self, trace):
        prior = trace.nodes[self.names[0]]["fn"]
        m0, v0 = prior.loc, prior.scale**2
        eta1, eta2 = m0 / v0, -0.5 / v0
        for f in self.spec.factors:
            if f.kind == CONJUGATE:
                site = trace.nodes[f.site]
                a = f.jacobian[:, 0]
                c = site["fn"].loc.reshape(-1) - a * self.z_at
                s2 = site["fn"].scale.expand_as(site["fn"].loc).reshape(-1) ** 2
                eta1 = eta1 + (a * (site["value"].reshape(-1) - c) / s2).sum()
                eta2 = eta2 - (a**2 / (2 * s2)).sum()
        return torch.stack([eta1, eta2]).detach()

    def _moments(self):
        eta = pyro.param(self.param).detach()
        v = -0.5 / eta[1]
        return eta[0] * v, v

    def messages(self, ctx):
        m, v = self._moments()
        tr = ctx.trace
        prior = tr.nodes[self.names[0]]["fn"]
        elbo = 0.5 * torch.log(2 * math.pi * math.e * v)  # H[q]
        elbo = elbo - 0.5 * ((m - prior.loc) ** 2 + v) / prior.scale**2
        elbo = elbo - torch.log(prior.scale) - 0.5 * math.log(2 * math.pi)
        for f in self.spec.factors:
            if f.kind == CONJUGATE and f.site in self.owned:
                site = tr.nodes[f.site]
                a = f.jacobian[:, 0]
                c = site["fn"].loc.reshape(-1) - a * self.z_at
                s = site["fn"].scale.expand_as(site["fn"].loc).reshape(-1)
                y = site["value"].reshape(-1)
                sq = (y - a * m - c) ** 2 + a**2 * v
                elbo = elbo + (-0.5 * sq / s**2 - torch.log(s) - 0.5 * math.log(2 * math.pi)).sum()
        if ctx.grads:
            p = pyro.param(self.param)
            p.grad = self._target(tr) - p.detach()
        return elbo

    def step(self, beta, ctx=None):
        old, target = targets_from_grads([pyro.param(self.param)])
        new, counts = damped_step(old, target, beta, lambda new: new[0][1] < 0)
        with torch.no_grad():
            pyro.param(self.param).copy_(new[0])
        return [StepReport(self.label, self.kind, beta, counts)]

    def trace_values(self, subsample):
        return {self.names[0]: self.z_at}

    def sample(self, subsample, exclude=(), at_means=False):
        if self.names[0] in exclude:
            return {}
        q = self.marginal(self.names[0])
        return {self.names[0]: q.mean if at_means else q.sample()}

    def marginal(self, name):
        m, v = self._moments()
        return dist.Normal(m, v.sqrt())


def _accepts(spec):
    return len(spec.names) == 1 and spec.dim == 1 and spec.chain is None


@pytest.fixture
def toy_kind():
    register_block_kind(_accepts, ConjugateScalarBlock)  # the one registration line
    yield
    unregister_block_kind(ConjugateScalarBlock)


def model(y):
    x = pyro.sample("x", dist.Normal(torch.tensor(1.0, dtype=y.dtype), 2.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(3.0 * x - 1.0, 0.5), obs=y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_registered_toy_block_kind_gives_the_exact_posterior(toy_kind, dtype):
    y = torch.tensor([2.0, 1.5, 2.7, 1.9], dtype=dtype)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    svi.step(y)
    loss = svi.step(y)  # at the exact posterior: -ELBO = -log p(y)
    assert isinstance(guide.engine.blocks[0], ConjugateScalarBlock)
    # the exact posterior of x: precision 1/4 + 4 * 9/0.25, mean by eq. 2
    prec = 1 / 4 + len(y) * 9 / 0.25
    mean = (1.0 / 4 + (3.0 * (y.double() + 1.0)).sum().item() / 0.25) / prec
    q = guide.posterior("x")
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=0)
    assert torch.allclose(q.mean.double(), torch.tensor(mean, dtype=torch.float64), **tol)
    assert torch.allclose(q.variance.double(), torch.tensor(1 / prec, dtype=torch.float64), **tol)
    # -log p(y): y ~ N(3 * 1 - 1, 0.25 I + 9 * 4 * 11^T)
    cov = 0.25 * torch.eye(len(y), dtype=torch.float64) + 36.0
    evidence = dist.MultivariateNormal(torch.full((len(y),), 2.0, dtype=torch.float64), cov)
    assert abs(loss + evidence.log_prob(y.double()).item()) < (
        1e-3 if dtype == torch.float32 else 1e-8
    )


def test_without_the_registration_the_builtin_gaussian_block_gives_the_same_answer():
    y = torch.tensor([2.0, 1.5, 2.7, 1.9], dtype=torch.float64)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    svi.step(y)
    svi.step(y)
    assert isinstance(guide.engine.blocks[0], GaussianBlock)
    prec = 1 / 4 + len(y) * 9 / 0.25
    assert abs(guide.posterior("x").variance.item() - 1 / prec) < 1e-12


def test_every_block_kind_derives_from_the_protocol():
    for kind in (GaussianBlock, MarkovBlock, NaturalBlock, MeanFieldBlock, SiteFormBlock):
        assert issubclass(kind, Block), kind
    with pytest.raises(TypeError):
        Block()  # abstract


def mixed_kinds(y, counts, X, labels, series):
    """The toy block (``x``) beside a Gamma natural block, a Gaussian block and a Markov chain."""
    x = pyro.sample("x", dist.Normal(y.new_tensor(1.0), 2.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(3.0 * x - 1.0, 0.5), obs=y)
    rate = pyro.sample("rate", dist.Gamma(y.new_tensor(2.0), 1.0))
    with pyro.plate("counts", len(counts)):
        pyro.sample("c", dist.Poisson(rate), obs=counts)
    w = pyro.sample("w", dist.Normal(y.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("labels", len(labels)):
        pyro.sample("b", dist.Bernoulli(logits=X @ w), obs=labels)
    z = y.new_tensor(0.0)
    for t in pyro.markov(range(len(series))):
        z = pyro.sample(f"z_{t}", dist.Normal(z, 0.5))
        pyro.sample(f"s_{t}", dist.Normal(z, 1.0), obs=series[t])


def _mixed_data(dtype):
    g = torch.Generator().manual_seed(3)
    y = torch.tensor([2.0, 1.5, 2.7, 1.9], dtype=dtype)
    counts = torch.tensor([3.0, 1.0, 4.0, 2.0, 2.0], dtype=dtype)
    X = torch.randn(20, 2, generator=g, dtype=torch.float64).to(dtype)
    labels = (X[:, 0] > 0).to(dtype)
    series = torch.cumsum(torch.randn(6, generator=g, dtype=torch.float64), 0).to(dtype)
    return y, counts, X, labels, series


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_toy_block_answers_every_guide_method_beside_the_other_kinds(toy_kind, dtype, tmp_path):
    """The worked example defines only the protocol's abstract methods; the guide's methods
    (median, quantiles, posterior, get_posterior, sample_latent, Predictive, a checkpoint round
    trip) work for it through the protocol's defaults, beside Gamma, Gaussian and Markov blocks."""
    from pyro.infer import Predictive

    from pyro_cvi.checkpoints.checkpoint import load_checkpoint, save_checkpoint

    args = _mixed_data(dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(mixed_kinds)
    optim = CVI(step_size=1.0)
    svi = SVI(mixed_kinds, guide, optim, loss=CVI_ELBO())
    svi.step(*args)
    svi.step(*args)
    kinds = {type(b).__name__ for b in guide.engine.blocks}
    assert {"ConjugateScalarBlock", "GaussianBlock", "MarkovBlock", "MeanFieldBlock"} <= kinds
    y = args[0].double()
    prec = 1 / 4 + len(y) * 9 / 0.25
    mean = (1.0 / 4 + (3.0 * (y + 1.0)).sum().item() / 0.25) / prec
    tol = 1e-4 if dtype == torch.float32 else 1e-9
    med = guide.median()
    assert abs(float(med["x"]) - mean) < tol * (1 + abs(mean))
    assert set(med) == {"x", "rate", "w"} | {f"z_{t}" for t in range(6)}
    qs = guide.quantiles([0.1, 0.5, 0.9])
    assert torch.allclose(qs["x"][1], med["x"])
    half = 1.2815515655446004 * math.sqrt(1 / prec)  # the 0.9 quantile of N(0, 1)
    assert abs(float(qs["x"][2] - qs["x"][0]) - 2 * half) < 1e-3
    q = guide.posterior("x")
    assert abs(float(q.variance) - 1 / prec) < tol
    packed = guide.get_posterior()
    assert packed.event_shape == (1 + 1 + 2 + 6,)
    u = pyro.poutine.trace(guide.sample_latent).get_trace().nodes["_AutoCVI_latent"]["value"]
    assert u.shape == (10,) and bool(torch.isfinite(u).all())
    draws = Predictive(mixed_kinds, guide=guide, num_samples=200)(*args)
    x = draws["x"].reshape(-1)  # (Predictive pads global sites to the plates' depth)
    assert x.shape == (200,)
    assert abs(float(x.double().mean()) - mean) < 4 * math.sqrt(1 / prec / 200)
    # a checkpoint round trip: the same q, and the same next step
    path = tmp_path / "run.pt"
    save_checkpoint(path, optim, guide)
    pyro.set_rng_seed(1)
    expected = svi.step(*args)
    pyro.clear_param_store()
    guide2, optim2 = AutoCVI(mixed_kinds), CVI(step_size=1.0)
    load_checkpoint(path, optim2, guide2)
    svi2 = SVI(mixed_kinds, guide2, optim2, loss=CVI_ELBO())
    pyro.set_rng_seed(1)
    assert svi2.step(*args) == pytest.approx(expected, rel=1e-6)
    assert isinstance(guide2.engine.block_for("x"), ConjugateScalarBlock)
