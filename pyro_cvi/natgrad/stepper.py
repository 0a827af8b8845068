"""Natural-gradient steps for the Gaussians of a Pyro guide, as the :class:`~pyro_cvi.CVI`
optimizer applies them (see :mod:`pyro_cvi.gaussian.steps` for the maths and
:mod:`pyro_cvi.natgrad.roles` for how the Gaussians are found)."""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import pyro
import torch

from ..gaussian import diag_step, lowrank_step, tril_step
from .control import NoiseControl
from .curvature import CHECKS, MAX_DIM, DrawCurvature, diag_with_draw, tril_with_draw
from .expfam import (
    CONCENTRATION_FAMILIES,
    MAX_FACTOR,
    concentration_group_step,
    gaussian_score_control,
)
from .observe import GuideSite
from .params import read, write
from .roles import GaussianGroup, find_gaussians
from .sites import leaf_tensors, site_group

__all__ = ["GaussianStepper", "FORMS"]

FORMS = ("retraction", "natural")
#: the lowest ceiling of a concentration family's adaptive step
CONCENTRATION_MIN_CEILING = 0.01


class GaussianStepper:
    """Finds the Gaussians among the parameters handed to the optimizer and steps them.

    :param form: ``"retraction"`` (default: Lin, Schmidt & Khan 2020, positive definite at
        every step size) or ``"natural"`` (the plain natural-gradient step, halved per
        Gaussian until valid; exact in one step at ``b = 1`` on conjugate Gaussian models).
    :param declared: explicit Gaussians, ``label -> (loc name, scale or scale_tril name)``.
    """

    def __init__(
        self, form: str = "retraction", declared: Optional[Mapping[str, Sequence[str]]] = None
    ):
        if form not in FORMS:
            raise ValueError(f"CVI(gaussian_step={form!r}): choose one of {FORMS}")
        self.retraction = form == "retraction"
        self.declared = dict(declared or {})
        self.controls: Dict[str, NoiseControl] = {}
        self.skipped: set = set()  # Gaussians warned about (once each)
        self._cache: Tuple[object, List[GaussianGroup]] = (None, [])
        #: the groups found at the guide's sites (:meth:`observe`), by site
        self.site_groups: Dict[str, GaussianGroup] = {}
        #: the guide sites that are not stepped by natural gradients, and why
        self.site_skipped: Dict[str, str] = {}
        self._site_cache: Dict[str, Tuple[object, Tuple[Optional[GaussianGroup], str]]] = {}
        #: the guide sites of the last loss (their draws: expfam.site_score)
        self.draws: Dict[str, GuideSite] = {}
        #: the single draw of each Normal site the last loss ran, by its loc's param name
        self.normal_draws: Dict[str, torch.Tensor] = {}
        #: the params that are the whole loc of a guide site with no site group (a joint
        #: autoguide's latent, ``L = diag(s) T``: its group is found by name)
        self.site_locs: set = set()
        #: the curvature fitted from the draws of each diagonal Gaussian (by label)
        self.curvatures: Dict[str, DrawCurvature] = {}
        #: the raw parameters the last step overwrote, with their values before it (:meth:`undo`)
        self.before: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.before_labels: List[str] = []

    def observe(self, sites: Mapping[str, GuideSite]) -> None:
        """Analyse the guide sites the loss just ran (:mod:`pyro_cvi.natgrad.sites`); an empty
        ``sites`` (a compiled loss, or a loss that ran no guide) keeps what was found before."""
        self.draws = dict(sites)
        self.normal_draws = {}  # (this loss's draws only: a stale draw would mislead the fit)
        if not sites:
            return
        self.site_locs = set()
        store = pyro.get_param_store()
        names = {id(u): n for n, u in store.named_parameters()}
        cons = store.get_state()["constraints"]
        found: Dict[str, Tuple[Optional[GaussianGroup], str]] = {}
        params_key = tuple(sorted(names.items()))
        for name, site in sites.items():
            key = _site_key(site, params_key)
            cached = self._site_cache.get(name)
            if cached is not None and cached[0] == key:
                found[name] = cached[1]
                continue
            result = site_group(site, names, cons)
            self._site_cache[name] = (key, result)
            found[name] = result
        for name in list(self._site_cache):
            if name not in sites:
                del self._site_cache[name]
        # a parameter that feeds two sites is not any one site's: the inner optimizer's
        owners: Dict[str, List[str]] = {}
        for name, (g, _) in found.items():
            for n in {n for _, n in g.names} if g is not None else ():
                owners.setdefault(n, []).append(name)
        self.site_groups = {}
        self.site_skipped = {}
        for name, (g, why) in found.items():
            if g is None:
                self.site_skipped[name] = why
            elif any(len(owners[n]) > 1 for _, n in g.names):
                shared = [n for _, n in g.names if len(owners[n]) > 1]
                self.site_skipped[name] = f"{shared[0]!r} also feeds another site"
            else:
                self.site_groups[name] = g
        for name, (g, _) in found.items():
            draw = _single_draw(sites[name], g)
            if draw is not None and g is not None:
                self.normal_draws[g.roles["loc"]] = draw
            elif g is None:
                loc_name, draw = _joint_loc(sites[name], names)
                if loc_name is not None:
                    self.site_locs.add(loc_name)
                if draw is not None:
                    self.normal_draws[loc_name] = draw

    def split(
        self, params: Iterable[torch.Tensor]
    ) -> Tuple[List[GaussianGroup], List[torch.Tensor]]:
        """``(groups with a member among params, the other params)``: first the guide sites
        found in the trace (:meth:`observe`), except Pyro's autoguides, whose parameters keep
        their name-based roles (:mod:`.roles`); then the name-based groups of what is left: only
        the autoguides' and the declared ones once guide sites were seen (a model's ``loc`` and
        ``scale`` hyperparameters are no Gaussian q), any (the old convention) before."""
        store = pyro.get_param_store()
        named = {}
        rest = []
        for p in params:
            name = store.param_name(p)
            if name is None:
                rest.append(p)
            else:
                named[name] = p
        if not named:
            return [], rest
        groups = []
        used: set = set()
        declared = {n for pair in self.declared.values() for n in pair}
        for g in self.site_groups.values():
            members = [n for _, n in g.names]
            if any(n.startswith("Auto") or n in declared for n in members):
                continue
            if any(n in named for n in members) and all(n in store for n in members):
                groups.append(g)
                used.update(members)
        seen_sites = bool(self.site_groups or self.site_skipped)
        for g in self._groups():
            members = [n for _, n in g.names]
            own = all(n.startswith("Auto") or n in declared for n in members)
            if seen_sites and not own and g.roles.get("loc") not in self.site_locs:
                continue  # named like a Gaussian but feeds no guide site: a model parameter
            if any(n in named for n in members) and not used & set(members):
                groups.append(g)
                used.update(members)
        return groups, rest + [p for n, p in named.items() if n not in used]

    def _groups(self) -> List[GaussianGroup]:
        store = pyro.get_param_store()
        shapes = {n: u for n, u in store.named_parameters()}
        key = tuple((n, tuple(u.shape), id(u)) for n, u in shapes.items())
        if self._cache[0] != key:
            cons = store.get_state()["constraints"]
            self._cache = (key, find_gaussians(shapes, shapes, cons, self.declared))
        return self._cache[1]

    def step(
        self,
        groups: List[GaussianGroup],
        beta_of: Callable[[NoiseControl], Tuple[float, Optional[float]]],
        adaptive: bool = False,
    ) -> None:
        """One step of every Gaussian in ``groups``; ``beta_of(control)`` gives its sizes
        ``(b, b for the mean or None: the same)``. ``adaptive``: also cap each step by a trust
        region (see :func:`pyro_cvi.gaussian.steps.tril_step`)."""
        self.before, self.before_labels = [], [g.label for g in groups]
        if not groups:
            return
        store = pyro.get_param_store()
        cons = store.get_state()["constraints"]
        for g in groups:
            for _, n in g.names:
                raw = store[n].unconstrained()
                self.before.append((raw, raw.detach().clone()))
            control = self.controls.get(g.label)
            if control is None:
                control = self.controls[g.label] = _control(g.family)
            beta, beta_mean = beta_of(control)
            max_rel = 1.0 if adaptive else None
            fit = self._fit(g) if g.family in _FITTED else None
            if g.site and fit is None:  # the score control variate of the site's draw
                # (natgrad.expfam; a curvature fit carries its own control variates)
                gaussian_score_control(g, self.draws.get(g.site), control, cons)
            if g.family in CONCENTRATION_FAMILIES:
                factor = MAX_FACTOR if max_rel is not None else None
                new, d = concentration_group_step(
                    g, cons, beta, factor, self.draws.get(g.site), control
                )
            elif g.family == "diag":
                new, d = _diag(g, cons, (beta, beta_mean), self.retraction, max_rel, fit)
                if fit is not None and fit[1].active and not fit[1].started:
                    # the gradients' noise changed: the step control starts afresh
                    fit[1].started = True
                    control = self.controls[g.label] = _control(g.family)
            else:  # (here only the full-covariance families have a fit)
                extra = () if fit is None else (fit,)
                new, d = _STEPS[g.family](
                    g, cons, (beta, beta_mean), self.retraction, max_rel, *extra
                )
            if all(bool(torch.isfinite(v).all()) for v in new.values()):
                roles, maps = g.roles, g.transforms
                for role, value in new.items():
                    write(roles[role], value, cons, maps.get(role))
                control.observe(d)
            elif g.label not in self.skipped:
                self.skipped.add(g.label)
                warnings.warn(
                    f"CVI(): a natural-gradient step of the Gaussian {g.label!r} was not finite "
                    "and was skipped (non-finite gradients from the loss?); q keeps its value",
                    RuntimeWarning,
                    stacklevel=4,
                )

    def undo(self) -> List[str]:
        """Put back the raw values the last :meth:`step` overwrote (bit for bit) and let every
        step control start afresh; the labels of the Gaussians put back."""
        with torch.no_grad():
            for raw, value in self.before:
                raw.copy_(value)
        self.before = []
        self.controls.clear()
        labels, self.before_labels = self.before_labels, []
        return labels

    def _fit(self, g: GaussianGroup) -> Optional[Tuple[torch.Tensor, DrawCurvature]]:
        """``(draw, curvature fit)`` of a diagonal or full-covariance Gaussian with one draw
        this step (:mod:`.curvature`), else ``None``. A full covariance takes the fit from
        ``d + 2`` draws on (its step has no other way to average the one-draw Wishart noise);
        so does a one-coordinate Normal (a line through 3 draws: its one-draw precision target
        carries ``Lambda (m - m*) eps / s``, which far from the mean throws the precision
        and then, through it, the mean further off); a diagonal one after a window of
        ``2 d + 10``. The scalar sites of Pyro's autoguides are not fitted: on the zoo's
        non-centred eight schools the fit of ``AutoNormal``'s ``tau`` (a non-Gaussian
        posterior in the log scale) ended 0.6 nat worse than the plain step."""
        draw = self.normal_draws.get(g.roles["loc"])
        if draw is None or not 1 <= draw.numel() <= MAX_DIM:
            return None
        if draw.numel() == 1 and any(n.startswith("Auto") for _, n in g.names):
            return None  # an autoguide's scalar site keeps the plain step (see _fit's doc)
        curv = self.curvatures.get(g.label)
        if curv is None or curv.dim != draw.numel():
            d = draw.numel()
            full = g.family != "diag" or d == 1
            curv = DrawCurvature(d, d + 2, CHECKS) if full else DrawCurvature(d)
            self.curvatures[g.label] = curv
        return draw, curv

    def state(self) -> Dict:
        state: Dict = {k: c.state() for k, c in self.controls.items()}
        if self.curvatures:
            state[_CURVATURES] = {k: c.state() for k, c in self.curvatures.items()}
        return state

    def load(self, state: Mapping) -> None:
        for k, v in state.items():
            if k == _CURVATURES:
                for label, cs in v.items():
                    curv = self.curvatures[label] = DrawCurvature(int(cs["u"].numel()))
                    # (min_draws and checks, where saved, are restored by load)
                    curv.load(cs)
            else:
                self.controls.setdefault(k, NoiseControl()).load(v)


