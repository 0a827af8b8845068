"""Recognising Markov Gaussian priors in a traced Pyro model, in O(T) (used by the analysis).

Two forms, both turned into one :class:`ChainSpec` (states ``x (T, d)``):

* **ssm**: one site whose distribution is a
  :class:`~pyro_cvi.statespace.distribution.LinearGaussianSSM` (e.g. ``MarkovGP``);
* **hmm**: one site whose distribution is Pyro's ``dist.GaussianHMM`` (no batch dims): the
  chain of ``(z_t, y_t)`` with the hidden ``z`` summed out (:mod:`~pyro_cvi.statespace.hmm`);
* **loop**: a ``pyro.markov`` loop of Normal sites ``x_t ~ Normal(A_t x_{t-1} + b_t, Q_t)``
  (scalar, ``.to_event(1)`` or MVN): every site's prior depends on its predecessor only
  (read off autograd, structural), each site has one successor, and the transition is
  confirmed affine by one probe run at a random joint perturbation.

Observation factors must have their linked parameter affine in the states, each element in
one step: ``eta_r = h_r' x_{t_r} + c_r``. ``(t_r, h_r)`` come from Jacobian-vector products
on the analysis' leaf trace (O(T), no dense Jacobian) and are confirmed by the same probe run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import torch

from ..model import probes
from ..model.tracing import describe_link, latent_weight, linear_candidates, linear_param, unwrap
from .distribution import LinearGaussianSSM
from .hmm import HiddenStates, hmm_chain, is_gaussian_hmm
from .increments import Increments
from .kalman import LinearGaussianChain

__all__ = [
    "ChainSpec",
    "find_chains",
    "prepare_loop",
    "probe_loop",
    "chain_prior",
    "loop_transitions",
    "observation_rows",
    "confirm_affine",
    "depends",
    "observation_factor",
    "loop_weights",
    "tempered_constant",
]

MIN_LOOP_LENGTH = 3


@dataclass
class ChainSpec:
    """A Markov Gaussian chain: its sites in time order, state dim, length and form."""

    names: Tuple[str, ...]
    state_dim: int
    length: int
    ssm: bool
    A: Optional[torch.Tensor] = None  # loop transitions (T-1, d, d), when static
    dynamic: bool = False  # loop transitions depend on learnable parameters
    #: a random walk (:class:`Increments`: the one site holds diff(x)) or a GaussianHMM
    #: (:class:`HiddenStates`: the one site holds the observed part of the states)
    increments: Optional[Union[Increments, HiddenStates]] = None
    probe: Optional[tuple] = None  # (dx, moved trace) of the detection, reused by the analysis
    observations: Dict[str, tuple] = field(default_factory=dict)  # confirmed at detection
    #: a loop with a weighted prior (``poutine.scale``) that the Kalman block tempers
    weighted: bool = False
    #: global discrete latents with a mean-field ``q`` that select the loop's Normal factors'
    #: parameters (:func:`regimes_of`; the expected prior of :mod:`~pyro_cvi.blocks.regime_markov`)
    regimes: Tuple[str, ...] = ()

    @property
    def size_text(self) -> str:
        return f"T={self.length}, d={self.state_dim}"

    def states(self, z: torch.Tensor) -> torch.Tensor:
        """The states ``(T, d)`` of the block's joint z (a random walk: ``cumsum``)."""
        if self.increments is not None:
            return self.increments.states(z)
        return z.reshape(self.length, self.state_dim)

    def takes_weights(self, trace) -> bool:
        """Whether the Kalman block can temper this chain's weighted prior
        (:func:`tempered_weights_supported`); marks the chain weighted if so."""
        self.weighted = tempered_weights_supported(self, trace)
        return self.weighted

    def lift(self, dx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A direction on the states ``(T, d)`` as a direction on the one site ``like``."""
        if self.increments is not None:
            return self.increments.increments(dx).reshape(like.shape)
        return dx.reshape(like.shape)


def _normal_site(fn) -> bool:
    """A Normal / Independent(Normal) / MVN site with no batch dims and a vector event."""
    base, mask, _ = unwrap(fn)
    if mask is not None or len(fn.batch_shape) or len(fn.event_shape) > 1:
        return False
    return isinstance(base, (torch.distributions.MultivariateNormal, torch.distributions.Normal))


def _normal_parts(fn):
    """``(loc (d,), cov (d, d))`` of a Normal / Independent(Normal) / MVN site, else None."""
    if not _normal_site(fn):
        return None
    base = unwrap(fn)[0]
    shape = fn.event_shape
    d = int(shape.numel())
    if isinstance(base, torch.distributions.MultivariateNormal):
        return base.loc.expand(shape).reshape(d), base.covariance_matrix.reshape(d, d)
    if type(base) is torch.distributions.Normal or isinstance(base, torch.distributions.Normal):
        loc = base.loc.expand(shape).reshape(d)
        var = (base.scale**2).expand(shape).reshape(d)
        return loc, torch.diag_embed(var)
    return None


def find_chains(an) -> List[ChainSpec]:
    """Every Markov chain of the model (see the module docstring); ``an`` is the Analysis."""
    tr = an.structure
    latents = [n for n in an.values if n in an.continuous]
    out = []
    for n in latents:
        fn = tr.nodes[n]["fn"]
        base = unwrap(fn)[0]
        if isinstance(base, LinearGaussianSSM) and not an.deps.get(n):
            T, d = fn.event_shape
            out.append(ChainSpec((n,), int(d), int(T), True))
        elif is_gaussian_hmm(base) and not an.deps.get(n) and not len(fn.batch_shape):
            T, k = fn.event_shape
            lay = HiddenStates(int(T), int(base.hidden_dim), int(k))
            out.append(ChainSpec((n,), lay.state_dim, lay.length, False, increments=lay))
    used = {c.names[0] for c in out}
    cand = [n for n in latents if n not in used and _normal_site(tr.nodes[n]["fn"])]
    cset = set(cand)
    free = _regime_candidates(an)
    parent: Dict[str, str] = {}
    children: Dict[str, List[str]] = {n: [] for n in cand}
    for n in cand:
        deps = an.deps.get(n, set()) - free
        if len(deps) == 1 and next(iter(deps)) in cset:
            (p,) = deps
            parent[n] = p
            children[p].append(n)
    for root in cand:
        if root in parent or an.deps.get(root, set()) - free:
            continue
        names, cur = [root], root
        while len(children[cur]) == 1:
            cur = children[cur][0]
            names.append(cur)
        if len(names) < MIN_LOOP_LENGTH or len(children[cur]) > 1:
            continue
        shapes = {tuple(tr.nodes[m]["fn"].event_shape) for m in names}
        if len(shapes) != 1:
            continue
        regimes = regimes_of(an, set(names), free)
        if regimes is not None and _closed(an, set(names), set(regimes)):
            d = int(torch.Size(shapes.pop()).numel())
            out.append(ChainSpec(tuple(names), d, len(names), False, regimes=regimes))
    return out


def _regime_candidates(an) -> set:
    """The discrete latents that may select a loop's parameters: global (in no vectorised
    plate), with a mean-field ``q`` (not summed out), unmarked for enumeration."""
    out = set()
    for c in an.discrete - an.collapsed:
        site = an.structure.nodes[c]
        if not any(f.vectorized for f in site["cond_indep_stack"]):
            out.add(c)
    return out


def regimes_of(an, names: set, free: set) -> Optional[Tuple[str, ...]]:
    """The discrete parents ``s`` (of ``free``) of the loop ``names``' factors, or ``None``
    where a factor reading one of them is neither a Normal transition nor an observation with
    a linear-predictor parameter (no mask): those chains keep the mean field. Only one regime
    latent, with no parent of its own, is taken (the expected prior of one categorical q)."""
    found = set()
    for site, deps in an.deps.items():
        if site in an.leaves or not (deps & names or site in names):
            continue
        hit = deps & free
        if not hit:
            continue
        node = an.structure.nodes[site]
        base, mask, _ = unwrap(node["fn"])
        if mask is not None or node["mask"] is not None:
            return None
        if site in names and not isinstance(base, torch.distributions.Normal):
            return None
        if site not in names and not (node["is_observed"] and linear_param(base) is not None):
            return None
        found |= hit
    if len(found) > 1 or any(an.deps.get(c) for c in found):
        return None
    for n in names if found else ():  # (the block reads every step's Normal loc and scale)
        node = an.structure.nodes[n]
        plain = isinstance(unwrap(node["fn"])[0], torch.distributions.Normal)
        if not plain or latent_weight(node) is not None:
            return None
    return tuple(sorted(found))


def _closed(an, names: set, regimes: set = frozenset()) -> bool:
    """Every factor touching the chain depends on chain sites only (and its regimes), at most
    one besides its own predecessor link (observations of one step)."""
    for site, deps in an.deps.items():
        if site in an.leaves:
            continue
        touch = deps & names
        if not touch or site in names:
            continue
        if deps - names - regimes or len(touch) > 1:
            return False
    return True


def loop_transitions(names, trace, leaves, create_graph: bool = False) -> torch.Tensor:
    """``A_t = d loc_t / d x_{t-1}`` for every step of a loop, one backward pass per state
    component (the chain's locs depend on their own predecessor only)."""
    locs = torch.stack([_normal_parts(trace.nodes[n]["fn"])[0] for n in names[1:]])  # (T-1,d)
    prev = [leaves[n] for n in names[:-1]]
    d = locs.shape[-1]
    rows = []
    for k in range(d):
        gs = torch.autograd.grad(
            locs[:, k].sum(), prev, retain_graph=True, create_graph=create_graph, allow_unused=True
        )
        rows.append(torch.stack([g.reshape(d) if g is not None else locs.new_zeros(d) for g in gs]))
    return torch.stack(rows, 1)  # (T-1, d, d): row k of A_t


def prepare_loop(spec: ChainSpec, trace, leaves, moved, label: str) -> None:
    """Read a loop's transitions off the leaf trace (static, or ``dynamic`` when they depend
    on learnable parameters) and confirm them affine on the probe run ``moved``."""
    spec.A = loop_transitions(spec.names, trace, leaves).detach()
    params = [s["value"] for s in trace.nodes.values() if s["type"] == "param"]
    locs = [_normal_parts(trace.nodes[n]["fn"])[0] for n in spec.names[1:]]
    zs = [leaves[n] for n in spec.names]
    spec.dynamic = any(probes.depends_on_params(v, zs, params) for v in locs)
    ref, new = chain_prior(spec, trace), chain_prior(spec, moved)
    if not probes.close(new.b, ref.b, probes.rtol(ref.b.dtype)):
        raise ValueError(
            f"sites {label}: the Normal chain's loc is not affine in the previous state "
            "(probed); write x_t ~ Normal(a * x_(t-1) + b, q)"
        )


def probe_loop(an, spec: ChainSpec) -> bool:
    """:func:`prepare_loop` at a probe run of its own (a random move of every state), for a
    loop whose first site's prior no chain factor reads (shared with another block); ``False``
    where the transitions are not affine."""
    tr, leaves = an.leaf_trace()
    g = torch.Generator().manual_seed(13)
    moves = {
        n: torch.randn(an.ref[n].shape, generator=g, dtype=torch.float64, device=g.device)
        for n in spec.names
    }
    with torch.no_grad():
        moved = an.run(**{n: an.ref[n] + v.to(an.ref[n]) for n, v in moves.items()})
    try:
        with torch.enable_grad():
            prepare_loop(spec, tr, leaves, moved, spec.names[0])
    except ValueError:
        return False
    return True


def chain_prior(spec: ChainSpec, trace, A: Optional[torch.Tensor] = None) -> LinearGaussianChain:
    """The chain's prior read off a trace (loops: ``b_t = loc_t - A_t x_{t-1}`` at the trace's
    values, with the given or stored transitions ``A``)."""
    if spec.ssm:
        return unwrap(trace.nodes[spec.names[0]]["fn"])[0].chain
    if isinstance(spec.increments, HiddenStates):
        return hmm_chain(unwrap(trace.nodes[spec.names[0]]["fn"])[0])
    if spec.increments is not None:
        return spec.increments.prior([unwrap(trace.nodes[n]["fn"])[0] for n in spec.names])
    parts = [_normal_parts(trace.nodes[n]["fn"]) for n in spec.names]
    weights = loop_weights(spec, trace)
    if weights is not None:  # p^c: the same Normal with its covariance divided by c
        parts = [
            (loc, cov if w is None else cov * torch.outer(w, w).rsqrt().to(cov))
            for (loc, cov), w in zip(parts, weights)
        ]
    m0, P0 = parts[0]
    A = spec.A if A is None else A
    x = torch.stack([trace.nodes[n]["value"].reshape(spec.state_dim) for n in spec.names])
    locs = torch.stack([p[0] for p in parts[1:]])
    b = locs - (A @ x[:-1].unsqueeze(-1)).squeeze(-1)
    Q = torch.stack([p[1] for p in parts[1:]])
    return LinearGaussianChain(m0, P0, A.to(locs), b, Q)


def loop_weights(spec: ChainSpec, trace) -> Optional[List[Optional[torch.Tensor]]]:
    """The positive weight per state element (``(d,)``, float64) that Trace_ELBO gives each
    site of a loop's prior (``poutine.scale``; :func:`~pyro_cvi.model.tracing.latent_weight`),
    ``None`` for an unweighted site; ``None`` when no site is weighted. A tempered Normal
    ``N(x | mu, S)^c`` is ``N(x | mu, S / c)`` times a constant (:func:`tempered_constant`)
    where ``c`` is one weight for the whole event (an MVN) or one per independent element."""
    if not spec.weighted:
        return None
    out: List[Optional[torch.Tensor]] = []
    for n in spec.names:
        site = trace.nodes[n]
        w = latent_weight(site)
        if w is not None:
            full = isinstance(unwrap(site["fn"])[0], torch.distributions.MultivariateNormal)
            w = w.to(torch.float64)
            w = w.expand(spec.state_dim) if full or w.numel() == 1 else w.reshape(spec.state_dim)
        out.append(w)
    return out if any(w is not None for w in out) else None


def tempered_weights_supported(spec: ChainSpec, trace) -> bool:
    """Whether the Kalman block can weigh this chain's prior: a loop whose weights are positive,
    one per element of a diagonal Normal or one for an MVN's whole event (not a masked-out
    transition: its state would have no prior factor)."""
    if spec.ssm or spec.increments is not None:
        return False
    for n in spec.names:
        site = trace.nodes[n]
        w = latent_weight(site)
        if w is None:
            continue
        full = isinstance(unwrap(site["fn"])[0], torch.distributions.MultivariateNormal)
        if not bool((w > 0).all()) or (full and bool((w != w.flatten()[0]).any())):
            return False
        if not full and w.numel() not in (1, spec.state_dim):
            return False
    return True


def tempered_constant(spec: ChainSpec, trace) -> Optional[torch.Tensor]:
    """``sum_t [c_t log N(x_t | mu_t, S_t) - log N(x_t | mu_t, S_t / c_t)]``, free of ``x``: per
    element ``-(c - 1) log(2 pi s) / 2 - log(c) / 2`` for a diagonal Normal, and
    ``-(c - 1) (d log 2 pi + log det S) / 2 - d log(c) / 2`` for an MVN; ``None`` when no site is
    weighted. The ELBO of the tempered chain is the Kalman block's bound plus this."""
    weights = loop_weights(spec, trace)
    if weights is None:
        return None
    total = None
    for n, w in zip(spec.names, weights):
        if w is None:
            continue
        loc, cov = _normal_parts(trace.nodes[n]["fn"])
        w = w.to(cov)
        if isinstance(unwrap(trace.nodes[n]["fn"])[0], torch.distributions.MultivariateNormal):
            c, d = w[0], cov.shape[-1]
            log_norm = d * math.log(2 * math.pi) + torch.logdet(cov)
            term = -0.5 * (c - 1) * log_norm - 0.5 * d * torch.log(c)
        else:
            var = torch.diagonal(cov)
            term = (-0.5 * (w - 1) * torch.log(2 * math.pi * var) - 0.5 * torch.log(w)).sum()
        total = term if total is None else total + term
    return total


#: the margin over the tolerance of :func:`_spans_steps`'s early refusal (the full check decides
#: anything closer)
SPAN_MARGIN = 100.0


def _spans_steps(spec: ChainSpec, flat: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether the first element of ``flat`` clearly depends on two steps of the chain: its
    gradient in the states (one backward pass, none for ``X @ x``: ``X``'s first row; and the
    adjoint of :meth:`ChainSpec.lift`) has
    entries above ``SPAN_MARGIN`` times the tolerance at two steps. A cheap early refusal
    before the ``d + 2`` passes of :func:`observation_rows` (a softmax regression's weight
    matrix, read as a random walk along either dim, is refused here)."""
    X = probes.matvec_matrix(flat, x, views=True)  # flat = X @ x: its first row, as it is
    if X is not None:
        g = X[0].reshape(x.shape)
    else:
        (g,) = torch.autograd.grad(flat[0], x, retain_graph=True, allow_unused=True)
    if g is None:
        return False
    dx = x.new_zeros(spec.length, spec.state_dim, requires_grad=True)
    with torch.enable_grad():
        (gs,) = torch.autograd.grad((spec.lift(dx, x) * g.detach()).sum(), dx, allow_unused=True)
    if gs is None or not bool(torch.isfinite(gs).all()):
        return False
    per_step = gs.abs().amax(-1)
    floor = SPAN_MARGIN * probes.rtol(x.dtype) * (1.0 + float(per_step.max()))
    return int((per_step > floor).sum()) >= 2


def observation_rows(
    spec: ChainSpec, value: torch.Tensor, leaves, create_graph: bool = False
) -> Tuple[torch.Tensor, ...]:
    """``(t_r, h_r)`` of ``eta = value`` (flattened) on the leaf trace: ``eta_r`` depends on
    ``x_{t_r}`` only, with gradient ``h_r``. Returns ``(time_index (R,), H (R, d))``, or
    raises ``ValueError`` when an element depends on two steps. With ``create_graph``, ``H``
    keeps its graph to learnable parameters (an observation coefficient ``h(theta)``)."""
    flat = value.reshape(-1)
    R, d, T = flat.numel(), spec.state_dim, spec.length
    if not spec.ssm and spec.increments is None:
        (touched,) = [n for n in spec.names if depends(flat, leaves[n])]
        t = spec.names.index(touched)
        H = probes.jacobian(flat, leaves[touched], create_graph=create_graph).reshape(R, d)
        return torch.full((R,), t, dtype=torch.long, device=flat.device), H
    if len(spec.names) > 1:  # (a nested walk's several sites)
        return spec.increments.rows(flat, [leaves[n] for n in spec.names], create_graph)
    x = leaves[spec.names[0]]
    if _spans_steps(spec, flat, x):
        raise ValueError("an element depends on more than one step")
    u = torch.zeros_like(flat, requires_grad=True)
    # (a scalar output, not grad_outputs=u: torch imports sympy for explicit grad_outputs)
    (vjp,) = torch.autograd.grad((flat * u).sum(), x, create_graph=True)

    def jvp(dx, graph=False):  # J_x dx, dx on the states (T, d)
        (out,) = torch.autograd.grad(
            (vjp * spec.lift(dx, x)).sum(), u, retain_graph=True, create_graph=graph
        )
        return out if graph else out.detach()

    H = torch.stack(
        [jvp(_component(x.new_zeros(T, d), k), create_graph) for k in range(d)], -1
    )  # (R, d)
    g = torch.Generator().manual_seed(3)
    weights = torch.rand(d, generator=g, dtype=x.dtype, device=g.device).to(x) + 0.5
    steps = torch.arange(1, T + 1, dtype=x.dtype, device=x.device)[:, None] * weights
    denom = H @ weights
    ratio = jvp(steps) / torch.where(denom == 0, torch.ones_like(denom), denom)
    t = torch.where(denom == 0, torch.zeros_like(ratio), ratio - 1).round().long().clamp(0, T - 1)
    g = torch.Generator().manual_seed(5)
    check = torch.randn(T, d, generator=g, dtype=x.dtype, device=g.device).to(x)
    if not probes.close(jvp(check), (H.detach() * check[t]).sum(-1), probes.rtol(x.dtype)):
        raise ValueError("an element depends on more than one step")
    return t, H


def _component(x, k):
    e = torch.zeros_like(x)
    e[..., k] = 1.0
    return e


def depends(value, leaf) -> bool:
    (g,) = torch.autograd.grad(value.sum(), leaf, retain_graph=True, allow_unused=True)
    return g is not None


def confirm_affine(spec, rows, eta_at, eta_moved, dx) -> bool:
    """One probe: ``eta(x + dx) = eta(x) + h_r' dx_{t_r}`` for every element."""
    t, H = rows
    pred = eta_at.reshape(-1) + (H * dx[t]).sum(-1)
    return probes.close(eta_moved.reshape(-1), pred, probes.rtol(eta_at.dtype))


def observation_factor(site: str, spec: ChainSpec, base, trace, leaves, moved, dx):
    """An observation of a chain: one of its parameters, through a link (``param = g(eta)``,
    :data:`~pyro_cvi.model.tracing.LINKS`), must be affine in one step's state per element,
    its other parameters free of the states. Returns ``(param name, (t, H), why, dynamic,
    link)``; ``dynamic``: ``H`` depends on learnable parameters (recomputed every step);
    ``link``: ``None`` for a registered likelihood's own parameter."""
    kind_name = type(base).__name__
    advice = "an observation of a Markov chain needs a likelihood one of whose parameters"
    zs = [leaves[n] for n in spec.names]
    with torch.enable_grad():
        candidates = linear_candidates(base, zs)
    if not candidates:
        raise ValueError(
            f"site {site!r}: {kind_name}: {advice} carries the states (the others free of them)"
        )
    problems = []
    for name, link in candidates:
        value = linear_param(base, name, link)[1]
        with torch.enable_grad():
            try:
                rows = observation_rows(spec, value, leaves)
            except (ValueError, RuntimeError) as e:
                problems.append(f"{describe_link(base, name, link)}: {e}")
                continue
            params = [s["value"] for s in trace.nodes.values() if s["type"] == "param"]
            dynamic = probes.depends_on_params(value, zs, params)
        eta_moved = linear_param(unwrap(moved.nodes[site]["fn"])[0], name, link)[1]
        if not confirm_affine(spec, rows, value.detach(), eta_moved, dx):
            problems.append(f"{describe_link(base, name, link)} is not affine in the states")
            continue
        how = describe_link(base, name, link)
        eq = f"{how} with . = h' x_t + c" if link is not None else f"{how} = h' x_t + c"
        why = f"{kind_name} {eq} (probed); {rows[0].numel()} sites"
        return name, (rows[0], rows[1].detach()), why, dynamic, link
    raise ValueError(
        f"site {site!r}: {kind_name}: {advice}, through a link, is affine in one step's state "
        f"per element ({'; '.join(problems)})"
    )
