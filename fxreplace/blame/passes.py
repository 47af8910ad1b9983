"""Measuring a blame search's passes: one teacher-forced validation per selection of replaced
components, the passes of a round side by side as copies of the prompts, each measured once.

:class:`Passes` holds a search's state (the components by layer and kind, the passes measured, the
budget); :mod:`fxreplace.blame.drift`, :mod:`fxreplace.blame.systematic` and :mod:`fxreplace.blame.search`
build on it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Collection, Mapping, Sequence

from ..components import LAYER
from ..metrics import DIVERGED, EXPLAINS, Tolerances, explained
from ..validation import ValidationResult, heartbeat, logit_validation
from ..words import fmt
from ..covers import Cover
from .result import MAX_ORIGINS, SIGNIFICANT, LayerShare, Origin, Pass, Systematic

#: streams probed per localisation round. A round costs a batch of copies, not a pass each, so wide
#: rounds are cheap and rounds are what costs: 8 narrow 16 layers to 2 (32 to 4) in the first round, and
#: the second decides between them with their kinds beside (two rounds for one fault)
PROBES = 8


def default_budget(layers: int, kinds: int, probes: int = PROBES) -> int:
    """Passes enough for MAX_ORIGINS + 1 origins (each localised twice: after the last origin, then
    from the first layer; its kinds tried twice: alone, then above the stream below; then together)
    plus the diffuse heat map. Kinds carried by a localisation round fit in its probes + 1 passes, no more
    than its probes and one layer's kinds. A systematic fault's passes (its kind everywhere, each layer
    alone and left out) fit in what it leaves: it stops the search early and needs no heat map."""
    localise = probes * max(1, math.ceil(math.log(max(layers, 2), probes + 1)))
    together = kinds * (kinds - 1) // 2 + 1  # a layer's kinds tried together: the pairs, then all
    return 1 + (MAX_ORIGINS + 1) * (2 * (localise + kinds) + together + 1) + layers * (kinds + 1)


class BudgetSpent(Exception):
    pass


class _Copies:
    """``copies`` times the reference prompts ``indices``: prompt ``i`` is ``indices[i % len(indices)]``."""

    def __init__(self, reference, indices: Sequence[int], copies: int):
        self.reference, self.indices, self.store = reference, list(indices), reference.store
        self.num_prompts = copies * len(self.indices)

    def _p(self, i: int) -> int:
        return self.indices[i % len(self.indices)]

    def prompt_tokens(self, i):
        return self.reference.prompt_tokens(self._p(i))

    def num_generated(self, i):
        return self.reference.num_generated(self._p(i))

    def tokens(self, i):
        return self.reference.tokens(self._p(i))

    def logits(self, i):
        return self.reference.logits(self._p(i))

    @property
    def metadata(self) -> dict:
        """The reference's metadata with its per-prompt texts laid out as the copies."""
        texts = self.reference.metadata.get("prompt_texts")
        return {**self.reference.metadata,
                "prompt_texts": texts and [texts[self._p(i)] for i in range(self.num_prompts)]}


