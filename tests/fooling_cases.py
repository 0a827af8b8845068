"""Models built to fool AutoCVI's analysis: functions that are affine almost everywhere but not
globally, values that autograd does not see (detached or cast paths), data-dependent branches,
masks, factors and sites Pyro treats in its own way, and models that break Pyro's shape rules.

Each :class:`Case` says what is true of its model (``affine``: whether the watched factor's
parameter is affine in the latents, the truth a classifier must not contradict; ``cause``: for
a model that must be refused, words the error has to contain). ``scripts/check_fooling.py``
fits each with the default ``AutoCVI`` + ``CVI()`` and compares the reported loss with a
Trace_ELBO estimate of the same guide (:meth:`AutoCVI.check_bound`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import pyro
import pyro.distributions as dist
import torch

__all__ = ["Case", "CASES"]


@dataclass
class Case:
    """One fooling model.

    :param name: table key.
    :param group: what it tries (``piecewise``, ``branch``, ``mask``, ``cast``, ``detach``,
        ``factor``, ``unit``, ``asserts``, ``plate``, ``control``).
    :param build: ``dtype -> (model, args)``.
    :param site: the factor whose classification is watched (``explain()``'s factor column).
    :param affine: whether that factor's parameter is affine in the latents (``None``: not a
        question for this case, e.g. a model that must be refused).
    :param cause: for a model that must be refused: words its error must contain (any one).
    :param note: what the model does.
    """

    name: str
    group: str
    build: Callable[[torch.dtype], Tuple[Callable, tuple]]
    site: Optional[str] = "x"
    affine: Optional[bool] = False
    cause: List[str] = field(default_factory=list)
    note: str = ""
    guide_kwargs: Dict = field(default_factory=dict)


def _x(dtype, n=8, seed=0, scale=1.0, shift=0.5):
    g = torch.Generator().manual_seed(seed)
    return (shift + scale * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype)


def _normal_link(link: Callable, obs_scale: float = 1.0, n: int = 8) -> Callable:
    """``z ~ N(0, 1)``, ``x_i ~ N(link(z), obs_scale)``."""

    def build(dtype):
        x = _x(dtype, n)

        def model(x):
            z = pyro.sample("z", dist.Normal(x.new_tensor(0.0), 1.0))
            with pyro.plate("data", len(x)):
                pyro.sample("x", dist.Normal(link(z), obs_scale), obs=x)

        return model, (x,)

    return build


def _bernoulli(link: Callable, kind: str = "probs") -> Callable:
    def build(dtype):
        y = (_x(dtype, 10, seed=1) > 0.5).to(dtype)

        def model(y):
            z = pyro.sample("z", dist.Normal(y.new_tensor(0.0), 1.0))
            with pyro.plate("data", len(y)):
                p = link(z)
                d = dist.Bernoulli(probs=p) if kind == "probs" else dist.Bernoulli(logits=p)
                pyro.sample("x", d, obs=y)

        return model, (y,)

    return build


def _poisson(link: Callable) -> Callable:
    def build(dtype):
        y = torch.tensor([1.0, 3.0, 0.0, 2.0, 4.0, 1.0], dtype=dtype)

        def model(y):
            z = pyro.sample("z", dist.Normal(y.new_tensor(0.0), 1.0))
            with pyro.plate("data", len(y)):
                pyro.sample("x", dist.Poisson(link(z)), obs=y)

        return model, (y,)

    return build


def _branch_python(dtype):
    x = _x(dtype)

    def model(x):
        z = pyro.sample("z", dist.Normal(x.new_tensor(0.0), 1.0))
        loc = 3.0 * z if float(z) > 0 else -z  # a Python branch on the latent's value
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Normal(loc, 1.0), obs=x)

    return model, (x,)


def _branch_data(dtype):
    x = _x(dtype)

    def model(x):
        z = pyro.sample("z", dist.Normal(x.new_tensor(0.0), 1.0))
        # a branch on the data: affine in z on either side
        loc = 2.0 * z if float(x.mean()) > 0 else -z
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Normal(loc, 1.0), obs=x)

    return model, (x,)


def _where_data(dtype):
    x = _x(dtype)
    c = torch.arange(len(x)) % 2 == 0

    def model(x):
        z = pyro.sample("z", dist.Normal(x.new_tensor(0.0), 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Normal(torch.where(c, z, -2.0 * z), 1.0), obs=x)

    return model, (x,)


def _mask_data(dtype):
    x = _x(dtype)
    m = (torch.arange(len(x)) % 3 != 0).to(dtype)

    def model(x):
        z = pyro.sample("z", dist.Normal(x.new_tensor(0.0), 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Normal(z * m, 1.0), obs=x)

    return model, (x,)


def _two_latents(link2: Callable) -> Callable:
    """``a, b ~ N(0, 1)``, ``x_i ~ N(link2(a, b), 1)``."""

    def build(dtype):
        x = _x(dtype)

        def model(x):
            a = pyro.sample("a", dist.Normal(x.new_tensor(0.0), 1.0))
            b = pyro.sample("b", dist.Normal(x.new_tensor(0.0), 1.0))
            with pyro.plate("data", len(x)):
                pyro.sample("x", dist.Normal(link2(a, b), 1.0), obs=x)

        return model, (x,)

    return build


def _vector_clamp(dtype):
    x = _x(dtype, 6).reshape(3, 2)

    def model(x):
        w = pyro.sample("w", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Normal(w.clamp(-0.2, 0.2), 1.0).to_event(1), obs=x)

    return model, (x,)


def _regression_relu(dtype):
    g = torch.Generator().manual_seed(2)
    X = torch.randn(12, 2, generator=g, dtype=torch.float64).to(dtype)
    y = torch.relu(X @ torch.tensor([1.0, -1.0], dtype=dtype)) + 0.3 * torch.randn(
        12, generator=g, dtype=torch.float64
    ).to(dtype)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
        with pyro.plate("data", len(y)):
            pyro.sample("x", dist.Normal(torch.relu(X @ w), 0.3), obs=y)

    return model, (X, y)


def _factor_in_plate(dtype):
    """The issue's case: a per-datum Gaussian log-likelihood as ``pyro.factor`` in a plate."""
    x = _x(dtype, 20, scale=2.0)

    def model(x):
        mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 10.0))
        with pyro.plate("data", len(x)):
            pyro.factor("x", dist.Normal(mu, 1.0).log_prob(x))

    return model, (x,)


