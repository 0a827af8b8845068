"""Reference posteriors of zoo models from long NUTS runs (``tests/zoo/references/<model>.json``,
written by ``scripts/make_nuts_references.py``), and the distance of a guide's posterior from
them.

A reference file holds, for every continuous latent site (on the constrained space), the
posterior mean and standard deviation of every element with split R-hat and effective sample
sizes, the same for the symmetry-free quantities of :data:`zoo.clients.CANONICAL` where the
model has symmetries (``"canonical"``), and the NUTS settings. Enumerated discrete sites are
summed out by NUTS and have no entry.

The distance of a set of draws from a reference is the mean over scalar parameters of
``|mean_draws - mean_NUTS| / sd_NUTS`` (0 for an exact posterior mean; the issue's target is
<= 0.2), computed on the canonical quantities where the model has them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import pyro.poutine as poutine
import torch
from pyro.poutine.util import site_is_subsample

from .clients import CANONICAL

REFERENCE_DIR = Path(__file__).resolve().parent / "references"


def _trace(model, data):
    with torch.no_grad(), poutine.block():
        return poutine.trace(model).get_trace(*data.args, **data.kwargs)


def latent_sites(model, data) -> Dict[str, tuple]:
    """``{name: shape}`` of the continuous latent sites of one run of ``model`` on ``data``."""
    return {
        name: tuple(site["value"].shape)
        for name, site in _trace(model, data).nodes.items()
        if site["type"] == "sample"
        and not site["is_observed"]
        and not site_is_subsample(site)
        and not site["fn"].support.is_discrete
    }


def max_plate_nesting(model, data) -> int:
    """The deepest vectorised plate dimension of ``model`` (0 without plates)."""
    dims = [
        -f.dim
        for site in _trace(model, data).nodes.values()
        if site["type"] == "sample"
        for f in site["cond_indep_stack"]
        if f.vectorized and f.dim is not None
    ]
    return max(dims, default=0)


def reference_path(name: str) -> Path:
    return REFERENCE_DIR / f"{name}.json"


def load_reference(name: str) -> Optional[dict]:
    """The reference of model ``name``, or ``None`` when there is none."""
    path = reference_path(name)
    return json.loads(path.read_text()) if path.is_file() else None


def canonical(name: str, draws: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The symmetry-free quantities of ``draws`` (``{site: (S, *shape)}``) for model ``name``;
    ``draws`` unchanged when the model has no symmetry."""
    fn = CANONICAL.get(name)
    return fn(draws) if fn is not None else draws


def summarise(draws: Dict[str, torch.Tensor]) -> Dict[str, dict]:
    """``{name: {"shape", "mean", "sd"}}`` of draws ``{name: (S, *shape)}`` (lists, float64)."""
    out = {}
    for k, v in draws.items():
        v = v.detach().to(torch.float64)
        out[k] = {"shape": list(v.shape[1:]), "mean": v.mean(0).tolist(), "sd": v.std(0).tolist()}
    return out


def _compared(name: str, ref: dict) -> Dict[str, dict]:
    return ref["canonical"] if name in CANONICAL else ref["sites"]


def posterior_means(name: str, draws: Dict[str, torch.Tensor]) -> Dict[str, list]:
    """Means of the canonical quantities of ``draws`` (what :func:`mean_error` compares)."""
    return {
        k: v.detach().to(torch.float64).mean(0).tolist() for k, v in canonical(name, draws).items()
    }


def mean_error(name: str, means: Dict[str, list], ref: dict) -> dict:
    """``{"mean": m, "max": M, "by_site": {...}}``: the mean (and largest) over scalar parameters
    of ``|mean - NUTS mean| / NUTS sd`` for ``means`` from :func:`posterior_means`. A
    reference quantity ``means`` lacks raises ``KeyError``."""
    errs, by_site = [], {}
    for site, r in _compared(name, ref).items():
        ref_mean = torch.tensor(r["mean"], dtype=torch.float64)
        got = torch.tensor(means[site], dtype=torch.float64).reshape(ref_mean.shape)
        sd = torch.tensor(r["sd"], dtype=torch.float64).clamp(min=1e-12)
        e = ((got - ref_mean).abs() / sd).reshape(-1)
        by_site[site] = float(e.mean())
        errs.append(e)
    e = torch.cat(errs)
    return {"mean": float(e.mean()), "max": float(e.max()), "by_site": by_site}


def standardised_error(name: str, draws: Dict[str, torch.Tensor], ref: dict) -> dict:
    """:func:`mean_error` of the posterior means of ``draws`` (``{site: (S, *shape)}``), on the
    canonical quantities where the model has symmetries."""
    return mean_error(name, posterior_means(name, draws), ref)
