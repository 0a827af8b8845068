"""The first step (tracing, probing, analysis, the warm start) pays no one-time import.

``torch.broadcast_shapes`` imports sympy on first use (0.6-0.8 CPU s, more than the whole set-up
of a small model) and ``numpy.random`` costs 0.08 s; the package's set-up and steps use neither.
Checked in a fresh interpreter, since any earlier test may have imported them."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    import pyro, pyro.distributions as dist, torch
    from pyro.infer import SVI
    from pyro_cvi import CVI, CVI_ELBO, AutoCVI
    from pyro_cvi.statespace import Matern32, markov_gp

    before = {m for m in ("sympy", "numpy.random") if m in sys.modules}
    g = torch.Generator().manual_seed(0)
    X = torch.randn(100, 4, generator=g, dtype=torch.float64)
    y = (X[:, 0] > 0).double()
    t = torch.arange(50, dtype=torch.float64)
    counts = torch.poisson(torch.exp(torch.sin(t / 10)), generator=g)

    def logreg(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(4), 1.0).to_event(1))
        with pyro.plate("data", 100):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    def softmax(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(4, 3), 1.0).to_event(2))
        with pyro.plate("data", 100):
            pyro.sample("y", dist.Categorical(logits=X @ w), obs=y.long())

    def chain(t, y):
        f = markov_gp("x", t, Matern32(lengthscale=5.0, variance=1.0))
        with pyro.plate("t", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

    for model, args in ((logreg, (X, y)), (softmax, (X, y)), (chain, (t, counts))):
        pyro.clear_param_store()
        svi = SVI(model, AutoCVI(model), CVI(), loss=CVI_ELBO())
        for _ in range(2):
            svi.step(*args)
    after = {m for m in ("sympy", "numpy.random") if m in sys.modules}
    print(sorted(after - before))
    """
)


def test_first_steps_import_neither_sympy_nor_numpy_random():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=1200, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
