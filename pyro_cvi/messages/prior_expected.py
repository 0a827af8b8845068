"""The expected prior of a Gaussian block latent whose loc and scale live in the remainder.

For ``theta ~ Normal(loc, s)`` with ``loc = c + G u`` and ``log s = d + H u`` in the
remainder's unconstrained coordinates ``u`` (:mod:`~pyro_cvi.model.prior_factor`), under
``q(u) = N(m, S)`` and per row (``g``, ``h`` its coefficients):

    E[1/s^2]   = exp(-2 (d + h'm) + 2 h'S h),
    E[loc/s^2] = (c + g'm - 2 g'S h) E[1/s^2]

(``E[x e^{a'u}] = (E[x] + cov(x, a'u)) E[e^{a'u}]`` for jointly Gaussian ``x, u``). The block's
prior for that latent is then ``N(E[loc/s^2] / E[1/s^2], 1 / E[1/s^2])``: its natural
parameters are the expected ones (eq. 20), exact given the remainder's ``q``; in a
linear-Gaussian tree (``loc = A z + c``, ``z`` the block) the conditional's precision is
``E[1/s^2]`` and its offset ``E[c/s^2] / E[1/s^2]``.

The remainder's side of the same factor (its ELBO term and its message to ``u``) is
Rao-Blackwellised over the block's ``q(theta) = N(m_theta, v_theta)`` per coordinate
(:func:`expected_log_prior`):

    E_q(theta)[log N(theta; loc, s)] = log N(m_theta; loc, s) - v_theta / (2 s^2),

exact in ``theta`` where the loc does not read the block, so that the remainder's gradient in
``u`` carries no draw of ``theta``. An observation shared with the block in the same way,
``y ~ Normal(A theta + c(u), s(u))`` with ``A`` free of every latent (the block's
expected-scale rows), is read as

    E_q(theta)[log N(y; A theta + c, s)] = log N(y; A m + c, s) - diag(A V A') / (2 s^2)

(:func:`shared_moments`: the run's loc holds ``A theta`` at a draw, so the value passed is
``y + A (theta - m)``).
"""

from __future__ import annotations

from typing import Dict, Tuple

import pyro
import torch
from pyro.distributions.util import broadcast_shape, sum_rightmost

from ..gaussian import centred_exp_mean
from ..model.prior_factor import PriorInfo, observation_info
from ..model.records import CONJUGATE_PRIOR, CONJUGATE_SCALE, CONJUGATE_SCALE_MC
from ..model.tracing import unwrap

__all__ = [
    "beside_message",
    "beside_messages",
    "block_moments",
    "expected_log_prior",
    "expected_prior",
    "expected_prior_moments",
    "observation_message",
    "remainder_moments",
    "shared_moments",
]


