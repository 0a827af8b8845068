"""The repository's reference computations, benchmark models and dataset loaders.

Research code used by the tests, the scripts in ``scripts/`` and some tutorials: independent
reference computations for Bayesian logistic regression (:mod:`bench.baselines`), the Gamma
latent-variable models of the paper's experiments (:mod:`bench.gamma_models`) and loaders
for the benchmark datasets (:mod:`bench.datasets`). It is not part of the installed
``pyro_cvi`` package (``pip install`` leaves it out) and needs scikit-learn, which the library
itself does not; import it from the repository root, as the tests and scripts do.
"""
