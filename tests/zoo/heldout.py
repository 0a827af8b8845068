"""Held-out metric shared by the zoo: the mean log predictive density of test points.

``lpd = mean_n log (1/S) sum_s p(y_n | z_s)`` with ``z_s ~ q`` drawn by the guide on the
training arguments, and the model replayed at ``z_s`` on the test arguments. Higher is better.
"""

from __future__ import annotations

import math

import pyro.poutine as poutine
import torch


@torch.no_grad()
def log_predictive_density(model, guide, data, site: str = "obs", num_samples: int = 200) -> float:
    """Mean held-out log predictive density (nats per test point) of ``site``."""
    rows = []
    for _ in range(num_samples):
        guide_tr = poutine.trace(guide).get_trace(*data.args, **data.kwargs)
        model_tr = poutine.trace(poutine.replay(model, trace=guide_tr)).get_trace(
            *data.test_args, **data.kwargs
        )
        node = model_tr.nodes[site]
        rows.append(node["fn"].log_prob(node["value"]).reshape(-1))
    lp = torch.stack(rows)
    return float((lp.logsumexp(0) - math.log(num_samples)).mean())
