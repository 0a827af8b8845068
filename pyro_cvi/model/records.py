"""The records an :class:`~pyro_cvi.model.analysis.Analysis` produces: one :class:`Factor` per
(factor, latent or block) pair, one :class:`LatentInfo` per latent site, one :class:`BlockSpec`
per joint Gaussian block, and the names of the kinds, forms and owners they use
(docs/architecture.md, step 1 of the pipeline)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from ..families import FAMILY_NAMES, ExponentialFamily

# kinds of (factor, latent) pairs
PRIOR = "conjugate prior"
CONJUGATE = "conjugate"
LINEAR = "linear-predictor"
GENERAL = "general"
#: conjugate to the latent given the others, the expectation over them by Monte Carlo (a Normal
#: likelihood's Gamma precision beside the remainder: ``E_q[(y - loc)^2]`` over its draws)
CONJUGATE_MC = "conjugate (MC)"
#: a Normal factor with discrete (mean-field) parents, loc affine in a Gaussian block given them:
#: exact rows per enumerated value, weighted by ``q`` of the values (eq. 20)
CONJUGATE_ENUM = "conjugate (enumerated)"
#: a GLM factor with discrete (mean-field) parents, its linked parameter affine in a Gaussian
#: block given them: linear-predictor sites per enumerated value, weighted by ``q`` of the value
LINEAR_ENUM = "linear-predictor (enumerated)"
#: a Normal factor whose loc is affine in a Gaussian block and whose scale depends only on other
#: blocks' latents: exact rows with ``1/sigma^2`` replaced by ``E_q[1/sigma^2]`` (eq. 20), in
#: closed form (a log-normal scale) or averaged over many draws of the other blocks' ``q``
CONJUGATE_SCALE = "conjugate (E 1/s^2)"
CONJUGATE_SCALE_MC = "conjugate (MC 1/s^2)"
#: the Normal prior of a Gaussian block latent whose loc and scale are other blocks' latents
#: (``theta ~ Normal(mu, tau)`` beside the remainder): the prior at ``E_q[1/s^2]`` and
#: ``E_q[loc/s^2]`` in closed form (eq. 20, :mod:`~pyro_cvi.model.prior_factor`)
CONJUGATE_PRIOR = "conjugate (E prior)"
#: ``AutoCVI(families={site: name})`` names that place a latent without choosing its family:
#: ``"joint"`` keeps a block latent whose prior reads the remainder in its joint Gaussian
#: (:func:`~pyro_cvi.model.remainder.remainder_sets`)
PLACEMENTS = ("joint",)
#: every name ``AutoCVI(families=...)`` accepts
SITE_CHOICES = tuple(FAMILY_NAMES) + PLACEMENTS
LEAF = "leaf"
COLLAPSED = "collapsed"
NATGRAD = "natural-gradient"  # a factor of the remainder: reparameterised natural gradients
#: a Categorical / OneHotCategorical / Multinomial factor with logits affine in a Gaussian
#: block: K-dimensional sites (:mod:`pyro_cvi.messages.softmax_sites`)
SOFTMAX = "softmax-predictor"

# forms of a latent's q
SITE = "site"
NATURAL = "natural"
LEAF_FORM = "leaf"
REMAINDER = "remainder"  # in the joint Gaussian of the remainder (model/remainder.py)

# owners of ELBO terms (besides a block index)
MEANFIELD = "meanfield"
CONSTANT = "constant"
REMAINDER_OWNER = "remainder"


@dataclass
class Factor:
    """One (factor site, latent site or block) pair and how CVI treats it."""

    site: str
    latent: str
    kind: str
    reason: str
    param: Optional[str] = None
    jacobian: Optional[torch.Tensor] = None  # (R, D): d link(param) / d z (block: joint z)
    dynamic: bool = False  # the Jacobian depends on learnable parameters: recompute each step
    given_others: bool = False  # conjugate given the other (natural-form) latents (eq. 20)
    time_index: Optional[torch.Tensor] = None  # Markov block: the step of each row (R,)
    num_classes: int = 0  # K of a softmax factor (its Jacobian has N K point-major rows)
    plate: Optional[str] = None  # a subsampled plate it lies in (its sites change per minibatch)
    #: a linear predictor's link: ``param = LINKS[link][0](A z + c)`` (``None``: the registered
    #: likelihood's own, ``model.tracing.LINEAR_PARAMS``)
    link: Optional[str] = None
    #: a general factor that reads a draw the guide does not see (``poutine.block``): its
    #: messages are averaged over the steps (:mod:`~pyro_cvi.blocks.hidden_draws`)
    hidden_draw: bool = False
    #: a linear predictor in a vectorised subsampled plate: ``(axis, full shape)`` of its
    #: linked value (the plate's axis and the value's shape at the plate's full size)
    minibatch: Optional[Tuple[int, Tuple[int, ...]]] = None
    #: the discrete latents a ``CONJUGATE_ENUM`` factor is enumerated over, and the plate dims
    #: left of which they are enumerated
    enumerated: Tuple[str, ...] = ()
    enum_dims: Optional[int] = None
    #: a ``CONJUGATE_SCALE(_MC)`` factor's expected-scale set-up
    #: (:class:`~pyro_cvi.model.scale_factor.ScaleInfo`)
    scale: Optional[Any] = None

    @property
    def link_of(self) -> Tuple[Optional[str], Optional[str]]:
        """``(param, link)``: how to read its linked value (``tracing.linked_reader``)."""
        return self.param, self.link

    def describe(self) -> str:
        return f"{self.site:>20s} -> {self.latent:<12s} {self.kind:<17s} {self.reason}"


@dataclass
class LatentInfo:
    name: str
    family: Optional[ExponentialFamily]
    form: str
    event_shape: torch.Size
    batch_shape: torch.Size
    frames: list  # the site's vectorised plates (CondIndepStackFrame)
    block: Optional[int] = None
    factors: List[Factor] = field(default_factory=list)


@dataclass
class BlockSpec:
    """A joint Gaussian over the flattened, concatenated values of ``names``."""

    index: int
    names: Tuple[str, ...]
    shapes: Tuple[torch.Size, ...]
    factors: List[Factor] = field(default_factory=list)
    #: a Markov chain prior (a Kalman-smoother block): a registered finder's chain
    #: (:mod:`~pyro_cvi.model.structures`; :class:`pyro_cvi.statespace.detect.ChainSpec`)
    chain: Optional[Any] = None
    #: members whose Normal prior has a loc affine in the others: ``name -> A`` (R x D), the
    #: Jacobian of the loc in the joint z (a linear-Gaussian tree, model/gaussian_tree.py)
    prior_rows: Dict[str, torch.Tensor] = field(default_factory=dict)
    #: tree members whose prior scale depends on mean-field latents (a plug-in prior)
    scale_latent: Set[str] = field(default_factory=set)

    @property
    def sizes(self) -> Tuple[int, ...]:
        return tuple(int(s.numel()) for s in self.shapes)

    @property
    def dim(self) -> int:
        return sum(self.sizes)

    @property
    def label(self) -> str:
        long = self.chain is not None and len(self.names) > 3
        return f"{self.names[0]}..{self.names[-1]}" if long else ", ".join(self.names)

    def split(self, z: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Site values from a joint vector ``z`` (trailing dim ``D``; leading dims kept)."""
        out, i = {}, 0
        for n, s, k in zip(self.names, self.shapes, self.sizes):
            out[n] = z[..., i : i + k].reshape(z.shape[:-1] + s)
            i += k
        return out

    def join(self, values: Dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([values[n].reshape(-1) for n in self.names])


_SOFTMAX_CLASSES = (
    torch.distributions.Categorical,
    torch.distributions.OneHotCategorical,
    torch.distributions.Multinomial,
)


def centred_logits(base) -> Optional[torch.Tensor]:
    """``logits - mean(logits, -1)`` of a softmax likelihood, else ``None``."""
    if not isinstance(base, _SOFTMAX_CLASSES):
        return None
    logits = base.logits
    return logits - logits.mean(-1, keepdim=True)
