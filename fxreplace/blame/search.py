"""The blame search: localise by the residual streams, attribute by kind, repeat for every origin.

Every *pass* is one teacher-forced validation with a set of components replaced; the
passes of one *round* run side by side as copies of the prompts in one batch (each copy
selects its own components) when the engine supports it (``per_request_selection``).

``E(S)``: the fraction of the divergence removed with the captures ``S`` replaced
(:func:`fxreplace.validation.explained`). Replacing the stream after layer ``k`` removes
every error arising at or before ``k``, so ``E(B + stream k)`` grows with ``k``. With the
origins found so far ``B`` kept replaced, the search

1. finds the first layer whose stream adds at least :data:`SIGNIFICANT` to ``E(B)``, by a
   ``(probes + 1)``-ary split (``probes`` streams per round);
2. replaces each kind of that layer (one round, or beside the streams of the round that decides
   the layer when the candidates' kinds add no batch to it); kinds are declared in
   forward order and replacing a component also hides what went wrong upstream of it inside
   its layer (the experts' output carries a faulty router's routing), so the *earliest* kind
   explaining the layer's part is its origin; when none does, the layer itself is;
3. keeps that origin replaced and goes on after it, until the rest is below the thresholds,
   no later layer adds a significant part, more than :data:`MAX_ORIGINS` origins are needed
   (diffuse drift: then every stream and component is measured for the heat map), or the
   pass budget is spent. Once one kind holds origins in two layers, it is replaced in every
   layer holding it (one pass) and the search goes on beside that; at the end (also for the
   origins' kinds in turn, the largest origin's first, when the origins leave MEMBER), when that
   explains the divergence, the kind is one systematic fault (a bug in code every layer runs shows
   in every layer), its faulty layers those whose leaving out of the replacement leaves a part of
   the divergence, each with what its replacement removes alone; an origin of another kind beside
   it is attributed again with those layers replaced (its layer's part then holds its own fault only).

When the target's logits hold NaN/inf, one observing pass finds where they first appear.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Callable, Collection, Sequence

from ..components import LAYER
from ..metrics import DIVERGED, EXPLAINS, Tolerances, explained, phase_clue
from ..points import ROUTING as ROUTING_POINT
from ..validation import ValidationResult, heartbeat, logit_validation
from .result import (MAX_ORIGINS, SIGNIFICANT, Blame, BlameResult, LayerShare, NonFinite, Origin, Pass, Systematic,
                     pct)

#: streams probed per localisation round. A round costs a batch of copies, not a pass each, so wide
#: rounds are cheap and rounds are what costs: 8 narrow 16 layers to 2 (32 to 4) in the first round, and
#: the second decides between them with their kinds beside (two rounds for one fault)
PROBES = 8
#: A layer of a systematic kind is at fault when leaving it out of the kind's replacement leaves at least this
#: part of the divergence (or the floor's part, when larger): with the kind replaced in the others, a sound
#: layer computes what the reference does, so leaving it out leaves ~0 (rounding), where a fault leaves its part
MEMBER = 0.01
#: the kind a family's router logits are declared as: the layers holding one are its MoE layers
ROUTER = "router"


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


class Search:
    """One search's state: the passes measured (by selection), rounds, budget."""

    def __init__(self, engine, reference, components, *, tolerances: Tolerances, prompts: Sequence[int],
                 budget: int | None, probes: int, progress: bool, supply: Callable[[Collection[str]], None] | None,
                 observe: Callable | None, floor=None, unscaled: str = "", batch_rows: int | None = None,
                 drift_of: Callable[[list[str]], dict[str, float]] | None = None,
                 layer_types: Sequence[str] | None = None):
        self.engine, self.reference, self.components = engine, reference, list(components)
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

    # ------------------------------------------------------------------ measuring

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
                f"{', '.join(self.cache[k][0].replaced) or 'nothing'}: KL {_g(self.cache[k][0].mean_kl)}"
                for k in todo)[:400])

    def E(self, selection: Collection[str], signed: bool = False) -> float:
        """Explained by ``selection`` (0 for nothing replaced; unknown counts as 0). The search decides on
        it as is (a replacement making the target worse explains nothing); ``signed``: below 0 by how much
        worse, as the figures the verdict and the reports show."""
        key = self.key(selection)
        if not key or key not in self.cache:
            return 0.0
        return explained(self.off_summary, self.cache[key][1], signed)["explained"] or 0.0

    # ------------------------------------------------------------------ the search

    def run(self) -> BlameResult:
        started = time.perf_counter()
        first_probes = self._probe_points(0, len(self.stream_layers) - 1, known_last=False)
        (off, self.off_summary), *_ = self.measure([()] + [[self.streams[self.stream_layers[i]].capture_name]
                                                            for i in first_probes])
        self.off = off
        if self.floor is not None:
            self.noise = self._noise_part(self.off_summary)
            self.significant = max(SIGNIFICANT, self.noise)
        origins: list[Origin] = []
        nonfinite = None
        spent = diffuse = False
        after_layers = None  # explained by the stream after the last layer: the rest arises after the layers
        if off.steps_diverged == 0 and not off.nonfinite:
            return self._result([], None, False, False, started, "the target does not diverge from the reference "
                                "(every step within tolerance); nothing to blame.")
        if off.nonfinite:
            nonfinite = self._first_nonfinite()
            return self._result([], nonfinite, False, False, started, nonfinite.describe() + "." if nonfinite else
                                "the target's logits hold NaN/inf; no observing engine to say where they first appear.")
        # within the floor as a whole, the target may still hold a component whose replacement removes more than
        # the precision alone causes: the search looks for it at the floor's scale
        within = self.floor is not None and self.floor.within(self.off_summary)
        try:
            base: list[str] = []
            start = 0  # index into stream_layers
            while self._places(origins) <= MAX_ORIGINS:
                found = self._localise(base, start)
                if found is None or any(o.layer == found for o in origins):
                    if start == 0:
                        break
                    start = 0  # an origin found downstream may unmask one upstream: search again from the first layer
                    continue
                found_here = self._attribute(base, found)
                origins += found_here
                origin = found_here[0]
                base = base + [o.component or self.streams[o.layer].capture_name for o in found_here]
                if self._explains(base):
                    break
                repeated = self._repeated_kind(origins)
                if repeated is not None:  # one kind at fault in two layers: replaced in every layer (one pass), the
                    base = self._kind_wide(repeated, origins)  # search goes on beside it
                    self.measure(self._kind_round(repeated, origins))
                    if self._explains(base):
                        break
                start = (self.stream_layers.index(origin.layer) + 1) % len(self.stream_layers)
            if self.drifts:
                origins = self._without_drift(origins)
            if self.floor is not None and self.drift_of is not None and not origins:
                origins = self._beyond_own_drift()
            origins = self._systematic(origins)
            last = self.stream_layers[-1] if self.stream_layers else None
            if last is not None:  # probed in the first round
                after_layers = self.E([self.streams[last].capture_name])
                if self.drifts and 1 - after_layers < self._least(origins):
                    after_layers = None  # what arises after the layers stands no higher than the drift
            if within and not origins:
                return self._result([], None, True, False, started, f"within precision noise: the target is "
                                    f"{self.floor.describe(self.off_summary).split(': ', 1)[1]}; no component stands "
                                    "above the floor, so there is nothing to blame beyond the precision itself.")
            # a systematic kind is one place to fix, however many layers it holds
            places = len(origins) if self.systematic is None else self._places(origins)
            builds_up = bool(origins) and (places > MAX_ORIGINS or sum(self._spread(origins)) >= SIGNIFICANT)
            if self.floor is not None:  # nothing stands out from the floor, or too many would have to be fixed
                diffuse = (not origins and after_layers is None) or places > MAX_ORIGINS
            elif self.drifts:
                diffuse = (not origins and after_layers is None) or builds_up
                if diffuse:  # precision drift builds up beside them: without a floor, no scale to tell them from it
                    self.candidates, origins = origins, []
            else:
                diffuse = builds_up
            if diffuse:  # where does the drift build up: every stream and kind, for the heat map
                self.measure([[c.capture_name] for c in self.components])
        except BudgetSpent:
            spent = True
        return self._result(origins, None, diffuse, spent, started, None, after_layers)

    def _probe_points(self, a: int, b: int, known_last: bool) -> list[int]:
        """Up to ``probes`` indices splitting [a, b] evenly, ending at b (b - 1 when b is known)."""
        last = b - 1 if known_last else b
        size = last - a + 1
        if size <= 0:
            return []
        m = min(self.probes, size)
        return sorted({a - 1 + math.ceil(j * size / m) for j in range(1, m + 1)})

    def _localise(self, base: list[str], start: int) -> int | None:
        """The first layer (from stream index ``start``) whose stream adds SIGNIFICANT to what is
        explained so far: E(base), or the stream before ``start`` where that explains more (what
        the origins found upstream leave there, e.g. drift, arises upstream, not after them).

        Every stream measured already narrows the search before a round runs: after an origin in
        layer ``k``, the streams past ``k`` with that origin beside them are the streams alone (the
        stream replaces what the origin changed), so the first round's probes still bracket the next origin."""
        if not self.stream_layers:
            return None
        a, b, known = start, len(self.stream_layers) - 1, False
        upstream = [self.streams[self.stream_layers[start - 1]].capture_name] if start else []
        sel = {i: base + [self.streams[self.stream_layers[i]].capture_name] for i in range(a, b + 1)}
        while True:
            if all(self.key(s) in self.cache for s in (base, upstream) if s):
                e_base = max(self.E(base) if base else 0.0, self.E(upstream) if upstream else 0.0)
                measured = [i for i in range(a, b + 1) if self.key(sel[i]) in self.cache]
                hits = [i for i in measured if self.E(sel[i]) - e_base >= self.significant]
                if hits:
                    below = [i for i in measured if i < hits[0]]
                    a, b, known = (below[-1] + 1 if below else a), hits[0], True
                elif measured and not known and measured[-1] == b:
                    return None  # not even the last stream adds a significant part
                elif measured:
                    a = measured[-1] + 1
            if known and a == b:
                return self.stream_layers[a]
            points = self._probe_points(a, b, known)
            selections = [sel[i] for i in points] + ([base] if base else []) + ([upstream] if upstream else [])
            if known and points == list(range(a, b)):
                # this round decides the layer (one of a..b): their kinds ride along when they add no batch
                # to the round, so the attribution that follows needs no round of its own
                kinds = [base + [c.capture_name] for i in range(a, b + 1) for c in self._kinds(self.stream_layers[i])]
                if self._batches(selections + kinds) <= self._batches(selections):
                    selections += kinds
            self.measure(selections)

    def _batches(self, selections: Sequence[Collection[str]]) -> int:
        """The engine batches a round of ``selections`` takes (the measured ones cost nothing)."""
        new = len({self.key(s) for s in selections} - self.cache.keys())
        return math.ceil(new * len(self.indices) / self.batch_rows)

    def _attribute(self, base: list[str], layer: int) -> list[Origin]:
        """The earliest kind of ``layer`` explaining its part (beyond ``base``); else the smallest set
        of its kinds that does together (pairs, then all: two faults in one layer), each named with
        its share; else the layer itself.

        A fault downstream can mask one upstream (after a flipped router little is left for an
        attention fault to add), so the layer's part may hold upstream errors no kind of it
        explains: then each kind is tried again with the stream below the layer replaced
        beside it, which removes everything upstream (the search then looks upstream again)."""
        idx = self.stream_layers.index(layer)
        stream = base + [self.streams[layer].capture_name]
        below = base + [self.streams[self.stream_layers[idx - 1]].capture_name] if idx else base
        candidates = self._kinds(layer)
        # ``base`` too: the search has measured it already, an attribution beside a systematic fault may not have
        self.measure([base + [c.capture_name] for c in candidates] + [below] + ([base] if base else []))
        e_base = self.E(base) if base else 0.0
        # the part a kind must explain: the layer's, less what precision noise may leave in it (with a floor)
        part = self.E(stream) - self.E(below) - self.noise / EXPLAINS
        kinds = [x.kind for x in candidates]

        def origin(c, share, together=()):
            beside = self.key(base + [x.capture_name for x in together] + [c.capture_name]) - {c.capture_name}
            return Origin(layer, share, c.capture_name, c.kind, kinds, sorted(beside))

        # without a floor, a drifting target's layer part holds drift no kind explains: a kind standing out from the
        # drift (removing more than it leaves) is an origin as it is
        stands_out = self._least([]) if self.drifts and self.floor is None else math.inf
        for c in candidates:
            gain = self.E(base + [c.capture_name]) - e_base
            if gain >= self.significant and (gain >= EXPLAINS * part or gain >= stands_out):
                return [origin(c, gain)]
        if idx:
            self.measure([below + [c.capture_name] for c in candidates])
            for c in candidates:
                if self.E(below + [c.capture_name]) - self.E(below) >= max(self.significant, EXPLAINS * part):
                    return [origin(c, self.E(base + [c.capture_name]) - e_base)]
        for size in sorted({2, len(candidates)}):
            if size > len(candidates) or size < 2:
                continue
            combos = list(itertools.combinations(candidates, size))
            self.measure([base + [c.capture_name for c in combo] for combo in combos])
            # the first set that explains the part, in forward order: as for one kind, a later kind replaced
            # hides what went wrong upstream of it (the experts' output carries a faulty router's routing)
            gains = [(self.E(base + [c.capture_name for c in combo]) - e_base, combo) for combo in combos]
            explaining = [(gain, combo) for gain, combo in gains if gain >= self.significant and gain >= EXPLAINS * part]
            if explaining:
                gain, combo = explaining[0]
                # each one's share: what the set loses without it (measured: the pairs, or the sets one smaller);
                # a member adding less than an origin must is not guilty (e.g. its own rounding beside a fault)
                guilty = list(combo)
                self.measure([base + [x.capture_name for x in guilty if x is not c] for c in guilty])
                shared = [c for c in guilty if self._member_share(base, guilty, c) >= self.significant]
                if shared and len(shared) < len(guilty):
                    guilty = shared  # its other members are measured again without them (all subsets are measured)
                return [origin(c, self._member_share(base, guilty, c), [x for x in guilty if x is not c])
                        for c in guilty]
        return [Origin(layer, self.E(stream) - e_base, None, None, kinds)]

    def _explains(self, selection: list[str]) -> bool:
        """With ``selection`` replaced, what is left is below the thresholds: no step diverges, it explains
        EXPLAINS, or what is left is within the floor (precision noise)."""
        done, left = self.measure([selection])[0]
        return done.steps_diverged == 0 or self.E(selection) >= EXPLAINS or (
            self.floor is not None and self.floor.within(left))

    def _repeated_kind(self, origins: list[Origin]) -> str | None:
        """The kind holding origins in two or more layers, or in one beside a layer no kind explained (the same fault
        upstream of that layer can hide its kind there: replacing the kind in it removes only what arises in it, its
        stream all the rest); the most layers, the earliest kind on a tie; else None. None for a drifting target
        without a floor: no scale tells a kind's precision drift from its fault."""
        if self.drifts and self.floor is None:
            return None
        layers = {kind: {o.layer for o in origins if o.component and o.kind == kind} for kind in self.kinds}
        least = 1 if any(o.component is None for o in origins) else 2
        repeated = [kind for kind in self.kinds if len(layers[kind]) >= least]
        return max(repeated, key=lambda kind: len(layers[kind])) if repeated else None

    def _leaving_kinds(self, origins: list[Origin]) -> list[str]:
        """The origins' kinds, the largest origin's first, when the origins together leave at least MEMBER of the
        divergence beyond the floor's part: the same fault in other layers, each adding less than SIGNIFICANT, may be
        what they leave (beside a larger fault of another kind: a flipped router beside an attention bug)."""
        if self.drifts and self.floor is None:
            return []  # no scale tells a kind's precision drift from its fault
        named = [o for o in origins if o.component and o.kind in self.kinds]
        together = self.key([o.component or self.streams[o.layer].capture_name for o in origins])
        if not named or together not in self.cache or 1 - self.E(together) - self.noise < MEMBER:
            return []
        return list(dict.fromkeys(o.kind for o in sorted(named, key=lambda o: -o.share)))

    def _places(self, origins: list[Origin]) -> int:
        """The places to fix: the origins, a kind holding origins in several layers counted once."""
        repeated = self._repeated_kind(origins)
        return len([o for o in origins if repeated is None or o.kind != repeated]) + (repeated is not None)

    def _kind_wide(self, kind: str, origins: list[Origin]) -> list[str]:
        """``kind`` replaced in every layer holding it, beside the origins of other kinds; not where such an origin
        lies inside it (a router inside the MoE block): replacing the block there would hide it. A layer no kind
        explained is not replaced: its stream would make everything upstream of it the reference's."""
        others = [o.component for o in origins if o.kind != kind and o.component]
        return others + [c.capture_name for c in self._of_kind(kind) if not any(self._inside(n, c) for n in others)]

    def _of_kind(self, kind: str) -> list:
        """The components of ``kind`` in the layers, in layer order."""
        return [c for c in self.components if c.kind == kind and c not in self.feeders]

    def _inside(self, name: str, outer) -> bool:
        """The component ``name`` is a submodule of the component ``outer``, whose replacement hides it; for the
        routing a module is called with, of the block computing it (its router, whose logits it comes from)."""
        inner = self.by_name.get(name)
        where = outer.module_name.rpartition(".")[0] if outer.target.point == ROUTING_POINT else outer.module_name
        return inner is not None and inner is not outer and inner.module_name.startswith(where + ".")

    def _kind_round(self, kind: str, origins: list[Origin]) -> list[list[str]]:
        """The first round telling whether ``kind`` is one systematic fault: it replaced in every layer holding it, the
        origins together, each of the kind's alone and each origin left out of the kind-wide replacement."""
        wide = self._kind_wide(kind, origins)
        names = [o.component for o in origins if o.component]
        return [wide, names] + [[o.component] for o in origins if o.kind == kind] + [
            [n for n in wide if n != name] for name in names]

    def _systematic(self, origins: list[Origin]) -> list[Origin]:
        """The origins, with a kind holding origins in several layers made one systematic fault when replacing it in
        every layer holding it (beside the other origins) explains the divergence; when no kind holds origins in two
        layers and the origins leave MEMBER, each origin's kind is tried so in turn, the largest origin's first.
        Sets ``self.systematic``.

        Its faulty layers leave at least MEMBER of the divergence when left out of that replacement: with the kind
        replaced in the others, a sound layer computes the reference's values and leaves ~0. So an origin of the kind
        leaving less is dropped (it hid an upstream error), and when its origins leave part of what the kind-wide
        replacement removes, every other layer holding it is left out in turn (one the search passed over, its part
        below SIGNIFICANT); there, a component inside the kind's (its router) explaining what the layer leaves is an
        origin of its own, as the search would name it. An origin of another kind stays when leaving it out leaves a
        significant part, attributed again with the faulty layers replaced beside it where the fault acted upstream
        of it (:meth:`_beside_systematic`), and a layer no kind explained goes (the kind explains it). Each faulty
        layer's share is its replacement alone."""
        repeated = self._repeated_kind(origins)
        for kind in [repeated] if repeated else self._leaving_kinds(origins):
            found = self._systematic_of(kind, origins)
            if self.systematic is not None:
                return found
        return origins

    def _systematic_of(self, kind: str, origins: list[Origin]) -> list[Origin]:
        """:meth:`_systematic` for ``kind``."""
        wide = self._kind_wide(kind, origins)
        least = max(MEMBER, self.noise)
        group = {o.component: o for o in origins if o.kind == kind}
        others = {o.component: o for o in origins if o.kind != kind and o.component}

        def without(name, *instead):
            return [n for n in wide if n != name] + list(instead)

        def left(name, *instead):  # what leaving ``name`` out of the kind-wide replacement (``instead`` in) leaves
            return self.E(wide) - self.E(without(name, *instead))

        self.measure(self._kind_round(kind, origins))
        if not self._explains(wide):
            return origins  # the kind is not the whole story: its origins stand as found
        passed = []
        if self.E(wide) - self.E([*others, *group]) >= least:
            passed = [c for c in self._of_kind(kind) if c.capture_name in wide and c.capture_name not in group]
        inner = {c.capture_name: [x for x in self.components if x.layer == c.layer and self._inside(x.capture_name, c)]
                 for c in passed}
        self.measure([without(c.capture_name) for c in passed] + [[c.capture_name] for c in passed]
                     + [without(name, x.capture_name) for name, xs in inner.items() for x in xs])
        leaving = [c for c in self._of_kind(kind)
                   if (c.capture_name in group or c in passed) and left(c.capture_name) >= least]
        within = {}  # a passed layer's component inside the kind's that explains what the layer leaves
        for c in leaving:
            explaining = [x for x in inner.get(c.capture_name, []) if left(c.capture_name, x.capture_name) < least]
            if explaining:
                within[c.capture_name] = explaining[0]
        faulty = [c for c in leaving if c.capture_name not in within]
        if len(faulty) < 2:
            return origins
        kept = self._beside_systematic([x.capture_name for x in within.values()] + [c.capture_name for c in faulty],
                                       list(others.values()), wide)
        chosen = ([o.component for o in kept] + [x.capture_name for x in within.values()]
                  + [c.capture_name for c in faulty])
        self.measure([chosen] + [[n for n in chosen if n != x.capture_name] for x in within.values()])

        def beside_all(x) -> Origin:
            """``x`` as an origin sharing what the others replaced beside it leave without it."""
            beside = [n for n in chosen if n != x.capture_name]
            return Origin(x.layer, self.E(chosen) - self.E(beside), x.capture_name, x.kind,
                          [k.kind for k in self._kinds(x.layer)], sorted(beside))

        # each sharing what its replacement alone removes: below 0 where that alone makes the target worse
        # (faults that interact, e.g. a norm offset in every layer), as the table's row shows it
        members = [dataclasses.replace(group[c.capture_name], share=self.E([c.capture_name], signed=True), beside=[])
                   if c.capture_name in group else Origin(c.layer, self.E([c.capture_name], signed=True),
                                                          c.capture_name, kind, [k.kind for k in self._kinds(c.layer)])
                   for c in faulty]
        where, every = self._where(kind, [c.layer for c in faulty])
        self.systematic = Systematic(kind, [c.layer for c in faulty], [c.capture_name for c in faulty], where, every,
                                     self.E(chosen), [o.share for o in members],
                                     [left(c.capture_name) for c in faulty], self.E(wide))
        return members + kept + [beside_all(x) for x in within.values()]

    def _beside_systematic(self, fixed: list[str], others: list[Origin], wide: list[str]) -> list[Origin]:
        """The origins of other kinds that stand beside a systematic fault whose faulty layers' components are
        ``fixed`` (its kind replaced in every layer holding it: ``wide``), each attributed again with that fault
        replaced beside it.

        One stays when leaving it out of ``wide`` (measured by the kind's first round) leaves a significant part, or,
        where that hides it, out of ``fixed`` and the others replaced together: in the origin's own layer the kind
        may lie downstream of it, as the routing lies downstream of its block's router. When its layer was attributed
        while the systematic fault still acted in it or upstream of it (in layers the search had not reached yet),
        the layer's part held some of that fault's error too, which a later kind of the layer carries and its own
        kind does not (the MoE block named for its router); with the fault replaced the part is its own, and the
        earliest kind explaining it is the origin. A fault acting only downstream acts alike with the layer's stream
        and its kinds replaced: the attribution stands."""
        names = [o.component for o in others]
        together = fixed + names

        def leaves(name, replaced):  # what leaving ``name`` out of ``replaced`` leaves
            return self.E(replaced) - self.E([n for n in replaced if n != name])

        hidden = [n for n in names if leaves(n, wide) < self.significant]
        self.measure([together] + [[n for n in together if n != name] for name in hidden])
        kept = [o for o in others if o.component not in hidden or leaves(o.component, together) >= self.significant]
        out = []
        for layer in dict.fromkeys(o.layer for o in kept):
            here = [o for o in kept if o.layer == layer]
            base = fixed + [o.component for o in kept if o.layer != layer]
            if {n for n in fixed if self.layer_of[n] <= layer} <= set().union(*(o.beside for o in here)):
                out += here  # attributed with the fault in it and upstream replaced beside already
                continue
            again = self._attribute(base, layer)
            out += again if all(o.component for o in again) else here
        return out

    def _where(self, kind: str, layers: list[int]) -> tuple[str, bool]:
        """``layers`` in the words of the model's layer groups ("every layer", "every MoE layer", "every sliding
        attention layer"), and whether they are one; else listed ("layers 1 and 3 (2 of 8)")."""
        groups = {"every layer": self.layers}
        moe = sorted({c.layer for c in self.components if c.kind == ROUTER and c.layer is not None})
        groups.setdefault("every MoE layer", moe)
        for name in dict.fromkeys(self.layer_types or []):
            groups.setdefault(f"every {name.replace('_', ' ')} layer",
                              [k for k, t in enumerate(self.layer_types) if t == name])
        holding = sorted({c.layer for c in self.components if c.kind == kind and c.layer is not None})
        groups.setdefault(f"every layer holding its {kind}", holding)
        for name, group in groups.items():
            if list(group) == layers:
                return name, True
        listed = ", ".join(map(str, layers[:-1])) + f" and {layers[-1]}"
        return f"layers {listed} ({len(layers)} of {len(self.layers)})", False

    def _without_drift(self, origins: list[Origin]) -> list[Origin]:
        """The origins of a drifting target that stand out from its precision drift; the others go to
        ``self.drift`` (the verdict lists them, unnamed). A part no component explains is what rounding in
        the residual path looks like: it stands out only by its own part (its stream's over the stream
        below) above the floor's part of the divergence. Without a floor, a component stands out when it
        removes more than the strongest one leaves (at most the drift, when that one is the only fault)."""
        least = self._least(origins)
        kept = []
        for o in origins:
            part = o.share if o.component else self._own_part(o)
            if o.component is None and self.floor is None or part < least:
                self.drift.append(o)
            else:
                kept.append(o)
        if self.drift and kept:  # what the named ones remove together, without the drift replaced beside them
            try:
                self.measure([[o.component or self.streams[o.layer].capture_name for o in kept]])
            except BudgetSpent:
                pass
        return kept

    def _beyond_own_drift(self) -> list[Origin]:
        """With a floor and the clean model, when no component stands above the floor's whole part: the
        component removing a significant part beyond its own precision drift (what its replacement removes
        in the clean model in the target's precision, in the target's measure): a fault smaller than the floor,
        hidden in the drift, still stands out there. The earliest in forward order of those removing
        nearly as much as the most (a later kind of its layer carries it too). None when the target
        diverges no more than its floor (within 10%): a component's replacement then removes more than the
        clean model's only by the two programs' rounding taking other turns."""
        if 1 - self.noise < SIGNIFICANT:  # the target diverges no more than the precision alone: nothing to tell apart
            return []
        comps = [c for c in self.components if c.kind != LAYER]
        self.measure([[c.capture_name] for c in comps])  # every component alone: the heat map
        drift = self.drift_of([c.capture_name for c in comps])
        beyond = {c.capture_name: self.E([c.capture_name]) - self.noise * drift[c.capture_name] for c in comps}
        most = max(beyond.values(), default=0.0)
        if most < SIGNIFICANT:
            return []
        c = next(c for c in comps if beyond[c.capture_name] >= EXPLAINS * most)
        layer = c.layer if c.layer is not None else self.stream_layers[0]
        self.drift = [o for o in self.drift if o.layer != layer]  # its layer's part is the origin's now
        return [Origin(layer, self.E([c.capture_name]), c.capture_name, c.kind, [x.kind for x in self._kinds(layer)],
                       drift=drift[c.capture_name] * self.noise)]

    def _least(self, origins: list[Origin]) -> float:
        """The least part standing out from a drifting target's precision drift: the floor's part, else what
        the strongest component found leaves (more than half when none is found)."""
        if self.floor is not None:
            return self.significant
        return max(SIGNIFICANT, 1 - max((o.share for o in origins if o.component), default=0.5))

    def _own_part(self, origin: Origin) -> float:
        """What ``origin``'s layer adds: its stream's part over the stream below (its share when unmeasured)."""
        idx = self.stream_layers.index(origin.layer)
        here = frozenset([self.streams[origin.layer].capture_name])
        below = frozenset([self.streams[self.stream_layers[idx - 1]].capture_name]) if idx else frozenset()
        if here not in self.cache or (below and below not in self.cache):
            return origin.share
        return self.E(here) - self.E(below)

    def _member_share(self, base: list[str], combo: list, member) -> float:
        """What ``combo`` (replaced beside ``base``) loses without ``member``."""
        return (self.E(base + [x.capture_name for x in combo])
                - self.E(base + [x.capture_name for x in combo if x is not member]))

    def _noise_part(self, off: dict) -> float:
        """The floor's part of the divergence: what the reference in the target's precision diverges
        as a fraction of the target's, in the measure where that fraction is larger (the explained
        part is the smaller of two measures removed, so the noise is the larger)."""
        m = self.floor.multiples(off)
        parts = [1 / v for v in (m["kl"], m["top5"]) if v]
        return min(1.0, max(parts)) if parts else 1.0

    def _kinds(self, layer: int) -> list:
        """The components of ``layer`` other than its stream, in forward order; the first layer's start
        with the feeders (the embedding): its input is their output, so the earliest of them all whose
        replacement explains the layer's part is its origin (an embedding row's error reaches every later
        position through layer 0's attention, whose replacement removes most of it too)."""
        own = [c for c in self.components if c.layer == layer and c.kind != LAYER]
        return (self.feeders if self.stream_layers and layer == self.stream_layers[0] else []) + own

    def _spread(self, origins: list[Origin]) -> tuple[float, float]:
        """The part of the divergence arising where no origin is: in the measured stretches of
        layers that hold none, and after the last layer (final norm, lm_head).

        A fault leaves the layers around it untouched: each of their streams explains what the
        stream below explains, so such stretches hold ~0. Precision drift adds a little in every
        layer and after them, so the stretches an origin leaves out still hold a substantial part."""
        inside, below = 0.0, -math.inf
        shares = self._layer_shares()
        for s in shares:
            if not any(below < o.layer <= s.layer for o in origins):
                inside += max(0.0, s.share or 0.0)
            below = s.layer
        after = max(0.0, 1.0 - shares[-1].explained) if shares and shares[-1].layer == self.stream_layers[-1] else 0.0
        return inside, after

    def _first_nonfinite(self) -> NonFinite | None:
        """Observe every declared component in one pass; the first non-finite value in forward order."""
        if self.observe is None:
            return None
        order = {c.capture_name: (c.layer if c.layer is not None else -1, i) for i, c in enumerate(self.components)}
        n = max(self.reference.num_generated(p) for p in self.indices)
        gens = self.observe([self.reference.prompt_tokens(p) for p in self.indices], n)
        self.rounds += 1
        best = None
        for p, gen in zip(self.indices, gens):
            plen = len(self.reference.prompt_tokens(p))
            for name, per_position in gen.observed.items():
                if name not in order:
                    continue
                for pos, value in per_position.items():
                    if not bool(value.isfinite().all()):
                        key = (pos, order[name])
                        if best is None or key < best[0]:
                            best = (key, p, pos, name)
            bad = [j for j, lg in enumerate(gen.logits) if not bool(lg.isfinite().all())]
            if bad:
                pos = plen - 1 + bad[0]
                key = (pos, (math.inf, 0))
                if best is None or key < best[0]:
                    best = (key, p, pos, None)
        if best is None:
            return None
        _, p, pos, name = best
        plen = len(self.reference.prompt_tokens(p))
        step = pos - plen + 1 if pos >= plen - 1 else None
        c = self.by_name.get(name)
        return NonFinite(p, pos, step, name, c.kind if c else None, c.layer if c else None)

    # ------------------------------------------------------------------ the result

    def _result(self, origins, nonfinite, diffuse, spent, started, verdict=None, after_layers=None) -> BlameResult:
        ranking = self._ranking(origins)  # in the order found: each row's attribution had the earlier ones beside it
        # the largest part first, wherever it arises; a systematic fault's layers first, in layer order (one fix)
        systematic = self.systematic
        members = set(systematic.components) if systematic else set()
        origins = sorted(origins, key=lambda o: (0, o.layer) if o.component in members else (1, -o.share))
        shares = self._layer_shares()
        chosen = self.key(o.component or self.streams[o.layer].capture_name for o in origins)
        together = self.E(chosen) if chosen in self.cache else None
        # with a floor, explaining all that exceeds it is explaining all there is to explain
        enough = EXPLAINS if self.floor is None else min(EXPLAINS, 1 - self.noise)
        confident = (not diffuse and not spent and bool(origins) and all(o.component for o in origins)
                     and (together or 0) >= enough)
        floor = None
        if self.floor is not None and hasattr(self, "off_summary"):
            floor = {"dtype": self.floor.dtype, "multiples": self.floor.multiples(self.off_summary),
                     "within": self.floor.within(self.off_summary), "noise_share": self.noise,
                     "floor": self.floor.aggregate(self.indices)}
        if verdict is None:
            verdict = _verdict(origins, together, diffuse, self._spread(origins or self.candidates), spent, self.budget,
                               ranking, shares, after_layers, self.noise if self.floor is not None else None,
                               self.drifts, self.drift, floor is not None and floor["within"], self.candidates,
                               systematic)
            if self.floor is not None:
                verdict = f"{self.floor.describe(self.off_summary)}. " + verdict
        if self.floor is None and self.unscaled and hasattr(self, "off_summary") and nonfinite is None:
            verdict = verdict.rstrip(".") + f"; {self.unscaled}."
        clue = phase_clue(self.off_summary) if hasattr(self, "off_summary") else ""
        if clue:  # a fault in incremental decoding (or in prefill alone): the first thing to read for
            verdict = f"{verdict.rstrip('.')}. {clue}"
        order = {o.component: i for i, o in enumerate(origins)}
        ranking.sort(key=lambda b: order.get(b.component, len(order)))  # stable: the origins in order, then by share
        return BlameResult(ranking, shares, origins, self.passes, self.rounds, verdict, confident, diffuse, nonfinite,
                           self.kinds, self.layers, time.perf_counter() - started, self.budget, spent,
                           explained=together, floor=floor, candidates=self.candidates, systematic=systematic)

    def _ranking(self, origins: list[Origin]) -> list[Blame]:
        """One row per measured component (its most informative pass: the attribution that named it,
        else the pass with the most origins replaced beside it)."""
        off, off_s = self.off, self.off_summary
        named = {o.component for o in origins if o.component}
        chosen = [o.component or self.streams[o.layer].capture_name for o in origins + self.drift]
        kept = set(chosen)
        # an origin's row is its attribution: the origins found before it (and the other guilty components
        # of its layer) replaced beside it
        attributed = {o.component: frozenset(o.beside) for o in origins if o.component}
        rows: dict[str, Blame] = {}
        for key, (on, on_s) in self.cache.items():
            for c in self.components:
                if c.kind == LAYER or c.capture_name not in key:
                    continue
                others = sorted(key - {c.capture_name})
                if not set(others) <= kept or attributed.get(c.capture_name, frozenset(others)) != frozenset(others):
                    continue
                e = explained(off_s, on_s, signed=True)
                share = None if e["explained"] is None else e["explained"] - self.E(others, signed=True)
                row = Blame(c.capture_name, c.kind, c.layer, off.mean_kl, on.mean_kl, off.mean_top5_error,
                            on.mean_top5_error, off.top1_agreement, on.top1_agreement, off.first_divergence,
                            on.first_divergence, off.prompts_diverged, on.prompts_diverged, e["kl"], e["top5"],
                            e["explained"], share, others, c.capture_name in named)
                held = rows.get(c.capture_name)
                if held is None or len(others) > len(held.with_replaced):
                    rows[c.capture_name] = row
        return sorted(rows.values(), key=lambda b: -(b.share if b.share is not None else -1))

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


