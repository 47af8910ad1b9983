"""Drift accounting: what of a drifting target's divergence precision may explain, and where the
part no origin holds arises (the verdict's test for a diffuse drift)."""

from __future__ import annotations

import math

from ..metrics import EXPLAINS
from .passes import LAYER, BudgetSpent, Passes
from .result import SIGNIFICANT, Origin


class DriftAccounting(Passes):
    """The search's measures of precision drift (its passes through :class:`~fxreplace.blame.passes.Passes`)."""

    def _noise_part(self, off: dict) -> float:
        """The floor's part of the divergence: what the reference in the target's precision diverges
        as a fraction of the target's, in the measure where that fraction is larger (the explained
        part is the smaller of two measures removed, so the noise is the larger)."""
        m = self.floor.multiples(off)
        parts = [1 / v for v in (m["kl"], m["top5"]) if v]
        return min(1.0, max(parts)) if parts else 1.0

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
                self.measure([self._replaced(kept)])
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
