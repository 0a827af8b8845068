"""Gamma latent-variable models of the paper's Section 7 / Appendices J and K, with data, held-out
metrics and the paper's baseline (Adam on softplus-transformed Gamma parameters).

* **Poisson-gamma matrix factorisation** (Appendix K): ``X_nv ~ Poisson(sum_k Z_nk W_kv)``,
  ``W, Z ~ Gamma(a, b)``, on scikit-learn's 8x8 digits (1797 images, 64 pixels, counts 0..16).
  A random 20% of the entries is held out (masked in the likelihood); the metric is their mean
  Poisson log-likelihood under the posterior-mean rates.
* **Gamma factor model** (Appendix J): ``y_i ~ N(0, Z Z^T + sigma^2 I)``, ``Z_dk ~ Gamma(a, b)``,
  on synthetic data; the metric is the mean held-out log-likelihood at the posterior mean of Z.

Both likelihoods are non-conjugate for the Gamma ``q``: CVI sends Monte Carlo messages
(implicit reparameterisation + Fisher solve, Appendix F) and the priors' messages are exact.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
import torch.nn.functional as F
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide.initialization import init_to_value

__all__ = [
    "load_digits_counts",
    "poisson_mf_model",
    "poisson_mf_heldout",
    "synthetic_gamma_factor",
    "gamma_factor_model",
    "gamma_factor_heldout",
    "softplus_gamma_guide",
    "random_init",
    "run_cvi",
    "run_adam",
    "History",
]


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------
def load_digits_counts(test_frac: float = 0.2, seed: int = 0, dtype=torch.float32):
    """scikit-learn's digits as a count matrix ``X`` (1797 x 64) with a random held-out mask.

    Returns ``(X, train_mask, test_mask)`` (boolean masks of ``X``'s shape, complementary).
    """
    from sklearn.datasets import load_digits

    X = torch.as_tensor(load_digits().data, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    test = torch.rand(X.shape, generator=g) < test_frac
    return X, ~test, test


def synthetic_gamma_factor(
    N: int = 2000,
    N_test: int = 1000,
    D: int = 20,
    K: int = 4,
    sigma2: float = 0.1,
    seed: int = 0,
    dtype=torch.float32,
):
    """Data from the gamma factor model: ``Z ~ Gamma(1, 1)``, ``y = Z x + noise``,
    ``x ~ N(0, I_K)``. Returns ``(Y_train, Y_test, Z_true)``."""
    g = torch.Generator().manual_seed(seed)
    Z = -torch.log(torch.rand(D, K, generator=g, dtype=torch.float64))  # Gamma(1, 1)
    x = torch.randn(K, N + N_test, generator=g, dtype=torch.float64)
    Y = (Z @ x).T + sigma2**0.5 * torch.randn(N + N_test, D, generator=g, dtype=torch.float64)
    return Y[:N].to(dtype), Y[N:].to(dtype), Z.to(dtype)


# ------------------------------------------------------------------------------------------------
# models and metrics
# ------------------------------------------------------------------------------------------------
def poisson_mf_model(K: int, a: float = 0.3, b: float = 0.3) -> Callable:
    """``model(X, mask)``: Poisson-gamma matrix factorisation (Appendix K, eq. 96)."""

    def model(X, mask=None):
        N, V = X.shape
        W = pyro.sample(
            "W", dist.Gamma(X.new_tensor(a), X.new_tensor(b)).expand([K, V]).to_event(2)
        )
        with pyro.plate("images", N):
            Z = pyro.sample(
                "Z", dist.Gamma(X.new_tensor(a), X.new_tensor(b)).expand([K]).to_event(1)
            )
            like = dist.Poisson(Z @ W)
            if mask is not None:
                like = like.mask(mask)
            pyro.sample("X", like.to_event(1), obs=X)

    return model


def poisson_mf_heldout(W_mean, Z_mean, X, test_mask) -> float:
    """Mean Poisson log-likelihood of the held-out entries at the posterior-mean rates."""
    with torch.no_grad():
        lp = dist.Poisson(Z_mean @ W_mean).log_prob(X)
        return float((lp * test_mask).sum() / test_mask.sum())


def gamma_factor_model(
    D: int, K: int, sigma2: float = 0.1, a: float = 1.0, b: float = 1.0
) -> Callable:
    """``model(Y)``: the gamma factor model (Appendix J, eq. 95), ``y_i ~ N(0, Z Z^T + s2 I)``."""

    def model(Y):
        Z = pyro.sample(
            "Z", dist.Gamma(Y.new_tensor(a), Y.new_tensor(b)).expand([D, K]).to_event(2)
        )
        with pyro.plate("data", Y.shape[0]):
            pyro.sample(
                "y",
                dist.LowRankMultivariateNormal(Y.new_zeros(D), Z, Y.new_full((D,), sigma2)),
                obs=Y,
            )

    return model


def gamma_factor_heldout(Z_mean, Y_test, sigma2: float = 0.1) -> float:
    """Mean held-out log-likelihood at the posterior mean of Z."""
    with torch.no_grad():
        D = Y_test.shape[-1]
        like = dist.LowRankMultivariateNormal(
            Y_test.new_zeros(D), Z_mean, Y_test.new_full((D,), sigma2)
        )
        return float(like.log_prob(Y_test).mean())


def random_init(shapes: Dict[str, Tuple[int, ...]], seed: int = 1, dtype=torch.float32):
    """Initial posterior means ``U(0.5, 1.5)`` per entry (breaks the symmetry of the factors)."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: (0.5 + torch.rand(s, generator=g, dtype=torch.float64)).to(dtype)
        for k, s in shapes.items()
    }


