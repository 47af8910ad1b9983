"""Per-step logit comparison between a reference and a target model."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .words import fmt, pct, plural, times

MATCHED, WITHIN_TOLERANCE, DIVERGED = "matched", "within_tolerance", "diverged"
#: Which forward computed a step's logits: a request's prefill (its first step) or a decode step with the KV cache.
PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class Tolerances:
    """When a step counts as matched / within tolerance / diverged.

    Errors are absolute differences of log-probabilities over the reference's top-k
    tokens. A step is *diverged* when the top-1 token differs or any error exceeds
    its tolerance, *matched* when the top-1 agrees and the top-5 error is at most
    ``match_atol`` (numerically the same model), and *within tolerance* otherwise.
    Defaults suit a bf16 target against an fp32 reference.
    """

    match_atol: float = 1e-4
    top5_atol: float = 0.1
    top50_atol: float = 0.5
    kl_max: float = 0.05

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepMetrics:
    top1_agree: bool
    reference_token: int
    target_token: int
    top5_error: float
    top50_error: float
    kl: float
    nan: bool
    status: str


def compare_logits(reference: torch.Tensor, target: torch.Tensor, tol: Tolerances = Tolerances()) -> StepMetrics:
    """Compare one step's ``[vocab]`` logits (any float dtype; computed in fp64)."""
    _same_shape(reference, target)
    return compare_steps(reference[None], target[None], tol)[0]


#: rows of ``[steps, vocab]`` compared at once: a chunk's fp64 temporaries stay ~tens of MiB at
#: a 150k vocabulary, however many copies x steps a blame round compares
COMPARE_CHUNK_ROWS = 32


def compare_steps(reference: torch.Tensor, target: torch.Tensor, tol: Tolerances = Tolerances()) -> list[StepMetrics]:
    """:func:`compare_logits` for each row of ``[steps, vocab]`` logits, as tensor operations over
    chunks of :data:`COMPARE_CHUNK_ROWS` rows (a blame round compares every step of every copy of
    the prompts: at once, fp64 copies of all of them would outweigh the model); the errors are read
    at the reference's top 50 only (a top-k, not a sort of the vocabulary)."""
    _same_shape(reference, target)
    out = []
    for start in range(0, reference.shape[0], COMPARE_CHUNK_ROWS):
        out += _compare_chunk(reference[start : start + COMPARE_CHUNK_ROWS], target[start : start + COMPARE_CHUNK_ROWS], tol)
    return out


def _compare_chunk(reference: torch.Tensor, target: torch.Tensor, tol: Tolerances) -> list[StepMetrics]:
    ref = torch.log_softmax(reference.double(), -1)
    tgt = torch.log_softmax(target.double(), -1)
    ref_tokens, tgt_tokens = reference.argmax(-1).tolist(), target.argmax(-1).tolist()
    nans = torch.isnan(target).any(-1).tolist()
    order = ref.topk(min(50, ref.shape[-1]), dim=-1).indices
    errors = (ref.gather(-1, order) - tgt.gather(-1, order)).abs()
    top5s, top50s = errors[:, :5].amax(-1).tolist(), errors.amax(-1).tolist()
    tgt.neg_().add_(ref)  # ref - tgt, in place: one fp64 chunk fewer
    kls = (ref.exp_().mul_(tgt)).sum(-1).clamp(min=0).tolist()
    out = []
    for ref_token, tgt_token, nan, top5, top50, kl in zip(ref_tokens, tgt_tokens, nans, top5s, top50s, kls):
        if nan:
            out.append(StepMetrics(False, ref_token, -1, float("nan"), float("nan"), float("nan"), True, DIVERGED))
            continue
        agree = ref_token == tgt_token
        if not agree or top5 > tol.top5_atol or top50 > tol.top50_atol or kl > tol.kl_max:
            status = DIVERGED
        elif top5 <= tol.match_atol:
            status = MATCHED
        else:
            status = WITHIN_TOLERANCE
        out.append(StepMetrics(agree, ref_token, tgt_token, top5, top50, kl, False, status))
    return out


def _same_shape(reference: torch.Tensor, target: torch.Tensor) -> None:
    if reference.shape != target.shape:
        raise ValueError(f"reference logits {tuple(reference.shape)} and target logits {tuple(target.shape)} differ in shape "
                         "(is the reference from another model?)")