class Passes:
    """One search's state: the passes measured (by selection), rounds, budget."""

    def __init__(self, engine, reference, components, *, tolerances: Tolerances, prompts: Sequence[int],
                 budget: int | None, probes: int, progress: bool, supply: Callable[[Collection[str]], None] | None,
                 observe: Callable | None, floor=None, unscaled: str = "", batch_rows: int | None = None,
                 drift_of: Callable[[list[str]], dict[str, float]] | None = None,
                 layer_types: Sequence[str] | None = None, covers: Mapping[str, Cover] | None = None):
        self.engine, self.reference, self.components = engine, reference, list(components)
        # what each component's replacement spans (fxreplace.covers; empty for an engine's model): the verdict's words
        self.covers = dict(covers or {})
        # the model's kind of each layer (config.layer_types: "sliding_attention", ...): names the layers a systematic
        # fault holds the way the model groups them
        self.layer_types = list(layer_types) if layer_types else None
        self.systematic: Systematic | None = None
        # the noise floor (fxreplace.floor): what exceeds it is attributed, what it explains is precision noise
        self.floor, self.unscaled = floor, unscaled
        # a target below float32 drifts by itself: a part of its divergence may be precision drift, not a fault
        self.drifts = floor is not None or bool(unscaled)
        self.drift: list[Origin] = []  # parts the search replaced on its way that precision drift may explain
        self.candidates: list[Origin] = []  # without a floor: the strongest components beside a diffuse drift
        # with the clean model: the part of the floor each component's replacement removes in the clean model itself
        self.drift_of = drift_of
        self.noise = 0.0  # the floor's part of the divergence: set once the target without replacement is measured
        self.significant = SIGNIFICANT  # the least part an origin adds: SIGNIFICANT, or the floor's part when larger
        self.tolerances, self.indices, self.progress = tolerances, list(prompts), progress
        self.probes, self.supply, self.observe = probes, supply, observe
        self.streams = {c.layer: c for c in self.components if c.kind == LAYER and c.layer is not None}
        self.stream_layer = {c.capture_name: layer for layer, c in self.streams.items()}
        self.by_name = {c.capture_name: c for c in self.components}
        # components outside the layers listed before them (resolve_components' order): their output feeds
        # the first layer (the embedding), so they are candidates of its part, and any stream covers them
        first = next((i for i, c in enumerate(self.components) if c.layer is not None), 0)
        self.feeders = [c for c in self.components[:first] if c.kind != LAYER]
        self.layer_of = {c.capture_name: c.layer for c in self.components} | {c.capture_name: -1 for c in self.feeders}
        self.stream_layers = sorted(self.streams)
        self.kinds = list(dict.fromkeys(c.kind for c in self.components if c.kind != LAYER and c not in self.feeders))
        self.layers = sorted({c.layer for c in self.components if c.layer is not None})
        self.budget = budget if budget is not None else default_budget(len(self.layers), len(self.kinds), probes)
        self.cache: dict[frozenset, tuple[Pass, dict]] = {}
        self.passes: list[Pass] = []
        self.rounds = 0
        self.batched = engine.per_request_selection
        # requests the engine runs in one batch: a round's passes side by side up to it cost about one pass
        self.batch_rows = (batch_rows or len(self.indices) * (probes + 1)) if self.batched else len(self.indices)

    def key(self, selection: Collection[str]) -> frozenset:
        """The selection as measured: replacing the stream after layer ``k`` discards everything
        computed at or before ``k``, so components of those layers beside it change nothing
        (their pass is the stream's alone)."""
        names = frozenset(selection)
        covered = max((self.stream_layer[n] for n in names if n in self.stream_layer), default=None)
        if covered is None:
            return names
        return frozenset(n for n in names if self.layer_of.get(n) is None or self.layer_of[n] > covered
                         or n == self.streams[covered].capture_name)

    def _replaced(self, origins) -> list[str]:
        """What replacing ``origins`` replaces: each one's component, or its layer's stream."""
        return [o.component or self.streams[o.layer].capture_name for o in origins]

    def measure(self, selections: Sequence[Collection[str]]) -> list[tuple[Pass, dict]]:
        """Each selection's (pass, summary); the unmeasured ones run as one round."""
        keys = [self.key(s) for s in selections]
        todo = [k for k in dict.fromkeys(keys) if k not in self.cache]
        if todo:
            if len(self.passes) + len(todo) > self.budget:
                raise BudgetSpent
            if self.supply is not None:
                self.supply(set().union(*todo))
            for group in ([todo] if self.batched else [[k] for k in todo]):
                self._round(group)
        return [self.cache[k] for k in keys]

    def _round(self, todo: list[frozenset]) -> None:
        t0 = time.perf_counter()
        n = len(self.indices)
        copies = _Copies(self.reference, self.indices, len(todo))
        replace = {i: todo[i // n] for i in range(copies.num_prompts)}
        doing = f"blame round {self.rounds + 1}: {len(todo)} passes side by side"
        with heartbeat(lambda line: print(f"  {line}", flush=True), self.progress, doing):
            result = logit_validation(self.engine, copies, modes=("on",), replace=replace, tolerances=self.tolerances,
                                      progress=False)
        seconds = time.perf_counter() - t0
        self.rounds += 1
        for h, key in enumerate(todo):
            steps = [dataclasses.replace(s, prompt=self.indices[s.prompt % n]) for s in result.steps if s.prompt // n == h]
            s = ValidationResult(steps=steps, tolerances=self.tolerances, num_prompts=n).summary()["on"]
            firsts = [p["first_divergence"] for p in s["prompts"].values() if p["first_divergence"] is not None]
            done = Pass(tuple(sorted(key)), s["mean_kl"], s["mean_top5_error"], s["top1_agreement"], s["prompts_diverged"],
                        s["status_counts"][DIVERGED], min(firsts) if firsts else None,
                        any(p["nan"] for p in s["prompts"].values()), self.rounds, seconds)
            self.passes.append(done)
            self.cache[key] = (done, s)
        if self.progress:
            print(f"  round {self.rounds}: {len(todo)} passes side by side ({seconds:.1f} s): " + "; ".join(
                f"{', '.join(self.cache[k][0].replaced) or 'nothing'}: KL {fmt(self.cache[k][0].mean_kl)}"
                for k in todo)[:400])

    def E(self, selection: Collection[str], signed: bool = False) -> float:
        """Explained by ``selection`` (0 for nothing replaced; unknown counts as 0). The search decides on
        it as is (a replacement making the target worse explains nothing); ``signed``: below 0 by how much
        worse, as the figures the verdict and the reports show."""
        key = self.key(selection)
        if not key or key not in self.cache:
            return 0.0
        return explained(self.off_summary, self.cache[key][1], signed)["explained"] or 0.0

    def _batches(self, selections: Sequence[Collection[str]]) -> int:
        """The engine batches a round of ``selections`` takes (the measured ones cost nothing)."""
        new = len({self.key(s) for s in selections} - self.cache.keys())
        return math.ceil(new * len(self.indices) / self.batch_rows)

    def _explains(self, selection: list[str]) -> bool:
        """With ``selection`` replaced, what is left is below the thresholds: no step diverges, it explains
        EXPLAINS, or what is left is within the floor (precision noise)."""
        done, left = self.measure([selection])[0]
        return done.steps_diverged == 0 or self.E(selection) >= EXPLAINS or (
            self.floor is not None and self.floor.within(left))

    def _kinds(self, layer: int) -> list:
        """The components of ``layer`` other than its stream, in forward order; the first layer's start
        with the feeders (the embedding): its input is their output, so the earliest of them all whose
        replacement explains the layer's part is its origin (an embedding row's error reaches every later
        position through layer 0's attention, whose replacement removes most of it too)."""
        own = [c for c in self.components if c.layer == layer and c.kind != LAYER]
        return (self.feeders if self.stream_layers and layer == self.stream_layers[0] else []) + own

    def _layer_shares(self) -> list[LayerShare]:
        out, below = [], 0.0
        for k in self.stream_layers:
            key = frozenset([self.streams[k].capture_name])
            if key not in self.cache:
                continue
            e = self.E(key)
            out.append(LayerShare(k, self.streams[k].capture_name, e, e - below))
            below = e
        return out
