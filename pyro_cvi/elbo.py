"""``CVI_ELBO``: the ELBO with gradients with respect to mean parameters.

For every CVI parameter ``lambda_tilde`` of an :class:`~pyro_cvi.AutoCVI` guide this loss writes
the natural gradient ``grad_mu E_q[log p_f] - lambda_tilde`` into ``.grad`` (exact for conjugate
factors, Gauss-Hermite or Monte Carlo for linear-predictor factors, Bonnet/Price for general
ones), and it back-propagates the ELBO (with ``q`` held fixed) into every other parameter, so
hyperparameters can be learned by a torch optimizer in the same step. The value it returns is
the -ELBO, exact where closed forms allow (conjugate terms, the KL, quadrature).
"""

from __future__ import annotations

from typing import Dict, List

import torch
from pyro.infer import ELBO

from . import conjugacy as cj
from .autoguide import LEAF_FORM, NATURAL_FORM, SITE_FORM, AutoCVI
from .optim import PENDING
from .messages import general_gaussian_message, linear_predictor_message
from .tracing import trace_model
from .validation import check_observations

__all__ = ["CVI_ELBO"]


class CVI_ELBO(ELBO):
    """The evidence lower bound for CVI; use it with :class:`~pyro_cvi.AutoCVI` and
    :class:`~pyro_cvi.CVI`::

        svi = SVI(model, AutoCVI(model), CVI(step_size=0.5), loss=CVI_ELBO())
    """

    def __init__(self, **kwargs):
        if kwargs.get("num_particles", 1) != 1:
            raise ValueError(
                "CVI_ELBO computes its expectations itself; set AutoCVI(num_samples=...) for "
                "Monte Carlo gradients instead of num_particles"
            )
        super().__init__(**kwargs)

    def loss(self, model, guide, *args, **kwargs) -> float:
        with torch.no_grad():
            return float(self._elbo(model, guide, args, kwargs, grads=False).neg())

    def differentiable_loss(self, model, guide, *args, **kwargs):
        return self._elbo(model, guide, args, kwargs, grads=False).neg()

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        elbo = self._elbo(model, guide, args, kwargs, grads=True)
        PENDING.add(guide)
        loss = -elbo
        if loss.requires_grad:
            loss.backward()
        return float(loss.detach())

    def _get_trace(self, model, guide, args, kwargs):
        raise NotImplementedError("CVI_ELBO does not sample traces; it computes expectations")

    # ------------------------------------------------------------------
    def _elbo(self, model, guide, args, kwargs, grads: bool) -> torch.Tensor:
        guide = _require_autocvi(guide)
        if guide.model is not model and getattr(guide.model, "__wrapped__", None) is not model:
            raise ValueError(
                "CVI_ELBO: this AutoCVI guide was built for a different model "
                f"({getattr(guide.model, '__name__', guide.model)!r}); build the guide with "
                "AutoCVI(model) for the model you pass to SVI"
            )
        if guide.prototype_trace is None:
            guide._setup_prototype(*args, **kwargs)
        guide._last_args, guide._last_kwargs = args, kwargs
        guide._maybe_reclassify(args, kwargs)
        tr = guide._trace_at_means(args, kwargs)
        check_observations(tr, guide._structure)
        elbo = 0.0
        counted = set()
        for name, info in guide._latents.items():
            if info.form == SITE_FORM:
                elbo = elbo + self._site_form(guide, info, tr, args, kwargs, grads, counted)
        natural = [i for i in guide._latents.values() if i.form == NATURAL_FORM]
        if natural:
            elbo = elbo + self._natural_form(guide, natural, args, kwargs, grads, counted)
        if not torch.is_tensor(elbo):
            elbo = torch.tensor(float(elbo))
        return elbo

    def _site_form(self, guide: AutoCVI, info, tr, args, kwargs, grads, counted):
        prior_g, rows, elbo_fns, post, sites, general = guide._refresh_site_form(info, tr)
        elbo = -post.kl_to(prior_g_from(tr, info))
        counted.add(info.name)
        for idx, fn in elbo_fns:
            sl = post.blocks[idx][1]
            elbo = elbo + fn(post.f_mean[sl], post.f_var[sl])
        for f in info.factors:
            if f.kind == cj.CONJUGATE:
                counted.add(f.site)
        for (site_name, sl), (_, r) in zip(post.blocks, rows):
            if site_name is None:
                continue
            e, target = linear_predictor_message(
                tr.nodes[site_name],
                r,
                post.f_mean[sl],
                post.f_var[sl],
                guide.num_quad_points,
                guide.num_samples,
            )
            counted.add(site_name)
            elbo = elbo + e
            if grads:
                p = sites[site_name]
                p.grad = target - p.detach()
        if general is not None:
            gsites = [f.site for f in info.factors if f.kind == cj.GENERAL]
            counted.update(gsites)
            log_joint = _log_joint(guide, info.name, gsites, args, kwargs)
            value, h, P = general_gaussian_message(
                log_joint, post.loc, post.scale_tril(), guide.num_general_samples
            )
            elbo = elbo + value
            if grads:
                general[0].grad = h - general[0].detach()
                general[1].grad = P - general[1].detach()
        return elbo

    def _natural_form(self, guide: AutoCVI, infos, args, kwargs, grads, counted):
        lams = {i.name: tuple(p.detach().clone().requires_grad_(True)
                              for p in guide._natural_params_of(i)) for i in infos}
        qs = {i.name: i.family.natural_to_dist(lams[i.name]) for i in infos}
        for i in infos:
            if not qs[i.name].has_rsample:
                raise NotImplementedError(
                    f"latent site {i.name!r} is discrete ({i.family.name}); CVI for discrete "
                    "latents (enumeration, Algorithm 2) is not available yet. Marginalise it with "
                    "@config_enumerate and TraceEnum_ELBO, or make it continuous."
                )
        exact_prior = {}
        for i in infos:
            pf = next((f for f in i.factors if f.site == i.name), None)
            if pf is not None and pf.kind == cj.PRIOR:
                exact_prior[i.name] = True
        nat_names = set(lams)
        grad_sites = []
        for s, d in guide._deps.items():
            latent = guide._latents.get(s)
            if (latent is not None and latent.form == LEAF_FORM) or s in exact_prior:
                continue
            if d & nat_names or s in nat_names:
                grad_sites.append(s)
        value_sites = [s for s in grad_sites if s not in counted]
        S = guide.num_general_samples
        acc = {n: [torch.zeros_like(t) for t in lams[n]] for n in lams}
        value = 0.0
        tensors = [t for n in lams for t in lams[n]]
        for _ in range(S):
            vals = {}
            for n, i in guide._latents.items():
                if i.form == SITE_FORM:
                    vals[n] = guide.posterior(n).sample()
                elif i.form == NATURAL_FORM:
                    vals[n] = qs[n].rsample()
            with torch.enable_grad():
                t = trace_model(guide.model, vals, args, kwargs)
                t.compute_log_prob()
                f = sum(t.nodes[s]["log_prob_sum"] for s in grad_sites) if grad_sites else None
                if grads and f is not None and f.requires_grad:
                    gs = torch.autograd.grad(f, tensors, retain_graph=True, allow_unused=True)
                    k = 0
                    for n in lams:
                        for j in range(len(lams[n])):
                            if gs[k] is not None:
                                acc[n][j] += gs[k]
                            k += 1
                v = sum(t.nodes[s]["log_prob_sum"] for s in value_sites) if value_sites else 0.0
            value = value + v
        elbo = value / S
        tr = guide._trace_at_means(args, kwargs)
        for i in infos:
            fam = i.family
            lam = tuple(t.detach() for t in lams[i.name])
            mu = fam.natural_to_mean(lam)
            elbo = elbo + fam.entropy(lam).sum()
            target = [torch.zeros_like(t) for t in lam]
            if grads:
                g_lam = tuple(a / S for a in acc[i.name])
                g_mu = fam_mean_grad(fam, lam, g_lam)
                target = [t + g for t, g in zip(target, g_mu)]
            if i.name in exact_prior:
                eta0 = fam.dist_to_natural(tr.nodes[i.name]["fn"])
                eta0 = tuple(e.expand_as(t) if e.shape != t.shape else e
                             for e, t in zip(eta0, lam))
                scale = tr.nodes[i.name]["scale"]
                elbo = elbo + scale * (
                    fam.inner(eta0, mu) - fam.log_partition(eta0)
                    + fam.base_log_measure(_mean_point(fam, mu, i))
                ).sum()
                target = [t + scale * e.detach() for t, e in zip(target, eta0)]
            if grads:
                for p, t in zip(guide._natural_params_of(i), target):
                    p.grad = t - p.detach()
        return elbo


