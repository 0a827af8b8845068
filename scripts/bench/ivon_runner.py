"""IVON (``ivon-opt``; Shen et al., ICML 2024) as a peer of AutoCVI in
``scripts/benchmark_bnn.py``, set up as its paper sets it up for a Bayesian posterior, and
scored by the same ``-ELBO`` estimator as the other guides.

IVON keeps a diagonal Gaussian ``q = N(m, diag(1 / (ess (h + delta))))`` over a flat parameter
vector and minimises ``E_q[loss] + KL(q || N(0, 1 / (ess delta))) / ess`` by a variational
online-Newton step: one draw per step, a momentum ``beta1`` on the gradient, a running Price
estimate of the Hessian ``h`` (rate ``1 - beta2``), and the step
``m <- m - lr (h0 + delta) (g + delta m) / (h + delta)``. Two ways in:

* **networks** (``NETWORKS``: every latent a ``Normal(0, 1)`` weight or bias): the same network
  as a plain ``nn.Module`` (what an IVON user writes; one forward and backward a step), the
  loss the mean negative log likelihood, ``ess = N`` and ``delta = 1 / N``: the prior
  precision ``ess delta = 1``, so ``q`` targets the same posterior as the other guides;
* **any other model**: the flat unconstrained vector of Pyro's potential energy
  (``initialize_model``: ``-log p(x, T(u)) - log |T'(u)|``, ``init_to_median``), the loss
  ``potential / ess`` with ``ess`` the number of observations and ``delta = 0``: the prior
  is in the loss, not in a weight decay, and ``q``'s precision is ``ess h``.

The learning rate follows a cosine from ``lr`` to 0 over the CPU budget when
``schedule="cosine"`` (the paper's runs anneal; the budget is known, so the schedule reads the
CPU time spent, not a step count). The final Gaussian is written into an ``AutoNormal`` of
the model (same unconstrained coordinates) and scored there.
"""

from __future__ import annotations

import math
import time
from typing import Dict, Optional

import pyro
import torch
from pyro.infer.autoguide import AutoNormal

from .bnn_models import NETWORKS, mlp_twin

__all__ = ["IVON_DEFAULTS", "run_ivon"]

#: the settings used unless told otherwise (see ``scripts/benchmark_bnn.py --help``):
#: ``beta2`` 0.999 rather than the package's 1 - 1e-5 (which averages the Hessian over ~1e5
#: steps and leaves the variances at their start over the few thousand full-batch steps here)
IVON_DEFAULTS = {"hess_init": 1.0, "beta1": 0.9, "beta2": 0.999, "schedule": "cosine"}


def _cosine(opt, lr0: float, frac: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr0 * 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0)))


def _loop(opt, closure, budget: float, lr0: float, schedule: str, max_steps=None):
    """IVON steps (one draw each) for ``budget`` CPU seconds, or ``max_steps`` steps (the
    schedule then reads the step count): ``(steps, last losses, CPU seconds)``."""
    losses = []
    t0 = time.process_time()
    steps = 0
    while True:
        with opt.sampled_params(train=True):
            opt.zero_grad()
            loss = closure()
            loss.backward()
        opt.step()
        steps += 1
        losses.append(float(loss.detach()))
        t = time.process_time() - t0
        if (max_steps is None and t >= budget) or steps == max_steps:
            return steps, losses[-50:], t
        if schedule == "cosine":
            _cosine(opt, lr0, t / budget if max_steps is None else steps / max_steps)


def _diverged(lr, cfg, steps, err) -> dict:
    return {
        "estimate": (math.inf, 0.0),
        "steps": steps,
        "lr": lr,
        "settings": cfg,
        "diverged": err,
    }


