"""What a blame search found: passes, measured components, per-layer shares, origins, verdict."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..components import layer_of
from ..errors import BlameError
from ..metrics import (BELOW_ZERO, BELOW_ZERO_NOTE, ENGINE_CODE_REPRO, EXPLAINED_NOTE, EXPLAINS, LAYERS_HEAD,
                       NOTHING_RANKED, part)
from ..words import fmt, pct, plural, times

#: A part of the divergence that matters: more than what a replacement that explains it may leave.
#: An origin adds at least this much; the layers holding no origin hold less together, or the
#: drift is diffuse (a fault leaves them at ~0, precision drift adds a little in every layer).
SIGNIFICANT = round(1 - EXPLAINS, 6)
#: More independent origins than this and the drift is called diffuse (the search stops there).
MAX_ORIGINS = 3


def engine_code(module: str) -> str:
    """What a verdict says of a repro of ``module`` when blamed through an engine that runs its own code (vLLM's):
    ``fxreplace repro write`` runs transformers' code with the target's weights, which tells the two apart."""
    return (f"the engine runs its own code there: `fxreplace repro write --component {module}` runs it in transformers' "
            f"code with the target's weights: {ENGINE_CODE_REPRO}")


@dataclass
class Pass:
    """One teacher-forced validation with ``replaced`` (capture names) replaced."""

    replaced: tuple[str, ...]
    mean_kl: float | None
    mean_top5_error: float | None
    top1_agreement: float | None
    prompts_diverged: int
    steps_diverged: int
    first_divergence: int | None  # earliest diverged step over all prompts
    nonfinite: bool  # some prompt's logits held NaN/inf
    round: int  # the batched validation it ran in (hypotheses of one round run side by side)
    seconds: float  # that round's wall time


@dataclass
class Blame:
    """A measured component: the divergence without / with its replacement.

    ``explained``: the fraction of the divergence gone with this component replaced, together
    with ``with_replaced`` (the origins found before it); ``share``: the part it accounts for
    itself (``explained`` minus what ``with_replaced`` alone explains)."""

    component: str
    kind: str
    layer: int | None
    kl_off: float | None
    kl_on: float | None
    top5_off: float | None
    top5_on: float | None
    top1_off: float | None
    top1_on: float | None
    first_divergence_off: int | None
    first_divergence_on: int | None
    prompts_diverged_off: int
    prompts_diverged_on: int
    explained_kl: float | None
    explained_top5: float | None
    explained: float | None  # the smaller of the two
    share: float | None
    with_replaced: list[str] = field(default_factory=list)
    origin: bool = False  # an origin of the divergence (the verdict names it)


@dataclass
class LayerShare:
    """Localisation evidence: the residual stream after ``layer`` replaced (nothing else)."""

    layer: int
    stream: str  # its capture name
    explained: float | None  # of the divergence, with the stream replaced
    share: float | None  # arising in this layer: explained minus the nearest measured layer below (or 0)


@dataclass
class Origin:
    """Where a part of the divergence arises: a component, or the layer itself when none of
    its declared kinds explains that part."""

    layer: int
    # of the whole divergence (beyond the origins found before); None: not measured (a place of a class at fault
    # wherever it runs, left out with its neighbours, see SharedClass.tried)
    share: float | None
    component: str | None
    kind: str | None
    kinds_tried: list[str] = field(default_factory=list)
    beside: list[str] = field(default_factory=list)  # replaced beside it when it was measured: earlier origins, its layer's other guilty kinds
    # of its share, the precision drift arising there (its replacement in the clean model in the target's precision);
    # None: not measured
    drift: float | None = None
    # a layer itself: what no kind spans in it, in words (its own forward, a norm after its MLP); "": not known
    outside: str = ""

    def describe(self, noise: float | None = None) -> str:
        """``noise``: the floor's part of the divergence; the origin's part is then also a multiple of it."""
        scale = f", {times(self.share / noise)} the floor" if noise and self.share is not None else ""
        if self.drift is not None:
            scale += f"; {pct(self.share - self.drift)} beyond the precision drift arising there"
        if self.component is None:
            look = (f"look at what no kind spans there: {self.outside}" if self.outside else
                    "look at the norms or the residual path")
            return (f"layer {self.layer} ({pct(self.share)}{scale}): none of {'/'.join(self.kinds_tried) or 'its kinds'} "
                    f"explains it, alone or together; {look}")
        if layer_of(self.component) is None:  # a feeder of the layer (the embedding): its input, not in it
            return f"{self.kind} {self.component}, the input of layer {self.layer} ({pct(self.share)}{scale})"
        return f"layer {self.layer} {self.kind} {self.component} ({pct(self.share)}{scale})"


@dataclass
class Systematic:
    """One kind at fault in several layers, told by replacing it in all of them at once (one pass): the
    same bug in every layer is code they share (the module's class, its kernel, how it reads the config)."""

    kind: str
    layers: list[int]  # the faulty ones: leaving one out of the kind's replacement leaves a part of the divergence
    components: list[str]  # theirs, in layer order (a repro takes the first)
    where: str  # "every layer", "every MoE layer", "every sliding attention layer", or "layers 1 and 3 (2 of 8)"
    every: bool  # the layers are all those of a group the model declares (all, its MoE layers, a layer type)
    explained: float  # of the divergence: the kind replaced in these layers together (beside the other origins)
    alone: list[float]  # per layer, in ``layers``' order: the part its replacement removes by itself
    left_out: list[float]  # per layer: the part left when it alone is left out of the kind-wide replacement
    kind_wide: float  # of the divergence: the kind replaced in every layer holding it (beside the other origins)
    cover: str = ""  # what replacing the first one spans in its layer ("input_layernorm (LlamaRMSNorm), self_attn (...)")

    def holds(self, origin: "Origin") -> bool:
        """Whether ``origin`` is one of this fault's places (said once, as the fault)."""
        return origin.component in self.components

    @property
    def runs_after(self) -> bool:
        """Whether the fault also acts after the last layer (its words then say what arises there)."""
        return False

    def _each_layer(self) -> str:
        return ", ".join(f"layer {layer} {part(share)}" for layer, share in zip(self.layers, self.alone))

    def describe(self) -> str:
        each = self._each_layer()
        if any(share < 0 for share in self.alone):
            each += f" ({BELOW_ZERO}: fixed alone, that layer makes the target worse: the layers' faults interact)"
        low, high = pct(min(self.left_out)), pct(max(self.left_out))
        return (f"{self.kind} ({_pattern(self.components, self.layers)}) in {self.where}: replacing it in these "
                f"{len(self.layers)} layers together removes {pct(self.explained)} of the divergence (each layer's "
                f"alone: {each}; left out, any one of them leaves {low if low == high else f'{low}-{high}'})")

    def advice(self, repro: bool = True) -> str:
        """Where the fix is: code every layer of the group runs, or what only these layers share. ``repro``:
        whether ``fxreplace repro write`` runs the code blamed (see :func:`engine_code` where it does not)."""
        if self.every:
            spans = (f"what replacing the {self.kind} spans in each layer, {self.cover}: their classes"
                     if self.cover else f"the {self.kind} module's class")
            text = (f"A fault in {self.where} points at code they share ({spans}, kernels, how they read the config), "
                    f"not at one layer's weights")
            if not repro:
                return f"{text}; {engine_code(self.components[0])}."
            text += f"; `fxreplace repro write` takes the first, {self.components[0]}"
            if "), " in self.cover:  # several modules: the repro tells the last from those before it
                text += (": where its module agrees with the reference on the reference's inputs, the fault is in what "
                         "runs before it there")
            return text + "."
        return ("The same kind at fault in some layers only points at what these layers share and the others do not "
                "(their layer type, a per-layer config value), or at each one's weights.")


@dataclass
class SharedClass(Systematic):
    """One class at fault wherever it runs: the covers of several kinds (and of what runs after the last layer)
    run it, and every component replaced to tell it leaves a part of the divergence when left out (an RMSNorm
    every layer's attention and MLP and the final norm run). ``kind`` joins the kinds; ``layers``/``components``
    are those replaced; ``alone`` is not measured (a fault in every place at once is not one place's); ``left_out``
    is per group in ``tried``."""

    classes: list[str] = field(default_factory=list)  # the class, then any other that every one of those covers runs
    instances: list[str] = field(default_factory=list)  # its modules in a layer ("input_layernorm", ...)
    after: list[str] = field(default_factory=list)  # its modules after the last layer ("model.norm"), if any
    whole: float = 1.0  # of the divergence: what arises in the layers (the stream after the last layer replaced)
    member: float = 0.0  # the part a component left out must leave to be at fault (MEMBER, or the floor's part)
    modules: list[str] = field(default_factory=list)  # per class, its first module (qualified): what a repro runs
    # the components left out together, group by group: each alone, or in a deep model a kind's in a few groups of
    # neighbouring layers (one place's part is too small to tell there)
    tried: list[list[str]] = field(default_factory=list)

    @property
    def runs_after(self) -> bool:
        return bool(self.after)

    def describe(self) -> str:
        low, high = pct(min(self.left_out)), pct(max(self.left_out))
        after = f" and, after the last layer, {', '.join(self.after)}" if self.after else ""
        rest = (f" (all that arises in the layers; the rest, {pct(1 - self.whole)}, arises after them, where "
                f"{', '.join(self.after)} runs it too)" if self.after and self.whole < 1 else "")
        leaving, count = sum(part >= self.member for part in self.left_out), len(self.left_out)
        what = (f"the {count}" if count == len(self.components) else
                f"the {count} groups of neighbouring layers' components")
        each = (f"any one of {what} leaves" if leaving == count else
                f"{leaving} of {what} leave at least {pct(self.member)}:")
        return (f"{self.classes[0]}, the class that {self.kind} of {self.where} run ({', '.join(self.instances)}){after}: "
                f"replacing {self.kind} in these {len(self.layers)} layers together removes {pct(self.explained)} of "
                f"the divergence{rest}; left out, {each} {low if low == high else f'{low}-{high}'}")

    def advice(self, repro: bool = True) -> str:
        others = ""
        if len(self.classes) > 1:
            others = (f"; {', '.join(self.classes[1:])} runs in the same places, so replacing cannot tell it from "
                      f"{self.classes[0]}")
        repros = "; ".join(f"`fxreplace repro write --component {module}` runs {cls} alone"
                           for cls, module in zip(self.classes, self.modules))
        then = (f"{repros} (with --blame it takes {self.components[0]}, whose replacement spans {self.cover})" if repro
                else engine_code(self.modules[0]))
        return (f"One class at fault wherever it runs is one bug: fix {self.classes[0]} (its forward, its kernel, how it "
                f"reads the config){others}; {then}.")


@dataclass
class LayerCode(Systematic):
    """The layers' own code at fault in several layers: no kind explains what arises in them, alone or together,
    and nothing in them lies outside the kinds' spans but the layer class's own forward (its residual adds, where
    it applies its norms). ``components`` are the layers' streams; ``alone`` each layer's part of the divergence
    (what its stream adds to the one below); ``cls`` the layer class, ``kinds`` those tried."""

    cls: str = ""
    kinds: list[str] = field(default_factory=list)
    module: str = ""  # the first faulty layer's module: what a repro of one layer runs
    running: list[int] = field(default_factory=list)  # every layer running ``cls``

    def holds(self, origin: "Origin") -> bool:
        return origin.component is None and origin.layer in self.layers

    def describe(self) -> str:
        each = self._each_layer()
        others = [k for k in self.running if k not in self.layers]
        hidden = (f"; {plural(len(others), 'other layer')} run{'s' if len(others) == 1 else ''} it too, adding less, "
                  "which a later layer's code may hide: a norm it applies after the residual erases what an earlier "
                  "layer got wrong" if others else "")
        return (f"the layers' own code ({self.cls}.forward) in {self.where}: no kind ({'/'.join(self.kinds)}) explains "
                f"what arises in them, alone or together (each layer's part: {each}; together they explain "
                f"{pct(self.explained)} of the divergence{hidden})")

    def advice(self, repro: bool = True) -> str:
        then = (f"`fxreplace repro write --component {self.module}` runs one layer alone" if repro
                else engine_code(self.module))
        return (f"A fault in {self.where} outside every kind's span is code they share: {self.cls}.forward itself (its "
                f"residual adds, where it applies its norms, what it hands its submodules), not one layer's weights; "
                f"{then}.")


def _pattern(components: list[str], layers: list[int]) -> str:
    """``model.layers.N.self_attn`` when the components differ only by their layer index, else their names."""
    parts = components[0].split(".")
    for i, part in enumerate(parts):
        spelled = [".".join(parts[:i] + [str(layer)] + parts[i + 1:]) for layer in layers]
        if part == str(layers[0]) and spelled == components:
            return ".".join(parts[:i] + ["N"] + parts[i + 1:])
    return ", ".join(components)


@dataclass
class NonFinite:
    """Where NaN/inf first appear, in forward order: position first, then layer and kind."""

    prompt: int
    position: int  # in the prompt + generated sequence
    step: int | None  # generated step whose logits it feeds (None: inside the prompt's prefill)
    component: str | None  # None: the logits are the first non-finite value observed
    kind: str | None
    layer: int | None

    def describe(self) -> str:
        where = f"prompt {self.prompt}, position {self.position} " + (
            f"(step {self.step})" if self.step is not None else "(in the prompt)")
        if self.component is None:
            return (f"non-finite values (NaN/inf) first appear in the logits, {where}; every declared component is "
                    "finite before them: look at the final norm and lm_head")
        return f"non-finite values (NaN/inf) first appear in {self.component} ({self.kind}, layer {self.layer}), {where}"


@dataclass
class BlameResult:
    ranking: list[Blame]  # components only: the origins first, then the rest, each by share
    layer_shares: list[LayerShare]  # per measured layer: localisation evidence
    origins: list[Origin]
    passes: list[Pass]
    rounds: int
    verdict: str
    confident: bool  # components explain the divergence, each origin named
    diffuse: bool
    nonfinite: NonFinite | None
    kinds: list[str]  # component kinds, in forward order within a layer
    layers: list[int]
    seconds: float
    budget: int  # the most passes the search may run
    budget_spent: bool  # it stopped there
    captured: list[str] = field(default_factory=list)  # components captured on demand from the clean model
    capture_seconds: float = 0.0  # of ``seconds``, spent capturing them
    explained: float | None = None  # of the divergence, by every origin replaced together
    # the noise floor's scale: {"dtype", "multiples" (the target without replacement / the floor, per measure),
    # "within" (precision noise), "noise_share" (the floor's part of the divergence), "floor" (its measures)};
    # None: no floor, no scale
    floor: dict | None = None
    # a target below float32 without a floor: the strongest components beside a diffuse drift, named by the verdict
    # but no origins (no scale tells a fault there from the precision)
    candidates: list[Origin] = field(default_factory=list)
    floor_seconds: float = 0.0  # of ``seconds``, measuring the floor (0 when the reference stored it)
    program: dict = field(default_factory=dict)  # what was examined: {"engine", "compile", "dtype"}
    thresholds: dict = field(default_factory=lambda: {"explains": EXPLAINS, "significant": SIGNIFICANT,
                                                      "max_origins": MAX_ORIGINS})
    # one kind at fault in several layers (its origins come first, in layer order); None: none is
    systematic: Systematic | None = None
    # whether ``fxreplace repro write`` runs the code blamed (the engine ran transformers' code for the checkpoint; else
    # its repro tells the weights from the engine's code)
    repro: bool = True

    @property
    def guilty(self) -> Blame | None:
        """The first origin's component when the verdict is confident."""
        return self.ranking[0] if self.confident else None

    @property
    def origin_layer(self) -> int | None:
        return self.origins[0].layer if self.origins else None

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "confident": self.confident, "diffuse": self.diffuse,
                "origin_layer": self.origin_layer, "origins": [asdict(o) for o in self.origins],
                "candidates": [asdict(o) for o in self.candidates],
                "systematic": asdict(self.systematic) if self.systematic else None,
                "explained": self.explained, "nonfinite": asdict(self.nonfinite) if self.nonfinite else None,
                "passes": len(self.passes), "rounds": self.rounds, "budget": self.budget,
                "budget_spent": self.budget_spent, "captured": self.captured, "seconds": self.seconds,
                "capture_seconds": self.capture_seconds, "noise_floor": self.floor, "floor_seconds": self.floor_seconds,
                "program": self.program, "repro": self.repro,
                "thresholds": self.thresholds, "kinds": self.kinds, "layers": self.layers,
                "ranking": [asdict(b) for b in self.ranking], "layer_shares": [asdict(s) for s in self.layer_shares],
                "pass_log": [asdict(p) for p in self.passes]}

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    def write_report(self, directory: str | Path) -> Path:
        """``blame.json``, ``blame_heatmap.png`` and ``blame.html`` in ``directory``."""
        from ..report import write_blame_report  # reports need matplotlib (the hf extra): loaded to write one

        return write_blame_report(self, directory)

    def table(self, limit: int | None = 12) -> str:
        """The ranking, the per-layer shares and what the columns mean, as text (what ``blame.html``
        shows: no table when nothing was ranked, a part below 0 marked and explained)."""
        lines = []
        if self.ranking:
            head = (f"{'#':>3} {'component':<28} {'kind':<9} {'layer':>5} {'KL off':>9} {'KL on':>9} {'top-5 off':>9} "
                    f"{'top-5 on':>9} {'explained':>9} {'share':>6}  origin")
            lines += [head, "-" * len(head)]
            for i, b in enumerate(self.ranking[:limit], 1):
                lines.append(f"{i:>3} {b.component:<28} {b.kind:<9} {fmt(b.layer):>5} {fmt(b.kl_off):>9} "
                             f"{fmt(b.kl_on):>9} {fmt(b.top5_off):>9} {fmt(b.top5_on):>9} {part(b.explained):>9} "
                             f"{part(b.share):>6}  {'yes' if b.origin else ''}")
            if limit is not None and len(self.ranking) > limit:
                lines.append(f"... {len(self.ranking) - limit} more in blame.html")
            lines.append(EXPLAINED_NOTE)
        else:
            lines.append(NOTHING_RANKED)
        if self.layer_shares:
            lines.append(f"{LAYERS_HEAD}: " + ", ".join(f"{s.layer}: {part(s.share)}" for s in self.layer_shares))
        if self.below_zero():
            lines.append(BELOW_ZERO_NOTE)
        if self.systematic:  # a kind's layers are its first rows; a class's or the layers' own code have their own figures
            head = "(the first rows, in layer order, each replaced alone)" if type(self.systematic) is Systematic else \
                "(its own figures)"
            lines.append(f"systematic {head}: {self.systematic.describe()}")
        lines.append(f"{plural(len(self.passes), 'validation pass')} in {plural(self.rounds, 'round')} (budget {self.budget}), "
                     f"{len(self.captured)} components captured on demand, {self.seconds:.1f} s")
        return "\n".join(lines)

    def below_zero(self) -> bool:
        """Whether a part the reports show (a component's or a layer's explained or share) reads below 0."""
        rows = [*self.ranking, *self.layer_shares]
        parts = [v for row in rows for v in (row.explained, row.share)]
        return any(part(v).endswith(BELOW_ZERO) for v in parts)

