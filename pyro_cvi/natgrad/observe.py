"""How ``CVI()`` sees the guide: a passive observer at the bottom of Pyro's effect stack.

Pyro's ``SVI`` hands an optimizer only the parameters; the distributions they feed are known
only while the loss runs. While a ``CVI()`` exists, one :class:`SiteObserver` sits at the
*bottom* of ``pyro.poutine.runtime._PYRO_STACK``: every ELBO's ``poutine.trace`` of the guide
and the replayed model, every ``plate``, ``block``, ``scale``, ``mask`` or enumeration handler
is above it, so a sample site reaches it after all of them (``apply_stack`` processes top to
bottom) and it sees the site exactly as the loss's own trace does (a site hidden by
``poutine.block`` is hidden from it too). It changes nothing in the message. It records:

* **guide sites**: sample sites that are neither observed nor given a value by a handler above
  (``msg["done"]``: the model's sites replayed from the guide's trace, enumerated sites) -
  the distribution object, hence the autograd graph from the raw parameters to the
  distribution's parameters (:mod:`pyro_cvi.natgrad.sites` reads it);
* **draws outside the model's support**: a latent site of the model replayed from the guide
  whose value is not finite or fails its prior's support (a draw of ``q`` far in its tails after
  a step, overflowed to ``inf`` or underflowed to a boundary) is refused *before* the model
  builds a distribution from it (where torch would raise a bare constraint error): each live
  ``CVI()`` whose last step moved this guide's Gaussians undoes that step, bit for bit
  (:meth:`pyro_cvi.CVI.refuse_draw`), and :class:`~pyro_cvi.DivergenceError` names the site
  (nothing is checked where no such step exists: AutoCVI alone, or the first loss);
* for the divergence guard, ``(sign, fn, value, scale, mask)`` of every sample site, from
  which :meth:`SiteObserver.take_loss` forms the ``-ELBO`` estimate of the particles seen
  since the last step, ``-(sum log p - sum log q) / particles`` (Trace_ELBO's own estimate,
  computed lazily, without gradients); it is ``None`` where it cannot be formed (no model site
  was seen, enumerated sites, sites seen unequally often: a guide or model run outside the
  loss).

Alternatives weighed: reading the frame of ``SVI.step`` (breaks with a hand-written loop, any
wrapper, or another Python); re-tracing the guide (``CVI()`` does not know the guide nor its
arguments); parameter names (say nothing about which distribution a parameter feeds). The
observer works with ``SVI``, a hand-written ``loss.loss_and_grads`` loop, and any Pyro ELBO.
What it changes: while a ``CVI()`` is alive ``pyro.poutine.runtime.am_i_wrapped()`` is true
(a bare ``pyro.sample`` goes through the effect stack; it returns the same value). When the
last ``CVI()`` is garbage-collected it goes idle and leaves the stack as soon as that is safe:
at once if nothing else is on the stack, else at the next site that runs with nothing above it
(a collection can run inside Pyro's walk over the stack, which an early removal would shift).
Under ``JitTrace_ELBO`` the guide runs in Python only while being compiled: what was seen then
is kept (:mod:`pyro_cvi.natgrad.sites` caches it).

**Several ``CVI()`` optimizers** (two ``SVI`` objects in one process) share the one observer.
While more than one is alive, every guide site is recorded with the raw parameters its
distribution depends on (the leaves of its autograd graph), and each optimizer takes only the
sites whose parameters it was handed, leaving the others for their own optimizer, whatever the
order of the losses and the steps (``SVI.step`` in turn, or both losses before both steps).
The log of the loss estimate is cut into the loss runs that made it (each run: its guide's
sites, then its model's) and each optimizer takes the runs of its own guide; a run whose guide
sites belong to two optimizers gives no estimate (``None``), never a mixed one.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from pyro.distributions import constraints
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import _PYRO_STACK

from ..divergence import DivergenceError
from .gp_models import owning_gp_model

__all__ = ["GuideSite", "SiteObserver", "current", "forget", "observer"]

#: the raw parameters (ids) a guide site depends on; ``None``: not looked up (one optimizer)
Leaves = Optional[frozenset]

PARTICLE_PLATE = "num_particles_vectorized"
#: at most this many sites are kept for the loss estimate between two steps
MAX_LOG = 20_000


@dataclass
class GuideSite:
    """A guide sample site as the loss saw it: its distribution and plate context."""

    name: str
    fn: Any
    scale: float
    particles: int  # size of the vectorised-particle plate around it (1: none)
    #: the value drawn (detached) and how often the site ran since the last step
    value: Optional[torch.Tensor] = None
    runs: int = 1
    #: the raw parameters (ids) its distribution depends on, while several optimizers share
    #: the observer (else ``None``)
    leaves: Leaves = None
    #: the ``pyro.contrib.gp`` variational GP whose guide drew it (weakly; :mod:`.gp_models`)
    gp_model: Optional[weakref.ref[Any]] = None


class SiteObserver(Messenger):
    """Records the guide's sample sites (and every site's log density terms) seen since the
    last :meth:`take`; never changes a message."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Dict[Tuple[str, Leaves], GuideSite] = {}
        self.log: List[Tuple[int, Any, Any, Any, Any, str, int, Leaves]] = []
        self.broken = False

    # Messenger protocol: only sample sites are looked at
    def _process_message(self, msg: Any) -> None:
        if _STATE["users"] <= 0:  # no CVI() left: idle until it is taken off the stack
            _detach_when_safe()
            return
        if msg["type"] == "sample":
            msg.setdefault("infer", {})
            msg["_cvi_done_above"] = bool(msg["done"])

    def _postprocess_message(self, msg: Any) -> None:
        if _STATE["users"] <= 0:
            msg.pop("_cvi_done_above", None)
            return
        if msg["type"] != "sample" or type(msg["fn"]).__name__ == "_Subsample":
            msg.pop("_cvi_done_above", None)
            return
        done = bool(msg.pop("_cvi_done_above", True))
        observed = bool(msg["is_observed"])
        fn = msg["fn"]
        particles = 1
        for frame in msg["cond_indep_stack"]:
            if frame.name == PARTICLE_PLATE and frame.size is not None:
                particles = int(frame.size)
        scale = msg["scale"]
        guide = not done and not observed
        if done and not observed and torch.is_tensor(msg["value"]):
            self._check_draw(msg)
        leaves: Leaves = None
        if guide and _STATE["users"] > 1:
            leaves = _leaves(fn)
        if guide and torch.is_grad_enabled() and _has_params(fn):
            # (a model run on its own inside a custom loss samples its latent sites too:
            # their priors, without parameters, do not replace the guide's site)
            c = float(scale) if not torch.is_tensor(scale) or scale.numel() == 1 else math.nan
            key = (msg["name"], leaves)
            seen = self.sites.get(key)
            value = msg["value"].detach() if torch.is_tensor(msg["value"]) else None
            runs = 1 if seen is None else seen.runs + 1
            gp = owning_gp_model()
            self.sites[key] = GuideSite(
                msg["name"],
                fn,
                c,
                particles,
                value,
                runs,
                leaves,
                None if gp is None else weakref.ref(gp),
            )
        if len(self.log) >= MAX_LOG:  # no CVI() step for long (another optimizer runs):
            self.broken, self.log = True, []  # the loss estimate is off until the next step
        if self.broken:
            return
        enumerated = (
            msg["infer"].get("enumerate") == "parallel"
            or msg["infer"].get("_enumerate_dim") is not None
        )
        if enumerated:
            self.broken = True
            return
        sign = -1 if guide else 1
        entry = (sign, fn, msg["value"], scale, msg["mask"], msg["name"], particles, leaves)
        self.log.append(entry)

    def _check_draw(self, msg: Any) -> None:
        """Refuse a latent value replayed into the model that is not finite or is outside its
        prior's support (see the module docstring); enumerated and integer values pass."""
        value = msg["value"]
        if not value.is_floating_point() or msg["infer"].get("_enumerate_dim") is not None:
            return
        if not any(o.can_undo() for o in list(_OWNERS)):
            return  # no step to undo (AutoCVI alone, or the first loss): as before
        why = None
        with torch.no_grad():
            if not bool(torch.isfinite(value).all()):
                why = "is not finite"
            else:
                support = getattr(msg["fn"], "support", None)
                try:
                    ok = _inside(support, value)
                except (NotImplementedError, RuntimeError, ValueError, TypeError):
                    ok = True  # a dependent or unusual support: the loss checks it
                if not ok:
                    why = f"is outside the support of its prior ({support})"
        if why is None:
            return
        leaves = frozenset().union(*[k[1] for k in self.sites if k[1] is not None])
        owners = [o for o in list(_OWNERS) if _STATE["users"] <= 1 or o.owns(leaves)]
        notes = [n for n in (o.refuse_draw() for o in owners) if n is not None]
        if not notes:  # no optimizer that steps Pyro's Gaussians: the loss goes on as before
            return
        self.sites, self.log, self.broken = {}, [], False  # this loss run is abandoned
        raise DivergenceError(
            f"CVI(): the guide drew a value of the latent site {msg['name']!r} that {why} "
            f"(in {value.dtype}): q is too wide or too far out there to be evaluated. "
            + " ".join(n for n in notes if n)
            + " Fixes: the adaptive CVI() instead of a fixed step_size (or a smaller one), a "
            "smaller init_scale of the guide, init_loc_fn=... inside the support, or float64."
        )

    def take(self, params: Optional[Sequence[torch.Tensor]] = None) -> Dict[str, GuideSite]:
        """The guide sites seen since the last call (and forget them); with ``params``, only
        those whose distribution depends on one of them (the others are kept for the
        optimizer they belong to)."""
        mine = _ids(params)
        taken: Dict[str, GuideSite] = {}
        for key in list(self.sites):
            site = self.sites[key]
            if mine is None or site.leaves is None or site.leaves & mine:
                del self.sites[key]
                taken[site.name] = site
        return taken

    def take_log(self, params: Optional[Sequence[torch.Tensor]]) -> Optional[List[Tuple]]:
        """The loss runs of the log that belong to ``params`` (all, without them), taken out
        of it; ``None`` where a run's guide sites belong to ``params`` and to others."""
        mine = _ids(params)
        log, broken = self.log, self.broken
        if mine is None or all(e[7] is None for e in log):
            self.log, self.broken = [], False
            return None if broken else log
        runs: List[List[Tuple]] = []
        for e in log:  # a run: guide sites (sign -1), then the model's (sign +1)
            if not runs or (e[0] < 0 and runs[-1][-1][0] > 0):
                runs.append([])
            runs[-1].append(e)
        kept: List[Tuple] = []
        rest: List[Tuple] = []
        mixed = False
        for run in runs:
            owners = [e[7] & mine for e in run if e[0] < 0 and e[7]]
            if any(owners) and not all(owners):
                mixed = True
            (kept if any(owners) else rest).extend(run)
        self.log, self.broken = rest, broken and bool(rest)
        return None if broken or mixed else kept

    def take_loss(self, params: Optional[Sequence[torch.Tensor]] = None) -> Optional[float]:
        """The ``-ELBO`` estimate of what was seen since the last call (of the loss runs whose
        guide ``params`` feed, with them), or ``None``."""
        log = self.take_log(params)
        if not log or not any(e[0] > 0 for e in log):
            return None
        # the loss ran every site equally often (its particles); sites run outside it (a
        # guide called on its own to set it up) are the earlier extra occurrences
        # (by guide or model and name: a latent site has one entry of each per run)
        by_name: Dict[Tuple[int, str], List[int]] = {}
        for i, entry in enumerate(log):
            by_name.setdefault((entry[0], entry[5]), []).append(i)
        runs = min(len(v) for v in by_name.values())
        kept = sorted(i for v in by_name.values() for i in v[len(v) - runs :])
        if not any(log[i][0] > 0 for i in kept):
            return None
        total = 0.0
        particles = 1
        with torch.no_grad():
            for i in kept:
                sign, fn, value, scale, mask, name, particles, _ = log[i]
                try:
                    lp = fn.log_prob(value)
                except (ValueError, RuntimeError):
                    return None
                if mask is not None and mask is not True:
                    if mask is False:
                        continue
                    lp = torch.where(mask, lp, torch.zeros_like(lp))
                total += sign * float((lp * scale).sum())
        return -total / (runs * particles)


