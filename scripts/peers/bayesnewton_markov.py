"""BayesNewton's CVI on the Markov-GP benchmark problem, timed; run by ``benchmark_peers.py``.

Runs in an environment with BayesNewton and JAX (CPU) installed, not this package's: it imports
only numpy, jax, objax and bayesnewton. The problem is ``scripts/time_markov_step.py``'s: ``T``
regular inputs ``t = 0 .. T - 1``, counts ``y ~ Poisson(exp(sin(t / 50) + sin(t / 7) / 2))``
(the counts are passed in, so both sides fit the same data), a Matern-3/2 prior (lengthscale 20,
variance 1, fixed), a Poisson likelihood with the exp link, ``MarkovVariationalGP`` (the
Kalman-smoother CVI of Wilkinson et al.), step size 1. One step is BayesNewton's documented
training function, ``model.inference(lr=1)`` followed by ``model.energy()`` (the -ELBO),
compiled once with ``objax.Jit``. Float64, one thread (XLA's CPU threading off).

    python bayesnewton_markov.py counts.npy --steps 20 --num-points 10

Prints one JSON object: compile and per-step process CPU seconds (their median and each one),
and the -ELBO per step.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)
os.environ.setdefault("JAX_ENABLE_X64", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("counts", help=".npy file of the counts y (length T)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--num-points", type=int, default=10, help="Gauss-Hermite points")
    ap.add_argument("--lengthscale", type=float, default=20.0)
    ap.add_argument("--variance", type=float, default=1.0)
    args = ap.parse_args()

    import numpy as np

    c_import = time.process_time()
    import bayesnewton
    import jax
    import objax

    y = np.load(args.counts).astype(np.float64)
    T = y.shape[0]
    x = np.arange(T, dtype=np.float64)
    kern = bayesnewton.kernels.Matern32(variance=args.variance, lengthscale=args.lengthscale)
    lik = bayesnewton.likelihoods.Poisson()
    c0 = time.process_time()
    model = bayesnewton.models.MarkovVariationalGP(kernel=kern, likelihood=lik, X=x, Y=y)
    cub = bayesnewton.cubature.GaussHermite(num_cub_points=args.num_points)

    @objax.Function.with_vars(model.vars())
    def train_op():
        model.inference(lr=1.0, cubature=cub)
        return model.energy(cubature=cub)

    train_op = objax.Jit(train_op)
    energy = [float(jax.block_until_ready(train_op()))]  # the first call compiles
    setup = time.process_time() - c0
    cpus = []
    for _ in range(args.steps):
        c = time.process_time()
        e = jax.block_until_ready(train_op())
        cpus.append(time.process_time() - c)
        energy.append(float(e))
    print(
        json.dumps(
            dict(
                T=T,
                setup_cpu=setup,
                import_cpu=c0 - c_import,
                cpu=statistics.median(cpus),
                cpu_min=min(cpus),
                cpus=cpus,
                neg_elbo=energy,
                jax=jax.__version__,
                bayesnewton=getattr(bayesnewton, "__version__", "1.3.4"),
            )
        )
    )


if __name__ == "__main__":
    main()
