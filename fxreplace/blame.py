"""``fxreplace.blame``: find the component that makes a target drift from its reference.

Every *pass* is one teacher-forced validation (:func:`fxreplace.validation.logit_validation`)
with a set of components replaced by their reference values. The search:

1. one pass with nothing replaced (the divergence to explain);
2. localise the layer: replacing the residual stream after layer ``k`` removes every
   error that arises at or before ``k``, so "does it restore agreement?" is monotone in
   ``k`` and bisection finds the first layer whose stream restores it in O(log L) passes;
3. attribute within that layer: replace each kind (attention, router, experts, ...)
   alone. Kinds are declared in forward order, and replacing a component also hides
   whatever went wrong upstream of it inside its layer (the experts' output carries a
   faulty router's routing), so the *earliest* component that explains the divergence
   is the cause;
4. when no single layer accounts for most of it (diffuse drift, e.g. bf16 rounding
   everywhere), every layer's stream and every component is measured and the report
   says the drift is diffuse instead of naming one component.

Measures are continuous (see :data:`fxreplace.validation.EXPLAINS`): a replacement
*explains* the divergence when it removes at least 90% of both the mean KL and the mean
top-5 log-prob error; a layer is the *origin* when its own share (explained after it
minus explained before it) is at least :data:`CONCENTRATED`. Top-1 agreement, diverged
prompts and first divergences are reported beside them.

Any engine whose ``generate(prompts, max_new_tokens, replace)`` accepts a collection of
capture names to replace works; :func:`blame` builds the embedded runner for an HF
model, :class:`fxreplace.vllm.engine.VllmBlameEngine` serves vLLM.
"""

from __future__ import annotations

import copy
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Collection, Mapping, Sequence

import torch
from torch import nn

from .metrics import DIVERGED, Tolerances
from .targets import Target, TargetLike, resolve_targets
from .validation import EXPLAINS, explained, logit_validation

#: A layer is where the divergence arises when at least this share of it appears there.
CONCENTRATED = 0.5
LAYER = "layer"


@dataclass(frozen=True)
class Component:
    """One candidate: a module's value (``capture_name`` in the reference) of a kind, in a layer."""

    kind: str
    layer: int | None
    module_name: str
    capture_name: str
    target: Target  # the exact module, for instrument()


def layer_of(name: str) -> int | None:
    """The layer index of a qualified name: its first numeric component (``model.layers.3.mlp`` -> 3)."""
    m = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    return int(m.group(1)) if m else None


def resolve_components(model: nn.Module, components: Mapping[str, TargetLike]) -> list[Component]:
    """``{kind: Target}`` (the family's ``components`` or your own, same Target syntax)
    resolved on ``model``, in layer order then the declared kind order."""
    found = []
    for order, (kind, target) in enumerate(components.items()):
        for r in resolve_targets(model, [target]):
            exact = Target(r.module_name, point=r.point, adapter=r.adapter, shard=r.shard, name=r.capture_name)
            found.append((layer_of(r.capture_name), order, Component(kind, layer_of(r.capture_name), r.module_name,
                                                                     r.capture_name, exact)))
    return [c for _, _, c in sorted(found, key=lambda t: (-1 if t[0] is None else t[0], t[1]))]


@dataclass
class Pass:
    """One validation run with ``replaced`` (capture names) replaced."""

    replaced: tuple[str, ...]
    mean_kl: float
    mean_top5_error: float
    top1_agreement: float
    prompts_diverged: int
    steps_diverged: int
    first_divergence: int | None  # earliest diverged step over all prompts
    seconds: float


@dataclass
class Blame:
    """A measured component: its divergence without / with its replacement."""

    component: str
    kind: str
    layer: int | None
    kl_off: float
    kl_on: float
    top5_off: float
    top5_on: float
    top1_off: float
    top1_on: float
    first_divergence_off: int | None
    first_divergence_on: int | None
    prompts_diverged_off: int
    prompts_diverged_on: int
    explained_kl: float | None
    explained_top5: float | None
    explained: float | None  # the smaller of the two
    share: float | None  # what this component accounts for; for a layer's stream: explained minus the layer below's


