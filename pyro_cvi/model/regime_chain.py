"""Factors of a Markov chain whose Normal factors' parameters a discrete latent selects.

For a loop ``x_0 ~ N(m0(s), P0(s))``, ``x_t ~ N(A_t(s) x_{t-1} + b_t(s), Q_t(s))`` with
observations ``y_r ~ N(h_r(s)' x_{t_r} + c_r(s), R_r(s))`` and a global discrete ``s`` with a
mean-field ``q(s)`` (Algorithm 2 under ``q(s) q(x)``), every factor's log density is linear in
its natural parameters, so its expected log density under ``q(s)`` is

    E_q(s)[log p(x | s)] = sum_k q(s = k) log p(x | s = k),                            (1)

a Gaussian potential in ``x`` again: the chain's expected message (exact, VMP). The Markov block
(:mod:`~pyro_cvi.blocks.regime_markov`) builds ``q(x)`` from (1) with a Kalman smoother; the mean
field owns the factors' ELBO terms and sends ``q(s = k)`` the expected log density of each
value,

    f_k = E_q(x)[log N(v; mu_k, sigma_k^2)] = log N(E v; E mu_k, sigma_k^2)
          - Var_q(v - mu_k) / (2 sigma_k^2),                                           (2)

with ``v`` the factor's value (a state or data) and ``mu_k`` its loc, affine in the states;
``Var_q`` reads the smoother's marginals and lag-one covariances (:class:`ChainNormal`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from .discrete_glm import EnumeratedGLM
from .records import CONJUGATE_ENUM, LINEAR_ENUM, Factor

__all__ = ["ChainNormal", "RULE", "regime_chain_factor", "regime_sites_factor"]

#: the default rule as explain() states it (scripts/benchmark_kalman_discrete.py measures it)
RULE = (
    "the default for a global unmarked discrete; marked for enumeration it stays summed out "
    "in the remainder, AutoCVI(discrete='collapse') sums it out too"
)


class ChainNormal:
    """The mean field's pattern for (2), elementwise over the enumerated values and the
    Normal's elements (the weights ``q(s = k)`` are applied by the mean field)."""

    name = "Normal (chain, enumerated)"

    def __init__(self, names: Sequence[str]):
        self.names = tuple(names)

    def elp(self, m):
        base, v = m.base, m.x
        resid = v - base.loc
        jac = {p: m.jacobian("resid", p, resid) for p in self.names}
        var = m.q.variance(jac).reshape(resid.shape)
        return base.log_prob(v) - 0.5 * var / base.scale**2


def _normal_loc(spec, kinds=("affine",)) -> bool:
    """Whether ``spec`` is the mean field's exact Normal with its loc of a kind in ``kinds``
    (affine in the continuous latents, or constant for the first state) and a scale free of
    them (both given ``s``)."""
    loc, prec = spec.roles.get("loc"), spec.roles.get("precision")
    return bool(
        spec.exact
        and spec.pattern is not None
        and spec.pattern.name == "Normal"
        and loc is not None
        and loc.kind in kinds
        and (prec is None or prec.kind == "const")
    )


def regime_sites_factor(an, spec, block, linear: Factor) -> Factor:
    """An observation of the chain through a link, reading its regimes: ``linear`` (the chain's
    linear-predictor record on the enumerated trace: one row per value of ``s`` and element)
    as kind ``LINEAR_ENUM``, one site per row with target ``q(s = k)`` times the branch's
    (eqs. 13, 20, 30-31); ``spec`` exact with
    :class:`~pyro_cvi.model.discrete_glm.EnumeratedGLM` (the mean field's ``f_k``)."""
    touched = [n for n in block.names if n in spec.continuous]
    given = ", ".join(sorted(spec.discrete))
    spec.exact, spec.pattern = True, EnumeratedGLM(linear.param, linear.link, touched)
    spec.reason = f"{linear.reason.split(' (')[0]} given {given}"
    why = f"{linear.reason} per value of {given}, weighted by q({given}) (eq. 20)"
    return replace(
        linear,
        kind=LINEAR_ENUM,
        reason=why,
        enumerated=tuple(sorted(spec.discrete)),
        enum_dims=an.enum_dims,
    )


def regime_chain_factor(an, spec, block) -> Optional[Factor]:
    """The record of factor ``spec`` (a transition or an observation of the chain of ``block``
    reading the chain's regime latents) on ``block``: kind ``CONJUGATE_ENUM``, exact; marks
    ``spec`` exact with :class:`ChainNormal` so the mean field computes (2) and its message to
    ``q(s)``. ``None`` for a block that is no chain with regimes."""
    chain = block.chain
    if chain is None or not chain.regimes or not spec.discrete & set(chain.regimes):
        return None
    if spec.site not in block.names and not _normal_loc(spec):
        return None  # (an observation through a link: regime_sites_factor)
    if spec.site in block.names and not _normal_loc(spec, ("affine", "const")):
        raise ValueError(
            f"site {spec.site!r}: a transition of the chain {block.label} that reads "
            f"{', '.join(sorted(spec.discrete))} must be a Normal whose loc is affine in the "
            "previous state and whose scale is free of the states, given each value; mark the "
            "discrete site infer={'enumerate': 'parallel'} (or AutoCVI(discrete='collapse')) "
            "to sum it out instead"
        )
    touched = [n for n in block.names if n in spec.continuous]
    given = ", ".join(sorted(spec.discrete))
    spec.exact, spec.pattern = True, ChainNormal(touched)
    spec.reason = f"Normal given {given}"
    if spec.site == block.names[0]:
        why = (
            f"Markov prior given {given}: Kalman smoother, O(T d^3) ({chain.size_text}), "
            f"the expected prior over q({given}) (eq. 20, exact; {RULE})"
        )
    elif spec.site in block.names:
        why = (
            f"transition into {spec.site} given {given}: the expected natural parameters "
            "sum_k q(s = k) eta_k in the chain prior (eq. 20, exact)"
        )
    else:
        why = (
            f"Normal observation of {touched[0]} given {given}: the expected natural "
            "parameters sum_k q(s = k) eta_k as the step's information (eq. 20, exact)"
        )
    return Factor(
        spec.site,
        block.label,
        CONJUGATE_ENUM,
        why,
        "loc",
        enumerated=tuple(sorted(spec.discrete)),
        enum_dims=an.enum_dims,
    )
