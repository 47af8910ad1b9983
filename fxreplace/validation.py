"""Logit validation with teacher forcing.

For each prompt the engine generates greedily. At the first step whose top-1
token differs from the reference, the divergence is recorded, the input is
extended with the reference tokens up to and including that step, and the
engine runs again as a *new request* (the context builder resolves it to the
same prompt by prefix), until every reference step has been compared. An engine
whose ``teacher_forcing`` is true instead reads the reference's tokens in its
decode steps (``generate(..., forced=)``), so one call compares every step; each
step is recorded as the re-run after the prompt's earlier divergences would record it.

Any engine works that offers ``generate(prompts, max_new_tokens, replace) ->
[Generation]`` (:class:`fxreplace.engines.protocol.Engine`); ``Generation.observed``,
when the engine fills it, gives each target's own computed values per position,
from which router agreement is measured.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Collection, Mapping, Sequence

import torch

from .context import PerRequest
from .dtypes import is_full_precision
from .engines.protocol import Engine, check_engine
from .metrics import (DECODE, DIVERGED, MATCHED, PREFILL, WITHIN_TOLERANCE, StepMetrics, Tolerances, Verdict,
                      compare_steps, diverging_phase, no_scale, phase_clue, phase_counts, topk_agreement, verdict)
from .reference import Reference


@dataclass(frozen=True)
class StepRecord(StepMetrics):
    """One validated step: its metrics and where it came from."""

    mode: str  # "off" (no replacement) or "on"
    prompt: int
    step: int  # index of the generated token
    round: int  # 0 = first run, n = n-th teacher-forcing retry
    req_id: str
    phase: str  # PREFILL: the request's first step (its prompt's prefill computed it), else DECODE


@dataclass
class ValidationResult:
    steps: list[StepRecord] = field(default_factory=list)
    # router agreement: mode -> capture name -> [agreeing positions, compared positions]
    router: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    tolerances: Tolerances = field(default_factory=Tolerances)
    num_prompts: int = 0
    num_steps: int = 0
    prompt_texts: dict[int, str | None] = field(default_factory=dict)  # per prompt, when given as text
    token_texts: dict[int, str] = field(default_factory=dict)  # decoded tokens at the first divergences
    replaced: str = "the targets"  # what mode "on" replaces, in the verdict's words
    floor: "NoiseFloor | None" = None  # the reference in the target's precision (fxreplace.floor): the verdict's scale
    # the program validated: {"engine", "compile", "dtype"}; blame examines the same one
    program: dict = field(default_factory=dict)
    caveat: str = ""  # what the verdict must say first (a reference below float32 accepted)
    gate: dict | None = None  # the --fail-on outcome when one was checked (:meth:`Gate.outcome`)

    @property
    def verdict(self) -> Verdict:
        """What this validation concludes (:func:`fxreplace.metrics.verdict`)."""
        dtype = self.program.get("dtype")
        unscaled = no_scale(dtype) if dtype and not is_full_precision(dtype) else ""
        summary = self.summary()
        found = verdict(summary, self.replaced, self.floor, unscaled)
        # where the target as it runs (without replacement, else the one mode) diverges: prefill or decode only
        clue = phase_clue(summary.get("off") or next(iter(summary.values())))
        sentence = " ".join(x for x in (f"{self.caveat}." if self.caveat else "", found.sentence, clue) if x)
        return dataclasses.replace(found, sentence=sentence)

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
                diverged = [s for s in mine if not s.top1_agree]
                first = min(diverged, key=lambda s: s.step) if diverged else None
                phases = phase_counts(mine)
                prompts[p] = {
                    "first_divergence": first.step if first else None,
                    "divergences": len(diverged),
                    "retries": max(s.round for s in mine),
                    "nan": any(s.nan for s in mine),
                    "mean_top5_error": _mean([s.top5_error for s in mine]),
                    "mean_kl": _mean([s.kl for s in mine]),
                    # the tokens at the first divergence: what the reference and the target picked
                    "tokens_at_divergence": [first.reference_token, first.target_token] if first else None,
                    # per phase (prefill, decode): steps, diverged steps, top-5 errors; the one phase that alone diverges
                    "phases": phases,
                    "diverges_in": diverging_phase(phases),
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
                "verdict": self.verdict.to_dict(),
                "program": self.program,
                "noise_floor": self.floor.to_dict() if self.floor else None,
                "gate": self.gate,
                "tolerances": self.tolerances.to_dict(),
                "prompt_texts": self.prompt_texts,
                "token_texts": self.token_texts,
                "summary": self.summary(),
                "steps": [asdict(s) for s in self.steps],
            },
            default=_json_default,
        )

    def write_report(self, directory: str | Path) -> Path:
        from .report import write_report  # reports need matplotlib (the hf extra): loaded to write one

        return write_report(self, directory)


@dataclass(frozen=True)
class Gate:
    """A pass/fail rule for CI, checked on the target *without* replacement (mode "off": the
    compiled model as it runs). Per prompt: ``diverged`` fails a prompt whose top-1 token differs
    from the reference at any step (or gives NaN), ``kl`` one whose mean KL exceeds it, ``top5``
    one whose mean top-5 log-prob error exceeds it. ``floor=K`` fails the validation when a measure
    that counts (:meth:`fxreplace.floor.NoiseFloor.counted`: mean KL, mean top-5 error, and the first
    divergence where the floor diverged) over every validated prompt exceeds K times its noise floor's:
    the measures and the scale the verdict states and blame searches on, so the three agree (the
    validation needs a floor: :mod:`fxreplace.floor`)."""

    diverged: bool = False
    kl: float | None = None
    top5: float | None = None
    floor: float | None = None

    @classmethod
    def parse(cls, conditions: Sequence[str]) -> "Gate":
        """``["diverged", "kl=0.05", "top5=0.1"]`` (the CLI's ``--fail-on``); ValueError names a bad one."""
        fields: dict = {}
        for condition in conditions:
            key, sep, value = condition.partition("=")
            if key == "diverged" and not sep:
                fields["diverged"] = True
            elif key in ("kl", "top5", "floor") and sep:
                try:
                    fields[key] = float(value)
                except ValueError:
                    raise ValueError(f"{condition!r}: {key}= needs a number, e.g. {key}=0.05") from None
            else:
                raise ValueError(f"{condition!r}: expected diverged, kl=X, top5=Y or floor=K")
        return cls(**fields)

    def failures(self, result: ValidationResult) -> dict[int, list[str]]:
        """Per validated prompt, why it fails the per-prompt conditions (an empty list: it passes)."""
        out = {}
        for p, s in self._off(result)["prompts"].items():
            reasons = []
            if self.diverged and s["nan"]:
                reasons.append("NaN logits")
            elif self.diverged and s["first_divergence"] is not None:
                reasons.append(f"diverged at step {s['first_divergence']}")
            if self.kl is not None and (s["mean_kl"] is None or s["mean_kl"] > self.kl):
                reasons.append(f"mean KL {_fmt(s['mean_kl'])} > {self.kl:g}")
            if self.top5 is not None and (s["mean_top5_error"] is None or s["mean_top5_error"] > self.top5):
                reasons.append(f"mean top-5 error {_fmt(s['mean_top5_error'])} > {self.top5:g}")
            out[p] = reasons
        return out

    def overall(self, result: ValidationResult) -> list[str]:
        """Why the validation as a whole fails the gate (``floor=K``, on the verdict's scale), or nothing."""
        if self.floor is None:
            return []
        summary = self._off(result)
        labels = {"kl": "mean KL {}x the floor", "top5": "mean top-5 error {}x the floor",
                  "first_divergence": "first divergence {}x sooner"}
        # the measures the verdict and blame count (NoiseFloor.counted), on the scale they state
        above = [labels[key].format(_fmt(m)) for key, m in result.floor.beyond(summary, self.floor).items()]
        return [f"{', '.join(above)} > {self.floor:g}x over the {len(summary['prompts'])} validated prompts"] if above else []

    def outcome(self, result: ValidationResult, conditions: Sequence[str]) -> dict:
        """The gate's result as reports record it: the conditions, whether it passed, and why not."""
        prompts = {p: reasons for p, reasons in self.failures(result).items() if reasons}
        overall = self.overall(result)
        return {"conditions": list(conditions), "passed": not prompts and not overall, "overall": overall,
                "prompts": prompts}

    def describe(self, outcome: dict, num_prompts: int) -> str:
        """One line: "gate passed (--fail-on ...)" or what failed."""
        flags = " ".join(outcome["conditions"])
        if outcome["passed"]:
            return f"gate passed (--fail-on {flags}): every prompt" + (", and the whole on the floor's scale"
                                                                      if self.floor is not None else "")
        parts = list(outcome["overall"])
        if outcome["prompts"]:
            parts.append(f"{len(outcome['prompts'])} of {num_prompts} prompts: " + "; ".join(
                f"prompt {p}: {', '.join(r)}" for p, r in list(outcome["prompts"].items())[:5]))
        return f"gate failed (--fail-on {flags}): " + "; ".join(parts)

    def _off(self, result: ValidationResult) -> dict:
        summary = result.summary().get("off")
        if summary is None:
            raise ValueError("the gate checks the target without replacement: validate with mode 'off'")
        if self.floor is not None and result.floor is None:
            raise ValueError(f"floor={self.floor:g} needs the noise floor, and this validation has none")
        return summary


def logit_validation(
    engine: Engine,
    reference: Reference,
    *,
    modes: Sequence[str] = ("off", "on"),
    tolerances: Tolerances = Tolerances(),
    prompts: Sequence[int] | None = None,
    router_topk: int | None = None,
    replace: Collection[str] | Mapping[int, Collection[str]] | None = None,
    tokenizer=None,
    progress: bool = True,
) -> ValidationResult:
    """Teacher-forced validation of ``engine`` against ``reference``.

    ``modes``: "off" runs the engine without replacement, "on" with it. ``prompts``
    selects reference prompts (default: all). ``router_topk``: compare each
    target's top-k set (the experts it picks) with the reference's where the
    engine reports what its targets computed. ``replace``: the capture names "on"
    replaces (default: every target of the engine), or ``{prompt: capture names}`` per
    prompt (one engine call serves them all: see :class:`~fxreplace.context.PerRequest`).
    ``tokenizer`` (the checkpoint's) decodes the tokens at each first divergence for the reports.

    With ``progress``, a bar counts validated steps, and while the engine works on a
    call (a compile, a long wave) a line says so at least every :data:`HEARTBEAT_S` seconds.
    """
    check_engine(engine, "logit_validation's engine")
    for mode in modes:
        if mode not in ("off", "on"):
            raise ValueError(f"modes must be 'off' and/or 'on', got {mode!r}")
    indices = list(range(reference.num_prompts)) if prompts is None else list(prompts)
    texts = reference.metadata.get("prompt_texts") or [None] * reference.num_prompts
    result = ValidationResult(tolerances=tolerances, num_prompts=len(indices), prompt_texts={p: texts[p] for p in indices})
    for mode in modes:
        _validate_mode(engine, reference, result, mode, indices, replace, tolerances, router_topk, progress)
    result.num_steps = len(result.steps)
    if tokenizer is not None:
        at_divergence = {t for s in result.steps if not s.top1_agree and not s.nan for t in (s.reference_token, s.target_token)}
        result.token_texts = {t: tokenizer.decode([t]) for t in sorted(at_divergence)}
    return result


def _validate_mode(engine: Engine, reference: Reference, result: ValidationResult, mode: str, indices: list[int],
                   replace, tolerances: Tolerances, router_topk: int | None, progress: bool) -> None:
    """One mode's rounds of :func:`logit_validation`, recorded into ``result``: every prompt still
    running in one engine call, until each covers the reference's steps or stops on NaN."""
    from tqdm.auto import tqdm  # the hf extra; `import fxreplace` (blame) imports this module without it

    router = result.router.setdefault(mode, {})
    # per prompt: how many reference steps are covered, and whether we stopped on NaN
    covered = {p: 0 for p in indices}
    stopped: set[int] = set()
    rounds = 0
    # smoothing=0: the rate is the average since the bar (re)started, which leaves out the first call's compile
    bar = tqdm(total=sum(reference.num_generated(p) for p in indices), desc=f"validate ({mode})", disable=not progress,
               smoothing=0)
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
        doing = f"round {rounds}: {len(todo)} prompts, up to {max_new} steps"
        if rounds == 0:
            doing += "; a compiled engine compiles during its first call"
        forcing = engine.teacher_forcing
        forced = {"forced": [reference.tokens(p)[covered[p]:] for p in todo]} if forcing else {}
        with heartbeat(lambda line: bar.write(f"  {bar.desc}: {line}", file=sys.stderr), progress, doing):
            gens = engine.generate(inputs, max_new, replace=selection, **forced)
        spans = [(p, gen, covered[p], min(len(gen.logits), reference.num_generated(p) - covered[p]))
                 for p, gen in zip(todo, gens)]
        for (p, gen, start, _), compared in zip(spans, _compare(reference, spans, tolerances)):
            retry = rounds  # forced steps after a divergence count as the retry that would compute them
            for j, m in enumerate(compared):
                step = start + j
                phase = PREFILL if j == 0 else DECODE  # a request's first step: its prefill computed it
                result.steps.append(StepRecord(**vars(m), mode=mode, prompt=p, step=step, round=retry, req_id=gen.req_id,
                                               phase=phase))
                covered[p] = step + 1
                if m.nan:
                    stopped.add(p)
                    break
                if not m.top1_agree:
                    if not forcing:
                        break
                    retry += 1
            if router_topk and getattr(gen, "observed", None):
                _router_agreement(router, reference, p, gen, start, covered[p], router_topk)
        _advance(bar, sum(covered.values()), first_call=rounds == 0)
        rounds += 1
    bar.close()


def _advance(bar, done: int, first_call: bool) -> None:
    """Move the progress bar to ``done`` steps; after the first call, which compiles, the ETA is timed from
    the calls after it."""
    if first_call:
        bar.reset()
        bar.initial = bar.n = done
        bar.refresh()
    else:
        bar.update(done - bar.n)


def _compare(reference: Reference, spans, tolerances: Tolerances) -> list[list[StepMetrics]]:
    """Per ``(prompt, generation, first step, steps)`` of one engine call, its steps' metrics (the steps
    after a divergence are read only when the engine forced them); prompt by prompt, so a blame
    round's logits are never copied into one tensor beside the generations holding them."""
    return [compare_steps(reference.logits(p)[start : start + n], torch.stack(gen.logits[:n]), tolerances) if n else []
            for p, gen, start, n in spans]


#: Longest stretch without a progress line while the engine works (a compile takes 10-60 s).
HEARTBEAT_S = 10.0


@contextmanager
def heartbeat(write: Callable[[str], None], enabled: bool, doing: str):
    """While the engine runs one call, ``write`` every HEARTBEAT_S seconds that it still works
    and for how long: its first calls compile, and a slow machine must not look hung."""
    if not enabled:
        yield
        return
    started, done = time.perf_counter(), threading.Event()

    def beat():
        while not done.wait(HEARTBEAT_S):
            write(f"engine busy for {time.perf_counter() - started:.0f} s ({doing})")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


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


def _fmt(value: float | None) -> str:
    return "NaN" if value is None else f"{value:.3g}"


def _mean(values) -> float | None:
    values = [v for v in values if v == v]  # drop NaN
    return sum(values) / len(values) if values else None


def _json_default(obj):
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    raise TypeError(type(obj))
