"""Long runs of every stepping path: the runners of ``scripts/check_long_runs.py`` and of the
slow tests in ``tests/test_long_runs.py``.

A path is a way of stepping ``q``: ``AutoCVI`` (``CVI_ELBO``, adaptive ``CVI()``), ``CVI()`` on
each of Pyro's Gaussian autoguides (``Trace_ELBO``), the GPyTorch adapter (``CVIOptimizer``
and GPyTorch's own loop with ``CVIVariationalStrategy``), streaming (``StreamingCVI``) and
structured SVI (``StructuredSVI``). Each runs on a small regression and a small classification
problem (``logistic``; structured SVI, whose locals must be conditionally conjugate, runs a
mixture with a Categorical local instead), in float32 or float64, and records the loss of
every step. A run passes when every loss is finite and the mean loss of the last ``window``
steps is within ``tol`` nats of the lowest mean loss of any ``window`` consecutive steps (no
drift, no late blow-up).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Dict, List, Optional, Tuple

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import (
    AutoDiagonalNormal,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)
from torch.distributions import kl_divergence

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, Horizon, Remainder

__all__ = ["PATHS", "MODELS", "Stepper", "run", "verdict"]

MODELS = ("regression", "logistic")
N, D = 40, 3


def _data(kind: str, dtype: torch.dtype, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    if kind == "regression":
        y = X @ w + 0.5 * torch.randn(N, generator=g, dtype=torch.float64)
    else:
        y = torch.bernoulli(torch.sigmoid(X @ w), generator=g)
    return X.to(dtype), y.to(dtype)


def _model(kind: str) -> Callable:
    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            f = X @ w
            like = dist.Normal(f, 0.5) if kind == "regression" else dist.Bernoulli(logits=f)
            pyro.sample("y", like, obs=y)

    return model


class Stepper:
    """One run of a path: ``step()`` takes a step and returns its loss; ``advance(k)`` moves
    every counter the path keeps (step numbers, warm-ups, moving averages) ``k`` steps on, so
    that a short run exercises the step-count-dependent state of a very long one; ``bound()``
    (where the path has one) is a fresh estimate of the -ELBO of the current q, independent
    of the losses the steps reported: ``(estimate, standard error)``."""

    def __init__(
        self,
        step: Callable[[], float],
        counters: Callable[[], list],
        bound: Optional[Callable[[], Tuple[float, float]]] = None,
    ):
        self.step, self._counters, self.bound = step, counters, bound

    def advance(self, k: int) -> None:
        for obj, attr in self._counters():
            value = obj[attr] if isinstance(obj, dict) else getattr(obj, attr)
            if torch.is_tensor(value):
                with torch.no_grad():
                    value.add_(k)
            elif isinstance(obj, dict):
                obj[attr] = value + k
            else:
                setattr(obj, attr, value + k)


def _svi_counters(svi: SVI) -> list:
    """The counters of ``CVI()``: its step number, the adaptive controls of AutoCVI engines
    and of Pyro's Gaussians (their warm-up and moving averages), AutoCVI's ``num_steps``."""
    optim = svi.optim
    out = [(optim, "t")]
    for engine in optim._live():
        if engine.control is not None:
            out.append((engine.control, "t"))
        rem = getattr(engine, "remainder", None)
        if rem is not None:  # its own clock (the horizon) or noise control
            c = rem.control
            out += [(c, "t")] + [
                (r, "t")
                for r in (getattr(c, "prec", None), getattr(c, "mean", None))
                if r is not None
            ]
        out.append((pyro.param(engine.steps_name).unconstrained(), "data"))
    for control in optim.gaussians.controls.values():
        out += [(control, "t"), (control.prec, "t"), (control.mean, "t")]
    return out


def mc_bound(model: Callable, guide: Callable, *args, draws: int = 2000) -> Tuple[float, float]:
    """``-E_q[log p(y, z) - log q(z)]`` from ``draws`` independent draws of the guide (each a
    Trace_ELBO term of one particle), and its standard error."""
    from pyro import poutine

    terms = []
    with torch.no_grad():
        for _ in range(draws):
            g = poutine.trace(guide).get_trace(*args)
            m = poutine.trace(poutine.replay(model, trace=g)).get_trace(*args)
            terms.append(float(g.log_prob_sum() - m.log_prob_sum()))
    t = torch.tensor(terms, dtype=torch.float64)
    return float(t.mean()), float(t.std() / math.sqrt(draws))


def _svi(guide_cls, loss) -> Callable:
    def make(kind, dtype):
        X, y = _data(kind, dtype)
        model = _model(kind)
        guide = guide_cls(model)
        svi = SVI(model, guide, CVI(), loss=loss())
        return Stepper(
            lambda: svi.step(X, y), lambda: _svi_counters(svi), lambda: mc_bound(model, guide, X, y)
        )

    return make


def _gp(kind: str, dtype: torch.dtype, inducing: bool):
    import gpytorch

    from pyro_cvi.contrib.gpytorch import CVIVariationalStrategy

    X, y = _data(kind, dtype)
    x = X[:, :1].contiguous()

    class GP(gpytorch.models.ApproximateGP):
        def __init__(self):
            if inducing:
                var = gpytorch.variational.CholeskyVariationalDistribution(10)
                strategy = CVIVariationalStrategy(
                    self, x[::4].clone(), var, learn_inducing_locations=False
                )
            else:
                strategy = CVIVariationalStrategy(self, x, N)
            super().__init__(strategy)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

        def forward(self, a):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(a), self.covar_module(a)
            )

    if kind == "regression":
        lik = gpytorch.likelihoods.GaussianLikelihood()
    else:
        lik = gpytorch.likelihoods.BernoulliLikelihood()
    return GP().to(dtype), lik.to(dtype), x, y


def _gpytorch_optimizer(kind, dtype):
    from pyro_cvi.contrib.gpytorch import CVIOptimizer

    gp, lik, x, y = _gp(kind, dtype, inducing=False)
    opt = CVIOptimizer(gp, lik)
    return Stepper(
        lambda: float(opt.step(x, y)),
        lambda: [(opt, "num_steps"), (opt.control, "t")],
        lambda: _gp_bound(gp, lik, x, y),
    )


def _gp_bound(gp, lik, x, y) -> Tuple[float, float]:
    """GPyTorch's ``-VariationalELBO * N`` of the current q, evaluated afresh (exact for the
    Gaussian likelihood, Gauss-Hermite quadrature for the Bernoulli one: no sampling error)."""
    import gpytorch

    mll = gpytorch.mlls.VariationalELBO(lik, gp, num_data=N)
    with torch.no_grad():
        return float(-mll(gp(x), y) * N), 0.0


def _gpytorch_loop(kind, dtype):
    """GPyTorch's own loop: ``loss.backward()`` of ``-VariationalELBO`` takes the CVI step;
    Adam moves the kernel and likelihood hyperparameters."""
    import gpytorch

    gp, lik, x, y = _gp(kind, dtype, inducing=True)
    mll = gpytorch.mlls.VariationalELBO(lik, gp, num_data=N)
    params = [p for p in list(gp.hyperparameters()) + list(lik.parameters()) if p.requires_grad]
    adam = torch.optim.Adam(params, lr=0.01)
    gp.train()
    lik.train()

    def step():
        adam.zero_grad()
        loss = -mll(gp(x), y) * N
        loss.backward()
        adam.step()
        return float(loss.detach())

    def counters():
        out = [(adam.state[p], "step") for p in params if "step" in adam.state[p]]
        strategy = gp.variational_strategy
        for attr in ("num_steps", "t"):
            if hasattr(strategy, attr):
                out.append((strategy, attr))
        return out

    return Stepper(step, counters, lambda: _gp_bound(gp, lik, x, y))


def _streaming(kind, dtype):
    """One step is one minibatch update (4 minibatches of 10 per pass); each minibatch of a
    pass reports the pass's -ELBO. The bound: Trace_ELBO draws of the final q of the block on
    the whole data set, independent of the pass's own quadrature."""
    from torch.utils.data import DataLoader, TensorDataset

    from pyro_cvi.scale.streaming import StreamingCVI

    X, y = _data(kind, dtype)
    loader = DataLoader(TensorDataset(X, y), batch_size=10)
    model = _model(kind)
    stream = StreamingCVI(model, step_size=0.5)
    queue: List[float] = []

    def step():
        if not queue:
            queue.extend([-stream.run_pass(loader)] * len(loader))
        return queue.pop()

    def guide(X, y):  # the final q of the block (its one site, ``w``) as a Pyro guide
        q = stream.posterior()
        pyro.sample("w", dist.MultivariateNormal(q.loc, scale_tril=q.scale_tril))

    return Stepper(step, lambda: [(stream, "num_passes")], lambda: mc_bound(model, guide, X, y))


