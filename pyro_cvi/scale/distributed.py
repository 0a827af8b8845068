"""Data-parallel CVI on ``torch.distributed``: one all-reduce of the conjugate statistics.

A CVI step of a Gaussian block with linear-predictor (and conjugate Normal) factors needs the
data only through sums over data points (Algorithm 1 step 4, eq. 2)::

    Lambda = Lambda0 + sum_n a_n (-2 lam2_n) a_n^T,      Lambda m = Lambda0 m0 + sum_n a_n b_n

With the data split over R ranks, each rank holds its shard and the O(N/R) sites of its own
points, computes its partial sums, and one ``all_reduce`` (SUM) gives every rank the same
``(Lambda, Lambda m)``: the exact full-batch natural-gradient step, not an average of
stochastic gradients (Horovod/DDP). The site targets of eq. 13 are per point, so they need no
communication. The ELBO is ``-KL(q || prior)`` (the same on every rank) plus the sum of the
ranks' expected log-likelihoods (one more all-reduce of a scalar); the gradients of the model's
hyperparameters are all-reduced (SUM) before the torch optimizer steps, and the model's
parameters are broadcast from rank 0 at set-up, so every rank holds the same ``q`` and the same
hyperparameters throughout.

Enable it in one line; the same script runs on 1 or R processes (``torchrun``)::

    torch.distributed.init_process_group("gloo")        # "nccl" on GPUs
    X, y = shard(X), shard(y)                           # this rank's rows
    guide = AutoCVI(model, process_group=WORLD)          # or a group from new_group()
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())

Covered: global Gaussian blocks with conjugate Normal and linear-predictor factors (GLMs,
Bayesian linear regression, sparse GPs written in Pyro with ``f = K_nm K_mm^-1 u``), mean-field
latents with exact factors (global ones: their targets and ELBO terms all-reduced, the
replicated factors counted ``1/R`` per rank, see :func:`replicated_sites`; per-row ones: local,
no communication), hyperparameters, the adaptive ``CVI()`` step (decided on the all-reduced
ELBO, so identically on every rank), checkpoints (one file per rank). Refused with an error
naming the sites: general (Monte Carlo) factors. GPyTorch sparse GPs:
``CVIOptimizer(model, likelihood, process_group=WORLD)`` in ``pyro_cvi.contrib.gpytorch``
(the full GP is refused: its sites are coupled through ``k(X, X)``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Union

import pyro
import torch
import torch.distributed as tdist
import torch.distributed.nn.functional as tdist_nn

from ..model.analysis import MEANFIELD, SITE, Analysis
from ..model.replication import replicated_sites

__all__ = [
    "RankFailure",
    "Reducer",
    "tell_ranks",
    "WORLD",
    "as_reducer",
    "replicated_sites",
    "start_ranks",
    "combine",
    "shard",
    "rank_path",
]

#: pass as ``process_group`` for the default (world) group
WORLD = "world"


class RankFailure(RuntimeError):
    """Another rank of a data-parallel run failed in this step; this rank's step was undone."""