def _rd(g: GaussianGroup, role: str, cons) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(theta, dl/dtheta)`` of one role, the gradient per copy of a broadcast site."""
    c, grad = read(g.roles[role], cons, g.transforms.get(role))
    return c, grad if g.weight == 1.0 else grad / g.weight


def _diag(g, cons, beta, retraction, max_rel, fit=None):
    m, gm = _rd(g, "loc", cons)
    s, gs = _rd(g, "scale", cons)
    precondition = None
    if fit is not None and fit[0].shape == m.shape:
        gm, gs, precondition = diag_with_draw(m, s, gm, gs, fit[0], fit[1])
    m2, s2, d = diag_step(m, s, gm, gs, beta[0], retraction, max_rel, beta[1], precondition)
    return {"loc": m2, "scale": s2}, d


def _full_step(m, L, gm, gL, beta, retraction, max_rel, fit):
    """The step of ``N(m, L L^T)``, with the draws' curvature fit where there is one."""
    G = None
    if fit is not None and fit[0].shape == m.shape and m.dim() == 1:
        fitted = tril_with_draw(m, L, gm, gL, fit[0], fit[1])
        if fitted is not None:
            gm, G = fitted
    return tril_step(m, L, gm, gL, beta[0], retraction, max_rel, beta[1], G)


