"""The CVI site update for GPyTorch models with a :class:`CVIVariationalStrategy`.

One step (Khan & Lin 2017, Algorithm 1 and eq. 13) for the data points in the batch:

1. marginals ``q(f_n) = N(m_n, v_n)`` from the current sites (a GP-regression prediction);
2. ``f_n = E_q[log p(y_n | f_n)]`` by ``likelihood.expected_log_prob`` and its gradients
   ``df/dm``, ``df/dv`` by autograd (exact for analytic and quadrature likelihoods);
3. the gradients with respect to the mean parameters ``(m, v + m^2)`` (eqs. 30-31)::

       g1 = df/dm - 2 m df/dv,     g2 = df/dv;

4. ``lam <- (1 - beta) lam + beta g`` (eq. 13), then q is rebuilt from the new sites.

With ``beta = 1`` and exact gradients this is NCVMP / a Newton-like fixed-point step; with a
Gaussian likelihood it gives the exact GP-regression posterior in one step.

**Validity of the sites.** q stays a valid Gaussian as long as every site precision
``W_n = -2 lam2_n`` is >= 0. For log-concave likelihoods (Bernoulli, logistic, Poisson,
Gaussian) ``df/dv = E[d^2 log p / df^2] / 2 <= 0`` always holds. For non-log-concave ones
(Student-t: points in the tails have positive curvature) the step clips the curvature of the
target, ``g2 <- min(g2, 0)``, and recomputes ``g1 = df/dm - 2 m g2`` so that the site still
matches the gradient in the mean (the fixed point keeps ``d ELBO / dm = 0`` exactly). Every
clipped site is counted in ``optimizer.num_clipped`` (total) and ``optimizer.last_num_clipped``.
Non-finite gradients raise :class:`FloatingPointError` instead of writing NaN into the sites.

**Data-parallel** (``process_group=WORLD``, sparse form only): each rank holds its shard of the
training data and the sites of its own points. Building q(u) all-reduces the sums over data
points (``Phi W Phi^T``, ``Phi r``; see :class:`SparseSitePosterior`), the site targets above
are per point (no communication), the -ELBO is ``KL`` (counted once) plus every rank's
expected log-likelihood (one small all-reduce, which also carries the clipping counts, the
non-finite flags and the backtracking test, so every rank takes the same decision), and
:meth:`CVIOptimizer.reduce_grads` sums the hyperparameter gradients of :meth:`CVIOptimizer.loss`
over the ranks, so every rank takes the same Adam step.
"""

from __future__ import annotations

from typing import Any, List, Optional, Union

import torch
from gpytorch.likelihoods import BernoulliLikelihood, Likelihood
from gpytorch.models import ApproximateGP
from torch import Tensor

from pyro_cvi.messages.quadrature import site_natural_params
from pyro_cvi.model.validation import check_targets
from pyro_cvi.step_control import Snapshot, StepControl
from pyro_cvi.update import cvi_update

from .inducing import mean_param_targets
from .likelihoods import LogisticBernoulliLikelihood, binary_labels, site_gradients
from .minibatch import SiteMemoryScaling, SVIScaling
from .strategy import CVIVariationalStrategy

__all__ = ["CVIOptimizer"]


def module_tensors(module: torch.nn.Module) -> List[Tensor]:
    """Every tensor a module holds: parameters, buffers, and plain tensor attributes of it and
    its submodules (``FixedNoiseGaussianLikelihood`` keeps its noise as one)."""
    out = list(module.parameters()) + list(module.buffers())
    for sub in module.modules():
        out += [v for v in vars(sub).values() if torch.is_tensor(v)]
    return out