def _inside(support: Any, value: torch.Tensor) -> bool:
    """Whether ``value`` lies in ``support`` as the guide's map onto it reaches it: a bound
    (``positive``, ``nonnegative``, ``greater_than``) strictly (``exp`` never reaches it; a
    value on it underflowed), any other support by its own check; the real line always."""
    base = support
    while isinstance(base, constraints.independent):
        base = base.base_constraint
    if base is None or base is constraints.real:
        return True
    if isinstance(base, (constraints.greater_than, constraints.greater_than_eq)):
        return bool((value > base.lower_bound).all())
    if isinstance(base, constraints.less_than):
        return bool((value < base.upper_bound).all())
    return bool(support.check(value).all())


def _has_params(fn: Any, depth: int = 0) -> bool:
    """Whether a tensor of the distribution (or of one it wraps) requires grad."""
    if depth > 8:
        return False
    for v in vars(fn).values():
        if torch.is_tensor(v):
            if v.requires_grad:
                return True
        elif isinstance(v, torch.distributions.Distribution) and _has_params(v, depth + 1):
            return True
    return False


_STATE: Dict[str, Any] = {"observer": None, "users": 0}
#: the live ``CVI()`` optimizers (:meth:`SiteObserver._check_draw` asks them to undo a step)
_OWNERS: weakref.WeakSet[Any] = weakref.WeakSet()


