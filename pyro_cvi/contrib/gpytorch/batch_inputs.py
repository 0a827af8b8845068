"""GPyTorch's convention for test inputs, ``[*batch, n, D]``, for :class:`CVIVariationalStrategy`:
the shape checked against the inducing points and the model's batch shape (a named error instead
of a raw size mismatch), and a batch of input sets under the data-site forms predicted as one set
of ``prod(batch) * n`` points whose covariance is cut into its per-set ``n x n`` blocks (the sets
are independent given the data, so each block is what that set alone gives)."""

from __future__ import annotations

from typing import Any

import torch
from gpytorch.distributions import MultivariateNormal
from linear_operator.operators import DiagLinearOperator
from torch import Tensor

__all__ = ["BatchInputForm"]


class BatchInputForm:
    """Input-shape checks and batched prediction; mixed into the strategy, which provides
    ``inducing_points``, ``_variational_distribution`` and ``forward``."""

    inducing_points: Tensor
    _variational_distribution: Any
    forward: Any

    def _check_input_shape(self, x: Tensor) -> None:
        """GPyTorch's convention for inputs: ``[*batch, n, D]``, with ``D`` the inducing points'
        last dimension and ``batch`` broadcasting with the model's batch shape."""
        Z = self.inducing_points
        if x.shape[-1] != Z.shape[-1]:
            raise ValueError(
                f"CVIVariationalStrategy: inputs x of shape {tuple(x.shape)} have "
                f"{x.shape[-1]} features (the last dimension) but the inducing points have "
                f"{Z.shape[-1]}. GPyTorch's inputs are [*batch, n, D]: a batch of "
                "one-dimensional test points needs a trailing dimension, x.unsqueeze(-1)."
            )
        model_batch = torch.broadcast_shapes(
            Z.shape[:-2],
            self._variational_distribution.batch_shape,
        )
        try:
            torch.broadcast_shapes(x.shape[:-2], model_batch)
        except RuntimeError:
            raise ValueError(
                f"CVIVariationalStrategy: inputs x of shape {tuple(x.shape)} have the batch "
                f"shape {tuple(x.shape[:-2])}, which does not broadcast with the model's batch "
                f"shape {tuple(model_batch)}. For the same test points under every GP of the "
                f"batch pass x of shape (n, D) or (*extra, 1, n, D), e.g. x.unsqueeze(-3)."
            ) from None

    def _batched_forward(self, x: Tensor, diag: bool, **kwargs) -> MultivariateNormal:
        """Data-site forms (one GP): a batch ``[*batch, n, D]`` of input sets, predicted as one
        set of ``prod(batch) * n`` points whose covariance is cut into the per-set blocks (the
        sets are independent given the data: each block is what that set alone gives)."""
        batch, n = x.shape[:-2], x.shape[-2]
        out = self.forward(x.reshape(-1, x.shape[-1]), diag=diag, **kwargs)
        mean = out.mean.reshape(*batch, n)
        cov = out.lazy_covariance_matrix
        if isinstance(cov, DiagLinearOperator):
            return MultivariateNormal(mean, DiagLinearOperator(cov.diagonal().reshape(*batch, n)))
        b = mean.numel() // n
        dense = cov.to_dense().reshape(b, n, b, n)
        idx = torch.arange(b, device=x.device)
        blocks = dense[idx, :, idx, :]
        return MultivariateNormal(mean, blocks.reshape(*batch, n, n))
