"""AutoCVI / CVI_ELBO / CVI on Gaussian latents: exactness, detection, agreement, convergence."""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from bench.baselines import logreg_neg_elbo
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

from pyro_cvi import CVI, CVI_ELBO, AutoCVI, step_sizes


def _blr_data(N=40, D=5, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(N, D, generator=g, dtype=dtype)
    w = torch.randn(D, generator=g, dtype=dtype)
    y = X @ w + 0.3 * torch.randn(N, generator=g, dtype=dtype) + 0.7
    return X, y


def _blr_model(m0, s0, sigma, offset=0.7):
    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(m0, s0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            return pyro.sample("y", dist.Normal(X @ w + offset, sigma), obs=y)

    return model


def _blr_closed_form(X, y, m0, s0, sigma, offset=0.7):
    Lam = torch.diag(s0**-2) + X.T @ X / sigma**2
    V = torch.linalg.inv(Lam)
    m = V @ (m0 / s0**2 + X.T @ (y - offset) / sigma**2)
    evidence = dist.MultivariateNormal(
        X @ m0 + offset, X @ torch.diag(s0**2) @ X.T + sigma**2 * torch.eye(len(y), dtype=X.dtype)
    ).log_prob(y)
    return m, V, evidence


def _log_evidence_woodbury(X, r, sigma):
    """log N(r | 0, X X^T + sigma^2 I) in O(N D^2) (determinant lemma + Woodbury), prior N(0, I)."""
    N, D = X.shape
    Lam = torch.eye(D, dtype=X.dtype) + X.T @ X / sigma**2
    L = torch.linalg.cholesky(Lam)
    u = torch.cholesky_solve((X.T @ r / sigma**2).unsqueeze(-1), L).squeeze(-1)
    quad = (r @ r) / sigma**2 - (X.T @ r / sigma**2) @ u
    logdet = 2 * N * math.log(sigma) + 2 * L.diagonal().log().sum()
    return -0.5 * (quad + logdet + N * math.log(2 * math.pi))


@pytest.mark.parametrize("N,D", [(40, 5), (6, 30)])  # primal and dual
def test_conjugate_linear_regression_one_step_exact(N, D):
    X, y = _blr_data(N, D)
    m0 = torch.linspace(-0.5, 0.5, D, dtype=X.dtype)
    s0 = torch.linspace(0.5, 2.0, D, dtype=X.dtype)
    model = _blr_model(m0, s0, 0.3)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    loss = svi.step(X, y)
    m, V, evidence = _blr_closed_form(X, y, m0, s0, 0.3)
    q = guide.posterior("w")
    assert torch.allclose(q.loc, m, rtol=1e-6, atol=1e-9)
    assert torch.allclose(q.covariance_matrix, V, rtol=1e-6, atol=1e-9)
    # for a conjugate model the ELBO at the exact posterior is the log evidence
    assert loss == pytest.approx(-evidence.item(), rel=1e-9)
    assert "conjugate" in guide.explain()
    assert "linear-predictor" not in guide.explain()


def test_conjugate_with_obs_mask_uses_only_observed_entries():
    X, y = _blr_data(30, 4)
    m0, s0 = torch.zeros(4, dtype=X.dtype), torch.ones(4, dtype=X.dtype)
    mask = torch.arange(30) % 3 != 0
    y_nan = torch.where(mask, y, torch.tensor(float("nan"), dtype=y.dtype))

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(m0, s0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            # (X * w).sum(-1) rather than X @ w: Predictive adds a batch dim to w here
            pyro.sample("y", dist.Normal((X * w).sum(-1) + 0.7, 0.3), obs=y, obs_mask=mask)

    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    loss = svi.step(X, y_nan)
    m, V, evidence = _blr_closed_form(X[mask], y[mask], m0, s0, 0.3)
    q = guide.posterior("w")
    assert torch.allclose(q.loc, m, rtol=1e-6)
    assert torch.allclose(q.covariance_matrix, V, rtol=1e-6)
    assert loss == pytest.approx(-evidence.item(), rel=1e-8)
    text = guide.explain()
    assert "y_observed" in text and "conjugate" in text
    assert "y_unobserved" in text and "leaf" in text
    # the imputed values come from the conditional prior given w
    samples = Predictive(model, guide=guide, num_samples=400, parallel=True)(X, y_nan)
    imputed = samples["y_unobserved"].reshape(400, -1)[:, ~mask].mean(0)
    assert torch.allclose(imputed, X[~mask] @ m + 0.7, atol=0.12)


def test_multivariate_normal_prior_and_mvn_posterior():
    X, y = _blr_data(25, 3)
    P0 = torch.tensor([[2.0, 0.5, 0.0], [0.5, 1.0, 0.2], [0.0, 0.2, 3.0]], dtype=X.dtype)

    def model(X, y=None):
        w = pyro.sample("w", dist.MultivariateNormal(X.new_zeros(3), precision_matrix=P0))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)

    guide = AutoCVI(model)
    SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO()).step(X, y)
    Lam = P0 + X.T @ X / 0.25
    m = torch.linalg.solve(Lam, X.T @ y / 0.25)
    assert torch.allclose(guide.posterior("w").loc, m, rtol=1e-8)
    assert torch.allclose(guide.posterior("w").precision_matrix, Lam, rtol=1e-8)


def _logreg_model(delta, likelihood="bernoulli"):
    def model(X, y=None):
        D = X.shape[-1]
        w = pyro.sample("w", dist.Normal(X.new_zeros(D), X.new_ones(D) / delta**0.5).to_event(1))
        with pyro.plate("data", X.shape[0]):
            if likelihood == "bernoulli":
                pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
            elif likelihood == "binomial":
                pyro.sample("y", dist.Binomial(total_count=5, logits=X @ w), obs=y)
            elif likelihood == "poisson":
                pyro.sample("y", dist.Poisson(torch.exp(X @ w)), obs=y)
            elif likelihood == "probs":
                pyro.sample("y", dist.Bernoulli(probs=torch.sigmoid(X @ w)), obs=y)

    return model


def _toy_classification(N=60, D=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.cat([torch.ones(N, 1), torch.randn(N, D - 1, generator=g)], 1).double()
    w = torch.tensor([0.3, 1.5, -1.0]).double()[:D]
    y = torch.bernoulli(torch.sigmoid(X @ w), generator=g)
    return X, y


@pytest.mark.parametrize("likelihood", ["bernoulli", "binomial", "poisson", "probs"])
def test_linear_predictor_detection(likelihood):
    X, y = _toy_classification()
    if likelihood == "binomial":
        y = y * 3
    if likelihood == "poisson":
        y = torch.poisson(torch.exp(0.3 * X[:, 1]))
    model = _logreg_model(1.0, likelihood)
    guide = AutoCVI(model)
    guide(X, y)
    text = guide.explain()
    line = [ln for ln in text.splitlines() if ln.strip().startswith("y ->")][0]
    assert "linear-predictor" in line, text
    assert "60 sites" in line
    assert "conjugate prior" in text


def test_nonaffine_and_scale_dependence_are_general():
    X, y = _blr_data(20, 2)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(X.new_zeros(2), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(torch.tanh(X @ w), 0.5), obs=y)
            pyro.sample("y2", dist.Normal(X @ w, torch.exp(w[0])), obs=y)

    guide = AutoCVI(model, remainder="off")
    guide(X, y)
    lines = {ln.split("->")[0].strip(): ln for ln in guide.explain().splitlines() if "->" in ln}
    assert "general" in lines["y"] and "not affine" in lines["y"]
    assert "general" in lines["y2"] and "loc, scale depend on w" in lines["y2"]


def _brute_force_gaussian(X, y, delta, steps=400):
    """Maximise the quadrature ELBO over (m, Cholesky) with L-BFGS: an independent optimum."""
    D = X.shape[1]
    m = torch.zeros(D, dtype=X.dtype, requires_grad=True)
    raw = torch.zeros(D, D, dtype=X.dtype, requires_grad=True)
    opt = torch.optim.LBFGS(
        [m, raw],
        max_iter=steps,
        tolerance_grad=1e-12,
        tolerance_change=1e-14,
        line_search_fn="strong_wolfe",
    )

    def L():
        return torch.tril(raw, -1) + torch.diag(torch.exp(raw.diagonal()) * 0.3)

    def closure():
        opt.zero_grad()
        Lm = L()
        loss = logreg_neg_elbo(X, y, m, Lm @ Lm.T, delta)
        loss.backward()
        return loss

    opt.step(closure)
    Lm = L().detach()
    return m.detach(), Lm @ Lm.T, float(closure())


@pytest.mark.parametrize("num_samples", [None, 64])
def test_logistic_regression_matches_brute_force_optimum(num_samples):
    X, y = _toy_classification()
    model = _logreg_model(1.0)
    guide = AutoCVI(model, num_samples=num_samples)
    beta = 1.0 if num_samples is None else step_sizes.robbins_monro(1.0, 1.0, 0.7)
    svi = SVI(model, guide, CVI(step_size=beta), loss=CVI_ELBO())
    losses = [svi.step(X, y) for _ in range(40 if num_samples is None else 300)]
    m_bf, V_bf, loss_bf = _brute_force_gaussian(X, y, 1.0)
    q = guide.posterior("w")
    loss_cvi = float(logreg_neg_elbo(X, y, q.loc, q.covariance_matrix, 1.0))
    if num_samples is None:
        assert loss_cvi == pytest.approx(loss_bf, abs=1e-6)
        assert losses[-1] == pytest.approx(loss_bf, abs=1e-5)  # the reported loss is exact
        assert torch.allclose(q.loc, m_bf, atol=1e-4)
        assert torch.allclose(q.covariance_matrix, V_bf, atol=1e-4)
    else:
        assert loss_cvi == pytest.approx(loss_bf, abs=2e-3)
        assert torch.allclose(q.loc, m_bf, atol=0.05)


def test_general_factor_bonnet_price_converges():
    # y ~ Normal(tanh-free but non-affine: loc = w^2 * x) -> general factor
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, generator=g).double()
    y = 0.8 * x + 0.1 * torch.randn(50, generator=g).double()

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.ones(1, dtype=x.dtype), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Normal(w[0] ** 3 * x, 0.1), obs=y)

    guide = AutoCVI(model, remainder="off", num_general_samples=16)
    svi = SVI(model, guide, CVI(step_size=step_sizes.robbins_monro(0.5, 1.0, 0.7)), loss=CVI_ELBO())
    for _ in range(150):
        svi.step(x, y)
    assert "general" in guide.explain()
    # exact posterior by quadrature on a grid (1-D), compare mean and sd
    grid = torch.linspace(0.5, 1.2, 20001, dtype=x.dtype)
    logp = dist.Normal(1.0, 1.0).log_prob(grid) + dist.Normal(grid[:, None] ** 3 * x, 0.1).log_prob(
        y
    ).sum(-1)
    p = torch.softmax(logp, 0)
    mean = (p * grid).sum()
    sd = ((p * (grid - mean) ** 2).sum()).sqrt()
    q = guide.posterior("w")
    assert q.loc.item() == pytest.approx(mean.item(), abs=3e-3)
    assert q.covariance_matrix.sqrt().item() == pytest.approx(sd.item(), rel=0.1)


