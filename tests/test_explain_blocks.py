"""``guide.explain()`` per block: each block reports (``Block.incoming``) which factors send it
exact expected messages, which Monte Carlo expected messages and which CVI sites; the lines
name the right factors on zoo models of every kind of block."""

import pyro
import pytest
import torch
from test_expected_natural import _rate_data, _rate_model
from zoo import ZOO

from pyro_cvi import CVI, CVI_ELBO, AutoCVI

RULES = ("exact expected", "Monte Carlo expected", "sites")


def _blocks_section(text):
    """``{latent: {rule: {factors}}}`` and the block labels, from the per-block section."""
    lines = text.split("\n")
    start = lines.index("# blocks: incoming messages (Algorithm 2, eq. 20; sites: Algorithm 1)")
    out, labels = {}, []
    for line in lines[start + 1 :]:
        if line.startswith("# block "):
            labels.append(line[len("# block ") : -1])
            continue
        latent, rest = line[len("#   ") :].split(": ", 1)
        rules = {}
        for part in rest.split("; "):
            rule, sites = part.split(" from ")
            assert rule in RULES
            rules[rule] = set() if sites == "-" else set(sites.split(", "))
        out[latent] = rules
    return out, labels


def _explain(model, data, **kw):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoCVI(model, **kw)
    pyro.infer.SVI(model, guide, CVI(), CVI_ELBO()).step(*data.args, **data.kwargs)
    section, labels = _blocks_section(guide.explain())
    assert labels == [b.label for b in guide.engine.blocks]
    return section


def _zoo(name):
    entry = ZOO[name]
    model, kw = entry.build(torch.float64)
    return _explain(model, entry.data(torch.float64), **kw)


def test_lda_blocks():
    got = _zoo("lda")
    # Dirichlet(topic_weights) is affine in the weights: exact expected for doc_topics
    assert got["doc_topics"] == {
        "exact expected": {"doc_topics", "word_topics"},
        "Monte Carlo expected": set(),
        "sites": set(),
    }
    # ... and not conjugate to the weights: their Monte Carlo gradient
    assert got["topic_weights"]["sites"] == {"doc_topics"}
    assert got["topic_weights"]["exact expected"] == {"topic_weights"}
    assert got["topic_words"]["exact expected"] == {"topic_words", "doc_words"}
    assert got["word_topics"]["exact expected"] == {"word_topics", "doc_words"}


def test_sparse_gamma_def_blocks():
    """``rate = b / (z @ w)``: no closed form, and the model does not broadcast over a particle
    plate (``w.reshape``), so the factor's Monte Carlo gradient serves."""
    got = _zoo("sparse_gamma_def")
    assert got["z_mid"] == {
        "exact expected": set(),
        "Monte Carlo expected": set(),
        "sites": {"z_mid", "z_bottom"},
    }
    assert got["w_bottom"] == {
        "exact expected": {"w_bottom"},
        "Monte Carlo expected": set(),
        "sites": {"obs"},
    }


def test_gaussian_block_and_remainder():
    got = _zoo("bayesian_regression")
    # a Uniform scale: E_q[1/sigma^2] by Monte Carlo (messages/scale_expected.py)
    assert got["a, bA, bR, bAR"] == {
        "exact expected": {"a", "bA", "bR", "bAR"},
        "Monte Carlo expected": {"obs"},
        "sites": set(),
    }
    assert got["remainder(sigma)"]["sites"] == {"obs", "sigma"}
    assert not got["remainder(sigma)"]["exact expected"]
    assert not got["remainder(sigma)"]["Monte Carlo expected"]


def test_conjugate_natural_block():
    got = _zoo("coin")
    assert got["latent_fairness"]["exact expected"] == {"latent_fairness", "obs"}
    assert not got["latent_fairness"]["sites"]


@pytest.mark.parametrize("vectorize", [True, False])
def test_monte_carlo_expected(vectorize):
    """``rate = b / (u1 + u2)``: Monte Carlo expected (the model broadcasts over a particle
    plate, whatever ``vectorize_particles`` says of the Monte Carlo gradients); the parents get
    the factor's Monte Carlo gradient."""
    y = _rate_data(torch.float64)

    class Data:
        args, kwargs = (y,), {}

    got = _explain(_rate_model, Data, vectorize_particles=vectorize)
    assert got["z"] == {"exact expected": {"y"}, "Monte Carlo expected": {"z"}, "sites": set()}
    assert got["u1"]["sites"] == {"z"}
    assert got["u2"]["sites"] == {"z"}


def test_precision_beside_the_remainder():
    """The BNN's Gamma noise precision: the Normal likelihood's expected natural parameter
    averaged over draws of the network (Monte Carlo expected), not a site of the remainder."""
    got = _zoo("bnn")
    assert got["prec_obs"] == {
        "exact expected": {"prec_obs"},
        "Monte Carlo expected": {"obs"},
        "sites": set(),
    }
    (rem,) = [k for k in got if k.startswith("remainder(")]
    assert "obs" in got[rem]["sites"]
    assert not got[rem]["exact expected"] and not got[rem]["Monte Carlo expected"]
