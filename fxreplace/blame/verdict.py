"""The blame verdict's wording: what the search found, said once for the CLI, the reports and
:class:`~fxreplace.blame.result.BlameResult`."""

from __future__ import annotations

from ..metrics import EXPLAINS
from ..words import pct
from .result import MAX_ORIGINS, SIGNIFICANT, Systematic


def verdict_text(origins, together, diffuse, spread, spent, budget, ranking, shares, after_layers, noise=None,
             drifts=False, drift=(), within=False, candidates=(), systematic: Systematic | None = None,
             after_modules: str = "", repro: bool = True) -> str:
    """The blame verdict; ``noise``: the floor's part of the divergence (None: no floor); ``drifts``: the
    target is below float32; ``drift``: the parts it replaced on its way that precision drift may explain;
    ``within``: the target as a whole is within its floor; ``candidates``: without a floor, the strongest
    components beside a diffuse drift; ``systematic``: one kind at fault in several layers (its origins first);
    ``after_modules``: what runs after the last layer ("model.norm (LlamaRMSNorm), lm_head (Linear)"); ``repro``:
    whether ``fxreplace repro write`` runs the code blamed (the engine ran transformers' code)."""
    tail = ""
    if drift:
        scale = ("the floor's part" if noise is not None else
                 "what the strongest component leaves: below float32 without a noise floor they cannot be told from "
                 "precision drift")
        tail = (f" Not named, as they stand no higher than {scale}: "
                + "; ".join(o.describe(noise) for o in drift) + ".")
    ran_after = systematic is not None and systematic.runs_after  # its words say what arises after the layers
    after_place = (after_layers is not None and after_layers < EXPLAINS and not diffuse and (noise is None or drifts)
                   and not ran_after)
    after_words = after_modules or "the final norm, lm_head"
    if after_place and not origins:
        tail += (f" Replacing the stream after the last layer removes {pct(after_layers)}: the rest arises after the "
                 f"decoder layers ({after_words}).")
    if diffuse:
        return _diffuse_verdict(origins, spread, shares, after_layers, noise, drifts, candidates)
    if spent:
        found = "; ".join(o.describe(noise) for o in origins) or "nothing yet"
        return f"the search stopped at its budget of {budget} passes; found so far: {found}."
    if not origins:
        return ("no layer's residual stream explains a significant part of the divergence (threshold "
                f"{SIGNIFICANT:.0%})." + tail)
    # a systematic kind's layers are one source: the same fault; the others stand by themselves
    rest = [o for o in origins if not (systematic and systematic.holds(o))]
    sources = len(rest) + (systematic is not None) + bool(after_place)  # what arises after the layers: a place too
    independent = len({o.layer for o in rest}) == len(rest)
    if systematic and not rest and not after_place:
        some = "1 kind at fault" if type(systematic) is Systematic else "1 fault"  # (a class, the layers' own code)
        count = "1 systematic fault" if systematic.every else f"{some} in {len(systematic.layers)} layers"
    else:  # a layer's guilty kinds are found together: not independent
        count = "1 source" if sources == 1 else f"{sources} {'independent ' if independent else ''}sources"
    if noise is not None and all(o.drift is not None for o in origins):  # told from the clean model's own drift
        count += " standing out from the precision drift arising in it" if len(origins) == 1 else \
            " standing out from the precision drift arising in them"
    elif within:  # the target as a whole within its floor, yet this part is more than the precision causes
        count += " the precision noise does not explain"
    elif noise is not None:
        count += " above the precision floor"
    named = ([systematic.describe()] if systematic else []) + [o.describe(noise) for o in rest]
    if after_place:  # a place of its own: beside origins in the layers it is no sign of drift in float32
        named.append(f"after the last layer, {after_words} ({pct(1 - after_layers)}: what the stream after the last "
                     "layer does not remove)")
    text = f"{count}: " + "; ".join(named)
    if together is not None and after_place:
        text += (f"; replacing {'those' if len(origins) > 1 else 'the one'} in the layers removes {pct(together)} of "
                 "the divergence")
    elif together is not None and (rest or not systematic):
        text += f"; together they explain {pct(together)} of the divergence" if len(origins) > 1 else \
            f"; replacing it removes {pct(together)} of the divergence"
    if len(origins) == 1 and origins[0].component:
        top = next(b for b in ranking if b.component == origins[0].component)
        text += (f" (mean KL {top.kl_off:.3g} -> {top.kl_on:.3g}, {pct(top.explained_kl)} of the KL and "
                 f"{pct(top.explained_top5)} of the top-5 error)")
    if noise is not None:
        text += (f"; precision noise at the floor: {pct(noise)} of the divergence (the reference in the target's "
                 "precision diverges that much by itself)")
    elif together is not None and together < EXPLAINS and not tail and not drifts and not ran_after and not after_place:
        text += f"; the remaining {pct(1 - together)} arises in no single layer (each adds less than {SIGNIFICANT:.0%})"
    return text + "." + (" " + systematic.advice(repro) if systematic else "") + tail


def _diffuse_verdict(origins, spread, shares, after_layers, noise, drifts, candidates) -> str:
    """The verdict of a diffuse drift: where it builds up, and why no few components are its fix."""
    per_layer = ", ".join(f"{s.layer}: {pct(s.share)}" for s in shares) or "-"
    if drifts:
        if len(origins) > MAX_ORIGINS:
            why = f"more than {MAX_ORIGINS} places would each have to be fixed"
        elif noise is not None:
            why = (f"no layer adds a part larger than the floor's ({pct(noise)} of the divergence), so none can be told "
                   "from precision noise")
        elif candidates:
            inside, after = spread
            named = "; ".join(o.describe() for o in candidates)
            why = (f"the strongest components ({named}) leave {pct(inside + after)} of it to the other layers "
                   f"({pct(inside)}) and after the last layer ({pct(after)}), as precision drift does; without a noise "
                   "floor a fault there cannot be told from the precision")
        else:
            why = ("no component removes more of it than it leaves, so none can be told from precision drift without "
                   "a noise floor")
        beyond = " beyond the floor" if noise is not None else ""
        return (f"diffuse drift{beyond}: the divergence builds up across the layers, not in a few components: "
                f"{why}; share arising per layer: {per_layer}.")
    if after_layers is not None:
        per_layer += f", after the last layer: {pct(1 - after_layers)}"
    inside, after = spread
    # the origins' layers by their streams' shares: the same accounting as the other layers'
    by_layer = {s.layer: s.share for s in shares}
    parts = "; ".join(f"layer {o.layer}{' (' + o.kind + ')' if o.kind else ''}: {pct(by_layer.get(o.layer, o.share))}"
                      for o in origins)
    if len(origins) > MAX_ORIGINS:
        why = f"more than {MAX_ORIGINS} places would each have to be fixed ({parts})"
    else:
        why = (f"the layers with the largest parts ({parts}) leave {pct(inside + after)} of it to the other layers "
               f"({pct(inside)}) and after the last layer ({pct(after)}), where a fault leaves ~0 (concentrated "
               f"sources leave less than {SIGNIFICANT:.0%}): fixing those components alone would not remove it")
    return (f"diffuse drift: the divergence builds up across the layers, not in a few components: {why}; share "
            f"arising per layer: {per_layer}.")
