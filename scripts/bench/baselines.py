"""Reference computations for Bayesian logistic regression, independent of the CVI Pyro API.

The model is ``w ~ N(0, I / delta)``, ``y_n ~ Bernoulli(sigmoid(x_n^T w))``, and ``q = N(m, V)``.
Everything here is used by the tests, the benchmark (``scripts/benchmark_logreg.py``) and the
tutorial (``tutorials/logistic_regression.ipynb``):

* :func:`logreg_neg_elbo` and :func:`logreg_log_loss_bits`: the metrics of the benchmark
  protocol (``shared/data/README.md``), with expectations by Gauss-Hermite quadrature, since
  each likelihood term depends on ``w`` only through ``eta_n = x_n^T w ~ N(x_n^T m, x_n^T V x_n)``.
* :func:`plain_cvi_logreg`: a lean plain-torch CVI loop (Khan & Lin 2017, Algorithm 1 with the
  GLM update of Appendix E.1): the floor for the framework overhead of the Pyro API.
* :func:`pyro_adam_logreg`: the usual Pyro baseline, SVI with Adam, ``AutoMultivariateNormal``
  and ``Trace_ELBO``.
* :func:`run_svi_checkpoints` and :func:`time_to_target`: timing helpers, with evaluation kept
  out of the measured time.
"""

from __future__ import annotations

import importlib
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from pyro_cvi.messages.quadrature import gauss_hermite, mean_param_gradients, site_natural_params

__all__ = [
    "HistoryPoint",
    "Checkpoint",
    "LogRegFit",
    "make_logreg_model",
    "bernoulli_logit_log_prob",
    "logreg_neg_elbo",
    "logreg_log_loss_bits",
    "gaussian_kl_to_isotropic_prior",
    "plain_cvi_logreg",
    "pyro_adam_logreg",
    "run_svi_checkpoints",
    "evaluate_checkpoints",
    "time_to_target",
]

StepSize = Union[float, Callable[[int], float]]


class HistoryPoint(NamedTuple):
    """``(iteration, seconds, neg_elbo)``: ``seconds`` counts only the optimisation steps."""

    iteration: int
    seconds: float
    neg_elbo: float


class Checkpoint(NamedTuple):
    """A snapshot of ``q = N(loc, covariance)`` after ``iteration`` steps, ``seconds`` of work.

    Either ``covariance`` or ``scale_tril`` (``covariance = scale_tril scale_tril^T``) may be
    ``None``: a Cholesky factor is enough to score ``q`` without forming the covariance.
    """

    iteration: int
    seconds: float
    loc: torch.Tensor
    covariance: Optional[torch.Tensor]
    scale_tril: Optional[torch.Tensor] = None


@dataclass
class LogRegFit:
    """Result of a fit: ``q = N(loc, covariance)`` and the -ELBO history.

    Unpacks as ``loc, covariance, history = fit``. ``checkpoints`` holds snapshots of ``q`` where
    the method records them (:func:`pyro_adam_logreg`); ``extra`` holds method-specific state
    (the CVI sites ``lam1``, ``lam2``, the chosen ``form``). ``scale_tril``, where known, is the
    Cholesky factor of ``covariance``: score ``q`` with it (:meth:`neg_elbo`), since
    ``L L^T`` of a badly scaled ``L`` may not factorise again in floating point.
    """

    loc: torch.Tensor
    covariance: torch.Tensor
    history: List[HistoryPoint]
    checkpoints: List[Checkpoint] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    scale_tril: Optional[torch.Tensor] = None

    def __iter__(self) -> Iterator:
        return iter((self.loc, self.covariance, self.history))

    def neg_elbo(
        self, X: torch.Tensor, y: torch.Tensor, prior_precision: float, num_points: int = 32
    ) -> float:
        """:func:`logreg_neg_elbo` of the final ``q`` (using ``scale_tril`` when known)."""
        with torch.no_grad():
            V = None if self.scale_tril is not None else self.covariance
            return float(
                logreg_neg_elbo(
                    X, y, self.loc, V, prior_precision, num_points, scale_tril=self.scale_tril
                )
            )

    def log_loss_bits(self, X: torch.Tensor, y: torch.Tensor, num_points: int = 32) -> float:
        """:func:`logreg_log_loss_bits` of the final ``q`` on ``(X, y)``."""
        with torch.no_grad():
            V = None if self.scale_tril is not None else self.covariance
            return logreg_log_loss_bits(X, y, self.loc, V, num_points, scale_tril=self.scale_tril)

    @property
    def num_iters(self) -> int:
        return self.history[-1].iteration if self.history else 0

    @property
    def seconds(self) -> float:
        return self.history[-1].seconds if self.history else 0.0