def _verdict(origins, together, diffuse, spread, spent, budget, ranking, shares, after_layers, noise=None,
             drifts=False, drift=(), within=False, candidates=(), systematic: Systematic | None = None) -> str:
    """The blame verdict; ``noise``: the floor's part of the divergence (None: no floor); ``drifts``: the
    target is below float32; ``drift``: the parts it replaced on its way that precision drift may explain;
    ``within``: the target as a whole is within its floor; ``candidates``: without a floor, the strongest
    components beside a diffuse drift; ``systematic``: one kind at fault in several layers (its origins first)."""
    tail = ""
    if drift:
        scale = ("the floor's part" if noise is not None else
                 "what the strongest component leaves: below float32 without a noise floor they cannot be told from "
                 "precision drift")
        tail = (f" Not named, as they stand no higher than {scale}: "
                + "; ".join(o.describe(noise) for o in drift) + ".")
    if after_layers is not None and after_layers < EXPLAINS and not diffuse and (noise is None or drifts):
        tail += (f" Replacing the stream after the last layer removes {pct(after_layers)}: the rest arises after the "
                "decoder layers (final norm, lm_head).")
    if diffuse:
        return _diffuse_verdict(origins, spread, shares, after_layers, noise, drifts, candidates)
    if spent:
        found = "; ".join(o.describe(noise) for o in origins) or "nothing yet"
        return f"the search stopped at its budget of {budget} passes; found so far: {found}."
    if not origins:
        return ("no layer's residual stream explains a significant part of the divergence (threshold "
                f"{SIGNIFICANT:.0%})." + tail)
    # a systematic kind's layers are one source: the same fault; the others stand by themselves
    rest = [o for o in origins if not (systematic and o.component in systematic.components)]
    sources = len(rest) + (systematic is not None)
    independent = len({o.layer for o in rest}) == len(rest)
    if systematic and not rest:
        count = "1 systematic fault" if systematic.every else f"1 kind at fault in {len(systematic.layers)} layers"
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
    text = f"{count}: " + "; ".join(named)
    if together is not None and (rest or not systematic):
        text += f"; together they explain {pct(together)} of the divergence" if len(origins) > 1 else \
            f"; replacing it removes {pct(together)} of the divergence"
    if len(origins) == 1 and origins[0].component:
        top = next(b for b in ranking if b.component == origins[0].component)
        text += (f" (mean KL {top.kl_off:.3g} -> {top.kl_on:.3g}, {pct(top.explained_kl)} of the KL and "
                 f"{pct(top.explained_top5)} of the top-5 error)")
    if noise is not None:
        text += (f"; precision noise at the floor: {pct(noise)} of the divergence (the reference in the target's "
                 "precision diverges that much by itself)")
    elif together is not None and together < EXPLAINS and not tail and not drifts:
        text += f"; the remaining {pct(1 - together)} arises in no single layer (each adds less than {SIGNIFICANT:.0%})"
    return text + "." + (" " + systematic.advice() if systematic else "") + tail


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


def _g(v) -> str:
    return "-" if v is None else f"{v:.3g}"
