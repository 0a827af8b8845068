"""Minibatch CVI steps on the data sites with the SVI scaling of Khan & Lin 2017, eq. 14.

A minibatch ``B`` of the ``N`` training points gives the targets ``g_n`` of its sites only. By
default (:class:`CVIOptimizer` without ``minibatch=``) the batch's sites move towards their
targets and every other site is kept: the sum of the sites is exact once every site is fresh,
but a site keeps the target of the q at its last visit, and those stale sites converge at about
the rate of full-batch passes. Eq. 14 (the paper's doubly stochastic CVI) instead decays every
site and adds the batch's targets scaled to the whole data set::

    lam_n <- (1 - beta_t) lam_n + beta_t (N / B) g_n 1[n in B],

so the sum of the sites is a running average of the unbiased estimates ``(N / B) sum_B g_n``
(over uniformly random batches their mean is the full-batch target ``sum_n g_n`` at the same
q), with the step sizes ``beta_t`` of :class:`SVIScaling` (a warm-up, then ``~ c / t``). A
site then no longer is its point's own pseudo-observation; the sum is what q uses. The decay
is O(N) on the buffers and O(M^2) on the sparse form's running sums (they are linear in the
sites); the batch costs O(B M^2) as before.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from .posterior import SiteSums, site_sums

__all__ = ["SVIScaling", "SiteMemoryScaling", "SiteScalingForm"]

#: a loaded memory's version: it belongs to whatever sites the strategy has at the next step
_ADOPT = object()


class SVIScaling:
    """The step sizes ``beta_t`` of eq. 14 (module docstring), ``t = 0, 1, ...``::

        beta_t = 1                              for t < w   (warm-up),
        beta_t = c / (t - w + 1 + c)            for t >= w,

    so the sum of the sites is the latest batch's estimate during the warm-up, then a running
    average of the later estimates (``c = 1``: the plain average from step ``w - 1`` on; larger
    ``c`` weights recent q more). The first estimates come from a q far from the optimum; a
    warm-up lets them go, and the plain-ish average after it keeps the noise of the
    ``(N / B)``-scaled estimates low (an average over about an epoch of batches drawn without
    replacement has almost no sampling noise left). ``beta_t -> 0`` like ``1 / t``: Robbins-Monro.

    :param c: the averaging window, ``> 0``. Default 1.5.
    :param warmup: ``w``, the number of leading steps with ``beta = 1``; ``>= 0``. Default 4.
        ``warmup=0`` gives ``c / (t + 1 + c)``; the earlier rule ``c / (t + c)`` is
        ``SVIScaling(c, warmup=1)``.

    On the problem of ``scripts/benchmark_sparse_minibatch.py`` (N = 20,000, M = 200, B = 1,024,
    30 steps) the defaults end 7.3-8.6 nats above the full-batch optimum over four sequences of
    permutations, against 14.5-16.3 for ``c / (t + c)`` with ``c = 3`` and 40-43 with the batch's
    sites set to their targets (no scaling).
    """

    def __init__(self, c: float = 1.5, warmup: int = 4):
        if not float(c) > 0:
            raise ValueError(f"SVIScaling: c must be > 0, got {c}")
        if int(warmup) != warmup or warmup < 0:
            raise ValueError(f"SVIScaling: warmup must be an integer >= 0, got {warmup}")
        self.c = float(c)
        self.warmup = int(warmup)
        self.num_steps = 0

    def beta(self, t: int) -> float:
        """``beta_t`` (class docstring)."""
        if t < self.warmup:
            return 1.0
        return min(1.0, self.c / (t - self.warmup + 1 + self.c))

    def next_beta(self) -> float:
        """``beta_t`` of the next step (and count it)."""
        beta = self.beta(self.num_steps)
        self.num_steps += 1
        return beta

    def state_dict(self) -> dict:
        """What a reload needs to go on exactly: the step count ``t`` of ``beta_t``."""
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])

    def apply(self, strategy, indices: Tensor, target: tuple, num_data: int) -> None:
        """One step of eq. 14 on ``strategy``'s data sites: every site times ``1 - beta_t``, the
        batch's sites plus ``beta_t (N / B) g``."""
        beta, scale = self.next_beta(), num_data / target[0].shape[-1]
        strategy.scale_sites(1.0 - beta)
        new1 = strategy.site_lam1[indices] + beta * scale * target[0]
        new2 = strategy.site_lam2[indices] + beta * scale * target[1]
        strategy.set_sites(new1, new2.clamp_max(0.0), indices)