# ----------------------------------------------------------------------------------------------
# The model and the metrics
# ----------------------------------------------------------------------------------------------


def make_logreg_model(prior_precision: float) -> Callable:
    """The Pyro model ``w ~ N(0, I / delta)``, ``y_n ~ Bernoulli(logits = x_n^T w)`` (eq. 66)."""
    import pyro
    import pyro.distributions as dist

    scale = 1.0 / math.sqrt(prior_precision)

    def model(X: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        D = X.shape[-1]
        w = pyro.sample("w", dist.Normal(X.new_zeros(D), X.new_full((D,), scale)).to_event(1))
        with pyro.plate("data", X.shape[0]):
            return pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model


def bernoulli_logit_log_prob(eta: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``log p(y | eta) = y * eta - log(1 + exp(eta))``, elementwise and numerically stable."""
    return -F.binary_cross_entropy_with_logits(eta, y.expand_as(eta), reduction="none")


def _predictive_moments(
    X: torch.Tensor,
    m: torch.Tensor,
    V: Optional[torch.Tensor],
    scale_tril: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Mean ``x_n^T m`` and variance ``x_n^T V x_n`` of ``eta_n``.

    ``V`` is a full covariance or its diagonal; if ``V`` is ``None``, ``scale_tril`` ``L`` gives
    ``x_n^T V x_n = |L^T x_n|^2``.
    """
    mean = X @ m
    if V is None:
        if scale_tril is None:
            raise ValueError("give the covariance V or its Cholesky factor scale_tril")
        var = (X @ scale_tril).pow(2).sum(-1)
    elif V.dim() == 1:
        var = (X * X) @ V
    else:
        var = ((X @ V) * X).sum(-1)
    return mean, var.clamp_min(0.0)


def gaussian_kl_to_isotropic_prior(
    m: torch.Tensor,
    V: Optional[torch.Tensor],
    prior_precision: float,
    scale_tril: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``KL(N(m, V) || N(0, I / delta)) = (delta tr V + delta m^T m - D - log det(delta V)) / 2``.

    ``V`` may be a full ``(D, D)`` covariance or the ``(D,)`` diagonal of one; with ``V=None``
    the Cholesky factor ``scale_tril`` is used (``tr V = |L|_F^2``, no ``O(D^3)`` work).
    """
    delta = float(prior_precision)
    D = m.shape[-1]
    if V is None:
        if scale_tril is None:
            raise ValueError("give the covariance V or its Cholesky factor scale_tril")
        diag = torch.diagonal(scale_tril)
        trace, logdet = scale_tril.pow(2).sum(), 2.0 * diag.abs().log().sum()
    elif V.dim() == 1:
        trace, logdet = V.sum(), V.log().sum()
    else:
        L = torch.linalg.cholesky(V)
        trace, logdet = torch.diagonal(V).sum(), 2.0 * torch.diagonal(L).log().sum()
    return 0.5 * (delta * trace + delta * (m * m).sum() - D - D * math.log(delta) - logdet)


def logreg_neg_elbo(
    X: torch.Tensor,
    y: torch.Tensor,
    m: torch.Tensor,
    V: Optional[torch.Tensor],
    prior_precision: float,
    num_points: int = 32,
    *,
    scale_tril: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The exact -ELBO of ``q = N(m, V)`` for Bayesian logistic regression (up to quadrature).

    ``-ELBO = sum_n E_q[-log p(y_n | eta_n)] + KL(q || N(0, I / delta))`` with
    ``eta_n ~ N(x_n^T m, x_n^T V x_n)``; the 1-D expectations use ``num_points``-point
    Gauss-Hermite quadrature and the KL is in closed form. Differentiable in ``m`` and ``V``.
    ``V`` may be a ``(D,)`` diagonal, or ``None`` with ``scale_tril`` given.
    """
    mean, var = _predictive_moments(X, m, V, scale_tril)
    t, w = gauss_hermite(num_points, mean.dtype, mean.device)
    eta = mean + var.sqrt() * t[:, None]
    expected_ll = (w[:, None] * bernoulli_logit_log_prob(eta, y)).sum()
    return gaussian_kl_to_isotropic_prior(m, V, prior_precision, scale_tril) - expected_ll


def logreg_log_loss_bits(
    X: torch.Tensor,
    y: torch.Tensor,
    m: torch.Tensor,
    V: Optional[torch.Tensor],
    num_points: int = 32,
    *,
    scale_tril: Optional[torch.Tensor] = None,
) -> float:
    """Test log-loss in bits, ``-mean(y log2 p + (1 - y) log2(1 - p))``, ``p = E_q[sigmoid(eta)]``.

    The predictive probability is computed by quadrature in log space,
    ``log p = logsumexp_k(log w_k + log sigmoid(eta_k))``, so it never rounds to 0 or 1.
    """
    mean, var = _predictive_moments(X, m, V, scale_tril)
    return bernoulli_log_loss_bits(mean, var, y, num_points)


def bernoulli_log_loss_bits(
    mean: torch.Tensor, var: torch.Tensor, y: torch.Tensor, num_points: int = 32
) -> float:
    """Log-loss in bits of ``p_n = E[sigmoid(eta_n)]``, ``eta_n ~ N(mean_n, var_n)``
    (by quadrature)."""
    t, w = gauss_hermite(num_points, mean.dtype, mean.device)
    eta = mean + var.sqrt() * t[:, None]
    logw = w.log()[:, None]
    log_p = torch.logsumexp(logw + F.logsigmoid(eta), 0)
    log_1mp = torch.logsumexp(logw + F.logsigmoid(-eta), 0)
    nats = -(y * log_p + (1.0 - y) * log_1mp).mean()
    return float(nats) / math.log(2.0)


# ----------------------------------------------------------------------------------------------
# Plain-torch CVI (Algorithm 1 + Appendix E.1)
# ----------------------------------------------------------------------------------------------


def _step(step_size: StepSize, t: int) -> float:
    return float(step_size(t)) if callable(step_size) else float(step_size)


class _Primal:
    """``q(w) ∝ N(w | 0, I / delta) prod_n exp(lam1_n eta_n + lam2_n eta_n^2)`` in D x D form.

    ``Lambda = delta I + X^T W X`` (``W = -2 lam2``), ``m = Lambda^{-1} X^T lam1``; one Cholesky
    ``Lambda = L L^T`` per update, ``s_n = x_n^T V x_n = |L^{-1} x_n|^2``.
    """

    def __init__(self, X: torch.Tensor, delta: float):
        self.X, self.delta = X, delta
        self.eye = torch.eye(X.shape[1], dtype=X.dtype, device=X.device)

    def update(self, lam1: torch.Tensor, W: torch.Tensor):
        X = self.X
        Lam = torch.addmm(self.eye, X.T, X * W[:, None], beta=self.delta)
        self.L = torch.linalg.cholesky(Lam)
        self.m = torch.cholesky_solve((X.T @ lam1)[:, None], self.L)[:, 0]
        A = torch.linalg.solve_triangular(self.L, X.T, upper=False)
        mean, var = X @ self.m, (A * A).sum(0)
        # log det(Lambda / delta) = log det(I + W^1/2 K W^1/2) (Sylvester), used by the KL.
        logdet = 2.0 * torch.diagonal(self.L).log().sum() - X.shape[1] * math.log(self.delta)
        sq_norm_m = self.delta * (self.m * self.m).sum()
        return mean, var, logdet, sq_norm_m

    def posterior(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.m, torch.cholesky_inverse(self.L)


class _Dual:
    """The same posterior in N x N (Woodbury) form, for ``D > N``.

    With ``K = X X^T / delta`` and ``B = I + W^1/2 K W^1/2 = L_B L_B^T`` (well conditioned:
    eigenvalues >= 1), ``alpha = lam1 - W^1/2 B^{-1} W^1/2 K lam1``, ``m = X^T alpha / delta``,
    ``X m = K alpha``, ``diag(X V X^T) = diag(K) - |L_B^{-1} W^1/2 K|^2`` (column sums), and
    ``V = I / delta - C^T C / delta^2`` with ``C = L_B^{-1} W^1/2 X`` (formed only at the end).
    """

    def __init__(self, X: torch.Tensor, delta: float):
        self.X, self.delta = X, delta
        self.K = (X @ X.T) / delta
        self.diagK = torch.diagonal(self.K).clone()
        self.eye = torch.eye(X.shape[0], dtype=X.dtype, device=X.device)

    def update(self, lam1: torch.Tensor, W: torch.Tensor):
        K = self.K
        sw = W.clamp_min(0.0).sqrt()
        self.sw = sw
        B = torch.addcmul(self.eye, sw[:, None] * K, sw[None, :])
        self.LB = torch.linalg.cholesky(B)
        Kl = K @ lam1
        self.alpha = lam1 - sw * torch.cholesky_solve((sw * Kl)[:, None], self.LB)[:, 0]
        A = torch.linalg.solve_triangular(self.LB, sw[:, None] * K, upper=False)
        mean = K @ self.alpha
        var = self.diagK - (A * A).sum(0)
        logdet = 2.0 * torch.diagonal(self.LB).log().sum()
        sq_norm_m = self.alpha @ mean  # delta |m|^2 = alpha^T K alpha
        return mean, var, logdet, sq_norm_m

    def posterior(self) -> Tuple[torch.Tensor, torch.Tensor]:
        X, d = self.X, self.delta
        m = (X.T @ self.alpha) / d
        C = torch.linalg.solve_triangular(self.LB, self.sw[:, None] * X, upper=False)
        V = torch.eye(X.shape[1], dtype=X.dtype, device=X.device) / d - (C.T @ C) / d**2
        return m, V


def plain_cvi_logreg(
    X: torch.Tensor,
    y: torch.Tensor,
    prior_precision: float,
    step_size: StepSize = 0.4 / 1.4,
    num_iters: int = 100,
    tol: Optional[float] = None,
    form: str = "auto",
    callback: Optional[Callable[[int, HistoryPoint], Optional[bool]]] = None,
    num_points: int = 32,
    num_samples: Optional[int] = None,
    return_covariance: bool = True,
    progress: Union[bool, str] = False,
    clock: Callable[[], float] = time.perf_counter,
    init_sites: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> LogRegFit:
    """CVI for Bayesian logistic regression as a sequence of Bayesian linear regressions.

    Algorithm 1 of Khan & Lin (2017) with the GLM update of Appendix E.1. Each data point has a
    Gaussian site ``exp(lam1_n eta_n + lam2_n eta_n^2)`` (eq. 13). Iteration ``t``:

    1. gradients of ``E_q[log p(y_n | eta_n)]`` with respect to the mean parameters of
       ``q(eta_n) = N(a_n, s_n)`` (eqs. 29-31): ``g_n = (df/dm - 2 a_n df/dv, df/dv)``, by
       Gauss-Hermite quadrature (``num_samples=None``) or Monte Carlo;
    2. ``lam_tilde <- (1 - beta_t) lam_tilde + beta_t g`` (eq. 12 / E.1);
    3. conjugate computation: ``q`` is the posterior of a Bayesian linear regression with
       pseudo-observations ``y~_n = lam1_n / W_n``, noise variances ``1 / W_n``, ``W = -2 lam2``:
       ``V^{-1} = delta I + X^T W X``, ``m = V X^T lam1``, in primal (D x D) or dual (N x N)
       form (``form="auto"`` takes the dual when ``D > N``). One Cholesky per iteration.

    Sites start at zero (``q`` = the prior). ``step_size`` is ``beta`` or a function
    ``t -> beta_t`` (``t = 1, 2, ...``); the paper's ``w / (1 + w)`` with ``w = 0.4`` is the
    default. The history records ``(t, seconds, -ELBO(q_t))`` with ``q_0`` the prior; the
    -ELBO comes at no extra cost from the quantities of step 1, using ``delta tr V =
    D - sum_n W_n s_n`` and ``log det(delta V) = -log det(I + W^1/2 K W^1/2)``, and equals
    :func:`logreg_neg_elbo` at the same ``num_points``. With ``tol`` the loop stops once the
    -ELBO changes by less than ``tol`` between iterations; ``callback(t, point)`` returning
    ``True`` stops it too. ``V`` is formed once, at the end (``return_covariance=False`` skips it).
    ``clock`` times the history (``time.process_time`` for CPU seconds). ``init_sites``
    ``(lam1, lam2)`` starts the sites elsewhere (e.g. ``(y - 1/2, -1/8)``: the Newton step
    from ``w = 0``, which ``AutoCVI`` takes where the prior is flat).
    """
    if X.dim() != 2:
        raise ValueError(f"X must be (N, D), got shape {tuple(X.shape)}")
    N, D = X.shape
    delta = float(prior_precision)
    if form == "auto":
        form = "dual" if D > N else "primal"
    if form not in ("primal", "dual"):
        raise ValueError(f"form must be 'auto', 'primal' or 'dual', got {form!r}")
    y = y.to(dtype=X.dtype, device=X.device)
    solver = _Primal(X, delta) if form == "primal" else _Dual(X, delta)

    def log_lik(eta: torch.Tensor) -> torch.Tensor:
        return bernoulli_logit_log_prob(eta, y)

    lam1 = X.new_zeros(N) if init_sites is None else init_sites[0].to(X)
    lam2 = X.new_zeros(N) if init_sites is None else init_sites[1].to(X).expand(N)
    history: List[HistoryPoint] = []
    pbar = None
    if progress:
        from tqdm.auto import tqdm

        pbar = tqdm(total=num_iters, desc=f"plain CVI ({form})")

    start = clock()
    with torch.no_grad():
        mean, var, logdet, sq_norm_m = solver.update(lam1, -2.0 * lam2)
    t = 0
    while True:
        with torch.enable_grad():
            f, gm, gv = mean_param_gradients(
                log_lik, mean, var, num_points=num_points, num_samples=num_samples
            )
        with torch.no_grad():
            W = -2.0 * lam2
            kl = 0.5 * (sq_norm_m - (W * var).sum() + logdet)
            point = HistoryPoint(t, clock() - start, float(kl - f.sum()))
        history.append(point)
        stop = callback is not None and bool(callback(t, point))
        if tol is not None and t > 0 and abs(history[-2].neg_elbo - point.neg_elbo) < tol:
            stop = True
        if stop or t >= num_iters:
            break
        t += 1
        if pbar is not None:
            pbar.update(1)
        with torch.no_grad():
            beta = _step(step_size, t)
            g1, g2 = site_natural_params(mean, gm, gv)
            lam1 = (1.0 - beta) * lam1 + beta * g1
            lam2 = (1.0 - beta) * lam2 + beta * g2
            mean, var, logdet, sq_norm_m = solver.update(lam1, -2.0 * lam2)
    if pbar is not None:
        pbar.close()

    with torch.no_grad():
        if return_covariance:
            m, V = solver.posterior()
        else:
            m, V = solver.posterior()[0], X.new_empty(0)
    return LogRegFit(m, V, history, extra={"lam1": lam1, "lam2": lam2, "form": form})


# ----------------------------------------------------------------------------------------------
# Pyro SVI runners
# ----------------------------------------------------------------------------------------------


Snapshot = Callable[[], Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]]


def run_svi_checkpoints(
    svi,
    args: tuple,
    num_iters: int,
    snapshot: Snapshot,
    checkpoint_every: Union[int, Callable[[int], bool]] = 10,
    time_limit: Optional[float] = None,
    kwargs: Optional[dict] = None,
    progress: Union[bool, str] = False,
    start_seconds: float = 0.0,
) -> Tuple[List[Checkpoint], List[float]]:
    """Run ``svi.step(*args)`` and snapshot ``q`` at checkpoints.

    Only ``svi.step`` is timed (the clock starts at ``start_seconds``, e.g. a set-up time).
    ``snapshot()`` returns ``(loc, covariance, scale_tril)`` (either of the last two may be
    ``None``) and runs outside the clock: before the first step (iteration 0), after step ``i``
    when ``i % checkpoint_every == 0`` (or ``checkpoint_every(i)`` is true), and at the end.
    Stops after ``num_iters`` steps or once the timed total exceeds ``time_limit`` seconds.
    Returns the checkpoints and the per-step losses.
    """
    kwargs = kwargs or {}
    checkpoints: List[Checkpoint] = []
    losses: List[float] = []
    elapsed = float(start_seconds)
    due = checkpoint_every if callable(checkpoint_every) else lambda i: i % checkpoint_every == 0

    def take(i: int) -> None:
        with torch.no_grad():
            loc, cov, tril = snapshot()
        checkpoints.append(
            Checkpoint(
                i,
                elapsed,
                loc.detach().clone(),
                None if cov is None else cov.detach().clone(),
                None if tril is None else tril.detach().clone(),
            )
        )

    pbar = None
    if progress:
        from tqdm.auto import tqdm

        desc = progress if isinstance(progress, str) else None
        pbar = tqdm(total=num_iters, desc=desc, leave=False, mininterval=0.5, file=sys.stderr)
    take(0)
    i = 0
    for i in range(1, num_iters + 1):
        t0 = time.perf_counter()
        loss = svi.step(*args, **kwargs)
        elapsed += time.perf_counter() - t0
        losses.append(float(loss))
        if pbar is not None:
            pbar.update(1)
        if due(i):
            take(i)
        if time_limit is not None and elapsed > time_limit:
            break
    if pbar is not None:
        pbar.close()
    if checkpoints[-1].iteration != i:
        take(i)
    return checkpoints, losses


def evaluate_checkpoints(
    checkpoints: List[Checkpoint],
    X: torch.Tensor,
    y: torch.Tensor,
    prior_precision: float,
    num_points: int = 32,
) -> List[HistoryPoint]:
    """The quadrature -ELBO (:func:`logreg_neg_elbo`) at each checkpoint, as a history."""
    out = []
    with torch.no_grad():
        for c in checkpoints:
            try:
                value = logreg_neg_elbo(
                    X, y, c.loc, c.covariance, prior_precision, num_points, scale_tril=c.scale_tril
                )
                value = float(value)
            except RuntimeError:  # a covariance that is not positive definite
                value = math.inf
            out.append(HistoryPoint(c.iteration, c.seconds, value))
    return out


def pyro_adam_logreg(
    model: Callable,
    X: torch.Tensor,
    y: torch.Tensor,
    lr: float,
    num_iters: int,
    *,
    prior_precision: Optional[float] = None,
    num_particles: int = 1,
    checkpoint_every: Union[int, Callable[[int], bool]] = 10,
    time_limit: Optional[float] = None,
    init_scale: float = 0.1,
    seed: Optional[int] = 0,
    progress: Union[bool, str] = False,
) -> LogRegFit:
    """Pyro's standard recipe: ``SVI(model, AutoMultivariateNormal(model), Adam(lr), Trace_ELBO)``.

    Gradients are reparameterised Monte Carlo estimates from ``num_particles`` draws
    (vectorised when more than one). ``q = N(loc, L L^T)`` is snapshotted (``loc``, ``L``) at
    the checkpoints, outside the clock. With ``prior_precision`` the checkpoints are scored by
    the quadrature -ELBO into ``history``; otherwise ``history`` holds the Monte Carlo step
    losses at the checkpoints (``nan`` at iteration 0). The param store is cleared first, and
    the guide is set up by one call outside the clock (``extra["setup_seconds"]``). The model
    must have a single latent site, or ``loc`` and ``covariance`` are over all latents,
    flattened.
    """
    import pyro
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoMultivariateNormal

    if seed is not None:
        pyro.set_rng_seed(seed)
    pyro.clear_param_store()
    t0 = time.perf_counter()
    guide = AutoMultivariateNormal(model, init_scale=init_scale)
    guide(X, y)  # set up the guide's parameters
    setup_seconds = time.perf_counter() - t0
    elbo = Trace_ELBO(
        num_particles=num_particles, vectorize_particles=num_particles > 1, max_plate_nesting=1
    )
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), loss=elbo)

    def snapshot():
        q = guide.get_posterior()
        return q.loc, None, q.scale_tril

    checkpoints, losses = run_svi_checkpoints(
        svi, (X, y), num_iters, snapshot, checkpoint_every, time_limit, progress=progress
    )
    if prior_precision is not None:
        history = evaluate_checkpoints(checkpoints, X, y, prior_precision)
    else:
        history = [
            HistoryPoint(
                c.iteration, c.seconds, losses[c.iteration - 1] if c.iteration else math.nan
            )
            for c in checkpoints
        ]
    last = checkpoints[-1]
    with torch.no_grad():
        covariance = last.scale_tril @ last.scale_tril.T
    return LogRegFit(
        last.loc,
        covariance,
        history,
        checkpoints,
        extra={"guide": guide, "losses": losses, "lr": lr, "setup_seconds": setup_seconds},
        scale_tril=last.scale_tril,
    )


def time_to_target(
    history: List[HistoryPoint], target: float, tol: float = 0.5
) -> Optional[Tuple[int, float]]:
    """``(iteration, seconds)`` of the first history point with ``-ELBO <= target + tol``.

    ``target`` is the converged -ELBO (the benchmark takes the best any method reaches);
    returns ``None`` if the history never gets within ``tol`` nats.
    """
    for point in history:
        if point.neg_elbo <= target + tol:
            return point.iteration, point.seconds
    return None


def warm_up() -> None:
    """Pay torch's and Pyro's one-time costs (BLAS, LAPACK, autograd) before any timing."""
    importlib.import_module("torch.fx.experimental.symbolic_shapes")  # autograd imports sympy

    g = torch.Generator().manual_seed(0)
    X = torch.randn(50, 5, generator=g, dtype=torch.float64)
    y = (X[:, 0] > 0).to(X.dtype)
    plain_cvi_logreg(X, y, 1.0, 0.5, 3)
    plain_cvi_logreg(X, y, 1.0, 0.5, 3, form="dual")
    pyro_adam_logreg(make_logreg_model(1.0), X, y, 0.01, 3, prior_precision=1.0)
