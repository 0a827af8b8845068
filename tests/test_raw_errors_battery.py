"""A battery of inputs that used to surface raw or misleading errors: two guides under one
prefix, a plate of the wrong size (or of size one), NaN in the design matrix, a transposed
design matrix. Each gives an error that names the site or plate and says what to do, and the
guide steps on exactly as an undisturbed run afterwards."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.model.validation import first_line

DTYPES = [torch.float32, torch.float64]


def _data(dtype, N=40, D=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(X[:, 0]), generator=g)
    return X.to(dtype), y.to(dtype)


def logreg(X, y=None, size=None):
    w = pyro.sample("w", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0] if size is None else size):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def other(X, y=None):
    v = pyro.sample("v", dist.Normal(X.new_zeros(X.shape[1]), 2.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ v), obs=y)


def _steps_after(bad, dtype, model=logreg, N=40, D=3):
    """The losses and q of three good steps after an optional bad one (first step or later),
    against those of a run that never saw it."""
    X, y = _data(dtype, N, D)

    def run(with_bad, later):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoCVI(model)
        svi = SVI(model, guide, CVI(step_size=0.5), loss=CVI_ELBO())
        losses = [svi.step(X, y)] if later else []
        error = None
        if with_bad:
            with pytest.raises(ValueError) as e:
                bad(svi, X, y)
            error = str(e.value)
        losses += [svi.step(X, y) for _ in range(2)]
        return losses, guide.posterior("w").mean, error

    errors = []
    for later in (False, True):
        clean, q, _ = run(False, later)
        after, q_after, error = run(True, later)
        assert after == clean and torch.equal(q, q_after), later
        errors.append(error)
    return errors


# ---------------------------------------------------------------------- two guides, one prefix
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("how", ["same-model-step", "other-model-step", "same-model-call"])
def test_a_second_guide_under_the_same_prefix_says_to_pass_a_prefix(how, dtype):
    X, y = _data(dtype)
    pyro.clear_param_store()
    first = AutoCVI(logreg)
    svi = SVI(logreg, first, CVI(), loss=CVI_ELBO())
    svi.step(X, y)
    model = other if how == "other-model-step" else logreg
    second = AutoCVI(model)
    with pytest.raises(ValueError, match=r"AutoCVI\(model, prefix='AutoCVI_2'\)") as e:
        if how.endswith("call"):
            second(X, y)
        else:
            SVI(model, second, CVI(), loss=CVI_ELBO()).step(X, y)
    assert "prefix 'AutoCVI'" in str(e.value)
    assert second.prototype_trace is None  # nothing half-built
    renamed = AutoCVI(model, prefix="AutoCVI_2")  # what the message says works
    SVI(model, renamed, CVI(), loss=CVI_ELBO()).step(X, y)
    assert torch.isfinite(torch.tensor(svi.step(X, y)))  # the first guide is untouched


# ---------------------------------------------------------------------- plates of the wrong size
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("size", [39, 41, 1, 2, 80])
def test_a_plate_of_the_wrong_size_names_the_plate_and_the_site(size, dtype):
    def bad(svi, X, y):
        svi.step(X, y, size=size)

    for error in _steps_after(bad, dtype):
        assert f"plate 'data' has size {size}, but site 'y' inside it has 40" in error
        assert "pyro.plate('data', 40)" in error
        assert ("size 1 does not broadcast" in error) == (size == 1)


# ---------------------------------------------------------------------- NaN in the design matrix
def _balanced(text):
    depth = 0
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        assert depth >= 0, text
    return depth == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("where", [(0, 0), (3, 1), (39, 2), (20, 0), (7, 2)])
def test_nan_in_the_design_matrix_gives_a_whole_balanced_message(where, dtype):
    def bad(svi, X, y):
        X = X.clone()
        X[where] = float("nan")
        svi.step(X, y)

    for error in _steps_after(bad, dtype):
        assert error.startswith(
            f"the model's argument 0 has a non-finite value (first at index {list(where)}: nan)"
        )
        assert _balanced(error), error
        assert error.endswith(
            "Remove or impute it (observations may be marked missing with obs_mask)."
        )
        quoted = error.split("a distribution refused the result (", 1)[1]
        assert " ...)" in quoted or "..." not in quoted  # a cut is marked, at a word boundary


@pytest.mark.parametrize(
    "text, width, expected",
    [
        ("short (a) message", 160, "short (a) message"),
        ("one two three four", 9, "one two ..."),
        ("cut (inside parens here", 14, "cut (inside ...)"),
        ("f(x[1, 2], g(y)) and more words", 13, "f(x[1, 2] ...)"),
        ("first line (open\nsecond line)", 160, "first line (open)"),
        ("averyveryverylongwordwithoutspaces", 10, "averyveryv ..."),
    ],
)
def test_first_line_cuts_at_words_and_closes_brackets(text, width, expected):
    assert first_line(text, width) == expected
    assert _balanced(first_line(text, width))


# ---------------------------------------------------------------------- transposed design matrix
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("N, D", [(40, 3), (40, 2), (25, 5), (12, 11), (60, 1)])
def test_a_transposed_design_matrix_is_said_to_be_transposed(N, D, dtype):
    def bad(svi, X, y):
        svi.step(X.T.contiguous(), y)

    for error in _steps_after(bad, dtype, N=N, D=D):
        assert f"argument 0 has shape ({D}, {N}), which looks transposed" in error
        assert f"X.T, of shape ({N}, {D})" in error
        assert "y.reshape(-1)" not in error


def test_a_column_vector_of_labels_still_gets_the_reshape_hint():
    X, y = _data(torch.float64)
    pyro.clear_param_store()
    svi = SVI(logreg, AutoCVI(logreg), CVI(), loss=CVI_ELBO())
    with pytest.raises(ValueError, match=r"y\.reshape\(-1\)"):
        svi.step(X, y[:, None])
