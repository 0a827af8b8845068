"""Models on which fixed CVI steps diverged or raised raw torch errors, written
anew after Pyro's tutorials and examples, with small synthetic data (fixed seeds).

Each builder returns ``(model, args, guide_kwargs)``; :func:`sparse_gamma_def` also returns the
hand-written guide of Pyro's ``examples/sparse_gamma_def.py`` structure.
"""

import pyro
import pyro.distributions as dist
import torch

F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def eight_schools(centred: bool = True):
    y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0], dtype=F64)
    sigma = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0], dtype=F64)

    def model(sigma, y=None):
        mu = pyro.sample("mu", dist.Normal(sigma.new_tensor(0.0), 5.0))
        tau = pyro.sample("tau", dist.HalfCauchy(sigma.new_tensor(5.0)))
        with pyro.plate("schools", len(sigma)):
            if centred:
                theta = pyro.sample("theta", dist.Normal(mu, tau))
            else:
                eta = pyro.sample("eta", dist.Normal(sigma.new_tensor(0.0), 1.0))
                theta = mu + tau * eta
            pyro.sample("obs", dist.Normal(theta, sigma), obs=y)

    return model, (sigma, y), {}


def halfnormal_regression():
    g = _gen(1)
    X = torch.randn(50, 3, generator=g, dtype=F64)
    w0 = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
    y = X @ w0 + 0.7 * torch.randn(50, generator=g, dtype=F64)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(3), 1.0).to_event(1))
        sigma = pyro.sample("sigma", dist.HalfNormal(X.new_tensor(1.0)))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Normal(X @ w, sigma), obs=y)

    return model, (X, y), {}


def baseball_pooled():
    """examples/baseball.py ``partially_pooled``: ``kappa ~ Pareto(1, 1.5)``."""
    g = _gen(2)
    at_bats = torch.full((18,), 45.0, dtype=F64)
    hits = torch.binomial(at_bats, 0.2 + 0.1 * torch.rand(18, generator=g, dtype=F64), generator=g)

    def model(at_bats, hits):
        phi = pyro.sample("phi", dist.Uniform(at_bats.new_tensor(0.0), 1.0))
        kappa = pyro.sample("kappa", dist.Pareto(at_bats.new_tensor(1.0), 1.5))
        with pyro.plate("players", len(at_bats)):
            theta = pyro.sample("theta", dist.Beta(phi * kappa, (1.0 - phi) * kappa))
            pyro.sample("obs", dist.Binomial(at_bats, probs=theta), obs=hits)

    return model, (at_bats, hits), {}


def baseball_logit():
    """examples/baseball.py ``partially_pooled_with_logit``."""
    model0, (at_bats, hits), _ = baseball_pooled()

    def model(at_bats, hits):
        loc = pyro.sample("loc", dist.Normal(at_bats.new_tensor(-1.0), 1.0))
        scale = pyro.sample("scale", dist.HalfCauchy(at_bats.new_tensor(1.0)))
        with pyro.plate("players", len(at_bats)):
            alpha = pyro.sample("alpha", dist.Normal(loc, scale))
            pyro.sample("obs", dist.Binomial(at_bats, logits=alpha), obs=hits)

    return model, (at_bats, hits), {}


def logistic_subsampled():
    g = _gen(3)
    X = torch.randn(400, 3, generator=g, dtype=F64)
    y = torch.bernoulli(torch.sigmoid(X @ torch.tensor([1.5, -2.0, 0.5], dtype=F64)), generator=g)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(3), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0], subsample_size=50) as idx:
            pyro.sample("obs", dist.Bernoulli(logits=X[idx] @ w), obs=y[idx])

    return model, (X, y), {}


def gaussian_mixture():
    """The Gaussian mixture tutorial (enumerated assignments)."""
    data = torch.tensor([0.0, 1.0, 10.0, 11.0, 12.0], dtype=F64)

    def model(data):
        weights = pyro.sample("weights", dist.Dirichlet(0.5 * data.new_ones(2)))
        scale = pyro.sample("scale", dist.LogNormal(data.new_tensor(0.0), 2.0))
        with pyro.plate("components", 2):
            locs = pyro.sample("locs", dist.Normal(data.new_tensor(0.0), 10.0))
        with pyro.plate("data", len(data)):
            a = pyro.sample("assignment", dist.Categorical(weights))
            pyro.sample("obs", dist.Normal(locs[a], scale), obs=data)

    init = pyro.infer.autoguide.initialization.init_to_value(
        values={"locs": torch.tensor([0.5, 11.0], dtype=F64)}
    )
    return model, (data,), {"init_loc_fn": init}


def gamma_poisson_glm():
    g = _gen(4)
    X = torch.randn(80, 3, generator=g, dtype=F64)
    rate = torch.exp(X @ torch.tensor([0.3, -0.5, 0.8], dtype=F64) + 1.0)
    y = dist.GammaPoisson(2.0, 2.0 / rate).sample()

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(3), 1.0).to_event(1))
        b = pyro.sample("b", dist.Normal(X.new_tensor(0.0), 2.0))
        phi = pyro.sample("phi", dist.Gamma(X.new_tensor(2.0), 1.0))
        with pyro.plate("data", X.shape[0]):
            mu = torch.exp(X @ w + b)
            pyro.sample("obs", dist.GammaPoisson(phi, phi / mu), obs=y)

    return model, (X, y), {}


