"""What a GPyTorch user changes between training steps, as a table of cases shared by
``tests/test_gpytorch_user_changes.py`` and ``scripts/check_gpytorch_user_changes.py``.

Every case trains a sparse GP regression (40 points, 10 inducing points, a Gaussian likelihood,
hyperparameters held fixed) for a few steps, makes one change by hand, and takes a few more
steps. With a Gaussian likelihood the optimal q(u) after the change has a closed form (Titsias
2009; in whitened coordinates ``u = m0(Z) + L v``, ``L L^T = K_ZZ + jitter I``)::

    q*(v) = N(B^-1 Phi (y - m0(X)) s / noise, B^-1),   B = I + Phi Phi^T s / noise,
    Phi = L^-1 K_ZX,   s = num_data / n  (the mll's scaling of the data term),

so ``q*(u) = N(m0(Z) + L m_v, L B^-1 L^T + jitter I)``, computed here independently in float64.
A case either ends at that q(u) or raises the error it names. Three ways of stepping:

* ``loop``: GPyTorch's loop, ``(-mll(model(x), y)).backward()`` (the step taken in backward);
* ``cvi``: :class:`CVIOptimizer` on the strategy built the GPyTorch way;
* ``sites``: :class:`CVIOptimizer` on the sparse data-site form (``num_data=``, ``train_inputs=``).

Every stepper uses ``step_size=1.0``: with a Gaussian likelihood one CVI step is then exact, so
a change that is seen at the next step is fitted by it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple, Type

import gpytorch
import torch
from torch import Tensor

from pyro_cvi.contrib.gpytorch import CVIOptimizer, CVIVariationalStrategy

N, M, STEPS_BEFORE, STEPS_AFTER = 40, 10, 3, 3


class SVGP(gpytorch.models.ApproximateGP):
    def __init__(self, Z: Tensor, X: Optional[Tensor] = None):
        if X is None:  # the GPyTorch way
            dist = gpytorch.variational.CholeskyVariationalDistribution(Z.shape[-2])
            strategy = CVIVariationalStrategy(self, Z, dist, step_size=1.0)
        else:  # data sites
            strategy = CVIVariationalStrategy(self, Z, num_data=len(X), train_inputs=X)
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        self.mean_module.initialize(constant=0.3)
        self.covar_module.base_kernel.lengthscale = 0.4

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def data(dtype: torch.dtype, seed: int = 0, n: int = N) -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 1, generator=g, dtype=torch.float64) * 3
    y = torch.sin(2 * X[:, 0]) + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)
    return X.to(dtype), y.to(dtype)


def optimal_q(model, X: Tensor, y: Tensor, noise, scale: float = 1.0) -> Tuple[Tensor, Tensor]:
    """The optimal q(u) of the sparse ELBO with a Gaussian likelihood (module docstring), in
    float64, at the model's current kernel, mean, inducing points and jitter; ``noise`` a number
    or a vector (one variance per point)."""
    s = model.variational_strategy
    Z = s.inducing_points.detach().double()
    X, y = X.double(), y.double()
    with torch.no_grad():
        k = copy.deepcopy(model.covar_module).double()
        mean = copy.deepcopy(model.mean_module).double()
        Kzz = k(Z).to_dense() + s.jitter * torch.eye(len(Z), dtype=torch.float64)
        L = torch.linalg.cholesky(Kzz)
        Phi = torch.linalg.solve_triangular(L, k(Z, X).to_dense(), upper=False)
        w = scale / torch.as_tensor(noise, dtype=torch.float64).expand(len(X))
        B = torch.eye(len(Z), dtype=torch.float64) + (Phi * w) @ Phi.mT
        m_v = torch.linalg.solve(B, Phi @ ((y - mean(X)) * w))
        mu = mean(Z) + L @ m_v
        cov = L @ torch.linalg.solve(B, L.mT) + s.jitter * torch.eye(len(Z), dtype=torch.float64)
    return mu, cov


def q_u(model) -> Tuple[Tensor, Tensor]:
    """q(u)'s mean and covariance as the strategy gives them (in its dtype)."""
    with torch.no_grad():
        q = model.variational_strategy.variational_distribution
        return q.mean, q.covariance_matrix


