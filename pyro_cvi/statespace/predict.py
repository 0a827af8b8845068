"""Posterior predictions of a fitted Markov GP at new 1-D inputs, O((T + T*) d^3).

The new inputs join the chain with no sites: ``q`` on the merged, sorted inputs is the prior
(the same SDE, exact discretisation at the new gaps) times the fitted sites at the training
inputs, so one Kalman smoother gives ``E_q[f(t*)]`` and ``Var_q[f(t*)]`` exactly (the
site-form ``q`` of eq. 11 is a GP posterior with pseudo-observations, App. E.2).
"""

from __future__ import annotations

from typing import Any, Tuple

import torch

from ..model.tracing import unwrap
from .distribution import MarkovGP
from .kalman import smooth

__all__ = ["predict", "predict_f"]


def predict_f(
    prior: MarkovGP, eta: torch.Tensor, J: torch.Tensor, new_times: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(mean, var)`` of ``f = H x`` at ``new_times`` given the sites ``(eta (T, d), J (T, d, d))``
    on the prior's inputs."""
    times = prior.times.detach()
    new_times = new_times.to(times)
    merged, inverse = torch.unique(torch.cat([times, new_times]), return_inverse=True)
    T, d = eta.shape
    e = eta.new_zeros(len(merged), d).index_add_(0, inverse[:T], eta.detach())
    Jm = J.new_zeros(len(merged), d, d).index_add_(0, inverse[:T], J.detach())
    with torch.no_grad():
        chain = MarkovGP(merged, prior.kernel).chain.detach()
        post = smooth(chain, e, Jm)
        H = prior.emission.detach().to(e)
        mean = post.mean @ H
        var = torch.einsum("i,tij,j->t", H, post.cov, H)
    idx = inverse[T:]
    return mean[idx], var[idx]


def predict(
    guide: Any, name: str, new_times: torch.Tensor, *args: Any, **kwargs: Any
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(mean, var)`` of ``f`` at ``new_times`` for the Markov GP site ``name`` of a fitted
    :class:`~pyro_cvi.AutoCVI` guide; ``args, kwargs``: the model's training arguments."""
    block = guide.engine.block_of(name)
    trace = guide.engine.context(args, kwargs, {}, grads=False).trace
    prior = unwrap(trace.nodes[name]["fn"])[0]
    if not isinstance(prior, MarkovGP):
        raise ValueError(
            f"site {name!r}: predictions at new inputs need a MarkovGP prior "
            "(pyro_cvi.statespace.markov_gp); use guide.posterior for other chains"
        )
    eta, J = block.information()
    return predict_f(prior, eta, J, new_times)
