"""The Markov block's short path for its commonest problem: a Gaussian process observed through
its first state coordinate, one row per step, fixed hyperparameters.

The same numbers as the general path of :mod:`.markov` (bit for bit), from less work per step:

* the smoother takes the rows ``(b, w)`` directly
  (:func:`~pyro_cvi.statespace.first_sites.marginals`), the prior's transition rows kept while
  the prior is the same object with the same tensors (identity and version counters; the
  cache holds them, so no identity is reused);
* the factor's message reads its likelihood's weights, observations and closed-form
  expectation once per trace and offsets (:class:`MessagePlan`, from their second step: a
  trace that changes every step keeps the general message), where the expectation is in
  closed form, the linear predictor has no graph and is finite, and no Monte Carlo is asked;
* ``E_q[f_t]``, ``Var_q[f_t]`` are read off the marginals (``f_t = x_{t,0}``).

Anything else (several factors, a start offset, lag-one covariances, a graph, a chain past
``kalman.FIRST_SITES_MAX_T``, a failed pass) takes the general path, which decides as before.
"""

from __future__ import annotations

from operator import is_
from typing import Any, Optional, Tuple

import torch

from ..gaussian.price import site_natural_params
from ..messages.gaussian import (
    RowBlock,
    _closed_form,
    _flat_obs,
    _weight,
    linear_predictor_message,
    poisson_expectation,
)
from ..model.tracing import has_learnable_params, linear_param, unwrap
from ..statespace import first_sites
from ..statespace.kalman import FIRST_SITES_MAX_T, LinearGaussianChain, Marginals
from ..statespace.posterior import SiteRows

__all__ = ["on_first", "FastPath", "MessagePlan", "expected_log_sites", "site_rows"]

_UNREAD = object()  # (a site seen once: its plan is read when it is seen again)

# the constants of the short path's element-wise arithmetic as 0-dim tensors: the same numbers
# as Python's (a CPU scalar operand is read in the other operand's dtype either way), without
# wrapping a Python number into a tensor at every operation
_HALF, _NEG_HALF, _TWO = (torch.tensor(v, dtype=torch.float64) for v in (0.5, -0.5, 2.0))
_BY_DTYPE: dict = {torch.float64: (_HALF, _NEG_HALF, _TWO)}


def _halves(dtype: torch.dtype) -> tuple:
    """``(0.5, -0.5, 2)`` as 0-dim tensors of ``dtype``: a factor of one scalar observation has
    0-dim moments, with which a float64 constant would promote a float32 message."""
    kept = _BY_DTYPE.get(dtype)
    if kept is None:
        kept = _BY_DTYPE[dtype] = tuple(torch.tensor(v, dtype=dtype) for v in (0.5, -0.5, 2.0))
    return kept


def expected_log_sites(sr: SiteRows, f_mean: torch.Tensor, f_var: torch.Tensor) -> torch.Tensor:
    """:meth:`~pyro_cvi.statespace.posterior.SiteRows.expected_log_sites`, the same operations
    (``f**2`` is ``f * f`` in torch's kernel)."""
    return (sr.b * f_mean - _HALF * sr.w * (f_var + f_mean * f_mean)).sum()


