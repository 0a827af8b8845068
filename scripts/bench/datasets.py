"""Loaders for the benchmark datasets, following the protocols of the paper's experiments.

The LIBSVM files and ``usps_3vs5.npz`` are not shipped with the package. Loaders read them from
a directory given as ``data_dir``, else from the ``PYRO_CVI_DATA`` environment variable, else
from ``../shared/data`` relative to the working directory or the repository. The default
example, :func:`load_breast_cancer_sklearn`, needs no files: scikit-learn bundles it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

__all__ = [
    "LOGREG_PRIOR_PRECISION",
    "LogRegData",
    "GPCData",
    "data_dir",
    "load_logreg",
    "load_breast_cancer_sklearn",
    "load_usps_3vs5",
    "CoalData",
    "bin_events",
    "load_coal",
    "load_coal_events",
    "simulated_coal_events",
]

#: Prior precision ``delta`` of ``w ~ N(0, I / delta)`` per dataset (the paper's Table 1).
LOGREG_PRIOR_PRECISION = {
    "a1a": 2.8072,
    "australian": 1e-5,
    "breast-cancer": 1.0,
    "colon-cancer": 596.362332,
}

_FILES = {
    "a1a": ("a1a", "a1a.t", 123),
    "australian": ("australian_scale", None, 14),
    "breast-cancer": ("breast-cancer_scale", None, 10),
    "colon-cancer": ("colon-cancer", None, 2000),
}


@dataclass
class LogRegData:
    """A binary classification problem with a bias column prepended and labels in {0, 1}."""

    name: str
    X_train: torch.Tensor
    y_train: torch.Tensor
    X_test: torch.Tensor
    y_test: torch.Tensor
    prior_precision: float

    @property
    def num_features(self) -> int:
        return self.X_train.shape[1]


@dataclass
class GPCData:
    name: str
    X_train: torch.Tensor
    y_train: torch.Tensor
    X_test: torch.Tensor
    y_test: torch.Tensor


def data_dir(path: Optional[Union[str, os.PathLike]] = None) -> Path:
    """The benchmark data folder: the argument, else ``$PYRO_CVI_DATA``, else ``../shared/data``.

    A folder named by the argument or the variable is the only one looked in: if it does not
    exist, that is an error naming it (never a quiet fall-back to another folder)."""
    explicit = path if path is not None else os.environ.get("PYRO_CVI_DATA") or None
    if explicit is not None:
        candidates = [Path(explicit)]
    else:
        repo = Path(__file__).resolve().parent.parent
        candidates = [Path.cwd() / ".." / "shared" / "data", repo / ".." / "shared" / "data"]
    for c in candidates:
        if c.is_dir():
            return c.resolve()
    raise FileNotFoundError(
        "Benchmark data not found. Pass data_dir=..., or set PYRO_CVI_DATA to the folder holding "
        "the LIBSVM files (a1a, a1a.t, australian_scale, breast-cancer_scale, colon-cancer) and "
        f"usps_3vs5.npz. Looked in: {[str(c) for c in candidates]}"
    )


def _to_tensors(X, y, dtype, device):
    X = torch.as_tensor(np.asarray(X), dtype=dtype, device=device)
    y = torch.as_tensor(np.asarray(y), dtype=dtype, device=device)
    return X, y


def _add_bias(X: np.ndarray) -> np.ndarray:
    return np.hstack([np.ones((X.shape[0], 1)), X])


def load_logreg(
    name: str,
    data_dir_: Optional[Union[str, os.PathLike]] = None,
    dtype: torch.dtype = torch.float64,
    device: Optional[Union[str, torch.device]] = None,
) -> LogRegData:
    """Load a LIBSVM dataset under the protocol of ``shared/data/README.md``.

    Bias column prepended; labels mapped to {0, 1} (+1, or 4 for breast-cancer, is 1); a1a uses
    its own train/test files, the others a 50/50 split with
    ``numpy.random.default_rng(1).permutation(N)``.
    """
    from sklearn.datasets import load_svmlight_file

    if name not in _FILES:
        raise ValueError(f"unknown dataset {name!r}; choose one of {sorted(_FILES)}")
    root = data_dir(data_dir_)
    train_file, test_file, n_features = _FILES[name]
    X, y = load_svmlight_file(str(root / train_file), n_features=n_features)
    X, y = _add_bias(X.toarray()), np.asarray(y)
    positive = 4.0 if name == "breast-cancer" else 1.0
    y = (y == positive).astype(np.float64)
    if test_file is not None:
        Xt, yt = load_svmlight_file(str(root / test_file), n_features=n_features)
        Xt, yt = _add_bias(Xt.toarray()), (np.asarray(yt) == positive).astype(np.float64)
        Xtr, ytr = X, y
    else:
        perm = np.random.default_rng(1).permutation(X.shape[0])
        tr, te = perm[: X.shape[0] // 2], perm[X.shape[0] // 2 :]
        Xtr, ytr, Xt, yt = X[tr], y[tr], X[te], y[te]
    Xtr, ytr = _to_tensors(Xtr, ytr, dtype, device)
    Xt, yt = _to_tensors(Xt, yt, dtype, device)
    return LogRegData(name, Xtr, ytr, Xt, yt, LOGREG_PRIOR_PRECISION[name])


def load_breast_cancer_sklearn(
    dtype: torch.dtype = torch.float64,
    device: Optional[Union[str, torch.device]] = None,
    prior_precision: float = 1.0,
) -> LogRegData:
    """scikit-learn's bundled Wisconsin diagnostic breast-cancer data (569 x 30), no download.

    Features are standardised with the training split's statistics, a bias column is
    prepended, and the split is the 50/50 protocol split with seed 1.
    """
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    perm = np.random.default_rng(1).permutation(X.shape[0])
    tr, te = perm[: X.shape[0] // 2], perm[X.shape[0] // 2 :]
    mu, sd = X[tr].mean(0), X[tr].std(0) + 1e-12
    X = (X - mu) / sd
    X = _add_bias(X)
    Xtr, ytr = _to_tensors(X[tr], y[tr].astype(np.float64), dtype, device)
    Xt, yt = _to_tensors(X[te], y[te].astype(np.float64), dtype, device)
    return LogRegData("breast-cancer-sklearn", Xtr, ytr, Xt, yt, prior_precision)


def load_usps_3vs5(
    data_dir_: Optional[Union[str, os.PathLike]] = None,
    dtype: torch.dtype = torch.float64,
    device: Optional[Union[str, torch.device]] = None,
) -> GPCData:
    """USPS 3-vs-5 (1540 x 256, y = 1 for digit 5), split with ``default_rng(147)``, 770 train."""
    root = data_dir(data_dir_)
    d = np.load(root / "usps_3vs5.npz")
    X, y = d["X"].astype(np.float64), d["y"].astype(np.float64)
    perm = np.random.default_rng(147).permutation(X.shape[0])
    tr, te = perm[:770], perm[770:]
    Xtr, ytr = _to_tensors(X[tr], y[tr], dtype, device)
    Xt, yt = _to_tensors(X[te], y[te], dtype, device)
    return GPCData("usps_3vs5", Xtr, ytr, Xt, yt)


@dataclass
class CoalData:
    """Coal-mining disasters binned into ``T`` equal bins (data/README.md protocol): bin
    centres ``t``, counts ``y``, ``binsize``, and the held-out bins (the first ``T // 10`` of
    ``numpy.random.default_rng(0).permutation(T)``) as a boolean mask ``test``."""

    t: torch.Tensor
    y: torch.Tensor
    binsize: float
    test: torch.Tensor


def load_coal(
    T: int = 200,
    path: Optional[Union[str, os.PathLike]] = None,
    dtype: torch.dtype = torch.float64,
) -> CoalData:
    """Bin the 191 event dates on ``[min, max]`` into ``T`` bins (Poisson counts)."""
    return bin_events(load_coal_events(path), T, dtype)


def load_coal_events(path: Optional[Union[str, os.PathLike]] = None) -> np.ndarray:
    """The 191 coal-mining disaster dates (decimal years); ``FileNotFoundError`` without data."""
    return np.loadtxt(data_dir(path) / "coal_mining_disasters.txt")


def simulated_coal_events(seed: int = 0) -> np.ndarray:
    """Event dates of a Poisson process on [1851, 1962] with a known intensity (3 a year
    before 1890, 1 a year after, a smooth change between): a stand-in for the coal data where
    the data folder is absent (the tutorial says so when it uses it)."""
    rng = np.random.default_rng(seed)
    lo, hi, peak = 1851.0, 1962.0, 3.0
    n = rng.poisson(peak * (hi - lo))
    t = np.sort(rng.uniform(lo, hi, n))
    rate = 1.0 + 2.0 / (1.0 + np.exp((t - 1890.0) / 3.0))  # thinning to the intensity
    return t[rng.uniform(0.0, peak, n) < rate]


def bin_events(events: np.ndarray, T: int = 200, dtype: torch.dtype = torch.float64) -> CoalData:
    """Event dates binned on ``[min, max]`` into ``T`` equal bins, with the held-out mask of
    :class:`CoalData`."""
    edges = np.linspace(events.min(), events.max(), T + 1)
    counts = np.histogram(events, edges)[0]
    test = np.zeros(T, dtype=bool)
    test[np.random.default_rng(0).permutation(T)[: T // 10]] = True
    return CoalData(
        torch.tensor(0.5 * (edges[1:] + edges[:-1]), dtype=dtype),
        torch.tensor(counts, dtype=dtype),
        float(edges[1] - edges[0]),
        torch.from_numpy(test),
    )
