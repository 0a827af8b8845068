"""``pyro_cvi.blocks.gaussian``: the site-form block (Algorithm 1) through its protocol."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks import GaussianBlock


def logistic(X, y):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
    b = pyro.sample("b", dist.Normal(torch.zeros((), dtype=X.dtype), 2.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def _data(N=40, D=3, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, D, generator=g, dtype=dtype)
    y = (torch.rand(N, generator=g, dtype=dtype) < torch.sigmoid(X[:, 0] - X[:, 1])).to(dtype)
    return X, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_block_protocol_views_of_q_agree(dtype):
    X, y = _data(dtype=dtype)
    guide = AutoCVI(logistic)
    svi = SVI(logistic, guide, CVI(step_size=0.5), loss=CVI_ELBO())
    for _ in range(5):
        svi.step(X, y)
    (block,) = guide.engine.blocks
    assert isinstance(block, GaussianBlock) and block.names == ("w", "b")
    joint = block.joint()
    # marginals are the joint's slices; the means are what sample(at_means) returns
    assert torch.allclose(block.marginal("w").mean, joint.mean[:3])
    assert torch.allclose(block.marginal("b").variance, joint.covariance_matrix[3, 3])
    means = block.sample({}, at_means=True)
    assert torch.equal(means["w"], joint.mean[:3].detach()) and means["b"].shape == ()
    assert block.sample({}, exclude=("w",)) == {}
    # the trace is taken at a fixed point (the affine factors do not care), kept across steps
    z_at = block.trace_values({})
    svi.step(X, y)
    assert all(torch.equal(z_at[n], block.trace_values({})[n]) for n in z_at)
    assert block.valid()
    assert block.labels == ["w, b"]


def test_one_site_per_data_point_and_new_data_of_another_size_is_refused():
    X, y = _data()
    guide = AutoCVI(logistic)
    svi = SVI(logistic, guide, CVI(step_size=0.5), loss=CVI_ELBO())
    svi.step(X, y)
    (block,) = guide.engine.blocks
    assert [pyro.param(n).shape for n in block.param_names()] == [torch.Size([40, 2])]
    with pytest.raises(ValueError, match="site 'y' now has 30 elements but the guide was fitted"):
        svi.step(X[:30], y[:30])


def test_steps_of_size_one_converge_to_a_fixed_point():
    """With step size 1 the sites jump to their targets (eq. 12); on a log-concave likelihood
    the bound then settles at its optimum within a dozen steps."""
    X, y = _data()
    guide = AutoCVI(logistic)
    svi = SVI(logistic, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    losses = [svi.step(X, y) for _ in range(12)]
    assert losses[-1] <= min(losses) + 1e-9
    assert abs(losses[-1] - losses[-2]) < 1e-8