class SiteMemoryScaling(SVIScaling):
    """Eq. 14 for the points not yet seen, each point's own latest target for the others.

    The sites are per point, so a point's target ``g_n`` (computed when its batch was stepped)
    can stand for it until it is seen again: the sum over those targets has no sampling noise,
    where eq. 14's ``(N / B)``-scaled batch sums have plenty (one batch of 1,024 of 20,000
    points is some 300 nats from the optimum at the optimal q). Targets from the first steps
    come from a q far from the optimum, so only those of steps ``t >= warmup`` are kept
    (the set ``K``); the rest of the data is filled in by eq. 14's running average ``e``
    (:class:`SVIScaling`, same ``c`` and ``warmup``), in proportion::

        eta_t = sum_{n in K} g_n + (1 - |K| / N) sum_n e_n,
        e_n <- (1 - beta_t) e_n + beta_t (N / B) g_n 1[n in B].

    Over uniformly random batches both terms are unbiased for their part of the full-data
    natural parameter ``sum_n g_n`` when the targets do not depend on q (a Gaussian
    likelihood); in general the estimate is consistent: once every point has been seen after
    the warm-up, ``|K| = N`` and ``eta`` is the sum of every point's latest target, whose fixed
    point is the full-batch one (each site equal to its target at q). Each step costs
    O(B M^2 + N) on top of the batch (the two running sums are linear in the sites); a change
    of the hyperparameters recomputes them, O(N M^2), once.

    **Refresh** (``refresh=True``, the default). A kept target is stale: it was taken at the q
    of its point's last visit, and q's mean moves most in the first epochs. With ``g_n = (d_n -
    2 c_n m_n, c_n)`` for ``d_n = df/dm``, ``c_n = df/dv`` of ``f = E_q[log p(y_n | f_n)]``
    (eqs. 30-31), a kept point outside the batch whose mean moved by more than ``refresh_tol``
    of its standard deviation since its linear part was taken gets, after each step, the linear
    part at q's current mean ``m_n`` and the variance ``v_n`` of its last visit, that visit's
    curvature kept::

        g1_n <- d_n(m_n, v_n) - 2 c_n m_n,      g2_n = c_n  (unchanged),

    unless the curvature at ``(m_n, v_n)`` exceeds :attr:`GROWTH` (2) times the kept ``c_n``
    (too little curvature for the fresh gradient would overshoot: a Poisson GP's grows like
    ``exp(m)``); such a point keeps its site until its next visit.

    (Linearised in ``m_n`` this is the old ``g1_n``: the site is the expected log-likelihood's
    local quadratic, and only its non-quadratic part moves it.) The means of all N points are
    ``m0 + Phi^T m_v``, O(N M); the gradients one expected log-likelihood over the refreshed
    points; the kept linear sum ``Phi r`` changes by their rows, O(N M); the precision sums
    change at the batch's rows only. A Gaussian likelihood's targets do not depend on q and are
    unchanged; the fixed point is the full-batch one as before.

    The settings' measured gaps to the full-batch optimum are in ``docs/gp_results.md``
    (``scripts/benchmark_sparse_minibatch.py``).

    :param c: eq. 14's averaging window (:class:`SVIScaling`). Default 5 (3 without the
        refresh).
    :param warmup: steps with ``beta = 1`` whose targets are not kept. Default 2 (3 without
        the refresh: refreshed early targets are worth keeping sooner).
    :param refresh: re-target the kept linear parts at q's current mean after each step
        (above). Default ``True``; ``False`` is the rule without it. Steps given likelihood
        keyword arguments (``step(x, y, indices=..., **kwargs)``, which may be per point) do
        not refresh: the other points' arguments are unknown.
    :param refresh_tol: a kept point is refreshed when its mean moved by more than this many
        standard deviations (of its last visit) since its linear part was taken; ``0``: every
        kept point at every step. Default 0.3.
    """

    #: a kept point is refreshed only while its curvature at the current mean is at most this
    #: multiple of its kept one (else its kept site, consistent if stale, stays)
    GROWTH = 2.0

    def __init__(
        self, c: float = 5.0, warmup: int = 2, refresh: bool = True, refresh_tol: float = 0.3
    ):
        super().__init__(c, warmup)
        if not float(refresh_tol) >= 0:
            raise ValueError(f"SiteMemoryScaling: refresh_tol must be >= 0, got {refresh_tol}")
        self.refresh, self.refresh_tol = bool(refresh), float(refresh_tol)
        self._state: Optional[dict] = None
        self._batch: Optional[tuple] = None

    def observe(self, y: Tensor, mean: Tensor, var: Tensor, gradient: Callable) -> None:
        """The batch of the coming :meth:`apply` (called by ``CVIOptimizer.step``): its targets
        ``y``, its marginal means and variances under the current q, and ``gradient(m, v, y)``,
        the expected log-likelihood's gradients in the mean and the variance at
        ``q(f_n) = N(m_n, v_n)``."""
        self._batch = (y.detach(), mean.detach(), var.detach(), gradient)

    def _start(self, strategy) -> dict:
        """State from the strategy's current sites: all of them the eq. 14 part, none kept."""
        l1, l2 = strategy.site_lam1, strategy.site_lam2
        return {
            "e": (l1.clone(), l2.clone()),
            "mem": (torch.zeros_like(l1), torch.zeros_like(l2)),
            "kept": torch.zeros(l1.shape, dtype=torch.bool, device=l1.device),
            "var": torch.full_like(l1, float("nan")),
            "mref": torch.full_like(l1, float("nan")),
            "y": None,
            "version": None,
            "sums": None,
        }

    def _refresh(self, strategy, st: dict, indices: Tensor, mem: tuple, kept: Tensor):
        """Overwrite ``mem[0]`` (the kept ``lam1``) of the kept points outside the batch whose
        mean moved by more than ``refresh_tol`` standard deviations since their linear part
        was taken by its target at q's current mean and the variance of their last visit
        (class docstring); store the batch's labels, means and variances. The refreshed rows
        and the change of their ``lam1``, or ``None``."""
        batch, self._batch = self._batch, None
        if not self.refresh or batch is None or batch[0].shape != indices.shape:
            return None
        y, mean_b, var, gradient = batch
        st["var"][indices] = var.to(st["var"])
        st["mref"][indices] = mean_b.to(st["mref"])
        if st["y"] is None:
            st["y"] = torch.zeros(kept.shape, dtype=y.dtype, device=y.device)
        st["y"][indices] = y
        due = kept & torch.isfinite(st["var"])
        due[indices] = False  # the batch's targets are already at the current q
        if not bool(due.any()):
            return None
        mean = strategy.site_means()
        near = (mean - st["mref"]).abs() <= self.refresh_tol * st["var"].clamp_min(0).sqrt()
        due &= ~near  # (a NaN reference mean: refreshed)
        if not bool(due.any()):
            return None
        rows = due.nonzero().squeeze(-1)
        mean = mean[rows]
        gm, gv = gradient(mean, st["var"][rows], st["y"][rows])
        # the kept curvature must not understate the new one by more than GROWTH: a Newton step
        # with too little curvature overshoots (a Poisson GP's grows like exp(m))
        keep = gv.to(mem[1]).clamp_max(0.0) >= self.GROWTH * mem[1][rows]
        if not bool(keep.all()):
            rows, mean, gm = rows[keep], mean[keep], gm[keep]
            if rows.numel() == 0:
                return None
        new = gm.to(mem[0]) - 2.0 * mem[1][rows] * mean
        delta = new - mem[0][rows]
        mem[0][rows], st["mref"][rows] = new, mean.to(st["mref"])
        return rows, delta

    def state_dict(self) -> dict:
        """The step count and the memory (``e``, the kept targets, which points are kept),
        detached copies: a reload into the optimizer of the reloaded model goes on exactly."""
        state = super().state_dict()
        st = self._state
        if st is not None:
            state["e"] = tuple(v.detach().clone() for v in st["e"])
            state["mem"] = tuple(v.detach().clone() for v in st["mem"])
            state["kept"] = st["kept"].clone()
            state["var"] = st["var"].detach().clone()
            state["mref"] = st["mref"].detach().clone()
            state["y"] = None if st["y"] is None else st["y"].clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        """The inverse of :meth:`state_dict`. The memory is taken to belong to the sites the
        strategy has at the next step (its running sums are recomputed then, once)."""
        super().load_state_dict(state)
        if "e" not in state:
            self._state = None
            return
        e, mem, kept = state["e"], state["mem"], state["kept"]
        if len(e) != 2 or len(mem) != 2 or not (e[0].shape == mem[0].shape == kept.shape):
            raise ValueError(
                "SiteMemoryScaling.load_state_dict: e, mem (pairs of [N] tensors) and kept "
                "([N] bool) must come from SiteMemoryScaling.state_dict()"
            )
        self._state = {
            "e": tuple(v.clone() for v in e),
            "mem": tuple(v.clone() for v in mem),
            "kept": kept.clone().bool(),
            "var": state["var"].clone() if "var" in state else torch.full_like(e[0], float("nan")),
            "mref": state["mref"].clone()
            if "mref" in state
            else torch.full_like(e[0], float("nan")),
            "y": None if state.get("y") is None else state["y"].clone(),
            "version": _ADOPT,
            "sums": None,
        }

    def apply(self, strategy, indices: Tensor, target: tuple, num_data: int) -> None:
        """One step (class docstring) on ``strategy``'s data sites at ``indices``."""
        st = self._state
        if st is not None and st["version"] is _ADOPT:
            if st["kept"].shape != strategy.site_lam1.shape:
                raise ValueError(
                    f"SiteMemoryScaling: the loaded memory has {tuple(st['kept'].shape)} points, "
                    f"the strategy {tuple(strategy.site_lam1.shape)}; load the state saved with "
                    "this training set"
                )
            like = strategy.site_lam1
            st = dict(st, version=strategy.site_version)
            st["e"] = tuple(v.to(like) for v in st["e"])
            st["mem"] = tuple(v.to(like) for v in st["mem"])
            st["kept"] = st["kept"].to(like.device)
            st["var"], st["mref"] = st["var"].to(like), st["mref"].to(like)
            st["y"] = None if st["y"] is None else st["y"].to(like.device)
        if st is None or st["version"] != strategy.site_version:
            st = self._start(strategy)  # first step, or the sites were set by someone else
        t = self.num_steps
        beta, scale = self.next_beta(), num_data / target[0].shape[-1]
        g1, g2 = target[0].to(strategy.site_lam1), target[1].to(strategy.site_lam1).clamp_max(0.0)
        e1, e2 = (v * (1.0 - beta) for v in st["e"])
        e1[indices] += beta * scale * g1
        e2[indices] += beta * scale * g2
        m1, m2, kept = st["mem"][0].clone(), st["mem"][1].clone(), st["kept"].clone()
        if t >= self.warmup:
            m1[indices], m2[indices], kept[indices] = g1, g2, True
        refreshed = self._refresh(strategy, st, indices, (m1, m2), kept)
        a = 1.0 - float(kept.sum()) / kept.numel()
        k = kept.to(m1)
        lam1, lam2 = k * m1 + a * e1, (k * m2 + a * e2).clamp_max(0.0)
        parts = strategy.site_parts_sums(
            st["sums"],
            indices,
            (st["mem"], (m1, m2)),
            (st["kept"].to(m1), k),
            (st["e"], (e1, e2)),
            1.0 - beta,
            refreshed,
        )
        strategy.write_sites_with_sums(lam1, lam2, parts, a)
        self._state = {
            "e": (e1, e2),
            "mem": (m1, m2),
            "kept": kept,
            "var": st["var"],
            "mref": st["mref"],
            "y": st["y"],
            "version": strategy.site_version,
            "sums": parts,
        }


