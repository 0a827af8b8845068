"""Data-parallel CVI (pyro_cvi.scale.distributed): 2 gloo ranks give the 1-process iterates."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.linear_gaussian import GaussianPrior, row_statistics, solve, solve_statistics
from pyro_cvi.scale.distributed import WORLD, Reducer, rank_path, replicated_sites, shard

HERE = Path(__file__).resolve().parent
D = 4  # tests/distributed_worker.py
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_summed_statistics_give_the_full_batch_posterior(device, dtype):
    """Statistics of two shards, summed, give the posterior of all rows (eq. 2)."""
    g = torch.Generator().manual_seed(1)
    A = torch.randn(40, 5, generator=g, dtype=torch.float64)
    w, b = torch.rand(40, generator=g, dtype=torch.float64) + 0.1, torch.randn(40, generator=g)
    A, w, b = (t.to(device=device, dtype=dtype) for t in (A, w, b.double()))
    prior = GaussianPrior(torch.zeros(5, dtype=dtype, device=device), var=torch.full((5,), 2.0))
    prior.var = prior.var.to(prior.loc)
    full = solve(prior, A, w, b, form="primal")
    parts = [row_statistics(A[i : i + 20], w[i : i + 20], b[i : i + 20]) for i in (0, 20)]
    S, s = parts[0][0] + parts[1][0], parts[0][1] + parts[1][1]
    post = solve_statistics(prior, S, s, A[20:])
    tol = 1e-4 if dtype == torch.float32 else 1e-12
    assert torch.allclose(post.loc, full.loc, atol=tol, rtol=tol)
    assert torch.allclose(post.covariance(), full.covariance(), atol=tol, rtol=tol)
    assert torch.allclose(post.f_var, full.f_var[20:], atol=tol, rtol=tol)
    assert torch.allclose(post.kl_to(prior), full.kl_to(prior), atol=10 * tol, rtol=tol)


def test_shard_and_rank_path(one_rank_group):
    X = torch.arange(10.0)
    assert torch.equal(shard(X), X)  # one rank: everything
    r = Reducer()
    assert rank_path("a/run.pt", r) == Path("a/run.rank0-of-1.pt")
    assert rank_path("a/run.pt", None) == Path("a/run.pt")
    (t,) = r([torch.ones(3)])
    assert torch.equal(t, torch.ones(3))


def test_process_group_needs_torch_distributed():
    with pytest.raises(RuntimeError, match="init_process_group"):
        AutoCVI(lambda: None, process_group=WORLD)


def test_monte_carlo_mean_field_factors_are_refused_by_name(one_rank_group):
    def model(y):
        tau = pyro.sample("tau", dist.Gamma(2.0, 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.StudentT(3.0, 0.0, tau.rsqrt()), obs=y)

    pyro.clear_param_store()
    svi = SVI(model, AutoCVI(model, process_group=WORLD), CVI(), loss=CVI_ELBO())
    with pytest.raises(NotImplementedError, match=r"factors \['y'\].*Monte Carlo"):
        svi.step(torch.randn(20))


def test_replicated_sites_are_the_latents_outside_the_observations_plates():
    def model(y):
        tau = pyro.sample("tau", dist.Gamma(2.0, 1.0))
        with pyro.plate("k", 3):
            pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y)):
            lam = pyro.sample("lam", dist.Gamma(2.0, 2.0))
            pyro.sample("y", dist.Normal(0.0, (tau * lam).rsqrt()), obs=y)

    from pyro_cvi.model.analysis import Analysis

    y = torch.randn(10)
    trace = pyro.poutine.trace(model).get_trace(y)
    assert replicated_sites(Analysis(model, (y,), {}, trace)) == {"tau", "mu"}


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process_and_resume_from_checkpoints(tmp_path):
    """torchrun, 2 gloo processes, float64: the same iterates (q's mean and covariance, the
    loss, two hyperparameters learned by Adam) as one process, to 1e-10; the 2-process run
    checkpoints after 3 steps (one file per rank), restores into fresh objects and goes on.
    The same for data-parallel StreamingCVI (3 passes), for a model with global and per-row
    mean-field (Gamma) latents under the adaptive CVI(), for a sparse GP classifier with a
    learned lengthscale, and for a sparse GPyTorch GP classifier (CVIOptimizer(process_group=
    WORLD): q(u), -ELBO, learned outputscale, lengthscale and inducing points, their
    gradients, backtracking)."""
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": "1"}
    worker = str(HERE / "distributed_worker.py")
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    sys.path.insert(0, str(HERE))
    try:
        import distributed_worker  # the same script, in this process, without torch.distributed

        distributed_worker.main(str(one))
    finally:
        sys.path.remove(str(HERE))
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    launch += ["--master_addr=127.0.0.1", f"--master_port={_free_port()}"]
    subprocess.run(launch + [worker, str(two), "ckpt"], env=env, check=True, timeout=1200)
    a, b = torch.load(one), torch.load(two)
    if a["gpytorch"] is not None:  # sparse GPyTorch GP: CVI steps, a backtrack, Adam steps
        gp_one, gp_two = torch.stack(a["gpytorch"]), torch.stack(b["gpytorch"])
        assert gp_one.shape == (7, 2 + 12 + 144 + 1 + 1 + 24 + 2 + 26)
        assert gp_one[-1, 185] == 1 and gp_one[-1, 184] == 0.5  # one backtrack, on both
        assert gp_one[3:, 186:].abs().min() > 0  # the full-data hyperparameter gradients
        assert (gp_one[-1, 158:184] - gp_one[2, 158:184]).abs().min() > 1e-3  # hypers moved
        assert (gp_one - gp_two).abs().max() < 1e-10
    # mean-field latents (adaptive CVI()) and a sparse GP
    assert a["others"].shape == (5 * (1 + D + 1) + 5 * (1 + 5 + 5 + 1),)
    ell = a["others"][5 * (1 + D + 1) :].reshape(5, -1)[:, -1]
    assert (ell[1:] - ell[:-1]).abs().min() > 1e-3  # the lengthscale is learned
    assert (a["others"] - b["others"]).abs().max() < 1e-10
    # StreamingCVI: 2 ranks streaming their shards (each its own minibatches) == 1 process
    assert (a["stream"] - b["stream"]).abs().max() < 1e-10
    a, b = a["svi"], b["svi"]
    assert a.dtype == torch.float64 and a.shape[0] == 6
    assert (a[1:, -2:] - a[:-1, -2:]).abs().min() > 1e-3  # the hyperparameters do move
    assert (a - b).abs().max() < 1e-10
    assert sorted(p.name for p in tmp_path.glob("run.*")) == [
        "run.rank0-of-2.pt",
        "run.rank1-of-2.pt",
    ]


@pytest.mark.slow
def test_a_rank_that_fails_makes_every_rank_fail_and_the_next_step_is_exact(tmp_path):
    """2 gloo ranks; rank 1's model raises in one step and rank 1 gets NaN data in another.
    Every rank raises in that step (rank 0: RankFailure naming rank 1, at once: a rank that
    waited for gloo's timeout would raise gloo's error instead, and never within the run's time
    limit), every rank's step is undone, and the good steps after it are those of an
    undisturbed run (to 1e-12)."""
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": "1"}
    worker = str(HERE / "fault_worker.py")
    outs = {name: tmp_path / f"{name}.pt" for name in ("clean", "faults")}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    launch += ["--master_addr=127.0.0.1", f"--master_port={_free_port()}"]
    launch += [worker, str(outs["clean"]), str(outs["faults"])]  # both runs, one after the other
    subprocess.run(launch, env=env, check=True, timeout=1200)
    runs = {name: torch.load(out, weights_only=False) for name, out in outs.items()}
    for rank in (0, 1):
        clean, faults = runs["clean"][rank], runs["faults"][rank]
        assert clean["errors"] == []
        assert len(faults["losses"]) == len(clean["losses"]) == 6
        assert faults["losses"] == pytest.approx(clean["losses"], rel=1e-12)
        torch.testing.assert_close(faults["mean"], clean["mean"], rtol=1e-12, atol=1e-12)
    e0, e1 = runs["faults"][0]["errors"], runs["faults"][1]["errors"]
    assert len(e0) == len(e1) == 2
    assert all(e.startswith("RankFailure: data-parallel CVI: rank 1 of 2 failed") for e in e0)
    assert e1[0].startswith("RuntimeError: a fault on rank 1")
    assert e1[1].startswith("ValueError: the model's argument 0 has a non-finite value")
