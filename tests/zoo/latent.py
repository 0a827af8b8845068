"""Zoo: latent-structure models (Gaussian mixture, LDA, an HMM, sparse gamma DEF)."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer import config_enumerate
from pyro.infer.autoguide.initialization import init_to_value

from . import ZooData, ZooModel


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- Gaussian mixture
K_MIX = 2


@config_enumerate
def gaussian_mixture(data):
    """Pyro's GMM tutorial: ``weights ~ Dirichlet(0.5)``, a shared ``scale ~ LogNormal(0, 2)``,
    ``locs ~ Normal(0, 10)`` per component, an enumerated assignment per point."""
    weights = pyro.sample("weights", dist.Dirichlet(0.5 * data.new_ones(K_MIX)))
    scale = pyro.sample("scale", dist.LogNormal(data.new_tensor(0.0), 2.0))
    with pyro.plate("components", K_MIX):
        locs = pyro.sample("locs", dist.Normal(data.new_tensor(0.0), 10.0))
    with pyro.plate("data", len(data)):
        assignment = pyro.sample("assignment", dist.Categorical(weights))
        pyro.sample("obs", dist.Normal(locs[assignment], scale), obs=data)


def gaussian_mixture_data(dtype=torch.float64) -> ZooData:
    """The tutorial's two clusters (around 0.5 and 11), 30 points."""
    g = _gen(30)
    c = torch.rand(30, generator=g) < 0.4
    x = torch.where(c, 0.5, 11.0).to(dtype) + torch.randn(30, generator=g, dtype=dtype)
    return ZooData((x,))


def _mixture_init(dtype=torch.float64):
    return init_to_value(values={"locs": torch.tensor([0.0, 10.0], dtype=dtype)})


# --------------------------------------------------------------------------- LDA
def lda(data, num_topics: int = 3, vocab: int = 20):
    """Pyro's ``examples/lda.py`` (the model, without the amortised guide): Gamma topic
    weights, Dirichlet topic-word distributions, Dirichlet document topics, an enumerated
    topic per word. ``data`` is ``(words per document, documents)``, word ids stored as floats
    (of the model's dtype)."""
    num_words, num_docs = data.shape
    with pyro.plate("topics", num_topics):
        topic_weights = pyro.sample(
            "topic_weights", dist.Gamma(data.new_tensor(1.0 / num_topics), 1.0)
        )
        topic_words = pyro.sample("topic_words", dist.Dirichlet(data.new_ones(vocab) / vocab))
    with pyro.plate("documents", num_docs):
        doc_topics = pyro.sample("doc_topics", dist.Dirichlet(topic_weights))
        with pyro.plate("words", num_words):
            word_topics = pyro.sample(
                "word_topics", dist.Categorical(doc_topics), infer={"enumerate": "parallel"}
            )
            pyro.sample("doc_words", dist.Categorical(topic_words[word_topics]), obs=data)


def lda_data(dtype=torch.float64) -> ZooData:
    """A synthetic corpus: 3 topics over 20 words, 30 documents of 16 words."""
    g = _gen(31)
    K, V, D, N = 3, 20, 30, 16
    topic_words = torch.full((K, V), 0.02)
    for k in range(K):
        topic_words[k, k * 6 : k * 6 + 7] = 1.0
    topic_words = topic_words / topic_words.sum(-1, keepdim=True)
    with torch.random.fork_rng():
        torch.manual_seed(31)
        doc_topics = torch.distributions.Dirichlet(torch.full((K,), 0.3)).sample((D,))
    z = torch.multinomial(doc_topics, N, replacement=True, generator=g).T  # (N, D)
    words = torch.multinomial(topic_words[z.reshape(-1)], 1, generator=g).reshape(N, D)
    # word ids as floats of the model's dtype (Categorical reads them as integers)
    return ZooData((words.to(dtype),), {"num_topics": K, "vocab": V})


# --------------------------------------------------------------------------- HMM
def hmm_model_1(sequences, lengths, hidden_dim: int = 3):
    """Pyro's ``examples/hmm.py`` ``model_1``: binary tones, a hidden state per time step
    (enumerated), ``pyro.markov`` over time, ``poutine.mask`` past each sequence's length."""
    num_sequences, max_length, data_dim = sequences.shape
    eye = torch.eye(hidden_dim, dtype=sequences.dtype, device=sequences.device)
    probs_x = pyro.sample("probs_x", dist.Dirichlet(0.9 * eye + 0.1).to_event(1))
    probs_y = pyro.sample(
        "probs_y",
        dist.Beta(sequences.new_tensor(0.1), 0.9).expand([hidden_dim, data_dim]).to_event(2),
    )
    tones_plate = pyro.plate("tones", data_dim, dim=-1)
    with pyro.plate("sequences", num_sequences, dim=-2):
        x = 0
        for t in pyro.markov(range(max_length)):
            with poutine.mask(mask=(t < lengths).unsqueeze(-1)):
                x = pyro.sample(
                    f"x_{t}", dist.Categorical(probs_x[x]), infer={"enumerate": "parallel"}
                )
                with tones_plate:
                    pyro.sample(
                        f"y_{t}", dist.Bernoulli(probs_y[x.squeeze(-1)]), obs=sequences[:, t]
                    )


