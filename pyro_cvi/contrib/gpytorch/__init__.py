"""GPyTorch adapter: GP models trained by conjugate-computation VI.

Install with ``pip install pyro-cvi[gpytorch]``.

* :class:`CVIVariationalStrategy`: a GPyTorch variational strategy whose q(u) is built in
  closed form from Gaussian sites (Khan & Lin 2017, eq. 14). Built the GPyTorch way,
  ``CVIVariationalStrategy(model, inducing_points, variational_distribution,
  learn_inducing_locations=True)``, it replaces GPyTorch's strategy in one line (any batch
  shape, inside ``IndependentMultitaskVariationalStrategy`` / ``LMCVariationalStrategy``), and
  GPyTorch's own training loop trains q: ``loss.backward()`` of ``-VariationalELBO`` takes one
  CVI step on the sites (see :mod:`~pyro_cvi.contrib.gpytorch.inducing`). With ``num_data``
  (the signature of earlier versions) it keeps one site per training point: the full GP
  (stable ``B = I + W^1/2 K W^1/2``) or the sparse dual parameterisation of Adam et al. 2021
  (O(N M^2), minibatchable, data-parallel), updated by :class:`CVIOptimizer` only.
* :class:`CVIOptimizer`: the CVI step with backtracking (:class:`pyro_cvi.step_control.StepControl`)
  from ``likelihood.expected_log_prob`` (eq. 13, Appendix B.1); any likelihood; accepts models
  whose strategy wraps a :class:`CVIVariationalStrategy`.
* :class:`MultiClassCVIStrategy`, :class:`MultiClassCVIOptimizer`: K latent GPs with coupled
  K x K sites per point, for ``SoftmaxLikelihood(mixing_weights=False)`` or
  :class:`CategoricalLogitsLikelihood` (multi-class classification; see ``multiclass.py``).
* :class:`LogisticBernoulliLikelihood`: Bernoulli with a sigmoid link, with expectations that
  stay exact for very wide marginals.

GPyTorch's GP-classification loop, with the strategy swapped in (the only changed line)::

    class GPClassificationModel(gpytorch.models.ApproximateGP):
        def __init__(self, train_x):
            variational_distribution = CholeskyVariationalDistribution(train_x.size(0))
            variational_strategy = CVIVariationalStrategy(       # was UnwhitenedVariationalStrategy
                self, train_x, variational_distribution, learn_inducing_locations=False
            )
            ...
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)   # hyperparameters only
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, train_y.numel())
    for i in range(50):
        optimizer.zero_grad()
        loss = -mll(model(train_x), train_y)
        loss.backward()       # the CVI step on q (step_size 0.5), and the hyperparameter gradients
        optimizer.step()

This is GPyTorch's NGD on whitened natural parameters with ``lr = step_size`` (a test checks
the trajectories agree with ``lengthscale_search=False``). By default the first step also takes
an M-step on the lengthscales (:mod:`~pyro_cvi.contrib.gpytorch.lengthscale_search`): from a
lengthscale far longer than the labels' scale, every method that fits q quickly stalls on the
bound's plateau (GPyTorch's own NGD and whitened strategy too), and this step leaves it.
Adding ``cvi = CVIOptimizer(model, likelihood)`` and ``cvi.step(train_x, train_y)`` before
``optimizer.zero_grad()`` fits q with backtracking instead
(``scripts/benchmark_gpytorch_loop.py``, ``scripts/benchmark_tutorial_datasets.py``).

Hybrid training with the data-site form (CVI for q, Adam for the hyperparameters)::

    import gpytorch, torch
    from pyro_cvi.contrib.gpytorch import (
        CVIOptimizer, CVIVariationalStrategy, LogisticBernoulliLikelihood)

    class GPClassifier(gpytorch.models.ApproximateGP):
        def __init__(self, X):
            super().__init__(CVIVariationalStrategy(self, X, num_data=X.shape[0]))
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(x), self.covar_module(x))

    model, likelihood = GPClassifier(X).double(), LogisticBernoulliLikelihood().double()
    cvi = CVIOptimizer(model, likelihood, step_size=0.8)      # sites: conjugate computations
    adam = torch.optim.Adam(model.parameters(), lr=0.05)      # hyperparameters only
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=X.shape[0])
    model.train(); likelihood.train()
    for it in range(100):
        cvi.step(X, y)                # eq. 13: sites <- (1 - beta) sites + beta grad_mu
        adam.zero_grad()
        loss = -mll(model(X), y)      # -ELBO / N with q rebuilt from the new sites
        loss.backward()               # hyperparameter gradients at fixed sites
        adam.step()
    model.eval(); likelihood.eval()
    probs = likelihood(model(X_test)).probs

Taking the CVI step first means the hyperparameter gradient is always evaluated at a q that has
just been fitted to the current hyperparameters, so it is close to the gradient of the
collapsed objective (at the site fixed point it is exact). To fit q at fixed hyperparameters,
call ``cvi.step`` alone; it returns the -ELBO (in nats, summed over the data) of q before the
update and backtracks if that ever goes up.

For the sparse form pass ``M < N`` inducing points and ``train_inputs=X``
(``learn_inducing_locations=True`` lets Adam move them); for minibatches call
``cvi.step(X[idx], y[idx], indices=idx)``. Use float64 for badly conditioned kernels.

**Data-parallel** (sparse form, ``torch.distributed``; the same script on 1 or R processes
under ``torchrun``): each rank builds the model on its shard of the rows and passes
``process_group``. q(u) needs the data only through ``sum_n phi_n W_n phi_n^T`` and
``sum_n phi_n r_n`` (whitened ``K_ZZ^-1/2 K_Zn``), all-reduced in one call, so every rank holds
the exact full-data q(u); the -ELBO is KL (once) plus every rank's data terms; ``cvi.loss``
replaces ``-mll(model(X), y)`` and ``cvi.reduce_grads()`` sums the hyperparameter gradients,
so every rank takes the same Adam step (both work unchanged in one process). Rank 0's
hyperparameters and inducing points are used. The full GP is refused (its sites are coupled
through ``k(X, X)``)::

    import os, torch.distributed
    from pyro_cvi.scale.distributed import WORLD, shard

    group = None
    if "RANK" in os.environ:                      # torchrun --nproc_per_node=R run.py
        torch.distributed.init_process_group("gloo")  # "nccl" on GPUs
        group = WORLD
    X, y = shard(X), shard(y)                     # this rank's rows (all in one process)
    model = SparseGP(Z, X).double()   # CVIVariationalStrategy(self, Z, len(X), train_inputs=X)
    cvi = CVIOptimizer(model, likelihood, step_size=0.8, process_group=group)
    adam = torch.optim.Adam(model.parameters(), lr=0.05)
    for it in range(100):
        cvi.step(X, y)                # -ELBO of all ranks' data, the same on every rank
        adam.zero_grad()
        cvi.loss(X, y).backward()     # = -mll(model(X), y) over every rank's data
        cvi.reduce_grads()            # full-data gradients on every rank
        adam.step()

Every rank must make the same calls (``step``, ``loss``, and rebuilding q, e.g.
``model(x)`` after the sites or hyperparameters change), since each one may run a collective.
Save one ``state_dict`` per rank (``pyro_cvi.scale.distributed.rank_path``): the sites are the
rank's.
"""

try:
    import gpytorch  # noqa: F401
except ImportError as e:  # pragma: no cover
    raise ImportError(
        "pyro_cvi.contrib.gpytorch needs GPyTorch: pip install 'pyro-cvi[gpytorch]'"
    ) from e

from .likelihoods import (
    LogisticBernoulliLikelihood,
    logistic_expected_log_prob,
    logistic_expected_prob,
)
from .minibatch import SiteMemoryScaling, SVIScaling
from .multiclass import CategoricalLogitsLikelihood, MultiClassCVIStrategy
from .multiclass_optim import MultiClassCVIOptimizer
from .optim import CVIOptimizer
from .posterior import FullSitePosterior, SparseSitePosterior
from .strategy import CVISites, CVIVariationalStrategy

__all__ = [
    "CategoricalLogitsLikelihood",
    "MultiClassCVIOptimizer",
    "MultiClassCVIStrategy",
    "CVIOptimizer",
    "CVISites",
    "CVIVariationalStrategy",
    "FullSitePosterior",
    "LogisticBernoulliLikelihood",
    "SparseSitePosterior",
    "SiteMemoryScaling",
    "SVIScaling",
    "logistic_expected_log_prob",
    "logistic_expected_prob",
]
