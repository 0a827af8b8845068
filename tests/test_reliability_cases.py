"""After each error of the second reliability pass the guide and the optimizer take a correct
next step (bit for bit an undisturbed run's); and the silently wrong answers it found are right.
The errors themselves are checked against docs/errors.md in ``tests/test_errors.py``."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from reliability_cases import BETA_DATA, beta_model, data, gp_problem, logreg

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.checkpoints.checkpoint import load_checkpoint, save_checkpoint

X, Y = data()
BAD = {
    "half-precision": (logreg, (X, Y), (X.half(), Y.half()), TypeError),
    "bool-labels": (logreg, (X, Y), (X, Y.bool()), TypeError),
    "impossible-observation": (
        beta_model,
        (BETA_DATA,),
        (torch.cat([BETA_DATA[:2], BETA_DATA.new_ones(1), BETA_DATA[3:]]),),
        ValueError,
    ),
}


@pytest.mark.parametrize("later", [False, True], ids=["first-step", "later-step"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_guide_steps_on_exactly_after_the_error(case, later):
    model, good, bad, exc = BAD[case]

    def run(with_bad):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoCVI(model)
        svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
        losses = [svi.step(*good)] if later else []
        if with_bad:
            with pytest.raises(exc):
                svi.step(*bad)
        pyro.set_rng_seed(1)
        losses += [svi.step(*good) for _ in range(3)]
        return losses, {k: v.detach().clone() for k, v in pyro.get_param_store().items()}

    (clean, p), (after, p_after) = run(False), run(True)
    assert after == clean
    assert p.keys() == p_after.keys() and all(torch.equal(p[k], p_after[k]) for k in p)


def test_switching_to_cvi_after_the_optimizer_pairing_error():
    """AutoCVI + Adam + CVI_ELBO raises at the second step; switched to CVI(), the run is a
    fresh CVI() run (the unapplied step was dropped; before: the error kept firing)."""
    pyro.set_rng_seed(0)
    guide = AutoCVI(logreg)
    adam = SVI(logreg, guide, pyro.optim.Adam({"lr": 0.1}), loss=CVI_ELBO())
    adam.step(X, Y)
    with pytest.raises(ValueError, match="optimizer that is not CVI"):
        adam.step(X, Y)
    svi = SVI(logreg, guide, CVI(), loss=CVI_ELBO())
    losses = [svi.step(X, Y) for _ in range(4)]
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    ref = SVI(logreg, AutoCVI(logreg, prefix="ref"), CVI(), loss=CVI_ELBO())
    assert losses == [ref.step(X, Y) for _ in range(4)]


def test_a_pending_checkpoint_of_another_model_is_dropped(tmp_path):
    def other(X, y=None):
        v = pyro.sample("v", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ v), obs=y)

    optim, guide = CVI(), AutoCVI(other)
    SVI(other, guide, optim, loss=CVI_ELBO()).step(X, Y)
    save_checkpoint(tmp_path / "other.pt", optim, guide)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    optim, guide = CVI(), AutoCVI(logreg)
    load_checkpoint(tmp_path / "other.pt", optim, guide)
    svi = SVI(logreg, guide, optim, loss=CVI_ELBO())
    with pytest.raises(ValueError, match="not applied and is dropped"):
        svi.step(X, Y)
    assert guide.pending_restore is None
    pyro.set_rng_seed(0)
    losses = [svi.step(X, Y) for _ in range(3)]
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    ref = SVI(logreg, AutoCVI(logreg, prefix="ref"), CVI(), loss=CVI_ELBO())
    assert losses == [ref.step(X, Y) for _ in range(3)]


def test_the_run_goes_on_after_an_unwritable_checkpoint_path(tmp_path):
    optim, guide = CVI(), AutoCVI(logreg)
    svi = SVI(logreg, guide, optim, loss=CVI_ELBO())
    svi.step(X, Y)
    with pytest.raises(ValueError, match="cannot write checkpoint .*does not exist"):
        save_checkpoint(tmp_path / "missing" / "run.pt", optim, guide)
    assert not list(tmp_path.iterdir())  # no temporary file left behind
    save_checkpoint(tmp_path / "run.pt", optim, guide)
    assert math.isfinite(svi.step(X, Y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_median_and_quantiles_of_a_half_normal_leaf(dtype):
    """A leaf's q is its prior: HalfNormal(2) has median 2 sqrt(2) erfinv(1/2) = 1.349 (before:
    0, the median of the folded Normal pushed through abs; quantiles raised)."""

    def model(x):
        pyro.sample("s", dist.HalfNormal(x.new_tensor(2.0)))
        with pyro.plate("n", x.shape[0]):
            pyro.sample("x", dist.Normal(x.new_tensor(0.0), 1.0), obs=x)

    guide = AutoCVI(model)
    SVI(model, guide, CVI(), loss=CVI_ELBO()).step(BETA_DATA.to(dtype))
    ps = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    exact = 2.0 * math.sqrt(2.0) * torch.erfinv(ps)
    assert float(guide.median()["s"]) == pytest.approx(float(exact[1]), rel=1e-5)
    q = guide.quantiles([0.1, 0.5, 0.9])["s"].double().reshape(-1)
    torch.testing.assert_close(q, exact, rtol=1e-5, atol=1e-6)


def test_a_latent_of_shape_1_by_3_has_one_mean_and_median():
    def model(x):
        z = pyro.sample("z", dist.Normal(x.new_zeros(1, 3), 1.0).to_event(2))
        with pyro.plate("n", x.shape[0]):
            pyro.sample("x", dist.Normal(z.sum(), 1.0), obs=x)

    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
    for _ in range(3):
        svi.step(BETA_DATA)
    mean, median = guide.posterior("z").mean, guide.median()["z"]
    assert mean.shape == median.shape == (1, 3)
    torch.testing.assert_close(mean, median)
    # the exact posterior: sum(z) ~ N(0, 3) prior, 5 unit-noise observations of it
    post_sum = 3.0 * float(BETA_DATA.sum()) / (1.0 + 3.0 * 5)
    assert float(mean.sum()) == pytest.approx(post_sum, rel=1e-6)


def test_cvi_optimizer_steps_on_exactly_after_a_nan_target():
    opt, x, y = gp_problem()
    bad = y.clone()
    bad[3] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        opt.step(x, bad)
    after = [float(opt.step(x, y)) for _ in range(3)]
    ref, x, y = gp_problem()
    assert after == [float(ref.step(x, y)) for _ in range(3)]


@pytest.mark.parametrize("optimizer", ["CVI", "Adam"])
@pytest.mark.parametrize("guide_name", ["AutoNormal", "AutoMultivariateNormal"])
def test_pyro_guide_resumed_into_a_fresh_guide_is_bit_identical(guide_name, optimizer, tmp_path):
    """A Pyro autoguide restored into a fresh guide that has not run: its late set-up no longer
    draws from the restored generators (before: other losses after the resume)."""
    from pyro.infer import Trace_ELBO
    from pyro.infer import autoguide as ag

    def make():
        optim = CVI() if optimizer == "CVI" else pyro.optim.Adam({"lr": 0.05})
        return getattr(ag, guide_name)(logreg), optim

    pyro.set_rng_seed(0)
    guide, optim = make()
    svi = SVI(logreg, guide, optim, loss=Trace_ELBO())
    for _ in range(5):
        svi.step(X, Y)
    save_checkpoint(tmp_path / "run.pt", optim, None)
    uninterrupted = [svi.step(X, Y) for _ in range(5)]
    pyro.clear_param_store()
    guide, optim = make()
    load_checkpoint(tmp_path / "run.pt", optim, guide)
    svi = SVI(logreg, guide, optim, loss=Trace_ELBO())
    assert [svi.step(X, Y) for _ in range(5)] == uninterrupted
