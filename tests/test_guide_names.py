"""Parameter names per guide: two AutoCVI guides in one process, each under its own prefix,
fit exactly what each fits alone; two guides under one prefix are refused with a clear error
(they would read and overwrite each other's parameters), and nothing else is refused."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

DTYPES = [torch.float32, torch.float64]


def _problem(seed, N, dtype):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, 3, generator=g, dtype=torch.float64)
    y = (torch.rand(N, generator=g, dtype=torch.float64) < torch.sigmoid(X.sum(-1))).to(dtype)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(3), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model, X.to(dtype), y


def _fit(model, guide, X, y, steps=8):
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    return [svi.step(X, y) for _ in range(steps)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_two_guides_with_their_own_prefixes_fit_what_each_fits_alone(dtype):
    (m1, X1, y1), (m2, X2, y2) = _problem(1, 40, dtype), _problem(2, 70, dtype)
    alone = []
    for model, X, y in ((m1, X1, y1), (m2, X2, y2)):
        pyro.clear_param_store()
        guide = AutoCVI(model)
        alone.append((_fit(model, guide, X, y), guide.posterior("w").mean.detach()))
    pyro.clear_param_store()
    g1, g2 = AutoCVI(m1, prefix="first"), AutoCVI(m2, prefix="second")
    s1 = SVI(m1, g1, CVI(step_size=1.0), loss=CVI_ELBO())
    s2 = SVI(m2, g2, CVI(step_size=1.0), loss=CVI_ELBO())
    losses = [(s1.step(X1, y1), s2.step(X2, y2)) for _ in range(8)]
    names = set(pyro.get_param_store().keys())
    assert {"first.sites.y", "second.sites.y", "first.num_steps", "second.num_steps"} <= names
    assert not any(n.startswith("AutoCVI.") for n in names)
    for k, guide in enumerate((g1, g2)):
        assert [pair[k] for pair in losses] == pytest.approx(alone[k][0], rel=1e-6)
        torch.testing.assert_close(guide.posterior("w").mean.detach(), alone[k][1])
    assert dict(g1.named_parameters()).keys() == {"sites.y", "num_steps"}


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_a_second_guide_under_a_used_prefix_is_refused_and_both_stay_usable(dtype):
    (m1, X1, y1), (m2, X2, y2) = _problem(1, 40, dtype), _problem(2, 40, dtype)
    g1 = AutoCVI(m1)
    s1 = SVI(m1, g1, CVI(step_size=1.0), loss=CVI_ELBO())
    s1.step(X1, y1)
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    g2 = AutoCVI(m2)
    s2 = SVI(m2, g2, CVI(step_size=1.0), loss=CVI_ELBO())
    with pytest.raises(ValueError, match=r"prefix 'AutoCVI'.*AutoCVI\(model, prefix="):
        s2.step(X2, y2)
    after = dict(pyro.get_param_store().items())
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k].detach(), v), k
    # the first guide steps on as if nothing happened; the second, renamed, fits its own data
    reference = _fit(m1, AutoCVI(m1, prefix="ref"), X1, y1, steps=3)
    assert s1.step(X1, y1) == pytest.approx(reference[1], rel=1e-6)
    g2 = AutoCVI(m2, prefix="other")
    losses = _fit(m2, g2, X2, y2)
    pyro.clear_param_store()
    assert losses == pytest.approx(_fit(m2, AutoCVI(m2), X2, y2), rel=1e-6)


def test_a_dropped_guide_or_a_cleared_store_holds_no_claim():
    model, X, y = _problem(1, 40, torch.float64)
    guide = AutoCVI(model)
    first = _fit(model, guide, X, y, steps=2)
    del guide  # dropped: a new guide under the same prefix is a new run
    pyro.clear_param_store()
    assert _fit(model, AutoCVI(model), X, y, steps=2) == first
    kept = AutoCVI(model)
    _fit(model, kept, X, y, steps=2)
    pyro.clear_param_store()  # the live guide's parameters left the store: no claim
    assert _fit(model, AutoCVI(model), X, y, steps=2) == first


@pytest.mark.parametrize("prefix", ["", ".x", "x.", 3, None])
def test_a_bad_prefix_is_refused(prefix):
    model, _, _ = _problem(1, 5, torch.float64)
    with pytest.raises(ValueError, match=r"AutoCVI\(prefix=.*non-empty string"):
        AutoCVI(model, prefix=prefix)