def expected_prior_moments(
    info, m: torch.Tensor, S: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(E[1/s^2], E[loc/s^2])`` per row of the prior :class:`PriorInfo` ``info`` under
    ``N(m, S)`` on the given latents' stacked unconstrained values (their order in ``info``)."""
    G = torch.cat([info.G[x] for x in info.given], 1).to(m)
    H = torch.cat([info.H[x] for x in info.given], 1).to(m)
    du = m - torch.cat([info.u0[x] for x in info.given]).to(m)
    loc = info.loc0.to(m) + G @ du
    log_s = info.log_scale0.to(m) + H @ du
    HS = H @ S
    var = (HS * H).sum(1)
    cov = (HS * G).sum(1)
    e_prec = torch.exp(-2 * log_s) * centred_exp_mean(var.new_tensor(-2.0), var)
    return e_prec, (loc - 2 * cov) * e_prec


def expected_prior(ctx, factor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(w, c)`` per row of ``factor``'s latent's conditional prior (kind ``CONJUGATE_PRIOR``):
    its precision ``E[1/s^2]`` and its loc's offset ``E[c/s^2] / E[1/s^2]`` (the block's own
    part of the loc, ``A z``, stays the tree's) at the current ``q`` of the remainder that
    holds the latents its loc and scale read."""
    info = factor.scale
    m, S = remainder_moments(ctx, info.given, f"the prior of {factor.site!r}", factor.site)
    e_prec, e_loc = expected_prior_moments(info, m, S)
    return e_prec, e_loc / e_prec


def beside_message(ctx, factor, shape: torch.Size) -> Tuple[torch.Tensor, torch.Tensor]:
    """The exact message of a natural-form Gaussian latent's own prior (kind
    ``CONJUGATE_PRIOR``, the latent kept beside the remainder): ``log N(theta; loc, s)`` is
    ``E[loc/s^2] theta - E[1/s^2] theta^2 / 2 + const`` under the remainder's ``q``, so its
    gradient in the mean parameters ``(E[theta], E[theta^2])`` is ``(E[loc/s^2], -E[1/s^2]/2)``
    (eq. 20), in the latent's ``shape``."""
    e_prec, e_loc = expected_prior_moments(factor.scale, *_given_moments(ctx, factor))
    return e_loc.reshape(shape), (-0.5 * e_prec).reshape(shape)


def beside_messages(ctx, factors, name: str, shape: torch.Size):
    """The sum of the exact messages the remainder's factors send natural-form latent
    ``name`` kept beside it (:mod:`~pyro_cvi.model.beside`): its own prior's
    (:func:`beside_message`) and its observations' (:func:`observation_message`), in its
    ``shape``; ``None`` where it has none."""
    total = None
    for f in factors:
        if f.kind == CONJUGATE_PRIOR and f.site == name:
            msg = beside_message(ctx, f, shape)
        elif f.kind == CONJUGATE_SCALE and f.site != name and isinstance(f.scale, PriorInfo):
            msg = observation_message(ctx, f, shape)
        else:
            continue
        total = msg if total is None else tuple(a + b for a, b in zip(total, msg))
    return total


def observation_message(ctx, factor, shape: torch.Size) -> Tuple[torch.Tensor, torch.Tensor]:
    """The exact message of observed ``y ~ Normal(A z + c(u), s(u))`` to natural-form ``z``
    (:func:`~pyro_cvi.model.prior_factor.observation_info`): given ``u`` its log-density is
    ``(A z)' (y - c) / s^2 - (A z)^2 / (2 s^2) + const`` per row and, ``z`` mean field, its
    gradient in ``(E[z], E[z^2])`` is ``(A' E[(y - c)/s^2], -(A*A)' E[1/s^2] / 2)``
    (eq. 20), the expectations in closed form under the remainder's ``q`` (as the prior's)."""
    info = factor.scale
    e_prec, e_loc = expected_prior_moments(info, *_given_moments(ctx, factor))
    y = _observed(ctx, factor.site, info).to(e_prec)
    _, At, _, A2t = info.rows
    eta1 = torch.mv(At, y * e_prec - e_loc)
    eta2 = -0.5 * torch.mv(A2t, e_prec)
    return eta1.reshape(shape), eta2.reshape(shape)


def _observed(ctx, site: str, info) -> torch.Tensor:
    """The step's observed value of ``site`` (its data; the analysed one without a trace)."""
    tr = ctx.trace
    if tr is None or site not in tr.nodes:
        return info.y0
    return tr.nodes[site]["value"].detach().reshape(-1)


def _given_moments(ctx, factor) -> Tuple[torch.Tensor, torch.Tensor]:
    site, name = factor.site, factor.latent
    what = f"the prior of {site!r}" if site == name else f"observation {site!r} of {name!r}"
    return remainder_moments(ctx, factor.scale.given, what, name)


def remainder_moments(ctx, given, what: str, site: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(m, S)`` (detached) of the remainder's joint Gaussian over the stacked unconstrained
    values of latents ``given`` (in that order); refused by name where they are not all in
    one remainder (``what`` reads them; ``site``: the latent a user would name)."""
    blocks = {id(ctx.block_for(x)): ctx.block_for(x) for x in given}
    (rem,) = blocks.values() if len(blocks) == 1 else (None,)
    if rem is None or not hasattr(rem, "joint_unconstrained"):
        raise RuntimeError(
            f"{what} reads {', '.join(given)}, which are not all in the remainder's joint "
            f"Gaussian; drop families={{{site!r}: 'gaussian'}} (or name it 'joint') to fit "
            f"{site!r} jointly with them"
        )
    # the moments without a MultivariateNormal (its broadcast check imports sympy once)
    with torch.no_grad():
        loc, cov = pyro.param(rem.loc_name).detach(), rem.covariance()
    starts = {s.name: (s.start, s.size) for s in rem.sites}
    idx = torch.cat(
        [torch.arange(starts[x][0], starts[x][0] + starts[x][1], device=loc.device) for x in given]
    )
    return loc[idx], cov[idx][:, idx]


def expected_log_prior(fn, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """``E[log fn(theta)]`` under ``theta ~ N(mean, var)`` elementwise (independent
    coordinates), for a site's Normal ``fn`` whose parameters are free of ``theta``:
    ``log N(mean; loc, s) - var / (2 s^2)``, summed over its event dims as ``fn.log_prob``."""
    base, mask, ndims = unwrap(fn)
    lp = base.log_prob(mean) - var / (2 * base.scale**2)
    if mask is not None:
        lp = torch.where(mask, lp, lp.new_zeros(()))
    return sum_rightmost(lp, ndims)


def block_moments(an, ctx, owned, others) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """``{site: (mean, variance)}`` (detached) for each site in ``owned`` that the remainder
    reads Rao-Blackwellised over exact blocks' ``q`` at :func:`expected_log_prior`:

    * a prior that is an expected-prior factor (kind ``CONJUGATE_PRIOR``): the moments of the
      latent (the site's shape). Where the loc reads the block (``loc = A z + c``, a tree
      member), those of ``theta - A z`` under the block's joint ``q``, shifted by ``A z`` at
      ``others``' draw of ``z`` (the run's loc holds it), so that the expectation is
      ``log N(E[theta - A z]; c, s) - Var[theta - A z] / (2 s^2)``;
    * an observed Normal shared with exact blocks as their expected-scale rows (kinds
      ``CONJUGATE_SCALE``, ``CONJUGATE_SCALE_MC``: ``y ~ Normal(sum_b A_b z_b + c, s)``, ``A_b``
      free of every latent, ``s`` and ``c`` of the remainder), :func:`shared_moments`;
    * an observation of a natural-form latent kept beside the remainder
      (``an.observed_beside``), :func:`_observed_moments`."""
    out: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
    if ctx is None or ctx.block_for is None or an.remainder_discrete:
        return out
    owned = set(owned)
    shared: Dict[str, list] = {}
    for spec in an.blocks:
        chain = ctx.block_for(spec.names[0]) if spec.chain is not None else None
        if hasattr(chain, "expected_moments"):  # (a chain at its expected precisions)
            out.update(chain.expected_moments(ctx, owned, others))
            continue
        for f in spec.factors:
            if f.site not in owned:
                continue
            if f.kind in (CONJUGATE_SCALE, CONJUGATE_SCALE_MC):
                shared.setdefault(f.site, []).append((spec, f))
            if f.kind != CONJUGATE_PRIOR:
                continue
            moments = _residual_moments(ctx.block_for(f.site), f.site, f.scale, others)
            if moments is not None:
                shape = an.values[f.site].shape
                out[f.site] = (moments[0].reshape(shape), moments[1].reshape(shape))
    for name in getattr(an, "prior_beside", {}):  # natural-form latents beside it
        if name in owned:
            out[name] = _natural_moments(ctx.block_for(name), name)
    for site, name in getattr(an, "observed_beside", {}).items():  # their observations
        if site in owned and name in others:
            out[site] = _observed_moments(an, ctx, site, name, others[name])
    for site, parts in shared.items():
        moments = shared_moments(ctx, site, parts, others)
        if moments is not None:
            out[site] = moments
    return out


def shared_moments(ctx, site: str, parts, others):
    """``(y + sum_b A_b (z_b - m_b), sum_b diag(A_b V_b A_b'))`` of observed Normal ``site``,
    read with the blocks' latents ``z_b`` at ``others``' draws (``parts``: ``(block spec, its
    factor record)`` with the rows ``A_b``), in the site's broadcast shape, or ``None``: then
    the run's ``log N(y; A z + c, s)`` at :func:`expected_log_prior` is

        log N(y; sum_b A_b m_b + c, s) - sum_b diag(A_b V_b A_b') / (2 s^2)
        = E_q(z)[log N(y; A z + c, s)]

    under the blocks' ``q(z_b) = N(m_b, V_b)`` (independent of each other and of the
    remainder), free of the draws. ``y``: the step's trace's value (the data of this step)."""
    tr = ctx.trace
    if tr is None or site not in tr.nodes:
        return None
    y = tr.nodes[site]["value"].detach()
    base = unwrap(tr.nodes[site]["fn"])[0]
    shape = torch.Size(broadcast_shape(base.loc.shape, base.scale.shape, y.shape))  # (no sympy)
    shift = var = None
    for spec, f in parts:
        block, A = ctx.block_for(spec.names[0]), f.jacobian
        if A is None or getattr(f, "dynamic", False) or not hasattr(block, "joint"):
            return None  # (rows that move with the parameters: the draw's term stays)
        if not all(n in others for n in spec.names):
            return None
        if A.shape[0] != shape.numel():
            return None
        m, V = _joint_moments(block, list(spec.names))
        A = A.to(m)
        z = torch.cat([others[n].detach().reshape(-1) for n in spec.names]).to(m)
        d, v = A @ (z - m), ((A @ V) * A).sum(1)
        shift, var = (d, v) if shift is None else (shift + d, var + v)
    if shift is None:
        return None
    return y.expand(shape) + shift.reshape(shape), var.reshape(shape)


def _joint_moments(block, names) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(mean, covariance)`` (detached) of ``block``'s joint ``q`` over ``names``: read from a
    Gaussian block's posterior where it has one (no ``MultivariateNormal`` built: its shape
    check imports sympy once a process; the same numbers), else from ``block.joint``."""
    post, index_of = getattr(block, "post", None), getattr(block, "index_of", None)
    if index_of is None or not hasattr(post, "scale_tril"):
        q = block.joint(names)
        return q.loc.detach(), q.covariance_matrix.detach()
    if tuple(names) == tuple(block.names):
        L = post.scale_tril()
        return post.loc.detach(), torch.matmul(L, L.mT).detach()
    idx = torch.cat([index_of(n) for n in names])
    return post.loc[idx].detach(), post.covariance()[idx][:, idx].detach()


def _natural_moments(block, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(mean, variance)`` (detached) of a natural-form Gaussian latent's mean-field ``q``,
    ``eta = (m / v, -1 / (2 v))``, in its shape."""
    nb = block.natural[name] if hasattr(block, "natural") else block
    eta1, eta2 = (t.detach() for t in nb.natural({}))
    var = -0.5 / eta2
    return eta1 * var, var


def _observed_moments(an, ctx, site: str, name: str, z: torch.Tensor):
    """``(y + A (z - m), diag(A V A'))`` of observation ``site`` of natural-form ``name``
    (``q = N(m, V)``, ``V`` diagonal; ``z``: the run's draw), so that the run's
    ``log N(y; A z + c, s)`` at :func:`expected_log_prior` is ``E_q(z)[log N(y; A z + c, s)]``
    (the module docstring), free of the draw."""
    info = observation_info(an, site, name)
    m, v = _natural_moments(ctx.block_for(name), name)
    y = _observed(ctx, site, info).to(m)
    A, _, A2, _ = info.rows
    shift = torch.mv(A, z.detach().reshape(-1).to(m) - m.reshape(-1))
    var = torch.mv(A2, v.reshape(-1))
    shape = an.structure.nodes[site]["value"].shape
    return (y + shift).reshape(shape), var.reshape(shape)


def _residual_moments(block, site: str, info, others):
    if not hasattr(block, "joint"):
        return None
    inside = info.inside if info.reads_block else ()
    if inside and not all(n in others for n in inside):
        return None
    m, V = _joint_moments(block, [site, *inside])
    R = m.numel() - sum(int(others[n].numel()) for n in inside)
    if not inside:
        return m, V.diagonal()
    A = info.A.to(m)
    B = torch.cat([torch.eye(R, dtype=m.dtype, device=m.device), -A], 1)
    z = torch.cat([others[n].detach().reshape(-1) for n in inside]).to(m)
    mean = B @ m + A @ z
    var = ((B @ V) * B).sum(1)
    return mean, var
