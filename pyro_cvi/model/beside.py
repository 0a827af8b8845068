"""Natural-form Gaussian latents kept beside the remainder with exact expected messages.

Members of a linear-Gaussian tree too large for one joint block
(:data:`~pyro_cvi.model.gaussian_tree.MAX_JOINT_DIM`; ``theta_j ~ Normal(mu, tau)`` over many
groups) become natural-form Gaussians. Such a latent ``z`` keeps an exact mean-field block
beside the remainder (Algorithm 2: a latent with a conjugate conditional keeps its block
whatever its neighbours are) where, given the remainder's unconstrained ``u``, each of its
factors is Gaussian in ``z`` with natural parameters affine in closed-form expectations:

* its own Normal prior, loc and log scale affine in ``u``
  (:func:`~pyro_cvi.model.prior_factor.prior_info`): ``(E[loc/s^2], -E[1/s^2]/2)``;
* an observed Normal ``y ~ Normal(A z + c(u), s(u))``, ``A`` free of every latent, ``c`` and
  ``log s`` affine in ``u`` (:func:`~pyro_cvi.model.prior_factor.observation_info`; a
  varying-intercept regression's likelihood with a common slope and a latent noise scale):
  ``(A' E[(y - c)/s^2], -(A*A)' E[1/s^2]/2)``, every other latent of the observation in the
  remainder (a Gaussian block sharing it joins the remainder, so that ``c`` is affine in
  ``u``);
* factors holding no remainder latent that are exact for it (the mean field's).

Each message is the expected natural parameter (eq. 20), so ``q(z)`` is the conditional
posterior given the remainder's ``q`` at every step; the remainder reads those factors
Rao-Blackwellised over ``q(z)`` (:mod:`~pyro_cvi.messages.prior_expected`).
"""

from __future__ import annotations

from typing import Dict, Optional, Set

from .prior_factor import observation_info, prior_info
from .records import COLLAPSED, GENERAL, NATURAL, SITE

__all__ = ["beside_candidates", "observed_blocks", "observed_beside", "shares_remainder"]


def beside_candidates(an, families: Optional[Dict[str, str]] = None) -> Set[str]:
    """Members of a dropped linear-Gaussian tree, now natural-form Gaussians, whose Normal prior
    reads other latents in the affine way of :func:`~pyro_cvi.model.prior_factor.prior_info`
    and whose every other factor is exact for them or an observation conjugate to them given
    the others (:func:`~pyro_cvi.model.prior_factor.observation_info`). The tree's root
    (``mu``) joins the scale (``tau``) in the remainder, a joint Gaussian of a few coordinates
    that keeps their correlation. Against the joint tree (which also keeps ``mu``-``theta``
    correlation) this gives up about 0.1-0.2 nat; a natural-form ``mu`` beside it fits no
    better (500 groups, float64). A latent the user names in ``families`` keeps the user's
    choice."""
    out: Set[str] = set()
    for n in getattr(an, "dropped_trees", {}):
        info = an.latents.get(n)
        if n in (families or {}) or info is None or info.form != NATURAL:
            continue
        if info.family is None or not info.family.is_gaussian:
            continue
        own = [f for f in info.factors if f.site == n]
        rest = [f for f in info.factors if f.site != n]
        if len(own) != 1 or any(
            f.kind in (GENERAL, COLLAPSED) and observation_info(an, f.site, n) is None for f in rest
        ):
            continue
        if prior_info(an, n, (n,)) is not None:
            out.add(n)
    return out


def _observations(an, name: str, members: Set[str]) -> Optional[Dict[str, str]]:
    """``{site: name}`` for latent ``name``'s factors other than its prior that hold a
    remainder latent (``members``), or ``None`` where one of them is no observation conjugate
    to it with every other latent in the remainder (the remainder would own it: no exact
    message to ``name``)."""
    info = an.latents.get(name)
    out: Dict[str, str] = {}
    if info is None or info.form != NATURAL:
        return out
    for f in info.factors:
        held = an.latents_of(f.site) - {name}
        if f.site == name or not held & members:
            continue
        if not held <= members or observation_info(an, f.site, name) is None:
            return None
        out[f.site] = name
    return out


def shares_remainder(an, name: str, members: Set[str]) -> bool:
    """Whether natural-form latent ``name`` has a factor other than its own prior that holds a
    remainder latent and sends it no exact message (:func:`_observations`)."""
    return _observations(an, name, members) is None


def observed_beside(an, names: Set[str], members: Set[str]) -> Dict[str, str]:
    """``{observation: latent}`` for the latents ``names`` kept beside the remainder
    ``members``: the observations the remainder owns that send them exact messages."""
    out: Dict[str, str] = {}
    for n in sorted(names):
        out.update(_observations(an, n, members) or {})
    return out


def observed_blocks(an, natural: Set[str]) -> Set[str]:
    """Members of Gaussian site blocks that share a conjugate observation with a latent in
    ``natural``: they join the remainder's component (not kept beside it), so that the
    observation's offset is affine in the remainder's coordinates."""
    out: Set[str] = set()
    for n in natural:
        info = an.latents.get(n)
        for f in info.factors if info is not None else ():
            if f.site == n or observation_info(an, f.site, n) is None:
                continue
            for m in an.latents_of(f.site) - {n}:
                other = an.latents.get(m)
                if other is not None and other.form == SITE and other.block is not None:
                    out.update(an.blocks[other.block].names)
    return out