def _tril(g, cons, beta, retraction, max_rel, fit=None):
    m, gm = _rd(g, "loc", cons)
    L, gL = _rd(g, "scale_tril", cons)
    m2, L2, d = _full_step(m, L, gm, gL, beta, retraction, max_rel, fit)
    return {"loc": m2, "scale_tril": L2}, d


def _scaled_tril(g, cons, beta, retraction, max_rel, fit=None):
    """``L = diag(s) T`` (``AutoMultivariateNormal``): ``dl/dL`` below the diagonal is
    ``(dl/dT) / s_i``; on it, ``dl/ds_i - sum_{j<i} T_ij dl/dL_ij``; then the step of
    ``N(m, L L^T)`` (:func:`_full_step`)."""
    m, gm = _rd(g, "loc", cons)
    s, gs = _rd(g, "scale", cons)
    T, gT = _rd(g, "scale_tril", cons)
    off = gT.tril(-1) / s.unsqueeze(-1)
    diag = gs - (T.tril(-1) * off).sum(-1)
    L = s.unsqueeze(-1) * T
    gL = off + torch.diag_embed(diag)
    m2, L2, d = _full_step(m, L, gm, gL, beta, retraction, max_rel, fit)
    s2 = L2.diagonal(dim1=-2, dim2=-1)
    return {"loc": m2, "scale": s2, "scale_tril": L2 / s2.unsqueeze(-1)}, d


