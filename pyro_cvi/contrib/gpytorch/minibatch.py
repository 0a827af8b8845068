"""Minibatch CVI steps on the data sites with the SVI scaling of Khan & Lin 2017, eq. 14.

A minibatch ``B`` of the ``N`` training points gives the targets ``g_n`` of its sites only. By
default (:class:`CVIOptimizer` without ``minibatch=``) the batch's sites move towards their
targets and every other site is kept: the sum of the sites is exact once every site is fresh,
but a site keeps the target of the q at its last visit, and those stale sites converge at about
the rate of full-batch passes. Eq. 14 (the paper's doubly stochastic CVI) instead decays every
site and adds the batch's targets scaled to the whole data set::

    lam_n <- (1 - beta_t) lam_n + beta_t (N / B) g_n 1[n in B],     beta_t = c / (t + c),

so the sum of the sites is a running average of the unbiased estimates ``(N / B) sum_B g_n``,
weighted towards recent q (``c`` sets the window; ``c = 1`` is the plain average). A site then
no longer is its point's own pseudo-observation; the sum is what q uses. The decay is O(N) on
the buffers and O(M^2) on the sparse form's running sums (they are linear in the sites); the
batch costs O(B M^2) as before.
"""

from __future__ import annotations

import torch

__all__ = ["SVIScaling", "SiteScalingForm"]


class SVIScaling:
    """The step sizes ``beta_t = c / (t + c)``, ``t = 0, 1, ...`` of eq. 14 (module docstring).

    :param c: the averaging window, ``> 0``. Default 3: on the problem of
        ``scripts/benchmark_sparse_minibatch.py`` (N = 20,000, M = 200, B = 1,024, 30 steps,
        two sequences of permutations other than the benchmark's) ``c = 1, 2, 3, 4`` ended 55,
        18-20, 13-14.5 and 14-16 nats above the full-batch optimum, against 43.5 with the
        batch's sites set to their targets (the benchmark's own permutations, ``c = 3``: 14.5
        against 42.3).
    """

    def __init__(self, c: float = 3.0):
        if not float(c) > 0:
            raise ValueError(f"SVIScaling: c must be > 0, got {c}")
        self.c = float(c)
        self.num_steps = 0

    def next_beta(self) -> float:
        """``beta_t`` of the next step (and count it)."""
        beta = self.c / (self.num_steps + self.c)
        self.num_steps += 1
        return min(1.0, beta)


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
