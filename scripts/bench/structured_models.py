"""Models with global and local latents for the structured-SVI comparison (Hoffman & Blei 2015).

Three conditionally conjugate problems with synthetic data of fixed seeds, each with a held-out
set of new local groups:

* ``gmm``: a 2-D Gaussian mixture, globals ``mu`` (K x 2, Normal) and ``w`` (Dirichlet), local
  ``c_n`` (enumerated);
* ``topics``: a topic model on the "bars" corpus (Griffiths & Steyvers 2004: 8 known topics, the
  rows and columns of a 4 x 4 image), with one topic per document (a mixture of unigrams, the
  LDA variant whose local conditional ``p(z_d | w_d, beta)`` is exact), globals ``beta``
  (topics, Dirichlet) and ``pi`` (Dirichlet);
* ``hierarchical``: groups ``theta_n ~ N(mu, 1/tau)``, ``y_nj ~ N(theta_n, 1)``, globals
  ``mu`` (Normal) and ``tau`` (Gamma), local ``theta_n`` (conjugate Normal).

The metric is the held-out log-likelihood per group, ``log (1/S) sum_s p(y_test | beta_s)`` with
``beta_s ~ q(beta)`` and the locals integrated out exactly
(:meth:`StructuredSVI.predictive_log_lik`),
for both methods' ``q(beta)``: mean-field CVI (``AutoCVI``, the VMP/CAVI sweep, ``step_size=1``)
and SSVI (Algorithm 1, :func:`run_ssvi`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI
from pyro.infer.autoguide.initialization import init_to_value

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, StructuredSVI, step_sizes

__all__ = ["Problem", "make_problem", "run_cvi", "run_ssvi", "PROBLEMS"]

PROBLEMS = ("gmm", "topics", "hierarchical")


@dataclass
class Problem:
    name: str
    model: Callable
    train: torch.Tensor
    test: torch.Tensor
    num_test_groups: int
    init: Callable[[int], Dict[str, torch.Tensor]]  # seed -> initial global values
    truth: Dict[str, torch.Tensor]
    #: initial q(beta) for SSVI: the same means as ``init``, narrow spreads (see run_ssvi)
    init_q: Callable[[Dict[str, torch.Tensor]], Dict[str, torch.distributions.Distribution]]


# ----------------------------------------------------------------------------- problems
def _gmm(seed: int, n: int, dtype) -> Problem:
    K, SIGMA = 4, 5.0
    g = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[-3.0, 0.0], [0.0, 3.0], [3.0, 0.0], [0.0, -3.0]], dtype=dtype)
    w_true = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=dtype)

    def draw(m):
        z = torch.multinomial(w_true, m, replacement=True, generator=g)
        return centres[z] + torch.randn(m, 2, generator=g, dtype=dtype)

    def model(x):
        w = pyro.sample("w", dist.Dirichlet(x.new_ones(K)))
        with pyro.plate("components", K):
            mu = pyro.sample("mu", dist.Normal(x.new_zeros(2), SIGMA).to_event(1))
        with pyro.plate("data", x.shape[0]):
            c = pyro.sample("c", dist.Categorical(w))
            pyro.sample("x", dist.Normal(mu[c], 1.0).to_event(1), obs=x)

    train, test = draw(n), draw(n)

    def init(s):
        gi = torch.Generator().manual_seed(1000 + s)
        return {"mu": train[torch.randperm(n, generator=gi)[:K]], "w": train.new_ones(K) / K}

    def init_q(v):
        eye = torch.eye(2, dtype=dtype).expand(K, 2, 2)
        return {"mu": dist.MultivariateNormal(v["mu"], 0.1 * eye), "w": dist.Dirichlet(50 * v["w"])}

    return Problem("gmm", model, train, test, n, init, {"mu": centres, "w": w_true}, init_q)


def bars_topics(dtype=torch.float64) -> torch.Tensor:
    """The 8 "bars" topics on a 4 x 4 vocabulary: uniform over one row or one column."""
    topics = torch.zeros(8, 4, 4, dtype=dtype)
    for i in range(4):
        topics[i, i, :] = 0.25
        topics[4 + i, :, i] = 0.25
    return topics.reshape(8, 16)


def _topics(seed: int, n: int, dtype) -> Problem:
    K, V, L = 8, 16, 12
    g = torch.Generator().manual_seed(seed)
    topics = bars_topics(dtype)

    def draw(m):
        z = torch.randint(0, K, (m,), generator=g)
        return torch.multinomial(topics[z], L, replacement=True, generator=g)

    def model(words):
        pi = pyro.sample("pi", dist.Dirichlet(torch.ones(K, dtype=dtype)))
        with pyro.plate("topics", K):
            beta = pyro.sample("beta", dist.Dirichlet(torch.full((V,), 0.5, dtype=dtype)))
        with pyro.plate("docs", words.shape[0], dim=-2):
            z = pyro.sample("z", dist.Categorical(pi))
            with pyro.plate("words", words.shape[1], dim=-1):
                pyro.sample("w", dist.Categorical(beta[z]), obs=words)

    train, test = draw(n), draw(n)

    def init(s):
        gi = torch.Generator().manual_seed(1000 + s)
        beta0 = torch.distributions.Dirichlet(torch.ones(V, dtype=dtype)).sample((K,))
        beta0 = 0.5 * beta0 + 0.5 * torch.rand(K, V, generator=gi, dtype=dtype).softmax(-1)
        return {"beta": beta0, "pi": torch.ones(K, dtype=dtype) / K}

    def init_q(v):
        return {"beta": dist.Dirichlet(100 * v["beta"]), "pi": dist.Dirichlet(50 * v["pi"])}

    return Problem("topics", model, train, test, n, init, {"beta": topics}, init_q)


def _hierarchical(seed: int, n: int, dtype) -> Problem:
    J, MU, TAU = 3, 1.0, 4.0
    g = torch.Generator().manual_seed(seed)

    def draw(m):
        theta = MU + TAU**-0.5 * torch.randn(m, 1, generator=g, dtype=dtype)
        return theta + torch.randn(m, J, generator=g, dtype=dtype)

    def model(y):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=dtype), 10.0))
        tau = pyro.sample("tau", dist.Gamma(torch.tensor(1.0, dtype=dtype), 1.0))
        with pyro.plate("groups", y.shape[0], dim=-2):
            theta = pyro.sample("theta", dist.Normal(mu, tau.rsqrt()))
            with pyro.plate("obs", y.shape[1], dim=-1):
                pyro.sample("y", dist.Normal(theta, 1.0), obs=y)

    train, test = draw(n), draw(n)

    def init(s):
        return {"mu": torch.tensor(0.0, dtype=dtype), "tau": torch.tensor(1.0, dtype=dtype)}

    truth = {"mu": torch.tensor(MU, dtype=dtype), "tau": torch.tensor(TAU, dtype=dtype)}

    def init_q(v):
        return {"mu": dist.Normal(v["mu"], 0.3), "tau": dist.Gamma(10.0 * v["tau"], 10.0)}

    return Problem("hierarchical", model, train, test, n, init, truth, init_q)


def make_problem(name: str, seed: int = 0, n: int = 200, dtype=torch.float64) -> Problem:
    builders = {"gmm": _gmm, "topics": _topics, "hierarchical": _hierarchical}
    if name not in builders:
        raise ValueError(f"unknown problem {name!r}; choose from {PROBLEMS}")
    return builders[name](seed, n, dtype)


# ----------------------------------------------------------------------------- runs
@dataclass
class Run:
    method: str
    history: List[List[float]]  # [iteration, seconds (excluding evaluation), held-out per group]
    posterior: Dict[str, torch.distributions.Distribution]
    error: Optional[str] = None


def _heldout(scorer: StructuredSVI, problem: Problem, posterior, num_samples: int) -> float:
    value = scorer.predictive_log_lik(problem.test, num_samples=num_samples, posterior=posterior)
    return value / problem.num_test_groups


def _globals(problem: Problem) -> StructuredSVI:
    scorer = StructuredSVI(problem.model)
    scorer.predictive_log_lik(problem.test[:2], num_samples=1)  # set-up: which sites are global
    return scorer


def run_cvi(problem: Problem, seed: int, iters: int, every: int = 1, num_samples: int = 32) -> Run:
    """Mean-field CVI: ``AutoCVI`` with the sequential (CAVI/VMP) sweep and ``step_size=1``."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    scorer = _globals(problem)
    guide = AutoCVI(
        problem.model, schedule="sequential", init_loc_fn=init_to_value(values=problem.init(seed))
    )
    svi = SVI(problem.model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    history, elapsed = [], 0.0
    for t in range(1, iters + 1):
        t0 = time.perf_counter()
        svi.step(problem.train)
        elapsed += time.perf_counter() - t0
        if t % every == 0 or t == iters:
            post = {n: guide.posterior(n) for n in scorer.global_names}
            history.append([t, elapsed, _heldout(scorer, problem, post, num_samples)])
    return Run("cvi (mean field)", history, post)


def run_ssvi(
    problem: Problem,
    seed: int,
    iters: int,
    every: int = 1,
    num_samples: int = 32,
    kappa: float = 0.75,
    delay: float = 1.0,
    scale: float = 0.3,
) -> Run:
    """SSVI (Algorithm 1, Option 1), ``rho_t = s (t + delay)^-kappa``, from the same initial
    global values as CVI as the means of a narrow ``q(beta)`` (``problem.init_q``): one draw
    of ``beta`` from a broad ``q`` gives a high-variance step (the ``V`` of eq. 8)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    ssvi = StructuredSVI(
        problem.model,
        step_size=step_sizes.robbins_monro(scale, delay, kappa),
        init_values=problem.init_q(problem.init(seed)),
    )
    history, elapsed = [], 0.0
    for t in range(1, iters + 1):
        t0 = time.perf_counter()
        ssvi.step(problem.train)
        elapsed += time.perf_counter() - t0
        if t % every == 0 or t == iters:
            post = {n: ssvi.posterior(n) for n in ssvi.global_names}
            history.append([t, elapsed, _heldout(ssvi, problem, post, num_samples)])
    return Run("ssvi (structured)", history, post)