# ------------------------------------------------------------------------------------------------
# the paper's baseline: Adam on softplus-transformed Gamma parameters
# ------------------------------------------------------------------------------------------------
def _inv_softplus(x):
    return x + torch.log(-torch.expm1(-x))


def softplus_gamma_guide(
    model,
    init: Dict[str, torch.Tensor],
    *args,
    init_shape: float = 1.0,
    prefix: str = "adam",
    **kwargs,
):
    """A guide ``q(z) = Gamma(softplus(a), softplus(r))`` per latent site (the paper's Adam
    baseline), started at shape ``init_shape`` and mean ``init[name]``; plates as in the model
    (no subsampling)."""
    proto = poutine.trace(poutine.block(model, hide_fn=lambda m: m["is_observed"])).get_trace(
        *args, **kwargs
    )
    sites = {
        n: s
        for n, s in proto.nodes.items()
        if s["type"] == "sample" and not s["is_observed"] and type(s["fn"]).__name__ != "_Subsample"
    }

    def guide(*a, **k):
        out = {}
        for name, site in sites.items():
            mean = init[name]
            sa = pyro.param(
                f"{prefix}.shape_raw.{name}",
                lambda mean=mean: _inv_softplus(torch.full_like(mean, init_shape)),
            )
            sr = pyro.param(
                f"{prefix}.rate_raw.{name}", lambda mean=mean: _inv_softplus(init_shape / mean)
            )
            fn = dist.Gamma(F.softplus(sa), F.softplus(sr)).to_event(site["fn"].event_dim)
            with ExitStack() as stack:
                for f in site["cond_indep_stack"]:
                    if f.vectorized:
                        stack.enter_context(pyro.plate(f.name, f.size, dim=f.dim))
                out[name] = pyro.sample(name, fn)
        return out

    def means():
        store = pyro.get_param_store()
        return {
            n: (
                F.softplus(store[f"{prefix}.shape_raw.{n}"])
                / F.softplus(store[f"{prefix}.rate_raw.{n}"])
            ).detach()
            for n in sites
        }

    return guide, means


