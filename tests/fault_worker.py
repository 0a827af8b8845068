"""A data-parallel run with faults on one rank, for tests/test_distributed.py (not collected).

``torchrun --nproc_per_node=2 tests/fault_worker.py CLEAN FAULTS``: 2 gloo ranks fit a
logistic regression with a learned prior scale (Adam) on their shards for 6 good steps, twice
in the same process group, each from a cleared param store and the same seed: first
undisturbed (saved to CLEAN), then with faults (saved to FAULTS): rank 1's model raises at the
3rd step and rank 1's data has a NaN at the 5th (a bad-data error from the checks); after each
failed step every rank goes on with good data. Rank 0 saves, per rank, the losses of the good
steps, q's mean and the errors the rank saw. (One launch for both runs: starting torchrun and
its ranks is most of the cost.)"""

import sys

import pyro
import pyro.distributions as dist
import torch
import torch.distributed as tdist
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.scale.distributed import WORLD, shard

N, D = 200, 3


def main(clean_out: str, faults_out: str) -> None:
    tdist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(X @ torch.ones(D, dtype=X.dtype)), generator=g)
    X, y = shard(X), shard(y)
    for out, faults in ((clean_out, False), (faults_out, True)):
        result = fit(X, y, faults)
        gathered = [None, None]
        tdist.all_gather_object(gathered, result)
        if tdist.get_rank() == 0:
            torch.save(gathered, out)
    tdist.destroy_process_group()


def fit(X: torch.Tensor, y: torch.Tensor, faults: bool) -> dict:
    rank = tdist.get_rank()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    state = {"raise": False}

    def model(X, y):
        scale = pyro.param("scale", torch.tensor(1.0, dtype=X.dtype), dist.constraints.positive)
        w = pyro.sample("w", dist.Normal(X.new_zeros(D), scale).to_event(1))
        if state["raise"]:
            raise RuntimeError(f"a fault on rank {rank}")
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    guide = AutoCVI(model, process_group=WORLD)
    svi = SVI(model, guide, CVI(optim_args={"lr": 0.05}), loss=CVI_ELBO())
    losses, errors = [], []
    for step in range(8 if faults else 6):
        bad = faults and step in (2, 4)
        state["raise"] = bad and step == 2 and rank == 1
        Xs = X.clone()
        if bad and step == 4 and rank == 1:
            Xs[3, 1] = float("nan")
        try:
            losses.append(svi.step(Xs, y))
        except Exception as e:  # noqa: BLE001 (recorded: the test checks them)
            errors.append(f"{type(e).__name__}: {e}")
    return {"losses": losses, "mean": guide.posterior("w").mean, "errors": errors}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