def _lowrank(g, cons, beta, retraction, max_rel):
    m, gm = _rd(g, "loc", cons)
    s, gs = _rd(g, "scale", cons)
    W, gW = _rd(g, "cov_factor", cons)
    m2, s2, W2, d = lowrank_step(m, s, W, gm, gs, gW, beta[0], max_rel, beta_mean=beta[1])
    return {"loc": m2, "scale": s2, "cov_factor": W2}, d


def _lowrank_cov(g, cons, beta, retraction, max_rel):
    """``LowRankMultivariateNormal(loc, W, d)``, ``S = W W^T + diag(d)``, stepped in Pyro's
    low-rank form ``S = diag(s) (I + V V^T) diag(s)`` with ``s = sqrt(d)``, ``V = W / s``:
    ``dl/dV = s dl/dW`` (rows), ``dl/ds_i = 2 s_i dl/dd_i + sum_j V_ij dl/dW_ij``."""
    m, gm = _rd(g, "loc", cons)
    W, gW = _rd(g, "cov_factor", cons)
    d, gd = _rd(g, "cov_diag", cons)
    sd = d.sqrt()
    V = W / sd.unsqueeze(-1)
    gV = gW * sd.unsqueeze(-1)
    gs = 2.0 * sd * gd + (gW * V).sum(-1)
    m2, s2, V2, dirs = lowrank_step(m, sd, V, gm, gs, gV, beta[0], max_rel, beta_mean=beta[1])
    return {"loc": m2, "cov_factor": V2 * s2.unsqueeze(-1), "cov_diag": s2.pow(2)}, dirs


