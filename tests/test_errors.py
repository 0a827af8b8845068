"""Every row of docs/errors.md is reproduced here; the documented message must match."""

import contextlib
import logging
import re
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

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
    """Collect the ``pyro_cvi`` log records; fail on any warning (routine events are quiet)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("pyro_cvi")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield records
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
    _svi(guide=AutoNormal(logreg), loss=Trace_ELBO()).step(X, y)


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
            svi.step(x, y)
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
    svi = _svi(_exponential_rate, step=1.0)
    for _ in range(3):
        svi.step(y)


def case_backtracked_step():
    y = torch.full((20,), 30.0, dtype=torch.float64)
    svi = SVI(_exponential_rate, AutoCVI(_exponential_rate), CVI(), CVI_ELBO())
    with _logged() as records:
        for _ in range(3):
            svi.step(y)
    assert svi.guide.num_backtracks > 0
    raise Logged([r.getMessage() for r in records if "undone" in r.getMessage()][0])


CASES = {
    name[5:].replace("_", "-"): fn for name, fn in globals().items() if name.startswith("case_")
}


def test_table_and_cases_match():
    assert set(ROWS) == set(CASES), "docs/errors.md and tests/test_errors.py list different cases"


@pytest.mark.parametrize("case", sorted(CASES))
def test_documented_error(case):
    pyro.clear_param_store()
    kind, message = ROWS[case]
    exc = {
        "ValueError": ValueError,
        "TypeError": TypeError,
        "RuntimeWarning": RuntimeWarning,
        "INFO": Logged,
    }[kind]
    with pytest.raises(exc) as info:
        CASES[case]()
    assert message in str(info.value), f"{case}: {info.value}"
