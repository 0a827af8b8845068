"""The conjugate computation of CVI for a Gaussian latent: Bayesian linear regression.

With a Gaussian prior ``N(z | m0, Lambda0^-1)`` and Gaussian "sites" on linear functions
``f_r = a_r^T z`` of the form ``exp(b_r f_r - w_r f_r^2 / 2)`` (exact messages of Normal
likelihoods, or CVI's site parameters of non-conjugate ones, eq. 13 and Appendix E.1), the
posterior is Gaussian with natural parameters (eq. 2 / Algorithm 1 step 4)::

    Lambda = Lambda0 + A^T W A,        Lambda m = Lambda0 m0 + A^T b.

Two equivalent forms are implemented:

* primal (``D x D``): one Cholesky of ``Lambda``; cost ``O(R D^2 + D^3)``.
* dual (``R x R``, Woodbury, for ``R < D`` and a diagonal prior covariance ``S0``): with
  ``K = A S0 A^T`` and the stable ``B = I + W^1/2 K W^1/2`` (Rasmussen & Williams, Alg. 3.2),
  ``m = m0 + S0 A^T alpha``, ``alpha = b - W^1/2 B^-1 W^1/2 (A m0 + K b)``; cost ``O(R^2 D + R^3)``.
  The solve itself is :func:`pyro_cvi.linalg.dual_solve`, shared with ``contrib.gpytorch``.

Cholesky factors come from :func:`pyro_cvi.linalg.cholesky`: strict for precisions (a failure
raises :class:`NotPositiveDefinite` so that the caller shrinks the CVI step), growing jitter
for covariances.

Only the quantities CVI needs each step are computed eagerly: the marginal means and variances
of ``f`` (for the site gradients) and ``log|V|`` (for the ELBO). The full covariance is formed
lazily, for ``posterior()`` and for sampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from .gaussian.conversions import loc_from_natural
from .linalg import NotPositiveDefinite, cholesky, dual_solve

__all__ = [
    "GaussianPrior",
    "GaussianPosterior",
    "solve",
    "row_statistics",
    "solve_statistics",
    "NotPositiveDefinite",
]

#: ``[local sums] -> [global sums]``: sums the row statistics over the ranks of a data-parallel
#: run (:class:`pyro_cvi.scale.distributed.Reducer`); ``None`` for one process
Reduce = Optional[Callable[[List[torch.Tensor]], List[torch.Tensor]]]


@dataclass
class GaussianPrior:
    """``N(loc, S0)`` given by a diagonal ``var``, a dense ``precision`` or a dense ``cov``.

    The form the model wrote is kept: a GP prior stays a covariance (its precision can be
    numerically meaningless), a precision-parameterised MVN stays a precision.

    ``log_norm``, when set, makes the prior an unnormalised Gaussian: its log-density is
    ``log_norm - (z - loc)^T S0^-1 (z - loc) / 2`` (``None``: the normalised
    ``-log|2 pi S0| / 2``). A tempered prior ``c log N(z | m, S)`` (Pyro's ``poutine.scale`` or
    ``mask`` on a latent) is ``S0 = S / c``, ``log_norm = -c log|2 pi S| / 2``; ``c = 0`` gives a
    zero precision (a flat prior), which only the precision form can hold.
    """

    loc: torch.Tensor
    var: Optional[torch.Tensor] = None
    precision: Optional[torch.Tensor] = None
    cov: Optional[torch.Tensor] = None
    log_norm: Optional[torch.Tensor] = None

    @property
    def is_diagonal(self) -> bool:
        return self.var is not None

    def tensors(self):
        return (self.loc, self.var, self.precision, self.cov, self.log_norm)

    def cov_cholesky(self) -> torch.Tensor:
        """Cholesky factor of the dense ``cov``, computed once per prior object."""
        if getattr(self, "_cov_chol", None) is None:
            self._cov_chol = cholesky(self.cov, jitter="grow", what="prior covariance")
        return self._cov_chol

    def precision_matrix(self) -> torch.Tensor:
        if self.precision is not None:
            return self.precision
        if self.cov is not None:
            return torch.cholesky_inverse(self.cov_cholesky())
        return torch.diag_embed(self.var.reciprocal())

    def normaliser(self) -> torch.Tensor:
        """``log_norm``, or the normalised Gaussian's ``-log|2 pi S0| / 2``."""
        if self.log_norm is not None:
            return self.log_norm
        D = self.loc.numel()
        if self.var is not None:
            logdet = self.var.log().sum()
        elif self.cov is not None:
            logdet = 2 * self.cov_cholesky().diagonal().log().sum()
        else:
            logdet = -2 * cholesky(self.precision, what="prior precision").diagonal().log().sum()
        return -0.5 * (D * math.log(2 * math.pi) + logdet)

    def detach(self) -> GaussianPrior:
        """A copy without graph; ``self`` when there is none (keeping its memoised Cholesky)."""
        if not any(t is not None and t.requires_grad for t in self.tensors()):
            return self
        return GaussianPrior(*(None if t is None else t.detach() for t in self.tensors()))

    def equal(self, other: GaussianPrior) -> bool:
        for a, b in zip(self.tensors(), other.tensors()):
            if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                return False
        return True


