"""State-space (Markov) CVI: linear-Gaussian chain priors fitted by Kalman smoothing.

* :mod:`.kalman`: the conjugate computation (log-normaliser by a parallel reduction, smoothed
  marginals and lag-one covariances by an explicit pass back down the tree, sampling),
  O(T d^3); :mod:`.soa`: its small-matrix algebra on long stacks; :mod:`.scan`: the
  associative scans; :mod:`.sequential`: one scalar pass for short chains of ``d <= 2``, and
  for the top of the tree of longer ones;
* :mod:`.kernels_sde`: Matern-1/2, 3/2, 5/2 kernels (and sums) as SDEs;
* :mod:`.distribution`: ``LinearGaussianSSM``, ``MarkovGP`` and ``markov_gp`` for Pyro models;
* :mod:`.detect`: how the analysis recognises chains (also ``pyro.markov`` loops);
* :mod:`.random_walk`, :mod:`.increments`: a vectorised random walk ``x = eps.cumsum(...)`` of
  Normal increments as a chain, and its ``q(eps)`` as the image of the chain's ``q(x)``;
* :mod:`.predict`: posterior marginals and predictions at new inputs from a fitted guide.

``AutoCVI`` gives a recognised chain a Markov block (:class:`pyro_cvi.blocks.markov.MarkovBlock`);
``guide.explain()`` says "Markov prior: Kalman smoother, O(T d^3)".
"""

from .distribution import LinearGaussianSSM, MarkovGP, markov_gp
from .kalman import LinearGaussianChain, Marginals, log_normalizer, smooth
from .kernels_sde import Matern12, Matern32, Matern52, SDEKernel, SumKernel
from .predict import predict, predict_f

__all__ = [
    "LinearGaussianSSM",
    "MarkovGP",
    "markov_gp",
    "LinearGaussianChain",
    "Marginals",
    "log_normalizer",
    "smooth",
    "Matern12",
    "Matern32",
    "Matern52",
    "SDEKernel",
    "SumKernel",
    "predict",
    "predict_f",
]
