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
from .messages import general_gaussian_message, linear_predictor_message
from .optim import PENDING
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
            try:
                return float(self._elbo(model, guide, args, kwargs, grads=False).neg())
            finally:
                _end_step(guide)

    def differentiable_loss(self, model, guide, *args, **kwargs):
        try:
            return self._elbo(model, guide, args, kwargs, grads=False).neg()
        finally:
            _end_step(guide)

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
        if guide.prototype_trace is None or guide._params_missing():
            # first call, or the param store was cleared under a live guide: start afresh
            guide._setup_prototype(*args, **kwargs)
        guide._last_args, guide._last_kwargs = args, kwargs
        guide._maybe_reclassify(args, kwargs)
        guide._step_subsample = _draw_subsample(guide, args, kwargs)  # one minibatch per step
        tr = guide._trace_at_means(args, kwargs)
        check_observations(tr, guide._structure)
        elbo = 0.0
        counted = set()
        for info in guide._latents.values():
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
        elbo = -post.kl_to(prior_g)
        counted.add(info.name)
        for idx, fn in elbo_fns:
            sl = post.blocks[idx][1]
            elbo = elbo + fn(post.f_mean[sl], post.f_var[sl])
        for f in info.factors:
            if f.kind == cj.CONJUGATE and not f.extra.get("given_others"):
                counted.add(f.site)  # (given-others factors: their term is the mean field's)
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
        """ELBO terms and Algorithm 2 targets of the natural-form (mean-field) sites.

        Exact ``E_q[log p_a]`` for conjugate factors and Monte Carlo for the rest
        (:func:`pyro_cvi.meanfield.compute`); the natural gradient ``target - lambda`` is
        written into ``.grad``. Minibatch locals are first given their full update
        (doubly stochastic CVI); with a sequential schedule the targets are computed during
        the sweep instead (:func:`pyro_cvi.meanfield.sweep`).
        """
        from . import meanfield as mf

        sequential = guide.schedule != "parallel"
        if grads and guide._step_subsample and not sequential:
            mf.update_locals(guide, args, kwargs)
        want = None if (grads and not sequential) else set()
        res = mf.compute(guide, args, kwargs, counted, want=want, value=True)
        if grads and not sequential:
            for i in infos:
                if mf.is_local(guide, i.name):
                    continue  # already updated (beta = 1) by update_locals
                params = guide._natural_params_of(i)
                target = res.targets[i.name]
                with torch.no_grad():
                    for p, t in zip(params, target):
                        p.grad = t - p.detach()
        return res.elbo


def _end_step(guide) -> None:
    if isinstance(guide, AutoCVI):
        guide._step_subsample = {}


def _draw_subsample(guide: AutoCVI, args, kwargs) -> Dict[str, torch.Tensor]:
    """Fresh subsample indices of every subsampled plate (``pyro.plate(subsample_size=...)``)."""
    return guide._draw_subsample(args, kwargs)


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
