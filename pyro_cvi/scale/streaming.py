"""Streaming CVI: minibatches from a ``DataLoader``, N beyond memory, the incremental form.

For one Gaussian block whose data factors are linear-predictor (GLM likelihoods) or conjugate
Normal, ``q`` depends on the data only through the row statistics (eq. 2, Algorithm 1 step 4)::

    Lambda = Lambda0 + sum_b S_b,   Lambda m = Lambda0 m0 + sum_b s_b,
    S_b = sum_{n in b} a_n w_n a_n^T,   s_b = sum_{n in b} a_n b_n.

Sites exist only for the current minibatch ``b``: its rows ``a_n`` are read off a trace of the
model (Jacobians by autograd), its eq. 13 targets are computed by quadrature at the current q,
and its stored contribution is replaced (eq. 12 is linear in the sites, so the batch sum of the
per-point updates is the update of the batch sum)::

    S_b <- (1 - beta) S_b + beta T_b,     T_b = sum_{n in b} a_n w_n(target) a_n^T

(Conjugate Normal rows are exact and enter in full.) This is the incremental form (Neal &
Hinton's incremental EM): the global sums always hold every visited point's latest site, never
a rescaled minibatch. Memory: O(D^2) per minibatch for the stored statistics plus one
minibatch of data and sites; no O(N) state.

What is exact and what is stochastic:

* ``update="pass"``: ``q`` is held fixed during a pass and solved at its end. One pass is then
  exactly one full-batch CVI step (:class:`~pyro_cvi.AutoCVI` with ``init_sites="prior"`` and
  the same ``beta``), in any batch order; the ELBO reported for the pass is the exact ELBO of
  the ``q`` the pass started from.
* ``update="batch"`` (default): ``q`` is re-solved after every minibatch (a D x D Cholesky),
  so information spreads within a pass; the step uses stale sites of the other batches. After
  the first pass every point's site is in the sums, and a fixed point of these updates is the
  fixed point of full-batch CVI. Nothing here is random: with quadrature messages and a fixed
  batch order the run is deterministic. The only stochasticity would come from a shuffling
  loader, which is refused (the batch's position identifies its stored statistics).

Example::

    loader = DataLoader(TensorDataset(X, y), batch_size=50_000)   # shuffle=False
    stream = StreamingCVI(model, step_size=1.0)
    for _ in range(5):
        stream.run_pass(loader)
    stream.posterior()            # q(w), a MultivariateNormal
    stream.elbo(loader)           # the exact ELBO of q, one more pass
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, List, Optional

import pyro.poutine as poutine
import torch

from ..blocks.gaussian import block_prior
from ..gaussian.sites import site_to_row
from ..linear_gaussian import GaussianPosterior, GaussianPrior, row_statistics, solve_statistics
from ..messages.gaussian import linear_predictor_message, linear_predictor_rows, normal_rows
from ..model.analysis import CONJUGATE, LINEAR, NATURAL, PRIOR, Analysis, BlockSpec
from ..model.tracing import linear_param, trace_model, unwrap
from ..update import cvi_update
from .distributed import as_reducer

__all__ = ["StreamingCVI"]


class StreamingCVI:
    """Streaming CVI for a model whose one Gaussian block has only linear-predictor and
    conjugate Normal data factors (see the module docstring).

    :param model: a Pyro model called as ``model(*batch)`` (or ``model(**batch)`` for dicts).
    :param step_size: ``beta`` in (0, 1].
    :param update: ``"batch"`` (re-solve q after every minibatch) or ``"pass"`` (once per pass:
        exactly a full-batch CVI step).
    :param num_quad_points: Gauss-Hermite points of the linear-predictor messages.
    :param progress: show a tqdm bar per pass (off by default).
    :param init_sites: ``"laplace"`` (default): in the first pass each minibatch's sites start
        at the likelihood's curvature at the current mean (a Newton step; a vague prior and
        ``beta = 1`` can otherwise overshoot), as ``AutoCVI``'s default; ``"prior"``: they
        start at zero and the first pass takes the CVI step from ``q = prior``.
    :param process_group: data-parallel streaming (:mod:`pyro_cvi.scale.distributed`): each rank
        streams its own shard (the same number of minibatches on every rank); the statistics'
        changes are all-reduced per minibatch (``update="batch"``) or per pass.
    """

    def __init__(
        self,
        model,
        step_size: float = 1.0,
        update: str = "batch",
        num_quad_points: int = 32,
        progress: bool = False,
        init_sites: str = "laplace",
        process_group=None,
    ):
        if update not in ("batch", "pass"):
            raise ValueError(f"update must be 'batch' or 'pass', got {update!r}")
        if not 0.0 < step_size <= 1.0:
            raise ValueError(f"step_size must be in (0, 1], got {step_size}")
        self.model, self.beta, self.update = model, float(step_size), update
        if init_sites not in ("laplace", "prior"):
            raise ValueError(f"init_sites must be 'laplace' or 'prior', got {init_sites!r}")
        self.num_quad_points, self.progress = num_quad_points, progress
        self.init_sites = init_sites
        self.reducer = as_reducer(process_group)
        self.spec: Optional[BlockSpec] = None
        self.prior: Optional[GaussianPrior] = None
        self.post: Optional[GaussianPosterior] = None
        self.stats: List[List[torch.Tensor]] = []  # per batch: [S_lin, s_lin, S_conj, s_conj]
        self.keys: List[tuple] = []
        self.total: Optional[List[torch.Tensor]] = None
        self.num_passes = 0

    # ------------------------------------------------------------------ set-up
    def _setup(self, args, kwargs) -> None:
        proto = poutine.trace(self.model).get_trace(*args, **kwargs)
        an = Analysis(self.model, args, kwargs, proto)
        natural = [n for n, i in an.latents.items() if i.form == NATURAL]
        if len(an.blocks) != 1 or natural:
            raise ValueError(
                "StreamingCVI handles one Gaussian block (e.g. regression weights); this model "
                f"has blocks {[b.names for b in an.blocks]} and mean-field sites {natural}. "
                "Use AutoCVI for it."
            )
        spec = an.blocks[0]
        bad = [f.site for f in spec.factors if f.kind not in (PRIOR, CONJUGATE, LINEAR)]
        if bad:
            raise ValueError(
                f"StreamingCVI: factors {bad} of block {spec.label!r} are neither conjugate "
                "Normal nor linear-predictor (see AutoCVI(model).explain()); use AutoCVI."
            )
        self.spec = replace(spec, factors=[f for f in spec.factors if f.kind != PRIOR])
        self.z_at = spec.join(an.values).detach()
        self.prior = block_prior(spec, proto).detach()
        D = spec.dim
        self.total = [self.z_at.new_zeros(D, D), self.z_at.new_zeros(D)]
        self.post = solve_statistics(self.prior, *self.total)

    # ------------------------------------------------------------------ one minibatch
    def _rows(self, args, kwargs):
        """The batch's trace at the fixed point ``z_at`` and each data factor's rows ``A``.

        The factors are affine in ``z`` (confirmed by the analysis' probes), so
        ``A e_j = value(e_j) - value(0)``: D + 1 plain model runs, much cheaper than D
        backward passes over the batch, and exact up to rounding."""

        def values(z):
            tr = trace_model(self.model, self.spec.split(z), args, kwargs)
            out = []
            for f in self.spec.factors:
                base = unwrap(tr.nodes[f.site]["fn"])[0]
                v = base.loc if f.kind == CONJUGATE else linear_param(base, f.param, f.link)[1]
                out.append(v.detach().reshape(-1))
            return out

        zero = torch.zeros_like(self.z_at)
        at0 = values(zero)
        cols = [[] for _ in at0]
        for j in range(self.spec.dim):
            e = zero.clone()
            e[j] = 1.0
            for c, v, v0 in zip(cols, values(e), at0):
                c.append(v - v0)
        factors = [replace(f, jacobian=torch.stack(c, -1)) for f, c in zip(self.spec.factors, cols)]
        return trace_model(self.model, self.spec.split(self.z_at), args, kwargs), factors

    def _batch(self, args, kwargs, post: GaussianPosterior, cov: torch.Tensor, laplace=False):
        """``(ELBO terms of the batch under post, [S_lin, s_lin, S_conj, s_conj] targets)``;
        ``laplace``: the targets of a point mass at the mean (a Newton step, positive
        curvature clipped), as :class:`~pyro_cvi.AutoCVI`'s ``init_sites="laplace"``."""
        tr, factors = self._rows(args, kwargs)
        D = self.spec.dim
        stats = [cov.new_zeros(D, D), cov.new_zeros(D), cov.new_zeros(D, D), cov.new_zeros(D)]
        value = cov.new_zeros(())
        for f in factors:
            site, A = tr.nodes[f.site], f.jacobian
            f_mean = A @ post.loc
            f_var = ((A @ cov) * A).sum(-1)
            if f.kind == CONJUGATE:
                rows, fn = normal_rows(site, f, self.z_at)
                value = value + fn(f_mean, f_var).detach()
                S, s = row_statistics(A, rows.w, rows.b)
                stats[2], stats[3] = stats[2] + S, stats[3] + s
                continue
            rows = linear_predictor_rows(site, f, self.z_at, A.new_zeros(A.shape[0], 2))
            if laplace:
                f_var = torch.full_like(f_var, 1e-4)
            with torch.enable_grad():
                v, target = linear_predictor_message(
                    site, rows, f_mean, f_var, self.num_quad_points, None
                )
            value = value + v.detach()
            lam1, lam2 = target[:, 0], target[:, 1]
            if laplace:
                lam2 = lam2.clamp(max=0.0)
                lam1 = torch.where(lam2 == 0, torch.zeros_like(lam1), lam1)
            S, s = row_statistics(A, *site_to_row(lam1, lam2, rows.c))
            stats[0], stats[1] = stats[0] + S, stats[1] + s
        return value, stats

    # ------------------------------------------------------------------ passes
    def run_pass(self, loader: Iterable) -> float:
        """One pass over ``loader`` with the incremental update; returns the sum of the
        batches' expected log-likelihoods minus ``KL`` (the exact ELBO of the starting q for
        ``update="pass"``; a running estimate for ``update="batch"``)."""
        post = self.post
        value = None
        first = not self.stats
        self._check_lengths(loader)
        for i, (args, kwargs) in enumerate(self._batches(loader)):
            if self.spec is None:
                self._setup(args, kwargs)
                post = self.post
            key = _key(args, kwargs)
            if first:
                self.keys.append(key)
            elif i >= len(self.keys) or self.keys[i] != key:
                raise ValueError(
                    f"StreamingCVI: minibatch {i} differs from the one seen at that position in "
                    "the first pass. The incremental form keeps each minibatch's statistics by "
                    "position: use the same DataLoader with shuffle=False (or a fixed sampler)."
                )
            cov = post.covariance()
            laplace = first and self.init_sites == "laplace"
            v, target = self._batch(args, kwargs, post, cov, laplace)
            value = v if value is None else value + v
            old = self.stats[i] if not first else [torch.zeros_like(t) for t in target]
            b = 1.0 if laplace else self.beta
            new = list(cvi_update(old[:2], target[:2], b))  # eq. 12 on the statistics
            new += target[2:]  # conjugate rows: exact, in full
            if first:
                self.stats.append(new)
            else:
                self.stats[i] = new
            if self.update == "batch":
                delta = [new[0] + new[2] - old[0] - old[2], new[1] + new[3] - old[1] - old[3]]
                if self.reducer is not None:  # every rank's batch i, in one all-reduce
                    delta = self.reducer(delta)
                self.total = [t + d for t, d in zip(self.total, delta)]
                post = self.post = solve_statistics(self.prior, *self.total)
        if value is None:
            raise ValueError("StreamingCVI: the loader yielded no minibatch")
        if not first and len(self.keys) != i + 1:
            raise ValueError(
                f"StreamingCVI: this pass had {i + 1} minibatches, the first had {len(self.keys)}"
            )
        # resum the stored statistics: no drift from the running updates
        self.total = [
            sum(s[0] + s[2] for s in self.stats),
            sum(s[1] + s[3] for s in self.stats),
        ]
        if self.reducer is not None:
            *self.total, value = self.reducer(self.total + [value])
        start = post if self.update == "batch" else self.post
        elbo = value - start.kl_to(self.prior)
        self.post = solve_statistics(self.prior, *self.total)
        self.num_passes += 1
        return float(elbo)

    @torch.no_grad()
    def elbo(self, loader: Iterable) -> float:
        """The exact ELBO of the current q: ``-KL(q || prior) + sum_n E_q[log p(y_n | .)]``,
        one pass over ``loader`` without updating anything."""
        if self.post is None:
            raise RuntimeError("StreamingCVI has not seen data yet: call run_pass(loader) first")
        cov = self.post.covariance()
        self._check_lengths(loader)
        total = sum(self._batch(a, k, self.post, cov)[0] for a, k in self._batches(loader))
        if self.reducer is not None:
            (total,) = self.reducer([total])
        return float(total - self.post.kl_to(self.prior))

    def _check_lengths(self, loader) -> None:
        """Data-parallel: every rank must see the same number of minibatches."""
        if self.reducer is None:
            return
        n = len(loader)
        like = torch.zeros((), device=self.reducer.device)
        (total,) = self.reducer([like.new_tensor(float(n)).reshape(1)])
        if not self.reducer.all_agree(float(total) == n * self.reducer.world_size, like):
            raise ValueError(
                "StreamingCVI: the ranks' loaders have different numbers of minibatches; give "
                "every rank the same number (e.g. equal shards and batch sizes, drop_last=True)"
            )

    def posterior(self) -> torch.distributions.MultivariateNormal:
        """The current ``q`` of the block (its sites' values flattened and concatenated)."""
        if self.post is None:
            raise RuntimeError("StreamingCVI has not seen data yet: call run_pass(loader) first")
        return torch.distributions.MultivariateNormal(
            self.post.loc, scale_tril=self.post.scale_tril()
        )

    def _batches(self, loader):
        it = loader
        if self.progress:
            from tqdm.auto import tqdm

            it = tqdm(loader, desc=f"CVI pass {self.num_passes + 1}", leave=False)
        for batch in it:
            if isinstance(batch, dict):
                yield (), batch
            elif isinstance(batch, (list, tuple)):
                yield tuple(batch), {}
            else:
                yield (batch,), {}


def _key(args, kwargs) -> tuple:
    """A cheap fingerprint of a minibatch: shapes and the sum of its first tensor."""
    tensors = [a for a in list(args) + [kwargs[k] for k in sorted(kwargs)] if torch.is_tensor(a)]
    shapes = tuple(tuple(t.shape) for t in tensors)
    return shapes, float(tensors[0].double().sum()) if tensors else 0.0