@dataclass
class BlameResult:
    ranking: list[Blame]  # most to least guilty
    passes: list[Pass]
    verdict: str
    confident: bool  # one component explains the divergence, and it arises in one layer
    diffuse: bool
    origin_layer: int | None
    kinds: list[str]
    layers: list[int]
    seconds: float
    thresholds: dict = field(default_factory=lambda: {"explains": EXPLAINS, "concentrated": CONCENTRATED})

    @property
    def guilty(self) -> Blame | None:
        return self.ranking[0] if self.confident else None

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "confident": self.confident, "diffuse": self.diffuse,
                "origin_layer": self.origin_layer, "passes": len(self.passes), "seconds": self.seconds,
                "thresholds": self.thresholds, "kinds": self.kinds, "layers": self.layers,
                "ranking": [asdict(b) for b in self.ranking], "pass_log": [asdict(p) for p in self.passes]}

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    def write_report(self, directory: str | Path) -> Path:
        """``blame.json``, ``blame_heatmap.png`` and ``blame.html`` in ``directory``."""
        from .report import write_blame_report

        return write_blame_report(self, directory)

    def table(self, limit: int | None = 12) -> str:
        """The ranking as a text table."""
        from .report import fmt

        head = (f"{'#':>3} {'component':<28} {'kind':<10} {'layer':>5} {'KL off':>9} {'KL on':>9} {'top-1 off':>9} "
                f"{'top-1 on':>9} {'1st div off':>11} {'1st div on':>10} {'explained':>9} {'share':>7}")
        lines = [head, "-" * len(head)]
        for i, b in enumerate(self.ranking[:limit], 1):
            lines.append(f"{i:>3} {b.component:<28} {b.kind:<10} {fmt(b.layer):>5} {fmt(b.kl_off):>9} {fmt(b.kl_on):>9} "
                         f"{fmt(b.top1_off):>9} {fmt(b.top1_on):>9} {fmt(b.first_divergence_off):>11} "
                         f"{fmt(b.first_divergence_on):>10} {_pct(b.explained):>9} {_pct(b.share):>7}")
        lines.append(f"{len(self.passes)} validation passes, {self.seconds:.1f} s")
        return "\n".join(lines)


def _pct(v) -> str:
    return "-" if v is None else f"{v:.0%}"


# --------------------------------------------------------------------------- the search