@dataclass
class Run:
    """A training run: the model, its likelihood, the data and one way of stepping."""

    stepper: str
    dtype: torch.dtype
    noise: float = 0.05

    def __post_init__(self):
        self.X, self.y = data(self.dtype)
        Z = self.X[:: N // M].clone()
        torch.manual_seed(0)
        sites = self.X if self.stepper == "sites" else None
        self.model = SVGP(Z, sites).to(self.dtype)
        self.likelihood = gpytorch.likelihoods.GaussianLikelihood().to(self.dtype)
        self.likelihood.noise = self.noise
        self.num_data = N
        self.model.train()
        self.likelihood.train()
        self.mll = gpytorch.mlls.VariationalELBO(self.likelihood, self.model, num_data=N)
        self.opt = None
        if self.stepper != "loop":
            self.opt = CVIOptimizer(self.model, self.likelihood, step_size=1.0)

    def step(self, steps: int = 1) -> None:
        for _ in range(steps):
            if self.opt is not None:
                self.opt.step(self.X, self.y)
            else:
                self.model.zero_grad()
                (-self.mll(self.model(self.X), self.y)).backward()

    def exact(self) -> Tuple[Tensor, Tensor]:
        noise = self.likelihood.noise.detach().reshape(-1)
        noise = noise[0] if noise.numel() == 1 else noise
        return optimal_q(self.model, self.X, self.y, noise, self.num_data / len(self.X))


# --------------------------------------------------------------------------- the changes
def set_noise(run: Run) -> None:
    run.likelihood.noise = 0.5


def new_likelihood(run: Run) -> None:
    lik = gpytorch.likelihoods.GaussianLikelihood().to(run.dtype)
    lik.noise = 0.5
    lik.train()
    run.likelihood = lik
    if run.opt is not None:
        run.opt.likelihood = lik
    run.mll = gpytorch.mlls.VariationalELBO(lik, run.model, num_data=run.num_data)


def set_lengthscale(run: Run) -> None:
    run.model.covar_module.base_kernel.lengthscale = 0.15


def set_outputscale(run: Run) -> None:
    run.model.covar_module.outputscale = 3.0


def set_mean_constant(run: Run) -> None:
    run.model.mean_module.initialize(constant=-1.0)


def eval_then_train(run: Run) -> None:
    """Predict in eval mode (GPyTorch's caches), change the noise, then go back to training."""
    run.model.eval()
    run.likelihood.eval()
    with torch.no_grad():
        run.likelihood(run.model(run.X[:5] + 0.01))
    run.likelihood.noise = 0.5
    run.model.train()
    run.likelihood.train()


def new_data(run: Run) -> None:
    """New training data of the same size (``x`` and ``y``) passed to the step."""
    run.X, run.y = data(run.dtype, seed=1)


def new_targets(run: Run) -> None:
    """New targets ``y`` at the same inputs."""
    run.y = -run.y


def new_data_other_size(run: Run) -> None:
    """New training data of another size, with the mll's ``num_data`` to match (the loop)."""
    run.X, run.y = data(run.dtype, seed=1, n=60)
    run.num_data = 60
    run.mll = gpytorch.mlls.VariationalELBO(run.likelihood, run.model, num_data=60)


def set_site_inputs(run: Run) -> None:
    """Data sites: new training inputs registered with ``set_site_inputs`` (and new targets)."""
    run.X, run.y = data(run.dtype, seed=1)
    run.model.variational_strategy.set_site_inputs(run.X)


def move_inducing_points(run: Run) -> None:
    with torch.no_grad():
        run.model.variational_strategy.inducing_points.add_(0.05)


def change_dtype(run: Run) -> None:
    """The model and likelihood moved to the other dtype (``.to(dtype)``) mid-run."""
    run.model.to(run.dtype)
    run.likelihood.to(run.dtype)
    run.X, run.y = run.X.to(run.dtype), run.y.to(run.dtype)


def change_num_data(run: Run) -> None:
    """The mll's ``num_data`` doubled: the data term counts twice (noise / 2 at the optimum)."""
    run.num_data = 2 * N
    run.mll = gpytorch.mlls.VariationalELBO(run.likelihood, run.model, num_data=2 * N)


def bernoulli_with_real_targets(run: Run) -> None:
    """A Bernoulli likelihood assigned to the optimizer while the targets are real numbers."""
    assert run.opt is not None
    run.opt.likelihood = gpytorch.likelihoods.BernoulliLikelihood().to(run.dtype)


def fixed_noise_likelihood(run: Run) -> None:
    """A ``FixedNoiseGaussianLikelihood`` (one variance per point) assigned, then its noise
    changed by hand after one step."""
    noise = torch.linspace(0.02, 0.3, len(run.X), dtype=run.dtype)
    lik = gpytorch.likelihoods.FixedNoiseGaussianLikelihood(noise=noise).to(run.dtype)
    run.likelihood = lik
    if run.opt is not None:
        run.opt.likelihood = lik
    run.mll = gpytorch.mlls.VariationalELBO(lik, run.model, num_data=run.num_data)
    run.step()
    lik.noise = noise.flip(0)


def other_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float64 else torch.float64


@dataclass(frozen=True)
class Case:
    """One row: the stepper, the change, and what must follow it (``error``: the exception type
    and a phrase of its message; ``None``: q(u) ends at the exact optimum)."""

    stepper: str
    change: Callable[[Run], None]
    error: Optional[Tuple[Type[BaseException], str]] = None
    dtype_move: bool = False


CASES: Dict[str, Case] = {
    "loop: noise set by hand": Case("loop", set_noise),
    "cvi: noise set by hand": Case("cvi", set_noise),
    "sites: noise set by hand": Case("sites", set_noise),
    "loop: new likelihood object": Case("loop", new_likelihood),
    "cvi: new likelihood object": Case("cvi", new_likelihood),
    "cvi: fixed-noise likelihood, noise changed": Case("cvi", fixed_noise_likelihood),
    "loop: fixed-noise likelihood, noise changed": Case("loop", fixed_noise_likelihood),
    "loop: lengthscale set by hand": Case("loop", set_lengthscale),
    "cvi: lengthscale set by hand": Case("cvi", set_lengthscale),
    "sites: lengthscale set by hand": Case("sites", set_lengthscale),
    "loop: outputscale set by hand": Case("loop", set_outputscale),
    "cvi: outputscale set by hand": Case("cvi", set_outputscale),
    "loop: mean constant set by hand": Case("loop", set_mean_constant),
    "cvi: mean constant set by hand": Case("cvi", set_mean_constant),
    "sites: mean constant set by hand": Case("sites", set_mean_constant),
    "loop: eval(), predict, noise, train()": Case("loop", eval_then_train),
    "cvi: eval(), predict, noise, train()": Case("cvi", eval_then_train),
    "sites: eval(), predict, noise, train()": Case("sites", eval_then_train),
    "loop: new x and y (same size)": Case("loop", new_data),
    "cvi: new x and y (same size)": Case("cvi", new_data),
    "loop: new y at the same x": Case("loop", new_targets),
    "cvi: new y at the same x": Case("cvi", new_targets),
    "sites: new y at the same x": Case("sites", new_targets),
    "loop: new x and y (another size, num_data)": Case("loop", new_data_other_size),
    "cvi: new x and y (another size)": Case(
        "cvi", new_data_other_size, (ValueError, "CVIOptimizer(model, likelihood, num_data=N)")
    ),
    "sites: new x without set_site_inputs": Case(
        "sites", new_data, (ValueError, "does not match the training inputs")
    ),
    "sites: set_site_inputs(new x)": Case("sites", set_site_inputs),
    "loop: inducing points moved": Case("loop", move_inducing_points),
    "cvi: inducing points moved": Case("cvi", move_inducing_points),
    "loop: model.to(other dtype)": Case("loop", change_dtype, dtype_move=True),
    "cvi: model.to(other dtype)": Case("cvi", change_dtype, dtype_move=True),
    "sites: model.to(other dtype)": Case("sites", change_dtype, dtype_move=True),
    "loop: mll num_data doubled": Case("loop", change_num_data),
    "cvi: Bernoulli likelihood, real targets": Case(
        "cvi", bernoulli_with_real_targets, (ValueError, "is not a binary label")
    ),
}


def tolerance(dtype: torch.dtype) -> float:
    """Largest error of q(u)'s mean and covariance, relative to the prior's scale."""
    return 1e-7 if dtype == torch.float64 else 1e-4


def run_case(name: str, dtype: torch.dtype) -> dict:
    """Run one case in ``dtype`` (for a dtype move: start in the other one and move to
    ``dtype``). Returns a row: the error raised (type and message) or the largest errors of
    q(u)'s mean and covariance against the exact optimum before and after the change."""
    case = CASES[name]
    run = Run(case.stepper, other_dtype(dtype) if case.dtype_move else dtype)
    run.step(STEPS_BEFORE)
    before = run.exact()
    run.dtype = dtype
    case.change(run)
    row: dict = {"case": name, "dtype": str(dtype).replace("torch.", "")}
    try:
        run.step(STEPS_AFTER)
    except Exception as e:  # the row records what was raised
        row["error"] = f"{type(e).__name__}: {e}"
        row["error_type"] = type(e)
        return row
    mean, cov = q_u(run.model)
    row["q_dtype"] = str(mean.dtype).replace("torch.", "")
    mean, cov = mean.double(), cov.double()
    scale = float(run.model.covar_module.outputscale.detach().double())
    exact = run.exact()
    row["mean_error"] = float((mean - exact[0]).abs().max()) / math.sqrt(scale)
    row["cov_error"] = float((cov - exact[1]).abs().max()) / scale
    row["old_answer_gap"] = float((mean - before[0]).abs().max()) / math.sqrt(scale)
    return row