def topk_agreement(reference: torch.Tensor, target: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, whether the sets of the top-k indices agree (the experts a router picks)."""
    ref = reference.float().topk(k, dim=-1).indices.sort(-1).values
    tgt = target.float().topk(k, dim=-1).indices.sort(-1).values
    return (ref == tgt).all(-1)


#: A divergence is confined to one phase only when that phase's mean top-5 error is at least
#: PHASE_CONTRAST times the other phase's largest: a precision drift (bf16) alone leaves both alike,
#: and one prefill step per prompt within tolerance beside a few diverged decode steps says nothing.
PHASE_CONTRAST = 10.0


def phase_counts(steps) -> dict:
    """Per phase of the ``steps`` (each with ``phase``, ``status``, ``top5_error``, ``nan``):
    ``{"steps", "diverged", "mean_top5_error", "max_top5_error"}`` (NaN logits count as an infinite error)."""
    out = {}
    for phase in dict.fromkeys(s.phase for s in steps):
        errors = [float("inf") if s.nan else s.top5_error for s in steps if s.phase == phase]
        out[phase] = {"steps": len(errors), "diverged": sum(s.status == DIVERGED for s in steps if s.phase == phase),
                      "mean_top5_error": sum(errors) / len(errors), "max_top5_error": max(errors)}
    return out


def diverging_phase(phases: dict) -> str | None:
    """The one phase whose steps diverge while no step of the other does, by far (``decode``: the
    prefill matches and only decode diverges, or the reverse; see :data:`PHASE_CONTRAST`); None
    when both or neither do, or when the two phases' errors are alike."""
    if set(phases) != {PREFILL, DECODE}:
        return None
    diverged = [p for p in (PREFILL, DECODE) if phases[p]["diverged"]]
    if len(diverged) != 1:
        return None
    other = DECODE if diverged[0] == PREFILL else PREFILL
    far = phases[diverged[0]]["mean_top5_error"] >= PHASE_CONTRAST * phases[other]["max_top5_error"]
    return diverged[0] if far else None


#: What a divergence confined to one phase says about where the fault is.
PHASE_MEANING = {
    DECODE: "a fault that arises only in decode, with the KV cache (the positions of cached tokens, the cached keys "
            "and values, the window): a forward without a cache does not show it",
    PREFILL: "a fault that arises only in the prefill (the prompt at once), or one the decode steps do not reach (an "
             "expert none of their tokens is routed to)",
}


def phase_clue(mode_summary: dict) -> str:
    """One sentence naming, per prompt of one mode's validation summary, those whose prefill steps
    match while only their decode steps diverge, or the reverse ("" when no prompt is so): the clue
    to a fault in incremental decoding. Validation's verdict says it; blame's can (its summaries
    are validation summaries)."""
    parts = []
    for phase, other in ((DECODE, PREFILL), (PREFILL, DECODE)):
        prompts = {p: s["phases"] for p, s in mode_summary["prompts"].items() if s.get("diverges_in") == phase}
        if not prompts:
            continue
        matching = [ph[other] for ph in prompts.values()]
        diverging = [ph[phase] for ph in prompts.values()]
        total = sum(ph["steps"] for ph in diverging)
        mean = sum(ph["mean_top5_error"] * ph["steps"] for ph in diverging) / total
        parts.append(f"on {plural(len(prompts), 'prompt')} ({', '.join(map(str, prompts))}) the {other} steps match "
                     f"({sum(ph['steps'] for ph in matching)} steps, top-5 error at most "
                     f"{max(ph['max_top5_error'] for ph in matching):.3g}) and only the {phase} steps diverge "
                     f"({sum(ph['diverged'] for ph in diverging)} of {total}, mean top-5 error {mean:.3g}): "
                     f"{PHASE_MEANING[phase]}")
    if not parts:
        return ""
    text = "; ".join(parts) + "."
    return text[0].upper() + text[1:]


#: A replacement *explains* a divergence when it removes at least EXPLAINS of both the mean
#: KL(reference || target) and the mean top-5 log-prob error; it *contributes* from CONTRIBUTES.
#: Counts of diverged prompts and top-1 agreement are reported beside them but decide nothing:
#: one flipped near-tie keeps a prompt "diverged" while the error itself shrinks 18-fold.
EXPLAINS, CONTRIBUTES = 0.9, 0.25

#: What a validation can conclude (:attr:`Verdict.outcome`). With both modes: the target
#: did not diverge at all, or replacing the tensors explains / contributes to / does not
#: cause its divergence, or makes a target that did not diverge diverge (a reference that is
#: not this model in full precision); with one mode: it passed or diverged.
NO_DIVERGENCE, EXPLAINED, CONTRIBUTES_TO, NOT_THE_CAUSE, PASSED, WORSE = (
    "no_divergence", "explained", "contributes", "not_the_cause", "passed", "replacement_worse")


def explained(off: dict, on: dict, signed: bool = False) -> dict:
    """The fraction of ``off``'s divergence that replacement removes (one mode's
    validation summary each): ``{"kl", "top5", "explained"}``, the last the smaller
    of the two (None when ``off`` has no error to remove). A replacement that makes the
    target worse removes nothing (0), or with ``signed`` reads below 0 by how much worse
    (what the reports show: e.g. one layer of interacting faults fixed alone)."""

    def removed(key):
        before, after = off[key], on[key]
        if before is None or after is None or before <= 0:
            return None
        change = 1.0 - after / before
        return change if signed else max(0.0, change)

    kl, top5 = removed("mean_kl"), removed("mean_top5_error")
    known = [v for v in (kl, top5) if v is not None]
    return {"kl": kl, "top5": top5, "explained": min(known) if known else None}


@dataclass(frozen=True)
class Verdict:
    """What a validation concludes: ``outcome`` (one of the constants above) for programs,
    ``sentence`` for people (the line the CLI prints, the top of report.html)."""

    outcome: str
    sentence: str
    explained: float | None = None  # the smaller of explained_kl and explained_top5
    explained_kl: float | None = None
    explained_top5: float | None = None
    # the target without replacement as multiples of the noise floor (None: no floor, no scale)
    floor_multiples: dict | None = None
    within_floor: bool | None = None

    def __str__(self) -> str:
        return self.sentence

    def to_dict(self) -> dict:
        return asdict(self)


def verdict(summary: dict, what: str = "the replaced tensors", floor=None, unscaled: str = "") -> Verdict:
    """The verdict on one validation summary (per mode, as ``ValidationResult.summary()``):
    with modes "off" and "on", whether replacing ``what`` removes the divergence (from the
    continuous measures, see :data:`EXPLAINS`); with one mode, whether the target diverged.
    ``floor`` (a :class:`fxreplace.floor.NoiseFloor`) gives the divergence its scale: the
    target without replacement as a multiple of the floor, within precision noise or beyond;
    without one, ``unscaled`` says that the verdict has no scale and how to get one."""
    scale = _scale(summary.get("off"), floor, unscaled)
    if set(summary) != {"off", "on"}:
        mode, s = next(iter(summary.items()))
        label = "without" if mode == "off" else "with"
        figures = (f"{label} replacement the target diverges on {s['prompts_diverged']} of {len(s['prompts'])} prompts "
                   f"(top-1 agreement {s['top1_agreement']:.3g}, mean KL {s['mean_kl']:.3g})")
        if s["status_counts"][DIVERGED]:
            return Verdict(DIVERGED, f"{figures}: it diverged from the reference{scale['text']}.", **scale["fields"])
        return Verdict(PASSED, f"{figures}: every step is within tolerance{scale['text']}.", **scale["fields"])
    off, on = summary["off"], summary["on"]
    change = (f"mean KL {fmt(off['mean_kl'])} -> {fmt(on['mean_kl'])}, diverged prompts {off['prompts_diverged']} -> "
              f"{on['prompts_diverged']}")
    if off["status_counts"][DIVERGED] == 0:
        if on["status_counts"][DIVERGED] and _worse(off, on, both=False):
            return Verdict(WORSE, f"replacing {what} makes the target worse: without replacement every step is within "
                           f"tolerance, with it the target diverges ({change}); the replaced tensors do not fit this "
                           "model: is the reference captured from these weights, in float32?", **scale["fields"])
        return Verdict(NO_DIVERGENCE, "the target did not diverge even without replacement; nothing to isolate "
                       f"here{scale['text']}.", **scale["fields"])
    e = explained(off, on)
    numbers = dict(explained=e["explained"], explained_kl=e["kl"], explained_top5=e["top5"], **scale["fields"])
    figures = (f"replacing {what} removes {pct(e['kl'])} of the mean KL ({off['mean_kl']:.3g} -> {on['mean_kl']:.3g}) "
               f"and {pct(e['top5'])} of the mean top-5 error; diverged prompts {off['prompts_diverged']} -> "
               f"{on['prompts_diverged']}, top-1 agreement {off['top1_agreement']:.3g} -> {on['top1_agreement']:.3g}")
    if e["explained"] is not None and e["explained"] >= EXPLAINS:
        return Verdict(EXPLAINED, f"{figures}: they explain the divergence (>= {EXPLAINS:.0%} of both removed)"
                       f"{scale['text']}.", **numbers)
    if e["explained"] is not None and e["explained"] >= CONTRIBUTES:
        return Verdict(CONTRIBUTES_TO, f"{figures}: they are part of the cause (>= {CONTRIBUTES:.0%} of both removed); "
                       f"the rest arises elsewhere: `fxreplace blame` searches for it{scale['text']}.", **numbers)
    worse = _worse(off, on)
    if worse:
        return Verdict(WORSE, f"{figures}: replacing {what} makes the target worse ({worse}); the replaced tensors do "
                       f"not fit this model: is the reference captured from these weights, in float32?{scale['text']}",
                       **numbers)
    return Verdict(NOT_THE_CAUSE, f"{figures}: they are not the cause (< {CONTRIBUTES:.0%} of the error removed); look "
                   f"elsewhere: `fxreplace blame` searches layer by layer{scale['text']}.", **numbers)




def no_scale(dtype: str | None) -> str:
    """What a verdict without a floor says: it has no scale, and how to get one."""
    return (f"no scale: how much of this divergence {dtype} rounding alone causes is not known (no noise floor); "
            f"capture the reference with `--noise-floor {dtype}`, or give the clean model (`--clean MODEL`), to measure it")


def _scale(off: dict | None, floor, unscaled: str) -> dict:
    """The verdict's scale: the target without replacement against the floor, or that it has none."""
    if off is None or floor is None:
        return {"text": f"; {unscaled}" if unscaled and off is not None else "", "fields": {}}
    return {"text": f"; without replacement the target is {floor.describe(off)}",
            "fields": {"floor_multiples": floor.multiples(off), "within_floor": floor.within(off)}}


def _worse(off: dict, on: dict, both: bool = True) -> str:
    """How replacement made the target worse (both measures grew by over 10%, or either with
    ``both=False``), or '': a near-tie flipping while the measures fall is no worse."""
    grew = [(label, off[key], on[key]) for key, label in (("mean_kl", "mean KL"), ("mean_top5_error", "mean top-5 error"))
            if off[key] is not None and on[key] is not None and on[key] > off[key] * 1.1]
    return ", ".join(f"{label} {a:.3g} -> {b:.3g}" for label, a, b in grew) if len(grew) >= (2 if both else 1) else ""








#: The mark of a part below zero (a blame share or explained part), and what it means: the
#: tables, the heat map and the pages show it with this note, never a bare "-5%".
BELOW_ZERO = "*"
BELOW_ZERO_NOTE = ("* below 0: with it replaced more of the divergence remained than without it (for a layer's "
                   "stream: than with the stream before it replaced); replacing it made the target worse by that "
                   "part, so it explains none of the divergence")


def part(v) -> str:
    """:func:`pct` of a part of the divergence, marked with :data:`BELOW_ZERO` where it is below 0."""
    text = pct(v)
    return text + BELOW_ZERO if v is not None and text.startswith("-") else text


#: What the ranking's columns mean and its order, under the table.
EXPLAINED_NOTE = ("explained: the part of the divergence gone with the component replaced (the smaller of the mean KL "
                  "and the mean top-5 error removed; with the origins above it replaced too); share: the part it "
                  "accounts for itself. Order: the origins first, then the rest, each by share.")
#: Said instead of an empty ranking.
NOTHING_RANKED = "no component ranked: none was measured alone (the verdict says why)"
#: What a repro tells after a blame through an engine that runs its own code (vLLM's): ``fxreplace repro write``
#: runs transformers' code with the target's weights, not the code blamed (the verdict's advice and the CLI's
#: ``next:`` line both say it).
ENGINE_CODE_REPRO = ("where it agrees with the reference the fault is in the engine's own code for it (compare its class, "
                     "kernels and weight loading with transformers'), where it disagrees in the weights (their conversion)")
#: The per-layer shares' heading.
LAYERS_HEAD = "arising per layer (the residual stream after the layer replaced)"