def search(engine, reference, components: Sequence[Component], *, tolerances: Tolerances = Tolerances(),
           prompts: Sequence[int] | None = None, progress: bool = True) -> BlameResult:
    """Bisection over layers, then attribution by kind (see the module docstring).

    ``engine.generate(prompts, n, replace=<capture names>)`` must replace exactly the
    named components; every name in ``components`` must be in the reference.
    """
    missing = [c.capture_name for c in components if c.capture_name not in reference.store.columns]
    if missing:
        raise KeyError(f"the reference holds no captures for components {missing[:4]}; capture them with "
                       f"capture_reference(..., components=...) (`fxreplace capture --components`)")
    if not components:
        raise ValueError("no components to search: give the family's components or your own")
    started = time.perf_counter()
    kinds = list(dict.fromkeys(c.kind for c in components))
    cache: dict[frozenset, tuple[Pass, dict]] = {}
    passes: list[Pass] = []

    def measure(names: Collection[str]) -> tuple[Pass, dict]:
        key = frozenset(names)
        if key not in cache:
            t0 = time.perf_counter()
            result = logit_validation(engine, reference, modes=("on",), replace=key, tolerances=tolerances,
                                      prompts=prompts, progress=False)
            s = result.summary()["on"]
            firsts = [p["first_divergence"] for p in s["prompts"].values() if p["first_divergence"] is not None]
            done = Pass(tuple(sorted(key)), s["mean_kl"], s["mean_top5_error"], s["top1_agreement"], s["prompts_diverged"],
                        s["status_counts"][DIVERGED], min(firsts) if firsts else None, time.perf_counter() - t0)
            passes.append(done)
            cache[key] = (done, s)
            if progress:
                what = ", ".join(done.replaced) if done.replaced else "nothing"
                print(f"  pass {len(passes)}: replaced {what[:70]}: mean KL {done.mean_kl:.3g}, "
                      f"top-1 {done.top1_agreement:.3g} ({done.seconds:.1f} s)")
        return cache[key]

    off, off_summary = measure(())
    layer_streams = {c.layer: c for c in components if c.kind == LAYER and c.layer is not None}
    layers = sorted({c.layer for c in components if c.layer is not None})

    def explained_by(c: Component) -> float | None:
        return explained(off_summary, measure([c.capture_name])[1])["explained"]

    if off.steps_diverged == 0:
        return _result([], passes, "the target does not diverge from the reference (every step within tolerance); "
                       "nothing to blame.", False, False, None, kinds, layers, started)

    origin = None
    stream_layers = sorted(layer_streams)
    if stream_layers:
        lo, hi = 0, len(stream_layers) - 1
        while lo < hi:  # first layer whose stream replacement explains the divergence
            mid = (lo + hi) // 2
            if (explained_by(layer_streams[stream_layers[mid]]) or 0) >= EXPLAINS:
                hi = mid
            else:
                lo = mid + 1
        if (explained_by(layer_streams[stream_layers[lo]]) or 0) >= EXPLAINS:
            origin = stream_layers[lo]

    def share_of_layer(k: int) -> float | None:
        """The part of the divergence that arises in layer k (explained after it minus before it)."""
        below = [j for j in stream_layers if j < k and frozenset([layer_streams[j].capture_name]) in cache]
        after = explained_by(layer_streams[k])
        before = explained_by(layer_streams[below[-1]]) if below else 0.0
        return None if after is None or before is None else after - before

    diffuse = origin is None or (share_of_layer(origin) or 0) < CONCENTRATED
    if diffuse:
        todo = list(components)  # per layer, every kind: where does the drift build up?
    else:
        todo = [c for c in components if c.layer == origin]
    for c in todo:
        measure([c.capture_name])

    ranking = []
    for c in components:
        key = frozenset([c.capture_name])
        if key not in cache:
            continue
        on, on_summary = cache[key]
        e = explained(off_summary, on_summary)
        share = share_of_layer(c.layer) if c.kind == LAYER and c.layer in layer_streams else e["explained"]
        ranking.append(Blame(c.capture_name, c.kind, c.layer, off.mean_kl, on.mean_kl, off.mean_top5_error,
                             on.mean_top5_error, off.top1_agreement, on.top1_agreement, off.first_divergence,
                             on.first_divergence, off.prompts_diverged, on.prompts_diverged, e["kl"], e["top5"],
                             e["explained"], share))

    def rank_key(b: Blame):
        sufficient = (b.share or 0) >= EXPLAINS and not diffuse
        # the earliest component that explains it is the cause; the ones after it only hide it
        return (not sufficient, kinds.index(b.kind) if sufficient else 0, -(b.share if b.share is not None else -1))

    ranking.sort(key=rank_key)
    top = ranking[0] if ranking else None
    confident = not diffuse and top is not None and (top.share or 0) >= EXPLAINS
    verdict = _verdict(top, confident, diffuse, origin, ranking, layer_streams, explained_by, stream_layers)
    return _result(ranking, passes, verdict, confident, diffuse, origin, kinds, layers, started)


def _verdict(top, confident, diffuse, origin, ranking, layer_streams, explained_by, stream_layers) -> str:
    if confident:
        where = (f"the divergence arises in layer {origin} (the residual stream after it restores agreement, "
                 f"{top.share:.0%} of it appears there)")
        if top.kind == LAYER:
            return (f"{where}, but no single declared component of that layer explains it: the cause is inside "
                    f"{top.component} outside its declared components (e.g. a norm).")
        return (f"{top.component} ({top.kind}, layer {top.layer}) is the cause: replacing it removes {top.explained_kl:.0%} "
                f"of the mean KL ({top.kl_off:.3g} -> {top.kl_on:.3g}) and {top.explained_top5:.0%} of the top-5 error; "
                f"{where}.")
    if not diffuse and origin is not None:
        best = ranking[0]
        return (f"the divergence arises in layer {origin}, but no single component explains it (best: {best.component}, "
                f"{_pct(best.explained)}); several components of that layer contribute.")
    shares = ", ".join(f"{k}: {_pct(b.share)}" for k in stream_layers
                       for b in ranking if b.kind == LAYER and b.layer == k)
    last = explained_by(layer_streams[stream_layers[-1]]) if stream_layers else None
    tail = (f" Replacing the stream after the last layer removes {_pct(last)}: the rest arises after the decoder layers "
            "(final norm, lm_head)." if last is not None and last < EXPLAINS else "")
    best = ranking[0] if ranking else None
    return (f"diffuse drift: no single layer or component accounts for the divergence (best single component: "
            f"{best.component if best else '-'}, {_pct(best.share if best else None)}; threshold {EXPLAINS:.0%}); "
            f"share arising per layer: {shares or '-'}.{tail}")


