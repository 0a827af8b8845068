"""The full curvature a diagonal Gaussian's own draws show, for its natural-gradient step.

CVI's natural gradient in the mean-field family ``q = N(m, diag(s^2))`` (eqs. 12-13) moves the
mean by ``m' = m - b P'^-1 dl/dm``, ``P'`` the diagonal precision. Where the posterior's
coordinates are correlated (``Lambda = -hess log p`` far from diagonal) that is a Jacobi
iteration on ``Lambda (m - m*) = 0``: its rate is the smallest eigenvalue of ``Lambda``'s
correlation matrix (0.05 for six predictors of pairwise correlation 0.95), and the one-draw
gradient's noise ``Lambda s eps`` is as large as its correlations make it.

With one reparameterised draw ``u_t = m_t + s_t eps_t`` per step, Trace_ELBO's ``dl/dm`` is
``h(u_t) = -grad log p(u_t)``: the gradient *at the draw*. A least-squares fit
``h(u) ~ A u + c`` over the recent steps (exponential forgetting over ``2 d + 10`` steps: a
secant estimate, as in quasi-Newton methods; exact from ``d + 1`` draws where the posterior is
Gaussian; none is fitted before ``2 d + 10`` draws) gives the full curvature ``A ~ Lambda``.
It is used twice, each time so that the expected step, hence the fixed point
``E[dl/dm] = 0, E[dl/dS] = 0`` of the natural gradient in ``q``'s family, is unchanged:

1. control variates (zero mean: ``E[u - m] = 0``, ``E[eps_i eps_j] = 0`` for ``i != j``)::

       dl/dm   <- dl/dm - A (u - m),
       dl/ds_i <- dl/ds_i - eps_i (A u + c - A_ii (u_i - m_i))_i - s_i A_ii (eps_i^2 - 1)

   (``E[eps_i h(u)_i] = E[eps_i A_ii (u_i - m_i)]`` where ``h = A u + c``); where the
   posterior is Gaussian the first is ``Lambda (m - m*)`` and the second ``A_ii s_i - 1 / s_i``
   (the precision's target ``G = Lambda_ii - P_ii``, Price's) exactly: no Monte Carlo noise;
2. the mean's metric ``M = P'^1/2 R P'^1/2``, ``R`` the correlation matrix of ``A`` (its
   eigenvalues clipped at ``R_FLOOR``): the diagonal natural gradient's own precision with
   the correlations the draws show. ``R = I`` (independent coordinates) is exactly the
   diagonal step; at the mean-field optimum (``P_ii = Lambda_ii``) ``M = Lambda`` and the
   mean's step is Newton's.

Both are used only while the fit earns them: the (exponentially averaged) whitened squared
error of its prediction of ``h`` at each new draw, before the draw enters it, is compared with
the whitened variance of ``h`` over the window (after ``CHECKS`` predictions): the control
variate is used while the fit
explains part of that variance, the metric while it explains at least half; otherwise the
step is the plain diagonal one.
Only single-draw steps of Normal sites of at most ``MAX_DIM`` coordinates are fitted, and only
while the gradients are the reparameterised ones of the draw (:func:`reparameterised`).

A one-coordinate Normal site (not an autoguide's) is fitted from ``d + 2 = 3`` draws on
(``A`` is its one curvature, the metric is the diagonal step's own): its plain one-draw
precision target ``h eps / s`` carries ``Lambda (m - m*) eps / s``, so a mean far off makes
the precision noisy, a small precision makes the next mean step long, and the two can throw
each other off for dozens of steps; with the control variate the target is ``A`` whatever
``m``.

A full-covariance site (``MultivariateNormal(loc, scale_tril=L)``) uses the same fit for
Price's precision target with control variates (:func:`tril_with_draw`), from ``d + 2`` draws
on: its one-draw precision estimate is a Wishart-like draw, and its step already has the full
metric.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

__all__ = ["MAX_DIM", "R_FLOOR", "DrawCurvature", "tril_with_draw"]

#: sites with more coordinates keep the diagonal step (the fit is ``O(d^3)`` a step)
MAX_DIM = 64
#: the smallest eigenvalue kept in the correlation matrix ``R`` of the mean's metric
R_FLOOR = 0.05
#: the metric is used while the fit's prediction error is at most this share of h's variance
METRIC_GAIN = 0.5
#: rate of the average of the fit's whitened squared prediction error
NORM_RATE = 0.1
#: predictions of new draws the fit is judged on before it is used
CHECKS = 5
#: a prediction error this many times both its running average and h's variance over the
#: window is a break (the data or the model moved): the memory restarts from the new draw
BREAK = 100.0


class DrawCurvature:
    """The exponentially weighted moments of ``(u_t, h_t)`` of one diagonal Gaussian, and
    the averaged squared norms that decide whether the fit is used."""

    def __init__(self, dim: int, min_draws: Optional[int] = None, checks: int = CHECKS) -> None:
        self.dim = dim
        #: draws in the fit's memory (``1 / (1 - forget)``)
        self.window = 2 * dim + 10
        self.forget = 1.0 - 1.0 / self.window
        #: no fit is made from fewer draws (default: ``window``); predictions judged first
        self.min_draws = self.window if min_draws is None else max(dim + 1, min_draws)
        self.checks = checks
        #: whether the last step used the fit; whether the fit was ever used
        self.active, self.started = False, False
        self.restart()

    def restart(self) -> None:
        """Forget every draw (the fit is rebuilt from the next ``min_draws``)."""
        dim = self.dim
        self.n = 0
        z = torch.zeros(dim, dtype=torch.float64, device="cpu")  # (moved by the first add)
        zz = torch.zeros(dim, dim, dtype=torch.float64, device="cpu")
        self.w, self.u, self.h, self.uu, self.hu = 0.0, z, z.clone(), zz, zz.clone()
        self.hh = z.clone()
        self.error, self.checked = 0.0, 0

    def fit(self, s: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(A, c)`` (``A`` symmetric, ``d x d``) from the moments so far, whitened by the
        current scales ``s`` for the solve; ``None`` before ``min_draws`` draws or when
        singular."""
        if self.n < self.min_draws:
            return None
        ubar, hbar = self.u / self.w, self.h / self.w
        suu = self.uu / self.w - torch.outer(ubar, ubar)
        shu = self.hu / self.w - torch.outer(hbar, ubar)
        # A = shu suu^-1 = shu D^-1 (D^-1 suu D^-1)^-1 D^-1, D = diag(s): whitened for the solve
        white = suu / torch.outer(s, s)
        white = 0.5 * (white + white.mT)
        ridge = 1e-8 * float(white.diagonal().mean()) + 1e-300
        chol, info = torch.linalg.cholesky_ex(
            white + ridge * torch.eye(self.dim, dtype=s.dtype, device=s.device)
        )
        if int(info) != 0:
            return None
        a = torch.cholesky_solve((shu / s).mT, chol).mT / s
        a = 0.5 * (a + a.mT)
        c = hbar - a @ ubar
        return (a, c) if bool(torch.isfinite(a).all() and torch.isfinite(c).all()) else None

    def add(self, u: torch.Tensor, h: torch.Tensor) -> None:
        f = self.forget
        self.n += 1
        self.w = f * self.w + 1.0
        if self.u.device != u.device:  # (the accumulators follow the draws' device)
            self.u, self.h, self.hh = self.u.to(u.device), self.h.to(u.device), self.hh.to(u.device)
            self.uu, self.hu = self.uu.to(u.device), self.hu.to(u.device)
        self.u = f * self.u + u
        self.h = f * self.h + h
        self.uu = f * self.uu + torch.outer(u, u)
        self.hu = f * self.hu + torch.outer(h, u)
        self.hh = f * self.hh + h * h

    def gains(self, error: torch.Tensor, s: torch.Tensor) -> Tuple[bool, bool]:
        """Record the fit's prediction error ``h - (A u + c)`` at the new draw (before
        :meth:`add`); ``(use the control variate, use the metric)``, from its whitened squared
        norm's average against ``h``'s whitened variance over the window."""
        r = NORM_RATE
        white = float((s * error).pow(2).sum())
        var = (self.hh / self.w - (self.h / self.w).pow(2)).clamp_min(0.0)
        total = float((s * s * var).sum())
        if self.checked >= self.checks and white > BREAK * max(self.error, total, 1e-300):
            self.restart()  # (a break: the fit's memory is of another posterior)
            return False, False
        self.checked += 1
        self.error = white if self.checked == 1 else (1 - r) * self.error + r * white
        if self.checked < self.checks:  # the fit is judged on that many predictions first
            return False, False
        return self.error < total, self.error < METRIC_GAIN * total

    def state(self) -> Dict:
        keys = ("n", "w", "u", "h", "uu", "hu", "hh", "error", "checked", "started")
        keys += ("min_draws", "checks")
        return {k: getattr(self, k) for k in keys}

    def load(self, state: Dict) -> None:
        for k, v in state.items():
            setattr(self, k, v.clone() if torch.is_tensor(v) else v)


