"""Reference posteriors of the zoo's client models from long NUTS runs.

For each model (default: ``tests/zoo/clients.CLIENTS``), in float64:
``pyro.infer.MCMC(NUTS(model, max_plate_nesting=..., jit_compile=True))`` with enumerated
discrete latents summed out (``config_enumerate`` in the model), ``--chains`` chains run one
after another (seeds 0, 1, ...), ``--warmup`` adaptation steps and ``--samples`` draws each
(default 4 x (500 + 1000); the slowest models take fewer: ``SETTINGS``).

Writes ``tests/zoo/references/<model>.json``: for every continuous latent site (constrained
space) the posterior mean and sd of every element, split R-hat and effective sample size per
element (summarised: max R-hat, min and median ESS), the same for the model's symmetry-free
quantities (``zoo.clients.CANONICAL``: mixture components and HMM states sorted by their
means in each draw, PPCA's ``W^T W`` and ``z W``), divergences per chain, the settings and
the CPU time.

    python scripts/make_nuts_references.py [--models a,b] [--chains 4] [--warmup 500]
        [--samples 1000] [--out-dir DIR]

Run it in the background, one model at a time (one torch thread).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer import MCMC, NUTS, Predictive
from pyro.infer.autoguide.initialization import init_to_median, init_to_sample
from pyro.infer.reparam import LocScaleReparam
from pyro.ops.stats import effective_sample_size, split_gelman_rubin

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.zoo import ZOO, clients  # noqa: E402
from tests.zoo.clients import CLIENTS  # noqa: E402
from tests.zoo.reference import (  # noqa: E402
    REFERENCE_DIR,
    canonical,
    latent_sites,
    max_plate_nesting,
)

# the models whose gradients cost most run 4 x (300 warm-up + 400 draws), the horseshoe
# (deep trees, divergences) 4 x (200 + 200): on a shared machine (a fifth of a core) the
# default would take hours
_SHORT = {"warmup": 300, "samples": 400}

#: Per-model departures from the defaults, and why.
SETTINGS = {
    # centred hierarchies (a latent scale over many latents) run non-centred
    # (``LocScaleReparam``): the same posterior without the funnel that stalls NUTS (the
    # centred random walk gave R-hat 1.26 and 32 effective draws of its step scale)
    "stochastic_volatility": {"warmup": 400, "samples": 600, "reparam": ["increments"]},
    "gp_poisson": _SHORT,
    "radon_varying_slope": {**_SHORT, "reparam": ["a", "b"]},
    "ppca": _SHORT,
    "horseshoe_logistic": {"warmup": 200, "samples": 200, "reparam": ["beta"]},
    # the markov-loop HMM has the DiscreteHMM variant's posterior exactly (same model, states
    # summed by enumeration rather than inside the distribution; tests/test_zoo_clients.py
    # checks the two marginal likelihoods agree), at a fraction of the cost per gradient
    "hmm_gaussian": {**_SHORT, "nuts_model": "hmm_gaussian_discrete", "init": "sample"},
    # the ARMA recursion over 100 points is 100 small autograd steps per gradient; its
    # triangular-solve form has the same density (checked in tests/test_zoo_clients.py)
    "arma11": {**_SHORT, "nuts_model": "arma11_vectorised"},
    # the enumerated mixture has the MixtureSameFamily variant's posterior exactly (checked
    # likewise); exchangeable components and states: each chain starts from a prior draw,
    # not the median (where the components coincide)
    "exchangeable_mixture": {"init": "sample", "nuts_model": "exchangeable_mixture_msf"},
    "exchangeable_mixture_msf": {"init": "sample"},
    "hmm_gaussian_discrete": {**_SHORT, "init": "sample"},
}


def _stats(chains: dict) -> dict:
    """Mean, sd, split R-hat and ESS of ``{name: (C, S, *shape)}``."""
    out = {}
    for k, v in chains.items():
        v = v.to(torch.float64)
        flat = v.reshape(v.shape[0] * v.shape[1], *v.shape[2:])
        rhat = split_gelman_rubin(v, chain_dim=0, sample_dim=1)
        ess = effective_sample_size(v, chain_dim=0, sample_dim=1)
        out[k] = {
            "shape": list(v.shape[2:]),
            "mean": flat.mean(0).tolist(),
            "sd": flat.std(0).tolist(),
            "r_hat_max": float(rhat.max()),
            "ess_min": float(ess.min()),
            "ess_median": float(ess.median()),
        }
    return out


_DONE: dict = {}  # (NUTS model, data builder, settings) -> reference, within one run


def run_model(name: str, chains: int, warmup: int, samples: int) -> dict:
    """The reference of zoo model ``name`` (reusing one computed earlier in this run from the
    same NUTS model, data and settings)."""
    settings = {"chains": chains, "warmup": warmup, "samples": samples, "init": "median"}
    settings.update(SETTINGS.get(name, {}))
    settings.setdefault("nuts_model", name)
    key = (ZOO[name].data, json.dumps(settings, sort_keys=True))
    if key not in _DONE:
        _DONE[key] = _run_nuts(name, settings)
    return {**_DONE[key], "model": name, "source": ZOO[name].source}


def _run_nuts(name: str, settings: dict) -> dict:
    chains, warmup, samples = settings["chains"], settings["warmup"], settings["samples"]
    print(f"{name}: NUTS, {chains} x ({warmup} warm-up + {samples})", flush=True)
    nuts_name = settings["nuts_model"]
    data = ZOO[name].data(torch.float64)
    model = ZOO[nuts_name].model if nuts_name in ZOO else getattr(clients, nuts_name)
    if settings.get("reparam"):  # the same posterior, non-centred for NUTS's geometry
        config = {k: LocScaleReparam(0.0) for k in settings["reparam"]}
        model = poutine.reparam(model, config=config)
    sites = latent_sites(ZOO[name].model, data)
    nesting = max_plate_nesting(model, data)
    init = init_to_sample if settings["init"] == "sample" else init_to_median
    draws = {k: [] for k in sites}
    divergences, t0 = [], time.process_time()
    for c in range(settings["chains"]):
        pyro.set_rng_seed(c)
        kernel = NUTS(
            model,
            max_plate_nesting=nesting,
            jit_compile=True,
            ignore_jit_warnings=True,
            init_strategy=init,
        )
        mcmc = MCMC(
            kernel,
            num_samples=settings["samples"],
            warmup_steps=settings["warmup"],
            num_chains=1,
            disable_progbar=True,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mcmc.run(*data.args, **data.kwargs)
        got = mcmc.get_samples()
        if any(k not in got for k in sites):  # reparameterised sites: from the draws
            pred = Predictive(model, posterior_samples=got, return_sites=list(sites))
            with torch.no_grad():
                got = {**pred(*data.args, **data.kwargs), **got}
        for k in sites:
            draws[k].append(got[k].detach())
        div = mcmc.diagnostics().get("divergences", {})
        divergences.append(sum(len(v) for v in div.values()))
        print(f"  {name}: chain {c} done ({time.process_time() - t0:.0f} CPU s)", flush=True)
    stacked = {k: torch.stack(v) for k, v in draws.items()}  # (C, S, *shape)
    out = {
        "model": name,
        "source": ZOO[name].source,
        "settings": {
            **settings,
            "nuts_model": nuts_name,
            "dtype": "float64",
            "max_plate_nesting": nesting,
            "jit_compile": True,
            "init_strategy": init.__name__,
            "seeds": list(range(settings["chains"])),
            "target_accept_prob": 0.8,
            "max_tree_depth": 10,
            "torch": torch.__version__,
            "pyro": pyro.__version__,
        },
        "cpu_seconds": time.process_time() - t0,
        "divergences": divergences,
        "sites": _stats(stacked),
    }
    C, S = settings["chains"], settings["samples"]
    flat = {k: v.reshape(C * S, *v.shape[2:]) for k, v in stacked.items()}
    canon = canonical(name, flat)
    if canon is not flat:
        out["canonical"] = _stats({k: v.reshape(C, S, *v.shape[1:]) for k, v in canon.items()})
    stats = out.get("canonical", out["sites"]).values()
    out["summary"] = {
        "r_hat_max": max(s["r_hat_max"] for s in stats),
        "ess_min": min(s["ess_min"] for s in stats),
        "divergences": sum(divergences),
    }
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default=",".join(CLIENTS), help="comma-separated zoo names")
    p.add_argument("--chains", type=int, default=4)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--out-dir", default=str(REFERENCE_DIR))
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in a.models.split(","):
        ref = run_model(name, a.chains, a.warmup, a.samples)
        (out_dir / f"{name}.json").write_text(json.dumps(ref, indent=1) + "\n")
        s = ref["summary"]
        print(
            f"{name}: {ref['cpu_seconds']:.0f} CPU s, max R-hat {s['r_hat_max']:.3f}, "
            f"min ESS {s['ess_min']:.0f}, divergences {s['divergences']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
