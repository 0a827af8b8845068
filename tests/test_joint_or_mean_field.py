"""Mean field or the joint Gaussian for a block latent whose prior reads the remainder.

``theta_j ~ Normal(mu, tau)`` with ``tau`` in the remainder: by default ``theta`` shares the
remainder's joint Gaussian while that joint would hold at most ``JOINT_MAX_DIM`` unconstrained
coordinates, and keeps its exact block beside it (mean field, the prior's expected message)
beyond; ``AutoCVI(families={"theta": "joint"})`` and ``{"theta": "gaussian"}`` force either
side. Checked: the pick at both sides of the boundary (``J + 2`` coordinates for ``J``
groups), ``explain()``'s line naming the rule, the overrides, the refusals, the threshold equal
to the remainder's dense-Hessian size (its reason), and the default's mean-field side against
``Trace_ELBO`` (the reported loss within 3 standard errors).
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks.remainder_rules import SCALED_HESSIAN_MAX_DIM
from pyro_cvi.model.prior_factor import JOINT_MAX_DIM
from pyro_cvi.model.records import CONJUGATE_PRIOR

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


def groups_model(sigma, y):
    mu = pyro.sample("mu", dist.Normal(sigma.new_tensor(0.0), 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(sigma.new_tensor(2.0)))
    with pyro.plate("groups", y.shape[0]):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        with pyro.plate("per_group", y.shape[1]):
            pyro.sample("obs", dist.Normal(theta, sigma), obs=y.T)


def groups_data(J, dtype):
    g = torch.Generator().manual_seed(3)
    theta = 1.0 + 0.7 * torch.randn(J, generator=g, dtype=torch.float64)
    y = theta[:, None] + torch.randn(J, 3, generator=g, dtype=torch.float64)
    return torch.tensor(1.0, dtype=dtype), y.to(dtype)


def set_up(J, dtype, families=None, steps=1):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(groups_model, families=families)
    svi = SVI(groups_model, guide, CVI(), CVI_ELBO())
    args = groups_data(J, dtype)
    for _ in range(steps):
        svi.step(*args)
    return guide, svi, args


def test_the_threshold_is_the_dense_hessian_size():
    """Beyond it the joint is stepped without Price's dense Hessians (its reason)."""
    assert JOINT_MAX_DIM == SCALED_HESSIAN_MAX_DIM == 64


@DTYPES
def test_the_default_picks_by_the_joint_size(dtype):
    J = JOINT_MAX_DIM - 2  # mu, tau and J thetas: 64 coordinates, the joint
    guide, _, _ = set_up(J, dtype)
    assert guide.engine.analysis.remainder == ["mu", "tau", "theta"]
    assert CONJUGATE_PRIOR not in guide.explain()
    guide, _, _ = set_up(J + 1, dtype)  # 65: mean field
    assert guide.engine.analysis.remainder == ["tau"]
    line = next(t for t in guide.explain().splitlines() if CONJUGATE_PRIOR in t)
    assert line.lstrip().startswith("theta -> mu, theta")
    assert "mean field by default: the joint would hold 65 coordinates, more than 64" in line
    assert "families={'theta': 'joint'} keeps the joint" in line


@DTYPES
def test_the_user_forces_either_side(dtype):
    guide, _, _ = set_up(100, dtype, {"theta": "joint"})
    assert guide.engine.analysis.remainder == ["mu", "tau", "theta"]
    assert CONJUGATE_PRIOR not in guide.explain()
    guide, _, _ = set_up(8, dtype, {"theta": "gaussian"})
    assert guide.engine.analysis.remainder == ["tau"]
    line = next(t for t in guide.explain().splitlines() if CONJUGATE_PRIOR in t)
    assert "named families={'theta': 'gaussian'}: mean field" in line


def test_unknown_and_misplaced_values_are_refused_by_name():
    with pytest.raises(ValueError, match=r"'theta': 'jiont'.*unknown family name.*'joint'"):
        AutoCVI(groups_model, families={"theta": "jiont"})
    with pytest.raises(ValueError, match=r"'nope' is not a latent site"):
        set_up(8, torch.float64, {"nope": "joint"})

    def labelled(y):
        z = pyro.sample("z", dist.Bernoulli(y.new_tensor(0.3)))
        pyro.sample("y", dist.Normal(z, 1.0), obs=y)

    pyro.clear_param_store()
    guide = AutoCVI(labelled, families={"z": "joint"})
    with pytest.raises(ValueError, match=r"families=\{'z': 'joint'\}.*'z' is discrete"):
        guide(torch.tensor(0.5, dtype=torch.float64))


@DTYPES
def test_the_default_mean_field_against_trace_elbo(dtype):
    """The default's mean-field side (80 groups) reports its bound: the reported loss against
    an independent ``Trace_ELBO`` of the same guide within 3 standard errors."""
    guide, svi, args = set_up(80, dtype, steps=60)
    assert guide.engine.analysis.remainder == ["tau"]
    with torch.no_grad():
        reported = torch.tensor([svi.evaluate_loss(*args) for _ in range(300)]).double()
        trace = torch.tensor(
            [Trace_ELBO(num_particles=100).loss(groups_model, guide, *args) for _ in range(10)],
            dtype=torch.float64,
        )
    se = math.hypot(reported.std() / math.sqrt(300), trace.std() / math.sqrt(10))
    assert abs(float(reported.mean() - trace.mean())) < 3 * se + 1e-3, (reported.mean(), se)