def correlation_metric(
    a: torch.Tensor,
) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(V, lam)``: the eigen-decomposition of ``R``, the correlation matrix of ``a``, with
    eigenvalues clipped at ``R_FLOOR``; ``None`` where a diagonal entry of ``a`` is not
    positive."""
    d = a.diagonal()
    if not bool((d > 0).all()):
        return None
    r = a / torch.outer(d.sqrt(), d.sqrt())
    r = 0.5 * (r + r.mT)
    r.diagonal().fill_(1.0)
    lam, v = torch.linalg.eigh(r)
    return v, lam.clamp_min(R_FLOOR)


def reparameterised(
    m: torch.Tensor,
    s: torch.Tensor,
    gm: torch.Tensor,
    gs: torch.Tensor,
    u: torch.Tensor,
    dtype: torch.dtype,
) -> bool:
    """Whether the gradients are the reparameterised ones of this draw: ``dl/ds_i = h_i eps_i
    - 1 / s_i`` with ``h = dl/dm`` (Trace_ELBO's; not where a KL term is analytic, as in
    TraceMeanField_ELBO, or a score-function term enters), up to ``dtype``'s round-off."""
    eps = (u - m) / s
    lhs, rhs = gs + 1.0 / s, gm * eps
    size = gs.abs() + 1.0 / s + rhs.abs()
    tol = 1e3 * torch.finfo(dtype).eps
    return bool(torch.isfinite(eps).all() and ((lhs - rhs).abs() <= tol * size).all())


