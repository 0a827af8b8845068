"""``guide.explain()``: one line per (factor, latent or block) pair of an
:class:`~pyro_cvi.model.analysis.Analysis`, with the kind CVI gives it and why, and for each
block the message rule of Algorithm 2 (eq. 20, with Algorithm 1's sites) its factors follow:

* *exact expected*: conjugate to the block given its other arguments, the expectations it needs
  in closed form under the neighbours' ``q`` (the expected natural parameter, VMP);
* *Monte Carlo expected*: conjugate, the same expected natural parameter averaged over draws of
  the neighbours;
* *sites*: not conjugate: CVI sites (quadrature for linear predictors, Bonnet/Price or the
  one-draw step, Monte Carlo gradients of the expected log-density).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .discrete_glm import summed_glm_hint
from .records import (
    COLLAPSED,
    CONJUGATE,
    CONJUGATE_ENUM,
    CONJUGATE_MC,
    CONJUGATE_PRIOR,
    CONJUGATE_SCALE,
    CONJUGATE_SCALE_MC,
    GENERAL,
    LINEAR,
    LINEAR_ENUM,
    NATGRAD,
    PRIOR,
    REMAINDER,
    SITE,
    SOFTMAX,
)

__all__ = ["EXACT", "MESSAGE_RULES", "MONTE_CARLO", "SITES", "explain", "message_rules"]

EXACT, MONTE_CARLO, SITES = "exact expected", "Monte Carlo expected", "sites"

#: the message rule of each factor kind (kinds not listed send no message: leaves, constants)
MESSAGE_RULES: Dict[str, str] = {
    PRIOR: EXACT,
    CONJUGATE: EXACT,
    CONJUGATE_ENUM: EXACT,
    CONJUGATE_MC: MONTE_CARLO,
    CONJUGATE_PRIOR: EXACT,
    CONJUGATE_SCALE: EXACT,
    CONJUGATE_SCALE_MC: MONTE_CARLO,
    LINEAR: SITES,
    LINEAR_ENUM: SITES,
    SOFTMAX: SITES,
    GENERAL: SITES,
    NATGRAD: SITES,
    COLLAPSED: SITES,
}


def _rules_line(pairs: Sequence[Tuple[str, str]], lead: str = "#   messages: ") -> str:
    by: Dict[str, List[str]] = {EXACT: [], MONTE_CARLO: [], SITES: []}
    for site, rule in pairs:
        if site not in by[rule]:
            by[rule].append(site)
    parts = [f"{rule} from {', '.join(sites) or '-'}" for rule, sites in by.items()]
    return lead + "; ".join(parts)


def message_rules(factors, told: Optional[Dict[Tuple[str, str], str]] = None) -> str:
    """``#   messages: exact expected from a, b; Monte Carlo expected from -; sites from y``;
    ``told``: ``{(factor, latent): rule}`` as the blocks report them (over the records' kinds)."""
    told = told or {}
    pairs = []
    for f in factors:
        rule = told.get((f.site, f.latent), MESSAGE_RULES.get(f.kind))
        if rule is not None:
            pairs.append((f.site, rule))
    return _rules_line(pairs)


def blocks_section(an, blocks: Sequence) -> List[str]:
    """For each block (the engine's, in order), the messages it receives, latent by latent,
    as the block reports them (``Block.incoming``)."""
    lines = ["# blocks: incoming messages (Algorithm 2, eq. 20; sites: Algorithm 1)"]
    for block in blocks:
        lines.append(f"# block {block.label}:")
        by: Dict[str, List[Tuple[str, str]]] = {}
        for item in block.incoming(an):
            by.setdefault(item.latent, []).append((item.factor, item.rule))
        for latent, pairs in by.items():
            lines.append(_rules_line(pairs, f"#   {latent}: "))
    return lines


def explain(an, blocks: Optional[Sequence] = None) -> str:
    """The analysis's classification, one line per (factor, latent or block) pair; with the
    engine's ``blocks``, each latent's message rules as its block reports them, and a section
    of every block's incoming messages."""
    told, notes = {}, {}
    for block in blocks or ():
        for item in block.incoming(an):
            told[(item.factor, item.latent)] = item.rule
            if getattr(item, "note", None) is not None:
                notes[(item.factor, item.latent)] = item.note

    def describe(f) -> str:
        note = notes.get((f.site, f.latent))
        if note is None:
            return f.describe()
        return f"{f.site:>20s} -> {f.latent:<12s} {note[0]:<17s} {note[1]}"

    lines = [f"{'factor':>20s}    {'latent':<12s} {'kind':<17s} why"]
    done = set()
    for name, info in an.latents.items():
        if info.form == REMAINDER:
            continue
        if info.form == SITE:
            if info.block in done:
                continue
            done.add(info.block)
            block = an.blocks[info.block]
            what = "gaussian" if len(block.names) == 1 else f"joint gaussian, D={block.dim}"
            if block.chain is not None:
                what = f"Markov gaussian chain, {block.chain.size_text}"
            lines.append(f"# {block.label}: q = {what} (site form)")
            lines.append(message_rules(block.factors, told))
            lines.extend(f.describe() for f in block.factors)
            continue
        fam = info.family.name if info.family is not None else "conditional prior"
        why = f"; {an.fallback[name]}" if name in an.fallback else ""
        lines.append(f"# {name}: q = {fam} ({info.form} form{why})")
        if info.factors:
            lines.append(message_rules(info.factors, told))
        lines.extend(describe(f) for f in info.factors)
    for name in sorted(an.collapsed - an.remainder_discrete, key=list(an.values).index):
        why = getattr(an, "summed_why", {}).get(name, "discrete='collapse'")
        lines.append(f"# {name}: no q, summed out exactly as TraceEnum_ELBO does ({why})")
    for name in sorted(an.remainder_discrete, key=list(an.values).index):
        why = f" ({an.summed_why[name]})" if name in getattr(an, "summed_why", {}) else ""
        why = why or summed_glm_hint(an, name)
        lines.append(f"# {name}: no q, summed out exactly in the remainder's log joint{why}")
    if an.remainder:
        summed = sorted(an.remainder_discrete, key=list(an.values).index)
        also = f"; summed out: {', '.join(summed)}" if summed else ""
        lines.append(
            f"# remainder: q = one joint Gaussian on the unconstrained values of "
            f"{', '.join(an.remainder)} (natural-gradient steps{also})"
        )
        lines.append(message_rules(an.remainder_factors, told))
        lines.extend(f.describe() for f in an.remainder_factors)
    if blocks:
        lines.extend(blocks_section(an, blocks))
    return "\n".join(lines)
