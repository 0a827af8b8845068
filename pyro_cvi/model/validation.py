"""Input checks that turn silent numerical failures into errors naming the site and the fix.

As Pyro's ``validate_args``, observations are checked against their distribution's support
(a Bernoulli ``y = 2``, a Poisson count of ``-3``), and beyond it: non-finite observations
outside any mask, values whose square overflows the dtype, non-finite coefficients of a linear
predictor (``inf`` in ``X``), and, when the model itself fails, the failure is explained in
terms of the data (:func:`explained`: which argument holds NaN, an empty plate, a dtype or a
shape that changed since the guide was built).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.poutine.trace_struct import Trace

from .tracing import LOG_PROB_KEY, is_random, linear_param, unwrap

__all__ = [
    "check_analysis",
    "check_observations",
    "check_structure",
    "check_targets",
    "data_shapes",
    "explained",
    "per_index",
]


def check_analysis(analysis, structure, args=(), kwargs=None) -> None:
    """The checks of a fresh analysis (new data): its observations (:func:`check_observations`)
    and, where a data argument holds inf or NaN, the linear predictors ``eta = A z + c`` of the
    observed sites, which must then be finite (an infinite covariate gives an infinite ``eta``
    that no distribution refuses: the loss would be ``nan``)."""
    _refuse_latent_units(analysis.structure, analysis.values)
    check_observations(analysis.structure, structure)
    bad_args = [(n, a) for n, a in _data_tensors(args, kwargs or {}) if not all_finite(a)]
    if not bad_args:
        _check_densities(analysis.structure, structure)
        return
    arg, a = bad_args[0]
    j = _first(~torch.isfinite(a))
    where = f"the model's {arg} is {float(a[tuple(j)])} at index {j}"
    for name, site in analysis.structure.nodes.items():
        if not is_random(site) or not site["is_observed"] or name not in structure:
            continue
        base = unwrap(site["fn"])[0]
        lin = linear_param(base)
        if lin is None or not lin[1].is_floating_point():
            continue
        bad = ~torch.isfinite(lin[1])
        if bool(bad.any()):
            i = _first(bad)
            value = float(lin[1][tuple(i)].detach())
            raise ValueError(
                f"site {name!r}: its {type(base).__name__} {lin[0]} is {value} "
                f"at index {i}: {where}. Remove or impute the non-finite inputs."
            )
    for spec in analysis.blocks:
        for f in spec.factors:
            A = f.jacobian
            if A is None or not A.is_floating_point() or bool(torch.isfinite(A).all()):
                continue
            row, col = (~torch.isfinite(A)).nonzero()[0].tolist()
            raise ValueError(
                f"site {f.site!r}: its linear predictor has a non-finite coefficient (row {row}, "
                f"coefficient of {spec.label} element {col}): {where}. Remove or impute the "
                "non-finite inputs."
            )
    _check_densities(analysis.structure, structure)


def all_finite(a: torch.Tensor) -> bool:
    """Whether every element of a floating tensor is finite (integers: always). A finite sum
    proves it (an ``inf`` or ``nan`` element makes the sum ``inf`` or ``nan``), at the cost of
    one reduction; a sum that is not finite (one of them, or an overflow) is checked element
    by element."""
    if not a.is_floating_point():
        return True
    if a.layout == torch.strided and a.numel() and bool(torch.isfinite(a.sum())):
        return True
    return bool(torch.isfinite(a).all())


def _refuse_latent_units(trace: Trace, latents) -> None:
    """A ``dist.Unit`` site sampled without ``obs`` is a bare log factor that Pyro's ELBOs read
    only through a guide that samples it: AutoCVI would give it no ``q`` and drop its factor
    (a wrong posterior that looks right). Refused by name, with the spelling that observes it."""
    for name in latents:  # (the analysis trace conditions them: ``latents`` says which)
        if isinstance(unwrap(trace.nodes[name]["fn"])[0], dist.Unit):
            raise NotImplementedError(
                f"site {name!r} is a dist.Unit (a bare log factor) sampled without obs: it "
                "has no latent value for a q to hold, and its log factor would be dropped. "
                f"Write it as pyro.factor({name!r}, log_factor), which observes it, or pass "
                "obs= to pyro.sample."
            )


def _scores_per_batch(fn, value) -> bool:
    """Whether ``fn`` scores ``value`` with one term per batch element (a value longer than the
    event shape suggests, that the law itself reads whole: ``DiscreteHMM`` over T steps)."""
    try:
        lp = fn.log_prob(value)
    except Exception:
        return False
    return torch.is_tensor(lp) and tuple(lp.shape) == tuple(fn.batch_shape)


def _explain_transposed(trace: Trace, name: str, v: torch.Tensor, expected) -> None:
    """An observation that does not fit its distribution because a design matrix was passed
    transposed: an argument of shape ``(D, N)`` where ``N`` is the number of observations and
    ``D`` the distribution's batch size. Raise an error that says so."""
    inputs = trace.nodes.get("_INPUT", {})
    if v.dim() != 1 or len(expected) != 1:
        return
    n, d = v.shape[0], expected[0]
    found = [
        (label, a)
        for label, a in _data_tensors(inputs.get("args", ()), inputs.get("kwargs", {}))
        if a.dim() == 2 and tuple(a.shape) == (d, n) and d != n
    ]
    if found:
        label, a = found[0]
        raise ValueError(
            f"observed site {name!r} has shape {tuple(v.shape)} but its distribution has "
            f"shape {tuple(expected)}: the model's {label} has shape {tuple(a.shape)}, which "
            f"looks transposed (its {n} columns match the {n} observations of {name!r}, and "
            f"its {d} rows made the distribution's {d}). Pass it with one row per "
            f"observation, its transpose (e.g. X.T, of shape {(n, d)})."
        )


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
        if not _broadcasts_into(v.shape, expected) and not _scores_per_batch(site["fn"], v):
            _explain_transposed(trace, name, v, expected)
            raise ValueError(
                f"observed site {name!r} has shape {tuple(v.shape)} but its distribution has "
                f"shape {tuple(expected)} (batch {tuple(site['fn'].batch_shape)}, event "
                f"{tuple(site['fn'].event_shape)}); reshape the data to match, e.g. y.reshape(-1)"
                " for a column vector, or use .to_event() for event dims"
            )
        mask = site["mask"]
        if v.is_floating_point():
            bad = _masked(~torch.isfinite(v), mask)
            if bool(bad.any()):
                raise ValueError(
                    f"observed site {name!r} has a non-finite value (first at index "
                    f"{_first(bad)}). Remove or impute those observations, or mark them "
                    "missing with pyro.sample(..., obs_mask=torch.isfinite(y))."
                )
            big = torch.finfo(v.dtype).max ** 0.5
            bad = _masked(v.abs() > big, mask)
            if bool(bad.any()):
                i = _first(bad)
                raise ValueError(
                    f"observed site {name!r} has the value {float(v[tuple(i)]):.3g} at index {i}, "
                    f"beyond {big:.3g}: its square overflows {v.dtype} and the ELBO cannot be "
                    "evaluated. Rescale the data (e.g. standardise y)."
                )
        _check_support(name, site, v, mask)