def _result(ranking, passes, verdict, confident, diffuse, origin, kinds, layers, started) -> BlameResult:
    return BlameResult(ranking, passes, verdict, confident, diffuse, origin, kinds, layers,
                       time.perf_counter() - started)


# --------------------------------------------------------------------------- entry point


def family_components(model: nn.Module) -> dict[str, Target]:
    """The components the model's family declares (``fxreplace.models``)."""
    from fxreplace.models import architecture, get_family

    arch = architecture(model.config, type(model).__name__)
    try:
        declared = get_family(arch).components
    except KeyError as exc:
        raise ValueError(f"{exc.args[0]}; pass components={{kind: Target}}") from None
    if not declared:
        raise ValueError(f"the {arch} family declares no components; pass components={{kind: Target}}")
    return dict(declared)


def recorded_components(reference) -> dict[str, dict]:
    """``{capture name: {"kind", "layer"}}`` as capture_reference recorded them."""
    recorded = reference.metadata.get("components")
    if not recorded:
        raise ValueError("the reference records no components: capture it with capture_reference(..., components="
                         "family.components) (`fxreplace capture --components`)")
    return recorded


def blame(target, reference, *, components: Mapping[str, TargetLike] | None = None, dtype: torch.dtype | None = None,
          compile: str | None = None, tolerances: Tolerances = Tolerances(), prompts: Sequence[int] | None = None,
          progress: bool = True) -> BlameResult:
    """Which component of ``target`` makes it drift from ``reference``?

    ``target``: an HF causal LM with the weights under test (it is copied, converted to
    ``dtype`` and instrumented at every component, then run by the embedded
    :class:`~fxreplace.runner.Runner`, compiled with ``compile`` as backend if given), or
    an engine whose ``generate(prompts, n, replace)`` takes capture names and whose
    ``components`` lists what it can replace (e.g.
    :class:`fxreplace.vllm.engine.VllmBlameEngine`). ``reference``: a
    :class:`~fxreplace.reference.Reference` captured with components.
    ``components``: ``{kind: Target}`` for models whose family declares none (an HF
    target only; else the reference's recorded components are used).
    """
    if not isinstance(target, nn.Module):
        return search(target, reference, target.components, tolerances=tolerances, prompts=prompts, progress=progress)
    from .instrument import instrument
    from .replacer import TensorReplacer
    from .runner import Runner, RunnerConfig

    model = copy.deepcopy(target)
    if dtype is not None:
        model = model.to(dtype)
    comps = resolve_components(model, components if components is not None else family_components(model))
    if components is None:  # the family's: search those the reference holds
        comps = [c for c in comps if c.capture_name in reference.store.columns] or comps
    instrument(model, [c.target for c in comps])
    longest = max(len(reference.prompt_tokens(p)) + reference.num_generated(p) for p in range(reference.num_prompts))
    bucket = 1 << (longest - 1).bit_length()
    engine = Runner(model, target.config, replacer=TensorReplacer(reference.store),
                    runner_config=RunnerConfig(prefill_buckets=(bucket,), batch_buckets=(min(8, reference.num_prompts),),
                                               max_len=2 * bucket),
                    dtype=next(model.parameters()).dtype, compile=compile)
    return search(engine, reference, comps, tolerances=tolerances, prompts=prompts, progress=progress)