def test_hyperparameter_learning_recovers_noise_scale():
    X, y = _blr_data(400, 3)

    def model(X, y=None):
        sigma = pyro.param(
            "sigma", torch.tensor(1.0, dtype=X.dtype), constraint=dist.constraints.positive
        )
        w = pyro.sample("w", dist.Normal(X.new_zeros(3), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w + 0.7, sigma), obs=y)

    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0, optim_args={"lr": 0.05}), loss=CVI_ELBO())
    for _ in range(300):
        svi.step(X, y)
    sigma = pyro.param("sigma").item()
    # the ML-II estimate maximises the evidence: check against a brute-force grid
    grid = torch.linspace(0.2, 0.5, 301, dtype=X.dtype)
    ev = torch.stack([_log_evidence_woodbury(X, y - 0.7, s) for s in grid])
    assert sigma == pytest.approx(grid[ev.argmax()].item(), abs=2e-3)


def test_median_predictive_and_step_size_schedules():
    X, y = _toy_classification()
    model = _logreg_model(1.0)
    guide = AutoCVI(model)
    opt = CVI(step_size=step_sizes.paper(0.4))
    assert opt.step_size == pytest.approx(0.4 / 1.4)
    svi = SVI(model, guide, opt, loss=CVI_ELBO())
    for _ in range(30):
        svi.step(X, y)
    med = guide.median(X, y)
    assert torch.allclose(med["w"], guide.posterior("w").loc)
    pred = Predictive(model, guide=guide, num_samples=500, return_sites=["w", "y"])(X)
    assert pred["w"].shape == (500, 1, 3) and pred["y"].shape == (500, 60)
    assert torch.allclose(pred["w"].mean(0)[0], med["w"], atol=0.15)
    rm = step_sizes.robbins_monro(1.0, 1.0, 0.6)
    assert rm(1) == pytest.approx(2**-0.6) and rm(100) < rm(10)
    with pytest.raises(ValueError, match="step size must be in"):
        CVI(step_size=1.5)