class Reducer:
    """Collective operations of one process group (SUM all-reduces and rank-0 broadcasts).

    :param group: a ``torch.distributed`` process group, or ``None`` for the default group.
    """

    def __init__(self, group=None):
        if not tdist.is_available() or not tdist.is_initialized():
            raise RuntimeError(
                "process_group was given but torch.distributed is not initialised: call "
                "torch.distributed.init_process_group('gloo' or 'nccl') first (torchrun sets "
                "the environment), or pass process_group=None for one process"
            )
        self.group = group
        self.world_size = tdist.get_world_size(group)
        self.rank = tdist.get_rank(group)
        #: where this group's collectives need their tensors (nccl: the current GPU)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if tdist.get_backend(group) == "nccl"
            else torch.device("cpu")
        )

    def status(self, failed: bool = False) -> None:
        """The status all-reduce that precedes every collective (and ends every step): each
        rank adds 1 at its own index if it failed. A rank that raises calls it once with
        ``failed=True`` (:func:`tell_ranks`), which meets the others' next status all-reduce:
        they raise :class:`RankFailure` naming it, every rank's step is rolled back, and the
        next step starts from the same ``q`` everywhere (instead of the others waiting in a
        data all-reduce the failed rank never reaches, until gloo's timeout)."""
        t = torch.zeros(self.world_size, device=self.device)
        if failed:
            t[self.rank] = 1.0
        tdist.all_reduce(t, op=tdist.ReduceOp.SUM, group=self.group)
        others = [r for r in range(self.world_size) if r != self.rank and float(t[r]) > 0]
        if others and not failed:
            raise RankFailure(
                f"data-parallel CVI: rank {others[0] if len(others) == 1 else others} of "
                f"{self.world_size} failed in this step (its own error says why). This rank's "
                "step was undone as well, so every rank still holds the same q: fix the cause "
                "and step again on every rank."
            )

    def __call__(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """Sum every tensor over the ranks: one flat all-reduce for the whole list. Where a
        tensor depends on learnable parameters (e.g. rows ``A`` with a learned lengthscale) the
        sum is differentiable: its backward all-reduces the incoming gradient, so each rank's
        parameters get the full-data gradient's share of their own rows."""
        self.status()
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if flat.requires_grad and torch.is_grad_enabled():
            flat = tdist_nn.all_reduce(flat, op=tdist.ReduceOp.SUM, group=self.group)
        else:
            flat = flat.detach().clone()
            tdist.all_reduce(flat, op=tdist.ReduceOp.SUM, group=self.group)
        out, i = [], 0
        for t in tensors:
            out.append(flat[i : i + t.numel()].reshape(t.shape))
            i += t.numel()
        return out

    def all_agree(self, flag: bool, like: torch.Tensor) -> bool:
        """Whether ``flag`` holds on every rank (collective decisions must be identical)."""
        self.status()
        t = like.new_tensor(1.0 if flag else 0.0).reshape(1)
        tdist.all_reduce(t, op=tdist.ReduceOp.MIN, group=self.group)
        return bool(t.item() == 1.0)

    def combine(self, shared: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """``shared + sum_ranks local`` as the value, ``shared / R + local`` as the graph:
        after the gradients are all-reduced (:meth:`reduce_grads`) they are those of the
        full-data ELBO."""
        local = torch.as_tensor(local).to(shared)
        (total,) = self([local.detach().reshape(1)])
        grad_part = shared / self.world_size + local
        value = shared.detach() + total.reshape(())
        return grad_part + (value - grad_part.detach())

    def reduce_grads(self, params: Iterable[torch.Tensor]) -> None:
        """All-reduce (SUM) the ``.grad`` of every parameter (zeros where a rank has none).

        The parameters are put in param-store-name order first: Pyro's ``SVI`` hands the
        optimizer a *set*, whose order follows object ids and so differs between processes;
        all-reducing in that order would add one rank's gradient of ``a`` to another's of
        ``b``."""
        store = pyro.get_param_store()

        def key(p):
            name = store.param_name(p)
            return (name is None, name or "", tuple(p.shape))

        params = sorted(params, key=key)
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        for p, g in zip(params, self(grads)):
            p.grad = g.to(p.dtype)

    def setup(self, analysis: Analysis, named_params, prefix: str) -> None:
        """At a guide's set-up: refuse what is not covered (Gaussian latents local to a rank's
        data; Monte Carlo factors of the mean-field part), and start every model parameter
        (outside the guide's ``prefix``) from rank 0's value, so every rank holds the same."""
        gaussian = {n for n, i in analysis.latents.items() if i.form == SITE}
        # (site-form latents have no plate dims today: a guard for sequential plates and beyond)
        local = sorted(gaussian - replicated_sites(analysis))
        general = [
            s for s, o in analysis.owner.items() if o == MEANFIELD and not analysis.spec(s).exact
        ]
        if local or general:
            what = (
                f"Gaussian latents {local} sit in a plate of the observations (rank-local)"
                if local
                else f"factors {general} of the mean-field latents need Monte Carlo"
            )
            raise NotImplementedError(
                "data-parallel CVI (process_group) covers global Gaussian latents, mean-field "
                f"latents and exact (closed-form or quadrature) factors; {what}. Run this "
                "model in one process (process_group=None)."
            )
        self.broadcast(v for k, v in sorted(named_params) if not k.startswith(prefix))

    def reduce_targets(self, targets: Dict, names) -> None:
        """Sum the targets of the global latents ``names`` over the ranks, in place (one
        all-reduce); each rank computed them with its replicated factors scaled by ``1/R``."""
        keys = [(n, i) for n in names for i in range(len(targets[n]))]
        if keys:
            summed = self([targets[n][i] for n, i in keys])
            for n in names:
                targets[n] = tuple(summed[keys.index((n, i))] for i in range(len(targets[n])))

    def broadcast(self, tensors: Iterable[torch.Tensor]) -> None:
        """Overwrite every tensor in place with rank 0's value."""
        src = tdist.get_global_rank(self.group, 0) if self.group is not None else 0
        self.status()
        with torch.no_grad():
            for t in tensors:
                tdist.broadcast(t.data, src=src, group=self.group)


def tell_ranks(reducer: Optional[Reducer], error: BaseException) -> None:
    """This rank failed with ``error``: tell the others (their next collective raises
    :class:`RankFailure`). Nothing for one process, or when the failure came from another rank."""
    if reducer is None or isinstance(error, RankFailure):
        return
    try:
        reducer.status(failed=True)
    except Exception:  # noqa: BLE001 (the group itself is broken: the rank's own error stands)
        pass


def start_ranks(reducer: Optional[Reducer], analysis: Analysis, named_params, prefix: str):
    """:meth:`Reducer.setup` in a data-parallel run; nothing for one process."""
    if reducer is not None:
        reducer.setup(analysis, named_params, prefix)


def combine(reducer: Optional[Reducer], shared: torch.Tensor, local: torch.Tensor):
    """:meth:`Reducer.combine` in a data-parallel run; ``shared + local`` for one process."""
    return shared + local if reducer is None else reducer.combine(shared, local)


def as_reducer(process_group) -> Optional[Reducer]:
    """``None`` -> ``None`` (one process); :data:`WORLD` -> the default group; else the group."""
    if process_group is None:
        return None
    if isinstance(process_group, Reducer):
        return process_group
    return Reducer(None if process_group is WORLD or process_group == WORLD else process_group)


def shard(data: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's contiguous block of rows of ``data`` (all rows without torch.distributed).

    Rows ``[r N / R, (r + 1) N / R)``: concatenating the shards in rank order gives ``data``.
    """
    if not tdist.is_available() or not tdist.is_initialized():
        return data
    R, r = tdist.get_world_size(group), tdist.get_rank(group)
    N = data.shape[0]
    return data[r * N // R : (r + 1) * N // R]


def rank_path(path: Union[str, os.PathLike], reducer: Optional[Reducer]) -> Path:
    """``run.pt`` -> ``run.rank{r}-of-{R}.pt`` in a data-parallel run (each rank saves its own
    sites), unchanged for one process."""
    path = Path(path)
    if reducer is None:
        return path
    return path.with_name(f"{path.stem}.rank{reducer.rank}-of-{reducer.world_size}{path.suffix}")