def observer(owner: object) -> SiteObserver:
    """The shared observer, put at the bottom of Pyro's stack while ``owner`` lives."""
    obs = _STATE["observer"]
    if obs is None:
        obs = SiteObserver()
        _STATE["observer"] = obs
    if obs not in _PYRO_STACK:
        _PYRO_STACK.insert(0, obs)
    # what was seen before this owner existed belongs to no step of it
    obs.take()
    obs.log, obs.broken = [], False
    _STATE["users"] += 1
    if hasattr(owner, "refuse_draw") and hasattr(owner, "can_undo"):
        _OWNERS.add(owner)
    weakref.finalize(owner, _release)
    return obs


def _release() -> None:
    """A ``CVI()`` was garbage-collected: the last one takes the observer off the stack."""
    _STATE["users"] -= 1
    if _STATE["users"] <= 0:
        _STATE["users"] = 0
        _detach_when_safe()


def _detach_when_safe() -> None:
    """Take the unused observer off Pyro's stack, now if nothing else is on it, else at the
    next site that runs with nothing above it. A garbage collection (hence :func:`_release`)
    can run inside Pyro's ``apply_stack`` while it walks the stack top to bottom; removing the
    bottom entry then shifts the walk by one and the handler it is in runs twice (a plate
    adds its frame twice: a "dim collision"). With nothing above the observer, the walk is at
    its last entry and ends."""
    obs = _STATE["observer"]
    if obs is None or obs not in _PYRO_STACK:
        return
    if all(m is obs for m in _PYRO_STACK):
        while obs in _PYRO_STACK:
            _PYRO_STACK.remove(obs)
    # else: the observer stays, idle, until the check in its own message handling


