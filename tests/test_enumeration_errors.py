"""A model that does not broadcast over enumeration dims never gets a silent wrong
classification or a raw torch error, and a discrete latent is never traced at a value outside
its support.

* ``discrete_mode``: a most probable value of the support also at a tie (torch's
  ``Bernoulli(0.5).mode`` is NaN; the guide's trace used it and indexed with NaN);
* a Bernoulli read through ``.long()`` as an index fits: its traced value is 0 or 1 and the
  reported loss is the closed-form bound of the symmetric mean-field point, above ``-log Z``;
* models that index, reshape, view or sum over a fixed dim: a ``ValueError`` naming the site
  and the latent, also where the enumerated run succeeds but hides the dependency (a sum over
  dim 0 left the switch looking like a leaf); the same model written to broadcast fits.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.blocks.marginals import discrete_mode

DTYPES = [torch.float64, torch.float32]
IDS = ["f64", "f32"]


def _fit(model, steps):
    pyro.clear_param_store()
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    return guide, [svi.step() for _ in range(steps)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_discrete_mode_is_a_value_of_the_support_at_ties(dtype):
    b = discrete_mode(dist.Bernoulli(torch.tensor([0.5, 0.7, 0.2, 0.5], dtype=dtype)))
    assert b.dtype == dtype and b.tolist() == [0.0, 1.0, 0.0, 0.0]
    probs = torch.tensor([[0.4, 0.4, 0.2], [0.1, 0.2, 0.7]], dtype=dtype)
    assert discrete_mode(dist.Categorical(probs)).tolist() == [0, 2]
    one_hot = discrete_mode(dist.OneHotCategorical(probs))
    assert one_hot.sum(-1).tolist() == [1.0, 1.0] and one_hot[1].tolist() == [0.0, 0.0, 1.0]
    # a batch of ties with an event dim kept: Bernoulli(0.5) reinterpreted
    ev = discrete_mode(dist.Bernoulli(torch.full((2, 3), 0.5, dtype=dtype)).to_event(1))
    assert ev.shape == (2, 3) and bool(((ev == 0) | (ev == 1)).all())


def _index_model(dtype, y):
    """``locs ~ N(0, I_2)``, ``b ~ Bernoulli(1/2)``, ``y_i ~ N(locs[b], 1)`` (b as an index)."""

    def model():
        locs = pyro.sample("locs", dist.Normal(torch.zeros(2, dtype=dtype), 1.0).to_event(1))
        b = pyro.sample("b", dist.Bernoulli(torch.tensor(0.5, dtype=dtype)))
        with pyro.plate("d", len(y)):
            pyro.sample("y", dist.Normal(locs[b.long()], 1.0), obs=y)

    return model


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_a_bernoulli_used_as_an_index_fits(dtype):
    pyro.set_rng_seed(0)
    y = (torch.randn(8, dtype=torch.float64) + 1.5).to(dtype)
    model = _index_model(dtype, y)
    guide, losses = _fit(model, 20)
    # both values of b give y ~ N(0, I + 11^T): log Z is that Gaussian's log density
    n = len(y)
    cov = torch.eye(n, dtype=torch.float64) + 1.0
    log_z = float(
        dist.MultivariateNormal(torch.zeros(n, dtype=torch.float64), cov).log_prob(y.double())
    )
    values = guide.engine.trace_values({})
    assert values["b"].dtype == dtype and float(values["b"]) in (0.0, 1.0)
    assert all(math.isfinite(v) for v in losses)
    loss = sum(losses[-5:]) / 5
    # the symmetric mean-field point q(b) = 1/2, each q(locs_k) the prior times the likelihood
    # tempered by 1/2: -ELBO = -2 log of int N(l; 0, 1) prod_i N(y_i; l, 1)^(1/2) dl
    yd = y.double()
    a, h = 1.0 + n / 2.0, float(yd.sum()) / 2.0
    log_i = -n / 4.0 * math.log(2 * math.pi) - float((yd**2).sum()) / 4.0
    log_i += -0.5 * math.log(a) + h * h / (2.0 * a)
    tol = 1e-8 if dtype == torch.float64 else 1e-4
    assert abs(loss - -2 * log_i) < tol * abs(log_i), (loss, -2 * log_i)
    assert loss > -log_z  # (a bound: above -log Z = -log p(y))


def _locs(dtype):
    return pyro.sample("locs", dist.Normal(torch.zeros(3, dtype=dtype), 1.0).to_event(1))


def _summed(dtype, y):  # runs enumerated, but the sum over dim 0 removes the switch's dim
    def model():
        locs = _locs(dtype)
        s = pyro.sample("s", dist.Categorical(torch.ones(3, dtype=dtype) / 3))
        with pyro.plate("d", len(y)):
            pyro.sample("y", dist.Normal(locs[s].sum(0), 1.0), obs=y)

    return model


def _reshaped(dtype, y):  # a fixed reshape of the index
    def model():
        locs = _locs(dtype)
        s = pyro.sample("s", dist.Categorical(torch.ones(3, dtype=dtype) / 3)).reshape(())
        with pyro.plate("d", len(y)):
            pyro.sample("y", dist.Normal(locs[s], 1.0), obs=y)

    return model


def _viewed(dtype, y):  # a marked switch viewed to a fixed shape
    def model():
        locs = _locs(dtype)
        s = pyro.sample(
            "s",
            dist.Categorical(torch.ones(3, dtype=dtype) / 3),
            infer={"enumerate": "parallel"},
        )
        pyro.sample("y", dist.Normal(locs[s.view(1)].expand(len(y)), 1.0).to_event(1), obs=y)

    return model


def _plate_view(dtype, y):  # a plate-local Bernoulli whose use is viewed to the plate's size
    def model():
        locs = _locs(dtype)
        with pyro.plate("d", len(y), dim=-1):
            s = pyro.sample("s", dist.Bernoulli(torch.tensor(0.5, dtype=dtype)))
            pyro.sample("y", dist.Normal(locs[s.long()].view(len(y)), 1.0), obs=y)

    return model


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("make", [_summed, _reshaped, _viewed, _plate_view])
def test_a_model_that_does_not_broadcast_is_refused_by_name(make, dtype):
    pyro.set_rng_seed(0)
    y = torch.randn(6, dtype=dtype)
    with pytest.raises(ValueError, match=r"enumeration dims .*'s'") as info:
        _fit(make(dtype, y), 1)
    assert "broadcast" in str(info.value)
    if make is _summed:  # the enumerated run succeeded: the check names the hidden reader
        assert "site 'y' reads discrete latent 's'" in str(info.value)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_the_same_switch_written_to_broadcast_is_not_a_leaf(dtype):
    pyro.set_rng_seed(0)
    y = torch.tensor([2.1, 1.7, 2.6, 2.2], dtype=dtype)

    def model():
        locs = _locs(dtype)
        s = pyro.sample("s", dist.Categorical(torch.ones(3, dtype=dtype) / 3))
        with pyro.plate("d", len(y)):
            pyro.sample("y", dist.Normal(locs[s], 1.0), obs=y)

    guide, losses = _fit(model, 10)
    assert "s" not in guide.engine.analysis.leaves
    assert all(math.isfinite(v) for v in losses)
    values = guide.engine.trace_values({})
    assert values["s"].dtype == torch.int64 and 0 <= int(values["s"]) < 3
