"""Helpers shared by the scripts that fit the zoo (``tests/zoo``) with Pyro's autoguides: the
model with its enumerated discrete sites hidden, the ELBO a zoo entry needs, and the size of a
model's latent space. No ``pyro_cvi`` import here: a script may load another checkout's."""

from __future__ import annotations


def hide_discrete(model):
    """The model with its enumerated discrete sites hidden from a baseline autoguide."""
    import pyro.poutine as poutine

    def enumerated(msg):
        return msg["type"] == "sample" and msg["infer"].get("enumerate") == "parallel"

    return poutine.block(model, hide_fn=enumerated)


def zoo_elbo(entry, **kw):
    """``TraceEnum_ELBO`` (three plates) for an entry with discrete sites, else ``Trace_ELBO``."""
    from pyro.infer import Trace_ELBO, TraceEnum_ELBO

    if entry.has_discrete:
        return TraceEnum_ELBO(max_plate_nesting=3, **kw)
    return Trace_ELBO(**kw)


def latent_size(model, data) -> int:
    """The number of latent coordinates one run of ``model`` on ``data`` samples."""
    import pyro.poutine as poutine
    import torch

    with torch.no_grad(), poutine.block():
        tr = poutine.trace(model).get_trace(*data.args, **data.kwargs)
    return sum(
        int(s["value"].numel())
        for s in tr.nodes.values()
        if s["type"] == "sample" and not s["is_observed"]
    )