def current() -> Optional[SiteObserver]:
    """The shared observer, if one was made."""
    obs = _STATE["observer"]
    return obs if isinstance(obs, SiteObserver) else None


def forget(params: Optional[Sequence[torch.Tensor]] = None) -> None:
    """Drop the log of the loss's sites (of the runs ``params`` feed, with them): no loss
    estimate is needed this step."""
    obs = current()
    if obs is not None:
        obs.take_log(params)


def _ids(params: Optional[Sequence[torch.Tensor]]) -> Optional[frozenset]:
    """The ids of ``params``; ``None`` (take everything) without them or while only one
    optimizer uses the observer."""
    if params is None or _STATE["users"] <= 1:
        return None
    return frozenset(id(p) for p in params)


#: at most this many autograd nodes are walked for a site's parameters
MAX_NODES = 10_000


def _leaves(fn: Any) -> frozenset:
    """The ids of the leaf tensors that require grad (the raw parameters) on the autograd
    graphs of the distribution's tensors (and of those of the distributions it wraps)."""
    found = set()
    seen = set()
    stack: List[Any] = []
    dists = [fn]
    while dists and len(dists) < 64:
        d = dists.pop()
        for v in vars(d).values():
            if torch.is_tensor(v) and v.requires_grad:
                if v.grad_fn is None:
                    found.add(id(v))
                else:
                    stack.append(v.grad_fn)
            elif isinstance(v, torch.distributions.Distribution):
                dists.append(v)
    while stack and len(seen) < MAX_NODES:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(f for f, _ in node.next_functions)
    return frozenset(found)