def _control(family: str) -> NoiseControl:
    """The step control of a new group: a concentration family's natural-gradient noise is
    large relative to its parameters (one Gamma draw says little about its shape), so its
    ceiling may decay further under noise (:mod:`.control`)."""
    if family in CONCENTRATION_FAMILIES:
        return NoiseControl(min_ceiling=CONCENTRATION_MIN_CEILING)
    return NoiseControl()


_STEPS = {
    "diag": _diag,
    "tril": _tril,
    "scaled_tril": _scaled_tril,
    "lowrank": _lowrank,
    "lowrank_cov": _lowrank_cov,
}


#: the families whose single draws are fitted (:mod:`.curvature`)
_FITTED = ("diag", "tril", "scaled_tril")

#: the key of the curvature fits in :meth:`GaussianStepper.state`
_CURVATURES = "__curvatures__"


def _single_draw(site: GuideSite, g: Optional[GaussianGroup]) -> Optional[torch.Tensor]:
    """The value of a ``Normal`` site (under ``.to_event`` only) run once since the last step
    with one particle, of its loc's shape: the draw whose gradient the loss wrote."""
    if g is None or g.family not in _FITTED or site.runs != 1 or site.particles != 1:
        return None
    fn = site.fn
    while type(fn).__name__ == "Independent":
        fn = fn.base_dist
    value = site.value
    family = {"diag": "Normal", "tril": "MultivariateNormal"}.get(g.family)
    if type(fn).__name__ != family or value is None or value.shape != fn.loc.shape:
        return None
    return value


def _joint_loc(
    site: GuideSite, names: Mapping[int, str]
) -> Tuple[Optional[str], Optional[torch.Tensor]]:
    """``(loc's param name, draw)`` of a joint Gaussian site (``MultivariateNormal``,
    ``LowRankMultivariateNormal``) with no site group whose loc is one whole parameter, as in
    Pyro's joint autoguides (``L = diag(s) T``: the group is found by name, :mod:`.roles`,
    whatever the guide's class is called); the draw only where one run with one particle made
    it (else ``None``); ``(None, None)`` for any other site."""
    fn = site.fn
    while type(fn).__name__ == "Independent":
        fn = fn.base_dist
    if type(fn).__name__ not in ("MultivariateNormal", "LowRankMultivariateNormal"):
        return None, None
    loc = fn.loc
    leaves = leaf_tensors(loc) if loc.dim() == 1 else None
    if leaves is None or len(leaves) != 1 or leaves[0].shape != loc.shape:
        return None, None
    name = names.get(id(leaves[0]))
    if name is None:
        return None, None
    value = site.value
    if (
        type(fn).__name__ != "MultivariateNormal"
        or site.runs != 1
        or site.particles != 1
        or value is None
        or value.shape != loc.shape
    ):
        return name, None
    return name, value


def _site_key(site: GuideSite, params_key: object) -> object:
    """What the analysis of a site depends on: its distribution's wrappers, their tensors'
    shapes, its plate context and the raw parameters that exist (ids)."""
    chain = []
    fn = site.fn
    for _ in range(16):
        chain.append(
            (type(fn).__name__,)
            + tuple((k, tuple(v.shape)) for k, v in sorted(vars(fn).items()) if torch.is_tensor(v))
        )
        fn = getattr(fn, "base_dist", None)
        if fn is None:
            break
    return (tuple(chain), site.scale, site.particles, params_key)
