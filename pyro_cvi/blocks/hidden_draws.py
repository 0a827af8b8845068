"""Messages of factors that read a draw the guide does not see (a latent hidden by
``poutine.block``, a ``torch.randn`` in the model): each model run draws it afresh, so one
step's message ``lambda_t`` is a draw of a random message. Pyro's Trace_ELBO maximises the
expectation over that draw; its fixed point is that of the *expected* message. The block's
Monte Carlo message is therefore averaged over the steps (a Robbins-Monro step ``1 / (t + 1)``
on top of the CVI step ``beta``):

    lambda <- lambda + beta / (t + 1) * (lambda_hat_t - lambda),

with ``t`` the guide's step count (saved in checkpoints, so a resume continues the average).
With ``beta = 1`` this is the running mean of the ``lambda_hat_t``."""

from __future__ import annotations

from typing import Any

from ..context import StepContext

__all__ = ["draw_weight"]


def draw_weight(block: Any, ctx: StepContext) -> float:
    """The weight ``1 / (t + 1)`` of this step's general message of ``block`` where one of its
    general factors reads a hidden draw (``Factor.hidden_draw``), else 1; ``t = ctx.steps``."""
    if not any(f.hidden_draw for f in block.general):
        return 1.0
    return 1.0 / (ctx.steps + 1.0)
