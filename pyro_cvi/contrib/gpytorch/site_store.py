"""Storage shared by the binary and multi-class CVI strategies: writing site parameters into
their buffers, and comparing the state keys that decide when a cached ``q`` is still valid."""

from __future__ import annotations

import warnings
from typing import Callable, List, Optional, Tuple

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.variational import _VariationalDistribution
from torch import Tensor

from ...gaussian.sites import pseudo_observations

__all__ = [
    "CVISites",
    "check_data_site_args",
    "warn_untrained",
    "write_sites",
    "keys_equal",
    "pseudo_observations",
]


def write_sites(
    buffers: tuple,
    lam1: Tensor,
    lam2: Tensor,
    indices: Optional[Tensor] = None,
    check: Optional[Callable[[Tensor], None]] = None,
) -> None:
    """Overwrite the site buffers ``(lam1, lam2)`` (all, or the rows ``indices``) after checking
    that the new values are finite and pass ``check(lam2)`` (the strategy's validity rule)."""
    if not (torch.isfinite(lam1).all() and torch.isfinite(lam2).all()):
        raise FloatingPointError("refusing to store non-finite CVI site parameters.")
    if check is not None:
        check(lam2)
    with torch.no_grad():
        for buf, new in zip(buffers, (lam1, lam2)):
            if indices is None:
                buf.copy_(new)
            else:
                buf[indices] = new.to(buf)


def keys_equal(a: List, b: List) -> bool:
    """Two state keys ``[site version, tensors...]`` are equal: same version, and tensors of the
    same shape, dtype and device with equal values."""
    if len(a) != len(b) or a[0] != b[0]:
        return False
    return all(
        x.shape == y.shape and x.dtype == y.dtype and x.device == y.device and torch.equal(x, y)
        for x, y in zip(a[1:], b[1:])
    )


class CVISites(_VariationalDistribution):
    """Container for the CVI site natural parameters: ``lam1`` and ``lam2`` (length ``N``).

    The site of data point ``n`` is ``exp(lam1_n f_n + lam2_n f_n^2)`` with ``lam2_n <= 0``.
    All-zero sites (the initial value) mean q = prior. This is not a distribution over ``u`` on
    its own: q(u) depends on the kernel, so use ``strategy.variational_distribution``.
    """

    def __init__(
        self,
        num_sites: int,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
    ):
        super().__init__(num_inducing_points=num_sites)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        self.register_buffer("lam1", torch.zeros(num_sites, dtype=dtype, device=device))
        self.register_buffer("lam2", torch.zeros(num_sites, dtype=dtype, device=device))

    @property
    def device(self) -> torch.device:
        return self.lam1.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lam1.dtype

    def initialize_variational_distribution(self, prior_dist: MultivariateNormal) -> None:
        self.lam1.zero_()
        self.lam2.zero_()

    def forward(self):
        raise RuntimeError(
            "CVISites hold site parameters, not q(u); q(u) depends on the kernel. "
            "Use model.variational_strategy.variational_distribution instead."
        )


def check_data_site_args(
    inducing_points: Tensor, num_data: int, learn: bool, train_inputs: Optional[Tensor]
) -> Tuple[bool, Optional[Tensor]]:
    """The data-site form's constructor checks: returns whether it is the full form and the
    ``N x D`` training inputs (or ``None``)."""
    if inducing_points.dim() != 2:
        raise NotImplementedError(
            "the data-site form of CVIVariationalStrategy supports a single GP "
            f"(inducing_points of shape M x D); got shape {tuple(inducing_points.shape)}. "
            "For batches of GPs build it the GPyTorch way (no num_data)."
        )
    is_full = train_inputs is None and inducing_points.shape[-2] == num_data
    if is_full and learn:
        raise ValueError(
            "In the full form the inducing points are the training inputs and cannot be "
            "learned. For learned inducing locations use the sparse form: pass "
            "train_inputs=X_train and M < N inducing points."
        )
    if train_inputs is not None:
        if train_inputs.dim() == 1:
            train_inputs = train_inputs.unsqueeze(-1)
        if train_inputs.shape[-2] != num_data:
            raise ValueError(
                f"train_inputs has {train_inputs.shape[-2]} rows but num_data={num_data}."
            )
    return is_full, train_inputs


def warn_untrained() -> None:
    """The data-site form's warning for a training pass with q at the prior and no optimizer."""
    warnings.warn(
        "CVIVariationalStrategy (data-site form, built with num_data=): q(u) is still the "
        "prior and only CVIOptimizer.step updates its sites, so a loop of loss.backward() and "
        "a torch optimizer trains the hyperparameters alone. Add CVIOptimizer(model, "
        "likelihood) and call cvi.step(X, y) before each optimizer step, or build the "
        "strategy the GPyTorch way, CVIVariationalStrategy(model, inducing_points, "
        "variational_distribution), whose sites are updated in loss.backward().",
        RuntimeWarning,
        stacklevel=5,
    )
