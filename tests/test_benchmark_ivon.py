"""The IVON peer of ``scripts/benchmark_bnn.py`` (``scripts/bench/ivon_runner.py``): its
Gaussian lands in an ``AutoNormal`` unchanged, the curve script's interpolation, the table and
verdicts of rows with and without Adam; with ``ivon-opt`` installed, IVON's Gaussian on a
conjugate model against the closed-form posterior."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from bench.ivon_runner import _scored_guide, run_ivon
from benchmark_bnn import _no_worse, table, verdict
from benchmark_ivon_curve import reach

DTYPES = [torch.float32, torch.float64]


def _model(y):
    mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 2.0))
    s = pyro.sample("s", dist.Gamma(y.new_tensor(2.0), 2.0))
    with pyro.plate("data", y.shape[0]):
        pyro.sample("y", dist.Normal(mu, s), obs=y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gaussian_is_written_into_autonormal_unchanged(dtype):
    """Unconstrained means and sds go in; the guide's loc and scale (the positive site on
    the log scale) come out, and its draws (what ``Trace_ELBO`` scores: the guide called
    reads the param store) have that mean and sd."""
    y = torch.tensor([0.3, -0.1, 0.8], dtype=dtype)
    locs = {"mu": torch.tensor(0.25, dtype=dtype), "s": torch.tensor(-0.5, dtype=dtype)}
    sds = {"mu": torch.tensor(0.3, dtype=dtype), "s": torch.tensor(0.2, dtype=dtype)}
    guide = _scored_guide(_model, (y,), 0, locs, sds)
    store = pyro.get_param_store()
    for site in ("mu", "s"):
        assert float(store[f"AutoNormal.locs.{site}"]) == pytest.approx(float(locs[site]))
        assert float(store[f"AutoNormal.scales.{site}"]) == pytest.approx(float(sds[site]))
    with torch.no_grad():
        draws = [guide(y) for _ in range(4000)]
    for site, f in (("mu", lambda v: v), ("s", torch.log)):
        u = torch.stack([f(d[site]) for d in draws])
        assert u.dtype == dtype
        sd = float(sds[site])
        assert float(u.mean()) == pytest.approx(float(locs[site]), abs=4 * sd / 4000**0.5)
        assert float(u.std()) == pytest.approx(sd, rel=0.06)


def test_reach_interpolates_between_step_counts():
    curve = [
        {"steps": 100, "cpu_s": 1.0, "estimate": (90.0, 0.1)},
        {"steps": 200, "cpu_s": 2.0, "estimate": (70.0, 0.1)},
        {"steps": 400, "cpu_s": 4.0, "estimate": (60.0, 0.1)},
    ]
    assert reach(curve, 75.0) == pytest.approx((175.0, 1.75))
    assert reach(curve, 95.0) == (100, 1.0)
    assert reach(curve, 59.0) is None


def _row(model, est, ivon=None, times=None):
    r = {
        "model": model,
        "seed": 0,
        "autocvi": {"estimate": est},
        "autocvi_ms_per_step": 5.0,
    }
    if ivon is not None:
        r["ivon"] = {"estimate": ivon, "lr": 0.1}
    if times is not None:
        r.update(
            {
                "autocvi_time_to_adam_best": times[0],
                "adam_time_to_adam_best": times[1],
                "adam_best": 70.0,
            }
        )
    return r


def test_table_and_verdicts_with_and_without_adam():
    rows = [
        _row("bnn_wine", (69.0, 0.5), ivon=(68.0, 0.5), times=(2.0, 8.0)),  # 1.0 < 2 * 0.71
        _row("bnn_wine", (70.5, 0.5), ivon=(68.0, 0.5)),  # 2.5 > 1.41: worse, no Adam
        _row("horseshoe_logistic", (100.0, 0.3), times=(3.0, 4.0)),  # 0.75x: not half
    ]
    lines = verdict(rows, [])
    assert "verdict bnn_wine: AutoCVI in at most half of Adam's time in 1/1" in lines
    assert "verdict bnn_wine: AutoCVI no worse than IVON at equal CPU in 1/2" in lines
    assert "verdict horseshoe_logistic: AutoCVI in at most half of Adam's time in 0/1" in lines
    t = table(rows)
    assert len(t) == 4 and t[1].split()[-2:] == ["yes", "yes"]
    assert t[2].split()[-2:] == ["-", "NO"] and t[3].split()[-2:] == ["NO", "-"]
    assert _no_worse((69.0, 0.5), (68.0, 0.5)) and not _no_worse((70.5, 0.5), (68.0, 0.5))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_ivon_on_a_conjugate_model_finds_the_posterior(dtype):
    """Normal mean, known noise, Normal(0, 2) prior: IVON through the potential energy (the
    prior in the loss) reaches the closed-form posterior mean and sd."""
    pytest.importorskip("ivon")

    def model(y):
        mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 2.0))
        with pyro.plate("data", y.shape[0]):
            pyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    y = torch.tensor([0.5, 1.5, 1.0, 2.0, 0.0, 1.2], dtype=dtype)
    prec = 1 / 4 + y.numel()
    mean, sd = float(y.sum()) / prec, prec**-0.5

    def estimate(model, guide, args):
        return (0.0, 0.0)

    r = run_ivon("normal_mean", model, (y,), 0.0, 0, 0.1, y.numel(), estimate, None, 4000)
    store = pyro.get_param_store()
    assert float(store["AutoNormal.locs.mu"]) == pytest.approx(mean, abs=0.05)
    assert float(store["AutoNormal.scales.mu"]) == pytest.approx(sd, rel=0.15)
    assert r["steps"] == 4000
