"""Messages of factors that read a draw the guide does not see (a latent hidden by
``poutine.block``, a ``torch.randn`` in the model): each model run draws it afresh, so one
step's message ``lambda_t`` is a draw of a random message. Pyro's Trace_ELBO maximises the
expectation over that draw; its fixed point is that of the *expected* message. The block's
Monte Carlo message is therefore averaged over the steps (a Robbins-Monro step ``1 / (t + 1)``
on top of the CVI step ``beta``):

    lambda <- lambda + beta / (t + 1) * (lambda_hat_t - lambda),

with ``t`` the guide's step count (saved in checkpoints, so a resume continues the average).
With ``beta = 1`` this is the running mean of the ``lambda_hat_t``. The adaptive step's
``beta < 1`` would make it a weighted mean that forgets its start only as ``t^-beta`` (q's
variance 8-20% high after 40 steps at ``beta`` 0.04-0.1), so the general message's step
bypasses it (:func:`undamped_targets`): the averaged message steps by ``1 / (t + 1)`` whatever
``beta`` (only the halvings that keep ``q`` valid still shrink it)."""

from __future__ import annotations

from typing import Any, Sequence, Tuple

import torch

from ..context import StepContext

__all__ = ["draw_weight", "undamped_targets"]


def draw_weight(block: Any, ctx: StepContext) -> float:
    """The weight ``1 / (t + 1)`` of this step's general message of ``block`` where one of its
    general factors reads a hidden draw (``Factor.hidden_draw``), else 1; ``t = ctx.steps``."""
    if not any(f.hidden_draw for f in block.general):
        return 1.0
    return 1.0 / (ctx.steps + 1.0)


def undamped_targets(
    block: Any, old: Sequence[torch.Tensor], target: Sequence[torch.Tensor], beta: float
) -> Tuple[torch.Tensor, ...]:
    """The step's targets with the general message's (the last two: ``h``, ``P``) rescaled so
    that eq. 12's step of size ``beta`` moves it by ``1 / (t + 1)`` of the way to this step's
    message: ``old + (target - old) / beta``, where a general factor of ``block`` reads a hidden
    draw and ``beta < 1``; else ``target`` unchanged."""
    if beta >= 1.0 or not any(f.hidden_draw for f in block.general):
        return tuple(target)
    general = tuple(o + (t - o) / beta for o, t in zip(old[-2:], target[-2:]))
    return (*target[:-2], *general)