def hmm():
    """examples/hmm.py ``model_1`` in small: enumerated states, Beta/Dirichlet globals."""
    g = _gen(5)
    T, N, K, D = 30, 4, 3, 5
    x = (torch.rand(N, T, D, generator=g) < 0.3).to(F64)
    lengths = torch.tensor([30, 25, 20, 30])

    def model(seqs, lengths):
        probs_x = pyro.sample(
            "probs_x", dist.Dirichlet(0.9 * torch.eye(K, dtype=F64) + 0.1).to_event(1)
        )
        probs_y = pyro.sample(
            "probs_y", dist.Beta(seqs.new_tensor(0.1), 0.9).expand([K, D]).to_event(2)
        )
        tones = pyro.plate("tones", D, dim=-1)
        with pyro.plate("sequences", seqs.shape[0], dim=-2):
            z = 0
            for t in pyro.markov(range(seqs.shape[1])):
                with pyro.poutine.mask(mask=(t < lengths).unsqueeze(-1)):
                    z = pyro.sample(
                        f"x_{t}", dist.Categorical(probs_x[z]), infer={"enumerate": "parallel"}
                    )
                    with tones:
                        pyro.sample(
                            f"y_{t}", dist.Bernoulli(probs_y[z.squeeze(-1)]), obs=seqs[:, t]
                        )

    return model, (x, lengths), {}


def sparse_gamma_def(n=40, top=6, mid=4, bottom=3, pixels=30):
    """examples/sparse_gamma_def.py in small, on synthetic counts; with the hand-written guide."""
    g = _gen(6)
    a_z, b_z, a_w, b_w = 0.1, 0.1, 0.1, 0.3
    z = torch.distributions.Gamma(torch.full((n, top), 1.0, dtype=F64), 1.0).sample()
    w = torch.rand(top, pixels, generator=g, dtype=F64) * 2
    x = torch.poisson(z @ w, generator=g)

    def model(x):
        with pyro.plate("w_top_plate", top * mid):
            w_top = pyro.sample("w_top", dist.Gamma(x.new_tensor(a_w), b_w))
        with pyro.plate("w_mid_plate", mid * bottom):
            w_mid = pyro.sample("w_mid", dist.Gamma(x.new_tensor(a_w), b_w))
        with pyro.plate("w_bottom_plate", bottom * pixels):
            w_bottom = pyro.sample("w_bottom", dist.Gamma(x.new_tensor(a_w), b_w))
        with pyro.plate("data", x.shape[0]):
            z_top = pyro.sample(
                "z_top", dist.Gamma(x.new_tensor(a_z), b_z).expand([top]).to_event(1)
            )
            mean_mid = z_top @ w_top.reshape(top, mid)
            z_mid = pyro.sample("z_mid", dist.Gamma(x.new_tensor(a_z), b_z / mean_mid).to_event(1))
            mean_bottom = z_mid @ w_mid.reshape(mid, bottom)
            z_bottom = pyro.sample(
                "z_bottom", dist.Gamma(x.new_tensor(a_z), b_z / mean_bottom).to_event(1)
            )
            mean_obs = z_bottom @ w_bottom.reshape(bottom, pixels)
            pyro.sample("obs", dist.Poisson(mean_obs).to_event(1), obs=x)

    def guide(x):
        sp = torch.nn.functional.softplus

        def param(name, shape):
            return pyro.param(name, lambda: 0.5 + 0.1 * torch.randn(shape, dtype=x.dtype))

        def ws(name, size):
            alpha, mean = (
                sp(param(f"alpha_w_{name}", (size,))),
                sp(param(f"mean_w_{name}", (size,))),
            )
            pyro.sample(f"w_{name}", dist.Gamma(alpha, alpha / mean))

        def zs(name, width):
            alpha = sp(param(f"alpha_z_{name}", (x.shape[0], width)))
            mean = sp(param(f"mean_z_{name}", (x.shape[0], width)))
            pyro.sample(f"z_{name}", dist.Gamma(alpha, alpha / mean).to_event(1))

        with pyro.plate("w_top_plate", top * mid):
            ws("top", top * mid)
        with pyro.plate("w_mid_plate", mid * bottom):
            ws("mid", mid * bottom)
        with pyro.plate("w_bottom_plate", bottom * pixels):
            ws("bottom", bottom * pixels)
        with pyro.plate("data", x.shape[0]):
            zs("top", top)
            zs("mid", mid)
            zs("bottom", bottom)

    return model, (x,), {}, guide


MODELS = {
    "eight_schools_centred": lambda: eight_schools(True),
    "eight_schools_noncentred": lambda: eight_schools(False),
    "halfnormal_regression": halfnormal_regression,
    "baseball_pooled": baseball_pooled,
    "baseball_logit": baseball_logit,
    "logistic_subsampled": logistic_subsampled,
    "gaussian_mixture": gaussian_mixture,
    "gamma_poisson_glm": gamma_poisson_glm,
    "hmm": hmm,
    "sparse_gamma_def": lambda: sparse_gamma_def()[:3],
}
