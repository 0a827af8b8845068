"""``pyro.contrib.gp`` likelihoods whose expected log-likelihood is exact, for ``CVI()``.

``pyro.contrib.gp``'s variational GPs (``VariationalGP``, ``VariationalSparseGP``) put the guide's
``q(u) = N(u_loc, u_scale_tril u_scale_tril^T)`` into the model: the likelihood receives the
marginals ``q(f_n) = N(f_loc_n, f_var_n)`` and estimates ``E_q[log p(y_n | f_n)]`` with *one* Monte
Carlo draw of ``f_n``. Every gradient of the ELBO is then that noisy: ``CVI()``'s natural-gradient
step on ``u_loc``, ``u_scale_tril`` (:mod:`pyro_cvi.natgrad`) shrinks to average the noise out,
and Adam's steps on the kernel shrink with the gradients' signal-to-noise ratio.

The expectation is one-dimensional per point (per point and class for ``MultiClass``), so it
needs no sampling. These subclasses, drop-ins for the likelihoods of the same name (same
constructor arguments, same site name, sampling unchanged when ``y is None``), add it to the
ELBO as ``pyro.factor`` at the likelihood's site when ``y`` is observed:

* :class:`Binary`: ``E[log sigmoid(s f)]``, ``s = 2y - 1``, by Gauss-Hermite quadrature
  (``num_points`` nodes; any other ``response_function``: ``E[y log r(f) + (1 - y) log(1 -
  r(f))]`` by the same rule);
* :class:`Poisson`: ``E[log Poisson(y | exp f)] = y m - exp(m + v / 2) - log y!`` in closed form
  (another response: Gauss-Hermite);
* :class:`MultiClass`: ``E[f_y - logsumexp(f)]`` with the K latent GPs independent under q, by
  the cubature of :func:`pyro_cvi.messages.softmax.lse_expectations` (Gauss-Hermite on the
  logit difference for K = 2, the third-order spherical-radial rule for K > 2; softmax
  response only).

The ELBO that ``TraceMeanField_ELBO`` then differentiates is exact (the KL of the whitened or
unwhitened prior is analytic; ``Trace_ELBO`` would estimate it from one draw of ``u``), so
``CVI()`` takes full natural-gradient steps on ``q(u)`` and its inner Adam deterministic steps on
the kernel and the inducing inputs. With ``q(u)`` at its optimum after every natural-gradient
step, those hyperparameters set the pace; ``CVI()`` recognises the GP by its class and steps
them at the inner rate 0.03 (:mod:`pyro_cvi.natgrad.gp_models`; Pyro's usual 0.01 lags, 0.05
leaves a Poisson GP's kernel jittering above the optimum). Usage (the likelihood is the
changed line)::

    from pyro_cvi.contrib import pyro_gp

    gpc = gp.models.VariationalSparseGP(X, y, kernel, Xu=Xu, likelihood=pyro_gp.Binary(),
                                        whiten=True)
    svi = SVI(gpc.model, gpc.guide, CVI(), TraceMeanField_ELBO())

(:func:`optimizer`, ``CVI(optim_args={"lr": INNER_LR})``, gives the same rate to every
parameter, the GP's and any other.)

**Why ``Trace_ELBO`` (or pyro.contrib.gp's own Monte Carlo likelihood) does not reach Adam's
2,000-step bound at a third of its time.** ``CVI()`` is a torch optimizer: Pyro's ``SVI`` hands
it the parameters and their gradients, never the model. The gradient is that of the loss's
estimate, so whatever noise the estimate has, the step has. Under ``Trace_ELBO`` the KL of
``q(u) = N(m, L L^T)`` is ``log q(u) - log p(u)`` at one draw ``u = m + L eps``; with the
whitened prior ``p(u) = N(0, I)`` its gradients are ``-(m + L eps)`` in ``m`` (the exact KL's:
``-m``) and ``-(m + L eps) eps^T`` below the diagonal of ``L`` (exact: ``-L``), noise of the
size of q's own standard deviations in every coordinate, at every step. CVI (Khan & Lin 2017,
eqs. 13-14) adds the conjugate part, here the Gaussian prior of ``u``, exactly and takes
gradients of the non-conjugate part only; from Pyro's gradient alone the prior's part cannot be
told apart from the data's, so it cannot be added exactly and the natural-gradient step must
average the draw's noise out: its step control shrinks the step (``~ 1 / t``), and after 500
steps the bound is 0.5-2.7 nats above Adam's 2,000-step one (Binary sparse 87.07 against
86.51, Binary full 24.48 / 23.10, Poisson 559.02 / 558.55, MultiClass 231.41 / 228.68;
``scripts/benchmark_pyro_gp.py``). pyro.contrib.gp's own likelihoods add the same kind of
noise to the data term (one draw of ``f_n`` per point) and end 0.1-0.4 nats above. With
``TraceMeanField_ELBO`` (the loss of ``pyro.contrib.gp.util.train``) the KL is analytic and
with the drop-in likelihoods below the data term is too: every gradient is exact, and the
target is reached at 0.17-0.22 of Adam's time.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pyro
import pyro.contrib.gp as gp
import torch
import torch.nn.functional as F
from torch import Tensor

from pyro_cvi.messages.quadrature import expected_log_prob
from pyro_cvi.messages.softmax import lse_expectations
from pyro_cvi.natgrad.gp_models import HYPER_LR
from pyro_cvi.optim import CVI

__all__ = ["INNER_LR", "Binary", "MultiClass", "Poisson", "expected_log_lik", "optimizer"]

#: the inner Adam's learning rate for the kernel and the inducing inputs (module docstring)
INNER_LR = HYPER_LR


def optimizer(**kwargs: Any) -> CVI:
    """``CVI(optim_args={"lr": INNER_LR}, **kwargs)``: natural gradients for ``q(u)`` (or
    ``q(f)``), the inner Adam at :data:`INNER_LR` for every other parameter of the GP."""
    if "optim_args" in kwargs:
        raise ValueError(
            "pyro_cvi.contrib.pyro_gp.optimizer sets optim_args; for other inner-optimizer "
            "arguments build CVI(optim_args=...) directly"
        )
    return CVI(optim_args={"lr": INNER_LR}, **kwargs)


def _check(f_loc: Tensor, f_var: Tensor, y: Tensor, name: str, ok: Callable) -> None:
    """Shapes of the marginals against ``y``, and ``y`` in the likelihood's support (``ok``):
    a label outside it would give a finite but wrong expectation."""
    bad = ~ok(y)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"pyro_cvi.contrib.pyro_gp.{name}: y = {float(y[idx])} at index {list(idx)} is "
            f"outside the likelihood's support ({_SUPPORT[name]}); recode the targets"
        )
    if f_loc.shape != f_var.shape:
        raise ValueError(
            f"{name}: f_loc {tuple(f_loc.shape)} and f_var {tuple(f_var.shape)} differ in shape"
        )
    if torch.is_tensor(y) and y.shape[-1] != f_loc.shape[-1]:
        raise ValueError(
            f"{name}: y has {y.shape[-1]} points but the latent GP {f_loc.shape[-1]}; pass the "
            "training targets that match the GP's inputs"
        )


_SUPPORT = {
    "Binary": "labels 0 or 1",
    "Poisson": "counts 0, 1, 2, ...",
    "MultiClass": "class indices 0, ..., K - 1",
}


def _is_count(y: Tensor) -> Tensor:
    return (y >= 0) & (y == torch.round(y))


class Binary(gp.likelihoods.Binary):
    """``pyro.contrib.gp.likelihoods.Binary`` with the exact expectation (module docstring).

    :param response_function: as for ``Binary`` (default: sigmoid).
    :param num_points: Gauss-Hermite nodes.
    """

    def __init__(self, response_function: Optional[Callable] = None, num_points: int = 20):
        super().__init__(response_function)
        self.num_points = int(num_points)

    def expected_log_prob(self, f_loc: Tensor, f_var: Tensor, y: Tensor) -> Tensor:
        """``E_{N(f_loc, f_var)}[log p(y | f)]`` per point."""
        y = y.to(f_loc)
        if self.response_function is torch.sigmoid:
            sign = 2.0 * y - 1.0
            return expected_log_prob(
                lambda e: -F.softplus(-e), sign * f_loc, f_var, self.num_points
            )
        r = self.response_function

        tiny = torch.finfo(f_loc.dtype).tiny

        def log_p(e):  # as precise as r(e) is where it rounds to 0 or 1
            p = r(e)
            return torch.where(y > 0.5, p.clamp_min(tiny).log(), (1.0 - p).clamp_min(tiny).log())

        return expected_log_prob(log_p, f_loc, f_var, self.num_points)

    def forward(self, f_loc: Tensor, f_var: Tensor, y: Optional[Tensor] = None):
        if y is None:
            return super().forward(f_loc, f_var, y)
        _check(f_loc, f_var, y, "Binary", lambda t: (t == 0) | (t == 1))
        return expected_log_lik(self, self.expected_log_prob(f_loc, f_var, y), y)


class Poisson(gp.likelihoods.Poisson):
    """``pyro.contrib.gp.likelihoods.Poisson`` with the exact expectation (module docstring).

    :param response_function: as for ``Poisson`` (default: exp).
    :param num_points: Gauss-Hermite nodes for a response other than exp.
    """

    def __init__(self, response_function: Optional[Callable] = None, num_points: int = 20):
        super().__init__(response_function)
        self.num_points = int(num_points)

    def expected_log_prob(self, f_loc: Tensor, f_var: Tensor, y: Tensor) -> Tensor:
        """``E_{N(f_loc, f_var)}[log p(y | f)]`` per point."""
        y = y.to(f_loc)
        if self.response_function is torch.exp:
            return y * f_loc - torch.exp(f_loc + 0.5 * f_var) - torch.lgamma(y + 1.0)
        r = self.response_function
        return expected_log_prob(
            lambda e: torch.distributions.Poisson(r(e), validate_args=False).log_prob(y),
            f_loc,
            f_var,
            self.num_points,
        )

    def forward(self, f_loc: Tensor, f_var: Tensor, y: Optional[Tensor] = None):
        if y is None:
            return super().forward(f_loc, f_var, y)
        _check(f_loc, f_var, y, "Poisson", _is_count)
        return expected_log_lik(self, self.expected_log_prob(f_loc, f_var, y), y)


class MultiClass(gp.likelihoods.MultiClass):
    """``pyro.contrib.gp.likelihoods.MultiClass`` (softmax response) with the cubature
    expectation (module docstring). ``f_loc``, ``f_var``: ``[..., K, N]`` as the GP gives them.
    """

    def __init__(self, num_classes: int, response_function: Optional[Callable] = None):
        if response_function is not None:
            raise ValueError(
                "pyro_cvi.contrib.pyro_gp.MultiClass: only the softmax response has a cubature "
                "expectation here; use pyro.contrib.gp.likelihoods.MultiClass for another one"
            )
        super().__init__(num_classes)

    def expected_log_prob(self, f_loc: Tensor, f_var: Tensor, y: Tensor) -> Tensor:
        """``E[f_y - logsumexp(f)]`` per point (``[..., N]``)."""
        if f_loc.dim() < 2 or f_loc.shape[-2] != self.num_classes:
            raise ValueError(
                f"MultiClass: the latent GP output must be [..., {self.num_classes}, N] (one GP "
                f"per class); got {tuple(f_loc.shape)}"
            )
        mean = f_loc.transpose(-2, -1)  # [..., N, K]
        cov = torch.diag_embed(f_var.transpose(-2, -1))
        lse = lse_expectations(mean, cov).value
        own = mean.gather(-1, y.long().unsqueeze(-1).expand(*mean.shape[:-1], 1)).squeeze(-1)
        return own - lse

    def forward(self, f_loc: Tensor, f_var: Tensor, y: Optional[Tensor] = None):
        if y is None:
            return super().forward(f_loc, f_var, y)
        _check(f_loc, f_var, y, "MultiClass", lambda t: _is_count(t) & (t < self.num_classes))
        return expected_log_lik(self, self.expected_log_prob(f_loc, f_var, y), y)


def expected_log_lik(likelihood: gp.likelihoods.Likelihood, ell: Tensor, y: Tensor) -> Tensor:
    """Add ``sum(ell)`` to the ELBO at the likelihood's own site name; returns ``y``."""
    if not bool(torch.isfinite(ell).all()):
        raise ValueError(
            f"{type(likelihood).__name__}: the expected log-likelihood is not finite; check y "
            "against the likelihood's support (0/1 labels, counts, class indices)"
        )
    pyro.factor(likelihood._pyro_get_fullname("y"), ell.sum())
    return y
