"""Non-conjugate Gamma models (Appendices J and K): CVI with Monte Carlo messages reaches the
optimum of the ELBO found by brute-force optimisation, on small instances."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from bench import gamma_models as gm

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, step_sizes


def _vectorized_elbo(log_p, shapes, S=20000, seed=0):
    """ELBO(params) = E_q[log p(z)] + H[q] with fixed-seed reparameterised samples."""

    def elbo(params):
        torch.manual_seed(seed)
        z = {n: dist.Gamma(params[n][0].exp(), params[n][1].exp()).rsample((S,)) for n in shapes}
        ent = sum(
            dist.Gamma(params[n][0].exp(), params[n][1].exp()).entropy().sum() for n in shapes
        )
        return log_p(z).mean() + ent

    return elbo


def _best_gamma_q(elbo, init):
    params = {
        n: (a.log().clone().requires_grad_(True), b.log().clone().requires_grad_(True))
        for n, (a, b) in init.items()
    }
    flat = [t for p in params.values() for t in p]
    opt = torch.optim.LBFGS(
        flat,
        max_iter=60,
        tolerance_grad=1e-8,
        tolerance_change=1e-10,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        loss = -elbo(params)
        loss.backward()
        return loss

    opt.step(closure)
    return -float(closure().detach())


def _small_pmf():
    g = torch.Generator().manual_seed(3)
    N, V, K = 6, 5, 2
    W = -torch.log(torch.rand(K, V, generator=g, dtype=torch.float64)) * 2
    Z = -torch.log(torch.rand(N, K, generator=g, dtype=torch.float64))
    X = torch.poisson(Z @ W, generator=g)
    return X, K


@pytest.mark.slow
def test_poisson_mf_reaches_the_best_gamma_q():
    """Appendix K on a small instance: the ELBO of CVI's q is that of the best factorised
    Gamma q (brute-force L-BFGS on a fixed-sample ELBO), up to Monte Carlo error."""
    X, K = _small_pmf()
    N, V = X.shape
    a = 0.5
    model = gm.poisson_mf_model(K, a, a)
    mask = torch.ones_like(X, dtype=torch.bool)

    def log_p(z):
        W, Z = z["W"], z["Z"]
        lp = dist.Gamma(X.new_tensor(a), a).log_prob(W).sum((-2, -1))
        lp = lp + dist.Gamma(X.new_tensor(a), a).log_prob(Z).sum((-2, -1))
        return lp + dist.Poisson(Z @ W).log_prob(X).sum((-2, -1))

    shapes = {"W": (K, V), "Z": (N, K)}
    elbo = _vectorized_elbo(log_p, shapes, S=3000)
    init = gm.random_init(shapes, seed=1, dtype=torch.float64)
    guide = AutoCVI(  # the Gamma mean field of Appendix K (not the joint Gaussian remainder)
        model,
        num_general_samples=2,
        init_loc_fn=pyro.infer.autoguide.init_to_value(values=init),
        remainder="off",
    )
    svi = SVI_(model, guide, step_sizes.robbins_monro(1.0, 1.0, 0.6))
    q = _averaged_q(svi, guide, (X, mask), shapes, 200, 80)
    got = float(elbo({n: (a_.log(), b_.log()) for n, (a_, b_) in q.items()}))
    best = _best_gamma_q(elbo, q)
    assert best >= got - 1e-6  # (the optimiser starts from CVI's q)
    # within 0.5%: the brute-force optimum of a fixed-sample ELBO is itself optimistic by a
    # few hundredths of a nat, and CVI's averaged iterate carries Monte Carlo noise
    assert got == pytest.approx(best, rel=5e-3)
    text = guide.explain()
    assert "X -> W" in text and "general" in text and "Fisher solve" in text
    assert "W -> W" in text and "conjugate prior" in text


def _averaged_q(svi, guide, args, shapes, steps, last):
    """Run CVI and average the natural parameters of the ``last`` steps (Polyak averaging)."""
    acc = None
    for t in range(steps):
        svi.step(*args)
        if t >= steps - last:
            nat = {
                n: [p.detach().clone() for p in guide.engine.stepper[n].params()] for n in shapes
            }
            acc = (
                nat if acc is None else {n: [a + b for a, b in zip(acc[n], nat[n])] for n in shapes}
            )
    return {n: (acc[n][0] / last + 1, -acc[n][1] / last) for n in shapes}


def SVI_(model, guide, step):
    return pyro.infer.SVI(model, guide, CVI(step_size=step), loss=CVI_ELBO())


@pytest.mark.slow
def test_gamma_factor_model_reaches_the_best_gamma_q():
    """Appendix J on a small instance (y ~ N(0, Z Z^T + s2 I), Z ~ Gamma(1, 1))."""
    Y, _, _ = gm.synthetic_gamma_factor(N=40, N_test=1, D=3, K=2, seed=2, dtype=torch.float64)
    model = gm.gamma_factor_model(3, 2)

    def log_p(z):
        Z = z["Z"]
        lp = dist.Gamma(Y.new_tensor(1.0), 1.0).log_prob(Z).sum((-2, -1))
        like = dist.LowRankMultivariateNormal(
            Y.new_zeros(3), Z.unsqueeze(-3), Y.new_full((3,), 0.1)
        )
        return lp + like.log_prob(Y).sum(-1)

    shapes = {"Z": (3, 2)}
    elbo = _vectorized_elbo(log_p, shapes, S=600)
    init = gm.random_init(shapes, seed=1, dtype=torch.float64)
    guide = AutoCVI(  # the Gamma mean field of Appendix J
        model,
        num_general_samples=4,
        init_loc_fn=pyro.infer.autoguide.init_to_value(values=init),
        remainder="off",
    )
    svi = SVI_(model, guide, step_sizes.robbins_monro(1.0, 1.0, 0.6))
    q = _averaged_q(svi, guide, (Y,), shapes, 150, 60)
    got = float(elbo({"Z": (q["Z"][0].log(), q["Z"][1].log())}))
    best = _best_gamma_q(elbo, q)
    assert got == pytest.approx(best, rel=5e-3)
    assert "LowRankMultivariateNormal has no conjugate pattern" in guide.explain()


def test_monte_carlo_messages_are_unbiased_and_vectorize():
    """The Monte Carlo targets of a loop of samples and of one vectorised run agree, and agree
    with a closed form: for K = 1 the Poisson factor is conjugate (rate = z * w)."""
    X = torch.tensor([[2.0, 0.0, 3.0], [1.0, 4.0, 2.0]], dtype=torch.float64)

    def model(X):  # broadcasting form of Z @ W, so that the particle dim can lead
        W = pyro.sample("W", dist.Gamma(X.new_tensor(0.5), 0.5).expand([1, 3]).to_event(2))
        with pyro.plate("n", 2):
            Z = pyro.sample("Z", dist.Gamma(X.new_tensor(0.5), 0.5).expand([1]).to_event(1))
            pyro.sample("X", dist.Poisson((Z.unsqueeze(-1) * W).sum(-2)).to_event(1), obs=X)

    init = {
        "W": torch.full((1, 3), 1.5, dtype=X.dtype),
        "Z": torch.full((2, 1), 0.7, dtype=X.dtype),
    }
    targets = {}
    for mode in ("exact", "loop", "vectorized"):
        pyro.clear_param_store()
        guide = AutoCVI(
            model,
            num_general_samples=1 if mode == "exact" else 4000,
            vectorize_particles=mode == "vectorized",
            init_loc_fn=pyro.infer.autoguide.init_to_value(values=init),
        )
        guide(X)
        if mode != "exact":
            assert "conjugate" in guide.explain()  # K = 1: a monomial, probed
            spec = guide.engine.analysis.spec("X")
            spec.exact = False  # force the Monte Carlo path on a factor with a closed form
        targets[mode] = guide.engine.natural_targets((X,), {})
    for n in ("W", "Z"):
        for i in range(2):
            exact = targets["exact"][n][i]
            for mode in ("loop", "vectorized"):
                err = (targets[mode][n][i] - exact).abs().max()
                assert err < 0.1 * (1 + exact.abs().max()), (n, i, mode, err)


def test_vectorize_particles_explains_a_model_that_does_not_broadcast():
    X = torch.tensor([[2.0, 0.0, 3.0], [1.0, 4.0, 2.0]], dtype=torch.float64)

    def model(X, mask=None):  # Z @ W does not broadcast over particles
        W = pyro.sample("W", dist.Gamma(X.new_tensor(0.5), 0.5).expand([2, 3]).to_event(2))
        with pyro.plate("images", 2):
            Z = pyro.sample("Z", dist.Gamma(X.new_tensor(0.5), 0.5).expand([2]).to_event(1))
            # (an offset: not a sum of products, so its messages are Monte Carlo ones)
            pyro.sample("X", dist.Poisson(Z @ W + 0.1).to_event(1), obs=X)

    guide = AutoCVI(model, remainder="off", num_general_samples=3, vectorize_particles=True)
    svi = SVI_(model, guide, 0.1)
    with pytest.raises(ValueError, match="broadcast"):
        svi.step(X, None)


def test_softplus_adam_baseline_runs_and_improves():
    X, train, test = gm.load_digits_counts()
    X, train, test = X[:200], train[:200], test[:200]
    K = 3
    model = gm.poisson_mf_model(K)
    init = gm.random_init({"W": (K, 64), "Z": (200, K)})

    def metric(m):
        return gm.poisson_mf_heldout(m["W"], m["Z"], X, test)

    h, means = gm.run_adam(model, (X, train), init, metric, lr=0.1, iters=60, every=20)
    assert h.metric[-1] > metric(init)
    hc, guide = gm.run_cvi(model, (X, train), init, metric, iters=60, every=20, step_size=0.3)
    assert hc.metric[-1] > metric(init)


@pytest.mark.slow
def test_poisson_mf_on_digits_converges_in_fewer_steps_than_adam():
    """Appendix K on the real data (scikit-learn's digits, K = 10, 20% of entries held out):
    after 400 steps CVI (constant beta = 0.3, one sample) has a clearly better held-out
    log-likelihood than Adam on the softplus Gamma parameters (the paper's baseline, best of
    two learning rates) after the same 400 steps. (Wall-clock comparisons:
    scripts/benchmark_gamma.py.)

    Measured (one sample per step, so the numbers move with the machine's floating-point
    rounding and the seed): CVI -2.146 to -2.174 at 400 steps over machines and seeds 0-2;
    Adam at 400 steps -2.240 (lr 0.1) and -2.197 (lr 0.3). At 600 Adam steps lr 0.3 reaches
    -2.164, within that spread of CVI's 400: the margin asserted here is CVI at 400 against
    Adam at 400."""
    X, train, test = gm.load_digits_counts()
    K = 10
    model = gm.poisson_mf_model(K)
    init = gm.random_init({"W": (K, 64), "Z": (X.shape[0], K)}, seed=1)

    def metric(m):
        return gm.poisson_mf_heldout(m["W"], m["Z"], X, test)

    start = metric(init)
    pyro.set_rng_seed(0)
    hc, guide = gm.run_cvi(model, (X, train), init, metric, iters=400, every=100, step_size=0.3)
    adam = []
    for lr in (0.1, 0.3):
        pyro.set_rng_seed(0)
        h, _ = gm.run_adam(model, (X, train), init, metric, lr=lr, iters=400, every=100)
        adam.append(h.metric[-1])
    assert start < -3.0
    assert hc.metric[-1] > -2.19
    assert hc.metric[-1] > max(adam) + 0.01, (hc.metric, adam)
    assert guide.num_rejected == 0
