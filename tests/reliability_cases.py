"""Cases of docs/errors.md added by the second reliability pass (each raises its documented
error; ``tests/test_errors.py`` checks them against the table, and
``tests/test_reliability_cases.py`` that the guide and optimizer step on correctly after)."""

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI
from pyro.infer.autoguide import init_to_value

from pyro_cvi import CVI, CVI_ELBO, AutoCVI
from pyro_cvi.checkpoints.checkpoint import save_checkpoint


def data(N=60, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, 2, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(X[:, 0]), generator=g)
    return X.to(dtype), y.to(dtype)


def logreg(X, y=None):
    w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def beta_model(x):
    a = pyro.sample("a", dist.Gamma(x.new_tensor(2.0), x.new_tensor(1.0)))
    with pyro.plate("d", x.shape[0]):
        pyro.sample("x", dist.Beta(a, x.new_tensor(2.0)), obs=x)


BETA_DATA = torch.tensor([0.2, 0.5, 0.9, 0.3, 0.7], dtype=torch.float64)


def svi(model=logreg, guide=None, step=1.0):
    guide = AutoCVI(model) if guide is None else guide
    return SVI(model, guide, CVI(step_size=step), loss=CVI_ELBO())


def case_prefix_collision():
    X, y = data()
    first, second = svi(), svi()
    first.step(X, y)
    second.step(X, y)  # a second guide under the prefix 'AutoCVI', the first still live


def case_bad_prefix():
    AutoCVI(logreg, prefix="")


def _wide_poisson(dtype, scale=10.0):
    """A Poisson regression whose prior is far wider than the data's scale."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(50, 3, generator=g, dtype=torch.float64)
    y = torch.poisson(torch.exp(X @ torch.full((3,), 1.5, dtype=X.dtype)), generator=g)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(3), scale).to_event(1))
        with pyro.plate("data", 50):
            pyro.sample("y", dist.Poisson(torch.exp(X @ w)), obs=y)

    return model, X.to(dtype), y.to(dtype)


def case_diverged():
    model, X, y = _wide_poisson(torch.float64)
    pyro.set_rng_seed(1)  # draws with which the fixed full step overshoots (most seeds do)
    s = svi(model, AutoCVI(model, init_sites="prior", num_samples=4))
    for _ in range(25):
        s.step(X, y)


def case_initial_q_not_finite():
    model, X, y = _wide_poisson(torch.float32, 30.0)  # exp(X w) overflows float32 at the prior
    pyro.set_rng_seed(0)
    svi(model, AutoCVI(model, init_sites="prior", num_samples=4)).step(X, y)


def case_model_changed():
    X, y = data()
    state = {"normal": False}

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            like = dist.Normal(X @ w, 1.0) if state["normal"] else dist.Bernoulli(logits=X @ w)
            pyro.sample("y", like, obs=y)

    s = svi(model)
    s.step(X, y)
    state["normal"] = True
    s.step(X, y)


def case_half_precision():
    X, y = data()
    svi().step(X.half(), y.half())


def case_bool_labels():
    X, y = data()
    svi().step(X, y.bool())


def case_impossible_observation():
    x = BETA_DATA.clone()
    x[2] = 1.0
    svi(beta_model).step(x)


def case_delta_latent():
    def model(x):
        d = pyro.sample("d", dist.Delta(x.new_tensor(1.0)))
        with pyro.plate("n", x.shape[0]):
            pyro.sample("x", dist.Normal(d, 1.0), obs=x)

    svi(model).step(BETA_DATA)


def case_checkpoint_unwritable(tmp_path):
    X, y = data()
    optim = CVI()
    guide = AutoCVI(logreg)
    SVI(logreg, guide, optim, loss=CVI_ELBO()).step(X, y)
    save_checkpoint(tmp_path / "no such folder" / "run.pt", optim, guide)


def case_improper_prior():
    def model(x):
        mu = pyro.sample("mu", dist.ImproperUniform(dist.constraints.real, (), ()))
        with pyro.plate("n", x.shape[0]):
            pyro.sample("x", dist.Normal(mu, 1.0), obs=x)

    svi(model, AutoCVI(model, init_loc_fn=init_to_value(values={"mu": BETA_DATA[0]}))).step(
        BETA_DATA
    )


def gp_problem():
    """A 20-point GP classification with CVIOptimizer (the GPyTorch adapter)."""
    import gpytorch

    from pyro_cvi.contrib.gpytorch import CVIOptimizer, CVIVariationalStrategy

    x = torch.linspace(0, 1, 20, dtype=torch.float64).unsqueeze(-1)
    y = (x[:, 0] > 0.5).double()

    class GP(gpytorch.models.ApproximateGP):
        def __init__(self):
            super().__init__(CVIVariationalStrategy(self, x, 20))
            self.mean, self.kernel = gpytorch.means.ZeroMean(), gpytorch.kernels.RBFKernel()

        def forward(self, a):
            return gpytorch.distributions.MultivariateNormal(self.mean(a), self.kernel(a))

    lik = gpytorch.likelihoods.BernoulliLikelihood().double()
    return CVIOptimizer(GP().double(), lik, 1.0), x, y


def case_gpytorch_nan_target():
    opt, x, y = gp_problem()
    y[3] = float("nan")
    opt.step(x, y)


CASES = {
    name[5:].replace("_", "-"): fn for name, fn in globals().items() if name.startswith("case_")
}
