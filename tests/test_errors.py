"""Every row of docs/errors.md is reproduced here; the documented message must match."""

import contextlib
import logging
import re
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal
from reliability_cases import CASES as MORE_CASES

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, CheckpointError, DivergenceError

TABLE = Path(__file__).resolve().parent.parent / "docs" / "errors.md"


def _rows():
    rows = {}
    for line in TABLE.read_text().splitlines():
        m = re.match(r"\| ([a-z0-9-]+) \| (.+?) \| `(\w+)`: (.+?) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(3), m.group(4))
    return rows


ROWS = _rows()


class Logged(Exception):
    """A routine event the library logs (INFO, logger ``pyro_cvi``) instead of warning about."""


@contextlib.contextmanager
def _logged():
    """Collect the ``pyro_cvi`` log records; fail on a warning about a routine event."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("pyro_cvi")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield records
        routine = [w for w in caught if "shrunk" in str(w.message) or "undone" in str(w.message)]
        assert not routine, routine  # routine events are logged, not warned
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def _data(N=60):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, 2, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(X[:, 0]), generator=g)
    return X, y


def logreg(X, y=None):
    w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def _svi(model=logreg, guide=None, loss=None, step=1.0):
    guide = AutoCVI(model) if guide is None else guide
    return SVI(model, guide, CVI(step_size=step), loss=CVI_ELBO() if loss is None else loss)


def case_non_finite_observation():
    X, y = _data()
    y[5] = float("nan")
    _svi().step(X, y)


def case_shape_mismatch():
    X, y = _data()
    _svi().step(X, y.unsqueeze(-1))


def case_unsupported_support():
    def model():
        k = pyro.sample("k", dist.OneHotCategorical(torch.ones(3) / 3))
        pyro.sample("y", dist.Normal((k * torch.arange(3.0)).sum(-1), 1.0), obs=torch.tensor(0.0))

    _svi(model).step()


@pytest.mark.parametrize("discrete", ["mean_field", "collapse"])
@pytest.mark.parametrize("prior", [dist.Poisson(3.0), dist.Geometric(0.3)], ids=["poisson", "geo"])
def test_infinite_discrete_latent(prior, discrete):
    def model():
        k = pyro.sample("k", prior)
        pyro.sample("y", dist.Normal(k, 1.0), obs=torch.tensor(0.0))

    guide = AutoCVI(model, discrete=discrete)
    with pytest.raises(ValueError, match=r"latent site 'k' is discrete.*Truncate it"):
        _svi(model, guide).step()


def case_infinite_discrete_latent():
    def model():
        k = pyro.sample("k", dist.Poisson(3.0))
        pyro.sample("y", dist.Normal(k, 1.0), obs=torch.tensor(0.0))

    _svi(model).step()


def case_structure_change():
    calls = []

    def model(X, y=None):
        calls.append(1)
        w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
        if len(calls) > 4:
            pyro.sample("extra", dist.Normal(0.0, 1.0))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    X, y = _data()
    svi = _svi(model)
    for _ in range(3):
        svi.step(X, y)


def case_wrong_model():
    X, y = _data()

    def other(X, y=None):
        return logreg(X, y)

    SVI(other, AutoCVI(logreg), CVI(step_size=1.0), loss=CVI_ELBO()).step(X, y)


def case_data_size_change():
    X, y = _data()
    svi = _svi()
    svi.step(X, y)
    svi.step(X[:30], y[:30])


def case_plain_guide_with_cvi_elbo():
    X, y = _data()
    _svi(guide=AutoNormal(logreg)).step(X, y)


def case_cvi_with_other_loss():
    X, y = _data()
    _svi(loss=Trace_ELBO()).step(X, y)


def case_torch_optimizer_with_cvi_elbo():
    X, y = _data()
    svi = SVI(logreg, AutoCVI(logreg), pyro.optim.Adam({"lr": 0.1}), loss=CVI_ELBO())
    svi.step(X, y)
    svi.step(X, y)


def case_guide_list_with_cvi_elbo():
    X, y = _data()
    guide = AutoGuideList(logreg)
    guide.append(AutoCVI(logreg))
    guide.append(AutoCVI(logreg, prefix="AutoCVI_2"))
    _svi(guide=guide).step(X, y)


def case_num_particles():
    CVI_ELBO(num_particles=4)


def case_bad_step_size():
    CVI(step_size=0.0)


def case_shrunk_step():
    # a Student-t likelihood with huge outliers at step 1: the precision goes non-PD
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 1, generator=g, dtype=torch.float64)
    y = 100.0 * torch.randn(30, generator=g, dtype=torch.float64)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(x.new_zeros(1), 10.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.StudentT(1.0, x @ w, 0.01), obs=y)

    svi = _svi(model)
    with _logged() as records:
        for _ in range(30):
            try:
                svi.step(x, y)
            except DivergenceError:  # outliers this large may also diverge: rolled back
                pass
            if svi.guide.num_shrunk > 0:
                break
    assert svi.guide.num_shrunk > 0
    raise Logged([r.getMessage() for r in records if "shrunk" in r.getMessage()][0])


def case_unknown_family():
    AutoCVI(logreg, families={"w": "student"})


def case_family_not_a_site():
    X, y = _data()
    _svi(guide=AutoCVI(logreg, families={"v": "gaussian"})).step(X, y)


def case_family_does_not_apply():
    X, y = _data()
    _svi(guide=AutoCVI(logreg, families={"w": "gamma"})).step(X, y)


def _exponential_rate(y):
    # a real latent used as a rate: fine near its prior, invalid where a long step sends it
    w = pyro.sample("w", dist.Normal(y.new_tensor(3.0), 0.3))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Exponential(w), obs=y)


def case_initial_q_invalid():
    def model(y):
        w = pyro.sample("w", dist.Normal(y.new_tensor(0.0), 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Exponential(w), obs=y)

    SVI(model, AutoCVI(model), CVI(), CVI_ELBO()).step(torch.ones(3, dtype=torch.float64))


def case_fixed_step_failed():
    y = torch.full((20,), 30.0, dtype=torch.float64)
    svi = _svi(_exponential_rate, step=1.0, guide=AutoCVI(_exponential_rate, remainder="off"))
    for _ in range(3):
        svi.step(y)


def case_backtracked_step():
    y = torch.full((20,), 30.0, dtype=torch.float64)
    guide = AutoCVI(_exponential_rate, remainder="off")
    svi = SVI(_exponential_rate, guide, CVI(), CVI_ELBO())
    with _logged() as records:
        for _ in range(3):
            svi.step(y)
    assert svi.guide.num_backtracks > 0
    raise Logged([r.getMessage() for r in records if "undone" in r.getMessage()][0])


# ---------------------------------------------------------------- bad data, files
def _bad(**change):
    X, y = _data()
    X, y = X.clone(), y.clone()
    for key, (where, value) in change.items():
        {"X": X, "y": y}[key][where] = value
    return X, y


def case_observation_outside_support():
    _svi().step(*_bad(y=(4, 2.0)))


def case_fractional_label():
    _svi().step(*_bad(y=(4, 0.5)))


def poisson_reg(X, y=None):
    w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Poisson((X @ w).exp()), obs=y)


def case_negative_count():
    X, _ = _data()
    y = torch.ones(60, dtype=X.dtype)
    y[7] = -3.0
    _svi(poisson_reg).step(X, y)


def case_nan_in_inputs():
    _svi().step(*_bad(X=((3, 1), float("nan"))))


def case_inf_in_inputs():
    _svi().step(*_bad(X=((3, 1), float("inf"))))


def case_integer_labels():
    X, y = _data()
    _svi().step(X, y.long())


def float64_prior(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def case_mixed_dtypes():
    X, y = _data()
    _svi(float64_prior).step(X.float(), y.float())


def any_width(X, y=None):
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def case_shape_change():
    X, y = _data()
    svi = _svi(any_width)
    svi.step(X, y)
    svi.step(torch.cat([X, X[:, :1]], 1), y)


def case_empty_data():
    X, y = _data()
    _svi().step(X[:0], y[:0])


def linreg(X, y=None):
    w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


def case_overflowing_observation():
    X, _ = _data()
    y = X[:, 0].clone()
    y[2] = 1e300
    _svi(linreg).step(X, y)


def case_step_size_none():
    CVI(step_size=None)


def case_fixed_step_oscillates():
    g = torch.Generator().manual_seed(0)
    D, N = 2000, 30
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = torch.bernoulli(
        torch.sigmoid(X @ torch.randn(D, generator=g, dtype=torch.float64)), generator=g
    )
    svi = _svi(any_width, step=1.0)
    with pytest.warns(RuntimeWarning) as record:
        for _ in range(30):
            svi.step(X, y)
    found = [r.message for r in record if "does not converge" in str(r.message)]
    assert len(found) == 1  # once per guide, never per step
    raise RuntimeWarning(str(found[0]))


def _saved(tmp, model=logreg, data=None):
    from pyro_cvi.checkpoints.checkpoint import save_checkpoint

    data = _data() if data is None else data
    optim = CVI(step_size=0.5)
    guide = AutoCVI(model)
    SVI(model, guide, optim, loss=CVI_ELBO()).step(*data)
    path = Path(tmp) / "run.pt"
    save_checkpoint(path, optim, guide)
    return path


def _load_into_live(path, model=logreg, data=None):
    from pyro_cvi.checkpoints.checkpoint import load_checkpoint

    pyro.clear_param_store()
    data = _data() if data is None else data
    optim, guide = CVI(step_size=0.5), AutoCVI(model)
    SVI(model, guide, optim, loss=CVI_ELBO()).step(*data)
    load_checkpoint(path, optim, guide)


class _Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


def case_checkpoint_unsafe(tmp_path):
    path = tmp_path / "crafted.pt"
    torch.save({"format": "pyro-cvi checkpoint", "version": 2, "optim": _Payload()}, path)
    _load_into_live(path)


def case_checkpoint_truncated(tmp_path):
    path = _saved(tmp_path)
    path.write_bytes(path.read_bytes()[:500])
    _load_into_live(path)


def case_checkpoint_not_a_checkpoint(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"version": 1}, path)
    _load_into_live(path)


def case_checkpoint_missing(tmp_path):
    _load_into_live(tmp_path / "nowhere.pt")


def case_checkpoint_other_data(tmp_path):
    path = _saved(tmp_path)
    X, y = _data(30)
    _load_into_live(path, data=(X, y))


def case_checkpoint_other_sites(tmp_path):
    path = _saved(tmp_path)

    def other(X, y=None):
        w = pyro.sample("beta", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Bernoulli(logits=X @ w), obs=y)

    _load_into_live(path, model=other)


def _plate_model(X, y=None, size=None):
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", size):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def case_plate_size_mismatch():
    X, y = _data(40)
    SVI(_plate_model, AutoCVI(_plate_model), CVI(), loss=CVI_ELBO()).step(X, y, size=39)


def case_plate_size_one():
    X, y = _data(40)
    SVI(_plate_model, AutoCVI(_plate_model), CVI(), loss=CVI_ELBO()).step(X, y, size=1)


def case_transposed_design_matrix():
    X, y = _data()
    _svi(any_width).step(X.T.contiguous(), y)


def case_natgrad_diverged():
    from pyro.infer import Trace_ELBO
    from pyro.infer.autoguide import AutoNormal

    def model(X, y):
        s = pyro.param("s", torch.tensor(1.0, dtype=X.dtype), constraint=dist.constraints.positive)
        w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w, s), obs=y)

    X, _ = _data()
    y = X.sum(-1)
    for seed in range(10):  # a learning rate far too large: most seeds diverge within 80 steps
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        svi = SVI(model, AutoNormal(model), CVI(optim_args={"lr": 50.0}), loss=Trace_ELBO())
        for _ in range(80):
            svi.step(X, y)


def case_checkpoint_directory(tmp_path):
    (tmp_path / "runs").mkdir()
    _load_into_live(tmp_path / "runs")


def case_checkpoint_empty(tmp_path):
    path = tmp_path / "run.pt"
    path.write_bytes(b"")
    _load_into_live(path)


def _pyro_guide_checkpoint(tmp_path, guide_cls, optim):
    from pyro.infer import Trace_ELBO

    from pyro_cvi.checkpoints.checkpoint import save_checkpoint

    guide = guide_cls(logreg)
    SVI(logreg, guide, optim, loss=Trace_ELBO()).step(*_data())
    save_checkpoint(tmp_path / "run.pt", optim, guide)
    pyro.clear_param_store()
    return tmp_path / "run.pt"


def case_checkpoint_other_optimizer(tmp_path):
    from pyro.infer.autoguide import AutoNormal

    from pyro_cvi.checkpoints.checkpoint import load_checkpoint

    path = _pyro_guide_checkpoint(tmp_path, AutoNormal, CVI())
    load_checkpoint(path, pyro.optim.Adam({"lr": 0.01}), AutoNormal(logreg))


def case_checkpoint_other_guide(tmp_path):
    from pyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

    from pyro_cvi.checkpoints.checkpoint import load_checkpoint

    path = _pyro_guide_checkpoint(tmp_path, AutoNormal, CVI())
    load_checkpoint(path, CVI(), AutoMultivariateNormal(logreg))


def case_checkpoint_unsafe_state(tmp_path):
    from pyro_cvi.checkpoints.checkpoint import save_checkpoint

    X, y = _data()
    optim, guide = CVI(step_size=0.5), AutoCVI(logreg)
    SVI(logreg, guide, optim, loss=CVI_ELBO()).step(X, y)
    state = optim.get_state()
    optim.get_state = lambda: {**state, "scheduler": object()}
    save_checkpoint(tmp_path / "run.pt", optim, guide)


def case_gpytorch_labels():
    import gpytorch

    from pyro_cvi.contrib.gpytorch import CVIOptimizer, CVIVariationalStrategy

    X, y = _data(20)

    class GP(gpytorch.models.ApproximateGP):
        def __init__(self):
            super().__init__(CVIVariationalStrategy(self, X, X.shape[0]))
            self.mean, self.kernel = gpytorch.means.ZeroMean(), gpytorch.kernels.RBFKernel()

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean(x), self.kernel(x))

    lik = gpytorch.likelihoods.BernoulliLikelihood().double()
    CVIOptimizer(GP().double(), lik, 1.0).step(X, 2 * y)  # labels in {0, 2}


def case_pyro_gp_labels():
    from pyro_cvi.contrib import pyro_gp

    f = torch.zeros(3, dtype=torch.float64)
    pyro_gp.Binary()(f, f + 1.0, torch.tensor([0.0, -1.0, 1.0], dtype=torch.float64))


def case_pyro_gp_multiclass_response():
    from pyro_cvi.contrib import pyro_gp

    pyro_gp.MultiClass(3, response_function=torch.sigmoid)


def case_scaled_masked_leaf():
    X, y = _data()

    def model(X, y):
        with pyro.plate("two", 2), poutine.scale(scale=0.5):
            with poutine.mask(mask=torch.tensor([True, False])):
                pyro.sample("z", dist.Normal(X.new_zeros(()), 1.0))  # nothing depends on it
        logreg(X, y)

    guide = AutoCVI(model)
    SVI(model, guide, CVI(), loss=CVI_ELBO()).step(X, y)


CASES = {
    name[5:].replace("_", "-"): fn for name, fn in globals().items() if name.startswith("case_")
}
CASES.update(MORE_CASES)  # the second reliability pass (tests/reliability_cases.py)


def test_table_and_cases_match():
    assert set(ROWS) == set(CASES), "docs/errors.md and tests/test_errors.py list different cases"


@pytest.mark.parametrize("case", sorted(CASES))
def test_documented_error(case, tmp_path):
    pyro.clear_param_store()
    kind, message = ROWS[case]
    exc = {
        "ValueError": ValueError,
        "DivergenceError": DivergenceError,
        "CheckpointError": CheckpointError,
        "TypeError": TypeError,
        "RuntimeWarning": RuntimeWarning,
        "INFO": Logged,
    }[kind]
    fn = CASES[case]
    with pytest.raises(exc) as info:
        fn(tmp_path) if fn.__code__.co_argcount else fn()
    assert message in str(info.value), f"{case}: {info.value}"


BAD_DATA = {
    "observation-outside-support": (logreg, _bad(y=(4, 2.0))),
    "fractional-label": (logreg, _bad(y=(4, 0.5))),
    "nan-in-inputs": (logreg, _bad(X=((3, 1), float("nan")))),
    "inf-in-inputs": (logreg, _bad(X=((3, 1), float("inf")))),
    "integer-labels": (logreg, (_data()[0], _data()[1].long())),
    "mixed-dtypes": (float64_prior, (_data()[0].float(), _data()[1].float())),
    "empty-data": (logreg, (_data()[0][:0], _data()[1][:0])),
}


@pytest.mark.parametrize("later", [False, True], ids=["first-step", "later-step"])
@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_guide_stays_usable_after_bad_data(case, later):
    """The bad step raises, leaves the guide as it was, and the next good step is exactly an
    undisturbed run's step."""
    model, bad = BAD_DATA[case]
    X, y = _data()

    def run(with_bad):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        svi = _svi(model, step=0.5)
        losses = [svi.step(X, y)] if later else []
        if with_bad:
            with pytest.raises((ValueError, TypeError)):
                svi.step(*bad)
        pyro.set_rng_seed(1)
        losses += [svi.step(X, y) for _ in range(2)]
        return losses, svi.guide.posterior("w").precision_matrix

    (clean, q), (after, q_after) = run(False), run(True)
    assert after == clean and torch.equal(q, q_after)
