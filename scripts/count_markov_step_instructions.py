"""Instructions per Markov-GP CVI step, counted by ``valgrind --tool=callgrind`` (load-free).

The problem of ``scripts/time_markov_step.py --fixed`` (``T`` regular inputs, Poisson counts,
Matern-3/2 with lengthscale 20 and variance 1, ``AutoCVI(num_quad_points=10)``,
``CVI(step_size=1.0)``, float64, one thread). The script runs itself under callgrind with
instrumentation off (the imports and set-up run at valgrind's light speed), takes
``--warmup`` steps, switches instrumentation on (``callgrind_control -i on``) for ``--steps``
steps only, and prints the instructions per step (callgrind's ``Ir`` total over the steps,
divided by their number) and the last loss (``float.hex``: compare two checkouts bit for bit).
To compare checkouts, run it with ``PYTHONPATH`` set to each (the count does not depend on the
machine's load, only on the code, Python and torch)::

    PYTHONPATH=. python scripts/count_markov_step_instructions.py --T 200 --steps 200
    PYTHONPATH=/other/checkout python scripts/count_markov_step_instructions.py --T 200

Needs ``valgrind`` (with ``callgrind_control``) on the PATH; writes nothing else.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile


def child(T: int, warmup: int, steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    import pyro
    import pyro.distributions as dist
    from pyro.infer import SVI

    from pyro_cvi import CVI, CVI_ELBO, AutoCVI
    from pyro_cvi.statespace import Matern32, markov_gp

    d64 = torch.float64
    g = torch.Generator().manual_seed(0)
    t = torch.arange(T, dtype=d64)
    y = torch.poisson(torch.exp(torch.sin(t / 50.0) + 0.5 * torch.sin(t / 7.0)), generator=g)

    def model(t, y):
        f = markov_gp("x", t, Matern32(lengthscale=20.0, variance=1.0))
        with pyro.plate("t", len(t)):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

    pyro.clear_param_store()
    pyro.set_rng_seed(0)  # (the same draws in every checkout: the last loss compares bit for bit)
    guide = AutoCVI(model, num_quad_points=10)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    for _ in range(warmup):
        svi.step(t, y)
    pid = str(os.getpid())
    subprocess.run(["callgrind_control", "-i", "on", pid], capture_output=True, check=False)
    for _ in range(steps):
        loss = svi.step(t, y)
    subprocess.run(["callgrind_control", "-i", "off", pid], capture_output=True, check=False)
    print(f"loss {float(loss).hex()}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=200, help="chain length")
    ap.add_argument("--warmup", type=int, default=50, help="steps before counting")
    ap.add_argument("--steps", type=int, default=200, help="steps counted")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.T, a.warmup, a.steps)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = [
            "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
            sys.executable, os.path.abspath(__file__), "--child",
            "--T", str(a.T), "--warmup", str(a.warmup), "--steps", str(a.steps),
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        loss = re.search(r"^loss (\S+)", run.stdout, re.M)
        with open(out) as fh:
            total = next(int(line.split()[1]) for line in fh if line.startswith("totals:"))
    import pyro_cvi

    print(f"pyro_cvi from {os.path.dirname(pyro_cvi.__file__)}; T = {a.T}, {a.steps} steps")
    print(f"instructions per step: {total / a.steps:,.0f} (total {total:,})")
    print(f"last loss: {loss.group(1) if loss else 'not printed: ' + run.stderr[-500:]}")


if __name__ == "__main__":
    main()
