"""Logit validation with teacher forcing.

For each prompt the engine generates greedily. At the first step whose top-1
token differs from the reference, the divergence is recorded, the input is
extended with the reference tokens up to and including that step, and the
engine runs again as a *new request* (the context builder resolves it to the
same prompt by prefix), until every reference step has been compared.

Any engine works that offers ``generate(prompts, max_new_tokens, replace) ->
[Generation]`` (see :class:`fxreplace.runner.Runner`); ``Generation.observed``,
when the engine fills it, gives each target's own computed values per position,
from which router agreement is measured.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Collection, Mapping, Protocol, Sequence

import torch

from .context import PerRequest
from .metrics import DIVERGED, MATCHED, WITHIN_TOLERANCE, StepMetrics, Tolerances, compare_logits, topk_agreement
from .reference import Reference


class Engine(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, replace: bool | Collection[str]) -> list: ...


@dataclass(frozen=True)
class StepRecord(StepMetrics):
    """One validated step: its metrics and where it came from."""

    mode: str  # "off" (no replacement) or "on"
    prompt: int
    step: int  # index of the generated token
    round: int  # 0 = first run, n = n-th teacher-forcing retry
    req_id: str


@dataclass
class ValidationResult:
    steps: list[StepRecord] = field(default_factory=list)
    # router agreement: mode -> capture name -> [agreeing positions, compared positions]
    router: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    tolerances: Tolerances = field(default_factory=Tolerances)
    num_prompts: int = 0
    num_steps: int = 0

    @property
    def modes(self) -> list[str]:
        return sorted({s.mode for s in self.steps}, key=["off", "on"].index)

    def table(self, mode: str | None = None) -> list[StepRecord]:
        return [s for s in self.steps if mode is None or s.mode == mode]

    def summary(self) -> dict:
        """Per mode: per-prompt first divergence and counts, plus aggregate figures."""
        out = {}
        for mode in self.modes:
            rows = self.table(mode)
            prompts = {}
            for p in sorted({s.prompt for s in rows}):
                mine = [s for s in rows if s.prompt == p]
                diverged = [s.step for s in mine if not s.top1_agree]
                prompts[p] = {
                    "first_divergence": min(diverged) if diverged else None,
                    "divergences": len(diverged),
                    "retries": max(s.round for s in mine),
                    "nan": any(s.nan for s in mine),
                    "mean_top5_error": _mean([s.top5_error for s in mine]),
                }
            router = self.router.get(mode, {})
            out[mode] = {
                "prompts": prompts,
                "steps": len(rows),
                "top1_agreement": _mean([float(s.top1_agree) for s in rows]),
                "mean_top5_error": _mean([s.top5_error for s in rows]),
                "mean_kl": _mean([s.kl for s in rows]),
                "status_counts": {st: sum(s.status == st for s in rows) for st in (MATCHED, WITHIN_TOLERANCE, DIVERGED)},
                "prompts_diverged": sum(v["first_divergence"] is not None for v in prompts.values()),
                "router_agreement": {m: (a / n if n else None) for m, (a, n) in router.items()},
                "router_agreement_mean": _mean([a / n for a, n in router.values() if n]),
            }
        return out

    def to_json(self) -> str:
        return json.dumps(
            {
                "tolerances": self.tolerances.to_dict(),
                "summary": self.summary(),
                "steps": [asdict(s) for s in self.steps],
            },
            default=_json_default,
        )

    def write_report(self, directory: str | Path) -> Path:
        from .report import write_report

        return write_report(self, directory)


def logit_validation(
    engine: Engine,
    reference: Reference,
    *,
    modes: Sequence[str] = ("off", "on"),
    tolerances: Tolerances = Tolerances(),
    prompts: Sequence[int] | None = None,
    router_topk: int | None = None,
    replace: Collection[str] | Mapping[int, Collection[str]] | None = None,
    progress: bool = True,
) -> ValidationResult:
    """Teacher-forced validation of ``engine`` against ``reference``.

    ``modes``: "off" runs the engine without replacement, "on" with it. ``prompts``
    selects reference prompts (default: all). ``router_topk``: compare each
    target's top-k set (the experts it picks) with the reference's where the
    engine reports what its targets computed. ``replace``: the capture names "on"
    replaces (default: every target of the engine), or ``{prompt: capture names}`` per
    prompt (one engine call serves them all: see :class:`~fxreplace.context.PerRequest`).
    """
    for mode in modes:
        if mode not in ("off", "on"):
            raise ValueError(f"modes must be 'off' and/or 'on', got {mode!r}")
    indices = list(range(reference.num_prompts)) if prompts is None else list(prompts)
    result = ValidationResult(tolerances=tolerances, num_prompts=len(indices))
    from tqdm.auto import tqdm  # the hf extra; `import fxreplace` (blame) imports this module without it

    for mode in modes:
        router = result.router.setdefault(mode, {})
        # per prompt: how many reference steps are covered, and whether we stopped on NaN
        covered = {p: 0 for p in indices}
        stopped: set[int] = set()
        rounds = 0
        bar = tqdm(total=sum(reference.num_generated(p) for p in indices), desc=f"validate ({mode})", disable=not progress)
        while True:
            todo = [p for p in indices if p not in stopped and covered[p] < reference.num_generated(p)]
            if not todo:
                break
            # one wave per round; prompts needing the same number of steps could share a call, but
            # each call already batches every prompt still running
            inputs = [reference.prompt_tokens(p) + reference.tokens(p)[: covered[p]] for p in todo]
            max_new = max(reference.num_generated(p) - covered[p] for p in todo)
            if replace is None or mode == "off":
                selection = mode == "on"
            else:
                selection = PerRequest(replace[p] for p in todo) if isinstance(replace, Mapping) else replace
            gens = engine.generate(inputs, max_new, replace=selection)
            for p, gen in zip(todo, gens):
                start = covered[p]
                ref_logits = reference.logits(p)
                for j, logits in enumerate(gen.logits[: reference.num_generated(p) - start]):
                    step = start + j
                    m = compare_logits(ref_logits[step], logits, tolerances)
                    result.steps.append(StepRecord(**asdict(m), mode=mode, prompt=p, step=step, round=rounds, req_id=gen.req_id))
                    bar.update(1)
                    covered[p] = step + 1
                    if m.nan:
                        stopped.add(p)
                        break
                    if not m.top1_agree:
                        break
                if router_topk and getattr(gen, "observed", None):
                    _router_agreement(router, reference, p, gen, start, covered[p], router_topk)
            rounds += 1
        bar.close()
    result.num_steps = len(result.steps)
    return result


#: A replacement *explains* a divergence when it removes at least EXPLAINS of both the mean
#: KL(reference || target) and the mean top-5 log-prob error; it *contributes* from CONTRIBUTES.
#: Counts of diverged prompts and top-1 agreement are reported beside them but decide nothing:
#: one flipped near-tie keeps a prompt "diverged" while the error itself shrinks 18-fold.
EXPLAINS, CONTRIBUTES = 0.9, 0.25


def explained(off: dict, on: dict) -> dict:
    """The fraction of ``off``'s divergence that replacement removes (one mode's
    :meth:`ValidationResult.summary` each): ``{"kl", "top5", "explained"}``, the last
    the smaller of the two (None when ``off`` has no error to remove)."""

    def removed(key):
        before, after = off[key], on[key]
        if before is None or after is None or before <= 0:
            return None
        return max(0.0, 1.0 - after / before)

    kl, top5 = removed("mean_kl"), removed("mean_top5_error")
    known = [v for v in (kl, top5) if v is not None]
    return {"kl": kl, "top5": top5, "explained": min(known) if known else None}


def verdict(off: dict, on: dict, what: str = "the replaced tensors") -> str:
    """One sentence on whether replacing ``what`` removes the divergence, from the
    continuous measures (see :data:`EXPLAINS`)."""
    if off["status_counts"][DIVERGED] == 0:
        return "the target did not diverge even without replacement; nothing to isolate here."
    e = explained(off, on)
    figures = (f"replacing {what} removes {e['kl']:.0%} of the mean KL ({off['mean_kl']:.3g} -> {on['mean_kl']:.3g}) "
               f"and {e['top5']:.0%} of the mean top-5 error; diverged prompts {off['prompts_diverged']} -> "
               f"{on['prompts_diverged']}, top-1 agreement {off['top1_agreement']:.3g} -> {on['top1_agreement']:.3g}")
    if e["explained"] is not None and e["explained"] >= EXPLAINS:
        return f"{figures}: they explain the divergence (>= {EXPLAINS:.0%} of both removed)."
    if e["explained"] is not None and e["explained"] >= CONTRIBUTES:
        return (f"{figures}: they are part of the cause (>= {CONTRIBUTES:.0%} of both removed); the rest arises "
                "elsewhere: `fxreplace blame` searches for it.")
    return (f"{figures}: they are not the cause (< {CONTRIBUTES:.0%} of the error removed); look elsewhere: "
            "`fxreplace blame` searches layer by layer.")


def _router_agreement(router, reference: Reference, p: int, gen, start: int, covered: int, k: int) -> None:
    """Count positions where the target's own top-k matches the reference's.

    Step s is computed from the input at position L + s - 1, so this round's
    steps start..covered-1 read positions up to L + covered - 2, all holding
    reference tokens; positions before L + start were counted in earlier rounds.
    """
    prompt_len = len(reference.prompt_tokens(p))
    first = 0 if start == 0 else prompt_len + start - 1
    last = prompt_len + covered - 2
    for name, per_position in gen.observed.items():
        if name not in reference.store.columns:
            continue
        rows = reference.store.rows(p, name)
        positions = sorted(pos for pos in per_position if first <= pos <= min(last, rows.shape[0] - 1))
        if not positions:
            continue
        target = torch.stack([per_position[pos] for pos in positions])
        agree = topk_agreement(rows[positions], target, k)
        counts = router.setdefault(name, [0, 0])
        counts[0] += int(agree.sum())
        counts[1] += len(positions)


def _mean(values) -> float | None:
    values = [v for v in values if v == v]  # drop NaN
    return sum(values) / len(values) if values else None


def _json_default(obj):
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    raise TypeError(type(obj))