def _structured(kind, dtype):
    """``StructuredSVI`` (its default Robbins-Monro schedule). Its q is ``q(beta) p(z | y,
    beta)``, so ``-ELBO = E_q[-sum_n log p(y_n | beta)] + KL(q(beta) || p(beta))``: the loss of
    a step is minus the ``sum_n log p(y_n | beta)`` it samples (one draw of ``q(beta)``) plus
    that KL (closed form), a one-draw estimate of the -ELBO; the bound is the same from 2,000
    fresh draws of the final ``q(beta)``. ``regression``: a hierarchical Normal (Normal locals);
    ``logistic``: a mixture's weights with Categorical locals (a Bernoulli-logit local is not
    conditionally conjugate, which structured SVI needs)."""
    from pyro_cvi.methods.structured import StructuredSVI

    g = torch.Generator().manual_seed(0)
    if kind == "regression":
        Y = (2.0 + torch.randn(8, 1, generator=g) + torch.randn(8, 4, generator=g)).to(dtype)
        one = torch.ones((), dtype=dtype)

        def model(Y):
            mu = pyro.sample("mu", dist.Normal(0.0 * one, 3.0 * one))
            with pyro.plate("groups", Y.shape[0], dim=-2):
                theta = pyro.sample("theta", dist.Normal(mu, one))
                with pyro.plate("obs", Y.shape[1], dim=-1):
                    pyro.sample("y", dist.Normal(theta, one), obs=Y)

    else:
        means = torch.tensor([-3.0, 0.5, 4.0], dtype=dtype)
        z = torch.multinomial(torch.tensor([0.2, 0.5, 0.3]), N, True, generator=g)
        Y = (means[z] + torch.randn(N, generator=g, dtype=torch.float64).to(dtype)).to(dtype)

        def model(x):
            w = pyro.sample("w", dist.Dirichlet(torch.ones(3, dtype=dtype)))
            with pyro.plate("data", x.shape[0]):
                k = pyro.sample("z", dist.Categorical(w))
                pyro.sample("x", dist.Normal(means[k], 1.0), obs=x)

    ssvi = StructuredSVI(model)
    ssvi.setup(Y)

    def kl() -> float:
        return sum(
            float(kl_divergence(ssvi.posterior(n), fam.natural_to_dist(ssvi.prior_nat[n])).sum())
            for n, fam in ssvi.families.items()
        )

    def step():
        k = kl()  # of the q the step draws its beta from
        return -ssvi.step(Y) + k

    def bound(draws: int = 2000) -> Tuple[float, float]:
        terms = [-float(ssvi.local_log_lik(ssvi.sample_globals(), Y)) for _ in range(draws)]
        t = torch.tensor(terms, dtype=torch.float64)
        return float(t.mean()) + kl(), float(t.std() / math.sqrt(draws))

    return Stepper(step, lambda: [(ssvi, "t")], bound)


