"""Input checks that turn silent numerical failures into errors naming the site and the fix."""

from __future__ import annotations

import torch
from pyro.poutine.trace_struct import Trace

from .tracing import is_random

__all__ = ["check_observations", "check_structure", "per_index"]


def check_observations(trace: Trace, prototype) -> None:
    """Raise ``ValueError`` for non-finite observations or a model whose sites changed."""
    check_structure(trace, prototype)
    latent = {n for n, obs in prototype.items() if not obs} if isinstance(prototype, dict) else ()
    for name, site in trace.nodes.items():
        if not is_random(site) or not site["is_observed"]:
            continue
        v = site["value"]
        if name in latent:  # a latent conditioned on q's value: q itself went bad
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise FloatingPointError(
                    f"latent site {name!r} got a non-finite value from q: the CVI step was "
                    "too long. Use the adaptive CVI() (step_size='auto') or a smaller step_size."
                )
            continue
        if not torch.is_tensor(v):
            continue
        expected = site["fn"].shape()
        if not _broadcasts_into(v.shape, expected):
            raise ValueError(
                f"observed site {name!r} has shape {tuple(v.shape)} but its distribution has "
                f"shape {tuple(expected)} (batch {tuple(site['fn'].batch_shape)}, event "
                f"{tuple(site['fn'].event_shape)}); reshape the data to match, e.g. y.reshape(-1)"
                " for a column vector, or use .to_event() for event dims"
            )
        if not v.is_floating_point():
            continue
        bad = ~torch.isfinite(v)
        mask = site["mask"]
        if torch.is_tensor(mask):  # entries masked out (e.g. by obs_mask) may hold NaN
            bad = bad & mask.reshape(mask.shape + (1,) * (bad.dim() - mask.dim()))
        if bool(bad.any()):
            bad = bad.nonzero()[0].tolist()
            raise ValueError(
                f"observed site {name!r} has a non-finite value (first at index {bad}). Remove or "
                "impute those observations, or mark them missing with "
                "pyro.sample(..., obs_mask=torch.isfinite(y))."
            )


def _broadcasts_into(shape, target) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without enlarging it (pure Python: the
    torch helper imports sympy on first use, which costs seconds)."""
    if len(shape) > len(target):
        return False
    return all(a in (1, b) for a, b in zip(reversed(shape), reversed(target)))


def _sample_sites(tr: Trace):
    return {n: s["is_observed"] for n, s in tr.nodes.items() if is_random(s) and not per_index(s)}


def per_index(site) -> bool:
    """A site of a sequential subsampled plate (``for i in pyro.plate(..., subsample_size=B)``):
    its name carries the data index, so the set of such sites changes with the minibatch."""
    return any(
        not f.vectorized and f.size is not None and (f.full_size or f.size) != f.size
        for f in site["cond_indep_stack"]
    )


def check_structure(trace: Trace, prototype) -> None:
    """``prototype``: a trace, or ``{site: is_observed}`` of the model when the guide was built."""
    now = _sample_sites(trace)
    then = prototype if isinstance(prototype, dict) else _sample_sites(prototype)
    if now.keys() != then.keys():
        added = sorted(set(now) - set(then))
        removed = sorted(set(then) - set(now))
        raise ValueError(
            f"the model's sample sites changed since the guide was built (added {added}, removed "
            f"{removed}). AutoCVI needs a fixed model structure: build a new AutoCVI for the new "
            "model, or keep control flow that adds or removes sites out of the model."
        )
    for n in now:
        if then[n] and not now[n]:
            raise ValueError(
                f"site {n!r} was observed when the guide was built and is latent now; build "
                "a new AutoCVI for the new model"
            )
