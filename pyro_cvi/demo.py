"""Bayesian logistic regression with CVI versus Pyro's Adam, on scikit-learn's breast-cancer data.

Run ``python -m pyro_cvi.demo``. The model is ``w ~ N(0, I)``, ``y_n ~ Bernoulli(logits =
x_n^T w)`` on the standardised Wisconsin diagnostic data (569 x 30, bundled with scikit-learn,
no download), split 50/50. Two ways to fit a full-covariance Gaussian ``q(w)``:

* CVI (Khan & Lin 2017): ``SVI(model, AutoCVI(model), CVI(step_size), CVI_ELBO())``. The prior
  is conjugate; each Bernoulli term is a linear-predictor factor with a Gaussian site, so every
  step is a Bayesian linear regression (Appendix E.1) with quadrature gradients.
* Pyro's usual recipe: ``SVI(model, AutoMultivariateNormal(model), Adam, Trace_ELBO())``.

Both are scored the same way: the -ELBO on the training set and the test log-loss in bits, with
expectations by Gauss-Hermite quadrature. Seconds include the guide's set-up.
"""

from __future__ import annotations

import argparse
import importlib
import time
from typing import List, Optional

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal

from pyro_cvi.baselines import logreg_log_loss_bits, logreg_neg_elbo, make_logreg_model
from pyro_cvi.datasets import load_breast_cancer_sklearn


def _fit_cvi(model, X, y, iters: int, w: float):
    from pyro_cvi import CVI, CVI_ELBO, AutoCVI
    from pyro_cvi.step_sizes import paper

    pyro.clear_param_store()
    t0 = time.perf_counter()
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=paper(w)), loss=CVI_ELBO())
    for _ in range(iters):
        svi.step(X, y)
    seconds = time.perf_counter() - t0
    q = guide.posterior("w")
    return q.loc.detach(), q.scale_tril.detach(), seconds, guide


def _fit_adam(model, X, y, iters: int, lr: float):
    pyro.clear_param_store()
    t0 = time.perf_counter()
    guide = AutoMultivariateNormal(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), loss=Trace_ELBO())
    for _ in range(iters):
        svi.step(X, y)
    seconds = time.perf_counter() - t0
    q = guide.get_posterior()
    return q.loc.detach(), q.scale_tril.detach(), seconds, guide


def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description="CVI versus Adam for Bayesian logistic regression")
    parser.add_argument("--iters", type=int, default=50, help="CVI iterations (default 50)")
    parser.add_argument("--adam-iters", type=int, default=2000, help="Adam iterations")
    parser.add_argument("--adam-lr", type=float, default=0.01)
    parser.add_argument("--quiet", action="store_true", help="print only the table")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the problem is small, and extra threads only contend)",
    )
    args = parser.parse_args(argv)

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    # torch imports sympy (about 1 s) the first time autograd is given grad_outputs: pay that
    # before any clock starts, so it is charged to neither method.
    importlib.import_module("torch.fx.experimental.symbolic_shapes")

    pyro.set_rng_seed(args.seed)
    data = load_breast_cancer_sklearn()
    X, y, delta = data.X_train, data.y_train, data.prior_precision
    model = make_logreg_model(delta)
    if not args.quiet:
        print(
            f"Bayesian logistic regression on scikit-learn's breast-cancer data: "
            f"{X.shape[0]} training and {data.X_test.shape[0]} test points, "
            f"D = {X.shape[1]} weights (bias included), prior N(0, I / {delta:g})."
        )

    rows = {}
    m, L, sec, guide = _fit_cvi(model, X, y, args.iters, w=0.4)
    rows["CVI (AutoCVI + CVI)"] = (args.iters, sec, m, L)
    if not args.quiet:
        print("\nWhat AutoCVI found in the model (guide.explain()):")
        print(guide.explain())
    pyro.set_rng_seed(args.seed)
    m, L, sec, _ = _fit_adam(model, X, y, args.adam_iters, args.adam_lr)
    rows[f"Adam lr={args.adam_lr:g} (AutoMVN)"] = (args.adam_iters, sec, m, L)

    results = {}
    header = f"{'method':<28}{'iterations':>11}{'seconds':>9}{'-ELBO':>10}{'test log-loss':>15}"
    print("\n" + header)
    print("-" * len(header))
    with torch.no_grad():
        for name, (iters, sec, m, L) in rows.items():
            neg_elbo = float(logreg_neg_elbo(X, y, m, None, delta, scale_tril=L))
            bits = logreg_log_loss_bits(data.X_test, data.y_test, m, None, scale_tril=L)
            results[name] = {
                "iterations": iters,
                "seconds": sec,
                "neg_elbo": neg_elbo,
                "test_log_loss_bits": bits,
            }
            print(f"{name:<28}{iters:>11d}{sec:>9.2f}{neg_elbo:>10.3f}{bits:>15.4f}")
    if not args.quiet:
        print(
            "\n-ELBO: training set, lower is better (Gauss-Hermite quadrature); log-loss in bits "
            "per test point.\nSeconds include each guide's set-up. CVI's steps are Bayesian "
            "linear regressions with exact\n(quadrature) gradients; Adam follows one-sample "
            "Monte Carlo gradients of the same ELBO."
        )
    return results


if __name__ == "__main__":
    main()