def _autocvi(kind, dtype):
    X, y = _data(kind, dtype)
    model = _model(kind)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
    return Stepper(
        lambda: svi.step(X, y), lambda: _svi_counters(svi), lambda: mc_bound(model, guide, X, y)
    )


def _nonlinear_model(kind: str) -> Callable:
    """The regression / classification with a saturating link: no exact message, so the
    weights go to the remainder's joint Gaussian (the one-draw Horizon step)."""

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(D), 1.0).to_event(1))
        gain = pyro.sample("gain", dist.LogNormal(X.new_tensor(0.5), 0.5))
        with pyro.plate("data", X.shape[0]):
            f = gain * torch.tanh(X @ w)
            like = dist.Normal(f, 0.5) if kind == "regression" else dist.Bernoulli(logits=f)
            pyro.sample("y", like, obs=y)

    return model


def _autocvi_remainder(kind, dtype):
    X, y = _data(kind, dtype)
    model = _nonlinear_model(kind)
    guide = AutoCVI(model, remainder=Remainder(step=Horizon()))
    svi = SVI(model, guide, CVI(), loss=CVI_ELBO())
    return Stepper(
        lambda: svi.step(X, y), lambda: _svi_counters(svi), lambda: mc_bound(model, guide, X, y)
    )


#: path name -> make(kind, dtype) -> Stepper
PATHS: Dict[str, Callable] = {
    "AutoCVI": _autocvi,
    "CVI() AutoNormal": _svi(AutoNormal, Trace_ELBO),
    "CVI() AutoDiagonalNormal": _svi(AutoDiagonalNormal, Trace_ELBO),
    "CVI() AutoMultivariateNormal": _svi(AutoMultivariateNormal, Trace_ELBO),
    "CVI() AutoLowRankMultivariateNormal": _svi(AutoLowRankMultivariateNormal, Trace_ELBO),
    "GPyTorch CVIOptimizer": _gpytorch_optimizer,
    "GPyTorch loop": _gpytorch_loop,
    "streaming": _streaming,
    "structured SVI": _structured,
    "AutoCVI remainder (Horizon)": _autocvi_remainder,
}


