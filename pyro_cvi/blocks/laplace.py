"""The Laplace start of a Gaussian block's linear-predictor sites, when one Newton step is not
enough.

The warm start (:func:`~pyro_cvi.messages.gaussian.warm_start_target`) puts each site at its
target for a point mass at the prior mean: one Newton step on the log joint
``L(m) = log N(m; m0, S0) + sum_n log p(y_n | a_n^T m + c_n)``. Where the likelihood is far
from quadratic on the prior's scale (Poisson counts in the hundreds under a vague prior) that
step overshoots: ``exp(a_n^T m)`` overflows and the first ``q`` is useless. Then the step is
damped (halved until ``L`` does not decrease, Newton with backtracking) and repeated to the
mode ``m*``, and the sites are the point-mass targets at ``m*``: ``q`` starts at the Laplace
approximation (its precision is ``-hess L(m*)``). Where the one step already increases ``L``
(logistic regressions: a1a, australian) nothing changes.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from ..linear_gaussian import GaussianPrior
from ..messages.gaussian import linear_predictor_point_value, warm_start_target
from ..update import MAX_HALVINGS_SOLVE

__all__ = ["LaplaceStart"]

#: Newton iterations at most (each a solve of the block's linear regression)
MAX_NEWTON = 50


def _prior_log_density(prior: GaussianPrior, m: torch.Tensor) -> torch.Tensor:
    """``-(m - m0)^T S0^-1 (m - m0) / 2`` (the constant left out)."""
    d = m - prior.loc.detach()
    if prior.cov is not None:
        L = prior.cov_cholesky().detach()
        u = torch.linalg.solve_triangular(L, d.unsqueeze(-1), upper=False).squeeze(-1)
        return -0.5 * (u * u).sum()
    return -0.5 * d @ (prior.precision_matrix().detach() @ d)


def _log_joint(block, trace, m: torch.Tensor) -> torch.Tensor:
    """``L(m)``: the prior, the conjugate rows and the linear-predictor factors at ``z = m``."""
    total = _prior_log_density(block.prior, m)
    for name, r in block.rows:
        f = r.A @ m
        if name is None:  # a conjugate row exp(b f - w f^2 / 2)
            total = total + (r.b * f - 0.5 * r.w * f * f).sum()
        else:
            site = trace.nodes[name]
            total = total + linear_predictor_point_value(site, r, f)
    return total.detach()


def _targets_at(block, trace, m: torch.Tensor) -> Optional[Dict[str, torch.Tensor]]:
    out = {}
    for name, r in block.rows:
        if name is not None:
            t = warm_start_target(trace.nodes[name], r, r.A @ m, block.options.num_quad_points)
            if t is None:
                return None
            out[name] = t
    return out


class LaplaceStart:
    """Mixin of :class:`~pyro_cvi.blocks.gaussian.GaussianBlock`: its :meth:`damped_start`."""

    def damped_start(self, ctx) -> bool:
        """If the warm-started ``q``'s mean lowers ``L`` below its value at the prior mean (or is
        not finite), move the sites to the point-mass targets at the mode of ``L`` (module
        docstring). Returns whether the sites were moved. Blocks with softmax or general factors,
        or split over data-parallel ranks, keep the one-step start."""
        if (
            self.softmax
            or self.general
            or self.minibatch
            or self.options.reducer is not None
            or not self.linear
        ):
            return False
        trace = ctx.trace
        with torch.no_grad():
            m = self.prior.loc.detach().clone()
            best = _log_joint(self, trace, m)
            one_step = _log_joint(self, trace, self.post.loc.detach())
            if not bool(torch.isfinite(best)) or (
                bool(torch.isfinite(one_step)) and bool(one_step >= best)
            ):
                return False
            moved = False
            for _ in range(MAX_NEWTON):
                targets = _targets_at(self, trace, m)
                if targets is None:
                    break
                step = self._solve(site_values=targets).loc.detach() - m
                t, accepted = 1.0, False
                for _ in range(MAX_HALVINGS_SOLVE):
                    value = _log_joint(self, trace, m + t * step)
                    if bool(torch.isfinite(value)) and bool(value >= best):
                        accepted = True
                        break
                    t *= 0.5
                if not accepted:
                    break
                gain = float(value - best)
                m, best, moved = m + t * step, value, True
                if gain <= 1e-8 * (1.0 + abs(float(best))):
                    break
            targets = _targets_at(self, trace, m) if moved else None
            if targets is None:
                return False
            sites = self._sites()
            for name, t in targets.items():
                sites[name].data.copy_(t)
        return True
