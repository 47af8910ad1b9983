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

import itertools
import math
import time

from ..metrics import EXPLAINS, explained, phase_clue
from ..covers import AFTER_LAYERS
from .drift import DriftAccounting
from .passes import LAYER, BudgetSpent
from .result import MAX_ORIGINS, SIGNIFICANT, Blame, BlameResult, NonFinite, Origin, SharedClass
from .systematic import SystematicKinds
from .verdict import verdict_text


class Search(SystematicKinds, DriftAccounting):
    """The search over a :class:`~fxreplace.blame.passes.Passes` state: localise, attribute, repeat."""

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
            self._find_origins(origins)
            if self.drifts:
                origins = self._without_drift(origins)
            if self.floor is not None and self.drift_of is not None and not origins:
                origins = self._beyond_own_drift()
            origins = self._systematic(origins)
            after_layers = self._after_layers(origins)
            origins = self._shared_class(origins, after_layers)
            origins = self._layers_own_code(origins)
            if within and not origins:
                return self._result([], None, True, False, started, f"within precision noise: the target is "
                                    f"{self.floor.describe(self.off_summary).split(': ', 1)[1]}; no component stands "
                                    "above the floor, so there is nothing to blame beyond the precision itself.")
            diffuse, origins = self._diffuse(origins, after_layers)
            if diffuse:  # where does the drift build up: every stream and kind, for the heat map
                self.measure([[c.capture_name] for c in self.components])
        except BudgetSpent:
            spent = True
        return self._result(origins, None, diffuse, spent, started, None, after_layers)

    def _find_origins(self, origins: list[Origin]) -> None:
        """Localise and attribute origin after origin into ``origins`` (in place: what the budget leaves found stands),
        each kept replaced while the search goes on after it, until they explain the divergence, no later layer adds a
        significant part or more than MAX_ORIGINS places would have to be fixed."""
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
            base = base + self._replaced(found_here)
            if self._explains(base):
                break
            repeated = self._repeated_kind(origins)
            if repeated is not None:  # one kind at fault in two layers: replaced in every layer (one pass), the
                base = self._kind_wide(repeated, origins)  # search goes on beside it
                self.measure(self._kind_round(repeated, origins))
                if self._explains(base):
                    break
            start = (self.stream_layers.index(origin.layer) + 1) % len(self.stream_layers)

    def _after_layers(self, origins: list[Origin]) -> float | None:
        """What the stream after the last layer explains (probed in the first round): the rest arises after the
        layers; None without streams, or for a drifting target when that rest stands no higher than the drift."""
        if not self.stream_layers:
            return None
        after_layers = self.E([self.streams[self.stream_layers[-1]].capture_name])
        if self.drifts and 1 - after_layers < self._least(origins):
            return None  # what arises after the layers stands no higher than the drift
        return after_layers

    def _diffuse(self, origins: list[Origin], after_layers: float | None) -> tuple[bool, list[Origin]]:
        """Whether the divergence is a diffuse drift, and the origins to name (none when a drifting target's
        origins become the candidates beside the drift)."""
        # a systematic kind is one place to fix, however many layers it holds
        places = len(origins) if self.systematic is None else self._places(origins)
        inside, after = self._spread(origins)
        if self.systematic is not None and self.systematic.runs_after:
            after = 0.0  # what arises after the layers, the class runs there too
        if self.floor is not None:  # nothing stands out from the floor, or too many would have to be fixed
            diffuse = (not origins and after_layers is None) or places > MAX_ORIGINS
        elif self.drifts:
            diffuse = (not origins and after_layers is None) or (
                bool(origins) and (places > MAX_ORIGINS or inside + after >= SIGNIFICANT))
            if diffuse:  # precision drift builds up beside them: without a floor, no scale to tell them from it
                self.candidates, origins = origins, []
        else:  # float32 does not drift: what arises after the layers is one more place (the final norm, lm_head)
            places += after >= SIGNIFICANT
            diffuse = bool(origins) and (places > MAX_ORIGINS or inside >= SIGNIFICANT)
        return diffuse, origins

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
        return [Origin(layer, self.E(stream) - e_base, None, None, kinds, outside=self._outside_words(layer))]

    def _member_share(self, base: list[str], combo: list, member) -> float:
        """What ``combo`` (replaced beside ``base``) loses without ``member``."""
        return (self.E(base + [x.capture_name for x in combo])
                - self.E(base + [x.capture_name for x in combo if x is not member]))

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
        origins = sorted(origins, key=lambda o: (0, o.layer) if systematic and systematic.holds(o) else (1, -o.share))
        shares = self._layer_shares()
        chosen = self.key(self._replaced(origins))
        together = self.E(chosen) if chosen in self.cache else None
        # with a floor, explaining all that exceeds it is explaining all there is to explain
        enough = EXPLAINS if self.floor is None else min(EXPLAINS, 1 - self.noise)
        if isinstance(systematic, SharedClass):  # beside what the class does after the layers, where none replaces it
            enough *= systematic.whole
        confident = (not diffuse and not spent and bool(origins) and all(o.component for o in origins)
                     and (together or 0) >= enough)
        floor = None
        if self.floor is not None and hasattr(self, "off_summary"):
            floor = {"dtype": self.floor.dtype, "multiples": self.floor.multiples(self.off_summary),
                     "within": self.floor.within(self.off_summary), "noise_share": self.noise,
                     "floor": self.floor.aggregate(self.indices)}
        if verdict is None:
            verdict = verdict_text(origins, together, diffuse, self._spread(origins or self.candidates), spent, self.budget,
                               ranking, shares, after_layers, self.noise if self.floor is not None else None,
                               self.drifts, self.drift, floor is not None and floor["within"], self.candidates,
                               systematic, self._cover_words(AFTER_LAYERS), self.engine.transformers_code)
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
                           explained=together, floor=floor, candidates=self.candidates, systematic=systematic,
                           repro=self.engine.transformers_code)

    def _ranking(self, origins: list[Origin]) -> list[Blame]:
        """One row per measured component (its most informative pass: the attribution that named it,
        else the pass with the most origins replaced beside it)."""
        off, off_s = self.off, self.off_summary
        named = {o.component for o in origins if o.component}
        chosen = self._replaced(origins + self.drift)
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
                # (the others not measured without it: a class's place that was not left out alone, see SharedClass)
                share = (None if e["explained"] is None or (others and self.key(others) not in self.cache)
                         else e["explained"] - self.E(others, signed=True))
                row = Blame(c.capture_name, c.kind, c.layer, off.mean_kl, on.mean_kl, off.mean_top5_error,
                            on.mean_top5_error, off.top1_agreement, on.top1_agreement, off.first_divergence,
                            on.first_divergence, off.prompts_diverged, on.prompts_diverged, e["kl"], e["top5"],
                            e["explained"], share, others, c.capture_name in named)
                held = rows.get(c.capture_name)
                if held is None or len(others) > len(held.with_replaced):
                    rows[c.capture_name] = row
        return sorted(rows.values(), key=lambda b: -(b.share if b.share is not None else -1))