def _factor_piecewise(dtype):
    x = _x(dtype, 10)

    def model(x):
        mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 1.0))
        with pyro.plate("data", len(x)):
            pyro.factor("x", -0.5 * (x - mu.clamp(-0.3, 0.3)) ** 2)

    return model, (x,)


def _factor_global(dtype):
    x = _x(dtype, 10)

    def model(x):
        mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 1.0))
        pyro.factor("x", dist.Normal(mu, 1.0).log_prob(x).sum())

    return model, (x,)


def _unit_latent(dtype):
    """The issue's case: ``dist.Unit`` sampled without ``obs`` (a bare log-factor)."""
    x = _x(dtype, 5)

    def model(x):
        mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 1.0))
        pyro.sample("x", dist.Unit(dist.Normal(mu, 1.0).log_prob(x).sum()))

    return model, (x,)


def _unit_observed(dtype):
    x = _x(dtype, 5)

    def model(x):
        mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 1.0))
        log = dist.Normal(mu, 1.0).log_prob(x).sum()
        pyro.sample("x", dist.Unit(log), obs=log.new_zeros(()))

    return model, (x,)


def _asserting_shapes(dtype):
    """The issue's case: Bernoulli latents in nested subsampled plates, the model asserting the
    shapes it expects (no enumeration asked for)."""

    def model(data):
        with pyro.plate("a", 5, subsample_size=5, dim=-3):
            with pyro.plate("b", 4, subsample_size=4, dim=-2):
                with pyro.plate("c", 3, subsample_size=3, dim=-1):
                    p = data.new_tensor(0.3)
                    x = pyro.sample("x", dist.Bernoulli(p))
                    assert x.shape == (5, 4, 3), x.shape
                    y = pyro.sample("y", dist.Bernoulli(0.2 + 0.6 * x))
                    assert y.shape == (5, 4, 3), y.shape

    return model, (torch.zeros(1, dtype=dtype),)


def _asserting_continuous(dtype):
    x = _x(dtype, 6)

    def model(x):
        with pyro.plate("data", len(x)):
            z = pyro.sample("z", dist.Normal(x.new_tensor(0.0), 1.0))
            assert z.shape == (len(x),), z.shape
            pyro.sample("x", dist.Normal(z, 1.0), obs=x)

    return model, (x,)


def _plate_dim_latent(dtype):
    """A latent of batch shape (3,) inside a plate of size 4: a plate-dimension error."""
    x = _x(dtype, 4)

    def model(x):
        with pyro.plate("data", 4):
            z = pyro.sample("z", dist.Normal(x.new_zeros(3), 1.0))
            pyro.sample("x", dist.Normal(z.sum(), 1.0), obs=x)

    return model, (x,)


def _plate_dim_obs(dtype):
    """The observation has more points than the plate: a shape error."""
    x = _x(dtype, 6)

    def model(x):
        z = pyro.sample("z", dist.Normal(x.new_tensor(0.0), 1.0))
        with pyro.plate("data", 4):
            pyro.sample("x", dist.Normal(z, 1.0), obs=x)

    return model, (x,)