def _scored_guide(model, args, seed, locs: Dict[str, torch.Tensor], sds: Dict[str, torch.Tensor]):
    """An ``AutoNormal`` of ``model`` holding the unconstrained ``locs`` and ``sds``."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoNormal(model)
    guide(*args)
    store = pyro.get_param_store()
    with torch.no_grad():
        for site, loc in locs.items():
            # (the store's item assignment takes the constrained value: the sd itself)
            store[f"AutoNormal.locs.{site}"] = loc.detach().clone()
            store[f"AutoNormal.scales.{site}"] = sds[site].detach().clone()
    return guide


def _ivon(params, lr, ess, delta, cfg):
    import ivon

    return ivon.IVON(
        params,
        lr=lr,
        ess=ess,
        weight_decay=delta,
        hess_init=cfg["hess_init"],
        beta1=cfg["beta1"],
        beta2=cfg["beta2"],
    )


def run_ivon(
    name: str,
    model,
    args,
    budget: float,
    seed: int,
    lr: float,
    n_obs: int,
    estimate,
    cfg: Optional[dict] = None,
    max_steps: Optional[int] = None,
) -> dict:
    """IVON on ``model`` for ``budget`` CPU seconds (or ``max_steps`` steps) at learning rate
    ``lr`` (settings ``cfg`` over :data:`IVON_DEFAULTS`), its Gaussian scored by
    ``estimate(model, guide, args)``."""
    cfg = {**IVON_DEFAULTS, **(cfg or {})}
    torch.manual_seed(seed)
    if name in NETWORKS:
        X, y = args
        N = X.shape[0]
        net = mlp_twin(NETWORKS[name]).to(X.dtype)
        opt = _ivon(net.parameters(), lr, N, 1.0 / N, cfg)

        def closure():
            return torch.nn.functional.cross_entropy(net(X), y)

        try:
            steps, last, cpu = _loop(opt, closure, budget, lr, cfg["schedule"], max_steps)
        except (ValueError, RuntimeError) as e:  # a non-finite draw: diverged, never the best
            return _diverged(lr, cfg, opt.current_step, str(e)[:200])
        sd = (1.0 / (N * (opt.param_groups[0]["hess"] + 1.0 / N))).sqrt()
        locs, sds, k = {}, {}, 0
        for pname, p in net.named_parameters():
            idx, kind = pname.split(".")
            site = f"l{int(idx) // 2 + 1}.{kind}"
            locs[site] = p.detach()
            sds[site] = sd[k : k + p.numel()].reshape(p.shape).to(p)
            k += p.numel()
        how = "nn.Module twin, ess = N, weight decay = 1 / N"
    else:
        from pyro.infer.autoguide.initialization import init_to_median
        from pyro.infer.mcmc.util import initialize_model

        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        init, potential_fn, _, _ = initialize_model(
            model, model_args=args, init_strategy=init_to_median
        )
        names = list(init)
        flat = torch.nn.Parameter(torch.cat([init[s].detach().reshape(-1) for s in names]))
        shapes = [init[s].shape for s in names]
        sizes = [init[s].numel() for s in names]
        opt = _ivon([flat], lr, n_obs, 0.0, cfg)

        def unflat(v):
            return {s: c.reshape(sh) for s, c, sh in zip(names, v.split(sizes), shapes)}

        def closure():
            return potential_fn(unflat(flat)) / n_obs

        try:
            steps, last, cpu = _loop(opt, closure, budget, lr, cfg["schedule"], max_steps)
        except (ValueError, RuntimeError) as e:  # a non-finite draw: diverged, never the best
            return _diverged(lr, cfg, opt.current_step, str(e)[:200])
        sd = (1.0 / (n_obs * opt.param_groups[0]["hess"])).sqrt()
        locs, sds = unflat(flat.detach()), unflat(sd)
        how = "potential energy, ess = number of observations, weight decay 0"
    if not all(bool(torch.isfinite(v).all()) for v in [*locs.values(), *sds.values()]):
        return _diverged(lr, cfg, steps, "non-finite mean or variance")
    guide = _scored_guide(model, args, seed, locs, sds)
    est = estimate(model, guide, args)
    return {
        "estimate": est,
        "steps": steps,
        "cpu_s": cpu,
        "lr": lr,
        "settings": cfg,
        "how": how,
        "last_losses_mean": sum(last) / len(last),
        "finite": bool(all(math.isfinite(v) for v in last)),
    }