class GaussianPosterior:
    """The solved ``q(z) = N(m, V)`` with the row marginals ``f = A z`` it was solved for."""

    def __init__(self, loc, logdet_cov, f_mean, f_var, form, cov_fn, diag_fn, prior):
        self.loc = loc
        self.logdet_cov = logdet_cov
        self.f_mean = f_mean
        self.f_var = f_var
        self.form = form
        self.prior = prior
        self._cov_fn = cov_fn
        self._diag_fn = diag_fn
        self._cov = None
        self._scale_tril = None
        #: ``tr(S0^-1 V) = D - sum_n w_n Var(f_n)`` when the precision is ``S0^-1 + A^T W A``
        #: (no extra message), set by the solver: the KL then needs no ``D x D`` inverse
        self.site_trace: Optional[torch.Tensor] = None
        #: ``sl -> [n, K, K]``: covariance blocks of K consecutive rows, set by the solver
        self.row_cov_fn = None

    def detached(self) -> GaussianPosterior:
        """The same ``q`` without graph (a ``q`` solved with ``keep_graph``, for the CVI
        targets: the same numbers, no second solve); lazy parts are detached when formed."""
        d = GaussianPosterior(
            *(t.detach() for t in (self.loc, self.logdet_cov, self.f_mean, self.f_var)),
            self.form,
            lambda: self.covariance().detach(),
            lambda: self.cov_diag().detach(),
            self.prior.detach(),
        )
        d.site_trace = None if self.site_trace is None else self.site_trace.detach()
        if self.row_cov_fn is not None:
            d.row_cov_fn = lambda sl, K: self.row_cov_fn(sl, K).detach()
        for name in ("rotations", "blocks"):
            if hasattr(self, name):
                setattr(d, name, getattr(self, name))
        return d

    def row_cov_blocks(self, sl: slice, K: int) -> torch.Tensor:
        """Covariances ``Cov(f_r)`` of the rows ``sl`` in consecutive groups of ``K`` rows
        (the K-variate pseudo-observations of a softmax site), ``[R / K, K, K]``."""
        return self.row_cov_fn(sl, K)

    def covariance(self) -> torch.Tensor:
        if self._cov is None:
            self._cov = self._cov_fn()
        return self._cov

    def cov_diag(self) -> torch.Tensor:
        if self._cov is not None:
            return self._cov.diagonal()
        return self._diag_fn()

    def scale_tril(self) -> torch.Tensor:
        if self._scale_tril is None:
            self._scale_tril = cholesky(
                self.covariance(), jitter="grow", what="posterior covariance"
            )
        return self._scale_tril

    def kl_to(self, prior: GaussianPrior) -> torch.Tensor:
        """``KL(q || prior)``; differentiable in ``prior`` and in ``q`` (where ``q`` was solved
        with graph, ``solve(..., keep_graph=True)``)."""
        D = self.loc.numel()
        diff = self.loc - prior.loc
        cheap = (
            self.site_trace is not None
            and not any(t is not None and t.requires_grad for t in prior.tensors())
            and prior.equal(self.prior)
        )
        if prior.is_diagonal:
            prec = prior.var.reciprocal()
            trace = self.site_trace if cheap else (prec * self.cov_diag()).sum()
            maha = (diff * diff * prec).sum()
            logdet_p = prior.var.log().sum()
        elif prior.cov is not None:
            # the prior this q was solved under (same storage, no graph): reuse its Cholesky
            same = prior is self.prior or (
                not prior.cov.requires_grad and prior.cov.data_ptr() == _ptr(self.prior.cov)
            )
            L0 = (
                self.prior.cov_cholesky()
                if same
                else cholesky(prior.cov, jitter="grow", what="prior covariance")
            )
            trace = torch.cholesky_solve(self.covariance(), L0).diagonal().sum()
            u = torch.linalg.solve_triangular(L0, diff.unsqueeze(-1), upper=False)
            maha = (u * u).sum()
            logdet_p = 2 * L0.diagonal().log().sum()
        else:
            P = prior.precision
            trace = (P * self.covariance()).sum()
            maha = diff @ P @ diff
            logdet_p = (
                None
                if prior.log_norm is not None
                else -2 * cholesky(P, what="prior precision").diagonal().log().sum()
            )
        if prior.log_norm is not None:  # an unnormalised (tempered) prior: -E_q[log p] - H(q)
            entropy = 0.5 * (D * math.log(2 * math.pi * math.e) + self.logdet_cov)
            return 0.5 * (trace + maha) - prior.log_norm - entropy
        return 0.5 * (trace + maha - D + logdet_p - self.logdet_cov)


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def choose_form(prior: GaussianPrior, R: int, D: int, has_extra: bool, w) -> str:
    """Dual when it is cheaper and valid: diagonal prior, fewer rows than dims, ``w >= 0``."""
    if has_extra or prior.precision is not None or R > D:
        return "primal"
    if R == D and prior.cov is None:
        return "primal"
    if w is not None and bool((w < 0).any()):
        return "primal"
    return "dual"


