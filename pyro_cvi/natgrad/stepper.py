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
from .params import read, write
from .roles import GaussianGroup, find_gaussians

__all__ = ["GaussianStepper", "FORMS"]

FORMS = ("retraction", "natural")


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

    def split(
        self, params: Iterable[torch.Tensor]
    ) -> Tuple[List[GaussianGroup], List[torch.Tensor]]:
        """``(Gaussians with a member among params, the other params)``."""
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
        groups = [g for g in self._groups() if any(n in named for _, n in g.names)]
        used = {n for g in groups for _, n in g.names}
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
        if not groups:
            return
        cons = pyro.get_param_store().get_state()["constraints"]
        for g in groups:
            control = self.controls.setdefault(g.label, NoiseControl())
            beta, beta_mean = beta_of(control)
            max_rel = 1.0 if adaptive else None
            new, d = _STEPS[g.family](g.roles, cons, (beta, beta_mean), self.retraction, max_rel)
            if all(bool(torch.isfinite(v).all()) for v in new.values()):
                for name, value in new.items():
                    write(name, value, cons)
                control.observe(d)
            elif g.label not in self.skipped:
                self.skipped.add(g.label)
                warnings.warn(
                    f"CVI(): a natural-gradient step of the Gaussian {g.label!r} was not finite "
                    "and was skipped (non-finite gradients from the loss?); q keeps its value",
                    RuntimeWarning,
                    stacklevel=4,
                )

    def state(self) -> Dict:
        return {k: c.state() for k, c in self.controls.items()}

    def load(self, state: Mapping) -> None:
        for k, v in state.items():
            self.controls.setdefault(k, NoiseControl()).load(v)


def _diag(roles, cons, beta, retraction, max_rel):
    m, gm = read(roles["loc"], cons)
    s, gs = read(roles["scale"], cons)
    m2, s2, d = diag_step(m, s, gm, gs, beta[0], retraction, max_rel, beta[1])
    return {roles["loc"]: m2, roles["scale"]: s2}, d


def _tril(roles, cons, beta, retraction, max_rel):
    m, gm = read(roles["loc"], cons)
    L, gL = read(roles["scale_tril"], cons)
    m2, L2, d = tril_step(m, L, gm, gL, beta[0], retraction, max_rel, beta[1])
    return {roles["loc"]: m2, roles["scale_tril"]: L2}, d


def _scaled_tril(roles, cons, beta, retraction, max_rel):
    """``L = diag(s) T`` (``AutoMultivariateNormal``): ``dl/dL`` below the diagonal is
    ``(dl/dT) / s_i``; on it, ``dl/ds_i - sum_{j<i} T_ij dl/dL_ij``."""
    m, gm = read(roles["loc"], cons)
    s, gs = read(roles["scale"], cons)
    T, gT = read(roles["scale_tril"], cons)
    off = gT.tril(-1) / s.unsqueeze(-1)
    diag = gs - (T.tril(-1) * off).sum(-1)
    L = s.unsqueeze(-1) * T
    gL = off + torch.diag_embed(diag)
    m2, L2, d = tril_step(m, L, gm, gL, beta[0], retraction, max_rel, beta[1])
    s2 = L2.diagonal(dim1=-2, dim2=-1)
    return {roles["loc"]: m2, roles["scale"]: s2, roles["scale_tril"]: L2 / s2.unsqueeze(-1)}, d


def _lowrank(roles, cons, beta, retraction, max_rel):
    m, gm = read(roles["loc"], cons)
    s, gs = read(roles["scale"], cons)
    W, gW = read(roles["cov_factor"], cons)
    m2, s2, W2, d = lowrank_step(m, s, W, gm, gs, gW, beta[0], max_rel, beta_mean=beta[1])
    return {roles["loc"]: m2, roles["scale"]: s2, roles["cov_factor"]: W2}, d


_STEPS = {"diag": _diag, "tril": _tril, "scaled_tril": _scaled_tril, "lowrank": _lowrank}