def verdict(losses: List[float], window: int = 1000, tol: float = 1.0) -> Dict:
    """Finite losses, and the last ``window`` steps' mean within ``tol`` of the best window's."""
    finite = all(math.isfinite(v) for v in losses)
    t = torch.tensor(losses, dtype=torch.float64)
    w = min(window, len(losses))
    if not finite or w == 0:
        return {"finite": finite, "last": math.nan, "best": math.nan, "gap": math.nan, "ok": False}
    c = torch.cat([torch.zeros(1, dtype=t.dtype), t.cumsum(0)])
    means = (c[w:] - c[:-w]) / w
    last, best = float(means[-1]), float(means.min())
    return {
        "finite": True,
        "last": last,
        "best": best,
        "gap": last - best,
        "ok": last - best <= tol,
    }


def run(
    path: str,
    kind: str,
    dtype: torch.dtype,
    steps: int,
    seed: int = 0,
    advance_at: int = 0,
    advance_by: int = 0,
    window: int = 1000,
) -> Dict:
    """One long run: ``{"losses", "seconds", "error", "bound", "bound_se", **verdict}`` (an
    exception is recorded; ``seconds``: CPU seconds of the steps, the bound not included). With
    ``advance_by``, every step counter is moved on by that many
    steps after step ``advance_at`` (:class:`Stepper`). ``bound``: a fresh estimate of the final
    q's -ELBO where the path has one (:meth:`Stepper.bound`), else ``None``."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    seen: List[float] = []
    t0 = time.process_time()
    error = None
    bound: Tuple[Optional[float], Optional[float]] = (None, None)
    try:
        stepper = PATHS[path](kind, dtype)
        for t in range(steps):
            if advance_by and t == advance_at:
                stepper.advance(advance_by)
            seen.append(float(stepper.step()))
    except Exception as e:  # noqa: BLE001 (a long run's failure is a result to report)
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]} (at step {len(seen) + 1})"
    seconds = time.process_time() - t0
    if error is None and stepper.bound is not None:
        try:
            bound = stepper.bound()
        except Exception as e:  # noqa: BLE001 (as a step's)
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]} (in the bound)"
    w = min(window, len(seen))
    tail = torch.tensor(seen[len(seen) - w :], dtype=torch.float64)
    out = {
        "last_se": float(tail.std() / math.sqrt(w)) if w > 1 else math.nan,
        "losses": seen,
        "seconds": seconds,
        "error": error,
        "bound": bound[0],
        "bound_se": bound[1],
    }
    out.update(verdict(seen, window))
    out["ok"] = out["ok"] and error is None and len(seen) == steps
    return out
