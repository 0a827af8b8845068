"""A GLM factor with discrete parents: linear-predictor sites per enumerated value.

For ``y ~ p(y | eta)`` whose linked parameter is ``eta = A_k z + c_k`` once the discrete
parents ``s`` take the value ``k`` (``Bernoulli(logits = X @ b + c[s])``, a Poisson's log rate,
a Binomial's logits, a Normal's log scale; ``s`` global or one per data point), under the mean
field ``q(s) q(z)`` of Algorithm 2 the factor's expected log-density is

    E_q[log p] = sum_k q(s = k) f_k,    f_k = E_{q(z)}[log p(y | A_k z + c_k)]          (1)

and each ``f_k`` is a 1-D Gaussian expectation per element (Gauss-Hermite, App. B.1). Its
message to ``q(s)`` is ``grad_{mu_s} (1) = f_k`` (eq. 20: the expected log-likelihood of each
value, exact up to quadrature; closed form for a Poisson). Its message to the Gaussian block of
``z`` is ``sum_k q(s = k)`` times the ``k``-th branch's linear-predictor site targets (eqs. 13,
30-31): the block keeps one site ``(lam1, lam2)`` per enumerated value and element, with target
``q(s = k) grad_mu f_k`` (Algorithm 1 on the branches, :mod:`pyro_cvi.blocks.enumerated_sites`).
The mean field owns (1) (the factor touches ``q(s)``); the rows' ``A`` come from the enumerated
leaf trace (one row per enumerated value and element), confirmed affine by the block's probes.

The continuous latents of such a factor join one Gaussian block (:func:`unites`), so that ``q(z)``
is joint over the coefficients of every branch (``b`` and ``c`` above). A Normal whose loc reads a
continuous latent keeps the exact rows of :mod:`pyro_cvi.messages.enumerated` instead.

The rule (measured by ``scripts/benchmark_discrete_glm.py``): a *global* unmarked ``s`` takes
this route by default (its bound within 0.04 nats of ``s`` summed out in the remainder, at
about an eighth of the CPU time); a *plate-local* ``s_n`` only with
``AutoCVI(discrete="mean_field")``: summed out in the remainder's log joint its bound was 1.4
nats better (N = 200), because ``q(s_n)`` cannot follow ``b, c`` under the mean field
(``explain()`` names the option). A marked global ``s`` stays summed out (the collapsed bound
is not the mean field's, docs/architecture.md).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..gaussian.quadrature import expected_log_prob
from .collapsed_group import is_global
from .records import LINEAR_ENUM, Factor, centred_logits
from .tracing import (
    describe_link,
    linear_candidates,
    linear_param,
    linked_reader,
    rebuilds,
    unwrap,
    with_param,
)

__all__ = ["EnumeratedGLM", "discrete_glm_factor", "summed_glm_hint", "unites"]

#: Gauss-Hermite points of the mean field's ``f_k`` (the blocks' default ``num_quad_points``)
NUM_POINTS = 32


def _observed_base(an, site: str):
    """The distribution of factor ``site`` in the leaf trace when it is observed data (no
    gradient in its value) and not a softmax factor; else ``None``."""
    tr, _ = an.leaf_trace()
    node = tr.nodes[site]
    if node["type"] != "sample" or not node["is_observed"]:
        return None
    if torch.is_tensor(node["value"]) and node["value"].requires_grad:
        return None
    base = unwrap(node["fn"])[0]
    return None if centred_logits(base) is not None else base


def _candidate(an, site: str) -> bool:
    """Whether factor ``site`` with discrete parents may be a GLM in a Gaussian block given them:
    observed, its discrete parents with a mean-field ``q`` (none summed out; a plate-local one
    only with ``AutoCVI(discrete="mean_field")``, the rule in the module docstring), outside
    any subsampled plate, not a Normal whose loc reads a continuous latent (exact rows)."""
    return _candidate_under(an, site, getattr(an, "discrete_mode", "auto"), an.collapsed)


def _candidate_under(an, site: str, mode: str, summed) -> bool:
    """:func:`_candidate` with the ``discrete=`` mode ``mode`` and the summed-out set ``summed``."""
    disc = an.deps.get(site, set()) & an.discrete
    if not disc or disc & summed or site in an.discrete:
        return False
    local = any(not is_global(an.structure.nodes[c]) for c in disc)
    if local and mode != "mean_field":
        return False
    if an.minibatch_plate(site) is not None:
        return False
    base = _observed_base(an, site)
    if base is None:
        return False
    if isinstance(base, torch.distributions.Normal):
        loc = base.loc
        return not (torch.is_tensor(loc) and loc.requires_grad)
    return True


def summed_glm_hint(an, name: str) -> str:
    """For ``explain()``: where discrete latent ``name`` is summed out in the remainder by the
    default rule while ``discrete="mean_field"`` would give it a ``q`` and a GLM factor of it
    linear-predictor sites per value, that option (else ``""``)."""
    if getattr(an, "discrete_mode", "auto") != "auto" or is_global(an.structure.nodes[name]):
        return ""
    summed = an.collapsed - an.remainder_discrete
    for site in an.deps:
        if name in an.deps[site] and _candidate_under(an, site, "mean_field", summed):
            return (
                f" (a plate-local parent of GLM factor {site!r}: summed out by default, "
                "AutoCVI(discrete='mean_field') gives it a q, and the factor sites per value "
                "where its linked parameter is affine given it)"
            )
    return ""


def unites(an, site: str) -> bool:
    """Whether factor ``site`` joins the Gaussian latents it reads into one block: every factor
    without a discrete parent, and a GLM candidate with discrete parents (module docstring)."""
    if not an.deps.get(site, set()) & an.discrete:
        return True
    return _candidate(an, site)


class EnumeratedGLM:
    """The mean field's pattern for (1): ``elp`` is the expected log-density of each enumerated
    value and element (the weights ``q(s = k)`` are applied by the mean field,
    :func:`pyro_cvi.messages.expectations.discrete_weight`)."""

    name = "GLM (enumerated)"

    def __init__(self, param: str, link: Optional[str], names: Sequence[str]):
        self.param, self.link, self.names = param, link, tuple(names)

    def elp(self, m) -> torch.Tensor:
        base = m.base
        eta = linear_param(base, self.param, self.link)[1]
        jac = {p: m.jacobian("eta", p, eta) for p in self.names}
        var = m.q.variance(jac).reshape(eta.shape)
        y = m.x

        def log_prob(e):
            return with_param(base, e, self.param, self.link).log_prob(y)

        return expected_log_prob(log_prob, eta, var.clamp(min=0.0), NUM_POINTS)


def discrete_glm_factor(an, spec, block) -> Optional[Factor]:
    """The record of factor ``spec`` on Gaussian ``block`` (kind ``LINEAR_ENUM``), or ``None``
    where it does not apply: a GLM candidate whose continuous latents all lie in ``block`` (not a
    chain) and whose linked parameter is affine in the block for every enumerated value, with
    a Jacobian free of the model's parameters (probed on the enumerated trace). Marks ``spec``
    exact with the pattern :class:`EnumeratedGLM`, so the mean field computes (1) and its
    message to ``q(s)``."""
    site = spec.site
    if block.chain is not None or spec.collapsed or not _candidate(an, site):
        return None
    if spec.discrete & an.remainder_discrete or spec.continuous - set(block.names):
        return None
    tr, leaves = an.leaf_trace()
    base = _observed_base(an, site)
    zs = [leaves[n] for n in block.names]
    with torch.enable_grad():
        candidates = linear_candidates(base, zs)
    for name, link in candidates:
        value = linear_param(base, name, link)[1]
        read = linked_reader(name, link)
        probed = an.probed_rows(site, block, value, read, structural=link is None)
        if probed is None or probed[1] or not rebuilds(tr.nodes[site], base, value, name, link):
            continue
        A = probed[0]
        given = ", ".join(sorted(spec.discrete))
        how = describe_link(base, name, link, "A_k z + c_k")
        why = (
            f"{type(base).__name__} {how} per value of {given} (probed, A: "
            f"{A.shape[0]}x{A.shape[1]}); {A.shape[0]} sites weighted by q({given}) (eq. 20)"
        )
        spec.exact, spec.pattern = True, EnumeratedGLM(name, link, block.names)
        spec.reason = f"{type(base).__name__} {describe_link(base, name, link)} given {given}"
        return Factor(
            site,
            block.label,
            LINEAR_ENUM,
            why,
            name,
            A,
            False,
            link=link,
            enumerated=tuple(sorted(spec.discrete)),
            enum_dims=an.enum_dims,
        )
    return None