def hmm_data(dtype=torch.float64) -> ZooData:
    """Binary sequences from a sticky 3-state chain, 6 tones, 8 sequences of length <= 12."""
    g = _gen(32)
    S, T, D, H = 8, 12, 6, 3
    trans = torch.full((H, H), 0.1) + 0.7 * torch.eye(H)
    emit = torch.rand(H, D, generator=g) * 0.8 + 0.1
    lengths = torch.randint(6, T + 1, (S,), generator=g)
    seqs = torch.zeros(S, T, D)
    for s in range(S):
        x = 0
        for t in range(int(lengths[s])):
            x = int(torch.multinomial(trans[x], 1, generator=g))
            seqs[s, t] = torch.bernoulli(emit[x], generator=g)
    return ZooData((seqs.to(dtype), lengths))


# --------------------------------------------------------------------------- sparse gamma DEF
SGDEF_WIDTHS = (3, 4, 5)  # top, middle, bottom
ALPHA_Z, BETA_Z, ALPHA_W, BETA_W = 0.1, 0.1, 0.1, 0.3


def sparse_gamma_def(x):
    """Pyro's ``examples/sparse_gamma_def.py``: a three-layer deep exponential family with
    sparse Gamma weights and Gamma latent layers, Poisson counts at the bottom."""
    top, mid, bottom = SGDEF_WIDTHS
    n, d = x.shape
    a_w, b_w = x.new_tensor(ALPHA_W), x.new_tensor(BETA_W)
    with pyro.plate("w_top_plate", top * mid):
        w_top = pyro.sample("w_top", dist.Gamma(a_w, b_w))
    with pyro.plate("w_mid_plate", mid * bottom):
        w_mid = pyro.sample("w_mid", dist.Gamma(a_w, b_w))
    with pyro.plate("w_bottom_plate", bottom * d):
        w_bottom = pyro.sample("w_bottom", dist.Gamma(a_w, b_w))
    a_z, b_z = x.new_tensor(ALPHA_Z), x.new_tensor(BETA_Z)
    with pyro.plate("data", n):
        z_top = pyro.sample("z_top", dist.Gamma(a_z, b_z).expand([top]).to_event(1))
        mean_mid = z_top @ w_top.reshape(top, mid)
        z_mid = pyro.sample("z_mid", dist.Gamma(a_z, b_z / mean_mid).to_event(1))
        mean_bottom = z_mid @ w_mid.reshape(mid, bottom)
        z_bottom = pyro.sample("z_bottom", dist.Gamma(a_z, b_z / mean_bottom).to_event(1))
        mean_obs = z_bottom @ w_bottom.reshape(bottom, d)
        pyro.sample("obs", dist.Poisson(mean_obs).to_event(1), obs=x)


def sparse_gamma_def_guide(x):
    """The example's hand-written mean-field guide: a Gamma per latent with softplus-mapped
    shape and mean parameters (the example also clips them from below after each step)."""
    top, mid, bottom = SGDEF_WIDTHS
    n, d = x.shape
    softplus = torch.nn.functional.softplus

    def init(shape, centre):
        return lambda: centre + 0.1 * torch.randn(shape, dtype=x.dtype, device=x.device)

    def gamma(name, shape):
        alpha = softplus(pyro.param(f"sgdef.alpha_{name}", init(shape, 0.5)))
        mean = softplus(pyro.param(f"sgdef.mean_{name}", init(shape, 0.0)))
        return dist.Gamma(alpha, alpha / mean)

    with pyro.plate("w_top_plate", top * mid):
        pyro.sample("w_top", gamma("w_top", (top * mid,)))
    with pyro.plate("w_mid_plate", mid * bottom):
        pyro.sample("w_mid", gamma("w_mid", (mid * bottom,)))
    with pyro.plate("w_bottom_plate", bottom * d):
        pyro.sample("w_bottom", gamma("w_bottom", (bottom * d,)))
    with pyro.plate("data", n):
        for name, width in (("z_top", top), ("z_mid", mid), ("z_bottom", bottom)):
            pyro.sample(name, gamma(name, (n, width)).to_event(1))


def sparse_gamma_def_data(dtype=torch.float64) -> ZooData:
    """A 20 x 30 count matrix from a two-factor Gamma-Poisson model (sparse-ish counts)."""
    g = _gen(33)
    n, d, k = 20, 30, 2
    u = -torch.rand(n, k, generator=g).log() * 2.0
    v = (torch.rand(k, d, generator=g) < 0.3).float() * (1.0 + 2.0 * torch.rand(k, d, generator=g))
    return ZooData((torch.poisson(u @ v, generator=g).to(dtype),))


ENTRIES = [
    ZooModel(
        "gaussian_mixture",
        gaussian_mixture,
        gaussian_mixture_data,
        "Pyro tutorial: Gaussian mixture model (config_enumerate)",
        has_discrete=True,
        steps=60,
        guide_kwargs={"init_loc_fn": _mixture_init()},
        for_dtype=lambda dtype: (gaussian_mixture, {"init_loc_fn": _mixture_init(dtype)}),
    ),
    ZooModel(
        "lda",
        lda,
        lda_data,
        "Pyro examples/lda.py (small synthetic corpus)",
        has_discrete=True,
        steps=60,
    ),
    ZooModel(
        "hmm",
        hmm_model_1,
        hmm_data,
        "Pyro examples/hmm.py model_1",
        has_discrete=True,
        steps=40,
        guide_kwargs={"schedule": "sequential"},
    ),
    ZooModel(
        "sparse_gamma_def",
        sparse_gamma_def,
        sparse_gamma_def_data,
        "Pyro examples/sparse_gamma_def.py (small synthetic counts)",
        steps=300,
        baselines={"hand_written": lambda model: sparse_gamma_def_guide},
    ),
]
