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

import torch

__all__ = ["SVIScaling", "SiteScalingForm"]


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


class SiteScalingForm:
    """``scale_sites`` for the data-site forms of :class:`CVIVariationalStrategy` (mixed in)."""

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