def test_cvi_steps_plain_autoguides_and_cvi_elbo_refuses_them():
    """CVI() takes natural-gradient steps on Pyro's Gaussian guides with Trace_ELBO
    (docs/pairings.md); CVI_ELBO still needs AutoCVI."""
    X, y = _toy_classification()
    model = _logreg_model(1.0)
    for Guide in (AutoNormal, AutoMultivariateNormal):
        pyro.clear_param_store()
        guide = Guide(model)
        svi = SVI(model, guide, CVI(step_size=0.5), loss=Trace_ELBO())
        svi.step(X, y)
        before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
        svi.step(X, y)
        assert all(not torch.equal(v, pyro.param(k).detach()) for k, v in before.items())
        svi = SVI(model, Guide(model), CVI(step_size=0.5), loss=CVI_ELBO())
        with pytest.raises(TypeError, match="AutoCVI"):
            svi.step(X, y)


def test_non_finite_observation_names_the_site():
    X, y = _toy_classification()
    y[3] = float("nan")
    model = _logreg_model(1.0)
    svi = SVI(model, AutoCVI(model), CVI(step_size=1.0), loss=CVI_ELBO())
    with pytest.raises(ValueError, match="observed site 'y' has a non-finite value"):
        svi.step(X, y)


def test_float32_logistic_regression_is_stable():
    X, y = _toy_classification()
    X, y = X.float(), y.float()
    model = _logreg_model(1.0)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses = [svi.step(X, y) for _ in range(30)]
    assert all(math.isfinite(v) for v in losses)
    assert guide.posterior("w").loc.dtype == torch.float32
    q = guide.posterior("w")
    ref = float(
        logreg_neg_elbo(X.double(), y.double(), q.loc.double(), q.covariance_matrix.double(), 1.0)
    )
    assert losses[-1] == pytest.approx(ref, abs=1e-3)


def test_clearing_the_param_store_restarts_a_live_guide():
    X, y = _toy_classification()
    model = _logreg_model(1.0)
    guide = AutoCVI(model)
    svi = SVI(model, guide, CVI(step_size=1.0), loss=CVI_ELBO())
    first = [svi.step(X, y) for _ in range(10)]
    pyro.clear_param_store()
    again = [svi.step(X, y) for _ in range(10)]
    assert again == pytest.approx(first, rel=1e-10)