# ------------------------------------------------------------------------------------------------
# timed runs: only the optimisation steps are timed; the metric is evaluated at checkpoints
# ------------------------------------------------------------------------------------------------
@dataclass
class History:
    """``(iteration, seconds, metric)`` checkpoints of one run."""

    name: str
    iters: List[int] = field(default_factory=list)
    seconds: List[float] = field(default_factory=list)
    metric: List[float] = field(default_factory=list)
    elbo: List[float] = field(default_factory=list)

    def best(self) -> float:
        return max(self.metric)

    def time_to(self, target: float) -> Optional[float]:
        """Seconds until the metric first reaches ``target`` (higher is better), or None."""
        for s, m in zip(self.seconds, self.metric):
            if m >= target:
                return s
        return None


def _timed(step, metric, iters: int, every: int, name: str, time_limit: Optional[float]):
    from bench.reporting import progress

    h = History(name)
    elapsed = 0.0
    for i in progress(range(1, iters + 1), name, total=iters, mininterval=0.5):
        t0 = time.perf_counter()
        loss = step()
        elapsed += time.perf_counter() - t0
        if i % every == 0 or i == iters:
            h.iters.append(i)
            h.seconds.append(elapsed)
            h.metric.append(metric())
            h.elbo.append(-float(loss))
        if time_limit is not None and elapsed > time_limit:
            break
    return h


def run_cvi(
    model,
    args,
    init: Dict[str, torch.Tensor],
    metric: Callable[[Dict], float],
    *,
    iters: int = 300,
    every: int = 10,
    step_size=0.3,
    num_samples: int = 1,
    vectorize_particles: bool = False,
    average: Optional[float] = None,
    time_limit: Optional[float] = None,
    name: str = "cvi",
):
    """CVI with ``AutoCVI`` (Monte Carlo messages for the likelihood, exact prior messages).

    ``metric(means)`` scores the posterior means ``{site: E_q[z]}``. With ``average=d`` the
    metric is computed for the exponential moving average (decay ``d``) of the natural
    parameters, i.e. iterate averaging, a standard companion of stochastic mirror descent
    (the averaging is timed; the guide's own parameters are not changed). Returns
    ``(history, guide)``.
    """
    from pyro_cvi import CVI, CVI_ELBO, AutoCVI

    pyro.clear_param_store()
    guide = AutoCVI(
        model,
        remainder="off",  # the paper's algorithm: Gamma q with Monte Carlo messages
        num_general_samples=num_samples,
        init_loc_fn=init_to_value(values=init),
        vectorize_particles=vectorize_particles,
    )
    svi = SVI(model, guide, CVI(step_size=step_size), loss=CVI_ELBO())

    guide(*args)  # set-up (tracing and probing the model) is not timed
    infos = {n: guide.engine.stepper[n] for n in init}
    avg = {}

    def step():
        loss = svi.step(*args)
        if average is not None:  # exponential moving average of the natural parameters
            for n, info in infos.items():
                nat = [p.detach() for p in info.params()]
                if n not in avg:
                    avg[n] = [t.clone() for t in nat]
                else:
                    for a, t in zip(avg[n], nat):
                        a.mul_(average).add_(t, alpha=1 - average)
        return loss

    def means():
        if average is not None:
            return {n: infos[n].family.natural_to_dist(tuple(avg[n])).mean for n in init}
        return {n: guide.posterior(n).mean.detach() for n in init}

    h = _timed(step, lambda: metric(means()), iters, every, name, time_limit)
    return h, guide


def run_adam(
    model,
    args,
    init: Dict[str, torch.Tensor],
    metric: Callable[[Dict], float],
    *,
    lr: float = 0.1,
    iters: int = 1000,
    every: int = 25,
    num_particles: int = 1,
    time_limit: Optional[float] = None,
    name: str = "adam",
):
    """The paper's baseline: Pyro SVI, ``Trace_ELBO``, Adam on softplus Gamma parameters."""
    pyro.clear_param_store()
    guide, means = softplus_gamma_guide(model, init, *args)
    svi = SVI(
        model, guide, pyro.optim.Adam({"lr": lr}), loss=Trace_ELBO(num_particles=num_particles)
    )
    svi.step(*args)  # create the parameters (not timed)
    h = _timed(lambda: svi.step(*args), lambda: metric(means()), iters, every, name, time_limit)
    return h, means