class CVIOptimizer:
    r"""Conjugate-computation VI steps on the sites of a :class:`CVIVariationalStrategy`.

    :param model: an ``ApproximateGP`` whose ``variational_strategy`` is a
        :class:`CVIVariationalStrategy`.
    :param likelihood: any one-dimensional GPyTorch likelihood with ``expected_log_prob``
        (``BernoulliLikelihood``, :class:`LogisticBernoulliLikelihood`,
        ``StudentTLikelihood``, ``PoissonLikelihood``, ``GaussianLikelihood``, ...).
    :param step_size: ``beta`` in eq. 13, in (0, 1]. With exact (quadrature) gradients,
        ``beta = 1`` is NCVMP (exact in one step for a Gaussian likelihood) but the undamped
        iteration can oscillate: on USPS (full GP, 770 points) it needs 9 iterations for the
        logistic likelihood at log sf = 2 and oscillates for probit and at log sf = 5, while
        ``beta = 0.8`` needs 5 (logistic, log sf = 2), 10 (probit) and 18 (log sf = 5, after one
        backtrack) to get within 0.5 nat; ``beta = 0.5`` (the paper's "CVI-exact, w = 1",
        ``beta = w / (1 + w)``) needs 8, 17 and 19. Hence the default 0.8, with backtracking.
    :param clip_curvature: clip positive site curvature (see the module docstring). If
        ``False``, a positive ``lam2`` raises an error instead.
    :param backtrack: for full-batch steps at unchanged hyperparameters, if the -ELBO went up
        since the previous step, undo that step and redo it with ``step_size * shrink``
        (down to ``min_step_size``). This makes ``step_size=1.0`` safe where the undamped
        fixed-point iteration oscillates (probit, log sf = 5, Student-t), and the returned
        -ELBO never increases. Rejections are counted in ``num_backtracks``. With hyperparameters
        changing between steps (hybrid training) or with minibatches there is no backtracking.

    :param minibatch: :class:`~pyro_cvi.contrib.gpytorch.minibatch.SVIScaling` for minibatch
        steps on the data sites by eq. 14 of Khan & Lin 2017 (every site decayed, the batch's
        targets scaled by ``N / B``), or
        :class:`~pyro_cvi.contrib.gpytorch.minibatch.SiteMemoryScaling` (each point's latest
        target, refreshed at q's mean; eq. 14 for the share not yet seen); ``"auto"``:
        ``SiteMemoryScaling()`` where the data-site form runs in one process, else ``None``;
        ``None``: the batch's sites move towards their targets (``step_size``) and the others
        are kept (after 30 steps of the benchmark 40-43 nats from the full-batch optimum,
        against 2.1-4.4 for the memory). Full-batch steps are the same either way.
    :param process_group: data-parallel CVI over ``torch.distributed`` (sparse form only):
        :data:`~pyro_cvi.scale.distributed.WORLD` or a group; ``None`` (default) keeps the
        strategy's own setting (one process unless it was given one). Every rank passes its
        shard (``pyro_cvi.scale.distributed.shard``) to the model's strategy and to :meth:`step`; at
        set-up every rank takes rank 0's hyperparameters and inducing points.

    ``step(x, y)`` returns the -ELBO (sum over the data, in nats) of q *before* the update,
    for monitoring; with a minibatch it is the unbiased estimate ``N/B sum_batch - KL``.
    For the hyperparameters, :meth:`loss` is ``-mll(model(x), y)`` of
    ``gpytorch.mlls.VariationalELBO`` summed over the ranks' data, and :meth:`reduce_grads`
    (after ``loss.backward()``, a no-op in one process) makes every rank's gradients the
    full-data ones.
    """

    def __init__(
        self,
        model: ApproximateGP,
        likelihood: Likelihood,
        step_size: float = 0.8,
        clip_curvature: bool = True,
        backtrack: bool = True,
        shrink: float = 0.5,
        min_step_size: float = 1e-2,
        process_group=None,
        num_data: Optional[int] = None,
        minibatch: Union[SVIScaling, None, str] = "auto",
    ):
        strategy = getattr(model, "variational_strategy", None)
        while not isinstance(strategy, CVIVariationalStrategy) and hasattr(
            strategy, "base_variational_strategy"
        ):  # IndependentMultitaskVariationalStrategy, LMCVariationalStrategy, ...
            strategy = strategy.base_variational_strategy
        if not isinstance(strategy, CVIVariationalStrategy):
            raise TypeError(
                "CVIOptimizer needs a model whose variational_strategy is a "
                "CVIVariationalStrategy (possibly wrapped by GPyTorch's multitask strategies); "
                f"got {type(getattr(model, 'variational_strategy', None)).__name__}."
            )
        if not 0.0 < float(step_size) <= 1.0:
            raise ValueError(f"step_size must be in (0, 1], got {step_size}")
        self.model = model
        self.likelihood = likelihood
        self.strategy = strategy
        #: the one step policy (backtracking only: no growth above a shrunk step)
        self.control = StepControl(
            max_beta=float(step_size),
            start_exact=float(step_size),
            shrink=float(shrink),
            grow_exact=1.0,
            min_beta=float(min_step_size),
        )
        self.control.start(stochastic=False)
        self.clip_curvature = clip_curvature
        self.backtrack = backtrack
        self.shrink = float(shrink)
        self.min_step_size = float(min_step_size)
        self.num_clipped = 0
        self.last_num_clipped = 0
        self.num_steps = 0
        if isinstance(minibatch, str):
            if minibatch != "auto":
                raise ValueError(
                    f"CVIOptimizer(minibatch={minibatch!r}): pass 'auto', None, SVIScaling() "
                    "or SiteMemoryScaling()"
                )
            one = not strategy.inducing_form and process_group is None
            minibatch = SiteMemoryScaling() if one and strategy.reducer is None else None
        self.minibatch: Optional[SVIScaling] = minibatch
        if minibatch is not None and (strategy.inducing_form or process_group is not None):
            raise ValueError(
                "CVIOptimizer(minibatch=SVIScaling()) needs the data-site form in one process "
                "(num_data= or train_inputs=, no process_group)."
            )
        if process_group is not None:
            strategy.set_process_group(process_group)
        self.reducer = strategy.reducer
        #: training points over every rank (``strategy.num_data`` in one process)
        self.num_data = strategy.num_data if num_data is None else int(num_data)
        self._inferred_n = False  # inducing form without num_data: N from the first step
        if strategy.inducing_form:
            strategy.backward_step = False  # the steps are taken here, with backtracking
        else:
            strategy.stepped_by_optimizer = True
        if self.reducer is not None:
            # every rank starts from rank 0's hyperparameters and inducing points
            shared = self.hyperparameters()
            if all(t is not strategy.inducing_points for t in shared):
                shared.append(strategy.inducing_points)  # a buffer when not learned
            self.reducer.broadcast(shared)
            like = strategy.site_lam1
            (total,) = self.reducer([like.new_tensor([float(strategy.num_data)])])
            self.num_data = int(round(float(total)))

    def hyperparameters(self) -> List[Tensor]:
        """The model's and the likelihood's parameters (kernel, mean, noise, learned inducing
        points), each once, in a fixed order."""
        seen, out = set(), []
        for p in list(self.model.parameters()) + list(self.likelihood.parameters()):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def _resolve_indices(self, x: Tensor, indices: Optional[Tensor]) -> Optional[Tensor]:
        s = self.strategy
        if x.dim() == 1:
            x = x.unsqueeze(-1)
        if indices is None:
            if x.shape[-2] != s.num_data:
                raise ValueError(
                    f"step(x, y) got {x.shape[-2]} points but the model has {s.num_data} sites; "
                    "for a minibatch pass indices= (the rows of the training set in x)."
                )
            if not s.is_full and s.site_inputs is None:
                s.set_site_inputs(x)
            ref = s.sites_inputs
        else:
            indices = torch.as_tensor(indices, device=s.site_lam1.device, dtype=torch.long)
            if indices.dim() != 1 or indices.shape[0] != x.shape[-2]:
                raise ValueError("indices must be a 1-D tensor with one entry per row of x.")
            if s.sites_inputs is None:
                raise RuntimeError(
                    "minibatch CVI steps in the sparse form need the full training inputs first: "
                    "pass train_inputs= to CVIVariationalStrategy or call set_site_inputs(X)."
                )
            ref = s.sites_inputs[indices]
        if ref.shape != x.shape or not torch.equal(ref, x.to(ref)):
            raise ValueError(
                "x does not match the training inputs that carry the CVI sites (in order). Sites "
                "are tied to data points: pass the full training inputs, or a minibatch together "
                "with its indices."
            )
        return indices

    def step(self, x: Tensor, y: Tensor, indices: Optional[Tensor] = None, **kwargs: Any) -> Tensor:
        """One CVI update of the sites of the points ``x`` (all training points, or ``indices``).

        :param x: the training inputs (full batch), or the minibatch ``X_train[indices]``.
        :param y: the matching targets (Bernoulli likelihoods: labels in {0, 1}, or in {-1, 1},
            read as {0, 1}; anything else raises ``ValueError``).
        :param indices: rows of the training set in the minibatch (``None``: full batch).
        :param kwargs: passed to ``likelihood.expected_log_prob``.
        :return: -ELBO of q before the update (detached 0-dim tensor). A backtracked step
            (undone and retried with a halved step size) returns the previous value again, so
            a convergence test on this value should also check that ``num_backtracks`` did
            not change.
        """
        s = self.strategy
        if isinstance(self.likelihood, (BernoulliLikelihood, LogisticBernoulliLikelihood)):
            y = binary_labels(y, "CVIOptimizer.step: targets y")
        f = torch.zeros(y.shape, dtype=y.dtype if y.is_floating_point() else torch.float64)
        check_targets(self.likelihood, y, f.to(y.device))  # y against the likelihood's support
        if s.inducing_form:
            return self._inducing_step(x, y, indices, **kwargs)
        indices = self._resolve_indices(x, indices)
        mean, var = s.site_marginals(indices)
        y = y.to(device=mean.device)

        ell, gm, gv = site_gradients(self.likelihood, y, mean, var, **kwargs)
        if indices is not None and not kwargs and isinstance(self.minibatch, SiteMemoryScaling):
            grad = lambda m, v, y: site_gradients(self.likelihood, y, m, v)[1:]  # noqa: E731
            self.minibatch.observe(y, mean, var, grad)  # what refreshes the kept targets
        finite = bool(
            torch.isfinite(gm).all() and torch.isfinite(gv).all() and torch.isfinite(ell).all()
        )
        clipped = gv > 0
        n = mean.shape[-1]
        with torch.no_grad():
            kl = s.kl_divergence()
        key = self.objective_key(x, y) if (self.backtrack and indices is None) else None
        same = self._same_point(key)
        # data-parallel: every rank's terms and flags in one all-reduce, so all decide alike
        kl, ell_sum, num_clipped, finite, same = self._agree(
            kl, ell.sum() * (s.num_data / n), int(clipped.sum()), finite, same
        )
        if not finite:
            raise FloatingPointError(
                "non-finite expected log-likelihood or gradient in the CVI step. Use float64 "
                "(model.double(), likelihood.double()), a smaller step_size, or check the targets."
            )

        self.last_num_clipped = num_clipped
        if self.last_num_clipped:
            if not self.clip_curvature:
                raise FloatingPointError(
                    f"{self.last_num_clipped} sites got positive curvature (non-log-concave "
                    "likelihood); use clip_curvature=True."
                )
            gv = torch.where(clipped, torch.zeros_like(gv), gv)
            self.num_clipped += self.last_num_clipped
        g1, g2 = site_natural_params(mean, gm, gv)
        loss = (kl - ell_sum).detach()
        old1 = s.site_lam1 if indices is None else s.site_lam1[indices]
        old2 = s.site_lam2 if indices is None else s.site_lam2[indices]
        return self._take_step(key, same, loss, (old1, old2), (g1, g2), indices)

    def objective_key(self, x: Tensor, y: Tensor) -> List[Tensor]:
        """What the -ELBO of a step depends on besides the sites: the model's parameters and
        inducing points, the likelihood (which object, its parameters and buffers: a noise set
        by hand, a new ``likelihood`` assigned), the data ``x``, ``y`` and the inputs that carry
        data sites. Two steps are compared (and the later one backtracked) only if their keys
        are equal; any change made between steps starts a new comparison instead of undoing the
        first step taken under it."""
        s = self.strategy
        lik = self.likelihood
        key = s.state_key()[1:]
        key.append(torch.tensor([id(lik), s.site_inputs_version, self.num_data or 0]))
        key += [t.detach().clone() for t in module_tensors(lik)]
        key += [x.detach().clone(), y.detach().clone()]
        return key

    def _same_point(self, key) -> bool:
        """Whether the last accepted step was taken at these hyperparameters (comparable)."""
        snap = self.control.snapshot
        if key is None or snap is None:
            return False
        return self.strategy.keys_equal([0] + snap.values["key"], [0] + key)

    def _take_step(self, key, same: bool, loss: Tensor, old: tuple, target: tuple, indices):
        """The step policy of :class:`pyro_cvi.step_control.StepControl`: if the -ELBO went up
        since the last accepted step at the same hyperparameters, undo that step and redo it with
        a smaller ``beta`` (returning the -ELBO of the restored point); otherwise record this
        point and step towards ``target`` (eq. 13)."""
        ctrl = self.control
        ctrl.rel_tol = self._rel_tol(loss)
        self.num_steps += 1
        snap = ctrl.snapshot
        if (
            same
            and ctrl.beta > self.min_step_size
            and not ctrl.accepts(-float(loss), None, comparable=True)
        ):
            ctrl.rejected()
            self._update(snap.values["old"], snap.values["target"], None)
            return snap.values["loss"]
        if key is None:
            ctrl.snapshot = None
        else:
            values = {"key": key, "loss": loss, "old": tuple(o.clone() for o in old)}
            values["target"] = target
            ctrl.accepted(Snapshot(values, -float(loss), None), comparable=True)
        self._update(old, target, indices)
        return loss

    def _inducing_step(self, x: Tensor, y: Tensor, indices, **kwargs: Any) -> Tensor:
        """The step for the inducing-site form (``inducing.py``): the targets are the gradient
        of ``sum_batch E_q[log p(y_n | f_n)] * N / B`` with respect to q(v)'s mean parameters,
        through ``model(x)`` (so GPyTorch's multitask wrappers and any likelihood work)."""
        s = self.strategy
        n = x.shape[-2] if x.dim() > 1 else x.shape[0]
        if self.num_data is None:
            if indices is not None:
                raise ValueError(
                    "minibatch steps on a CVIVariationalStrategy built the GPyTorch way need the "
                    "training-set size: CVIOptimizer(model, likelihood, num_data=N)."
                )
            self.num_data, self._inferred_n = n, True  # the first step is the full batch
        elif self._inferred_n and n != self.num_data:
            raise ValueError(
                f"step(x, y) got {n} points after a full batch of {self.num_data}; for "
                "minibatches pass CVIOptimizer(model, likelihood, num_data=N)."
            )
        scale = self.num_data / n
        s.pop_captured()
        with s.tracked_q() as (m_v, S_v), torch.enable_grad():
            out = self.model(x)
            ell = self.likelihood.expected_log_prob(y.to(out.mean.device), out, **kwargs).sum()
            cap = s.pop_captured()  # the first step's marginals (lengthscale search)
            leaves = (m_v, S_v) + (() if cap is None else cap["graph"])
            gm, gS, *g_point = torch.autograd.grad(ell, leaves, allow_unused=True)
        gm = torch.zeros_like(m_v) if gm is None else gm
        gS = torch.zeros_like(S_v) if gS is None else gS
        if not bool(torch.isfinite(ell) and torch.isfinite(gm).all() and torch.isfinite(gS).all()):
            raise FloatingPointError(
                "non-finite expected log-likelihood or gradient in the CVI step. Use float64 "
                "(model.double(), likelihood.double()), a smaller step_size, or check the targets."
            )
        t1, t2, clipped = mean_param_targets(m_v.detach(), gm * scale, gS * scale)
        s.num_clipped += clipped
        with torch.no_grad():
            loss = (s.kl_divergence().sum() - ell.detach() * scale).detach()
        key = self.objective_key(x, y) if (self.backtrack and self.num_data in (None, n)) else None
        same = self._same_point(key)
        if cap is not None and len(g_point) == 2 and None not in g_point:
            move = s.search_step(cap["x"], cap["mean"], g_point[0] * scale, g_point[1] * scale)
            if move is not None:  # new lengthscales: this step's -ELBO is not comparable
                move.apply()
                (t1, t2), key, same = move.targets, None, False
        old = (s.site_lam1, s.site_lam2)
        return self._take_step(key, same, loss, old, (t1, t2), None)

    def loss(self, x: Tensor, y: Tensor, indices: Optional[Tensor] = None, **kwargs: Any) -> Tensor:
        """-ELBO / N for the hyperparameters: ``-mll(model(x), y)`` of
        ``gpytorch.mlls.VariationalELBO(likelihood, model, num_data=N)`` (with its priors and
        added loss terms), differentiable; ``x`` is the training inputs or a minibatch with its
        ``indices``, as for :meth:`step`.

        Data-parallel: the value is that of all ranks' data (``KL`` and the priors counted
        once) on every rank; the graph is this rank's share, so that after ``backward()`` and
        :meth:`reduce_grads` every rank holds the full-data gradients.
        """
        self._resolve_indices(x, indices)
        s = self.strategy
        out = self.model(x)
        ell = self.likelihood.expected_log_prob(y.to(out.mean.device), out, **kwargs).sum(-1)
        shared = -s.kl_divergence()
        for module in (self.likelihood, self.model):
            for _, mod, prior, closure, _ in module.named_priors():
                shared = shared + prior.log_prob(closure(mod)).sum()
        for term in self.model.added_loss_terms():
            shared = shared - self.num_data * term.loss()
        local = ell * (s.num_data / out.mean.shape[-1])
        if self.reducer is None:
            return -(local + shared) / self.num_data
        return -self.reducer.combine(shared, local) / self.num_data

    def reduce_grads(self) -> None:
        """Data-parallel: sum every hyperparameter's ``.grad`` over the ranks (one all-reduce),
        after ``loss(...).backward()``, so that every rank's ``torch.optim`` step is the same;
        nothing in one process. Call it between ``backward()`` and ``adam.step()``."""
        if self.reducer is not None:
            self.reducer.reduce_grads(p for p in self.hyperparameters() if p.requires_grad)

    def _agree(self, kl: Tensor, ell_sum: Tensor, num_clipped: int, finite: bool, same: bool):
        """One process: the arguments. Data-parallel: KL (rank 0's), the sum of the ranks'
        ``ell_sum`` and ``num_clipped``, and whether ``finite`` and ``same`` hold on every rank,
        from one all-reduce (identical on every rank)."""
        r = self.reducer
        if r is None:
            return kl, ell_sum, num_clipped, finite, same
        flags = [kl if r.rank == 0 else torch.zeros_like(kl), ell_sum]
        flags += [kl.new_tensor(float(f)) for f in (num_clipped, not finite, same)]
        (total,) = r([torch.stack(flags)])
        every_rank_same = bool(total[4] == r.world_size)
        return total[0], total[1], int(total[2]), bool(total[3] == 0), every_rank_same

    @staticmethod
    def _rel_tol(loss: Tensor) -> float:
        """Relative increase of the -ELBO treated as real (not round-off) when backtracking."""
        return max(1e-9, 100.0 * torch.finfo(loss.dtype).eps)

    def _update(self, old: tuple, target: tuple, indices) -> None:
        """Eq. 13 (:func:`pyro_cvi.update.cvi_update`): ``lam <- lam + beta (g - lam)``, with
        ``lam2 <= 0`` kept (data sites) or ``lam2`` NSD (inducing sites)."""
        s = self.strategy
        if s.inducing_form:
            s.blend_sites(old, target, self.step_size)
            return
        if indices is not None and self.minibatch is not None:  # eq. 14 and its variants
            self.minibatch.apply(s, indices, target, self.num_data)
            return
        new1, new2 = cvi_update(old, target, self.step_size)
        s.set_sites(new1, new2.clamp_max(0.0), indices)

    @property
    def step_size(self) -> float:
        """``beta`` of the next step (shrunk by backtracking, never grown back)."""
        return float(self.control.beta)

    @property
    def num_backtracks(self) -> int:
        """Steps undone and redone with a smaller ``beta``."""
        return self.control.num_backtracks

    def state_dict(self) -> dict:
        return {
            "step_size": self.step_size,
            "num_clipped": self.num_clipped,
            "num_backtracks": self.num_backtracks,
            "num_steps": self.num_steps,
            "minibatch_steps": None if self.minibatch is None else self.minibatch.num_steps,
            "minibatch": None if self.minibatch is None else self.minibatch.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.control.beta = float(state["step_size"])
        self.num_clipped = int(state["num_clipped"])
        self.control.num_backtracks = int(state.get("num_backtracks", 0))
        self.num_steps = int(state["num_steps"])
        if self.minibatch is not None and state.get("minibatch") is not None:
            self.minibatch.load_state_dict(state["minibatch"])  # t, and a rule's memory
        elif self.minibatch is not None and state.get("minibatch_steps") is not None:
            self.minibatch.num_steps = int(state["minibatch_steps"])  # beta_t goes on from t
        self.control.snapshot = None