def _mean_point(fam, mu, info):
    return mu[0]


def fam_mean_grad(fam, lam, g_lam):
    from .families import fisher_solve_mean_grad

    return fisher_solve_mean_grad(fam, lam, g_lam)


def prior_g_from(tr, info):
    from .autoguide import _gaussian_prior

    return _gaussian_prior(tr.nodes[info.name]["fn"], info.numel)


def _log_joint(guide: AutoCVI, name: str, sites: List[str], args, kwargs):
    others: Dict[str, torch.Tensor] = {}
    for n, i in guide._latents.items():
        if n != name and i.form != LEAF_FORM:
            others[n] = guide.posterior(n).sample()
    shape = guide._latents[name].event_shape

    def f(z):
        t = trace_model(guide.model, {**others, name: z.reshape(shape)}, args, kwargs)
        t.compute_log_prob(site_filter=lambda s, site: s in sites)
        return sum(t.nodes[s]["log_prob_sum"] for s in sites)

    return f


def _require_autocvi(guide) -> AutoCVI:
    if isinstance(guide, AutoCVI):
        return guide
    name = type(guide).__name__
    raise TypeError(
        f"CVI_ELBO needs an AutoCVI guide, got {name}. Natural-gradient CVI steps need "
        "exponential-family factors with natural parameters: use guide = AutoCVI(model). "
        f"To keep {name}, use pyro.infer.Trace_ELBO with a torch optimizer such as "
        "pyro.optim.Adam."
    )