def solve(
    prior: GaussianPrior,
    A: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    extra_h: Optional[torch.Tensor] = None,
    extra_prec: Optional[torch.Tensor] = None,
    form: str = "auto",
    reduce: Reduce = None,
    keep_graph: bool = False,
) -> GaussianPosterior:
    """Posterior of ``N(m0, S0)`` times row sites ``exp(b f - w f^2 / 2)``, ``f = A z``.

    ``extra_h`` / ``extra_prec`` add natural parameters ``(h, Lambda)`` of other messages
    (general non-conjugate factors; primal form only). Raises :class:`NotPositiveDefinite` when
    the natural parameters are invalid, so callers can shrink the step. With ``reduce`` the rows
    are this rank's shard: their statistics ``(A^T W A, A^T b)`` are summed over the ranks
    (primal form) and every rank gets the full-data posterior. With ``keep_graph`` the prior
    keeps its graph (rows do whenever theirs have one): ``q`` is then differentiable in the
    model's parameters at fixed sites.
    """
    prior = prior if keep_graph else prior.detach()
    R, D = A.shape
    has_extra = extra_h is not None or extra_prec is not None
    if reduce is not None:
        S, s = reduce(list(row_statistics(A, w, b)))
        return solve_statistics(prior, S, s, A, extra_h, extra_prec, keep_graph)
    if form == "auto":
        form = choose_form(prior, R, D, has_extra, w)
    if form == "dual":
        identity = R == D and bool((A.diagonal() == 1).all()) and int(A.count_nonzero()) == R
        return _solve_dual(prior, None if identity else A, w, b)
    return _solve_primal(prior, A, w, b, extra_h, extra_prec)