def site_rows(sites: torch.Tensor, c: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`~pyro_cvi.gaussian.sites.site_to_row` of sites ``(R, 2)``: ``-2 lam2`` is
    ``-(2 lam2)`` bit for bit, so ``2 lam2`` is taken once."""
    lam1, lam2 = sites.unbind(-1)
    two_lam2 = _TWO * lam2
    return -two_lam2, lam1 + two_lam2 * c


def on_first(t: torch.Tensor, H: torch.Tensor, length: int) -> bool:
    """Whether rows ``(t, H)`` are one per step, in order, each on the first coordinate
    (``h_r = e_1``) of states of ``d <= 2``: then ``eta_t = (b_t, 0)``, ``J_t = diag(w_t, 0)``
    bit for bit."""
    R, d = H.shape
    if R != length or d > 2 or t.shape[0] != length:
        return False
    if not bool((t == torch.arange(length, device=t.device)).all()):
        return False
    return bool((H[:, 0] == 1).all()) and (d == 1 or not bool(H[:, 1].any()))


class MessagePlan:
    """What a factor's closed-form message reads from its trace site, once: the shape of its
    linear predictor, the weights and observations (masked entries zero), the expectation.
    A Poisson factor with unit weights keeps ``log y!`` too, and its expectation
    (:func:`~pyro_cvi.messages.gaussian.poisson_expectation`) drops the unit weights: the same
    numbers (``1 * x = x``)."""

    __slots__ = ("shape", "flat", "weight", "y", "closed", "log_y_factorial")

    def __init__(self, shape, weight, y, closed, log_y_factorial=None):
        self.shape, self.weight, self.y, self.closed = shape, weight, y, closed
        self.flat = len(shape) == 1  # (the rows' own layout: no reshapes)
        self.log_y_factorial = log_y_factorial

    @staticmethod
    def build(site, rows: RowBlock) -> Optional[MessagePlan]:
        base = unwrap(site["fn"])[0]
        closed = _closed_form(base, rows)
        if closed is None:
            return None
        eta_now = linear_param(base, rows.param, rows.link)[1]
        if eta_now.requires_grad or has_learnable_params(base, rows.param, rows.link):
            return None
        if not bool(torch.isfinite(eta_now).all()):
            return None  # (the general path's ``eta - eta.detach()`` is then not zero)
        weight = _weight(site, eta_now)
        y = _flat_obs(site, eta_now, weight)
        lgy = None
        if closed is poisson_expectation and bool((weight == 1).all()):
            lgy = torch.lgamma(y + 1)
        return MessagePlan(eta_now.shape, weight, y, closed, lgy)

    def message(self, rows: RowBlock, f_mean: torch.Tensor, f_var: torch.Tensor):
        """:func:`~pyro_cvi.messages.gaussian.linear_predictor_message`'s ``(value, target)``."""
        mean, var = f_mean + rows.c, f_var
        if not self.flat:
            mean, var = mean.reshape(self.shape), var.reshape(self.shape)
        if self.log_y_factorial is not None:  # (site_natural_params inlined: the same ops)
            y = self.y
            half, neg_half, two = _halves(mean.dtype)
            rate = torch.exp(mean + half * var)
            f, gm, gv = y * mean - rate - self.log_y_factorial, y - rate, neg_half * rate
            lam1, lam2 = gm - two * gv * mean, gv
        else:
            f, gm, gv = self.closed(self.weight, self.y, mean, var)
            lam1, lam2 = site_natural_params(mean, gm, gv)
        if not self.flat:
            lam1, lam2 = lam1.reshape(-1), lam2.reshape(-1)
        return f.sum(), torch.stack([lam1, lam2], -1)


class FastPath:
    """One Markov block's caches for the short path (module docstring)."""

    def __init__(self) -> None:
        #: ``(the prior's tensors, their versions, transition rows)`` of the last prior solved
        self._prior: Optional[Tuple[tuple, tuple, Any]] = None
        self._plans: dict = {}

    def solve(self, prior: LinearGaussianChain, sr: SiteRows) -> Optional[Marginals]:
        """The marginals of ``q = prior x sites`` for rows flagged :func:`on_first`, or
        ``None`` (the general path)."""
        T, d = sr.length, sr.H.shape[-1]
        if T > FIRST_SITES_MAX_T.get(d, 0) or sr.w.requires_grad or sr.b.requires_grad:
            return None
        rows = self._rows(prior)
        if rows is None:
            return None
        out = first_sites.marginals(rows, sr.b, sr.w)
        return None if out is None else Marginals(*out)

    def _rows(self, prior: LinearGaussianChain):
        tensors = prior.tensors()  # (a chain object may be rebuilt around the same tensors)
        versions = tuple(t._version for t in tensors)
        hit = self._prior
        if hit is not None and hit[1] == versions and all(map(is_, hit[0], tensors)):
            return hit[2]
        if not first_sites.applies(prior):
            return None
        rows = first_sites.transitions(prior)
        self._prior = (tensors, versions, rows)
        return rows

    def message(self, site, rows: RowBlock, f_mean, f_var, num_points: int, num_samples):
        """The factor's ``(value, target)``: by its plan where it has one, else by
        :func:`~pyro_cvi.messages.gaussian.linear_predictor_message`."""
        plan = None
        if num_samples is None:  # (kept with the site and offsets it was read for)
            name = site["name"]
            hit = self._plans.get(name)
            if hit is None or hit[0] is not site or hit[1] is not rows.c:
                self._plans[name] = (site, rows.c, _UNREAD)  # (read if they come again:
            elif hit[2] is _UNREAD:  # a trace that changes every step never pays for it)
                plan = MessagePlan.build(site, rows)
                self._plans[name] = (site, rows.c, plan)
            else:
                plan = hit[2]
        if plan is None:
            return linear_predictor_message(site, rows, f_mean, f_var, num_points, num_samples)
        return plan.message(rows, f_mean, f_var)