def _masked(bad: torch.Tensor, mask) -> torch.Tensor:
    """``bad`` where the site's mask is on (entries masked out, e.g. by obs_mask, are free)."""
    if torch.is_tensor(mask):
        bad = bad & mask.reshape(mask.shape + (1,) * (bad.dim() - mask.dim()))
    return bad


def _first(bad: torch.Tensor) -> list:
    return bad.nonzero()[0].tolist() if bad.dim() else []


def _check_support(name: str, site, v: torch.Tensor, mask) -> None:
    """Pyro's support check of an observation, with the site and index named."""
    fn = site["fn"]
    try:
        support = fn.support
    except NotImplementedError:
        return
    if constraints.is_dependent(support):
        return
    try:
        ok = support.check(v)
    except (RuntimeError, TypeError, ValueError):
        return
    bad = _masked(~ok.reshape(ok.shape + (1,) * (v.dim() - ok.dim())), mask)
    if bool(bad.any()):
        i = _first(bad)
        shown = v[tuple(i)] if len(i) <= v.dim() else v
        raise ValueError(
            f"observed site {name!r} has a value outside the support of its distribution "
            f"{type(fn).__name__} ({support}): {shown.tolist()} at index {i}. Pyro's "
            "Trace_ELBO refuses it too: fix the data (e.g. labels in {0, 1} for a Bernoulli, "
            "non-negative integer counts for a Poisson)."
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


def data_shapes(args, kwargs) -> dict:
    """``{argument: shape}`` of the model's tensor arguments (for :func:`explained`)."""
    return {n: tuple(a.shape) for n, a in _data_tensors(args, kwargs)}


def check_targets(likelihood, y: torch.Tensor, f: torch.Tensor) -> None:
    """GPyTorch: the targets ``y`` against the support of ``likelihood``'s distribution of
    ``y`` given latent values ``f`` (e.g. labels in {0, 1} for a Bernoulli likelihood), and
    finite (a NaN target would fail inside the quadrature with a message naming no target)."""
    if y.is_floating_point() and not bool(torch.isfinite(y).all()):
        i = _first(~torch.isfinite(y))
        raise ValueError(
            f"targets y: {y[tuple(i)].tolist()} at index {i} is not finite. Remove or impute "
            "those points (and their inputs) before the step."
        )
    try:
        d = likelihood.forward(f)
        support = d.support
        if constraints.is_dependent(support):
            return
        bad = ~support.check(y.to(f.dtype) if d.support.is_discrete else y)
        if y.is_floating_point():  # (NaN targets are refused by the step's finiteness check)
            bad = bad & torch.isfinite(y)
    except Exception:  # noqa: BLE001 (a likelihood without a plain torch distribution)
        return
    if bool(bad.any()):
        i = _first(bad)
        raise ValueError(
            f"targets y: {y[tuple(i)].tolist()} at index {i} is outside the support of "
            f"{type(likelihood).__name__} ({type(d).__name__}, {support}). Labels of a "
            "Bernoulli likelihood are 0 and 1 (map labels in {-1, 1} with (y + 1) / 2)."
        )


def first_line(text: str, width: int) -> str:
    """The first line of an error message, at most about ``width`` characters: cut at a word
    boundary (never inside a word) and with its parentheses and brackets closed, so that it
    reads as one clause inside another message's parentheses."""
    lines = str(text).strip().splitlines()
    line = lines[0] if lines else ""
    if len(line) > width:
        cut = line[:width]
        if line[width] != " " and " " in cut:
            cut = cut.rsplit(" ", 1)[0]
        line = cut.rstrip(" ,;:") + " ..."
    stack = []
    for ch in line:
        if ch in "([{":
            stack.append({"(": ")", "[": "]", "{": "}"}[ch])
        elif ch in ")]}" and stack and stack[-1] == ch:
            stack.pop()
    return line + "".join(reversed(stack))


def _data_tensors(args, kwargs):
    for i, a in enumerate(args):
        if torch.is_tensor(a):
            yield f"argument {i}", a
    for k, a in kwargs.items():
        if torch.is_tensor(a):
            yield f"argument {k!r}", a


@contextmanager
def explained(args, kwargs, shapes=None) -> Iterator[None]:
    """Explain a failure of the model in terms of its data: a NaN that a distribution refused,
    an empty plate, a dtype mismatch, or shapes that changed since ``shapes`` (the data the
    guide was built with, ``{argument: shape}``)."""
    try:
        yield
    except ZeroDivisionError as e:
        empty = [f"{n} has shape {tuple(a.shape)}" for n, a in _data_tensors(args, kwargs)]
        empty = [e for e, (_, a) in zip(empty, _data_tensors(args, kwargs)) if a.numel() == 0]
        if not empty:
            raise
        raise ValueError(
            f"the data is empty ({'; '.join(empty)}): a plate of size 0 has no data point to "
            "fit. Pass at least one data point."
        ) from e
    except (ValueError, RuntimeError) as e:
        text = str(e)
        _explain_known(e, text, args, kwargs)
        if isinstance(e, ValueError) and "to satisfy the constraint" in text:
            for n, a in _data_tensors(args, kwargs):
                if a.is_floating_point() and not bool(torch.isfinite(a).all()):
                    i = _first(~torch.isfinite(a))
                    raise ValueError(
                        f"the model's {n} has a non-finite value (first at index {i}: "
                        f"{float(a[tuple(i)])}), and a distribution refused the result "
                        f"({first_line(text, 160)}). Remove or impute it (observations "
                        "may be marked missing with obs_mask)."
                    ) from e
            raise
        if not isinstance(e, RuntimeError):
            raise
        now = {n: tuple(a.shape) for n, a in _data_tensors(args, kwargs)}
        changed = [
            f"{n}: {shapes[n]} -> {s}" for n, s in now.items() if shapes and shapes.get(n, s) != s
        ]
        if changed and ("size" in text or "shape" in text):
            flipped = [
                (n, s)
                for n, s in now.items()
                if shapes and len(s) == 2 and s[0] != s[1] and shapes.get(n) == s[::-1]
            ]
            if flipped:
                n, (d, rows) = flipped[0]
                raise ValueError(
                    f"the model's {n} has shape {(d, rows)}, which looks transposed: the guide "
                    f"was built with shape {(rows, d)}, one row per observation. Pass its "
                    f"transpose (e.g. X.T, of shape {(rows, d)})."
                ) from e
            raise ValueError(
                f"the data's shapes changed since the guide was built ({'; '.join(changed)}), "
                f"and the model failed ({first_line(text, 160)}). An AutoCVI guide is "
                "fitted to one model and data layout: build a new AutoCVI for the new shapes."
            ) from e
        if "dtype" in text or "cast" in text or "scalar type" in text:
            kinds = ", ".join(f"{n}: {a.dtype}" for n, a in _data_tensors(args, kwargs))
            raise TypeError(
                f"the model failed on mixed dtypes ({first_line(text, 160)}). The data "
                f"has {kinds}; every tensor the model combines must have one floating dtype: "
                "make the data and the model's priors and parameters agree (e.g. X.double() "
                "and y.double(), or priors built with X.new_zeros(...)); integer labels or "
                "counts must be passed as floats."
            ) from e
        raise


_PLATE_MISMATCH = re.compile(
    r"Shape mismatch inside plate\('(?P<plate>[^']*)'\) at site (?P<site>\S+) dim "
    r"(?P<dim>-?\d+), (?P<size>\d+) vs (?P<got>\d+)"
)


def _explain_known(e: BaseException, text: str, args, kwargs) -> None:
    """A failure on half-precision or bool data, on a prior that cannot be sampled (an
    ``ImproperUniform``), or on a plate whose size is not its data's, said in terms of what to
    change."""
    m = _PLATE_MISMATCH.search(text)
    if m is not None:
        plate, site, size, got = m["plate"], m["site"], int(m["size"]), int(m["got"])
        one = (
            " A plate of size 1 does not broadcast over the data: its size must be the number "
            "of data points."
            if size == 1
            else ""
        )
        raise ValueError(
            f"plate {plate!r} has size {size}, but site {site!r} inside it has {got} elements "
            f"along the plate's dim {m['dim']} (from its data or its distribution's "
            f"parameters).{one} Give the plate the number of data points, e.g. "
            f"pyro.plate({plate!r}, {got}), or pass data with one entry per plate element."
        ) from e
    if "does not support sampling" in text:
        what = text.split(" does not support sampling")[0].split()[-1]
        raise ValueError(
            f"a latent site's prior is a {what}, which cannot be sampled and has no normalised "
            "density: AutoCVI builds q from a proper prior and evaluates the ELBO with it "
            "(init_loc_fn does not change that). Use a proper prior, e.g. a wide Normal."
        ) from e
    tensors = list(_data_tensors(args, kwargs))
    half = [f"{n} ({a.dtype})" for n, a in tensors if a.dtype in (torch.float16, torch.bfloat16)]
    if half and ("Half" in text or "BFloat16" in text):
        raise TypeError(
            f"the model's data is in half precision ({', '.join(half)}), which pyro_cvi does not "
            "support (its Cholesky factors and quadrature need float32 or float64): convert "
            "the data, e.g. X.float() or X.double()."
        ) from e
    bools = [n for n, a in tensors if a.dtype == torch.bool]
    if bools and "bool" in text:
        raise TypeError(
            f"the model failed on a bool tensor ({', '.join(bools)}: "
            f"{first_line(text, 120)}); pass labels or counts as floats, e.g. y.float() "
            "or y.double() (a mask for obs_mask may stay bool)."
        ) from e


def _parameters_finite(fn) -> bool:
    """Whether every floating-point parameter of ``fn`` is finite (an infinite Poisson rate at a
    prior draw, ``exp`` overflowing, is the model's point, not a fault of the data)."""
    for key in getattr(fn, "arg_constraints", {}):
        a = getattr(fn, key, None)
        if torch.is_tensor(a) and a.is_floating_point() and not bool(torch.isfinite(a).all()):
            return False
    return True


def _check_densities(trace: Trace, structure) -> None:
    """Latent point masses (a ``Delta``: no density to fit a ``q`` to) and observations whose
    log-density is not finite at the analysis point (e.g. a Beta observation of exactly 0 or 1,
    on the edge of its support): errors naming the site and the fix."""
    for name, site in trace.nodes.items():
        cached = site.pop(LOG_PROB_KEY, None)  # (the dependency search's, where it took one)
        if not is_random(site) or name not in structure:
            continue
        base = unwrap(site["fn"])[0]
        if not structure[name]:
            if type(base).__name__ == "Delta":
                raise ValueError(
                    f"latent site {name!r} is a Delta (a point mass): it has no density to fit "
                    f"a q to. Use pyro.deterministic({name!r}, value) for a computed value, or "
                    "observe it (obs=...)."
                )
            continue
        v = site["value"]
        if not torch.is_tensor(v) or not v.is_floating_point():
            continue
        try:
            lp = site["fn"].log_prob(v).detach() if cached is None else cached
        except (ValueError, RuntimeError, NotImplementedError):
            continue
        bad = _masked(~torch.isfinite(lp), site["mask"])
        if bool(bad.any()) and _parameters_finite(base):  # else an overflow, not the data
            i = _first(bad)
            shown = v[tuple(i)] if len(i) <= v.dim() and v.dim() else v
            raise ValueError(
                f"observed site {name!r} has log-density {float(lp[tuple(i)])} at index {i} "
                f"(value {shown.tolist()}) under its {type(base).__name__}: the value is "
                "impossible or singular there (e.g. 0 or 1 for a Beta, on the edge of its "
                "support). Fix the data (e.g. clip into the open support) or the model."
            )