def row_statistics(
    A: torch.Tensor, w: torch.Tensor, b: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The sufficient statistics of the rows: ``(A^T W A, A^T b)``, sums over data points
    (Algorithm 1 step 4 needs nothing else from them; data-parallel and streaming CVI sum
    these over shards and minibatches)."""
    return A.T @ (w.unsqueeze(-1) * A), A.T @ b


def solve_statistics(
    prior: GaussianPrior,
    S: torch.Tensor,
    s: torch.Tensor,
    A: Optional[torch.Tensor] = None,
    extra_h: Optional[torch.Tensor] = None,
    extra_prec: Optional[torch.Tensor] = None,
    keep_graph: bool = False,
) -> GaussianPosterior:
    """Primal posterior from summed statistics: ``Lambda = Lambda0 + S``, ``Lambda m =
    Lambda0 m0 + s`` (eq. 2); the row marginals are those of ``A`` (this shard's rows)."""
    prior = prior if keep_graph else prior.detach()
    if A is None:
        A = S.new_zeros(0, S.shape[0])
    post = _solve_primal(prior, A, None, None, extra_h, extra_prec, stats=(S, s))
    post.site_trace = None  # needs all rows' w Var(f): the KL takes tr(S0^-1 V) directly
    return post


def _solve_primal(prior, A, w, b, extra_h, extra_prec, stats=None):
    D = prior.loc.numel()
    if prior.is_diagonal:
        Lam = torch.diag_embed(prior.var.reciprocal())
        h = prior.loc / prior.var
    else:
        Lam = prior.precision_matrix()
        h = Lam @ prior.loc
    if stats is not None:
        Lam, h = Lam + stats[0], h + stats[1]
    elif A.shape[0]:
        Lam = torch.addmm(Lam, A.T, w.unsqueeze(-1) * A)
        h = h + A.T @ b
    if extra_prec is not None:  # (A^T W A is symmetric; the Cholesky reads one triangle)
        Lam = Lam + 0.5 * (extra_prec + extra_prec.T)
    if extra_h is not None:
        h = h + extra_h
    L = cholesky(Lam, what="posterior precision Lambda0 + A^T W A")
    m = loc_from_natural(h, L)
    logdet_cov = -2 * L.diagonal().log().sum()
    if A.shape[0]:
        U = torch.linalg.solve_triangular(L, A.T, upper=False)
        f_var = (U * U).sum(0)
        f_mean = A @ m
    else:
        U = None
        f_var = f_mean = A.new_zeros(0)
    eye = torch.eye(D, dtype=A.dtype, device=A.device)

    def cov():
        return torch.cholesky_inverse(L)

    def diag():
        Linv = torch.linalg.solve_triangular(L, eye, upper=False)
        return (Linv * Linv).sum(0)

    def row_cov(sl, K):
        u = U[:, sl].reshape(D, -1, K)
        return torch.einsum("dnk,dnl->nkl", u, u)

    post = GaussianPosterior(m, logdet_cov, f_mean, f_var, "primal", cov, diag, prior)
    post.row_cov_fn = row_cov
    if extra_prec is None and stats is None:
        post.site_trace = D - (w * f_var).sum() if A.shape[0] else f_var.new_tensor(float(D))
    return post


def _solve_dual(prior, A, w, b):
    """Dual form; ``A=None`` means the identity (a GP: the sites sit on z itself)."""
    m0 = prior.loc
    dense = prior.cov is not None
    s0 = prior.cov.diagonal() if dense else prior.var
    if A is None:
        AS = prior.cov if dense else torch.diag_embed(s0)
        K, mu_f = AS, m0
    else:
        AS = A @ prior.cov if dense else A * s0  # (R, D); S0 is symmetric
        K, mu_f = AS @ A.T, A @ m0
    sol = dual_solve(K, w, b, mu_f)
    m = m0 + AS.T @ sol.alpha
    if dense:
        logdet_s0 = 2 * prior.cov_cholesky().diagonal().log().sum()
    else:
        logdet_s0 = s0.log().sum()
    logdet_cov = logdet_s0 - sol.logdet_B
    E = None

    def _E():
        # E = L_B^-1 W^1/2 A S0, so that V = S0 - E^T E (equal to sol.V for a GP: A S0 = K)
        nonlocal E
        if E is None:
            E = sol.V if AS is K else sol.whiten(AS)
        return E

    def cov():
        e = _E()
        return (prior.cov if dense else torch.diag_embed(s0)) - e.T @ e

    def diag():
        e = _E()
        return s0 - (e * e).sum(0)

    def row_cov(sl, K):
        idx = torch.arange(sl.start, sl.stop, device=m0.device).reshape(-1, K)
        V = sol.V[:, idx]  # [R, n, K]
        return sol.K[idx.unsqueeze(-1), idx.unsqueeze(-2)] - torch.einsum("rnk,rnl->nkl", V, V)

    post = GaussianPosterior(m, logdet_cov, sol.mean, sol.var, "dual", cov, diag, prior)
    post.row_cov_fn = row_cov
    post.site_trace = m0.numel() - (w.clamp_min(0) * sol.var).sum()
    return post