def linear_sums(P: Tensor, d1: Tensor, d2: Tensor, m0: Tensor) -> Tuple[Tensor, Tensor]:
    """The change of :func:`~.posterior.site_sums` over the columns of ``P`` when the sites
    change by ``(d1, d2)`` (sites whose precisions stay >= 0: the sums are then linear in
    them), in one product each: ``P diag(-2 d2) P^T`` and ``P (d1 + 2 d2 m0)``."""
    dw = -2.0 * d2
    return (P * dw.unsqueeze(-2)) @ P.mT, P @ (d1 - dw * m0)


class SiteScalingForm:
    """``scale_sites`` for the data-site forms of :class:`CVIVariationalStrategy` (mixed in)."""

    @property
    def site_version(self) -> int:
        """Bumped by every write of the sites (a rule's state is valid for one version)."""
        return self._site_version

    def scale_sites(self, factor: float) -> None:
        """Multiply every site by ``factor`` in ``[0, 1]`` (eq. 14's ``1 - beta``); the sparse
        form's running sums are scaled with them (they are linear in the sites)."""
        if self.inducing_form:
            raise ValueError("scale_sites: the inducing-site form has no per-point sites.")
        if not 0.0 <= float(factor) <= 1.0:
            raise ValueError(f"scale_sites: factor must be in [0, 1], got {factor}")
        c = self._prior_cache
        sums = None if c is None or self.is_full else c[1].get("sums")
        current = sums is not None and sums.version == self._site_version
        with torch.no_grad():
            self.site_lam1.mul_(factor)
            self.site_lam2.mul_(factor)
        self._site_version += 1
        self._cache = None
        if current:
            sums.scale(float(factor))
            sums.version = self._site_version

    def site_parts_sums(
        self,
        previous,
        indices,
        mem: tuple,
        kept: tuple,
        e: tuple,
        decay: float,
        linear_rows: Optional[tuple] = None,
    ):
        """The running sums of the two parts of :class:`SiteMemoryScaling`'s sites, ``sum_K
        phi g phi^T`` (kept memory) and ``sum_n phi e phi^T``, updated by the batch (O(B M^2))
        when ``previous`` belongs to the current ``Phi``, recomputed otherwise (O(N M^2));
        ``None`` when the form keeps no running sums (full form, autograd on).
        ``linear_rows``: ``(rows, change)``, kept ``lam1`` changed outside the batch too (a
        refresh; their precisions unchanged), added to the kept linear sum ``sum_K phi r``
        (O(N M))."""
        sums = self._fresh_sums()
        if sums is None:
            return None
        (m_old, m_new), (k_old, k_new), (e_old, e_new) = mem, kept, e
        if previous is None or previous["phi"] is not sums.Phi:
            S_k, s_k = site_sums(sums.Phi, k_new * m_new[0], k_new * m_new[1], sums.prior_mean_X)
            S_e, s_e = site_sums(sums.Phi, e_new[0], e_new[1], sums.prior_mean_X)
            return {"phi": sums.Phi, "k": (S_k, s_k), "e": (S_e, s_e)}
        P, m0 = sums.Phi[..., indices], sums.prior_mean_X[..., indices]
        ko, kn = k_old[indices], k_new[indices]
        d_k = linear_sums(
            P,
            kn * m_new[0][indices] - ko * m_old[0][indices],
            kn * m_new[1][indices] - ko * m_old[1][indices],
            m0,
        )
        # e: every site times decay, then the batch's rows changed
        d_e = linear_sums(
            P,
            e_new[0][indices] - decay * e_old[0][indices],
            e_new[1][indices] - decay * e_old[1][indices],
            m0,
        )
        S_k, s_k = previous["k"][0] + d_k[0], previous["k"][1] + d_k[1]
        if linear_rows is not None:  # one product with Phi (a column gather costs more)
            change = torch.zeros_like(sums.prior_mean_X)
            change[..., linear_rows[0]] = linear_rows[1]
            s_k = s_k + sums.Phi @ change
        S_e, s_e = previous["e"][0] * decay + d_e[0], previous["e"][1] * decay + d_e[1]
        return {"phi": sums.Phi, "k": (S_k, s_k), "e": (S_e, s_e)}

    def site_means(self) -> Tensor:
        """The means of q(f_n) at every site's input, no graph: ``m0 + Phi^T m_v`` (O(N M)) for
        the sparse form, q's mean for the full form."""
        with torch.no_grad():
            post, extras = self._posterior()
            if self.is_full:
                return post.mean
            return extras["prior_mean_X"] + post.Phi.mT @ post.m_v

    def _fresh_sums(self) -> Optional[SiteSums]:
        """The sparse form's running sums, current for the present sites, or ``None``."""
        if self.is_full:
            return None
        with torch.no_grad():
            self._posterior()
        c = self._prior_cache
        sums = None if c is None else c[1].get("sums")
        if sums is None or sums.version != self._site_version:
            return None
        return sums

    def write_sites_with_sums(self, lam1: Tensor, lam2: Tensor, parts, a: float) -> None:
        """Write every site; with ``parts`` (:meth:`site_parts_sums`) the running sums become
        ``S_k + a S_e`` (the sites are ``kept g + a e``) instead of being recomputed."""
        sums = None if parts is None else self._fresh_sums()
        self.set_sites(lam1, lam2)  # checks; bumps the version
        if sums is not None and sums.Phi is parts["phi"]:
            sums.S = parts["k"][0] + a * parts["e"][0]
            sums.s = parts["k"][1] + a * parts["e"][1]
            sums.version, sums.updates = self._site_version, sums.updates + 1