def diag_with_draw(
    m: torch.Tensor,
    s: torch.Tensor,
    gm: torch.Tensor,
    gs: torch.Tensor,
    u: torch.Tensor,
    curv: DrawCurvature,
):
    """``(dl/dm, dl/ds, precondition)`` for :func:`pyro_cvi.gaussian.steps.diag_step`: the
    gradients with the control variates, and the mean's metric as a callable (``None``: the
    plain diagonal step), from the fit before this draw; the draw is then added to it."""
    dtype, shape = m.dtype, m.shape
    m64, s64, gm64, gs64, u64 = (t.detach().double().reshape(-1) for t in (m, s, gm, gs, u))
    curv.active = False
    if not reparameterised(m64, s64, gm64, gs64, u64, m.dtype):
        return gm, gs, None
    fitted = curv.fit(s64)
    if fitted is None:
        curv.add(u64, gm64)
        return gm, gs, None
    a, c = fitted
    use_cv, use_metric = curv.gains(gm64 - (a @ u64 + c), s64)
    curv.add(u64, gm64)
    du = u64 - m64
    eps = du / s64
    gm_cv = gm64 - a @ du
    gs_cv = gs64 - eps * (a @ u64 + c - a.diagonal() * du) - s64 * a.diagonal() * (eps * eps - 1)
    if not use_cv:
        return gm, gs, None
    curv.active = True
    gm_out = gm_cv.to(dtype).reshape(shape)
    gs_out = gs_cv.to(dtype).reshape(shape)
    eig = correlation_metric(a) if use_metric else None
    if eig is None:
        return gm_out, gs_out, None
    v, lam = eig

    def precondition(p_new: torch.Tensor, g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(M^-1 g, sqrt(diag M^-1))`` for ``M = P'^1/2 R P'^1/2``."""
        root = p_new.detach().double().reshape(-1).rsqrt()
        x = v @ ((v.mT @ (root * g.double().reshape(-1))) / lam)
        sd = root * ((v * v) @ (1.0 / lam)).sqrt()
        return (root * x).to(dtype).reshape(shape), sd.to(dtype).reshape(shape)

    return gm_out, gs_out, precondition


def tril_reparameterised(
    m: torch.Tensor,
    L: torch.Tensor,
    gm: torch.Tensor,
    gL: torch.Tensor,
    u: torch.Tensor,
    dtype: torch.dtype,
) -> Optional[torch.Tensor]:
    """``eps = L^-1 (u - m)`` where the gradients are the reparameterised ones of the draw
    ``u = m + L eps`` of ``N(m, L L^T)``: ``dl/dL = tril(h eps^T) - diag(1 / L_ii)`` with
    ``h = dl/dm`` (Trace_ELBO's), up to ``dtype``'s round-off; else ``None``."""
    eps = torch.linalg.solve_triangular(L, (u - m).unsqueeze(-1), upper=False).squeeze(-1)
    expect = torch.outer(gm, eps).tril() - torch.diag(1.0 / L.diagonal())
    # (round-off of the triangular solve is relative to the whole matrix, not per element)
    size = float(gL.abs().amax() + gm.abs().amax() * eps.abs().amax() + expect.abs().amax())
    tol = 1e3 * torch.finfo(dtype).eps
    ok = torch.isfinite(eps).all() and ((gL.tril() - expect).abs() <= tol * size).all()
    return eps if bool(ok) else None


def tril_with_draw(
    m: torch.Tensor,
    L: torch.Tensor,
    gm: torch.Tensor,
    gL: torch.Tensor,
    u: torch.Tensor,
    curv: DrawCurvature,
) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(dl/dm, G)`` for :func:`pyro_cvi.gaussian.steps.tril_step` of a full-covariance
    Gaussian ``N(m, L L^T)`` with one draw ``u = m + L eps``, from the fit ``h(u) ~ A u + c``
    made before this draw (the draw then enters it); ``None``: the plain step.

    Price's theorem gives the precision's target ``E_q[dh/du] = E_q[h eps^T] L^-1``; its
    one-draw estimate ``h eps^T L^-1`` is a Wishart-like draw around it. With the zero-mean
    control variates ``A (u - m)`` and ``(A u + c) eps^T - A L``::

        dl/dm = h - A (u - m),    G = 2 dl/dS = sym((h - A u - c) eps^T L^-1) + A - S^-1

    (unbiased for any ``A`` fixed before the draw; where the posterior is Gaussian,
    ``h = A u + c`` exactly and both are the exact expected gradients)."""
    dtype, shape = m.dtype, m.shape
    m64, gm64, u64 = (t.detach().double().reshape(-1) for t in (m, gm, u))
    L64, gL64 = L.detach().double(), gL.detach().double()
    curv.active = False
    eps = tril_reparameterised(m64, L64, gm64, gL64, u64, dtype)
    if eps is None:
        return None
    s = L64.pow(2).sum(-1).sqrt()  # marginal standard deviations: the fit's whitening
    fitted = curv.fit(s)
    if fitted is None:
        curv.add(u64, gm64)
        return None
    a, c = fitted
    r = gm64 - (a @ u64 + c)
    use_cv, _ = curv.gains(r, s)
    curv.add(u64, gm64)
    if not use_cv:
        return None
    curv.active = True
    eye = torch.eye(curv.dim, dtype=torch.float64, device=L64.device)
    lower_inv = torch.linalg.solve_triangular(L64, eye, upper=False)
    hess = torch.outer(r, eps) @ lower_inv
    G = 0.5 * (hess + hess.mT) + a - lower_inv.mT @ lower_inv
    gm_cv = gm64 - a @ (u64 - m64)
    return gm_cv.to(dtype).reshape(shape), G.to(dtype)
