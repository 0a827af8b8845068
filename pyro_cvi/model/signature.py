"""Model changes are seen: a structural signature of the model's trace, checked every step, and
the tensors a model reads from its closure or module globals, part of the data's identity.

The analysis of a model (its blocks, affine coefficients, messages) holds as long as the model
has the same sample sites, with the same distributions, shapes and plates, and reads the same
data. A model without learnable parameters is traced once per data (its trace at the blocks'
fixed point does not change); so that a model that changes is still seen, every step runs it
again and compares:

* :func:`signature`: per sample site, the base distribution's type, its batch and event shapes
  (batch dims of subsampled plates left out: a minibatch's size may vary) and its plates. A
  difference raises a ``ValueError`` naming the site and the change (the guide's parameters
  were built for the old structure: a new guide is needed). Sites added or removed, or a
  model that starts raising, are caught by the same model run.
* :func:`closure_key`: identities, versions and shapes of the tensors the model function reads
  from its closure cells and its module globals. Data read that way is then treated as data
  passed as arguments: replaced or changed in place, it is re-analysed at the next step (a
  tensor read inside another function the model calls is not seen: pass data as arguments).
"""

from __future__ import annotations

import inspect
from typing import Callable, Dict, Optional, Tuple

import torch
from pyro.poutine.trace_struct import Trace
from pyro.poutine.util import site_is_subsample

from .tracing import unwrap

__all__ = ["signature", "check_signature", "closure_key", "data_key"]

Sig = Dict[str, Tuple]


def _subsampled(frame) -> bool:
    return frame.full_size is not None and frame.full_size != frame.size


def signature(trace: Trace) -> Sig:
    """``{site: (distribution, batch shape, event shape, plates)}`` of the sample sites."""
    out: Sig = {}
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or site_is_subsample(site):
            continue
        frames = site["cond_indep_stack"]
        if any(not f.vectorized and _subsampled(f) for f in frames):
            continue  # a sequential minibatch's sites: named by their data index
        fn = site["fn"]
        base = unwrap(fn)[0]
        batch: Optional[tuple] = tuple(fn.batch_shape)
        if any(_subsampled(f) for f in frames):
            batch = None
        plates = tuple(sorted((f.name, f.dim, f.full_size or f.size) for f in frames))
        out[name] = (type(base).__name__, batch, tuple(fn.event_shape), plates)
    return out


def _describe(entry: Tuple) -> str:
    kind, batch, event, plates = entry
    where = ", ".join(f"{p[0]} ({p[2]})" for p in plates) or "no plate"
    shape = "?" if batch is None else str(batch)
    return f"{kind} with batch shape {shape}, event shape {event}, in {where}"


def check_signature(trace: Trace, expected: Sig) -> None:
    """``ValueError`` if a site of ``trace`` differs from ``expected`` (sites added or removed
    are reported by :func:`~pyro_cvi.model.validation.check_structure`)."""
    now = signature(trace)
    for name in expected.keys() & now.keys():
        old, new = expected[name], now[name]
        if old[1] is None or new[1] is None:
            old, new = (old[0], None) + old[2:], (new[0], None) + new[2:]
        if old != new:
            raise ValueError(
                f"site {name!r} changed since the guide was analysed: it was a "
                f"{_describe(expected[name])}, it is now a {_describe(now[name])}. AutoCVI's "
                "parameters and messages were built for the old model: build a new AutoCVI "
                "(and SVI) for the new one."
            )


def closure_key(model: Callable) -> Tuple:
    """``(name, id, version, shape)`` of every tensor ``model`` reads from its closure or its
    module's globals (a ``functools.partial``, a bound method or a callable object: its
    function), in a fixed order."""
    fn = inspect.unwrap(model) if callable(model) else model
    while True:
        if hasattr(fn, "func") and callable(fn.func):  # functools.partial
            fn = fn.func
        elif inspect.ismethod(fn):
            fn = fn.__func__
        else:
            break
    code = getattr(fn, "__code__", None)
    if code is None and callable(fn):  # a callable object: its __call__
        fn = type(fn).__call__
        code = getattr(fn, "__code__", None)
    if code is None:
        return ()
    items = []
    cells = getattr(fn, "__closure__", None) or ()
    for name, cell in zip(code.co_freevars, cells):
        try:
            items.append((name, cell.cell_contents))
        except ValueError:  # an empty cell
            continue
    env = getattr(fn, "__globals__", {})
    items += [(n, env[n]) for n in code.co_names if n in env]
    return tuple(
        (n, id(v), v._version, tuple(v.shape)) for n, v in items if isinstance(v, torch.Tensor)
    )


def data_key(args, kwargs):
    """Identifies the data: the arguments' identities, versions and shapes."""
    items = list(args) + [kwargs[k] for k in sorted(kwargs)]
    return tuple(
        (id(a), a._version, tuple(a.shape)) if torch.is_tensor(a) else id(a) for a in items
    )
