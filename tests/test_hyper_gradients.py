"""Hyperparameter gradients of the hybrid step equal finite differences of the reported loss.

``CVI_ELBO().loss_and_grads`` writes into every model parameter the derivative of the -ELBO it
reports at fixed CVI (site) parameters: a Gaussian block's ``q`` is re-solved from the prior and
the sites, so it moves with parameters in the prior, in the affine coefficients ``A(theta)`` of
its linear-predictor / softmax / conjugate factors, and in their offsets ``c(theta)``. The
reference is a central finite difference of ``CVI_ELBO().loss`` (which re-solves ``q`` the same
way), and the gradient must not depend on the torch seed the guide was built under (the
analysis traces the model at a random prior draw).
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

D, M = 3, 5


def _data(N=120, K=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    if K is None:
        return X, torch.bernoulli(torch.sigmoid(X @ w), generator=g)
    W = torch.randn(D, K, generator=g, dtype=torch.float64)
    return X, torch.distributions.Categorical(logits=X @ W).sample()


def _kernel(a, b, ell, var=1.0):
    return var * torch.exp(-0.5 * torch.cdist(a, b) ** 2 / ell**2)


def _inducing(X):
    return torch.linspace(-2, 2, M, dtype=X.dtype)[:, None].expand(M, D)


def _sparse_gp(learn_variance=False, likelihood="bernoulli", learn_ell=True):
    """``u ~ N(0, K_mm)``, ``f = K_nm K_mm^-1 u``: the lengthscale enters the prior and ``A``."""

    def model(X, y):
        ell = torch.tensor(1.5, dtype=X.dtype)
        if learn_ell:
            ell = pyro.param("ell", ell, dist.constraints.positive)
        var = 1.0
        if learn_variance:
            var = pyro.param("var", torch.tensor(0.7, dtype=X.dtype), dist.constraints.positive)
        Z = _inducing(X)
        Kmm = _kernel(Z, Z, ell, var) + 1e-6 * torch.eye(M, dtype=X.dtype)
        u = pyro.sample("u", dist.MultivariateNormal(X.new_zeros(M), Kmm))
        A = torch.linalg.solve(Kmm, _kernel(Z, X, ell, var)).T
        with pyro.plate("data", X.shape[0]):
            if likelihood == "normal":
                noise = pyro.param(
                    "noise", torch.tensor(0.5, dtype=X.dtype), dist.constraints.positive
                )
                pyro.sample("y", dist.Normal(A @ u, noise), obs=y)
            else:
                pyro.sample("y", dist.Bernoulli(logits=A @ u), obs=y)

    return model


def ard_logistic(X, y):
    """Prior precision, per-feature scales (in ``A``) and a bias (in ``c``), all learned."""
    alpha = pyro.param("alpha", torch.tensor(2.0, dtype=X.dtype), dist.constraints.positive)
    s = pyro.param("s", torch.tensor([1.0, 0.5, 2.0], dtype=X.dtype))
    b = pyro.param("b", torch.tensor(0.3, dtype=X.dtype))
    w = pyro.sample("w", dist.Normal(X.new_zeros(D), alpha.rsqrt()).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=(X * s) @ w + b), obs=y)


def softmax_gp(X, y, K=3):
    """``K`` sparse GPs as the logits of a Categorical: softmax sites with ``A(ell)``."""
    ell = pyro.param("ell", torch.tensor(1.2, dtype=X.dtype), dist.constraints.positive)
    Z = _inducing(X)
    Kmm = _kernel(Z, Z, ell) + 1e-6 * torch.eye(M, dtype=X.dtype)
    prior = dist.MultivariateNormal(X.new_zeros(M), Kmm)
    U = torch.stack([pyro.sample(f"u{k}", prior) for k in range(K)], -1)
    A = torch.linalg.solve(Kmm, _kernel(Z, X, ell)).T
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Categorical(logits=A @ U), obs=y)


def _markov_chain(learn_h=False, T=12):
    """A ``pyro.markov`` AR(1) loop (Kalman-smoother block): transition ``a``, noise ``q`` in
    the chain prior, the log-rate offset ``b`` and (``learn_h``) its coefficient ``h`` on
    ``x_t``, whose observation rows are then recomputed every step."""

    def model(y):
        one = torch.ones((), dtype=y.dtype)
        a = pyro.param("a", 0.8 * one)
        q = pyro.param("q", 0.4 * one, dist.constraints.positive)
        b = pyro.param("b", 0.2 * one)
        h = pyro.param("h", 1.3 * one) if learn_h else 1.0
        x = pyro.sample("x_0", dist.Normal(0 * one, one))
        for t in pyro.markov(range(T)):
            if t > 0:
                x = pyro.sample(f"x_{t}", dist.Normal(a * x, q))
            pyro.sample(f"y_{t}", dist.Poisson(torch.exp(h * x + b)), obs=y[t])

    return model


def _fit(model, args, seed, steps):
    """A guide built under ``seed``, moved ``steps`` CVI steps (hyperparameters held)."""
    pyro.clear_param_store()
    torch.manual_seed(seed)
    guide = AutoCVI(model)
    svi = SVI(
        model, guide, CVI(step_size=0.5, optim=torch.optim.SGD, optim_args={"lr": 0.0}), CVI_ELBO()
    )
    for _ in range(steps):
        svi.step(*args)
    return guide


def _model_params(guide):
    store = pyro.get_param_store()
    return {
        n: store.get_param(n).unconstrained()
        for n in store.keys()
        if not n.startswith(guide.param_prefix)
    }


def _grads(model, guide, args):
    params = _model_params(guide)
    for p in params.values():
        p.grad = None
    loss = CVI_ELBO().loss_and_grads(model, guide, *args)
    return loss, {n: p.grad.detach().clone() for n, p in params.items()}


def _finite_differences(model, guide, args, h=1e-5):
    out = {}
    for name, p in _model_params(guide).items():
        fd = torch.zeros_like(p)
        for i in range(p.numel()):
            vals = []
            for e in (h, -h):
                with torch.no_grad():
                    p.view(-1)[i] += e
                vals.append(CVI_ELBO().loss(model, guide, *args))
                with torch.no_grad():
                    p.view(-1)[i] -= e
            fd.view(-1)[i] = (vals[0] - vals[1]) / (2 * h)
        out[name] = fd
    return out


CASES = {
    "sparse_gp_bernoulli": (_sparse_gp(), {}),
    "sparse_gp_bernoulli_variance": (_sparse_gp(learn_variance=True), {}),
    "sparse_gp_normal": (_sparse_gp(likelihood="normal"), {"regression": True}),
    "ard_logistic": (ard_logistic, {}),
    "softmax_gp": (softmax_gp, {"K": 3}),
    "markov_chain": (_markov_chain(), {"counts": True}),
    "markov_chain_observation_coefficient": (_markov_chain(learn_h=True), {"counts": True}),
}


def _args(case):
    opts = CASES[case][1]
    if opts.get("counts"):
        g = torch.Generator().manual_seed(1)
        return (torch.poisson(torch.full((12,), 2.0, dtype=torch.float64), generator=g),)
    X, y = _data(K=opts.get("K"))
    if opts.get("regression"):
        y = torch.sin(X[:, 0]) + 0.3 * X[:, 1]
    return X, y


@pytest.mark.parametrize("case", list(CASES))
def test_hyperparameter_gradient_is_the_finite_difference_of_the_loss(case):
    model, args = CASES[case][0], _args(case)
    guide = _fit(model, args, seed=0, steps=2)
    loss, grads = _grads(model, guide, args)
    assert loss == pytest.approx(CVI_ELBO().loss(model, guide, *args), rel=1e-12)
    fd = _finite_differences(model, guide, args)
    for name, g in grads.items():
        torch.testing.assert_close(g, fd[name], rtol=1e-6, atol=1e-7, msg=f"{case}: {name}")


@pytest.mark.parametrize(
    "case",
    [
        "sparse_gp_bernoulli",
        "softmax_gp",
        "sparse_gp_normal",
        "markov_chain_observation_coefficient",
    ],
)
def test_hyperparameter_gradient_does_not_depend_on_the_seed(case):
    """Two guides built under different torch seeds: the same loss and the same gradient."""
    model, args = CASES[case][0], _args(case)
    out = []
    for seed in (1, 2):
        guide = _fit(model, args, seed=seed, steps=1)
        out.append(_grads(model, guide, args))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-12)
    for name, g in out[0][1].items():
        torch.testing.assert_close(g, out[1][1][name], rtol=1e-9, atol=1e-12)


def test_site_steps_are_unchanged_by_the_differentiable_loss():
    """The CVI steps (site targets from the graph-free ``q``) are those of the same model with
    the lengthscale a constant, where no graph is built: the same sites after 3 steps."""
    args = _args("sparse_gp_bernoulli")
    sites = []
    for learn in (True, False):
        model = _sparse_gp(learn_ell=learn)
        guide = _fit(model, args, seed=0, steps=3)
        sites.append(pyro.param(f"{guide.param_prefix}.sites.y").detach().clone())
    torch.testing.assert_close(sites[0], sites[1], rtol=0, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_a_learnable_prior_scale_beside_the_one_draw_remainder(dtype):
    """A factor model whose noise scale has a learnable HalfNormal prior goes to the remainder
    (one-draw step): the loss's backward for the model's parameter reaches it (no "backward
    through the graph a second time"), with the gradient of the reported loss's own estimate
    (the same draws: autograd of the loss equals its finite difference in ``s0``)."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(30, 4, generator=g, dtype=torch.float64).to(dtype)

    def model(X):
        n, d = X.shape
        W = pyro.sample("W", dist.Normal(X.new_zeros(2, d), 1.0).to_event(2))
        s0 = pyro.param("s0", torch.tensor(1.0, dtype=X.dtype))
        sigma = pyro.sample("sigma", dist.HalfNormal(s0))
        with pyro.plate("data", n):
            z = pyro.sample("z", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
            pyro.sample("obs", dist.Normal(z @ W, sigma).to_event(1), obs=X)

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(), CVI_ELBO())
    losses = [svi.step(X) for _ in range(5)]
    assert all(torch.isfinite(torch.tensor(losses)))
    s0 = pyro.param("s0").unconstrained()
    # the same q, the same draws: d loss / d s0 by autograd against a central difference
    elbo, h = CVI_ELBO(), 1e-3 if dtype == torch.float64 else 3e-2

    def loss_at(value):
        with torch.no_grad():
            s0.copy_(value)
        pyro.set_rng_seed(7)
        return elbo.loss(model, guide, X)

    base = s0.detach().clone()
    fd = (loss_at(base + h) - loss_at(base - h)) / (2 * h)
    loss_at(base)
    s0.grad = None
    pyro.set_rng_seed(7)
    elbo.loss_and_grads(model, guide, X)
    assert s0.grad is not None and bool(torch.isfinite(s0.grad))
    auto = float(s0.grad)
    assert abs(auto - fd) < (1e-4 if dtype == torch.float64 else 5e-2) * max(1.0, abs(fd))


def test_a_learnable_prior_scale_keeps_the_plain_one_draw_step():
    """The remainder of the factor model above takes the one-draw step on its diagonal form,
    whose iterates are not averaged by default beside a learnable parameter of the model."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(30, 4, generator=g, dtype=torch.float64)

    def model(X):
        W = pyro.sample("W", dist.Normal(X.new_zeros(2, 4), 1.0).to_event(2))
        s0 = pyro.param("s0", torch.tensor(1.0, dtype=X.dtype))
        sigma = pyro.sample("sigma", dist.HalfNormal(s0))
        with pyro.plate("data", 30):
            z = pyro.sample("z", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
            pyro.sample("obs", dist.Normal(z @ W, sigma).to_event(1), obs=X)

    pyro.clear_param_store()
    guide = AutoCVI(model)
    SVI(model, guide, CVI(), CVI_ELBO()).step(X)
    (block,) = [b for b in guide.engine.blocks if getattr(b, "onedraw", False)]
    assert block.form == "diag" and block.control.beta == 0.0 and not block.control.averaging
