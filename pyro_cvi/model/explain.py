"""``guide.explain()``: one line per (factor, latent or block) pair of an
:class:`~pyro_cvi.model.analysis.Analysis`, with the kind CVI gives it and why."""

from __future__ import annotations

from .records import REMAINDER, SITE

__all__ = ["explain"]


def explain(an) -> str:
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
            lines.extend(f.describe() for f in block.factors)
            continue
        fam = info.family.name if info.family is not None else "conditional prior"
        why = f"; {an.fallback[name]}" if name in an.fallback else ""
        lines.append(f"# {name}: q = {fam} ({info.form} form{why})")
        lines.extend(f.describe() for f in info.factors)
    for name in sorted(an.collapsed - an.remainder_discrete, key=list(an.values).index):
        lines.append(f"# {name}: no q, summed out exactly (discrete='collapse')")
    for name in sorted(an.remainder_discrete, key=list(an.values).index):
        lines.append(f"# {name}: no q, summed out exactly in the remainder's log joint")
    if an.remainder:
        summed = sorted(an.remainder_discrete, key=list(an.values).index)
        also = f"; summed out: {', '.join(summed)}" if summed else ""
        lines.append(
            f"# remainder: q = one joint Gaussian on the unconstrained values of "
            f"{', '.join(an.remainder)} (natural-gradient steps{also})"
        )
        lines.extend(f.describe() for f in an.remainder_factors)
    return "\n".join(lines)