def _plate_dim_clash(dtype):
    """Two nested plates on the same dim."""
    x = _x(dtype, 6).reshape(2, 3)

    def model(x):
        z = pyro.sample("z", dist.Normal(x.new_tensor(0.0), 1.0))
        with pyro.plate("rows", 2, dim=-1):
            with pyro.plate("cols", 3, dim=-1):
                pyro.sample("x", dist.Normal(z, 1.0), obs=x)

    return model, (x,)


def _straight_through(dtype):
    """``round(z)`` in value, ``z`` to autograd (the straight-through trick)."""
    x = _x(dtype, 8, scale=0.5, shift=1.2)

    def model(x):
        z = pyro.sample("z", dist.Normal(x.new_tensor(0.0), 1.0))
        loc = z + (torch.round(z) - z).detach()
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Normal(loc, 0.5), obs=x)

    return model, (x,)


def _detached(dtype):
    x = _x(dtype, 8)

    def model(x):
        z = pyro.sample("z", dist.Normal(x.new_tensor(0.0), 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Normal(z.detach(), 1.0), obs=x)

    return model, (x,)


def _frozen_coefficient(dtype):
    """``z * z.detach()``: ``z^2`` in value, a coefficient that moves with the probe point."""
    x = _x(dtype, 8)

    def model(x):
        z = pyro.sample("z", dist.Normal(x.new_tensor(0.0), 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Normal(z * z.detach(), 1.0), obs=x)

    return model, (x,)


def _item_value(dtype):
    x = _x(dtype, 8)

    def model(x):
        z = pyro.sample("z", dist.Normal(x.new_tensor(0.0), 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Normal(x.new_tensor(z.item()), 1.0), obs=x)

    return model, (x,)


def _masked_loc_latent(dtype):
    x = _x(dtype, 8)

    def model(x):
        z = pyro.sample("z", dist.Normal(x.new_tensor(0.0), 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Normal(z * (z > 0).to(z.dtype), 1.0), obs=x)

    return model, (x,)


def _scale_piecewise(dtype):
    x = _x(dtype, 10)

    def model(x):
        z = pyro.sample("z", dist.Normal(x.new_tensor(0.0), 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Normal(0.5, z.abs() + 0.5), obs=x)

    return model, (x,)


def _mvn_clamp(dtype):
    x = _x(dtype, 6).reshape(3, 2)

    def model(x):
        w = pyro.sample("w", dist.MultivariateNormal(x.new_zeros(2), torch.eye(2, dtype=x.dtype)))
        with pyro.plate("data", x.shape[0]):
            pyro.sample(
                "x",
                dist.MultivariateNormal(w.clamp(max=0.1), torch.eye(2, dtype=x.dtype)),
                obs=x,
            )

    return model, (x,)


def _categorical_clamp(dtype):
    y = torch.tensor([0, 2, 1, 2, 2, 0])

    def model(y):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=dtype), 1.0).to_event(1))
        with pyro.plate("data", len(y)):
            pyro.sample("x", dist.Categorical(logits=w.clamp(-0.5, 0.5)), obs=y)

    return model, (y,)


def _control_affine(dtype):
    x = _x(dtype)

    def model(x):
        z = pyro.sample("z", dist.Normal(x.new_tensor(0.0), 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Normal(2.0 * z + 1.0, 1.0), obs=x)

    return model, (x,)


def _control_logistic(dtype):
    y = (_x(dtype, 10, seed=1) > 0.5).to(dtype)

    def model(y):
        z = pyro.sample("z", dist.Normal(y.new_tensor(0.0), 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("x", dist.Bernoulli(logits=z - 0.5), obs=y)

    return model, (y,)


def _clamp_far(dtype):
    """Affine wherever the prior puts mass (|z| < 50): piecewise only far away."""
    x = _x(dtype)

    def model(x):
        z = pyro.sample("z", dist.Normal(x.new_tensor(0.0), 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Normal(z.clamp(-50.0, 50.0), 1.0), obs=x)

    return model, (x,)


def _hierarchical_relu(dtype):
    x = _x(dtype, 12).reshape(3, 4)

    def model(x):
        mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 1.0))
        with pyro.plate("groups", 3, dim=-2):
            theta = pyro.sample("theta", dist.Normal(torch.relu(mu), 1.0))
            with pyro.plate("obs", 4, dim=-1):
                pyro.sample("x", dist.Normal(theta, 1.0), obs=x)

    return model, (x,)


def _gamma_rate_clamp(dtype):
    x = _x(dtype, 8).abs() + 0.1

    def model(x):
        z = pyro.sample("z", dist.Normal(x.new_tensor(0.0), 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Gamma(2.0, torch.exp(z.clamp(-0.5, 0.5))), obs=x)

    return model, (x,)


CASES: List[Case] = [
    # piecewise links of a Normal loc
    Case("clamp_100z", "piecewise", _normal_link(lambda z: torch.clamp(100 * z, 0, 1))),
    Case("relu", "piecewise", _normal_link(torch.relu)),
    Case("abs", "piecewise", _normal_link(torch.abs)),
    Case("round", "piecewise", _normal_link(torch.round), note="zero gradient a.e."),
    Case("floor", "piecewise", _normal_link(torch.floor)),
    Case("where_latent", "piecewise", _normal_link(lambda z: torch.where(z > 0, z, 3 * z))),
    Case("max_latent", "piecewise", _normal_link(lambda z: torch.maximum(z, 0.5 * z))),
    Case("min_const", "piecewise", _normal_link(lambda z: torch.clamp(z, max=0.2))),
    Case("hardtanh", "piecewise", _normal_link(torch.nn.functional.hardtanh)),
    Case("leaky_relu", "piecewise", _normal_link(lambda z: torch.nn.functional.leaky_relu(z))),
    Case("sign_times", "piecewise", _normal_link(lambda z: torch.sign(z) * z)),
    Case("clamp_far", "piecewise", _clamp_far, note="piecewise only at |z| > 50"),
    Case("vector_clamp", "piecewise", _vector_clamp),
    Case("mvn_clamp", "piecewise", _mvn_clamp),
    Case("regression_relu", "piecewise", _regression_relu),
    Case("hierarchical_relu", "piecewise", _hierarchical_relu, site="theta"),
    Case("scale_abs", "piecewise", _scale_piecewise),
    # piecewise links of other likelihoods
    Case(
        "bernoulli_round_clamp",
        "piecewise",
        _bernoulli(lambda z: torch.round(z).clamp(0.2, 0.8)),
        note="the issue's probability",
    ),
    Case("bernoulli_logits_abs", "piecewise", _bernoulli(torch.abs, "logits")),
    Case("bernoulli_logits_relu", "piecewise", _bernoulli(torch.relu, "logits")),
    Case("bernoulli_probs_clamp", "piecewise", _bernoulli(lambda z: z.clamp(0.1, 0.9))),
    Case("poisson_exp_clamp", "piecewise", _poisson(lambda z: torch.exp(z.clamp(-1.0, 1.0)))),
    Case("poisson_relu_plus", "piecewise", _poisson(lambda z: torch.relu(z) + 1.0)),
    Case("categorical_clamp", "piecewise", _categorical_clamp),
    Case("gamma_rate_clamp", "piecewise", _gamma_rate_clamp),
    # two latents
    Case("max_of_two", "piecewise", _two_latents(torch.maximum)),
    Case("where_of_two", "piecewise", _two_latents(lambda a, b: torch.where(a > b, a, b))),
    Case(
        "product_of_two",
        "piecewise",
        _two_latents(lambda a, b: a * b),
        affine=None,
        note="bilinear: affine in each given the other",
    ),
    # branches
    Case("python_branch_latent", "branch", _branch_python),
    Case("python_branch_data", "branch", _branch_data, affine=True),
    Case("where_data", "branch", _where_data, affine=True),
    # masks
    Case("mask_data", "mask", _mask_data, affine=True),
    Case("mask_latent", "mask", _masked_loc_latent),
    # integer casts
    Case("long_cast", "cast", _normal_link(lambda z: z.long().to(z.dtype))),
    Case("trunc", "cast", _normal_link(torch.trunc)),
    Case("item", "cast", _item_value, note="z.item(): a Python float"),
    # detached paths
    Case("detached", "detach", _detached),
    Case("straight_through", "detach", _straight_through),
    Case("frozen_coefficient", "detach", _frozen_coefficient),
    # factors
    Case("factor_in_plate", "factor", _factor_in_plate, affine=None, note="the issue's case"),
    Case("factor_piecewise", "factor", _factor_piecewise),
    Case("factor_global", "factor", _factor_global, affine=None),
    # dist.Unit
    Case("unit_latent", "unit", _unit_latent, affine=None, cause=["Unit", "'x'"]),
    Case("unit_observed", "unit", _unit_observed, affine=None),
    # models that assert their own shapes
    Case("asserting_discrete", "asserts", _asserting_shapes, site="y", affine=None),
    Case("asserting_continuous", "asserts", _asserting_continuous, affine=None),
    # plate-dimension errors
    Case(
        "plate_dim_latent",
        "plate",
        _plate_dim_latent,
        affine=None,
        cause=["shape", "plate", "dim"],
    ),
    Case("plate_dim_obs", "plate", _plate_dim_obs, affine=None, cause=["shape", "plate"]),
    Case("plate_dim_clash", "plate", _plate_dim_clash, affine=None, cause=["dim", "plate"]),
    # controls: affine, must stay exact
    Case("control_affine", "control", _control_affine, affine=True),
    Case("control_logistic", "control", _control_logistic, affine=True),
]
